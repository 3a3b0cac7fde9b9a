//! The Redis connection levee shares between rate limits, switches and stale copies, with
//! its health breaker; and the rate-limit decisions on the Redis server clock, behind a short
//! timeout and the health breaker: batched on a single server (`redis_batch`), one Lua script
//! per slot group in a cluster.
//!
//! Redis is advisory on the request path. Every call is bounded by `timeout`; after
//! `failures_to_open` consecutive failures the health breaker opens and requests stop calling
//! Redis for `cooldown`; then a single probe goes through, and Redis is used again as soon
//! as it answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::log_throttle::LogThrottle;
use crate::metrics::{Metrics, RedisNodeLabels};
use crate::proxy::upstream::{ca_certificates, client_tls, system_roots};
use crate::redis_batch::{
    lock, read_answer, reply_numbers, BatchTarget, DecisionBatcher, Endpoint, RedisRule,
};
use crate::redis_cluster::{parse_slots, ClusterHealth, Node};
use crate::redis_sentinel::{MasterAddress, MasterLink, SentinelTarget, Sentinels};
use crate::redis_wait::{Confirmed, WaitingWrites};

/// Shortest bound on a call off the request path: a refund (see `give_back`), a read of a
/// cluster's slot map.
const OFF_PATH_BOUND: Duration = Duration::from_secs(1);

/// The longest any caller waits for one call over the shared connection (a queue write waits
/// at least 500 ms, a switch 1 s, a queue worker 200 ms or more), which bounds the connection's
/// own response timeout. Each caller bounds its calls itself (`guarded_call`, `within`): a
/// response timeout of `[redis] timeout` (25 ms by default, sized for rate-limit checks)
/// cut every call there, so a Redis busy for 40 ms (an expiry cycle) failed queue writes that
/// had half a second to wait and opened the health breaker.
pub(crate) const LONGEST_SHARED_CALL: Duration = Duration::from_secs(2);

/// Shortest bound on a background call (a queue worker's, `/queues`): more patient than a
/// rate-limit check, yet one queue's node out must not hold up the others' replay for long,
/// as the worker serves every queue in turn, several calls each.
const BACKGROUND_CALL_FLOOR: Duration = Duration::from_millis(200);

/// The shared connection's response timeout: a backstop past every caller's own bound.
pub(crate) fn shared_response_timeout(timeout: Duration) -> Duration {
    timeout.max(LONGEST_SHARED_CALL)
}

/// The rate-limit script: GCRA for a batch of requests (see its header).
const SCRIPT: &str = include_str!("limit/script.lua");

/// `[redis]`, compiled. A reload with equal settings keeps the connection.
#[derive(Debug, Clone, PartialEq)]
pub struct RedisSettings {
    pub target: RedisTarget,
    /// Bound on every call. Default 25ms.
    pub timeout: Duration,
    /// Consecutive failures that open the health breaker. Default 3.
    pub failures_to_open: u32,
    /// How long Redis is left alone once the breaker opened. Default 1s.
    pub cooldown: Duration,
    /// Prefix of every key levee writes. Default `levee:`.
    pub key_prefix: String,
    /// levee instances sharing these limits; the `local` fallback admits `rate / instances`.
    /// Default 1.
    pub instances: u32,
    /// Share of a bucket's burst that must be left, by Redis's last answer less levee's own
    /// requests since, for a request to be admitted at once and charged in the background.
    /// 1 turns it off. Default [`DEFAULT_ADMIT_AHEAD_ABOVE`] for one instance, 1 for a fleet
    /// (see the policy compiler).
    pub admit_ahead_above: f64,
    /// `ca_file`, `cert_file` and `key_file`, for a `rediss://` target.
    pub tls: Option<RedisTls>,
}

/// The PEM files of a TLS connection to Redis, read when the policy is compiled: a changed
/// file makes the next reload connect anew.
#[derive(Clone, PartialEq, Default)]
pub struct RedisTls {
    /// CA certificates trusted instead of the system's (`ca_file`).
    pub ca: Option<Vec<u8>>,
    /// Client certificate chain and key (`cert_file`, `key_file`), for a Redis that checks
    /// its clients (`tls-auth-clients`).
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        f.debug_struct("RedisTls")
            .field("ca", &self.ca.is_some())
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

/// The rustls settings of levee's own connection to a `rediss://` server: `ca_file` instead
/// of the system's roots when given (as the general client does), and the client certificate.
pub fn rustls_config(tls: Option<&RedisTls>) -> Result<rustls::ClientConfig, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    match tls.and_then(|tls| tls.ca.as_deref()) {
        Some(ca) => {
            let certs = ca_certificates(ca).map_err(|error| format!("ca_file {error}"))?;
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|error| format!("ca_file: {error}"))?;
            }
        }
        None => {
            roots.add_parsable_certificates(system_roots().iter().cloned());
        }
    }
    let builder = client_tls(roots);
    match tls.and_then(|tls| tls.client.as_ref()) {
        Some((cert, key)) => {
            let chain: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(cert).collect();
            let chain = chain.map_err(|error| format!("cert_file: {error}"))?;
            let key =
                PrivateKeyDer::from_pem_slice(key).map_err(|error| format!("key_file: {error}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|error| format!("cert_file and key_file: {error}"))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

impl RedisTls {
    pub fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        }
    }
}

/// The longest a Redis Cluster call waits before it asks a node again that answered
/// `TRYAGAIN` or `CLUSTERDOWN`, in milliseconds: a quarter of `timeout`, at least 2.
fn cluster_retry_wait_ms(timeout: Duration) -> u64 {
    u64::try_from((timeout / 4).as_millis())
        .unwrap_or(u64::MAX)
        .max(2)
}

/// `[redis] admit_ahead_above` when the policy does not set it (and `instances` is 1 or 2).
pub const DEFAULT_ADMIT_AHEAD_ABOVE: f64 = 0.5;

#[derive(Clone, PartialEq)]
pub enum RedisTarget {
    Single(String),
    Cluster(Vec<String>),
    /// The master of a group that Redis Sentinel watches (`[redis.sentinel]`).
    Sentinel(SentinelTarget),
}

impl RedisTarget {
    /// Whether `other` names the same servers and database: credentials aside, so that a
    /// password rotated by a reload is not taken for a move to other servers.
    pub fn same_servers(&self, other: &RedisTarget) -> bool {
        let shown = |urls: &[String]| urls.iter().map(|url| server_of(url)).collect::<Vec<_>>();
        match (self, other) {
            (RedisTarget::Single(a), RedisTarget::Single(b)) => server_of(a) == server_of(b),
            (RedisTarget::Cluster(a), RedisTarget::Cluster(b)) => shown(a) == shown(b),
            (RedisTarget::Sentinel(a), RedisTarget::Sentinel(b)) => {
                a.master == b.master && a.db == b.db && shown(&a.nodes) == shown(&b.nodes)
            }
            _ => false,
        }
    }
}

/// The server and database a URL names, credentials aside: `redis://h:1` and
/// `redis://:secret@h:1/0` are one (a password added by a reload is no move). A URL the
/// client cannot read is compared as written, password hidden.
fn server_of(url: &str) -> String {
    use redis::IntoConnectionInfo;
    match url.into_connection_info() {
        Ok(info) => format!("{:?} db {}", info.addr(), info.redis_settings().db()),
        Err(_) => redact_url(url),
    }
}

/// Shown with the passwords in URLs hidden, should the settings ever be logged.
impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisTarget::Single(url) => f.debug_tuple("Single").field(&redact_url(url)).finish(),
            RedisTarget::Cluster(nodes) => f
                .debug_tuple("Cluster")
                .field(
                    &nodes
                        .iter()
                        .map(|node| redact_url(node))
                        .collect::<Vec<_>>(),
                )
                .finish(),
            RedisTarget::Sentinel(target) => f.debug_tuple("Sentinel").field(target).finish(),
        }
    }
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Why a Redis call did not give a decision.
#[derive(Debug, thiserror::Error)]
pub enum RedisFailure {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis answered something unexpected: {0}")]
    BadReply(String),
    /// Redis answered a batched call with `OOM`: full under `noeviction`, it refuses writes.
    /// (A command of the client's own keeps Redis's error, and its `OOM` code.)
    #[error("redis is full and refuses writes: {0}")]
    Full(String),
    #[error("redis is marked down; not calling it until the cool-down ends")]
    Down,
    #[error("redis connection failed: {0}")]
    Connection(String),
    #[error("{0} calls are already waiting for redis")]
    Overloaded(usize),
    /// The server is no longer the master (Redis Sentinel named another, or it answered
    /// `READONLY`). Behind Redis Sentinel not counted against Redis's health: the next call
    /// goes to the new master.
    #[error("redis is no longer the master: {0}")]
    MasterMoved(String),
    /// No connection could be made, so nothing was sent (and nothing needs settling).
    #[error("no connection to redis, nothing sent: {0}")]
    NotSent(String),
}

impl RedisFailure {
    /// True for failures a failover would cause: no answer, a broken connection, a server
    /// turned replica. Not for Redis refusing a command for other reasons.
    pub fn may_mean_failover(&self) -> bool {
        match self {
            RedisFailure::Timeout(_)
            | RedisFailure::Connection(_)
            | RedisFailure::NotSent(_)
            | RedisFailure::MasterMoved(_) => true,
            RedisFailure::Redis(error) => {
                error.is_io_error()
                    || error.is_timeout()
                    || error.is_connection_dropped()
                    || error.is_connection_refusal()
                    || error.code() == Some("READONLY")
            }
            RedisFailure::BadReply(_)
            | RedisFailure::Full(_)
            | RedisFailure::Down
            | RedisFailure::Overloaded(_) => false,
        }
    }

