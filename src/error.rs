//! Request-path errors and the one place they become HTTP responses.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::config::units::Shown;
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
    /// A request levee will not pass on. `reason` is about the request alone, and is what the
    /// client is told (`both Content-Length and Transfer-Encoding`); `detail`, when set, is
    /// the log's fuller account, which may name the policy's parts (the routes or the rule
    /// that made it matter). Made with [`ProxyError::bad_request`] when the two are one.
    #[error("bad request: {}", detail.as_deref().unwrap_or(reason.as_str()))]
    BadRequest {
        reason: String,
        detail: Option<String>,
    },
    #[error("request headers are {size} bytes, over the limit of {limit}")]
    HeadersTooLarge { size: usize, limit: usize },
    #[error("request has more than {limit} header fields")]
    TooManyHeaders { limit: usize },
    #[error("request line is over the limit of {limit} bytes")]
    TargetTooLong { limit: usize },
    #[error("request body is over the limit of {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("client sent the request body too slowly (no data for {})", Shown(*.after))]
    ClientBodyTimeout { after: Duration },
    #[error("no route matches this request and no default upstream is set")]
    NoRoute,
    /// A FastCGI upstream's path that names no `.php` script, with no front controller.
    #[error(
        "`{0}` names no PHP script (levee serves no files; the upstream has no front_controller)"
    )]
    NoScript(String),
    /// A FastCGI upstream's path that names a file under its root (see
    /// `client::Unsendable::StaticFile`): the front nginx should have served it.
    #[error("`{0}` is a file, which levee does not serve")]
    StaticFile(String),
    /// A FastCGI upstream's directory named without its trailing slash: moved to this.
    #[error("a directory: moved to {0}")]
    Directory(String),
    #[error("upstream `{upstream}` could not be reached: {reason}")]
    UpstreamConnect { upstream: String, reason: String },
    /// `waiting_for`: what did not come in time, as words ("answer", "connection", "TLS
    /// handshake").
    #[error("upstream `{upstream}`: no {waiting_for} within {}", Shown(*.after))]
    UpstreamTimeout {
        upstream: String,
        after: Duration,
        waiting_for: &'static str,
    },
    #[error("upstream `{upstream}` failed: {reason}")]
    UpstreamFailed { upstream: String, reason: String },
    #[error("upstream `{upstream}` is cut off by its open breaker; retry after {}", Shown(*.retry_after))]
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
    #[error("rate limited by rule `{}`; retry after {}", .0.rule.name, Shown(.0.retry_after))]
    RateLimited(Box<Denial>),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ProxyError::HeadersTooLarge { .. } | ProxyError::TooManyHeaders { .. } => {
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
            }
            ProxyError::TargetTooLong { .. } => StatusCode::URI_TOO_LONG,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::NoRoute | ProxyError::NoScript(_) | ProxyError::StaticFile(_) => {
                StatusCode::NOT_FOUND
            }
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
            ProxyError::BadRequest { .. } => "bad_request",
            ProxyError::HeadersTooLarge { .. } => "headers_too_large",
            ProxyError::TooManyHeaders { .. } => "too_many_headers",
            ProxyError::TargetTooLong { .. } => "target_too_long",
            ProxyError::BodyTooLarge { .. } => "body_too_large",
            ProxyError::ClientBodyTimeout { .. } => "client_body_timeout",
            ProxyError::NoRoute => "no_route",
            ProxyError::NoScript(_) => "no_script",
            ProxyError::StaticFile(_) => "static_file",
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
            ProxyError::BadRequest { .. }
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::TooManyHeaders { .. }
            | ProxyError::TargetTooLong { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::NoRoute
            | ProxyError::NoScript(_)
            | ProxyError::StaticFile(_)
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

    /// A request refused for what it is, with `reason` both the client's and the log's words.
    pub fn bad_request(reason: impl Into<String>) -> ProxyError {
        ProxyError::BadRequest {
            reason: reason.into(),
            detail: None,
        }
    }

    /// The rescue: the only place a request-path error becomes a response. The body says what
    /// happened as a visitor sees it, and when to come back, in the language the client reads
    /// (`wants_json`, as `answer_format` chooses: JSON for an API client, else a short HTML
    /// page, a rate limit's 429 too);
    /// what levee met (the upstream, its address, the tier, the library's words) stays in the
    /// log line, which is the error's `Display`.
    pub fn to_response(&self, wants_json: bool) -> Response<ResponseBody> {
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
            ProxyError::RateLimited(denial) => return rate_limited_response(denial, wants_json),
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
            _ => self
                .public_answer(retry_after)
                .response(self.status(), wants_json),
        };
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        // levee's own page may say back what the client sent (a path): never sniffed as
        // anything but what it says it is.
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
                | ProxyError::BadRequest { .. }
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

    /// What the visitor is told. Each arm is written for the visitor: no upstream, route or
    /// rule name, no address, tier or duration as Rust prints it. Only the client's own
    /// mistakes (4xx) say what was wrong with the request.
    fn public_answer(&self, retry_after: Option<u64>) -> PublicAnswer {
        let refused = |code, title, reason: String| PublicAnswer {
            code,
            title,
            words: format!("This request cannot be handled: {reason}."),
            reason: Some(reason),
            location: None,
            retry_after: None,
        };
        let later = |code, title, what: &str| PublicAnswer {
            code,
            title,
            words: format!("{what} {}", come_back(retry_after)),
            reason: None,
            location: None,
            retry_after,
        };
        match self {
            ProxyError::BadRequest { reason, .. } => {
                refused("bad_request", "Bad request", reason.clone())
            }
            ProxyError::HeadersTooLarge { size, limit } => refused(
                "headers_too_large",
                "Request headers too large",
                format!("the request headers are {size} bytes, over the limit of {limit}"),
            ),
            ProxyError::TooManyHeaders { limit } => refused(
                "headers_too_large",
                "Request headers too large",
                format!("the request has more than {limit} header fields"),
            ),
            ProxyError::TargetTooLong { limit } => refused(
                "uri_too_long",
                "Request line too long",
                format!("the request line is over the limit of {limit} bytes"),
            ),
            ProxyError::BodyTooLarge { limit } => refused(
                "body_too_large",
                "Request body too large",
                format!("the request body is over the limit of {limit} bytes"),
            ),
            ProxyError::ClientBodyTimeout { .. } => PublicAnswer {
                code: "request_timeout",
                title: "Request timeout",
                words: "The request body arrived too slowly. Please send the request again."
                    .into(),
                reason: Some("the request body arrived too slowly".into()),
                location: None,
                retry_after: None,
            },
            ProxyError::NoRoute | ProxyError::NoScript(_) | ProxyError::StaticFile(_) => PublicAnswer {
                code: "not_found",
                title: "Not found",
                words: "There is no page at this address.".into(),
                reason: None,
                location: None,
                retry_after: None,
            },
            ProxyError::Directory(location) => PublicAnswer {
                code: "moved",
                title: "Moved",
                words: format!("This page is at {location}."),
                reason: None,
                location: Some(location.clone()),
                retry_after: None,
            },
            ProxyError::UpstreamConnect { .. } | ProxyError::UpstreamFailed { .. } => later(
                "bad_gateway",
                "Bad gateway",
                "The site could not answer this request.",
            ),
            ProxyError::UpstreamTimeout { .. } => later(
                "gateway_timeout",
                "Gateway timeout",
                "The site took too long to answer.",
            ),
            ProxyError::BreakerOpen { .. } => later(
                "unavailable",
                "Service unavailable",
                "The site is having trouble right now.",
            ),
            ProxyError::Shed { .. } => later("busy", "Busy", "The site is busy right now."),
            ProxyError::Degraded { .. } => later(
                "unavailable",
                "Service unavailable",
                "This part of the site is switched off for now.",
            ),
            ProxyError::QueueUnavailable {
                unsettled: false, ..
            } => later(
                "not_stored",
                "Not stored",
                "Your request could not be accepted right now, and nothing was stored.",
            ),
            ProxyError::QueueUnavailable {
                unsettled: true, ..
            } => later(
                "unconfirmed",
                "Not confirmed",
                "Whether your request was stored could not be confirmed: it may still take effect. Send it again only with the same Idempotency-Key.",
            ),
            // Answered from the rule's own template (see `rate_limited_response`); these are
            // the words should one ever be asked for.
            ProxyError::RateLimited(_) => later(
                "rate_limited",
                "Too many requests",
                "Too many requests.",
            ),
            ProxyError::Internal(_) => later(
                "internal_error",
                "Internal error",
                "Something went wrong on our side.",
            ),
        }
    }
}

