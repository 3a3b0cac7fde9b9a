//! Upstreams: the dependencies levee forwards to, each with its own pooled keep-alive client.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::HeaderValue;
use http_body_util::combinators::UnsyncBoxBody;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use super::client::{Client, ClientSettings, FastCgiSettings};
use crate::breaker::Breaker;
use crate::degrade::bulkhead::{Bulkhead, BulkheadSettings};
use crate::degrade::trigger::LatencyWindow;
use crate::error::BoxError;

/// Body type of requests sent upstream (the client's body, wrapped in limits and timeouts).
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// Everything about an upstream that comes from the policy. When a reload leaves these
/// unchanged, the running [`Upstream`] (and its connection pool) is kept.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamSettings {
    pub scheme: Scheme,
    pub authority: Authority,
    /// `Host` sent upstream instead of the client's, when set.
    pub host: Option<HeaderValue>,
    /// Default 2s.
    pub connect_timeout: Duration,
    /// Time to the response head. Default 30s.
    pub response_timeout: Duration,
    /// Longest pause inside a response body. Default 30s.
    pub idle_body_timeout: Duration,
    /// Default 90s.
    pub pool_idle_timeout: Duration,
    /// Idle keep-alive connections kept per upstream. Default 256; 0 for FastCGI.
    pub pool_max_idle: usize,
    /// Extra CA certificates (PEM) trusted for `https://` upstreams, besides the system's.
    pub ca_files: Vec<std::path::PathBuf>,
    /// SHA-256 of the certificates `ca_files` held when the policy was compiled: a file
    /// rewritten in place (a rotated CA) is a change, though its path is the same.
    pub ca_digest: Vec<u8>,
    /// Concurrency bound with shedding by tier. Default: none.
    pub bulkhead: Option<BulkheadSettings>,
    /// A unix socket connected to instead of the url's host and port.
    pub socket: Option<std::path::PathBuf>,
    /// A `fastcgi://` upstream (php-fpm): how requests become CGI requests.
    pub fastcgi: Option<Arc<FastCgiSettings>>,
}

/// A named dependency, its client and its circuit breaker.
#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub settings: UpstreamSettings,
    pub client: Client,
    pub breaker: Arc<Breaker>,
    pub bulkhead: Option<Arc<Bulkhead>>,
    /// Recent latencies, for degrade triggers. Shared with the upstream this one replaced in
    /// a reload when both reach the same address: a `latency_p95` trigger keeps its history
    /// across a settings change.
    pub latency: Arc<LatencyWindow>,
    /// Its failures that a stale copy answered for, said in the log at most once per ten
    /// seconds (the copy may answer thousands a second while the app is down); one per
    /// upstream, so one app down does not hold back another's line.
    pub(crate) covered_failures: crate::log_throttle::LogThrottle,
}

/// The system's trusted roots, read once.
pub(crate) fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for error in &found.errors {
            tracing::warn!("reading system CA certificates: {error}");
        }
        found.certs
    })
}

/// Reads a PEM file of CA certificates; the error says what is wrong for `levee check`.
pub fn read_ca_file(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path)
        .map_err(|error| format!("cannot read CA file {}: {error}", path.display()))?;
    ca_certificates(&pem).map_err(|error| format!("CA file {} {error}", path.display()))
}

/// The certificates of a PEM text, at least one; the error ("is not valid PEM: …", "holds no
/// certificate") follows the file's name.
pub fn ca_certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|error| format!("is not valid PEM: {}", pem_error(&error)))?;
    if certs.is_empty() {
        return Err("holds no certificate".into());
    }
    // Each must be a certificate TLS can trust: a PEM block cut short or edited (a botched
    // rotation) is still PEM, and was skipped without a word when the connections were made,
    // after `levee check` and a reload had taken the file, so every call then failed.
    let mut trusted = rustls::RootCertStore::empty();
    for (index, cert) in certs.iter().enumerate() {
        trusted.add(cert.clone()).map_err(|error| {
            format!(
                "holds a certificate (number {}) TLS cannot use: {error}; is the file cut short or edited?",
                index + 1
            )
        })?;
    }
    Ok(certs)
}