    /// Redis answered with a refusal its caller expects and handles: a queue's consumer group
    /// that exists already (`BUSYGROUP`, at every start), or that is gone with its stream
    /// (`NOGROUP`, made again). Redis is up.
    fn is_expected_refusal(&self) -> bool {
        matches!(self, RedisFailure::Redis(error) if matches!(error.code(), Some("BUSYGROUP" | "NOGROUP")))
    }

    /// Redis answered, and refused the command for want of memory (`OOM` under `noeviction`):
    /// it is up, and answers at once. Taken for a Redis down, it opened the health breaker, and
    /// every answered read of the queue's worker let the next call probe at once: the breaker
    /// flapped, and logged both ways, hundreds of times a second (a review measured 1,100
    /// lines/s). Each call so refused fails on its own (a queue write is a 503).
    fn is_answer_of_a_full_redis(&self) -> bool {
        match self {
            RedisFailure::Redis(error) => error.code() == Some("OOM"),
            RedisFailure::Full(_) => true,
            _ => false,
        }
    }

    /// Whether the call went out at all: not when the health breaker held it back or too
    /// many decisions were waiting already.
    fn was_sent(&self) -> bool {
        !matches!(
            self,
            RedisFailure::Down | RedisFailure::Overloaded(_) | RedisFailure::NotSent(_)
        )
    }
}

/// What the latest call to Redis found, whatever made it: rate limits, switches, queues,
/// stale copies. The operator's "is Redis up": the health breaker alone follows rate-limit
/// calls only, so without limited traffic it said "up" for a Redis that refused every
/// switch and queue call, or "down" long after Redis was back.
#[derive(Debug, Default)]
struct Reach {
    /// Why the latest call failed (no answer, or a refusal such as a wrong password);
    /// `None` when it succeeded (or before any). A timeout after a refusal keeps the refusal.
    failure: Option<String>,
    /// `failure` is a timeout's.
    failure_timed_out: bool,
    /// The log said the calls fail, and has not said yet that they answer again.
    outage_logged: bool,
    /// The calls fail, and the log has not said so yet: the line was held back (another
    /// outage was said just before) and is said once the throttle lets it, if the calls still
    /// fail then.
    outage_unsaid: bool,
    /// When a call last failed: an outage is said over once calls have answered for
    /// [`ANSWERING_FOR`] since.
    failed_at: Option<std::time::Instant>,
    /// `failure` is a full Redis's refusal: it answers, so it is up.
    failure_is_full: bool,
    /// The latest refusal of a full Redis (`OOM`), and when. Such a Redis refuses writes and
    /// answers reads, so the latest call's outcome flipped with every call: `/status` said
    /// up and down by turns, and "OOM" came and went from `last_error`.
    refused_full: Option<(String, std::time::Instant)>,
}

/// How long `/status` shows a full Redis's latest refusal.
const FULL_SHOWN_FOR: Duration = Duration::from_secs(60);

/// How long calls answer with none failing before the log says Redis answers again. A Redis
/// that refuses writes (full, or turned replica) still answers reads: said at the first
/// answered read, "answers again" came a few milliseconds after "calls fail", and stood as
/// the last word while every write was refused.
const ANSWERING_FOR: Duration = Duration::from_secs(1);

/// One bucket to decide in Redis.
pub struct RedisAsk<'a> {
    pub key: &'a str,
    pub tag: &'a str,
    pub rule: &'a RedisRule,
}

/// A call on the request path: it follows the health breaker (in a cluster, that of the node
/// holding `key`) and records how it went in `metrics`.
#[derive(Clone, Copy)]
pub struct Guard<'a> {
    /// A key the command touches; every key of one command shares its slot.
    pub key: &'a str,
    pub metrics: &'a Metrics,
}

/// Redis's answer for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteVerdict {
    pub allowed: bool,
    pub remaining: u32,
    pub reset_ms: u64,
    pub retry_after_ms: u64,
}

/// A health breaker: Redis as a whole on a single server, or one master node of a cluster.
#[derive(Debug, Default)]
pub struct Health {
    pub(crate) consecutive_failures: u32,
    open_until: Option<Instant>,
    probing: bool,
}

/// A change of a health breaker's state, to log and count.
enum Change {
    Down { failures: u32 },
    Up,
}

impl Health {
    /// True while the breaker is closed.
    fn is_closed(&self) -> bool {
        self.open_until.is_none()
    }

    /// Whether a guarded call would be let through now, and as what: `Some(false)` while the
    /// breaker is closed, `Some(true)` as its probe once the cool-down is over and no probe
    /// is out, `None` otherwise.
    fn leave(&self) -> Option<bool> {
        match self.open_until {
            None => Some(false),
            Some(until) if Instant::now() < until || self.probing => None,
            Some(_) => Some(true),
        }
    }

    /// Leave to call: `None` while the breaker is open and cooling down, or while another
    /// request is its probe.
    fn permit(health: &Mutex<Health>) -> Option<Permit<'_>> {
        let mut state = lock(health);
        let probe = state.leave()?;
        state.probing |= probe;
        Some(Permit {
            health,
            probe,
            generation: 0,
        })
    }

    /// An open breaker lets the next call through as its probe, now.
    fn probe_now(&mut self) {
        if self.open_until.is_some() {
            self.open_until = Some(Instant::now());
        }
    }

    /// Records how a call went; opens the breaker at `failures_to_open` failures in a row
    /// (and again at each failed probe), closes it at the first success.
    fn record(&mut self, ok: bool, settings: &RedisSettings) -> Option<Change> {
        if ok {
            self.consecutive_failures = 0;
            return self.open_until.take().map(|_| Change::Up);
        }
        self.consecutive_failures += 1;
        let was_open = self.open_until.is_some();
        if was_open || self.consecutive_failures >= settings.failures_to_open {
            self.open_until = Some(Instant::now() + settings.cooldown);
            if !was_open {
                return Some(Change::Down {
                    failures: self.consecutive_failures,
                });
            }
        }
        None
    }
}

/// Leave to call Redis on the request path. A probe's permit ends the probe when it is
/// dropped, recorded or not: a request that goes away in the middle of its probe (the client
/// left) hands the probe on, instead of leaving the health breaker waiting for it forever.
struct Permit<'a> {
    health: &'a Mutex<Health>,
    probe: bool,
    /// With Redis Sentinel, the sentinels' generation when the call started (0 otherwise).
    generation: u64,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe {
            lock(self.health).probing = false;
        }
    }
}

pub struct RedisStore {
    pub settings: RedisSettings,
    connection: OnceCell<Connection>,
    /// Queue writes that wait for replicas, with their own connection to a single server
    /// (with Sentinel, `master_link` keeps it).
    waiting_writes: WaitingWrites,
    /// With a Redis Cluster, those writes per master node (by its address).
    waiting_writes_by_node: Mutex<HashMap<Arc<str>, Arc<WaitingWrites>>>,
    /// The queue's write records that later writes to this Redis may remove.
    pub(crate) answered_records: crate::queue::AnsweredRecords,
    health: Mutex<Health>,
    script: Arc<KeyedScript>,
    refund: Arc<KeyedScript>,
    /// Rate-limit decisions on a single server, batched (`redis_batch`). `None` for a
    /// cluster, whose decisions go one call per slot group through redis-rs.
    batcher: Option<DecisionBatcher>,
    /// A cluster's slot map and per-node health, which rate-limit decisions follow instead
    /// of `health`. `None` for a single server.
    cluster: Option<Arc<ClusterHealth>>,
    /// With Redis Sentinel, the shared connection, to whichever server the sentinels name
    /// master (instead of `connection`).
    master_link: Option<MasterLink>,
    /// The latest rate-limit decision was refused by a full Redis (see
    /// [`Self::rate_limit_source`]).
    decisions_refused_full: AtomicBool,
    /// The sentinels' generation `health` last saw (see [`Self::health`]).
    health_generation: AtomicU64,
    /// Redis's `maxmemory-policy` as last read, and when (see [`Self::read_eviction_policy`]).
    eviction_policy: Mutex<Option<(String, tokio::time::Instant)>>,
    reach: Mutex<Reach>,
    /// Bounds the "redis calls fail" lines of a Redis that fails and answers by turns.
    failing_log: LogThrottle,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("settings", &self.settings)
            .finish()
    }
}

impl RedisStore {
    pub fn new(settings: RedisSettings) -> RedisStore {
        let sentinels = match &settings.target {
            RedisTarget::Sentinel(target) => Some(Arc::new(Sentinels::new(
                target.clone(),
                settings.tls.clone(),
            ))),
            _ => None,
        };
        let batch_target = match &settings.target {
            RedisTarget::Single(url) => {
                Endpoint::from_url(url, settings.tls.as_ref()).map(BatchTarget::Fixed)
            }
            RedisTarget::Cluster(_) => None,
            RedisTarget::Sentinel(_) => sentinels.clone().map(BatchTarget::Sentinel),
        };
        let batcher = batch_target.map(|target| {
            // The worker's own bound on a call: at least the caller's timeout, and long
            // enough for a connection to be made even with a tight timeout.
            let call_bound = settings.timeout.max(Duration::from_millis(200));
            DecisionBatcher::new(target, SCRIPT, call_bound, settings.admit_ahead_above)
        });
        let cluster = matches!(settings.target, RedisTarget::Cluster(_))
            .then(|| Arc::new(ClusterHealth::default()));
        RedisStore {
            batcher,
            cluster,
            master_link: sentinels.map(MasterLink::new),
            health_generation: AtomicU64::new(0),
            decisions_refused_full: AtomicBool::new(false),
            settings,
            connection: OnceCell::new(),
            waiting_writes: WaitingWrites::default(),
            waiting_writes_by_node: Mutex::new(HashMap::new()),
            answered_records: crate::queue::AnsweredRecords::default(),
            health: Mutex::new(Health::default()),
            eviction_policy: Mutex::new(None),
            reach: Mutex::new(Reach::default()),
            failing_log: LogThrottle::new(Duration::from_secs(10)),
            script: Arc::new(KeyedScript::new(SCRIPT)),
            refund: Arc::new(KeyedScript::new(include_str!("limit/refund.lua"))),
        }
    }

