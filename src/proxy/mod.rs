//! The request path: one request, one policy snapshot, stages in a fixed order.
//!
//! ```text
//! accept (server.rs) → health paths → client identity → route → [degrade] → [rate limit]
//!   → [breaker + bulkhead] → forward → record → respond
//! ```
//! Stages in brackets come with their own modules; each slots in where marked in
//! [`forward`]. Errors from any stage travel up as [`ProxyError`] and become responses in
//! [`ProxyError::to_response`] only.

pub mod body;
pub mod client;
pub mod cors;
mod deadline;
pub mod h1;
pub mod header;
pub mod path;
pub mod route;
mod run_on;
pub mod server;
pub(crate) mod spool;
pub mod upgrade;
pub mod upstream;
pub mod upstream_fields;
mod upstream_time;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{header as h, Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;

use crate::breaker::{AtHead, Outcome, Permit};
use crate::config::policy::AnswerFormat;
use crate::config::{Policy, PolicyStore};
use crate::degrade::hide::{self, HidePlan};
use crate::degrade::stale::{
    self, copy_key, selected_query, Capture, CaptureTarget, CopyKey, Fetch, FetchGuard, StaleStore,
    Waited,
};
use crate::degrade::{CopyQuery, DegradeAction, StaleSettings};
use crate::error::{text_response, ErrorSide, ProxyError};
use crate::limit::key::RequestFacts;
use crate::metrics::{DegradedLabels, ShedLabels};
use crate::metrics::{Metrics, UpstreamErrorLabels};
use body::{find_cause, BodyIdleTimeout, IdleTimeout, Observed, OnBodyEnd, ResponseBody};
use client::ResponseFields;
use h1::{Answer, ClientUpgrade, RequestBody, RequestBodyError};
use route::{Route, RouteName};

/// Boxes the future `make` returns, built in its box. `Box::pin(make())` builds the future on
/// the stack first and then copies it into the box: the whole state machine, kilobytes for the
/// request path's futures, on every request. Allocating first lets the compiler have `make`
/// write straight into the box.
#[inline(always)]
pub(crate) fn boxed_in_place<F: std::future::Future>(
    make: impl FnOnce() -> F,
) -> std::pin::Pin<Box<F>> {
    let room = Box::<F>::new_uninit();
    Box::into_pin(Box::write(room, make()))
}

/// Counts an answer a degrade action gave (`stale`, `stale_missing`, `reject`).
fn count_degraded(shared: &Shared, route: &Route, action: &'static str) {
    shared
        .metrics
        .degraded_responses
        .get_or_create(&DegradedLabels {
            route: route.name.clone(),
            action,
        })
        .inc();
}

/// State shared by every connection of the public listener.
pub struct Shared {
    pub store: Arc<PolicyStore>,
    pub metrics: Arc<Metrics>,
    /// Rate-limit state that outlives policy reloads.
    pub limiter: Arc<crate::limit::Limiter>,
    /// Degrade switches (runtime and automatic) that outlive policy reloads.
    pub degrade: Arc<crate::degrade::Degrade>,
    /// Last good copies of `stale` routes.
    pub stale: Arc<StaleStore>,
    /// Set on SIGTERM: `/readyz` answers 503 while traffic still flows.
    pub draining: AtomicBool,
    /// Set when `shutdown_timeout` ran out: requests still running are cut off by levee, not
    /// by their clients.
    pub cutting_off: AtomicBool,
    /// Queues whose route stopped queueing with jobs still stored: replayed until empty.
    pub former_queues: crate::queue::FormerQueues,
    /// This instance's name in the fleet (host, process id, start time): its queue consumer
    /// and its line of the fleet view.
    pub instance: String,
    /// The log lines of refused requests (see [`rescue`]).
    pub refusals_said: crate::log_throttle::LogBudget,
    /// Cookies the app sets in answers it does not mark private (`learn_private_cookies`).
    pub app_cookies: crate::degrade::app_cookies::AppCookies,
}

/// Refused requests said in the log per second, the rest counted into the next line: a client
/// sending nothing but bad requests wrote one line per request (11,000 a second in a review),
/// with the access log off too. The access log has them all.
pub const REFUSALS_SAID_PER_SECOND: u32 = 20;

/// Handles one request from accept to response head. Never fails: errors become responses.
pub async fn handle(
    shared: Arc<Shared>,
    peer: SocketAddr,
    request: Box<Request<RequestBody>>,
) -> Answer {
    // One snapshot for the whole request, even if a reload swaps the policy meanwhile.
    let policy = shared.store.load();

    // Health paths are levee's own and never proxied; checked before routing so a broken
    // route table or a down backend cannot make levee look dead.
    let raw_path = request.uri().path();
    if raw_path == policy.server.livez_path {
        let mut answer = text_response(StatusCode::OK, "ok\n");
        close_if_draining(&shared, answer.headers_mut());
        return answer.into();
    }
    if raw_path == policy.server.readyz_path {
        let mut answer = if shared.draining.load(Ordering::Relaxed) {
            text_response(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
        } else {
            text_response(StatusCode::OK, "ready\n")
        };
        close_if_draining(&shared, answer.headers_mut());
        return answer.into();
    }

    // A page of another site that may read levee's own answers (boxed: held across the
    // request, in every request's future). Without `cors_origins`, nothing is looked up.
    let cors = if policy.server.cors_origins.is_empty() {
        None
    } else {
        cors::CorsRequest::of(
            &policy.server.cors_origins,
            request.method(),
            request.headers(),
        )
    };

    shared.metrics.inflight.inc();
    let mut exchange = Exchange {
        shared: shared.clone(),
        started: Instant::now(),
        method: request.method().clone(),
        uri: request.uri().clone(),
        client_ip: peer.ip(),
        accept: request
            .headers()
            .get_all(h::ACCEPT)
            .iter()
            .cloned()
            .collect(),
        // The server's until a route is found: a request no route takes is answered in it.
        answer_format: policy.server.answer_format,
        route: None,
        status: StatusCode::OK,
        error: None,
        refused_by: None,
        access_log: policy.server.access_log,
        // For the access log only (one levee before several sites: whose 429 was that?).
        host: if policy.server.access_log {
            request.headers().get(h::HOST).cloned().map(Box::new)
        } else {
            None
        },
        slot: None,
        reported: false,
    };
    let (Answer { response, relayed }, rescued) =
        match forward(&shared, &policy, peer, request, &mut exchange).await {
            Ok(answer) => (answer, false),
            Err(error) => (
                rescue(&shared, &mut exchange, error, cors.as_deref()).into(),
                true,
            ),
        };
    exchange.status = response.status();
    let (mut parts, body) = response.into_parts();
    // The one place levee's own answers (every error's, the 202 of a queued write) get the
    // page's CORS fields; the app's answers keep the app's.
    if let Some(cors) = &cors {
        if rescued || parts.extensions.get::<cors::OwnAnswer>().is_some() {
            cors.add_fields(&mut parts.headers);
        }
    }
    if parts.status != StatusCode::SWITCHING_PROTOCOLS {
        close_if_draining(&shared, &mut parts.headers);
    }
    Answer {
        response: Response::from_parts(parts, {
            let unsent = exchange.method == Method::HEAD;
            Observed::new(body, exchange, unsent).boxed_unsync()
        }),
        relayed,
    }
}

/// Draining: the client (the front) stops reusing this connection after this answer and
/// opens new ones while levee still accepts them, so few idle connections are left for the
/// end of the drain to close under a request the front is just sending (which it could not
/// retry if it is a POST).
fn close_if_draining(shared: &Shared, headers: &mut http::HeaderMap) {
    if shared.draining.load(Ordering::Relaxed) {
        headers.insert(h::CONNECTION, http::HeaderValue::from_static("close"));
    }
}

/// A request's reading of the clock, shared by the breaker, the upstream pool and the response
/// timer: a clock read costs about 25 ns here, and a pass-through request read it a dozen
/// times, as much as a tenth of levee's own time per request. It is read again only after
/// the request waited (a Redis call, a body read ahead, a bulkhead queue): what shares a
/// reading is at most microseconds apart, far below any timeout or breaker window.
struct RequestClock {
    reading: Instant,
    stale: bool,
}

impl RequestClock {
    fn reading(reading: Instant) -> RequestClock {
        RequestClock {
            reading,
            stale: false,
        }
    }

    /// The request waited (or may have): the next `now` reads the clock.
    fn waited(&mut self) {
        self.stale = true;
    }

    fn now(&mut self) -> Instant {
        if self.stale {
            self.reading = Instant::now();
            self.stale = false;
        }
        self.reading
    }
}

/// Request bodies up to this size are read whole before the upstream's breaker permit and
/// bulkhead slot are taken (see `forward`).
const READ_AHEAD: usize = 64 * 1024;

/// A request about to be stored as a job, with what its forwarded fields are set from.
struct JobRequest {
    parts: http::request::Parts,
    received_head: bytes::Bytes,
    from: header::ForwardedFrom,
}

/// A write to a route that queues while it is off, which is queued too when it cannot reach
/// its upstream: the route's queue and the job as the queue path stores it; for a write no
/// connection could take, the copy of its body read before sending.
struct QueueInstead<'a> {
    action: &'a crate::queue::QueueAction,
    job: JobRequest,
    copy: Option<body::ResendableBody>,
}

/// A request's head without its extensions or body (`Parts` is not `Clone`).
fn head_copy<B>(request: &Request<B>) -> http::request::Parts {
    let mut copy = Request::new(());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    copy.into_parts().0
}

/// The answer to a write queued because its upstream could not take it, or `None` when the
/// queue could not store it either (too large for the queue's `max_body`, Redis down): the
/// write then gets the answer it had without a queue (the fallback, a 502), not a 413 that
/// says "never" or a 503 in place of the route's own page.
fn unless_unqueueable(queued: Result<Answer, ProxyError>) -> Option<Result<Answer, ProxyError>> {
    match queued {
        Err(ProxyError::BodyTooLarge { .. })
        | Err(ProxyError::QueueUnavailable {
            unsettled: false, ..
        }) => None,
        answered => Some(answered),
    }
}

/// Queues a write its upstream could not take (see [`QueueInstead`]); `None` when the queue
/// cannot store it either (see [`unless_unqueueable`]).
async fn queue_instead(
    shared: &Shared,
    policy: &Policy,
    route: &Route,
    instead: Box<QueueInstead<'_>>,
    body: body::JobBody,
    allowed_headers: Option<crate::limit::RateLimitHeaders>,
) -> Option<Result<Answer, ProxyError>> {
    let QueueInstead { action, job, .. } = *instead;
    unless_unqueueable(queue_job(shared, policy, route, action, job, body, allowed_headers).await)
}

/// Stores the request as a job on a queue route and answers 202 (see `queue::enqueue`).
/// Boxed, as the rate limit's Redis call is (see above `forward`), and as a `dyn` future: an
/// `async fn` here leaves the compiler unable to prove the request's future `Send` for every
/// lifetime of its borrows.
fn queue_job<'a>(
    shared: &'a Shared,
    policy: &'a Policy,
    route: &'a Route,
    action: &'a crate::queue::QueueAction,
    mut job: JobRequest,
    body: body::JobBody,
    allowed_headers: Option<crate::limit::RateLimitHeaders>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Answer, ProxyError>> + Send + 'a>> {
    // A write whose replay could never run (a FastCGI upstream with no script for its path)
    // gets the answer it would get now, not a 202 for a job bound for the dead letters.
    if let Some(refusal) = route.upstream.client.refusal(job.parts.uri.path()) {
        let refused = unsendable(&refusal);
        return Box::pin(async move { Err(refused) });
    }
    let wants_json = route
        .answer_format
        .is_json(job.parts.headers.get_all(h::ACCEPT));
    // The job is replayed with the headers it is stored with: the forwarded fields levee
    // believes, as a request forwarded now carries them, not what an untrusted client
    // claimed (its `X-Forwarded-Proto: https`).
    header::set_forwarded(
        &mut job.parts.headers,
        job.from.peer,
        job.from.peer_trusted,
        job.from.client,
    );
    Box::pin(async move {
        crate::queue::enqueue(
            policy,
            route,
            action,
            job.parts,
            job.received_head,
            body,
            job.from.client,
            wants_json,
            &shared.metrics,
        )
        .await
        .map(|accepted| with_rate_limit_fields(accepted, allowed_headers).into())
    })
}

