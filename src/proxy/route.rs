//! The compiled route table: first match wins, in the order the policy lists routes.

use std::fmt;
use std::sync::Arc;

use http::Method;
use regex::Regex;

use super::upstream::Upstream;

/// A route's name, cheap to clone into metrics labels and log lines.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteName(pub Arc<str>);

impl fmt::Display for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl prometheus_client::encoding::EncodeLabelValue for RouteName {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), fmt::Error> {
        fmt::Write::write_str(encoder, &self.0)
    }
}

/// How a route matches the normalised path.
#[derive(Debug)]
pub enum PathMatch {
    Any,
    Exact(String),
    Prefix(String),
    Regex(Regex),
}

impl PathMatch {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Any => true,
            PathMatch::Exact(exact) => path == exact,
            PathMatch::Prefix(prefix) => path.starts_with(prefix.as_str()),
            PathMatch::Regex(regex) => regex.is_match(path),
        }
    }
}

/// A host pattern: `example.com` or `*.example.com`, compared without port, ignoring case.
#[derive(Debug)]
pub enum HostMatch {
    Exact(String),
    Suffix(String),
}

impl HostMatch {
    pub fn parse(pattern: &str) -> HostMatch {
        let pattern = pattern.to_ascii_lowercase();
        match pattern.strip_prefix('*') {
            Some(suffix) => HostMatch::Suffix(suffix.to_string()),
            None => HostMatch::Exact(pattern),
        }
    }

    fn matches(&self, host: &str) -> bool {
        match self {
            HostMatch::Exact(exact) => host.eq_ignore_ascii_case(exact),
            HostMatch::Suffix(suffix) => {
                host.len() > suffix.len()
                    && host
                        .get(host.len() - suffix.len()..)
                        .is_some_and(|tail| tail.eq_ignore_ascii_case(suffix))
            }
        }
    }
}

/// One compiled route. Requests carry an `Arc<Route>` from routing to the access log.
#[derive(Debug)]
pub struct Route {
    pub name: RouteName,
    pub hosts: Vec<HostMatch>,
    pub methods: Vec<Method>,
    pub path: PathMatch,
    pub upstream: Arc<Upstream>,
    /// Largest request body accepted, in bytes (413 above it).
    pub max_body: u64,
    /// Rate-limit rules, all decided together.
    pub limits: Vec<Arc<crate::limit::LimitRule>>,
    /// Answer while the upstream's breaker is open; `None`: 503 with `Retry-After`.
    pub fallback: Option<Arc<StaticResponse>>,
    /// 1 never degraded (default), 2 may be delayed, 3 may be switched off.
    pub tier: u8,
    /// The feature this route serves; switching it off turns the route off.
    pub module: Option<Arc<str>>,
    /// What the route answers while off. `None`: 503 with `Retry-After`.
    pub degrade: Option<crate::degrade::DegradeAction>,
    /// Module → CSS selector of the page fragments that show it.
    pub hide: Vec<(String, String)>,
    /// The 202 answer of a queue route (`degrade.action = "queue"` or `always_queue`).
    pub queue: Option<Arc<crate::queue::QueueAction>>,
    /// Every request is queued, not only while the route is off.
    pub always_queue: bool,
    /// Its request metrics, found once per policy.
    pub series: crate::metrics::RouteSeries,
}

/// A response written in the policy.
#[derive(Debug, Clone, PartialEq)]
pub struct StaticResponse {
    pub status: http::StatusCode,
    pub content_type: http::HeaderValue,
    pub body: bytes::Bytes,
}

impl Route {
    fn matches(&self, host: Option<&str>, method: &Method, path: &str) -> bool {
        if !self.methods.is_empty() && !self.methods.contains(method) {
            return false;
        }
        if !self.hosts.is_empty() {
            let Some(host) = host else { return false };
            if !self.hosts.iter().any(|pattern| pattern.matches(host)) {
                return false;
            }
        }
        self.path.matches(path)
    }
}

/// Routes in policy order, plus the route for requests that match none of them.
#[derive(Debug, Default)]
pub struct RouteTable {
    pub routes: Vec<Arc<Route>>,
    /// Catch-all on the default upstream; `None` when the policy has no default upstream,
    /// in which case unmatched requests get 404.
    pub fallback: Option<Arc<Route>>,
    /// Whether any route matches on the host: when none does, requests are routed without
    /// looking for theirs (a lookup, a check of every byte and a search for the port).
    by_host: bool,
}

impl RouteTable {
    pub fn new(routes: Vec<Arc<Route>>, fallback: Option<Arc<Route>>) -> RouteTable {
        let by_host = routes.iter().any(|route| !route.hosts.is_empty());
        RouteTable {
            routes,
            fallback,
            by_host,
        }
    }

    /// The host a request names, as `find` needs it: `None` when no route matches on hosts.
    pub fn host_of<'a>(&self, uri: &'a http::Uri, headers: &'a http::HeaderMap) -> Option<&'a str> {
        if self.by_host {
            request_host(uri, headers)
        } else {
            None
        }
    }

    /// `host` is without port (see `host_of`); `path` is normalised.
    pub fn find(&self, host: Option<&str>, method: &Method, path: &str) -> Option<&Arc<Route>> {
        self.routes
            .iter()
            .find(|route| route.matches(host, method, path))
            .or(self.fallback.as_ref())
    }
}

/// The host a request names, without port and without the trailing dot of a fully qualified
/// name (`admin.example.` is `admin.example`, as DNS and nginx's `server_name` have it: a
/// host route must not be dodged by a dot): the `Host` header, or the authority of an
/// absolute-form target.
pub(crate) fn request_host<'a>(
    uri: &'a http::Uri,
    headers: &'a http::HeaderMap,
) -> Option<&'a str> {
    let raw = match headers.get(http::header::HOST) {
        Some(value) => value.to_str().ok()?,
        None => uri.host()?,
    };
    let host = strip_port(raw);
    Some(host.strip_suffix('.').unwrap_or(host))
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        // IPv6 literal: keep the brackets, drop the port.
        return host.find(']').map_or(host, |end| &host[..=end]);
    }
    host.rsplit_once(':').map_or(host, |(name, _port)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_patterns() {
        assert!(HostMatch::parse("Example.com").matches("example.COM"));
        assert!(!HostMatch::parse("example.com").matches("www.example.com"));
        assert!(HostMatch::parse("*.example.com").matches("www.example.com"));
        assert!(!HostMatch::parse("*.example.com").matches(".example.com"));
        assert!(!HostMatch::parse("*.example.com").matches("example.com"));
    }

    #[test]
    fn a_fully_qualified_host_is_the_same_host() {
        let uri: http::Uri = "/".parse().unwrap();
        for (raw, host) in [
            ("admin.example.", "admin.example"),
            ("admin.example.:8080", "admin.example"),
            ("admin.example", "admin.example"),
            ("[::1]:80", "[::1]"),
        ] {
            let mut headers = http::HeaderMap::new();
            headers.insert(http::header::HOST, http::HeaderValue::from_static(raw));
            assert_eq!(request_host(&uri, &headers), Some(host), "{raw}");
        }
        assert!(HostMatch::parse("*.example").matches("admin.example"));
    }

    #[test]
    fn ports_are_stripped() {
        assert_eq!(strip_port("example.com:8080"), "example.com");
        assert_eq!(strip_port("example.com"), "example.com");
        assert_eq!(strip_port("[::1]:8080"), "[::1]");
    }
}