    /// True when Redis is a cluster: keys in different slots never share a call.
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// True while Redis answers: its latest call of any kind succeeded or was refused by a
    /// full Redis (see [`Reach`]); in a cluster, while no master node's health breaker is
    /// open either.
    pub fn is_up(&self) -> bool {
        let answers = {
            let reach = lock(&self.reach);
            reach.failure.is_none() || reach.failure_is_full
        };
        answers
            && self
                .cluster_nodes()
                .iter()
                .all(|(_, node_is_up)| *node_is_up)
    }

    /// Whether calls on `key` are worth making from the background: Redis answers (see
    /// [`Self::is_up`]), or in a cluster, the node holding `key` has its breaker closed. One
    /// node out silenced every instance's fleet line, though its own node answered.
    pub fn answers_for(&self, key: &str) -> bool {
        match &self.cluster {
            Some(cluster) => lock(&cluster.node_for(key).health).is_closed(),
            None => self.is_up(),
        }
    }

    /// A cluster's slot map is read again (at most once a second) while a node's breaker is
    /// open, traffic or not: calls on the node's slots go nowhere, so without them nothing
    /// learnt that a replica had taken the slots over, and `/status` named the dead node
    /// down for good. Called by the switch sync.
    pub fn follow_cluster(&self, metrics: &Metrics) {
        let Some(cluster) = &self.cluster else {
            return;
        };
        if cluster
            .nodes()
            .iter()
            .any(|node| !lock(&node.health).is_closed())
        {
            self.read_slot_map_when_due(cluster, true, metrics);
        }
    }

    /// Why the latest call failed, while that is so; a full Redis's refusal is told by
    /// [`Self::full_refusal`] instead.
    pub fn last_error(&self) -> Option<String> {
        let reach = lock(&self.reach);
        reach.failure.clone().filter(|_| !reach.failure_is_full)
    }

    /// The latest refusal of a full Redis, and how long ago, for a minute after it.
    pub fn full_refusal(&self) -> Option<(String, Duration)> {
        let reach = lock(&self.reach);
        let (error, at) = reach.refused_full.as_ref()?;
        let ago = at.elapsed();
        (ago < FULL_SHOWN_FOR).then(|| (error.clone(), ago))
    }

    /// A call's failure as the operator should read it: a timeout that follows a refusal
    /// (the connection retries a refused connect until the caller gives up) names the
    /// refusal too, as `last_error` does.
    pub fn explain(&self, failure: &RedisFailure) -> String {
        let reach = lock(&self.reach);
        match (failure, &reach.failure) {
            (RedisFailure::Timeout(_), Some(refusal)) if !reach.failure_timed_out => {
                format!("{failure} (last error: {refusal})")
            }
            _ => failure.to_string(),
        }
    }

    /// True while rate-limit decisions go to Redis: its health breaker is closed.
    pub fn decides_rate_limits(&self) -> bool {
        lock(&self.health).is_closed()
    }

    /// Notes whether the latest rate-limit decision was refused by a full Redis.
    fn note_decision<T>(&self, result: &Result<T, RedisFailure>) {
        let refused = matches!(result, Err(failure) if failure.is_answer_of_a_full_redis());
        // Read first: the flag is written only when it changes, not once per decision.
        if self.decisions_refused_full.load(Ordering::Relaxed) != refused {
            self.decisions_refused_full
                .store(refused, Ordering::Relaxed);
        }
    }