/// Everything between routing and the upstream's response head.
///
/// Its future is part of every request's, which the connection boxes (a copy of all of it)
/// and keeps while the upstream answers: the calls that only some requests make and whose
/// state is large (Redis for a rate limit, a queue or a stale copy; a new upstream
/// connection's TLS handshake) are boxed where they are made, so that pass-through requests
/// do not carry their state. Measured with `-Zprint-type-sizes`: `handle`'s future went from
/// 5,720 to 3,528 bytes.
async fn forward(
    shared: &Shared,
    policy: &Policy,
    peer: SocketAddr,
    mut request: Box<Request<RequestBody>>,
    exchange: &mut Exchange,
) -> Result<Answer, ProxyError> {
    let server = &policy.server;
    let mut clock = RequestClock::reading(exchange.started);

    // Limits on what the client sent. The HTTP layer bounds the head while parsing (431);
    // this is the operator's own, usually lower, limit, for the request line (414, as nginx
    // answers a line over its header buffer) and for the fields (431).
    if request_line_bytes(&request) > server.max_header_bytes {
        return Err(ProxyError::TargetTooLong {
            limit: server.max_header_bytes,
        });
    }
    let header_size = header::header_bytes(request.headers());
    if header_size > server.max_header_bytes {
        return Err(ProxyError::HeadersTooLarge {
            size: header_size,
            limit: server.max_header_bytes,
        });
    }

    // Framing both ways at once is how requests are smuggled past a proxy (RFC 9112 6.3).
    // The HTTP layer already settles it (chunked wins, the length is dropped, the connection
    // closes: `h1::parse`); this refusal guards any request that reaches here otherwise.
    if request.headers().contains_key(h::TRANSFER_ENCODING)
        && request.headers().contains_key(h::CONTENT_LENGTH)
    {
        return Err(ProxyError::bad_request(
            "both Content-Length and Transfer-Encoding",
        ));
    }

    // Client identity: forwarded headers count only from trusted proxies.
    let peer_trusted = server.trusted_proxies.contains(peer.ip());
    let client_ip = header::client_ip(peer.ip(), request.headers(), &server.trusted_proxies);
    exchange.client_ip = client_ip;
    let forwarded = header::ForwardedFrom {
        peer: peer.ip(),
        peer_trusted,
        client: client_ip,
    };

    // Route on the normalised path; the upstream still gets the original target.
    let normal_path = path::normalise(request.uri().path())
        .map_err(|error| ProxyError::bad_request(error.to_string()))?;
    let host = policy.routes.host_of(request.uri(), request.headers());
    let route = policy
        .routes
        .find_from(host, request.method(), &normal_path, Some(client_ip))
        .map_err(|disagree| ProxyError::BadRequest {
            reason: disagree.reason(),
            detail: Some(disagree.to_string()),
        })?
        .ok_or(ProxyError::NoRoute)?
        .clone();
    // `/%2Fpost.php` is `/post.php` to nginx but not to an app that keeps `%2F` in a segment:
    // when the two readings fall on different routes, either could escape a route's policy.
    if let Some(decoded) = path::with_encoded_slashes_decoded(request.uri().path())
        .map_err(|error| ProxyError::bad_request(error.to_string()))?
    {
        let decoded_route =
            policy
                .routes
                .find_from(host, request.method(), &decoded, Some(client_ip));
        if !decoded_route
            .as_ref()
            .is_ok_and(|other| other.is_some_and(|other| Arc::ptr_eq(other, &route)))
        {
            return Err(ProxyError::BadRequest {
                reason: "an encoded slash (%2F) in the path changes which part of the site it is for: send the path with plain slashes".into(),
                detail: Some(format!(
                    "an encoded slash (%2F) in the path changes which route applies: `{}` as sent, {} with it decoded",
                    route.name,
                    route_named(&decoded_route)
                )),
            });
        }
    }
    // Frameworks run a POST as the method its override names (Symfony, Laravel, CakePHP,
    // CodeIgniter, Yii), a plain PHP script runs it as the POST it is: when the two readings
    // fall on different routes, either could escape a route's policy.
    if request.method() == Method::POST {
        for (overridden, named_by) in
            route::method_overrides(request.headers(), request.uri().query())
        {
            let other = policy
                .routes
                .find_from(host, &overridden, &normal_path, Some(client_ip));
            if !other
                .as_ref()
                .is_ok_and(|other| other.is_some_and(|other| Arc::ptr_eq(other, &route)))
            {
                return Err(ProxyError::BadRequest {
                    reason: format!(
                        "{named_by} ({overridden}) changes which part of the site this POST is for: send the request as {overridden} itself"
                    ),
                    detail: Some(format!(
                        "{named_by} ({overridden}) changes which route applies to this POST: `{}` as a POST, {} as {overridden}",
                        route.name,
                        route_named(&other)
                    )),
                });
            }
        }
    }
    exchange.route = Some(route.clone());
    exchange.answer_format = route.answer_format;

    // Degrade: a route that is switched off answers with its action, without the upstream.
    let stale = Stale::for_request(
        policy,
        &route,
        &request,
        &normal_path,
        (peer_trusted, &shared.app_cookies),
    );
    let route_off = shared.degrade.view(policy).route_off(&route);
    // Queue routes accept the work now and apply it later instead (after the rate limit).
    // Only work is queued: a page view (GET, HEAD, OPTIONS) answered "accepted" and fetched
    // later for nobody would be neither. Off, it gets the route's refusal; on an
    // `always_queue` route, it is forwarded.
    let queue_now = !request.method().is_safe()
        && (route.always_queue
            || (route_off && matches!(route.degrade, Some(DegradeAction::Queue))));
    if route_off && !queue_now {
        let fallback = match &route.degrade {
            Some(DegradeAction::Reject(response)) => response.clone(),
            _ => route.fallback.clone(),
        };
        let refusal = ProxyError::Degraded {
            route: route.name.to_string(),
            fallback,
        };
        return stale
            .serve_or(shared, policy, &route, refusal, &mut exchange.error)
            .await
            .map(Answer::from);
    }

    // Rate limit: every rule of the route in one decision (one Redis round trip).
    let mut allowed_headers = None;
    if !route.limits.is_empty() {
        let facts = RequestFacts {
            client_ip,
            route: &route.name.0,
            method: request.method(),
            headers: request.headers(),
            query: request.uri().query(),
            identity: &policy.identity,
        };
        allowed_headers = shared
            .limiter
            .check(
                &route.limits,
                &route.fixed_keys,
                policy.redis.as_deref(),
                policy.key_prefix(),
                &facts,
                clock.now(),
            )
            .await?;
        clock.waited();
    }

    if let (true, Some(action)) = (queue_now, &route.queue) {
        header::strip_request_hop_by_hop(request.headers_mut(), false);
        let (parts, mut body) = (*request).into_parts();
        let received_head = body.take_received_head();
        let job = JobRequest {
            parts,
            received_head,
            from: forwarded,
        };
        let body = body
            .map_err(|error| body::ReadBodyError(error.into()))
            .boxed_unsync();
        return queue_job(shared, policy, &route, action, job, body, allowed_headers).await;
    }
    // A write to a route that queues while it is off is queued too when it cannot reach its
    // upstream (breaker open, shed by the bulkhead, no connection): accepted, and applied
    // once the upstream takes work again, instead of refused. Its head is kept as the queue
    // path above stores it, before the changes made below for the upstream's sake.
    let mut queue_when_refused = match (&route.degrade, &route.queue) {
        (Some(DegradeAction::Queue), Some(action)) if !request.method().is_safe() => {
            let mut parts = head_copy(&request);
            header::strip_request_hop_by_hop(&mut parts.headers, false);
            let job = JobRequest {
                parts,
                received_head: request.body().received_head().clone(),
                from: forwarded,
            };
            // Boxed: held across the awaits below, a head in place would grow every
            // request's future (see above `forward`).
            Some(Box::new(QueueInstead {
                action,
                job,
                copy: None,
            }))
        }
        _ => None,
    };

    if let Some(length) = content_length(request.headers()) {
        if length > route.max_body {
            return Err(ProxyError::BodyTooLarge {
                limit: route.max_body,
            });
        }
    }

    // Concurrent requests for a copy being fetched wait for that fetch, before they take a
    // breaker permit or a bulkhead slot: only the one that fetches holds them, and waiters
    // neither fill the pool nor use up a half-open breaker's probes.
    // Only while the breaker is closed: a half-open breaker's fetch is a probe that may take
    // up to response_timeout to fail, and those waiting for it are better served the copy
    // now (the breaker refuses them at once below).
    let (fetch, waited_for_fetch) = if route.upstream.breaker.is_closed() {
        let joined = stale.join(shared, policy, &route).await;
        if stale.key.is_some() {
            clock.waited();
        }
        match joined {
            // The copy carries no one's RateLimit fields: this client gets its own, as it
            // would on an answer fetched for it.
            Joined::Served(mut response) => {
                set_rate_limit_fields(response.headers_mut(), allowed_headers);
                return Ok(response.into());
            }
            Joined::Lead { guard, waited } => (guard, waited),
        }
    } else {
        (None, Duration::ZERO)
    };
    // A request that waited for another's fetch (which brought no copy) waits no longer in
    // all than the upstream's response timeout; one that waited all of it (that fetch timed
    // out, or its page was still coming) is answered as a timeout is: with the copy, or a 504.
    let full_timeout = route.upstream.settings.response_timeout;
    let response_timeout = full_timeout.saturating_sub(waited_for_fetch);
    if response_timeout.is_zero() {
        let timeout = ProxyError::UpstreamTimeout {
            upstream: route.upstream.name.clone(),
            after: full_timeout,
            waiting_for: "answer",
        };
        return stale
            .serve_or(shared, policy, &route, timeout, &mut exchange.error)
            .await
            .map(|copy| with_rate_limit_fields(copy, allowed_headers).into());
    }

    // Page fragments of switched-off modules are cut out of the HTML on the way back.
    let hiding = hidden_fragments(shared, policy, &route);

    // HTTP/1.0 has no upgrade (RFC 9110 7.8): its `Upgrade` is hop-by-hop like any other and
    // goes no further, or the upstream's 101 would reach a client that cannot take one.
    let upgrading = request.version() == Version::HTTP_11 && header::is_upgrade(request.headers());
    // The connection hands itself over once the 101 is written (see `h1::upgrade`).
    let client_upgrade = upgrading
        .then(|| request.extensions_mut().remove::<ClientUpgrade>())
        .flatten()
        .and_then(|upgrade| upgrade.take());
    let upstream = &route.upstream;
    // The request target stays the client's (the client sends its path and query only).
    // The version stays the client's: an HTTP upstream is always sent HTTP/1.1 (see
    // `client::encode_request_head`), and a FastCGI one is told the client's as
    // `SERVER_PROTOCOL`, as nginx tells PHP.
    let (mut parts, mut body) = (*request).into_parts();
    header::strip_request_hop_by_hop(&mut parts.headers, upgrading);
    // The forwarding fields are set as the head is encoded (see `header::ForwardedWriter`).
    let modules_off = hiding
        .as_ref()
        .filter(|_| policy.degrade.tell_app)
        .and_then(|plan| plan.told.clone());
    let told_modules_off = modules_off.is_some();
    let from_client = header::FromClient {
        forwarded: Some(forwarded),
        received_head: body.take_received_head(),
        // The app is told which modules are off, to spare itself their work
        // (`[degrade] tell_app`).
        modules_off,
    };
    if let Some(host) = &upstream.settings.host {
        parts.headers.insert(h::HOST, host.clone());
    }
    if hiding.is_some() || stale.key.is_some() {
        // The page must come back uncompressed to be rewritten, or to be kept as a copy that
        // answers clients of every kind; the front nginx may gzip it.
        parts.headers.remove(h::ACCEPT_ENCODING);
    }
    if hiding.is_some() {
        // A browser's validator names the app's page, which the app would confirm with a 304,
        // and the browser would show the page it cached, blocks of switched-off modules and
        // all: the page is asked for whole, to be cut.
        parts.headers.remove(h::IF_NONE_MATCH);
        parts.headers.remove(h::IF_MODIFIED_SINCE);
        // A range of the app's page is no range of the page once cut (its Content-Range
        // would count bytes that are gone).
        parts.headers.remove(h::RANGE);
        parts.headers.remove(h::IF_RANGE);
    }
    // Most requests (GET) have no body: no limit or idle timer to set up for them.
    let body = if http_body::Body::is_end_stream(&body) {
        body::empty()
    } else {
        let body = Limited::new(
            IdleTimeout::new(body, server.client_body_timeout, "client"),
            usize::try_from(route.max_body).unwrap_or(usize::MAX),
        )
        .boxed_unsync();
        // A body of up to READ_AHEAD bytes is read whole before the request takes a breaker
        // permit or a bulkhead slot: a client trickling its form (each byte within
        // client_body_timeout) holds neither a php-fpm slot nor a half-open probe meanwhile.
        // A longer body holds them while it streams. A client that asked `Expect:
        // 100-continue` is not read ahead: reading would tell it to send a body that an open
        // breaker or a full pool may refuse.
        let read = if expects_continue(&parts.headers) {
            Ok((body, None))
        } else {
            clock.waited();
            // A copy is kept for a request that may be sent again (idempotent), or queued
            // should no connection to the upstream be made (a write to a queue route).
            let keep = client::is_idempotent(&parts.method) || queue_when_refused.is_some();
            body::read_ahead(body, READ_AHEAD, keep).await
        };
        match read {
            Ok((body, copy)) => {
                if let Some(copy) = copy {
                    parts.extensions.insert(copy);
                }
                body
            }
            Err(error) => {
                return Err(
                    classify_body_error(&route, server.client_body_timeout, &*error)
                        .unwrap_or_else(|| unreadable_body(&*error)),
                )
            }
        }
    };

    // Breaker: an open dependency is not called at all; the last good copy or the route's
    // fallback answers. (The common case, a permit for a request sent as it is, is taken
    // first and moved once: every request passes here.)
    let mut permit = match upstream_permit(shared, &route, clock.now(), client_ip) {
        Ok(permit) if !permit.is_probe() || queue_when_refused.is_none() => permit,
        first => {
            let first = match first {
                Ok(permit) => {
                    // A visitor's write is not spent on learning whether the app is back (a
                    // comment sent as the probe of a dead app got its 502, and was lost): a
                    // write the queue can take is queued, and its replay, or a read, probes
                    // instead.
                    let copy = match parts.extensions.get::<body::ResendableBody>() {
                        Some(copy) => Some(copy.clone()),
                        None if http_body::Body::is_end_stream(&body) => {
                            Some(body::ResendableBody::empty())
                        }
                        None => None,
                    };
                    // (A write that asked `Expect: 100-continue` is among them: it is told to
                    // send its body to the queue.)
                    match (copy, queue_when_refused.take()) {
                        (Some(copy), Some(instead)) => {
                            drop(permit);
                            let copy = copy.body().map_err(body::ReadBodyError).boxed_unsync();
                            let headers = allowed_headers.clone();
                            if let Some(answer) =
                                queue_instead(shared, policy, &route, instead, copy, headers).await
                            {
                                return answer;
                            }
                            // The queue cannot store it either: sent as a probe after all.
                            upstream_permit(shared, &route, clock.now(), client_ip)
                        }
                        // A body longer than the read-ahead (a long comment) streams into the
                        // queue as it would past an open breaker; stored or not, it cannot be
                        // sent after that, and a queue that cannot take it leaves the
                        // breaker's answer.
                        (None, Some(instead)) => {
                            drop(permit);
                            queue_when_refused = Some(instead);
                            Err(breaker_refusal(
                                &route,
                                route.upstream.breaker.settings().open_for,
                            ))
                        }
                        (_, instead) => {
                            queue_when_refused = instead;
                            Ok(permit)
                        }
                    }
                }
                Err(refusal) => Err(refusal),
            };
            match first {
                Ok(permit) => permit,
                Err(refusal) => {
                    if let Some(instead) = queue_when_refused {
                        tracing::debug!(route = %route.name, "{refusal}: the write is queued instead");
                        let body = body.map_err(body::ReadBodyError).boxed_unsync();
                        let headers = allowed_headers.clone();
                        if let Some(answer) =
                            queue_instead(shared, policy, &route, instead, body, headers).await
                        {
                            return answer;
                        }
                    }
                    return stale
                        .serve_or(shared, policy, &route, refusal, &mut exchange.error)
                        .await
                        .map(|copy| with_rate_limit_fields(copy, allowed_headers).into());
                }
            }
        }
    };

    // Bulkhead: at max_inflight, tier 3 is shed first, tier 1 keeps its reserve. The slot is
    // held until the response body has been sent, like the php-fpm worker it stands for, and
    // until the upstream answered even when the client went away first (see `run_on`).
    let mut slot = None;
    if let Some(bulkhead) = &route.upstream.bulkhead {
        let acquired = match bulkhead.take_free(route.tier) {
            Some(slot) => Some(slot),
            None => {
                let acquired = bulkhead.acquire(route.tier).await;
                // It may have queued for a slot.
                clock.waited();
                acquired
            }
        };
        match acquired {
            Some(taken) => slot = Some(taken),
            None => {
                shared
                    .metrics
                    .shed
                    .get_or_create(&ShedLabels {
                        upstream: route.upstream.name.clone().into(),
                        tier: route.tier,
                    })
                    .inc();
                if let Some(instead) = queue_when_refused {
                    tracing::debug!(route = %route.name, upstream = %route.upstream.name, "the upstream is full: the write is queued instead");
                    // Not held while the job is stored: a half-open breaker's permit is one of
                    // its few probes.
                    drop(permit);
                    let body = body.map_err(body::ReadBodyError).boxed_unsync();
                    let headers = allowed_headers.clone();
                    let queued = queue_instead(shared, policy, &route, instead, body, headers);
                    if let Some(answer) = queued.await {
                        return answer;
                    }
                }
                let fallback = match &route.degrade {
                    Some(DegradeAction::Reject(response)) => response.clone(),
                    _ => route.fallback.clone(),
                };
                let refusal = ProxyError::Shed {
                    upstream: route.upstream.name.clone(),
                    tier: route.tier,
                    fallback,
                };
                return stale
                    .serve_or(shared, policy, &route, refusal, &mut exchange.error)
                    .await
                    .map(|copy| with_rate_limit_fields(copy, allowed_headers).into());
            }
        }
    }

    // Nothing below reads the upstream's fields unless the page is rewritten, a copy is kept,
    // the connection is upgraded, or the cookies the app sets are learned for the stale
    // routes (`learn_private_cookies`, on any route: the app sets its session anywhere):
    // otherwise they go back to the client as received.
    let fields =
        if hiding.is_none() && stale.key.is_none() && !upgrading && !policy.learns_app_cookies {
            ResponseFields::Relayed
        } else {
            ResponseFields::Parsed
        };
    // A write to a queue route that reaches no upstream at all (refused, unreachable: never
    // sent) is queued, when its body was read whole (or it has none): its head and that copy.
    let body_ended = http_body::Body::is_end_stream(&body);
    let mut queue_if_unsent = queue_when_refused.take().and_then(|mut instead| {
        instead.copy = Some(match parts.extensions.get::<body::ResendableBody>() {
            Some(copy) => copy.clone(),
            None if body_ended => body::ResendableBody::empty(),
            None => return None,
        });
        Some(instead)
    });
    let sent_at = clock.now();
    if body_ended {
        permit.count_if_abandoned_slow(sent_at, &shared.metrics);
    }
    // The response timeout runs from when the request is sent whole: an upload as slow as
    // the client's idle timer allows is not the upstream's failure.
    let request = Request::from_parts(parts, body);
    // A call holding a bulkhead slot, or a half-open breaker's probe, runs on to its answer
    // when its client leaves (see `run_on`).
    let (sent, mut permit) = if slot.is_none() && !permit.is_probe() {
        let sent = run_on::send(
            upstream,
            request,
            fields,
            from_client,
            sent_at,
            response_timeout,
            None,
        )
        .await;
        (sent, permit)
    } else {
        let mut held = run_on::call_holding(
            upstream.clone(),
            request,
            fields,
            from_client,
            sent_at,
            response_timeout,
            slot,
            (permit, shared.metrics.clone()),
        );
        let (sent, permit) = (&mut held).await;
        exchange.slot = held.take_slot();
        (sent, permit)
    };
    // The upstream's own header lines, when they are relayed as received (`fields`).
    let mut relayed = None;
    let mut counts_against_upstream = true;
    let mut never_sent = false;
    let (answer, waited_from) = match sent {
        Err(error) => {
            counts_against_upstream = error.is_upstream_failure();
            never_sent = error.never_sent();
            (
                Err(classify_client_error(
                    &route,
                    server.client_body_timeout,
                    &error,
                )),
                sent_at,
            )
        }
        Ok(answered) => {
            relayed = answered.relayed;
            (Ok(answered.response), answered.request_sent_at)
        }
    };
    if let (Err(ProxyError::UpstreamTimeout { .. }), Some(fetch)) = (&answer, &fetch) {
        fetch.timed_out();
    }
    let answered_at = Instant::now();
    let until_head = answered_at.saturating_duration_since(waited_from);
    // An answer with a body still to come is timed, and its call recorded, when the body
    // ends (see `upstream_time`); but for a failure status, which settles the call at once,
    // and for an event stream, settled at its head: its body is open-ended by design, and
    // timed to its end a healthy stream of a minute counted as a slow call (opening the
    // breaker of an app with `slow_call`) and as a minute of latency (raising the level of a
    // `latency_p95` trigger), and its client's going or a quiet spell cut by
    // `idle_body_timeout` as the app's failure.
    let body_to_come = matches!(&answer, Ok(response)
        if response.status() != StatusCode::SWITCHING_PROTOCOLS
            && !http_body::Body::is_end_stream(response.body())
            && response.extensions().get::<client::EventStream>().is_none());
    let mut call_end = None;
    // Record: only the upstream's own failures count against its breaker.
    let failure_status = match &answer {
        Ok(response) if body_to_come => {
            permit.measure_from(waited_from);
            match permit.record_head(response.status().as_u16(), answered_at, &shared.metrics) {
                AtHead::Failed => true,
                AtHead::BodyToCome(permit) => {
                    call_end = Some(upstream_time::CallEnd {
                        permit,
                        latency: upstream.latency.clone(),
                        metrics: shared.metrics.clone(),
                        until_head,
                        answered_at,
                    });
                    false
                }
            }
        }
        Ok(response) => {
            permit.measure_from(waited_from);
            permit.record_status(response.status().as_u16(), answered_at, &shared.metrics)
        }
        Err(error) if error.side() == ErrorSide::Upstream && counts_against_upstream => {
            permit.record(Outcome::Failure, answered_at, &shared.metrics);
            false
        }
        Err(_) => {
            permit.record(Outcome::Abandoned, answered_at, &shared.metrics);
            false
        }
    };
    if call_end.is_none()
        && answer
            .as_ref()
            .err()
            .is_none_or(|error| error.side() == ErrorSide::Upstream)
    {
        upstream.latency.record(answered_at, until_head);
    }
    let mut response = match answer {
        Ok(response) => response,
        Err(error) if never_sent && queue_if_unsent.is_some() => {
            let Some(mut instead) = queue_if_unsent.take() else {
                return Err(error);
            };
            // The slot stands for a php-fpm worker, and none is busy with this request.
            exchange.slot = None;
            let copy = instead
                .copy
                .take()
                .unwrap_or_else(body::ResendableBody::empty);
            let copy = copy.body().map_err(body::ReadBodyError).boxed_unsync();
            let headers = allowed_headers.clone();
            match queue_instead(shared, policy, &route, instead, copy, headers).await {
                Some(answer) => {
                    // Counted as any upstream failure is (see `rescue`): the app is down even
                    // though this client is answered otherwise. Told once per ten seconds.
                    count_upstream_error(&shared.metrics, &route, error.kind());
                    static QUEUED: crate::log_throttle::LogThrottle =
                        crate::log_throttle::LogThrottle::new(std::time::Duration::from_secs(10));
                    let now = std::time::Instant::now();
                    if let Some(held_back) = answer.is_ok().then(|| QUEUED.allow(now)).flatten() {
                        tracing::warn!(route = %route.name, held_back, "{error}; writes are queued instead");
                    }
                    return answer;
                }
                None => {
                    return stale_if_error(shared, policy, &route, &stale, error, exchange)
                        .await
                        .map(|copy| with_rate_limit_fields(copy, allowed_headers).into())
                }
            }
        }
        // stale-if-error: the last good copy beats an error page.
        Err(error) if error.side() == ErrorSide::Upstream => {
            return stale_if_error(shared, policy, &route, &stale, error, exchange)
                .await
                .map(|copy| with_rate_limit_fields(copy, allowed_headers).into())
        }
        Err(error) => return Err(error),
    };
    if failure_status || stale.answers_for(response.status()) {
        if let Some(copy) = stale
            .counted_copy(shared, policy, &route, &mut exchange.error)
            .await
        {
            return Ok(with_rate_limit_fields(copy, allowed_headers).into());
        }
    }

    if let Some(client_upgrade) = client_upgrade {
        if response.status() == StatusCode::SWITCHING_PROTOCOLS {
            return Ok(upgrade::pass_through(
                client_upgrade,
                &mut response,
                &route,
                policy.server.tunnel_idle_timeout,
            )
            .into());
        }
    }

    let (mut parts, body) = response.into_parts();
    header::strip_hop_by_hop(&mut parts.headers, false);
    if policy.learns_app_cookies && shared.app_cookies.learn(&parts.headers, &route.name.0) {
        if let Some(redis) = &policy.redis {
            crate::degrade::app_cookies::share(redis.clone(), shared.app_cookies.names());
        }
    }
    let body = IdleTimeout::new(body, upstream.settings.idle_body_timeout, "upstream");
    // Inside `SlotHeld`: the rest of a body it reads on after the client left still times
    // the call to its end.
    let body = match call_end {
        Some(end) => upstream_time::Timed::new(body, end).boxed_unsync(),
        None => body.boxed_unsync(),
    };
    // The slot stays taken while the page streams: the script may still be running.
    let body = match exchange.slot.take() {
        Some(slot) => run_on::SlotHeld::new(body, slot, upstream).boxed_unsync(),
        None => body,
    };
    // A good answer of a stale route refreshes its copy as it streams past (and is read on
    // to its end for the copy when this client leaves midway: see `Capture`).
    // A body that ends with the connection may be cut short, and would be kept as whole: not
    // kept (its readers waiting on this fetch go upstream themselves).
    let target = if parts.extensions.get::<client::CloseDelimited>().is_some() {
        None
    } else {
        stale
            .capture_target(
                shared,
                policy,
                &route,
                (parts.status, &parts.headers),
                fetch,
            )
            .map(|target| CaptureTarget {
                keep: !told_modules_off,
                ..target
            })
    };
    let body = match target {
        Some(target) => Capture::new(
            body,
            parts.status,
            (
                &parts.headers,
                parts.extensions.get::<header::ReceivedHead>(),
            ),
            target,
            // A page whose client went away is read on for its copy no longer than the
            // upstream is given for an answer.
            upstream.settings.response_timeout,
        )
        .boxed_unsync(),
        None => body,
    };
    // After the copy took its headers: this client's quota is no one else's.
    set_rate_limit_fields(&mut parts.headers, allowed_headers);
    let response = Response::from_parts(parts, body);
    // Awaited only when modules are off: every other answer goes on without a step more.
    let response = match hiding {
        None => response,
        hiding => without_switched_off_fragments(response, hiding).await,
    };
    Ok(Answer {
        // A page that is rewritten has its fields parsed (`fields` above), never relayed.
        response,
        relayed,
    })
}