/// "When to come back", in words: the seconds of `Retry-After`, or "later" without one.
fn come_back(retry_after: Option<u64>) -> String {
    match retry_after {
        Some(1) => "Please try again in 1 second.".to_string(),
        Some(seconds) => format!("Please try again in {seconds} seconds."),
        None => "Please try again later.".to_string(),
    }
}

/// The visitor's account of an error (see [`ProxyError::public_answer`]).
struct PublicAnswer {
    /// JSON's `error`: what happened, as a word a program can test (`busy`, `bad_gateway`).
    code: &'static str,
    /// The HTML page's title and heading.
    title: &'static str,
    /// A sentence or two for a person, ending with when to come back.
    words: String,
    /// JSON's `reason`: what was wrong with the request, for the client's own mistakes.
    reason: Option<String>,
    /// JSON's `location`: where a moved page is.
    location: Option<String>,
    /// JSON's `retry_after`, in seconds, as `Retry-After` says and as a 429's body says it.
    retry_after: Option<u64>,
}

impl PublicAnswer {
    /// The body as JSON (`{"error":"busy","retry_after":1}`) or as the short HTML page a
    /// rate limit's 429 is; `status` and the caller's headers make the rest.
    fn response(&self, status: StatusCode, wants_json: bool) -> Response<ResponseBody> {
        let (body, content_type) = if wants_json {
            let mut object = serde_json::Map::new();
            object.insert("error".into(), self.code.into());
            if let Some(reason) = &self.reason {
                object.insert("reason".into(), reason.as_str().into());
            }
            if let Some(location) = &self.location {
                object.insert("location".into(), location.as_str().into());
            }
            if let Some(seconds) = self.retry_after {
                object.insert("retry_after".into(), seconds.into());
            }
            let mut body = serde_json::Value::Object(object).to_string();
            body.push('\n');
            (body, "application/json; charset=utf-8")
        } else {
            (
                visitor_page(self.title, &self.words),
                "text/html; charset=utf-8",
            )
        };
        let mut response = Response::new(full_body(body));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
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

/// levee's own short HTML page: `title` as its heading, `words` (escaped) as its paragraph.
fn visitor_page(title: &str, words: &str) -> String {
    format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\n<body><h1>{title}</h1><p>{}</p></body></html>\n",
        html_text(words),
    )
}

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

/// A refusal by a rate-limit rule: the rule's template (HTML, or JSON when `wants_json`),
/// `Retry-After`, and the IETF `RateLimit-Policy` / `RateLimit` fields unless the rule hides them.
fn rate_limited_response(denial: &Denial, wants_json: bool) -> Response<ResponseBody> {
    let rule = &denial.rule;
    let retry_after = denial.retry_after.as_secs_f64().ceil().max(1.0) as u64;
    let (template, content_type) = if wants_json {
        (
            Some(rule.body_json.as_deref().unwrap_or(DEFAULT_LIMIT_JSON)),
            "application/json; charset=utf-8",
        )
    } else {
        // Without a page of the rule's own: levee's, as its other refusals read.
        (rule.body_html.as_deref(), "text/html; charset=utf-8")
    };
    // Placeholders are filled with numbers and the rule's own name only: nothing the
    // client sent reaches the body. The name is written as the body's language writes text,
    // so a rule named `say "hi"` or `a<b` leaves a JSON body parseable and an HTML page whole.
    let name = if !template.is_some_and(|template| template.contains("{rule}")) {
        String::new()
    } else if wants_json {
        let quoted = serde_json::to_string(&*rule.name).unwrap_or_default();
        quoted
            .strip_prefix('"')
            .and_then(|inner| inner.strip_suffix('"'))
            .unwrap_or_default()
            .to_string()
    } else {
        html_text(&rule.name)
    };
    let body = match template {
        Some(template) => template
            .replace("{retry_after}", &retry_after.to_string())
            .replace("{rule}", &name),
        None => visitor_page("Too many requests", &come_back(Some(retry_after))),
    };
    let mut response = Response::new(full_body(body));
    *response.status_mut() = rule.status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
    // As levee's other pages: a rule's own body is never sniffed as anything else.
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if rule.headers {
        if let Some(Ok(value)) =
            policy_field(rule, denial.quota).map(|field| HeaderValue::from_str(&field))
        {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every error levee answers itself, as the log meets it, with names and figures that
    /// must stay in the log: the upstream `app-7`, its address, the route `secret-route`,
    /// tier 2, a breaker's wait as Rust prints it.
    fn every_error() -> Vec<ProxyError> {
        let upstream = || "app-7".to_string();
        vec![
            ProxyError::BadRequest {
                reason: "the request has two `x-user` fields".into(),
                detail: Some(
                    "the request has two `x-user` fields (rate limit `secret-rule` is keyed by it)"
                        .into(),
                ),
            },
            ProxyError::HeadersTooLarge {
                size: 9000,
                limit: 8192,
            },
            ProxyError::TooManyHeaders { limit: 100 },
            ProxyError::TargetTooLong { limit: 8192 },
            ProxyError::BodyTooLarge { limit: 1000 },
            ProxyError::ClientBodyTimeout {
                after: Duration::from_micros(1_097_686),
            },
            ProxyError::NoRoute,
            ProxyError::NoScript("/secret-route/x".into()),
            ProxyError::StaticFile("/robots.txt".into()),
            ProxyError::Directory("/forum/".into()),
            ProxyError::UpstreamConnect {
                upstream: upstream(),
                reason: "connect to 10.0.0.5:9000: Connection refused (os error 111)".into(),
            },
            ProxyError::UpstreamTimeout {
                upstream: upstream(),
                after: Duration::from_micros(1_097_686),
                waiting_for: "TLS handshake",
            },
            ProxyError::UpstreamFailed {
                upstream: upstream(),
                reason: "read from 10.0.0.5:9000: hyper::Error(IncompleteMessage)".into(),
            },
            ProxyError::BreakerOpen {
                upstream: upstream(),
                retry_after: Duration::from_micros(1_097_686),
                fallback: None,
            },
            ProxyError::Shed {
                upstream: upstream(),
                tier: 2,
                fallback: None,
            },
            ProxyError::QueueUnavailable {
                route: "secret-route".into(),
                unsettled: false,
            },
            ProxyError::QueueUnavailable {
                route: "secret-route".into(),
                unsettled: true,
            },
            ProxyError::Degraded {
                route: "secret-route".into(),
                fallback: None,
            },
            ProxyError::Internal("spool file /var/tmp/levee-123 vanished".into()),
        ]
    }

    async fn body_of(response: Response<ResponseBody>) -> String {
        let bytes = response.into_body().collect().await.expect("a full body");
        String::from_utf8(bytes.to_bytes().to_vec()).expect("UTF-8")
    }

    #[tokio::test]
    async fn a_visitor_reads_no_name_address_tier_or_rust_formatting() {
        for error in every_error() {
            let log = error.to_string();
            for wants_json in [false, true] {
                let response = error.to_response(wants_json);
                assert_eq!(response.status(), error.status(), "{log}");
                let body = body_of(response).await;
                for internal in [
                    "app-7",
                    "10.0.0.5",
                    "secret-route",
                    "secret-rule",
                    "tier",
                    "1.097686",
                    "ms",
                    "os error",
                    "hyper",
                    "/var/tmp",
                    "levee",
                    "upstream",
                    "`app",
                    "max_inflight",
                    "breaker",
                ] {
                    assert!(
                        !body.contains(internal),
                        "{log}: the visitor reads {internal:?} in {body:?}"
                    );
                }
                if wants_json {
                    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
                    assert!(json["error"].is_string(), "{body}");
                } else {
                    assert!(body.starts_with("<!doctype html>"), "{body}");
                }
            }
        }
    }

    #[tokio::test]
    async fn the_log_keeps_what_the_visitor_is_not_told() {
        let logged = every_error()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n");
        for detail in [
            "upstream `app-7` could not be reached: connect to 10.0.0.5:9000",
            "upstream `app-7`: no TLS handshake within",
            "upstream `app-7` is at max_inflight; tier 2 is shed",
            "upstream `app-7` is cut off by its open breaker",
            "the queue of route `secret-route` cannot store work",
            "route `secret-route` is switched off",
            "rate limit `secret-rule` is keyed by it",
            "spool file /var/tmp/levee-123 vanished",
        ] {
            assert!(
                logged.contains(detail),
                "the log lost {detail:?}:\n{logged}"
            );
        }
    }

    #[tokio::test]
    async fn a_refusal_says_when_to_come_back_as_retry_after_does() {
        let shed = ProxyError::Shed {
            upstream: "app".into(),
            tier: 1,
            fallback: None,
        };
        let json = shed.to_response(true);
        assert_eq!(json.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(json.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            json.headers()[header::CONTENT_TYPE],
            "application/json; charset=utf-8"
        );
        assert_eq!(
            body_of(json).await,
            "{\"error\":\"busy\",\"retry_after\":1}\n"
        );
        let page = body_of(shed.to_response(false)).await;
        assert!(
            page.contains("<p>The site is busy right now. Please try again in 1 second.</p>"),
            "{page}"
        );

        // A breaker's wait of 1.097686 s (`1.097686s` as Rust prints it) is said in whole
        // seconds, rounded up, in the header and the words alike.
        let open = ProxyError::BreakerOpen {
            upstream: "app".into(),
            retry_after: Duration::from_micros(1_097_686),
            fallback: None,
        };
        let json = open.to_response(true);
        assert_eq!(json.headers()[header::RETRY_AFTER], "2");
        assert_eq!(
            body_of(json).await,
            "{\"error\":\"unavailable\",\"retry_after\":2}\n"
        );
        let page = body_of(open.to_response(false)).await;
        assert!(page.contains("Please try again in 2 seconds."), "{page}");

        let off = ProxyError::Degraded {
            route: "ranking".into(),
            fallback: None,
        };
        let json = off.to_response(true);
        assert_eq!(json.headers()[header::RETRY_AFTER], "30");
        assert_eq!(
            body_of(json).await,
            "{\"error\":\"unavailable\",\"retry_after\":30}\n"
        );

        // No Retry-After, no number: "later".
        let failed = ProxyError::UpstreamFailed {
            upstream: "app".into(),
            reason: "reset".into(),
        };
        let json = failed.to_response(true);
        assert!(json.headers().get(header::RETRY_AFTER).is_none());
        assert_eq!(body_of(json).await, "{\"error\":\"bad_gateway\"}\n");
    }

    #[tokio::test]
    async fn a_clients_own_mistake_is_explained_and_text_it_sent_stays_text() {
        let bad = ProxyError::bad_request("the header `<b>x` is repeated");
        let page = body_of(bad.to_response(false)).await;
        assert!(
            page.contains("This request cannot be handled: the header `&lt;b&gt;x` is repeated."),
            "{page}"
        );
        let json = body_of(bad.to_response(true)).await;
        let json: serde_json::Value = serde_json::from_str(&json).expect("JSON");
        assert_eq!(json["error"], "bad_request");
        assert_eq!(json["reason"], "the header `<b>x` is repeated");

        let large = ProxyError::BodyTooLarge { limit: 1000 };
        let response = large.to_response(true);
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(response.headers()[header::CONNECTION], "close");
        let json: serde_json::Value = serde_json::from_str(&body_of(response).await).expect("JSON");
        assert_eq!(
            json["reason"],
            "the request body is over the limit of 1000 bytes"
        );

        let moved = ProxyError::Directory("/forum/?a=\"b\"".into());
        let response = moved.to_response(true);
        assert_eq!(response.status(), StatusCode::MOVED_PERMANENTLY);
        assert_eq!(response.headers()[header::LOCATION], "/forum/?a=\"b\"");
        let json: serde_json::Value = serde_json::from_str(&body_of(response).await).expect("JSON");
        assert_eq!(json["location"], "/forum/?a=\"b\"");
    }
}