    /// Where rate-limit decisions go, for the operator: "redis", "fallback", in a cluster
    /// with some of its nodes' breakers open (or slots not mapped yet) "partly fallback", or
    /// "fallback (redis is full)" while Redis refuses them for want of memory.
    /// A cluster's decisions follow its nodes' breakers, never the single-server one, which
    /// said "redis" whatever the nodes did.
    pub fn rate_limit_source(&self) -> &'static str {
        let nodes = self.cluster_nodes();
        let up = nodes.iter().filter(|(_, up)| *up).count();
        let source = if nodes.is_empty() {
            if self.decides_rate_limits() {
                "redis"
            } else {
                "fallback"
            }
        } else if up == nodes.len() {
            "redis"
        } else if up == 0 {
            "fallback"
        } else {
            "partly fallback"
        };
        // A full Redis answers (its breakers stay closed) and refuses each decision, which
        // is then made in-process.
        if source == "redis" && self.decisions_refused_full.load(Ordering::Relaxed) {
            return "fallback (redis is full)";
        }
        source
    }

    /// Notes what a call found (`failure`: `None` when it answered). A background call that
    /// got an answer while the health breaker is open lets the next rate-limit call probe at
    /// once: Redis is back, and limits need not stay on their fallbacks for the rest of the
    /// cool-down, nor, without limited traffic, until one comes.
    fn note_call(&self, failure: Option<&RedisFailure>) {
        if failure.is_some_and(|failure| !failure.was_sent()) {
            return;
        }
        // An expected refusal is an answer: without this, every start of a levee whose queue
        // group existed logged "redis calls fail".
        let failure = failure.filter(|failure| !failure.is_expected_refusal());
        // Said once per outage, whatever call meets it first: on a site whose limited
        // routes are quiet, the switch sync and the queue workers fail unseen otherwise.
        // A Redis flapping call by call says it at most once per interval; its end is said
        // only of an outage that was.
        {
            let mut reach = lock(&self.reach);
            // A timeout says less than the refusal it follows: a wrong password or an untrusted
            // certificate makes the connection retry its handshake until the caller gives up,
            // and the operator read "did not answer within 500ms" in place of WRONGPASS.
            let said = match failure {
                Some(RedisFailure::Timeout(_))
                    if reach.failure.is_some() && !reach.failure_timed_out =>
                {
                    reach.failure.clone()
                }
                _ => {
                    reach.failure_timed_out = matches!(failure, Some(RedisFailure::Timeout(_)));
                    failure.map(ToString::to_string)
                }
            };
            let was_failing = std::mem::replace(&mut reach.failure, said).is_some();
            let now = std::time::Instant::now();
            reach.failure_is_full = failure.is_some_and(RedisFailure::is_answer_of_a_full_redis);
            if let Some(full) = failure.filter(|failure| failure.is_answer_of_a_full_redis()) {
                reach.refused_full = Some((full.to_string(), now));
            }
            if failure.is_some() {
                reach.failed_at = Some(now);
            }
            match failure {
                // A new outage, or one whose line was held back and may be said now: an
                // outage that began just after another was said is still said, once the
                // interval is over, rather than never.
                Some(error)
                    if !was_failing || (reach.outage_unsaid && self.failing_log.is_due(now)) =>
                {
                    if let Some(held_back) = self.failing_log.allow(now) {
                        reach.outage_logged = true;
                        reach.outage_unsaid = false;
                        tracing::warn!(held_back, "redis calls fail: {error}; switches are not synced, queue routes answer 503 and replays wait, stale copies are not shared, until it answers");
                    } else {
                        reach.outage_unsaid = true;
                    }
                }
                Some(_) => {}
                None => {
                    reach.outage_unsaid = false;
                    let answering_since_long_enough = reach
                        .failed_at
                        .is_none_or(|at| now.saturating_duration_since(at) >= ANSWERING_FOR);
                    if reach.outage_logged && answering_since_long_enough {
                        reach.outage_logged = false;
                        tracing::info!("redis calls answer again");
                    }
                }
            }
        }
        if failure.is_none() {
            lock(self.health()).probe_now();
        }
    }

    /// Reads Redis's `maxmemory-policy` (`None` until Redis answered), again once `every`
    /// has passed (an operator's `CONFIG SET` is seen without a restart), and warns when it lets Redis
    /// evict keys that have no expiry: queued jobs, which levee answered 202 for, and the
    /// operators' switches. Said when first read and when it changes, not on every read.
    pub async fn read_eviction_policy(&self, every: Duration) {
        // Not while Redis fails: asked every sync, its failures would only add to an
        // outage's, and one ending after Redis answered again read as a new outage.
        if !self.is_up() {
            return;
        }
        let previous = lock(&self.eviction_policy).clone();
        if previous
            .as_ref()
            .is_some_and(|(_, read_at)| read_at.elapsed() < every)
        {
            return;
        }
        let mut info = redis::cmd("INFO");
        info.arg("memory");
        // One server answers with its text; a cluster client asks every node and answers
        // with a map of node to text (read as one text, that was a failed call every pass: a
        // false "redis calls fail" and no check at all).
        let answer: redis::Value = match self
            .command(
                &info,
                self.settings.timeout.max(Duration::from_millis(500)),
                None,
            )
            .await
        {
            Ok(answer) => answer,
            Err(error) => {
                tracing::debug!("redis memory settings not read: {error}");
                // The last policy read stays shown (and is asked again next time).
                return;
            }
        };
        let policy = eviction_policy_of(&answer);
        let before = previous.map(|(policy, _)| policy);
        if before.as_deref() != Some(policy.as_str()) {
            if policy.starts_with("allkeys-") {
                tracing::warn!(
                    maxmemory_policy = %policy,
                    "redis evicts any key when it fills up: queued jobs (already answered 202) and the operators' switches may be dropped; set maxmemory-policy noeviction (or volatile-lru)"
                );
            } else if let Some(before) = &before {
                tracing::info!(maxmemory_policy = %policy, before = %before, "redis's maxmemory-policy changed");
            }
        }
        *lock(&self.eviction_policy) = Some((policy, tokio::time::Instant::now()));
        if before.is_none() {
            self.warn_if_nothing_is_kept_on_disk().await;
        }
    }

    /// Warns when Redis keeps nothing on disk (no append-only file, no `save` points): a
    /// restart of it loses every queued job levee answered 202 for, and the switches. Asked
    /// once, with the eviction policy; a Redis that refuses `CONFIG` (a managed one) is left
    /// unsaid, as is a cluster (its nodes may differ).
    async fn warn_if_nothing_is_kept_on_disk(&self) {
        if self.is_cluster() {
            return;
        }
        let timeout = self.settings.timeout.max(Duration::from_millis(500));
        let mut info = redis::cmd("INFO");
        info.arg("persistence");
        let Ok(answer) = self.command::<redis::Value>(&info, timeout, None).await else {
            return;
        };
        if info_field(&answer, "aof_enabled")
            .first()
            .map(String::as_str)
            != Some("0")
        {
            return;
        }
        let mut config = redis::cmd("CONFIG");
        config.arg("GET").arg("save");
        let Ok(save) = self.command::<Vec<String>>(&config, timeout, None).await else {
            return;
        };
        if save.get(1).is_some_and(|points| points.trim().is_empty()) {
            let redis = match &self.settings.target {
                RedisTarget::Single(url) => redact_url(url),
                other => format!("{other:?}"),
            };
            tracing::warn!(
                %redis,
                "redis keeps nothing on disk (appendonly no, no save points): if it restarts, every queued job (already answered 202) and every switch is lost; set appendonly yes (appendfsync everysec)"
            );
        }
    }

    /// Redis's `maxmemory-policy` as last read (see [`Self::read_eviction_policy`]).
    pub fn eviction_policy(&self) -> Option<String> {
        lock(&self.eviction_policy)
            .as_ref()
            .map(|(policy, _)| policy.clone())
    }

    /// Whether a guarded call on `key` is worth making now, and as what (see
    /// [`Health::leave`]): the health breaker of Redis (in a cluster, of the node holding
    /// `key`) is closed (`Some(false)`), or its cool-down is over and the call may be its probe
    /// (`Some(true)`). `None` while Redis is known to be down: a queue write is answered
    /// before its body is read, and a stale copy stays in memory, instead of each waiting out
    /// its timeout. After the cool-down such a call probes as a rate-limited request does, so
    /// a site without rate limits finds Redis back too.
    pub fn leave_for(&self, key: &str) -> Option<bool> {
        match &self.cluster {
            Some(cluster) => lock(&cluster.node_for(key).health).leave(),
            None => lock(self.health()).leave(),
        }
    }

    /// A cluster's master nodes as its slot map last listed them, and whether each is used
    /// for the rate-limit buckets, queue streams and stale copies it holds. Empty for a
    /// single server.
    pub fn cluster_nodes(&self) -> Vec<(String, bool)> {
        let Some(cluster) = &self.cluster else {
            return Vec::new();
        };
        cluster
            .nodes()
            .iter()
            .map(|node| (node.address.to_string(), lock(&node.health).is_closed()))
            .collect()
    }

    /// Starts from what `previous`, which a reload replaces, knew of the same servers: with
    /// Redis Sentinel, the master it follows (see [`Sentinels::start_from`]); and for the same
    /// target, its health breaker. A reload that changed only a timeout while Redis was down
    /// would otherwise make requests wait on it again until `failures_to_open` more failures.
    /// A changed target (a standby) starts afresh. (A cluster's per-node breakers start
    /// afresh too: its slot map is read anew.)
    pub fn start_from(&self, previous: &RedisStore) {
        if let (Some(link), Some(before)) = (&self.master_link, &previous.master_link) {
            link.sentinels.start_from(&before.sentinels);
        }
        if self.settings.target == previous.settings.target {
            {
                let before = lock(&previous.health);
                let mut health = lock(&self.health);
                health.consecutive_failures = before.consecutive_failures;
                health.open_until = before.open_until;
            }
            let before = lock(&previous.reach);
            let mut reach = lock(&self.reach);
            reach.failure = before.failure.clone();
            reach.failure_timed_out = before.failure_timed_out;
            // What the log said of the outage goes on too: its end is said, or its start
            // when that was held back.
            reach.outage_logged = before.outage_logged;
            reach.outage_unsaid = before.outage_unsaid;
        } else {
            // Another server (or the same with another password) starts with its own health,
            // but the log's last word on Redis was that calls fail: the new one's first
            // answers say they answer again, or a reload that fixed a wrong password left
            // "redis calls fail" standing as the last word.
            let said = lock(&previous.reach).outage_logged;
            lock(&self.reach).outage_logged = said;
        }
    }

    /// With Redis Sentinel, the master it named last (`None` before it was asked, and
    /// otherwise).
    pub fn sentinel_master(&self) -> Option<MasterAddress> {
        self.master_link.as_ref()?.sentinels.last_named()
    }

    async fn connect(&self) -> Result<Connection, RedisFailure> {
        let timeout = self.settings.timeout;
        if let Some(link) = &self.master_link {
            return Ok(Connection::Single(link.connection(timeout).await?));
        }
        let connection = self
            .connection
            .get_or_try_init(|| async {
                match &self.settings.target {
                    RedisTarget::Single(url) => {
                        let client = client_for(url.as_str(), self.settings.tls.as_ref())?;
                        let manager = connection_manager(
                            client,
                            timeout,
                            Some(shared_response_timeout(timeout)),
                        )
                        .await?;
                        Ok::<_, RedisFailure>(Connection::Single(manager))
                    }
                    RedisTarget::Cluster(nodes) => {
                        let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                            .connection_timeout(timeout.max(Duration::from_millis(200)))
                            .response_timeout(shared_response_timeout(timeout))
                            .retries(1)
                            // A node answering `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN` or
                            // `LOADING` (a slot moving, a failover under way) is asked again
                            // after a wait, by default 1.28 s at least: far past `timeout`,
                            // so such a call always timed out, a slot move that settles in
                            // milliseconds failed the request, and the operator read "did not
                            // answer" instead of Redis's own reason. The one retry comes
                            // within a quarter of `timeout` instead; a second such answer is
                            // the call's failure, with that reason.
                            .min_retry_wait(cluster_retry_wait_ms(timeout) / 2)
                            .max_retry_wait(cluster_retry_wait_ms(timeout));
                        if let Some(tls) = &self.settings.tls {
                            builder = builder.certs(tls.certificates());
                        }
                        let client = builder.build()?;
                        Ok(Connection::Cluster(client.get_async_connection().await?))
                    }
                    RedisTarget::Sentinel(_) => Err(RedisFailure::Connection(
                        "a sentinel target connects through its master link".into(),
                    )),
                }
            })
            .await?;
        Ok(connection.clone())
    }

    fn permit(&self) -> Option<Permit<'_>> {
        let mut permit = Health::permit(self.health())?;
        permit.generation = self.sentinel_generation();
        Some(permit)
    }

    /// The sentinels' generation (see [`Sentinels::generation`]); 0 without Sentinel.
    fn sentinel_generation(&self) -> u64 {
        self.master_link
            .as_ref()
            .map_or(0, |link| link.sentinels.generation())
    }

    /// The health breaker of Redis as a whole. With Redis Sentinel, a breaker that a master's
    /// failure opened lets the next call probe as soon as the sentinels name another master,
    /// instead of waiting out `cooldown` (as a promoted replica in a cluster is a new node).
    fn health(&self) -> &Mutex<Health> {
        if let Some(link) = &self.master_link {
            let named = link.sentinels.generation();
            if self.health_generation.swap(named, Ordering::AcqRel) != named {
                lock(&self.health).probe_now();
            }
        }
        &self.health
    }

    /// Records how a call went: `failure` is why it failed, `None` when it answered. A call
    /// cut short because the master moved says nothing of Redis's health, when the sentinels
    /// name the next one.
    fn record(&self, permit: Permit<'_>, failure: Option<&RedisFailure>, metrics: &Metrics) {
        self.note_call(failure);
        // A call that failed after the sentinels named another master failed at the old one.
        let moved_since = permit.generation != self.sentinel_generation();
        drop(permit);
        // A fixed `url` answering `READONLY` (a replica, or a demoted master a name still
        // points at) stays so until someone changes it: it fails as any other failure does,
        // or every call would reconnect and fall back for as long as it lasts.
        if let (Some(RedisFailure::MasterMoved(_)), Some(_)) = (failure, &self.master_link) {
            return;
        }
        if failure.is_some() && moved_since {
            return;
        }
        let answered = failure.is_none_or(RedisFailure::is_answer_of_a_full_redis);
        let change = lock(&self.health).record(answered, &self.settings);
        let to = match change {
            None => return,
            Some(Change::Up) => {
                tracing::info!("redis answers again: rate limits are shared through redis");
                metrics.redis_up.set(i64::from(self.is_up()));
                "up"
            }
            Some(Change::Down { failures }) => {
                tracing::warn!(
                    failures,
                    cooldown = ?self.settings.cooldown,
                    last_error = %failure.map(ToString::to_string).unwrap_or_default(),
                    "redis is failing: rate limits use each rule's on_redis_error fallback"
                );
                metrics.redis_up.set(i64::from(self.is_up()));
                "down"
            }
        };
        metrics
            .redis_transitions
            .get_or_create(&crate::metrics::RedisStateLabels { to })
            .inc();
    }

    /// Records how the calls to a cluster node went, like [`Self::record`] for its own
    /// breaker.
    /// `failure`: why the calls to the node failed, `None` when they all answered.
    fn record_node(
        &self,
        node: &Node,
        permit: Permit<'_>,
        failure: Option<&RedisFailure>,
        metrics: &Metrics,
    ) {
        drop(permit);
        self.note_call(failure);
        let change = lock(&node.health).record(failure.is_none(), &self.settings);
        let up = match change {
            None => return,
            Some(Change::Up) => {
                tracing::info!(
                    node = %node.address,
                    "redis cluster node answers again: the rate-limit buckets, queue streams and stale copies it holds are used again"
                );
                1
            }
            Some(Change::Down { failures }) => {
                tracing::warn!(
                    node = %node.address,
                    failures,
                    cooldown = ?self.settings.cooldown,
                    last_error = %failure.map(ToString::to_string).unwrap_or_default(),
                    "redis cluster node is failing: rules whose buckets it holds use their on_redis_error fallback, queue routes whose streams it holds answer 503"
                );
                0
            }
        };
        metrics
            .redis_node_up
            .get_or_create(&crate::redis_cluster::labels(node))
            .set(up);
    }

    /// Bound on a background call: the larger of `timeout` and 200 ms, at most
    /// [`LONGEST_SHARED_CALL`].
    pub fn background_bound(&self) -> Duration {
        self.settings
            .timeout
            .max(BACKGROUND_CALL_FLOOR)
            .min(LONGEST_SHARED_CALL)
    }

    /// Runs one command. On the request path (`guarded`), it goes through the health breaker
    /// like rate-limit calls (no waiting on a Redis known to be down): in a cluster, that of
    /// the node holding the guard's key, so one node out stops only the calls it would
    /// serve. Operator and background calls (`guarded = None`) always try, bounded by
    /// `timeout`.
    pub async fn command<T: redis::FromRedisValue>(
        &self,
        command: &redis::Cmd,
        timeout: Duration,
        guarded: Option<Guard<'_>>,
    ) -> Result<T, RedisFailure> {
        let call = async {
            let connection = self.connect().await?;
            Ok::<T, RedisFailure>(query(&connection, command).await?)
        };
        self.guarded_call(timeout, guarded, call).await
    }

    /// Runs a write over the connection of writes that wait for replicas (see `redis_wait`),
    /// guarded like [`Self::command`]: Redis's answer, and how many replicas had the write
    /// (at most `replicas`) when `WAIT` returned, within `wait`. `timeout` bounds the whole,
    /// waiting for replicas included. In a cluster the write goes to the master node holding
    /// the guard's key, over a connection of its own to that node: redis-rs would send `WAIT`
    /// to every master, over connections that made no write.
    pub async fn command_confirmed(
        &self,
        command: redis::Cmd,
        replicas: u32,
        wait: Duration,
        timeout: Duration,
        guard: Guard<'_>,
    ) -> Result<Confirmed, RedisFailure> {
        let node = match &self.cluster {
            Some(cluster) => {
                self.read_first_slot_map(cluster, timeout, guard.metrics)
                    .await;
                let address = cluster.node_for(guard.key).address;
                if *address == *crate::redis_cluster::UNMAPPED {
                    return Err(RedisFailure::NotSent(
                        "which cluster node holds the queue is not known yet (the slot map was not read)"
                            .into(),
                    ));
                }
                Some((address, cluster))
            }
            None => None,
        };
        let node_writes = node.as_ref().map(|(address, cluster)| {
            let mut by_node = lock(&self.waiting_writes_by_node);
            if !by_node.contains_key(address) {
                // Masters gone from the slot map take their connections with them.
                let masters = cluster.nodes();
                by_node.retain(|known, _| masters.iter().any(|node| node.address == *known));
            }
            by_node.entry(address.clone()).or_default().clone()
        });
        let node = node.map(|(address, _)| address);
        let writes = node_writes.as_deref().unwrap_or(&self.waiting_writes);
        let connect = || async {
            match &self.master_link {
                Some(link) => link.waiting_writes_connection(self.settings.timeout).await,
                None => {
                    let client = || self.waiting_writes_client(node.as_deref());
                    writes.fixed_connection(client, self.settings.timeout).await
                }
            }
        };
        let call = writes.write(command, replicas, wait, timeout, connect);
        self.guarded_call(timeout, Some(guard), call).await
    }

    /// A client for the server writes that wait for replicas go to: the single server, or the
    /// cluster node at `node` (`host:port`, as the slot map names it), logged in as the
    /// policy's first cluster URL says.
    fn waiting_writes_client(&self, node: Option<&str>) -> Result<redis::Client, RedisFailure> {
        let tls = self.settings.tls.as_ref();
        let urls = match (&self.settings.target, node) {
            (RedisTarget::Single(url), _) => return Ok(client_for(url.as_str(), tls)?),
            (RedisTarget::Cluster(urls), Some(_)) => urls,
            _ => {
                return Err(RedisFailure::Connection(
                    "a sentinel target connects through its master link".into(),
                ))
            }
        };
        let node = node.unwrap_or_default();
        let unusable = |why: &str| RedisFailure::NotSent(format!("cluster node {node}: {why}"));
        let (host, port) = node
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host.to_string(), port.parse::<u16>().ok()?)))
            .ok_or_else(|| unusable("not a host:port address"))?;
        let first = urls.first().ok_or_else(|| unusable("no cluster URL"))?;
        let info = redis::IntoConnectionInfo::into_connection_info(first.as_str())?;
        let address = match info.addr() {
            redis::ConnectionAddr::Tcp(..) => redis::ConnectionAddr::Tcp(host, port),
            redis::ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => redis::ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => return Err(unusable("the first cluster URL is not a TCP address")),
        };
        Ok(client_for(info.set_addr(address), tls)?)
    }

    /// Runs `call` within `timeout`, through the health breaker when `guarded` (see
    /// [`Self::command`]), and records how it went.
    async fn guarded_call<T>(
        &self,
        timeout: Duration,
        guarded: Option<Guard<'_>>,
        call: impl std::future::Future<Output = Result<T, RedisFailure>>,
    ) -> Result<T, RedisFailure> {
        let node = match (&self.cluster, &guarded) {
            (Some(cluster), Some(guard)) => {
                self.read_first_slot_map(cluster, timeout, guard.metrics)
                    .await;
                Some((cluster, cluster.node_for(guard.key)))
            }
            _ => None,
        };
        let health = node
            .as_ref()
            .map_or_else(|| self.health(), |(_, node)| &*node.health);
        let permit = match &guarded {
            Some(guard) => match Health::permit(health) {
                Some(mut permit) => {
                    permit.generation = self.sentinel_generation();
                    Some(permit)
                }
                None => {
                    if let Some((cluster, _)) = &node {
                        // As for rate limits: a replica may have taken over the node's slots.
                        self.read_slot_map_when_due(cluster, true, guard.metrics);
                    }
                    return Err(RedisFailure::Down);
                }
            },
            None => None,
        };
        let result = match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_elapsed) => Err(RedisFailure::Timeout(timeout)),
        };
        if let (Err(error), Some(link)) = (&result, &self.master_link) {
            if error.may_mean_failover() {
                link.sentinels.check_soon();
            }
        }
        match (permit, guarded) {
            (Some(permit), Some(guard)) => {
                let failure = result.as_ref().err();
                match &node {
                    Some((cluster, node)) => {
                        self.record_node(node, permit, failure, guard.metrics);
                        self.read_slot_map_when_due(cluster, failure.is_some(), guard.metrics);
                    }
                    None => self.record(permit, failure, guard.metrics),
                }
            }
            _ => self.note_call(result.as_ref().err()),
        }
        result
    }

    /// A deadline on Redis's own clock (µs) for a write that must not run once levee has given
    /// up on it: a plain write that times out is not cancelled, and a Redis that was only
    /// frozen or slow runs it later, after the caller was told it did not happen. Reads
    /// Redis's `TIME` (through the node holding `key`) and leaves half of what remains of
    /// `timeout` for the write's answer to travel back. Also returns that remaining time,
    /// the write's own timeout.
    pub async fn write_deadline(
        &self,
        key: &str,
        timeout: Duration,
        guarded: Option<Guard<'_>>,
    ) -> Result<(u64, Duration), RedisFailure> {
        let started = tokio::time::Instant::now();
        let mut clock = redis::cmd("EVAL");
        clock.arg("return redis.call('TIME')").arg(1).arg(key);
        let (seconds, micros): (u64, u64) = self.command(&clock, timeout, guarded).await?;
        let remaining = timeout.saturating_sub(started.elapsed());
        let deadline_us = seconds
            .saturating_mul(1_000_000)
            .saturating_add(micros)
            .saturating_add(u64::try_from((remaining / 2).as_micros()).unwrap_or(u64::MAX));
        Ok((deadline_us, remaining))
    }

    /// Admits every ask at once when Redis's last answers left each bucket more than
    /// `admit_ahead_above` of its burst; the decision still goes to Redis, in the next batch,
    /// and its answer updates what levee knows. `None`: decide with [`Self::decide_all`].
    /// Never while the health breaker is open, nor for a cluster.
    pub fn admit_ahead(
        &self,
        asks: &[RedisAsk<'_>],
        metrics: &Metrics,
        now: Instant,
    ) -> Option<crate::redis_batch::AheadVerdicts> {
        let batcher = self.batcher.as_ref()?;
        // The health breaker's word (not `is_up`, which a background call's failure also
        // moves): decisions are admitted ahead only while Redis decides them.
        if !self.decides_rate_limits() {
            return None;
        }
        batcher.admit_ahead(asks, &metrics.ratelimit_ahead_overruns, now)
    }

    /// Decides every ask. In a cluster, asks are grouped by hash tag (one slot each) and the
    /// groups run concurrently; a request that is not admitted whole consumes nothing: when
    /// a group refuses, fails or overruns the timeout, the groups that admitted are refunded.
    pub async fn decide_all(
        &self,
        asks: &[RedisAsk<'_>],
        metrics: &Metrics,
    ) -> Result<Vec<RemoteVerdict>, RedisFailure> {
        if let Some(cluster) = &self.cluster {
            return self.decide_in_cluster(cluster, asks, metrics).await;
        }
        let permit = self.permit().ok_or(RedisFailure::Down)?;
        let started = Instant::now();
        let deadline = started + self.settings.timeout;
        let result = match &self.batcher {
            Some(batcher) => within(deadline, self.settings.timeout, batcher.decide(asks))
                .await
                .map(|(_, verdicts)| verdicts),
            None => self.decide_unbatched(asks, deadline).await,
        };
        metrics
            .redis_latency
            .observe(started.elapsed().as_secs_f64());
        self.note_decision(&result);
        self.record(permit, result.as_ref().err(), metrics);
        result
    }

    /// One script for every ask, through redis-rs (a single server whose address the batcher
    /// cannot dial itself).
    async fn decide_unbatched(
        &self,
        asks: &[RedisAsk<'_>],
        deadline: Instant,
    ) -> Result<Vec<RemoteVerdict>, RedisFailure> {
        let timeout = self.settings.timeout;
        let connection = within(deadline, timeout, self.connect()).await?;
        let call = invoke(&self.script, &connection, asks.iter().collect());
        let (_, verdicts) = within(deadline, timeout, call).await?;
        Ok(verdicts)
    }

    /// [`Self::decide_all`] in a cluster: each slot group's calls count against the health of
    /// the node that holds it. A node cooling down leaves the request to `on_redis_error`
    /// without calling the others, whose charges would only be given back.
    async fn decide_in_cluster(
        &self,
        cluster: &Arc<ClusterHealth>,
        asks: &[RedisAsk<'_>],
        metrics: &Metrics,
    ) -> Result<Vec<RemoteVerdict>, RedisFailure> {
        self.read_first_slot_map(cluster, self.settings.timeout, metrics)
            .await;
        let groups = slot_groups(asks);
        // The nodes the request needs, once each, and for each group its node's index.
        let mut nodes: Vec<Node> = Vec::with_capacity(groups.len());
        let mut node_of_group = Vec::with_capacity(groups.len());
        for members in &groups {
            let node = cluster.node_for(asks[members[0]].key);
            let index = match nodes.iter().position(|known| known.address == node.address) {
                Some(index) => index,
                None => {
                    nodes.push(node);
                    nodes.len() - 1
                }
            };
            node_of_group.push(index);
        }
        let permits: Option<Vec<Permit<'_>>> = nodes
            .iter()
            .map(|node| Health::permit(&node.health))
            .collect();
        let Some(permits) = permits else {
            // A node cooling down may have handed its slots to another meanwhile (a replica
            // promoted): a fresh map finds the new master, whose breaker is closed.
            self.read_slot_map_when_due(cluster, true, metrics);
            return Err(RedisFailure::Down);
        };
        let started = Instant::now();
        let (result, group_ok) = self
            .run_groups(asks, groups, started + self.settings.timeout)
            .await;
        metrics
            .redis_latency
            .observe(started.elapsed().as_secs_f64());
        for (index, (node, permit)) in nodes.iter().zip(permits).enumerate() {
            let node_ok = node_of_group
                .iter()
                .zip(&group_ok)
                .all(|(&of, &ok)| of != index || ok);
            // The request's failure stands for the node's: the first group's that failed.
            let failure = if node_ok { None } else { result.as_ref().err() };
            self.record_node(node, permit, failure, metrics);
        }
        self.note_decision(&result);
        self.read_slot_map_when_due(cluster, result.is_err(), metrics);
        result
    }

    /// Decides the slot groups of a cluster request; also says, per group, whether its
    /// node answered.
    async fn run_groups(
        &self,
        asks: &[RedisAsk<'_>],
        groups: Vec<Vec<usize>>,
        deadline: Instant,
    ) -> (Result<Vec<RemoteVerdict>, RedisFailure>, Vec<bool>) {
        let timeout = self.settings.timeout;
        let connection = match within(deadline, timeout, self.connect()).await {
            Ok(connection) => connection,
            Err(error) => return (Err(error), vec![false; groups.len()]),
        };
        if groups.len() == 1 {
            let call = invoke(&self.script, &connection, asks.iter().collect());
            let result = within(deadline, timeout, call).await;
            let ok = result.is_ok();
            return (result.map(|(_, verdicts)| verdicts), vec![ok]);
        }
        // Several slots: decided in a task of its own, so that a request that goes away
        // meanwhile (its client hung up) still gives back what some groups charged when
        // another refused or failed.
        let group_count = groups.len();
        let owned: Vec<OwnedAsk> = asks.iter().map(OwnedAsk::from).collect();
        let script = self.script.clone();
        let refund = self.refund.clone();
        let (verdict_sender, verdict) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let asks: Vec<RedisAsk<'_>> = owned.iter().map(OwnedAsk::borrowed).collect();
            let decided =
                decide_in_groups(&script, &connection, &asks, &groups, deadline, timeout).await;
            let _ = verdict_sender.send((decided.result, decided.group_ok));
            let bound = timeout.max(OFF_PATH_BOUND);
            give_back(&refund, &connection, &asks, &decided.to_refund, bound).await;
        });
        let answer = verdict.await.unwrap_or_else(|_| {
            let ended =
                RedisFailure::Connection("the rate-limit decision ended without an answer".into());
            (Err(ended), vec![false; group_count])
        });
        // A refund is waited for until the deadline, so that the next request usually sees
        // it done; it goes on after that when this request has run out of time.
        let _ = tokio::time::timeout_at(deadline, task).await;
        answer
    }

    /// Reads the cluster's slot map again in the background when it is due (see
    /// [`ClusterHealth::claim_read`]); the read's task, when one was started. The task ends
    /// the claim however it goes, even when whoever waits for it is dropped.
    fn read_slot_map_when_due(
        &self,
        cluster: &Arc<ClusterHealth>,
        failed: bool,
        metrics: &Metrics,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let connection = self.connection.get().cloned()?;
        if !cluster.claim_read(failed) {
            return None;
        }
        let cluster = cluster.clone();
        let node_up = metrics.redis_node_up.clone();
        Some(tokio::spawn(async move {
            read_slot_map(&connection, &cluster, &node_up, OFF_PATH_BOUND).await;
        }))
    }

    /// Waits, within `timeout`, for the first read of the slot map. Until a map is read every
    /// key counts against the one stand-in node, so a single node frozen before the map came
    /// in would open the breaker of them all: a read run in the background after the first
    /// call could lose that race. Calls that come while the first read runs wait for it too,
    /// within the same `timeout`. Once a read failed, none waits: the next reads run in the
    /// background (at most one a second) while calls go by the stand-in's breaker, which
    /// answers at once when it is open.
    async fn read_first_slot_map(
        &self,
        cluster: &Arc<ClusterHealth>,
        timeout: Duration,
        metrics: &Metrics,
    ) {
        if cluster.was_read() {
            return;
        }
        if cluster.a_read_ended() {
            self.read_slot_map_when_due(cluster, false, metrics);
            return;
        }
        // Connected before the read is claimed: a request dropped meanwhile (its client hung
        // up) leaves no claim behind.
        match tokio::time::timeout(timeout, self.connect()).await {
            Ok(Ok(_)) => {}
            failed => {
                if let Ok(Err(error)) = failed {
                    tracing::debug!("slot map not read: {error}");
                }
                cluster.first_connect_failed();
                return;
            }
        }
        match self.read_slot_map_when_due(cluster, false, metrics) {
            Some(read) => {
                let _ = tokio::time::timeout(timeout, read).await;
            }
            None => {
                cluster.wait_for_read_under_way(timeout).await;
            }
        }
    }
}

/// Reads the cluster's slot map (`CLUSTER SLOTS`, within `bound`) and installs it, or ends the
/// claimed read as failed and keeps the map read before.
async fn read_slot_map(
    connection: &Connection,
    cluster: &ClusterHealth,
    node_up: &Family<RedisNodeLabels, Gauge>,
    bound: Duration,
) {
    let mut slots = redis::cmd("CLUSTER");
    slots.arg("SLOTS");
    let read = query::<redis::Value>(connection, &slots);
    let ranges = match tokio::time::timeout(bound, read).await {
        Ok(Ok(reply)) => parse_slots(&reply)
            .ok_or_else(|| "CLUSTER SLOTS answered something not a slot map".to_string()),
        Ok(Err(error)) => Err(format!("CLUSTER SLOTS failed: {error}")),
        Err(_elapsed) => Err(format!("CLUSTER SLOTS got no answer within {bound:?}")),
    };
    match ranges {
        Ok(ranges) => cluster.install(ranges, node_up),
        Err(reason) => {
            tracing::warn!("{reason}; calls keep following the slot map read before");
            cluster.read_failed();
        }
    }
}

/// A redis-rs client for `info`, with `[redis] ca_file`, `cert_file` and `key_file` when the
/// policy gives them (a `rediss://` target without them uses the system's CAs).
pub(crate) fn client_for<C: redis::IntoConnectionInfo>(
    info: C,
    tls: Option<&RedisTls>,
) -> redis::RedisResult<redis::Client> {
    match tls {
        Some(tls) => redis::Client::build_with_tls(info, tls.certificates()),
        None => redis::Client::open(info),
    }
}

/// A connection to one server that connects again by itself: connecting by at least 200 ms (a
/// tight `timeout` must not keep it from ever connecting), each call bounded by
/// `response_timeout` (the shared connection's: see [`shared_response_timeout`]), two retries.
pub(crate) async fn connection_manager(
    client: redis::Client,
    timeout: Duration,
    response_timeout: Option<Duration>,
) -> Result<ConnectionManager, RedisFailure> {
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout.max(Duration::from_millis(200))))
        .set_response_timeout(response_timeout)
        .set_number_of_retries(2);
    Ok(ConnectionManager::new_with_config(client, config).await?)
}