/// Sets the RateLimit fields of an admitted request whose rules ask for them (`limit`), in
/// place of any the upstream sent. Every answer to a request that passed the limits gets its
/// own: the app's page, or a copy (which never keeps them, see `Capture`) served to it.
fn set_rate_limit_fields(
    headers: &mut http::HeaderMap,
    limit: Option<crate::limit::RateLimitHeaders>,
) {
    if let Some(limit) = limit {
        headers.insert(header::RATELIMIT_POLICY.clone(), limit.policy);
        headers.insert(header::RATELIMIT.clone(), limit.state);
    }
}

fn with_rate_limit_fields(
    mut response: Response<ResponseBody>,
    limit: Option<crate::limit::RateLimitHeaders>,
) -> Response<ResponseBody> {
    set_rate_limit_fields(response.headers_mut(), limit);
    response
}

/// Cuts the fragments of switched-off modules (`hiding`, from [`hidden_fragments`]) out of an
/// HTML answer: the upstream's, or a stale copy, which is kept whole as the upstream sent it
/// and hidden with the switches of the moment it is served.
/// Fields of the app's answer that no longer hold once a module is cut out of it: the
/// length changes; the validators no longer describe the body (one kept by a browser would
/// have the app confirm a page with the blocks of other switches); the lifetimes caches read
/// besides `Cache-Control` (`Expires`, the front nginx's `X-Accel-Expires`, a CDN's) kept the
/// cut page long after the module was back on; a digest of the body as sent; byte ranges of
/// a body whose offsets are not the app's.
static CUT_PAGE_DROPS: [http::HeaderName; 9] = [
    h::CONTENT_LENGTH,
    h::ETAG,
    h::LAST_MODIFIED,
    h::EXPIRES,
    http::HeaderName::from_static("x-accel-expires"),
    http::HeaderName::from_static("surrogate-control"),
    http::HeaderName::from_static("cdn-cache-control"),
    http::HeaderName::from_static("content-md5"),
    h::ACCEPT_RANGES,
];

