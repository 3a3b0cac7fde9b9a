//! CORS fields on the answers levee writes itself (`[server] cors_origins`).
//!
//! A page of another site that calls the app's JSON API reads the app's answers by the CORS
//! fields the app sets. levee's own answers (a 429, a breaker's 503, a 502, the 202 of a
//! queued write) carried none, so the browser hid them from the page ("Failed to fetch"): a
//! write levee had queued looked failed and was sent again. And a preflight that levee
//! refused kept the browser from sending the request at all, even one a queue would take.
//! Answers relayed from the app keep the app's fields: they are never touched here.

use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};

use crate::error::{ErrorSide, ProxyError};
use crate::proxy::body::{self, ResponseBody};

/// The entry of `cors_origins` that allows every site.
pub const ANY_ORIGIN: &str = "*";

/// The fields of levee's own answers a page may read besides the ones every page may: when
/// to come back, the client's quota, the queued job.
const EXPOSED: &str = "Retry-After, RateLimit, RateLimit-Policy, X-Levee-Job";

/// How long a browser may keep levee's answer to a preflight: short, as levee answers it only
/// while the app cannot, and the app's own (its methods, its headers) should be asked again
/// once it is back.
const PREFLIGHT_MAX_AGE: &str = "60";

/// Marks an answer that levee wrote itself without an error: the 202 of a queued write. (The
/// answers made from errors are known as such where they are made.)
#[derive(Debug, Clone, Copy)]
pub struct OwnAnswer;

/// A request from a page of a site in `cors_origins`: what its answers from levee say back.
#[derive(Debug)]
pub struct CorsRequest {
    /// The request's `Origin`, as sent.
    origin: HeaderValue,
    /// The origin is listed by name: a site the operator trusts, whose pages may read
    /// levee's answers with their cookies, and whose preflights levee answers while the app
    /// cannot. Allowed only by `*`, its pages read levee's answers without cookies, and its
    /// preflights are the app's to answer: approved by levee, a page of any site could send
    /// a write with the visitor's cookies (queued, and applied later) that the app's own CORS
    /// check would have refused.
    listed: bool,
    /// A preflight's `Access-Control-Request-Method` and `Access-Control-Request-Headers`.
    preflight: Option<(HeaderValue, Option<HeaderValue>)>,
}

impl CorsRequest {
    /// The request's CORS side when `origins` allows its `Origin`, else `None`. The caller
    /// checks that `origins` is not empty first: a policy without CORS looks up nothing.
    pub fn of(origins: &[String], method: &Method, headers: &HeaderMap) -> Option<Box<Self>> {
        let origin = headers.get(header::ORIGIN)?;
        let listed = match allows(origins, origin) {
            Allowed::No => return None,
            Allowed::Listed => true,
            Allowed::Any => false,
        };
        let preflight = if listed && method == Method::OPTIONS {
            headers
                .get(header::ACCESS_CONTROL_REQUEST_METHOD)
                .map(|method| {
                    (
                        method.clone(),
                        headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned(),
                    )
                })
        } else {
            None
        };
        Some(Box::new(CorsRequest {
            origin: origin.clone(),
            listed,
            preflight,
        }))
    }

    /// Adds the fields that let the page read an answer of levee's own.
    pub fn add_fields(&self, headers: &mut HeaderMap) {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, self.origin.clone());
        if self.listed {
            headers.insert(
                header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                HeaderValue::from_static("true"),
            );
        }
        headers.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static(EXPOSED),
        );
        // The answer differs by the page that asked: a cache must not give it to another.
        headers.append(header::VARY, HeaderValue::from_static("Origin"));
    }

    /// levee's own answer to a preflight in place of `error`, when `error` is a refusal of
    /// levee's (a limit, an open breaker, a route off, shed) or an upstream it could not
    /// reach: the page then sends the request itself, which levee answers (or queues) and
    /// the page can read. `None` for anything else, and for a request that is no preflight.
    pub fn preflight_answer(&self, error: &ProxyError) -> Option<Response<ResponseBody>> {
        let (method, request_headers) = self.preflight.as_ref()?;
        if !matches!(error.side(), ErrorSide::Defence | ErrorSide::Upstream) {
            return None;
        }
        let mut response = Response::new(body::empty());
        *response.status_mut() = StatusCode::NO_CONTENT;
        let headers = response.headers_mut();
        headers.insert(header::ACCESS_CONTROL_ALLOW_METHODS, method.clone());
        if let Some(request_headers) = request_headers {
            headers.insert(
                header::ACCESS_CONTROL_ALLOW_HEADERS,
                request_headers.clone(),
            );
        }
        headers.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(PREFLIGHT_MAX_AGE),
        );
        Some(response)
    }
}

/// How `origins` allows a page's origin.
#[derive(Debug, PartialEq, Eq)]
enum Allowed {
    No,
    /// Named in the list.
    Listed,
    /// Only by `*`.
    Any,
}

/// Whether `origins` lists `origin` (by name first). Browsers send it in lower case, as the
/// list is kept; any case is taken all the same. `*` allows every site, but not the `null` of
/// a sandboxed page or a local file, which names no site.
fn allows(origins: &[String], origin: &HeaderValue) -> Allowed {
    let origin = origin.as_bytes();
    if origins
        .iter()
        .any(|listed| listed.as_bytes().eq_ignore_ascii_case(origin))
    {
        return Allowed::Listed;
    }
    if origin != b"null" && origins.iter().any(|listed| listed == ANY_ORIGIN) {
        return Allowed::Any;
    }
    Allowed::No
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_matched_as_listed_and_any_names_a_site() {
        let listed = ["https://app.example".to_string()];
        let any = [ANY_ORIGIN.to_string()];
        let origin = HeaderValue::from_static;
        assert_eq!(
            allows(&listed, &origin("https://app.example")),
            Allowed::Listed
        );
        assert_eq!(
            allows(&listed, &origin("https://APP.example")),
            Allowed::Listed
        );
        assert_eq!(
            allows(&listed, &origin("https://app.example.evil")),
            Allowed::No
        );
        assert_eq!(allows(&listed, &origin("http://app.example")), Allowed::No);
        assert_eq!(allows(&any, &origin("https://else.example")), Allowed::Any);
        assert_eq!(allows(&any, &origin("null")), Allowed::No);
        let both = ["*".to_string(), "https://app.example".to_string()];
        assert_eq!(
            allows(&both, &origin("https://app.example")),
            Allowed::Listed
        );
        // Allowed by `*` only: no cookies, and its preflights are the app's.
        let mut headers = HeaderMap::new();
        headers.insert(header::ORIGIN, origin("https://else.example"));
        headers.insert(header::ACCESS_CONTROL_REQUEST_METHOD, origin("POST"));
        let any_page = CorsRequest::of(&both, &Method::OPTIONS, &headers).expect("allowed");
        assert!(any_page.preflight.is_none());
        let mut fields = HeaderMap::new();
        any_page.add_fields(&mut fields);
        assert!(fields.contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN));
        assert!(!fields.contains_key(header::ACCESS_CONTROL_ALLOW_CREDENTIALS));
    }
}