/// Awaits `call` until `deadline`; a timeout (of `timeout`, the setting) after it.
async fn within<T>(
    deadline: Instant,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<T, RedisFailure>>,
) -> Result<T, RedisFailure> {
    tokio::time::timeout_at(deadline, call)
        .await
        .unwrap_or(Err(RedisFailure::Timeout(timeout)))
}

/// A [`RedisAsk`] that owns its key and tag, for a decision that outlives its request.
struct OwnedAsk {
    key: String,
    tag: String,
    rule: RedisRule,
}

impl From<&RedisAsk<'_>> for OwnedAsk {
    fn from(ask: &RedisAsk<'_>) -> OwnedAsk {
        OwnedAsk {
            key: ask.key.to_string(),
            tag: ask.tag.to_string(),
            rule: ask.rule.clone(),
        }
    }
}

impl OwnedAsk {
    fn borrowed(&self) -> RedisAsk<'_> {
        RedisAsk {
            key: &self.key,
            tag: &self.tag,
            rule: &self.rule,
        }
    }
}

/// The asks' indices, grouped by hash tag (one slot per group), in order of first appearance.
fn slot_groups(asks: &[RedisAsk<'_>]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (index, ask) in asks.iter().enumerate() {
        match groups
            .iter_mut()
            .find(|members| asks[members[0]].tag == ask.tag)
        {
            Some(members) => members.push(index),
            None => groups.push(vec![index]),
        }
    }
    groups
}