async fn without_switched_off_fragments(
    response: Response<ResponseBody>,
    hiding: Option<Arc<HidePlan>>,
) -> Response<ResponseBody> {
    let Some(plan) = hiding else {
        return response;
    };
    // A part of a page (the app answered a range though levee asked for none) cannot be
    // scanned for whole modules, and its `Content-Range` counts the bytes as sent.
    if response.status() == http::StatusCode::PARTIAL_CONTENT {
        return response;
    }
    // A redirect (or a 304, or a 204) shows no page: its fields stay the app's (a
    // canonical 301 came back marked no-cache, which the app had not said).
    if response.status().is_redirection() || response.status() == http::StatusCode::NO_CONTENT {
        return response;
    }
    let Some(encoding) =
        hide::page_encoding(response.headers()).filter(|_| hide::rewritable(response.headers()))
    else {
        return response;
    };
    let (mut parts, body) = response.into_parts();
    let hidden = match hide::open_page(body, plan, encoding).await {
        hide::Opened::Page(hidden) => hidden,
        hide::Opened::Json(body) => return Response::from_parts(parts, body),
    };
    for name in &CUT_PAGE_DROPS {
        parts.headers.remove(name);
    }
    // Nor does its `max-age`: a cache that kept the cut page for it (a browser, the front
    // nginx's proxy_cache, a CDN) showed it without the block long after the module was back
    // on. It is the page of this moment's switches.
    let said = |directive: &[u8]| {
        header::list_elements(&parts.headers, &h::CACHE_CONTROL)
            .any(|element| element.eq_ignore_ascii_case(directive))
    };
    if !said(b"no-store") {
        let lifetime = if said(b"private") {
            "private, no-cache"
        } else {
            "no-cache"
        };
        parts
            .headers
            .insert(h::CACHE_CONTROL, http::HeaderValue::from_static(lifetime));
    }
    Response::from_parts(parts, hidden)
}