/// A PEM reading error as words: the library's own text prints the marker it looked for as
/// a list of byte values.
fn pem_error(error: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error;
    match error {
        Error::MissingSectionEnd { end_marker } => format!(
            "a section has no `-----END {}-----` line (the file is cut short?)",
            String::from_utf8_lossy(end_marker)
        ),
        Error::IllegalSectionStart { line } => format!(
            "a section starts with a malformed line `{}`",
            crate::printable::printable(&String::from_utf8_lossy(line))
        ),
        other => other.to_string(),
    }
}

/// TLS for `https://` upstreams: rustls with the system roots plus `ca_files`.
fn tls_config(ca_files: &[std::path::PathBuf]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    let (_added, _ignored) = roots.add_parsable_certificates(system_roots().iter().cloned());
    for path in ca_files {
        // Checked by the compiler already; a file that vanished since is logged.
        match read_ca_file(path) {
            Ok(certs) => {
                roots.add_parsable_certificates(certs);
            }
            Err(error) => tracing::warn!("{error}"),
        }
    }
    client_tls(roots).with_no_client_auth()
}

/// levee's TLS client settings (rustls with ring, TLS 1.2 and 1.3) trusting `roots`, for
/// `https://` upstreams and `rediss://` alike; the client certificate is the caller's choice.
pub(crate) fn client_tls(
    roots: rustls::RootCertStore,
) -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
}

impl Upstream {
    /// `running`: the upstream this one replaces on a reload, if any. Its bulkhead is kept
    /// when its bounds are unchanged, so requests in flight across the reload still count
    /// (a fresh one would start at 0 and let up to twice `max_inflight` through).
    pub fn new(
        name: String,
        settings: UpstreamSettings,
        breaker: Arc<Breaker>,
        running: Option<&Upstream>,
    ) -> Upstream {
        let tls =
            (settings.scheme == Scheme::HTTPS).then(|| Arc::new(tls_config(&settings.ca_files)));
        let https = settings.scheme == Scheme::HTTPS;
        let client = Client::new(ClientSettings {
            // `[::1]` is written with brackets in a URL, not in a connect call.
            host: settings
                .authority
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port: settings
                .authority
                .port_u16()
                .unwrap_or(match (https, &settings.fastcgi) {
                    (true, _) => 443,
                    // php-fpm's usual TCP port.
                    (false, Some(_)) => 9000,
                    (false, None) => 80,
                }),
            authority: HeaderValue::from_str(settings.authority.as_str())
                .unwrap_or_else(|_| HeaderValue::from_static("localhost")),
            tls,
            connect_timeout: settings.connect_timeout,
            pool_idle_timeout: settings.pool_idle_timeout,
            pool_max_idle: settings.pool_max_idle,
            socket: settings.socket.clone(),
            fastcgi: settings.fastcgi.clone(),
        });
        let kept = running
            .and_then(|running| running.bulkhead.clone())
            .filter(|bulkhead| Some(bulkhead.settings) == settings.bulkhead);
        let bulkhead = kept.or_else(|| {
            settings
                .bulkhead
                .map(|settings| Arc::new(Bulkhead::new(settings)))
        });
        let latency = running
            .filter(|running| {
                running.settings.scheme == settings.scheme
                    && running.settings.authority == settings.authority
                    && running.settings.socket == settings.socket
            })
            .map(|running| Arc::clone(&running.latency))
            .unwrap_or_default();
        Upstream {
            name,
            settings,
            client,
            breaker,
            bulkhead,
            latency,
            covered_failures: crate::log_throttle::LogThrottle::new(Duration::from_secs(10)),
        }
    }

    /// The request target sent to this upstream: the client's path and query, checked.
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        http::Uri::builder().path_and_query(path_and_query).build()
    }
}
