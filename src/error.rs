//! Request-path errors and the one place they become HTTP responses.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::limit::{policy_field, state_field, Denial};
use crate::proxy::body::ResponseBody;
use crate::proxy::header::{RATELIMIT, RATELIMIT_POLICY};
use crate::proxy::route::StaticResponse;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which side of the proxy a failure came from. Upstream failures are the ones that will
/// count against an upstream's circuit breaker; client and internal ones never do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorSide {
    Client,
    Upstream,
    /// Refused on purpose by one of levee's defences (rate limit, open breaker, degrade).
    Defence,
    Internal,
}

/// The words of a queue route's 503: "nothing was stored" only when levee knows it.
fn queue_unavailable(route: &str, unsettled: bool) -> String {
    if unsettled {
        format!("the queue of route `{route}` could not confirm the work was stored: it may still be applied; send it again only with the same Idempotency-Key")
    } else {
        format!("the queue of route `{route}` cannot store work right now; nothing was stored")
    }
}

/// The `Retry-After` of a refusal whose end is an operator's call (a module or level switched
/// off, a breaker pinned open): nothing tells when it ends, so clients are asked back later.
pub const OPERATORS_CALL: Duration = Duration::from_secs(30);

/// Everything that can stop a request from being answered by its upstream.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("request headers are {size} bytes, over the limit of {limit}")]
    HeadersTooLarge { size: usize, limit: usize },
    #[error("request has more than {limit} header fields")]
    TooManyHeaders { limit: usize },
    #[error("request line is over the limit of {limit} bytes")]
    TargetTooLong { limit: usize },
    #[error("request body is over the limit of {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("client sent the request body too slowly (no data for {after:?})")]
    ClientBodyTimeout { after: Duration },
    #[error("no route matches this request and no default upstream is set")]
    NoRoute,
    /// A FastCGI upstream's path that names no `.php` script, with no front controller.
    #[error(
        "`{0}` names no PHP script (levee serves no files; the upstream has no front_controller)"
    )]
    NoScript(String),
    /// A FastCGI upstream's directory named without its trailing slash: moved to this.
    #[error("a directory: moved to {0}")]
    Directory(String),
    #[error("upstream `{upstream}` could not be reached: {reason}")]
    UpstreamConnect { upstream: String, reason: String },
    /// `waiting_for`: what did not come in time, as words ("answer", "connection", "TLS
    /// handshake").
    #[error("upstream `{upstream}`: no {waiting_for} within {after:?}")]
    UpstreamTimeout {
        upstream: String,
        after: Duration,
        waiting_for: &'static str,
    },
    #[error("upstream `{upstream}` failed: {reason}")]
    UpstreamFailed { upstream: String, reason: String },
    #[error("upstream `{upstream}` is cut off by its open breaker; retry after {retry_after:?}")]
    BreakerOpen {
        upstream: String,
        retry_after: Duration,
        fallback: Option<Arc<StaticResponse>>,
    },
    #[error("upstream `{upstream}` is at max_inflight; tier {tier} is shed")]
    Shed {
        upstream: String,
        tier: u8,
        fallback: Option<Arc<StaticResponse>>,
    },
    #[error("{}", queue_unavailable(route, *unsettled))]
    QueueUnavailable {
        route: String,
        /// The write went out, its answer was lost, and asking Redis what became of it
        /// failed too: Redis may have stored it (and kept it through a crash).
        unsettled: bool,
    },
    #[error("route `{route}` is switched off for now")]
    Degraded {
        route: String,
        fallback: Option<Arc<StaticResponse>>,
    },
    #[error("rate limited by rule `{}`; retry after {:?}", .0.rule.name, .0.retry_after)]
    RateLimited(Box<Denial>),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::HeadersTooLarge { .. } | ProxyError::TooManyHeaders { .. } => {
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
            }
            ProxyError::TargetTooLong { .. } => StatusCode::URI_TOO_LONG,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::NoRoute | ProxyError::NoScript(_) => StatusCode::NOT_FOUND,
            ProxyError::Directory(_) => StatusCode::MOVED_PERMANENTLY,
            ProxyError::UpstreamConnect { .. } | ProxyError::UpstreamFailed { .. } => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::RateLimited(denial) => denial.rule.status,
            ProxyError::QueueUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::BreakerOpen { fallback, .. }
            | ProxyError::Degraded { fallback, .. }
            | ProxyError::Shed { fallback, .. } => fallback
                .as_ref()
                .map_or(StatusCode::SERVICE_UNAVAILABLE, |fallback| fallback.status),
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Short label for metrics (`levee_upstream_errors_total{kind}`) and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyError::BadRequest(_) => "bad_request",
            ProxyError::HeadersTooLarge { .. } => "headers_too_large",
            ProxyError::TooManyHeaders { .. } => "too_many_headers",
            ProxyError::TargetTooLong { .. } => "target_too_long",
            ProxyError::BodyTooLarge { .. } => "body_too_large",
            ProxyError::ClientBodyTimeout { .. } => "client_body_timeout",
            ProxyError::NoRoute => "no_route",
            ProxyError::NoScript(_) => "no_script",
            ProxyError::Directory(_) => "directory",
            ProxyError::UpstreamConnect { .. } => "connect",
            ProxyError::UpstreamTimeout { .. } => "timeout",
            ProxyError::UpstreamFailed { .. } => "failed",
            ProxyError::RateLimited(_) => "rate_limited",
            ProxyError::BreakerOpen { .. } => "breaker_open",
            ProxyError::Degraded { .. } => "degraded",
            ProxyError::Shed { .. } => "shed",
            ProxyError::QueueUnavailable { .. } => "queue_unavailable",
            ProxyError::Internal(_) => "internal",
        }
    }

    pub fn side(&self) -> ErrorSide {
        match self {
            ProxyError::BadRequest(_)
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::TooManyHeaders { .. }
            | ProxyError::TargetTooLong { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::NoRoute
            | ProxyError::NoScript(_)
            | ProxyError::Directory(_) => ErrorSide::Client,
            ProxyError::UpstreamConnect { .. }
            | ProxyError::UpstreamTimeout { .. }
            | ProxyError::UpstreamFailed { .. } => ErrorSide::Upstream,
            ProxyError::RateLimited(_)
            | ProxyError::BreakerOpen { .. }
            | ProxyError::Degraded { .. }
            | ProxyError::Shed { .. }
            | ProxyError::QueueUnavailable { .. } => ErrorSide::Defence,
            ProxyError::Internal(_) => ErrorSide::Internal,
        }
    }

    /// The rescue: the only place a request-path error becomes a response. The body is one
    /// plain-text line that says what happened; internal details stay in the log.
    pub fn to_response(&self) -> Response<ResponseBody> {
        let retry_after = match self {
            ProxyError::BreakerOpen { retry_after, .. } => {
                Some(retry_after.as_secs_f64().ceil().max(1.0) as u64)
            }
            // How long a switch stays off is an operator's call; ask clients to come back later.
            ProxyError::Degraded { .. } => Some(OPERATORS_CALL.as_secs()),
            ProxyError::Shed { .. } => Some(1),
            ProxyError::QueueUnavailable { .. } => Some(5),
            _ => None,
        };
        let mut response = match self {
            ProxyError::RateLimited(denial) => return rate_limited_response(denial),
            ProxyError::BreakerOpen {
                fallback: Some(fallback),
                ..
            }
            | ProxyError::Degraded {
                fallback: Some(fallback),
                ..
            }
            | ProxyError::Shed {
                fallback: Some(fallback),
                ..
            } => {
                let mut response = static_response(fallback);
                // The operator's own page says "later" too: as the default one, it tells
                // clients when (a status that is not a refusal has no use for it).
                if let (Some(seconds), 429 | 503) = (retry_after, fallback.status.as_u16()) {
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
                }
                return response;
            }
            _ => {
                let status = self.status();
                let reason = match self {
                    ProxyError::Internal(_) => "internal error in levee".to_string(),
                    other => other.to_string(),
                };
                text_response(status, format!("{} {}\n", status.as_u16(), reason))
            }
        };
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        // levee's own line may say back what the client sent (a path): never read as HTML.
        response.headers_mut().insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        if let ProxyError::Directory(location) = self {
            // From the request's own target, which holds only what a header value can.
            if let Ok(location) = HeaderValue::from_str(location) {
                response.headers_mut().insert(header::LOCATION, location);
            }
        }
        // After a malformed or refused request the rest of the connection cannot be trusted to
        // be framed the way the client meant it: close it instead of reading on.
        if matches!(
            self,
            ProxyError::ClientBodyTimeout { .. }
                | ProxyError::BadRequest(_)
                | ProxyError::HeadersTooLarge { .. }
                | ProxyError::TooManyHeaders { .. }
                | ProxyError::TargetTooLong { .. }
                | ProxyError::BodyTooLarge { .. }
        ) {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// A response written in the policy (a friendly page or a JSON error).
pub fn static_response(fallback: &StaticResponse) -> Response<ResponseBody> {
    let mut response = Response::new(full_body(fallback.body.clone()));
    *response.status_mut() = fallback.status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, fallback.content_type.clone());
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// A small plain-text response answered by levee itself.
pub fn text_response(status: StatusCode, body: impl Into<Bytes>) -> Response<ResponseBody> {
    let mut response = Response::new(full_body(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

pub fn full_body(body: impl Into<Bytes>) -> ResponseBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

const DEFAULT_LIMIT_HTML: &str = "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>Too many requests</title></head>\n<body><h1>Too many requests</h1><p>Please try again in {retry_after} s.</p></body></html>\n";
const DEFAULT_LIMIT_JSON: &str =
    "{\"error\":\"rate_limited\",\"rule\":\"{rule}\",\"retry_after\":{retry_after}}\n";

/// `text` with HTML's special characters written as references.
fn html_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A refusal by a rate-limit rule: the rule's template (HTML or JSON by `Accept`),
/// `Retry-After`, and the IETF `RateLimit-Policy` / `RateLimit` fields unless the rule hides them.
fn rate_limited_response(denial: &Denial) -> Response<ResponseBody> {
    let rule = &denial.rule;
    let retry_after = denial.retry_after.as_secs_f64().ceil().max(1.0) as u64;
    let (template, content_type) = if denial.wants_json {
        (
            rule.body_json.as_deref().unwrap_or(DEFAULT_LIMIT_JSON),
            "application/json; charset=utf-8",
        )
    } else {
        (
            rule.body_html.as_deref().unwrap_or(DEFAULT_LIMIT_HTML),
            "text/html; charset=utf-8",
        )
    };
    // Placeholders are filled with numbers and the rule's own name only: nothing the
    // client sent reaches the body. The name is written as the body's language writes text,
    // so a rule named `say "hi"` or `a<b` leaves a JSON body parseable and an HTML page whole.
    let name = if !template.contains("{rule}") {
        String::new()
    } else if denial.wants_json {
        let quoted = serde_json::to_string(&*rule.name).unwrap_or_default();
        quoted
            .strip_prefix('"')
            .and_then(|inner| inner.strip_suffix('"'))
            .unwrap_or_default()
            .to_string()
    } else {
        html_text(&rule.name)
    };
    let body = template
        .replace("{retry_after}", &retry_after.to_string())
        .replace("{rule}", &name);
    let mut response = Response::new(full_body(body));
    *response.status_mut() = rule.status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
    if rule.headers {
        if let Some(Ok(value)) = policy_field(rule).map(|field| HeaderValue::from_str(&field)) {
            headers.insert(RATELIMIT_POLICY.clone(), value);
        }
        let reset = denial.reset.max(denial.retry_after);
        if let Some(Ok(value)) =
            state_field(rule, 0, reset).map(|field| HeaderValue::from_str(&field))
        {
            headers.insert(RATELIMIT.clone(), value);
        }
    }
    response
}