/// The stale-copy side of one request: its key (GET or HEAD on a `stale` route only) and
/// settings.
struct Stale {
    key: Option<CopyKey>,
    settings: Option<Arc<StaleSettings>>,
    /// The request carried `Authorization`: its answer is kept only if the app allows it.
    credentials: bool,
    /// The request carried cookies: its answer is not kept when the app says every use of it
    /// must ask the app again (see `why_not_storable`).
    cookies: bool,
    /// On a route that keeps pages setting cookies, the request's `Cookie` field: its answer
    /// is not kept when the app sets one of them again (that visitor's session, renewed).
    carried_cookies: Option<http::HeaderValue>,
    /// What the answer to this request may do for the copy: a GET fetches it and keeps what
    /// comes back; a HEAD is answered from it but its answer (no body) is no copy; a GET
    /// whose client said `Cache-Control: no-store` (RFC 9111 5.2.1.5), or that has a body,
    /// is answered from a copy too, but its answer is not kept; nor is the answer to a path
    /// spelled otherwise than its normal form.
    keeps: bool,
    /// The request asks for part of the page, or for it only if it changed (`Range`,
    /// `If-None-Match`, …): its answer may be a 206 or a 304, which is no copy, so it waits
    /// for a fetch in flight but never leads one (its readers would all go upstream when
    /// it ended without a copy: with many returning visitors, the stampede the single
    /// fetch is there to stop).
    partial: bool,
}

enum Joined {
    /// A concurrent fetch of the same copy finished: its copy answers this request too.
    Served(Response<ResponseBody>),
    /// Go upstream (leading the fetch when the route keeps copies), after `waited` for
    /// another's fetch that brought no copy: all of the response timeout when that fetch
    /// timed out, or this request's wait for it lasted that long.
    Lead {
        guard: Option<FetchGuard>,
        waited: Duration,
    },
}

impl Stale {
    /// Whether the route's copy answers in place of the app's own `status` (`on_status`),
    /// one the breaker does not count: a request with a copy key only.
    fn answers_for(&self, status: StatusCode) -> bool {
        self.key.is_some()
            && self
                .settings
                .as_ref()
                .is_some_and(|settings| settings.on_status.contains(&status.as_u16()))
    }

    fn for_request(
        policy: &Policy,
        route: &Route,
        request: &Request<RequestBody>,
        normal_path: &str,
        (peer_trusted, app_cookies): (bool, &crate::degrade::app_cookies::AppCookies),
    ) -> Stale {
        let none = Stale {
            key: None,
            settings: None,
            credentials: false,
            cookies: false,
            carried_cookies: None,
            keeps: false,
            partial: false,
        };
        let Some(DegradeAction::Stale(settings)) = &route.degrade else {
            return none;
        };
        // A logged-in user's, a commenter's or a cart's page, which such apps send without
        // `Cache-Control: private`: this visitor gets neither a copy nor another's fetch, and
        // others never get this visitor's page.
        if crate::limit::key::has_cookie(request.headers(), &settings.private_cookies) {
            return none;
        }
        // Likewise one the app sets without marking its answers private (a session of its own
        // name on pages that say nothing of caching). On a route that keeps pages setting
        // cookies (an app that starts a session on every page), such a visitor may still be
        // answered from the copy when the app fails (a guest's page, its cookies dropped), but
        // never shares another's fetch nor has its answer kept: a logged-in user got a guest's
        // page (and token) with the app healthy, and a guest the user's.
        let carries_learned = settings.learn_private_cookies
            && app_cookies.carried_by(request.headers(), &settings.vary);
        if carries_learned && !settings.allow_set_cookie {
            return none;
        }
        let method = request.method();
        let key = (method == Method::GET || method == Method::HEAD).then(|| {
            // Byte for byte, as rate-limit keys read them: two Latin-1 cookies are two pages.
            let mut vary: Vec<Vec<u8>> = settings
                .vary
                .iter()
                .map(|source| {
                    source
                        .read_bytes(request.headers(), request.uri().query())
                        .map(|value| value.into_owned())
                        .unwrap_or_default()
                })
                .collect();
            // The host and scheme a trusted front says the visitor used: the app may build
            // its links from them (an untrusted peer's are dropped before the app sees them).
            // Last, and only when there are some. (A front that sets `X-Forwarded-Proto`, as
            // most do, gives every key this part: copies kept by a levee without it are not
            // found again, and are fetched anew once.)
            if peer_trusted {
                vary.extend(header::forwarded_description(request.headers()));
            }
            // One route may serve several sites of one vhost: the page is the one the app
            // makes for the host it is sent, as it is sent (port and trailing dot kept: an
            // app that builds links from `HTTP_HOST` prints them, so `example.com:6666`'s page
            // is no copy for `example.com`); only its case is the client's whim.
            let host = match &route.upstream.settings.host {
                Some(pinned) => pinned.to_str().ok(),
                None => request
                    .headers()
                    .get(h::HOST)
                    .and_then(|host| host.to_str().ok())
                    .or_else(|| {
                        request
                            .uri()
                            .authority()
                            .map(|authority| authority.as_str())
                    }),
            }
            .unwrap_or("")
            .to_ascii_lowercase();
            copy_key(
                policy.key_prefix(),
                &route.name.0,
                &host,
                normal_path,
                selected_query(request.uri().query(), &settings.query).as_deref(),
                &vary,
            )
        });
        let client_says_no_store = header::list_elements(request.headers(), &h::CACHE_CONTROL)
            .any(|directive| directive.eq_ignore_ascii_case(b"no-store"));
        // A GET with a body neither fetches the copy nor keeps its answer: the app may read
        // the body (`php://input`), which the key does not, and the body comes at the
        // client's pace, which would hold every reader of the page waiting for the fetch.
        let bodiless = http_body::Body::is_end_stream(request.body());
        // Nor is the answer kept when the app may read a part of the key otherwise than the
        // key does (two `Cookie` fields, a selected parameter past PHP's `max_input_vars`):
        // a page made for one value would be kept for another's readers, as rate limits
        // refuse such requests for the same reason (`limit::key::unreadable_part`).
        let query = request.uri().query();
        let ambiguous = || {
            settings
                .vary
                .iter()
                .any(|source| source.unreadable(request.headers(), query).is_some())
                || match (&settings.query, query) {
                    (CopyQuery::Only(names), Some(query)) => {
                        crate::limit::key::names_past_input_vars(query, names)
                    }
                    _ => false,
                }
        };
        // The app reads the target as the client spelled it (`REQUEST_URI`), the key its
        // normalised path: an answer to `/x/../page.php` or `//evil.example/../page.php` may
        // print that spelling, and kept (or shared with the readers of a fetch it led) it
        // would be every visitor's `/page.php`. Such a request is answered from the copy, but
        // its own answer is no copy.
        let spelled_as_keyed = request.uri().path() == normal_path;
        Stale {
            key,
            settings: Some(settings.clone()),
            credentials: request.headers().contains_key(h::AUTHORIZATION),
            cookies: request.headers().contains_key(h::COOKIE),
            carried_cookies: request
                .headers()
                .get(h::COOKIE)
                .filter(|_| settings.allow_set_cookie)
                .cloned(),
            // A WebSocket's upgrade request is no page view: it is answered by its own 101.
            keeps: !carries_learned
                && method == Method::GET
                && spelled_as_keyed
                && !client_says_no_store
                && bodiless
                && !request.headers().contains_key(h::UPGRADE)
                && !ambiguous(),
            partial: [
                h::RANGE,
                h::IF_RANGE,
                h::IF_NONE_MATCH,
                h::IF_MODIFIED_SINCE,
                h::IF_MATCH,
                h::IF_UNMODIFIED_SINCE,
            ]
            .iter()
            .any(|name| request.headers().contains_key(name)),
        }
    }

