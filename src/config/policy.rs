//! The compiled, immutable policy. One `Arc<Policy>` is loaded per request and kept to its end.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::limit::key::Identity;
use crate::limit::LimitRule;
use crate::proxy::header::TrustedProxies;
use crate::proxy::route::RouteTable;
use crate::proxy::upstream::Upstream;
use crate::redis_store::RedisStore;

/// A compiled policy snapshot. Never mutated after it is swapped in.
#[derive(Debug)]
pub struct Policy {
    /// Counts successful loads since start; 1 is the policy levee started with.
    pub generation: u64,
    /// Short hash of the policy files' names and contents.
    pub hash: String,
    pub files: Vec<PathBuf>,
    /// Those of `files` that were empty (a placeholder): emptied later, they lose nothing.
    pub empty_files: Vec<PathBuf>,
    /// Each of `files` with a short hash of its contents: a reload names the files it changed.
    pub file_hashes: Vec<(PathBuf, String)>,
    /// A `stale` route takes cookies the app sets for a visitor's own
    /// (`learn_private_cookies`): the cookies upstream answers set are noted.
    pub learns_app_cookies: bool,
    /// When this generation was put in effect (unix seconds); set by the store.
    pub loaded_at_unix: u64,
    pub server: ServerSettings,
    pub admin: AdminSettings,
    pub upstreams: BTreeMap<String, Arc<Upstream>>,
    pub default_upstream: Option<String>,
    pub routes: RouteTable,
    /// Shared state; `None` runs everything in-process (the embedded default).
    pub redis: Option<Arc<RedisStore>>,
    pub identity: Identity,
    pub limits: BTreeMap<String, Arc<LimitRule>>,
    pub degrade: crate::degrade::DegradeSettings,
    /// Queue settings; `Some` whenever `[redis]` is configured.
    pub queue: Option<crate::queue::QueueSettings>,
    /// What in the policy does nothing (a limit no route uses…): logged at each load, printed
    /// by `levee check`, shown in `/status`.
    pub warnings: Vec<super::Diagnostic>,
    /// Where `[server] listen` and `[admin] listen` are written (`file:line:col`), for the
    /// error when levee cannot listen there; `None` for a default.
    pub listen_written_at: ListenWrittenAt,
}

/// See [`Policy::listen_written_at`].
#[derive(Debug, Default, Clone)]
pub struct ListenWrittenAt {
    pub server: Option<String>,
    pub admin: Option<String>,
}

/// `[redis] key_prefix` when the policy sets none.
pub const DEFAULT_KEY_PREFIX: &str = "levee:";

impl Policy {
    /// Prefix of every Redis key levee writes (`[redis] key_prefix`, default `levee:`).
    pub fn key_prefix(&self) -> &str {
        self.redis.as_ref().map_or(DEFAULT_KEY_PREFIX, |redis| {
            redis.settings.key_prefix.as_str()
        })
    }
}

/// `[server]`, with defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSettings {
    /// Default `127.0.0.1:8080`. Read at start; a change needs a restart.
    pub listen: SocketAddr,
    /// Default loopback only.
    pub trusted_proxies: TrustedProxies,
    /// Time a client has to send its whole request head. Default 10s.
    pub header_read_timeout: Duration,
    /// Total request header bytes accepted (431 above). Default 32 KiB.
    pub max_header_bytes: usize,
    /// Default body limit of routes that set none (413 above). Default 10 MiB.
    pub max_body: u64,
    /// Longest pause inside a request body. Default 30s.
    pub client_body_timeout: Duration,
    /// Longest wait for a client to take response bytes; then the connection closes.
    /// Default 60s.
    pub send_timeout: Duration,
    /// Longest silence both ways on an upgraded (WebSocket) connection; then both sides are
    /// closed. Default 5m.
    pub tunnel_idle_timeout: Duration,
    /// Client connections open at once on the public listener (tunnels included); more wait
    /// in the listen backlog. Default 10000, or what the open-file limit allows when that is
    /// less (see `config::store`).
    pub max_connections: u32,
    /// `max_connections` was set in the policy, not taken as the default.
    pub max_connections_given: bool,
    /// How long `/readyz` says 503 before levee stops accepting. Default 5s.
    pub drain: Duration,
    /// Longest wait for in-flight requests after drain. Default 30s.
    pub shutdown_timeout: Duration,
    /// Default `/livez`.
    pub livez_path: String,
    /// Default `/readyz`.
    pub readyz_path: String,
    /// One log line per request. Default true.
    pub access_log: bool,
    /// Origins (`https://app.example`, lower case, or `*` for any) whose pages may read the
    /// answers levee writes itself: they carry CORS fields, and a preflight levee would refuse
    /// is answered by it. Default none: levee's answers carry no CORS field.
    pub cors_origins: Vec<String>,
    /// The form of levee's own answers on requests no route with its own `answer_format`
    /// takes. Default by `Accept`.
    pub answer_format: AnswerFormat,
}

/// `answer_format`: the form of the answers levee writes itself (a 429, a 503, a 502/504, a
/// 400, the 202 of a queued write). Clients of an API often send no `Accept` (OkHttp) or
/// `*/*` (curl, URLSession), which by `Accept` read HTML pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnswerFormat {
    /// JSON when the client's `Accept` prefers it, else HTML (default).
    #[default]
    ByAccept,
    /// Always JSON.
    Json,
    /// Always HTML.
    Html,
}

impl AnswerFormat {
    /// As the policy writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            AnswerFormat::ByAccept => "by_accept",
            AnswerFormat::Json => "json",
            AnswerFormat::Html => "html",
        }
    }

    /// Whether levee's own answer to a request with these `Accept` fields is JSON: the one
    /// place the format is chosen, for errors, rate-limit refusals and queued writes alike.
    /// `Accept` is read only when the format leaves it to the client.
    pub fn is_json<'a>(self, accept: impl IntoIterator<Item = &'a http::HeaderValue>) -> bool {
        match self {
            AnswerFormat::Json => true,
            AnswerFormat::Html => false,
            AnswerFormat::ByAccept => crate::proxy::prefers_json(accept),
        }
    }
}

impl Default for ServerSettings {
    fn default() -> Self {
        ServerSettings {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            trusted_proxies: TrustedProxies::default(),
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 32 * 1024,
            max_body: 10 * 1024 * 1024,
            client_body_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(60),
            tunnel_idle_timeout: Duration::from_secs(300),
            max_connections: 10_000,
            max_connections_given: false,
            drain: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(30),
            livez_path: "/livez".into(),
            readyz_path: "/readyz".into(),
            access_log: true,
            cors_origins: Vec::new(),
            answer_format: AnswerFormat::ByAccept,
        }
    }
}

/// `[admin]`, with defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct AdminSettings {
    /// Default `127.0.0.1:9901`. Read at start; a change needs a restart.
    pub listen: SocketAddr,
    /// Named bearer tokens; when any is set, every admin request that changes state must
    /// carry one (`Authorization: Bearer …`). Default none (loopback only).
    pub tokens: Vec<(String, String)>,
    /// Other origins (`https://ops.example`, lower case) whose pages may send state-changing
    /// requests: the dashboard behind a proxy. Default none (only the listener's own).
    pub origins: Vec<String>,
}

impl Default for AdminSettings {
    fn default() -> Self {
        AdminSettings {
            listen: SocketAddr::from(([127, 0, 0, 1], 9901)),
            tokens: Vec::new(),
            origins: Vec::new(),
        }
    }
}