/// What [`decide_in_groups`] found.
struct GroupsDecided {
    result: Result<Vec<RemoteVerdict>, RedisFailure>,
    /// Per group: its node answered.
    group_ok: Vec<bool>,
    /// Per group whose script admitted, when the request was not admitted whole: the
    /// indices in `asks` of the buckets it charged, to give back.
    to_refund: Vec<Vec<usize>>,
}

/// Decides asks of several slots in a cluster: one script per slot group, each bounded by the
/// deadline itself, so that the groups which did answer are known even when another did not.
/// A request that is not admitted whole consumes nothing: when a group refuses, fails or
/// overruns the deadline, the buckets the other groups charged are returned for refunding.
async fn decide_in_groups(
    script: &KeyedScript,
    connection: &Connection,
    asks: &[RedisAsk<'_>],
    groups: &[Vec<usize>],
    deadline: Instant,
    timeout: Duration,
) -> GroupsDecided {
    let calls = groups.iter().map(|members| {
        let group: Vec<&RedisAsk<'_>> = members.iter().map(|&i| &asks[i]).collect();
        within(deadline, timeout, invoke(script, connection, group))
    });
    let answers = futures_util::future::join_all(calls).await;
    let mut verdicts = vec![
        RemoteVerdict {
            allowed: true,
            remaining: 0,
            reset_ms: 0,
            retry_after_ms: 0
        };
        asks.len()
    ];
    let mut any_blocked = false;
    let mut failure = None;
    let mut group_ok = Vec::with_capacity(groups.len());
    // Per group whose script admitted: the buckets it charged.
    let mut charged: Vec<Vec<usize>> = Vec::new();
    for (members, answer) in groups.iter().zip(answers) {
        group_ok.push(answer.is_ok());
        match answer {
            Ok((blocked, group_verdicts)) => {
                any_blocked |= blocked;
                let mut group_charged = Vec::new();
                for (&index, verdict) in members.iter().zip(group_verdicts) {
                    verdicts[index] = verdict;
                    if !blocked && verdict.allowed {
                        group_charged.push(index);
                    }
                }
                if !group_charged.is_empty() {
                    charged.push(group_charged);
                }
            }
            Err(error) => {
                failure.get_or_insert(error);
            }
        }
    }
    // Refused, or left to the fallback (Redis did not admit the request whole): what the
    // other groups charged goes back.
    let to_refund = if any_blocked || failure.is_some() {
        charged
    } else {
        Vec::new()
    };
    let result = match failure {
        Some(error) => Err(error),
        None => Ok(verdicts),
    };
    GroupsDecided {
        result,
        group_ok,
        to_refund,
    }
}

async fn invoke(
    script: &KeyedScript,
    connection: &Connection,
    asks: Vec<&RedisAsk<'_>>,
) -> Result<(bool, Vec<RemoteVerdict>), RedisFailure> {
    let reply: String = script
        .run(connection, |command| {
            command.arg(asks.len());
            for ask in &asks {
                command.arg(ask.key);
            }
            // One request in the batch (see `limit/script.lua`), waiting for its decision.
            command.arg(1).arg(asks.len()).arg(0);
            for ask in &asks {
                command
                    .arg(ask.rule.interval_us)
                    .arg(ask.rule.burst)
                    .arg(if ask.rule.dry_run { "1" } else { "0" });
            }
        })
        .await?;
    parse_reply(&reply, asks.len())
}

/// Gives one token back to each of `asks` that `groups` lists (one script call per slot
/// group, all at once), each call bounded by `bound`: a late refund is as right as an early
/// one, and it runs off the request path, so it gets longer than a decision, for a cluster
/// that is catching up after a failure.
async fn give_back(
    script: &KeyedScript,
    connection: &Connection,
    asks: &[RedisAsk<'_>],
    groups: &[Vec<usize>],
    bound: Duration,
) {
    let calls = groups.iter().map(|members| async move {
        let call = script.run::<i64>(connection, |command| {
            command.arg(members.len());
            for &index in members {
                command.arg(asks[index].key);
            }
            for &index in members {
                command.arg(asks[index].rule.interval_us);
            }
        });
        match tokio::time::timeout(bound, call).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(
                keys = members.len(),
                "rate-limit refund failed: {error}; those tokens stay spent"
            ),
            Err(_elapsed) => tracing::warn!(
                keys = members.len(),
                "rate-limit refund got no answer within {bound:?}; those tokens may stay spent"
            ),
        }
    });
    futures_util::future::join_all(calls).await;
}

/// A Lua script called by its hash (`EVALSHA`), and sent whole (`EVAL`) to the one server
/// that does not have it yet (a new or restarted node).
///
/// redis-rs's own fallback loads a missing script with `SCRIPT LOAD`, which a cluster client
/// sends to every master: one frozen or dead master then failed the calls meant for all the
/// others, refunds included. `EVAL` carries the script to the node that serves the keys.
struct KeyedScript {
    code: &'static str,
    hash: String,
}

impl KeyedScript {
    fn new(code: &'static str) -> KeyedScript {
        KeyedScript {
            code,
            hash: redis::Script::new(code).get_hash().to_string(),
        }
    }

    /// Runs the script; `fill` appends the number of keys, the keys and the arguments.
    async fn run<T: redis::FromRedisValue>(
        &self,
        connection: &Connection,
        fill: impl Fn(&mut redis::Cmd),
    ) -> Result<T, redis::RedisError> {
        let mut by_hash = redis::cmd("EVALSHA");
        by_hash.arg(&self.hash);
        fill(&mut by_hash);
        match query(connection, &by_hash).await {
            Err(error)
                if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                let mut whole = redis::cmd("EVAL");
                whole.arg(self.code);
                fill(&mut whole);
                query(connection, &whole).await
            }
            answer => answer,
        }
    }
}