    /// The last good copy, if there is one young enough, marked stale.
    async fn copy(
        &self,
        shared: &Shared,
        policy: &Policy,
        route: &Route,
    ) -> Option<Response<ResponseBody>> {
        let (Some(key), Some(settings)) = (&self.key, &self.settings) else {
            return None;
        };
        // Boxed, as the rate limit's Redis call is: see above `forward`.
        let copy = Box::pin(shared.stale.get(
            key,
            settings,
            policy.redis.as_deref(),
            &shared.metrics,
        ))
        .await?;
        if copy.age() > settings.max_age {
            return None;
        }
        Some(
            without_switched_off_fragments(
                copy.to_response(true),
                hidden_fragments(shared, policy, route),
            )
            .await,
        )
    }

    /// Serves the last good copy, or answers with `refusal` when there is none. (The caller
    /// counts nothing: this does, in `levee_degraded_responses_total`.) `logged`: the access
    /// log's `error`, which says `stale` for a copy served.
    async fn serve_or(
        &self,
        shared: &Shared,
        policy: &Policy,
        route: &Route,
        refusal: ProxyError,
        logged: &mut Option<&'static str>,
    ) -> Result<Response<ResponseBody>, ProxyError> {
        if self.settings.is_some() {
            if let Some(response) = self.counted_copy(shared, policy, route, logged).await {
                return Ok(response);
            }
        } else if matches!(refusal, ProxyError::Degraded { .. }) {
            count_degraded(shared, route, "reject");
        }
        Err(refusal)
    }

    /// [`Self::copy`] on a stale route, counted as the degrade action's answer: `stale`, or
    /// `stale_missing` when there is none to serve.
    async fn counted_copy(
        &self,
        shared: &Shared,
        policy: &Policy,
        route: &Route,
        logged: &mut Option<&'static str>,
    ) -> Option<Response<ResponseBody>> {
        self.settings.as_ref()?;
        let served = self.copy(shared, policy, route).await;
        let action = if served.is_some() {
            // In the access log as the answer levee gave in the app's stead, as `shed` is;
            // why the app was not asked is in the log line of that event (breaker opened,
            // level raised, the upstream's failure).
            *logged = Some("stale");
            "stale"
        } else {
            "stale_missing"
        };
        count_degraded(shared, route, action);
        served
    }

    /// Leads the fetch of this copy, or waits for the fetch already in flight: at most the
    /// upstream's response timeout in all, as long as the request would wait for an answer of
    /// its own, while the upstream makes the page (its head, then a body the app is still
    /// writing); but only until the leader's client has held the body back for
    /// [`stale::MAX_READER_HOLD`], as that client may read slowly.
    async fn join(&self, shared: &Shared, policy: &Policy, route: &Route) -> Joined {
        let Some(key) = self.key.as_ref().filter(|_| self.keeps) else {
            return Joined::Lead {
                guard: None,
                waited: Duration::ZERO,
            };
        };
        let fetch = if self.partial {
            shared.stale.fetch_in_flight(&key.key)
        } else {
            Some(shared.stale.fetch(&key.key))
        };
        let waiting = match fetch {
            Some(Fetch::Lead(guard)) => {
                return Joined::Lead {
                    guard: Some(guard),
                    waited: Duration::ZERO,
                }
            }
            Some(Fetch::Wait(receiver)) => receiver,
            None => {
                return Joined::Lead {
                    guard: None,
                    waited: Duration::ZERO,
                }
            }
        };
        let started = Instant::now();
        let waited = stale::wait_for_copy(
            waiting,
            route.upstream.settings.response_timeout,
            stale::MAX_READER_HOLD,
        )
        .await;
        match waited {
            Waited::Copy(copy) => {
                // A sample of the upstream's latency as this visitor met it: the requests a
                // slow page's one fetch answers are most of its requests, and counted as one
                // call, a page served to a crowd in 1.5 s each never reached a `latency_p95`
                // trigger's `min_calls`.
                let now = Instant::now();
                route
                    .upstream
                    .latency
                    .record(now, now.saturating_duration_since(started));
                Joined::Served(
                    without_switched_off_fragments(
                        copy.to_response(false),
                        hidden_fragments(shared, policy, route),
                    )
                    .await,
                )
            }
            // The fetch failed, gave nothing to keep, or its client holds the body back: go
            // upstream ourselves.
            Waited::GoUpstream => Joined::Lead {
                guard: None,
                waited: started.elapsed(),
            },
            // No head within this request's response timeout, or the fetch timed out: a fetch
            // of its own would be no quicker. It is answered below as a timeout is, with the
            // route's copy (within `max_age`, marked stale) or a 504. (A page whose head came
            // is waited for while the app writes it: see `wait_for_copy`. A waiter is not
            // served an older copy while the page is coming: the route is healthy, and the
            // page being fetched is the current one. A site that wants its copies served while
            // the app is too busy says so with a trigger.)
            Waited::TimedOut => Joined::Lead {
                guard: None,
                waited: route.upstream.settings.response_timeout,
            },
        }
    }

    fn capture_target(
        &self,
        shared: &Shared,
        policy: &Policy,
        route: &Route,
        (status, headers): (StatusCode, &http::HeaderMap),
        guard: Option<FetchGuard>,
    ) -> Option<CaptureTarget> {
        let (Some(key), Some(settings), true) = (&self.key, &self.settings, self.keeps) else {
            return None;
        };
        if let Some(reason) =
            stale::why_not_storable(status, headers, settings, self.credentials, self.cookies)
        {
            if status == StatusCode::OK {
                not_kept(shared, route, reason);
            }
            return None;
        }
        // Before levee has learned the app's session cookie (a new deployment), a logged-in
        // user's page that the app marks public was kept, and served to a stranger.
        if let Some(carried) = &self.carried_cookies {
            if crate::degrade::app_cookies::sets_a_carried_cookie(headers, carried) {
                not_kept(shared, route, "own_cookie");
                return None;
            }
        }
        // A page that sets a cookie is its visitor's: kept (`allow_set_cookie`) without it for
        // an outage, but not handed to the requests waiting for this fetch on a healthy site,
        // which go upstream for their own (they got this visitor's session-bound page, CSRF
        // token and all, and no session of their own).
        let guard = guard.filter(|_| !headers.contains_key(http::header::SET_COOKIE));
        if let Some(guard) = &guard {
            guard.answered();
        }
        Some(CaptureTarget {
            store: shared.stale.clone(),
            key: key.clone(),
            redis: policy.redis.clone(),
            metrics: shared.metrics.clone(),
            settings: settings.clone(),
            guard,
            keep: true,
        })
    }
}

/// Counts a 200 of a stale route that is not kept as its copy, and says why at most once a
/// minute: a page that starts a session on every view (`Set-Cookie`) is never kept, and the
/// route has no copy to serve when the app fails, which no one learned before the outage.
fn not_kept(shared: &Shared, route: &Route, reason: &'static str) {
    shared
        .metrics
        .stale_not_kept
        .get_or_create(&crate::metrics::NotKeptLabels {
            route: route.name.clone(),
            reason,
        })
        .inc();
    if route.series.said_due(reason, std::time::Instant::now()) {
        tracing::info!(route = %route.name, reason, "an answer of 200 was not kept as the route's stale copy: {}", stale::not_kept_because(reason));
    }
}

/// The plan for hiding this route's modules that are off now (their selectors and marker
/// names), if any is.
fn hidden_fragments(shared: &Shared, policy: &Policy, route: &Route) -> Option<Arc<HidePlan>> {
    if route.hide.is_empty() {
        return None;
    }
    // One snapshot of the switches: the key below and the plan made from it agree.
    let view = shared.degrade.view(policy);
    // Which of the route's fragments are hidden, one bit each: the key of their plan (a
    // fragment past the 64th has no bit; such a route makes its plan every time, below).
    let (mut off, mut any_off) = (0u64, false);
    for (index, (module, _)) in route.hide.iter().enumerate() {
        if view.module_off(module) {
            any_off = true;
            let bit = u32::try_from(index)
                .ok()
                .and_then(|index| 1u64.checked_shl(index));
            off |= bit.unwrap_or(0);
        }
    }
    if !any_off {
        return None;
    }
    let make = || {
        let (mut selectors, mut markers, mut modules) = (Vec::new(), Vec::new(), Vec::new());
        for (module, selector) in &route.hide {
            if view.module_off(module) {
                if selector == hide::MARKER {
                    markers.push(module.clone());
                } else {
                    selectors.push(selector.clone());
                }
                if !modules.contains(&module.as_str()) {
                    modules.push(module.as_str());
                }
            }
        }
        HidePlan::new(selectors, markers).telling(&modules)
    };
    Some(if route.hide.len() <= 64 {
        route.hide_plans.get_or_make(off, make)
    } else {
        Arc::new(make())
    })
}

/// Asks the route's upstream breaker for permission to call it.
fn upstream_permit(
    shared: &Shared,
    route: &Route,
    now: Instant,
    client_ip: std::net::IpAddr,
) -> Result<Permit, ProxyError> {
    let client = crate::limit::client_network(client_ip);
    route
        .upstream
        .breaker
        .admit(now, client, &shared.metrics)
        .map_err(|retry_after| breaker_refusal(route, retry_after))
}

/// The answer of the route's breaker that lets no call through.
fn breaker_refusal(route: &Route, retry_after: Duration) -> ProxyError {
    ProxyError::BreakerOpen {
        upstream: route.upstream.name.clone(),
        retry_after,
        fallback: route.fallback.clone(),
    }
}

/// The route a reading of the request falls on, named for the log.
fn route_named<E: std::fmt::Display>(found: &Result<Option<&Arc<Route>>, E>) -> String {
    match found {
        Ok(Some(route)) => format!("`{}`", route.name),
        Ok(None) => "no route".to_string(),
        Err(disagree) => format!("none that is sure ({disagree})"),
    }
}

