//! Upstreams: the dependencies levee forwards to, each with its own pooled keep-alive client.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::HeaderValue;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::breaker::Breaker;
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
    /// Idle keep-alive connections kept per upstream. Default 256.
    pub pool_max_idle: usize,
}

/// A named dependency, its client and its circuit breaker.
#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub settings: UpstreamSettings,
    pub client: Client<HttpConnector, UpstreamBody>,
    pub breaker: Arc<Breaker>,
}

impl Upstream {
    pub fn new(name: String, settings: UpstreamSettings, breaker: Arc<Breaker>) -> Upstream {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(settings.connect_timeout));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(Duration::from_secs(60)));
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(settings.pool_idle_timeout)
            .pool_max_idle_per_host(settings.pool_max_idle)
            .build(connector);
        Upstream {
            name,
            settings,
            client,
            breaker,
        }
    }

    /// `scheme://authority` of this upstream followed by the client's path and query.
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        http::Uri::builder()
            .scheme(self.settings.scheme.clone())
            .authority(self.settings.authority.clone())
            .path_and_query(path_and_query)
            .build()
    }
}