async fn query<T: redis::FromRedisValue>(
    connection: &Connection,
    command: &redis::Cmd,
) -> Result<T, redis::RedisError> {
    match connection.clone() {
        Connection::Single(mut connection) => command.query_async(&mut connection).await,
        Connection::Cluster(mut connection) => command.query_async(&mut connection).await,
    }
}

/// Reads the script's reply for one request (see `limit/script.lua`).
fn parse_reply(text: &str, count: usize) -> Result<(bool, Vec<RemoteVerdict>), RedisFailure> {
    let mut numbers = reply_numbers(text.as_bytes());
    match read_answer(&mut numbers, count) {
        Some((blocked, verdicts)) if numbers.next().is_none() => Ok((blocked > 0, verdicts)),
        _ => Err(RedisFailure::BadReply(format!(
            "not {count} rules' verdicts: {text:.80}"
        ))),
    }
}

/// Keeps the store alive in `Arc`s shared by policy generations.
pub type SharedRedis = Arc<RedisStore>;

/// The `maxmemory_policy` an `INFO memory` answer gives: one server's text, or a cluster's
/// map of node to text, where a node that evicts any key speaks for all (its queue streams
/// are as much at risk); "unknown" when no node says.
fn eviction_policy_of(answer: &redis::Value) -> String {
    let policies = info_field(answer, "maxmemory_policy");
    policies
        .iter()
        .find(|policy| policy.starts_with("allkeys-"))
        .or_else(|| policies.first())
        .cloned()
        .unwrap_or_else(|| "unknown".to_string())
}

/// The values of `field` in an `INFO` answer: one server's text, or a cluster's map of node
/// to text (one value per node that has it).
fn info_field(answer: &redis::Value, field: &str) -> Vec<String> {
    let of_text = |text: &[u8]| {
        String::from_utf8_lossy(text)
            .lines()
            .find_map(|line| line.trim().strip_prefix(field)?.strip_prefix(':'))
            .map(str::to_string)
    };
    let value_of = |value: &redis::Value| match value {
        redis::Value::BulkString(text) => of_text(text),
        redis::Value::VerbatimString { text, .. } | redis::Value::SimpleString(text) => {
            of_text(text.as_bytes())
        }
        _ => None,
    };
    match answer {
        redis::Value::Map(nodes) => nodes
            .iter()
            .filter_map(|(_, text)| value_of(text))
            .collect(),
        one => value_of(one).into_iter().collect(),
    }
}