/// The answer to a request whose body failed otherwise than [`classify_body_error`] knows:
/// the client is told only that it could not be read, the log what failed.
pub(crate) fn unreadable_body(error: &(dyn std::error::Error + 'static)) -> ProxyError {
    ProxyError::BadRequest {
        reason: "the request body could not be read".to_string(),
        detail: Some(format!(
            "request body could not be read: {}",
            error_chain(error)
        )),
    }
}

/// Sorts a failed upstream call into the client's fault or the upstream's.
/// The answer to a request whose own body failed: too large, broken by the client, or
/// stalled. `None` when the failure is not the client's body.
fn classify_body_error(
    route: &Route,
    client_body_timeout: std::time::Duration,
    error: &(dyn std::error::Error + 'static),
) -> Option<ProxyError> {
    if find_cause::<LengthLimitError>(error).is_some() {
        return Some(ProxyError::BodyTooLarge {
            limit: route.max_body,
        });
    }
    // The client's own body broke (it went away, or sent broken chunked framing): not
    // the upstream's failure.
    if let Some(broken) = find_cause::<RequestBodyError>(error) {
        let reason = match broken {
            // The connection's own failure (a reset) says nothing the client needs.
            RequestBodyError::Io(_) => "the request body could not be read".to_string(),
            other => other.to_string(),
        };
        return Some(ProxyError::BadRequest {
            reason,
            detail: Some(broken.to_string()),
        });
    }
    // levee lost the body it kept for php-fpm: its own failure, not the upstream's.
    if let Some(lost) = find_cause::<spool::SpoolError>(error) {
        return Some(ProxyError::Internal(lost.to_string()));
    }
    match find_cause::<BodyIdleTimeout>(error) {
        Some(idle) if idle.side == "client" => Some(ProxyError::ClientBodyTimeout {
            after: client_body_timeout,
        }),
        _ => None,
    }
}

fn classify_client_error(
    route: &Route,
    client_body_timeout: std::time::Duration,
    error: &client::ClientError,
) -> ProxyError {
    let upstream = route.upstream.name.clone();
    if let Some(error) = classify_body_error(route, client_body_timeout, error) {
        return error;
    }
    if let client::ClientError::Unsendable(refusal) = error {
        return unsendable(refusal);
    }
    if let client::ClientError::ResponseTimeout(after) = error {
        // The upstream's timeout, also where a request that waited for another's fetch had
        // only what was left of it.
        return ProxyError::UpstreamTimeout {
            upstream,
            after: (*after).max(route.upstream.settings.response_timeout),
            waiting_for: "answer",
        };
    }
    let reason = error_chain(error);
    if error.is_connect() {
        if let Some(waiting_for) = error.connect_timed_out() {
            return ProxyError::UpstreamTimeout {
                upstream,
                after: route.upstream.settings.connect_timeout,
                waiting_for,
            };
        }
        return ProxyError::UpstreamConnect { upstream, reason };
    }
    ProxyError::UpstreamFailed { upstream, reason }
}

/// The answer to a request a FastCGI upstream cannot be given (see `client::Unsendable`).
fn unsendable(refusal: &client::Unsendable) -> ProxyError {
    match refusal {
        client::Unsendable::NulInPath => ProxyError::bad_request(refusal.to_string()),
        client::Unsendable::NoScript(path) => ProxyError::NoScript(path.clone()),
        client::Unsendable::StaticFile(path) => ProxyError::StaticFile(path.clone()),
        client::Unsendable::Directory(location) => ProxyError::Directory(location.clone()),
        client::Unsendable::TooLong {
            size,
            limit,
            in_target: false,
            ..
        } => ProxyError::HeadersTooLarge {
            size: *size,
            limit: *limit,
        },
        client::Unsendable::TooLong { limit, .. } => ProxyError::TargetTooLong { limit: *limit },
    }
}

/// `outer: inner: innermost`, for one-line logs.
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        // Some errors print their source as part of their own message already.
        let inner_text = inner.to_string();
        if !text.ends_with(&inner_text) {
            text.push_str(": ");
            text.push_str(&inner_text);
        }
        source = inner.source();
    }
    text
}

/// The bytes of the request line as the client sent it (`GET /target HTTP/1.1` and CRLF);
/// an absolute-form target (`http://host/…`) counts whole.
fn request_line_bytes<B>(request: &Request<B>) -> usize {
    let uri = request.uri();
    let target = uri
        .path_and_query()
        .map_or(1, |target| target.as_str().len())
        + uri
            .scheme_str()
            .map_or(0, |scheme| scheme.len() + "://".len())
        + uri
            .authority()
            .map_or(0, |authority| authority.as_str().len());
    request.method().as_str().len() + " ".len() + target + " HTTP/1.1\r\n".len()
}

/// Did the client ask to be told before it sends its body?
fn expects_continue(headers: &http::HeaderMap) -> bool {
    // Any of its fields, as the connection that sends the `100 Continue` reads them.
    headers
        .get_all(h::EXPECT)
        .iter()
        .any(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// Does the client prefer JSON (an API client) over HTML (a browser)? By the weights of its
/// `Accept` fields (`text/html;q=0.1, application/json` is an API client's), the first named
/// winning a tie; a client that names neither gets HTML. Asked only under
/// `answer_format = "by_accept"` (see [`AnswerFormat::is_json`]).
pub(crate) fn prefers_json<'a>(accept: impl IntoIterator<Item = &'a http::HeaderValue>) -> bool {
    // (weight, place) of the best media range naming each.
    type Best = Option<(u16, usize)>;
    let (mut json, mut html): (Best, Best) = (None, None);
    let ranges = accept
        .into_iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','));
    for (place, range) in ranges.enumerate() {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or("").trim();
        let weight = parts
            .filter_map(|param| param.split_once('='))
            .find(|(name, _)| name.trim().eq_ignore_ascii_case("q"))
            .map_or(1000, |(_, value)| accept_weight(value.trim()));
        if weight == 0 {
            continue;
        }
        let media = media.to_ascii_lowercase();
        let best = if media.contains("json") {
            &mut json
        } else if media.contains("html") {
            &mut html
        } else {
            continue;
        };
        if best.is_none_or(|(known, _)| weight > known) {
            *best = Some((weight, place));
        }
    }
    match (json, html) {
        (Some((json_weight, json_place)), Some((html_weight, html_place))) => {
            json_weight > html_weight || (json_weight == html_weight && json_place < html_place)
        }
        (Some(_), None) => true,
        _ => false,
    }
}

/// A `q` value in thousandths (RFC 9110 12.4.2: `0`, `1`, `0.x` with up to three digits);
/// one that is not a weight counts as 1, as the range was named.
fn accept_weight(value: &str) -> u16 {
    let (whole, fraction) = value.split_once('.').unwrap_or((value, ""));
    if whole != "0" || fraction.len() > 3 || !fraction.bytes().all(|byte| byte.is_ascii_digit()) {
        return 1000;
    }
    // `0.5` is 500: the digits given, then zeros (`0` and `0.` are 0).
    fraction.parse::<u16>().unwrap_or(0) * [1, 100, 10, 1][fraction.len()]
}

pub(crate) fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(h::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse().ok())
}

/// `levee_upstream_errors_total` of the route's upstream, by the error's kind.
fn count_upstream_error(metrics: &Metrics, route: &Route, kind: &'static str) {
    // (A route a reload removed: its upstream may have gone with it, and its series too.)
    if route.series.is_retired() {
        return;
    }
    metrics
        .upstream_errors
        .get_or_create(&UpstreamErrorLabels {
            upstream: route.upstream.name.clone().into(),
            kind,
        })
        .inc();
}

/// The last good copy in place of an upstream's failure, or the failure (to `rescue`) when
/// there is none. The failure is the app's all the same: counted, and logged as `rescue`
/// would (at most once per ten seconds, as a down app's stale route may answer thousands a
/// second), so a down app behind stale routes is not seen only in the degrade counters.
async fn stale_if_error(
    shared: &Shared,
    policy: &Policy,
    route: &Route,
    stale: &Stale,
    error: ProxyError,
    exchange: &mut Exchange,
) -> Result<Response<ResponseBody>, ProxyError> {
    let Some(copy) = stale
        .counted_copy(shared, policy, route, &mut exchange.error)
        .await
    else {
        return Err(error);
    };
    count_upstream_error(&shared.metrics, route, error.kind());
    let throttle = &route.upstream.covered_failures;
    if let Some(held_back) = throttle.allow(std::time::Instant::now()) {
        tracing::warn!(client = %exchange.client_ip, method = %exchange.method, path = %exchange.uri, held_back, "{error}; the last good copy answered instead");
    }
    Ok(copy)
}

/// Requests for a file under a FastCGI upstream's root (see [`ProxyError::StaticFile`]): one
/// warn line a minute.
static STATIC_FILE_SAID: crate::log_throttle::LogThrottle =
    crate::log_throttle::LogThrottle::new(std::time::Duration::from_secs(60));

