//! Request-path errors and the one place they become HTTP responses.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::proxy::body::ResponseBody;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which side of the proxy a failure came from. Upstream failures are the ones that will
/// count against an upstream's circuit breaker; client and internal ones never do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorSide {
    Client,
    Upstream,
    Internal,
}

/// Everything that can stop a request from being answered by its upstream.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("request headers are {size} bytes, over the limit of {limit}")]
    HeadersTooLarge { size: usize, limit: usize },
    #[error("request body is over the limit of {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("client sent the request body too slowly (no data for {after:?})")]
    ClientBodyTimeout { after: Duration },
    #[error("no route matches this request and no default upstream is set")]
    NoRoute,
    #[error("upstream `{upstream}` could not be reached: {reason}")]
    UpstreamConnect { upstream: String, reason: String },
    #[error("upstream `{upstream}` did not answer within {after:?}")]
    UpstreamTimeout { upstream: String, after: Duration },
    #[error("upstream `{upstream}` failed: {reason}")]
    UpstreamFailed { upstream: String, reason: String },
    #[error("internal error: {0}")]
    Internal(String),
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::UpstreamConnect { .. } | ProxyError::UpstreamFailed { .. } => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Short label for metrics (`levee_upstream_errors_total{kind}`) and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyError::BadRequest(_) => "bad_request",
            ProxyError::HeadersTooLarge { .. } => "headers_too_large",
            ProxyError::BodyTooLarge { .. } => "body_too_large",
            ProxyError::ClientBodyTimeout { .. } => "client_body_timeout",
            ProxyError::NoRoute => "no_route",
            ProxyError::UpstreamConnect { .. } => "connect",
            ProxyError::UpstreamTimeout { .. } => "timeout",
            ProxyError::UpstreamFailed { .. } => "failed",
            ProxyError::Internal(_) => "internal",
        }
    }

    pub fn side(&self) -> ErrorSide {
        match self {
            ProxyError::BadRequest(_)
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::NoRoute => ErrorSide::Client,
            ProxyError::UpstreamConnect { .. }
            | ProxyError::UpstreamTimeout { .. }
            | ProxyError::UpstreamFailed { .. } => ErrorSide::Upstream,
            ProxyError::Internal(_) => ErrorSide::Internal,
        }
    }

    /// The rescue: the only place a request-path error becomes a response. The body is one
    /// plain-text line that says what happened; internal details stay in the log.
    pub fn to_response(&self) -> Response<ResponseBody> {
        let status = self.status();
        let reason = match self {
            ProxyError::Internal(_) => "internal error in levee".to_string(),
            other => other.to_string(),
        };
        let mut response = text_response(status, format!("{} {}\n", status.as_u16(), reason));
        if matches!(self, ProxyError::ClientBodyTimeout { .. }) {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
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