/// A Redis URL fit to show (in `/status`, in `levee check` errors): the credentials of
/// `user:pass@` and the value of a `password` or `pass` query parameter become `***`.
pub fn redact_url(url: &str) -> String {
    // The credentials end at the last `@`, wherever it is: a password typed with a raw `?`,
    // `/` or `#` in it must not be taken for the start of the query or path and shown. An `@`
    // in the query hides the host as well, which errs on the safe side.
    let (scheme, rest) = match url.find("://") {
        Some(scheme_end) => url.split_at(scheme_end + 3),
        None => ("", url),
    };
    let (userinfo_hidden, rest) = match rest.rfind('@') {
        Some(at) => (true, &rest[at..]),
        None => (false, rest),
    };
    let (address, query) = match rest.split_once('?') {
        Some((address, query)) => (address, Some(query)),
        None => (rest, None),
    };
    let mut out = format!(
        "{scheme}{}{address}",
        if userinfo_hidden { "***" } else { "" }
    );
    if let Some(query) = query {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _))
                    if key.eq_ignore_ascii_case("password") || key.eq_ignore_ascii_case("pass") =>
                {
                    format!("{key}=***")
                }
                _ => pair.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&pairs.join("&"));
    }
    out
}

#[cfg(test)]
mod reload_tests {
    use super::*;

    fn settings(url: &str, timeout_ms: u64) -> RedisSettings {
        RedisSettings {
            target: RedisTarget::Single(url.into()),
            timeout: Duration::from_millis(timeout_ms),
            failures_to_open: 1,
            cooldown: Duration::from_secs(60),
            key_prefix: "levee:".into(),
            instances: 1,
            admit_ahead_above: 1.0,
            tls: None,
        }
    }

    /// A Redis that refuses writes still answers reads: an outage is said over only once
    /// calls have answered, with none failing, for a second.
    #[test]
    fn an_outage_is_said_over_only_after_a_second_of_answers() {
        let store = RedisStore::new(settings("redis://127.0.0.1:1/0", 100));
        store.note_call(Some(&RedisFailure::Full("OOM".into())));
        assert!(lock(&store.reach).outage_logged);
        // A read answered at once: not yet.
        store.note_call(None);
        assert!(lock(&store.reach).outage_logged);
        store.note_call(Some(&RedisFailure::Full("OOM".into())));
        store.note_call(None);
        assert!(lock(&store.reach).outage_logged);
        // The last failure a second and more ago: said.
        lock(&store.reach).failed_at =
            std::time::Instant::now().checked_sub(ANSWERING_FOR + Duration::from_millis(1));
        store.note_call(None);
        assert!(!lock(&store.reach).outage_logged);
    }

    /// A reload that points levee at another Redis (or fixes the password) after an outage was
    /// said says its end once the new one answers.
    #[test]
    fn a_reload_to_another_redis_says_the_outage_over_when_it_answers() {
        let wrong = RedisStore::new(settings("redis://:wrong@127.0.0.1:1/0", 100));
        wrong.note_call(Some(&RedisFailure::BadReply("WRONGPASS".into())));
        assert!(lock(&wrong.reach).outage_logged);
        let fixed = RedisStore::new(settings("redis://:right@127.0.0.1:1/0", 100));
        fixed.start_from(&wrong);
        assert!(fixed.is_up(), "its own health");
        assert!(lock(&fixed.reach).outage_logged, "the end is still to say");
        fixed.note_call(None);
        assert!(!lock(&fixed.reach).outage_logged, "said");
    }

    /// A wrong password makes the connection retry its login until a call's time is out: the
    /// timeout does not replace the refusal as what `/status` says, until Redis answers or
    /// fails otherwise.
    #[test]
    fn a_timeout_after_a_refusal_keeps_the_refusal() {
        let store = RedisStore::new(settings("redis://127.0.0.1:1/0", 100));
        let refused = RedisFailure::Redis(redis::RedisError::from((
            redis::ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        )));
        let timeout = RedisFailure::Timeout(Duration::from_millis(500));
        store.note_call(Some(&refused));
        store.note_call(Some(&timeout));
        assert!(
            store
                .last_error()
                .is_some_and(|error| error.contains("Password authentication failed")),
            "{:?}",
            store.last_error()
        );
        store.note_call(None);
        assert_eq!(store.last_error(), None);
        store.note_call(Some(&timeout));
        store.note_call(Some(&timeout));
        assert_eq!(store.last_error(), Some(timeout.to_string()));
        store.note_call(Some(&refused));
        assert!(store
            .last_error()
            .is_some_and(|error| error.contains("Password authentication failed")));
    }

    #[tokio::test]
    async fn a_reload_of_the_same_redis_keeps_what_its_health_breaker_knows() {
        let metrics = Metrics::new();
        // Nothing listens on port 1: the first guarded call fails and opens the breaker.
        let down = RedisStore::new(settings("redis://127.0.0.1:1/0", 100));
        let guard = Guard {
            key: "k",
            metrics: &metrics,
        };
        let failed = down
            .command::<String>(&redis::cmd("PING"), Duration::from_millis(100), Some(guard))
            .await;
        assert!(failed.is_err());
        assert!(!down.is_up());

        let new_timeout = RedisStore::new(settings("redis://127.0.0.1:1/0", 50));
        new_timeout.start_from(&down);
        assert!(!new_timeout.is_up(), "still known to be down");
        assert!(!new_timeout.decides_rate_limits(), "its breaker still open");
        let standby = RedisStore::new(settings("redis://127.0.0.1:2/0", 100));
        standby.start_from(&down);
        assert!(standby.is_up(), "another server is tried");
    }

    /// A cluster none of whose nodes answers (a host down, packets dropped): once the stand-in
    /// node's breaker is open, a call answers at once, without waiting for a connection first.
    #[tokio::test(start_paused = true)]
    async fn a_cluster_never_reached_is_not_waited_for_once_its_breaker_is_open() {
        // Takes connections (the kernel's backlog) and never answers on them.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = silent.local_addr().expect("address");
        let mut settings = settings("", 100);
        settings.target = RedisTarget::Cluster(vec![format!("redis://{address}")]);
        let store = RedisStore::new(settings);
        let metrics = Metrics::new();
        let rule = RedisRule::new(1_000_000, 10, false);
        let asks = [RedisAsk {
            key: "levee:rl:k",
            tag: "",
            rule: &rule,
        }];
        let first = store.decide_all(&asks, &metrics).await;
        assert!(first.is_err());
        for _ in 0..3 {
            let started = Instant::now();
            let next = store.decide_all(&asks, &metrics).await;
            assert!(matches!(next, Err(RedisFailure::Down)), "{next:?}");
            assert_eq!(
                started.elapsed(),
                Duration::ZERO,
                "no wait for a connection"
            );
        }
        drop(silent);
    }
}

#[cfg(test)]
mod redact_tests {
    use super::{redact_url, RedisTarget, SentinelTarget};

    #[test]
    fn the_settings_never_show_a_password_when_printed() {
        let sentinel = SentinelTarget {
            nodes: vec!["redis://:sentinel-secret@10.0.0.5:26379".into()],
            master: "mymaster".into(),
            username: Some("levee".into()),
            password: Some("master-secret".into()),
            db: 0,
            tls: false,
        };
        for target in [
            RedisTarget::Single("redis://levee:url-secret@127.0.0.1:6379/0".into()),
            RedisTarget::Cluster(vec!["redis://:node-secret@10.0.0.1:7000".into()]),
            RedisTarget::Sentinel(sentinel),
        ] {
            let shown = format!("{target:?}");
            assert!(!shown.contains("secret"), "{shown}");
            assert!(shown.contains("***"), "{shown}");
        }
    }

    #[test]
    fn credentials_are_hidden_wherever_the_url_carries_them() {
        assert_eq!(
            redact_url("redis://levee:s3cret@127.0.0.1:6379/0"),
            "redis://***@127.0.0.1:6379/0"
        );
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?db=1&pass=s3cret"),
            "redis+unix:///run/redis.sock?db=1&pass=***"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        for typed in [
            "redis://levee:pa?ss@127.0.0.1:6379/0",
            "redis://levee:pa/ss@127.0.0.1:6379/0",
            "redis://levee:pa#ss@127.0.0.1:6379/0",
            "redis://levee:pa@ss@127.0.0.1:6379/0",
        ] {
            let shown = redact_url(typed);
            assert_eq!(shown, "redis://***@127.0.0.1:6379/0", "{typed}");
        }
    }

    #[test]
    fn a_rotated_password_names_the_same_servers_another_host_or_db_does_not() {
        let single = |url: &str| RedisTarget::Single(url.into());
        let at = single("redis://:old@10.0.0.1:6379/0");
        assert!(at.same_servers(&single("redis://:new@10.0.0.1:6379/0")));
        assert!(!at.same_servers(&single("redis://:old@10.0.0.2:6379/0")));
        assert!(!at.same_servers(&single("redis://:old@10.0.0.1:6379/1")));
        // A password added (or a user), the database written or left to its default of 0.
        let bare = single("redis://10.0.0.1:6379");
        assert!(bare.same_servers(&at));
        assert!(bare.same_servers(&single("redis://app:secret@10.0.0.1:6379/0")));
        assert!(!bare.same_servers(&single("rediss://10.0.0.1:6379")));
        let cluster =
            |urls: &[&str]| RedisTarget::Cluster(urls.iter().map(|url| url.to_string()).collect());
        assert!(cluster(&["redis://:a@10.0.0.1:7000"])
            .same_servers(&cluster(&["redis://:b@10.0.0.1:7000"])));
        assert!(!cluster(&["redis://10.0.0.1:7000"]).same_servers(&at));
    }
}