/// The one place a request-path error is logged, counted and turned into a response. A
/// preflight from a page in `cors_origins` (`cors`) that levee refused, or could not take to
/// the app, is answered by levee, so the page sends the request itself and can read its answer.
fn rescue(
    shared: &Shared,
    exchange: &mut Exchange,
    error: ProxyError,
    cors: Option<&cors::CorsRequest>,
) -> Response<ResponseBody> {
    exchange.error = Some(error.kind());
    if let ProxyError::RateLimited(denial) = &error {
        exchange.refused_by = Some(denial.rule.clone());
    }
    let path = LoggedTarget::of(shared, &exchange.uri, true);
    match error.side() {
        ErrorSide::Upstream => {
            if let Some(route) = &exchange.route {
                count_upstream_error(&shared.metrics, route, error.kind());
            }
            tracing::warn!(client = %exchange.client_ip, method = %exchange.method, %path, "{error}");
        }
        // The site's setup, not the client: said at warn (once a minute, any path), or an
        // operator saw pages answer 404 that nginx served from disk, with nothing saying why.
        // Not for a hidden file (`/.env`, `/.git/config`): bots probe for those all day, and
        // no front should serve them.
        ErrorSide::Client if matches!(&error, ProxyError::StaticFile(file) if !file.contains("/.")) => {
            if let Some(held_back) = STATIC_FILE_SAID.allow(std::time::Instant::now()) {
                tracing::warn!(client = %exchange.client_ip, method = %exchange.method, %path, held_back, "refused: {error}; the front nginx serves the site's files (nginx.conf: try_files $uri @levee)");
            }
        }
        ErrorSide::Client => match shared.refusals_said.allow(std::time::Instant::now()) {
            Some(held_back) => {
                tracing::info!(client = %exchange.client_ip, method = %exchange.method, %path, held_back, "refused: {error}")
            }
            None => {
                tracing::debug!(client = %exchange.client_ip, method = %exchange.method, %path, "refused: {error}")
            }
        },
        ErrorSide::Defence => {
            // Counted in metrics and the access log; one line each would flood the log.
            tracing::debug!(client = %exchange.client_ip, method = %exchange.method, %path, "{error}");
        }
        ErrorSide::Internal => {
            tracing::error!(client = %exchange.client_ip, method = %exchange.method, %path, "{error}");
        }
    }
    if let Some(answer) = cors.and_then(|cors| cors.preflight_answer(&error)) {
        return answer;
    }
    // The log line above has what levee met; the client gets the visitor's words.
    error.to_response(exchange.answer_format.is_json(&exchange.accept))
}

/// A request target as log lines show it: printable, with the values of the query
/// parameters the policy reads users and API keys from as `***` (`?api_key=SECRET` was in
/// clear in every line, where Redis keys hash them), and, in the lines of refusals (`cut`),
/// its first [`LOGGED_TARGET`] bytes and its length: a line echoed a 30 KB target whole, and
/// a client could make levee's log as large as its requests.
struct LoggedTarget<'a> {
    shared: &'a Shared,
    uri: &'a Uri,
    cut: bool,
}

/// The most of a target a refusal's log line shows.
const LOGGED_TARGET: usize = 512;

impl<'a> LoggedTarget<'a> {
    fn of(shared: &'a Shared, uri: &'a Uri, cut: bool) -> LoggedTarget<'a> {
        LoggedTarget { shared, uri, cut }
    }
}

/// Made when the line is written, not for every refusal whose line a level leaves out (a
/// flood of 429s at debug).
impl std::fmt::Display for LoggedTarget<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A target without a query has nothing to hide: the policy is not even looked at.
        let redacted = self
            .uri
            .path_and_query()
            .filter(|_| self.uri.query().is_some())
            .and_then(|target| {
                let policy = self.shared.store.load();
                policy.identity.redacted_target(target.as_str())
            });
        if !self.cut && redacted.is_none() {
            return crate::printable::PrintableUri(self.uri).fmt(f);
        }
        let whole = redacted.unwrap_or_else(|| self.uri.to_string());
        let whole = crate::printable::printable(&whole);
        match whole.get(..LOGGED_TARGET) {
            Some(shown) if self.cut && whole.len() > LOGGED_TARGET => {
                write!(f, "{shown}… ({} bytes)", whole.len())
            }
            _ => f.write_str(&whole),
        }
    }
}

/// What the access log and metrics need to know about one request; reported when the
/// response body ends, so duration and bytes cover the whole transfer.
struct Exchange {
    shared: Arc<Shared>,
    started: Instant,
    method: Method,
    uri: Uri,
    client_ip: IpAddr,
    /// The request's `Accept` fields (shared with the request's head, not copied): an error
    /// met after the request went upstream is still answered in the language the client
    /// reads (see [`rescue`]).
    accept: smallvec::SmallVec<[http::HeaderValue; 1]>,
    /// The form of levee's own answer: the route's `answer_format` once the request has one,
    /// the server's before.
    answer_format: AnswerFormat,
    route: Option<Arc<Route>>,
    status: StatusCode,
    error: Option<&'static str>,
    /// The limit rule that refused the request (`rule=` in the access log: a route may list
    /// several).
    refused_by: Option<Arc<crate::limit::LimitRule>>,
    access_log: bool,
    /// The request's `Host`, kept when the access log is on (boxed: every request moves
    /// the exchange, and most run without the access log).
    host: Option<Box<http::HeaderValue>>,
    /// The upstream's bulkhead slot, freed when the response body is done.
    slot: Option<crate::degrade::bulkhead::Slot>,
    /// Set once the exchange is in the log and the metrics.
    reported: bool,
}

impl OnBodyEnd for Exchange {
    fn on_body_end(mut self, bytes: u64, complete: bool, failure: Option<String>) {
        if let Some(failure) = failure {
            // The head went out as the upstream's, so the client sees only a cut answer; the
            // log and `levee_upstream_errors_total` say it was the upstream (it looked like a
            // client that went away).
            self.error = Some("body_cut");
            let upstream = self
                .route
                .as_ref()
                .map_or("-", |route| route.upstream.name.as_str());
            if let Some(route) = &self.route {
                count_upstream_error(&self.shared.metrics, route, "body_cut");
            }
            tracing::warn!(
                client = %self.client_ip,
                method = %self.method,
                path = %LoggedTarget::of(&self.shared, &self.uri, false),
                "upstream `{upstream}`'s answer was cut off after {bytes} bytes of its body: {failure}"
            );
        } else if !complete && self.shared.cutting_off.load(Ordering::Relaxed) {
            // A stream or a download still going when `shutdown_timeout` ran out: levee's
            // stop cut it, not the client (it read `complete=false error=-`, as a client's
            // going does).
            self.error = Some("cut_off_at_shutdown");
        }
        self.report(bytes, complete);
    }
}

/// A client that closes its connection before the answer cancels the request: the exchange is
/// dropped without a body ever ending. It is still counted (as nginx's 499, "client closed
/// request") and logged, and the in-flight gauge comes back down.
impl Drop for Exchange {
    fn drop(&mut self) {
        if !self.reported {
            if self.shared.cutting_off.load(Ordering::Relaxed) {
                // levee stopped before it answered: its failure, not the client's going.
                self.status = StatusCode::SERVICE_UNAVAILABLE;
                self.error = Some("cut_off_at_shutdown");
            } else {
                self.status = StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST);
                self.error = Some("client_closed");
            }
            self.report(0, false);
        }
    }
}

impl Exchange {
    fn report(&mut self, bytes: u64, complete: bool) {
        self.reported = true;
        let metrics = &self.shared.metrics;
        metrics.inflight.dec();
        let elapsed = self.started.elapsed();
        let unrouted;
        let (route_name, series) = match &self.route {
            Some(route) => (&route.name, Some(&route.series)),
            None => {
                unrouted = RouteName(Arc::from("-"));
                (&unrouted, None)
            }
        };
        metrics.record_request(
            route_name,
            series,
            self.status.as_u16(),
            elapsed.as_secs_f64(),
        );
        if self.access_log {
            let upstream = self
                .route
                .as_ref()
                .map_or("-", |route| route.upstream.name.as_str());
            // The host the request was routed by: an absolute-form target's, else `Host`'s.
            let host = match self.uri.authority() {
                Some(authority) => authority.as_str(),
                None => self
                    .host
                    .as_ref()
                    .and_then(|host| host.to_str().ok())
                    .unwrap_or("-"),
            };
            tracing::info!(
                target: "levee::access",
                client = %self.client_ip,
                method = %self.method,
                host = %crate::printable::printable(host),
                path = %LoggedTarget::of(&self.shared, &self.uri, false),
                route = %route_name,
                upstream,
                status = self.status.as_u16(),
                // Whole microseconds: `2.062`, not the float noise of `2.0620130000000003`.
                duration_ms = elapsed.as_micros() as f64 / 1000.0,
                bytes,
                complete,
                error = self.error.unwrap_or("-"),
                // Only on a rate limit's refusal (a field left out when `None`).
                rule = self.refused_by.as_ref().map(|rule| &*rule.name),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_or_html_is_chosen_by_accept_weights() {
        let wants = |accept: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(h::ACCEPT, accept.parse().expect("value"));
            prefers_json(headers.get_all(h::ACCEPT))
        };
        assert!(wants("application/json"));
        assert!(!wants("text/html,application/xhtml+xml,*/*;q=0.8"));
        assert!(wants("application/json, text/html"));
        assert!(!wants("text/html, application/json"));
        // Weights, not places, when they differ.
        assert!(wants("text/html;q=0.1, application/json"));
        assert!(!wants("application/json;q=0.1, text/html"));
        assert!(wants("text/html;q=0.5, application/problem+json;q=0.9"));
        // `q=0` names what the client does not take.
        assert!(!wants("application/json;q=0, text/html"));
        assert!(!wants("*/*"));
        assert!(!wants(""));
        assert_eq!(
            [
                accept_weight("0"),
                accept_weight("0.5"),
                accept_weight("0.05"),
                accept_weight("1.0"),
                accept_weight("x")
            ],
            [0, 500, 50, 1000, 1000]
        );
    }

    #[test]
    fn an_error_chain_names_each_cause_once() {
        let refused = client::ClientError::Connect {
            target: "127.0.0.1:8081".into(),
            source: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused"),
        };
        assert_eq!(error_chain(&refused), "connect to 127.0.0.1:8081: refused");
        let wrapped = std::io::Error::other(refused);
        assert_eq!(error_chain(&wrapped), "connect to 127.0.0.1:8081: refused");
    }

    #[test]
    fn a_resent_request_that_cannot_connect_fails_as_a_connect_but_may_have_been_sent() {
        let failed = |kind| client::ClientError::Connect {
            target: "127.0.0.1:8081".into(),
            source: std::io::Error::new(kind, "no"),
        };
        let first = failed(std::io::ErrorKind::ConnectionRefused);
        assert!(first.never_sent() && first.is_connect());
        let resent = client::ClientError::Resent(Box::new(first));
        assert!(resent.is_connect(), "answered 502 as a connect failure");
        assert!(resent.connect_timed_out().is_none());
        assert!(
            !resent.never_sent(),
            "the first try may have reached the app"
        );
        assert_eq!(
            error_chain(&resent),
            "connect to 127.0.0.1:8081: no (sent again after a pooled connection closed)"
        );
        let slow = client::ClientError::Resent(Box::new(failed(std::io::ErrorKind::TimedOut)));
        assert_eq!(slow.connect_timed_out(), Some("connection"), "answered 504");
    }
}
