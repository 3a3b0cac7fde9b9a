//! The admin listener: status, metrics, switches and reload for operators. It listens on its own
//! address (default `127.0.0.1:9901`) and is never reachable through the public listener.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub mod client;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use http_body_util::BodyExt;

use crate::breaker::Force;
use crate::config::ReloadTrigger;
use crate::degrade::switches::{self, Change};
use crate::error::{full_body, text_response};
use crate::proxy::body::ResponseBody;
use crate::proxy::route::{HostMatch, PathMatch, Route};
use crate::proxy::Shared;
use crate::queue::{worker, QueueKeys};
use crate::redis_store::RedisFailure;

/// Answers one admin request.
/// Marks every answer of the admin listener, so the CLI can tell it from the site: pointed at
/// the public listener by mistake, `levee level 1` would get the app's 200 for its POST and
/// report a level set that nothing set.
pub static ADMIN_MARK: http::HeaderName = http::HeaderName::from_static("x-levee-admin");

pub async fn handle(
    shared: Arc<Shared>,
    peer: std::net::SocketAddr,
    request: Request<Incoming>,
) -> Response<ResponseBody> {
    let mut response = answer(shared, peer, request).await;
    response.headers_mut().insert(
        ADMIN_MARK.clone(),
        HeaderValue::from_static(env!("CARGO_PKG_VERSION")),
    );
    // A refusal echoes what it refuses (`` `<script>` is not a level ``): as text/plain
    // only, never sniffed into a page.
    response.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

async fn answer(
    shared: Arc<Shared>,
    peer: std::net::SocketAddr,
    request: Request<Incoming>,
) -> Response<ResponseBody> {
    if let Err(response) = loopback_host(&shared, &request) {
        return *response;
    }
    // Changing state needs a token whenever tokens are configured. Reading is open on a
    // loopback listener, but beyond loopback it needs a token too: `/status` maps the site's
    // dependencies and the dead letters show clients' addresses and queries. Where tokens
    // are set, dead letters need one on loopback as well: the PHP app on the same machine
    // reaches loopback, and a page of it that fetches a URL a visitor names (server-side
    // request forgery) would hand the visitor other clients' queries (reset links, tokens).
    // The dashboard page itself holds no data, nor does the icon a browser asks for with it.
    let reading = request.method() == Method::GET || request.method() == Method::HEAD;
    let policy = shared.store.load();
    let admin = &policy.admin;
    let path = request.uri().path();
    // Everything under `/queues/` (dead letters are all there is): judged on the raw path,
    // which the handler decodes, a `%64ead` spelled `dead` passed for another path here.
    let holds_requests = path.starts_with("/queues/");
    let open_on_loopback = !holds_requests || admin.tokens.is_empty();
    let open_read = reading
        && (matches!(path, "/" | "/dashboard" | "/favicon.ico")
            || (admin.listen.ip().to_canonical().is_loopback() && open_on_loopback));
    let token_name = if open_read {
        None
    } else {
        match authorize(&shared, &request, peer) {
            Ok(name) => name,
            Err(response) => return *response,
        }
    };
    let peer_or_token = |request: &Request<Incoming>| match &token_name {
        Some(name) => format!("{name} ({peer})"),
        None => operator(request, peer),
    };
    // A HEAD is answered as its GET, without the body (the server leaves it out).
    let method = if request.method() == Method::HEAD {
        Method::GET
    } else {
        request.method().clone()
    };
    match (&method, request.uri().path()) {
        (&Method::POST, "/level") => {
            let by = peer_or_token(&request);
            let wanted = match read_word(request).await {
                Ok(wanted) => wanted,
                Err(response) => return response,
            };
            let change = match wanted.as_str() {
                "policy" | "auto" => Change::Level(None),
                text => match text.parse::<u8>() {
                    Ok(level) => Change::Level(Some(level)),
                    Err(_) => return text_response(StatusCode::BAD_REQUEST, format!("400 `{}` is not a level; send 0, 1, 2 or policy\n", text.escape_debug())),
                },
            };
            apply_switch(&shared, change, &by).await
        }
        (&Method::POST, path) if path.starts_with("/modules/") => {
            let name = path_segment(path.trim_start_matches("/modules/"));
            let by = peer_or_token(&request);
            let wanted = match read_word(request).await {
                Ok(wanted) => wanted,
                Err(response) => return response,
            };
            let change = match wanted.as_str() {
                "off" => Change::Module(name, Some(true)),
                "on" => Change::Module(name, Some(false)),
                "policy" | "auto" => Change::Module(name, None),
                other => return text_response(StatusCode::BAD_REQUEST, format!("400 `{}` is not a module state; send on, off or policy\n", other.escape_debug())),
            };
            apply_switch(&shared, change, &by).await
        }
        (&Method::GET, "/" | "/dashboard") => dashboard(),
        // Asked for by every browser that opens the dashboard: none, without a 404 in its
        // console (or in levee's log).
        (&Method::GET | &Method::HEAD, "/favicon.ico") => {
            let mut response = Response::new(full_body(""));
            *response.status_mut() = StatusCode::NO_CONTENT;
            response
        }
        (&Method::GET, "/status") => {
            let mut answer = status(&shared);
            let policy = shared.store.load();
            answer["fleet"] = crate::degrade::fleet::status(&shared, &policy).await;
            json_response(StatusCode::OK, &answer)
        }
        (&Method::GET, "/metrics") => {
            let page = shared.metrics.scrape(|| {
                publish_upstream_states(&shared);
                let policy = shared.store.load();
                switches::publish_gauges(&shared.degrade, &policy, &shared.metrics, true);
                // Read now: a background call may have found Redis back, or gone, since the
                // last rate-limit call set it.
                // Without a `[redis]` (a reload took it out) nothing is down: an alert on 0
                // set while it was there must clear.
                let redis = shared.store.load().redis.clone();
                let up = redis.as_ref().is_none_or(|redis| redis.is_up());
                shared.metrics.redis_up.set(i64::from(up));
                let full = redis.as_ref().is_some_and(|redis| redis.full_refusal().is_some());
                shared.metrics.redis_full.set(i64::from(full));
                shared.metrics.read_process();
            });
            let mut response = text_response(StatusCode::OK, page);
            // The body is OpenMetrics text (`_total` samples under a `# TYPE x counter`, and
            // `# EOF`): named as such, Prometheus parses it as such. Called 0.0.4 text, its
            // counters read as untyped.
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            response
        }
        (&Method::POST, "/reload") => {
            tracing::info!(by = %peer_or_token(&request), "policy reload asked from the admin API");
            // In a task of its own, as switch changes: see `run_to_end`.
            let store = shared.store.clone();
            let reloaded = run_to_end(async move { store.reload(ReloadTrigger::Admin).await }).await;
            let Some(reloaded) = reloaded else {
                return text_response(StatusCode::INTERNAL_SERVER_ERROR, "500 the reload task failed; see the log\n");
            };
            match reloaded {
            Ok(outcome) => json_response(
                StatusCode::OK,
                &json!({ "ok": true, "generation": outcome.generation, "hash": outcome.hash, "changed": outcome.changed, "warnings": outcome.warnings.iter().map(ToString::to_string).collect::<Vec<_>>() }),
            ),
            Err(diagnostics) => json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({
                    "ok": false,
                    "active_generation": shared.store.load().generation,
                    "errors": diagnostics.0.iter().map(|d| json!({
                        "location": d.location(), "severity": d.severity, "message": d.message, "hint": d.hint,
                    })).collect::<Vec<_>>(),
                }),
            ),
            }
        }
        (&Method::GET, "/queues") => queues(&shared).await,
        (method, path) if path.starts_with("/queues/") => {
            if *method == Method::POST {
                tracing::warn!(%path, by = %peer_or_token(&request), "dead letter retry or drop asked from the admin API");
            }
            dead_letter_request(&shared, method, path, request.uri().query()).await
        }
        (&Method::POST, path) if path.starts_with("/breakers/") => {
            let name = path_segment(path.trim_start_matches("/breakers/"));
            let by = peer_or_token(&request);
            set_breaker(&shared, &name, request, &by).await
        }
        (_, "/" | "/dashboard" | "/status" | "/metrics" | "/queues") => method_not_allowed("GET"),
        (_, "/reload" | "/level") => method_not_allowed("POST"),
        (_, path) if path.starts_with("/modules/") || path.starts_with("/breakers/") => {
            method_not_allowed("POST")
        }
        _ => text_response(
            StatusCode::NOT_FOUND,
            "404 not found; admin paths: GET /dashboard, GET /status, GET /metrics, GET /queues, POST /reload, POST /breakers/NAME, POST /level, POST /modules/NAME\n",
        ),
    }
}

/// Sets `levee_breaker_state` to what each breaker of the running policy says now. A
/// transition sets it as it happens, but some changes are none: a reload that starts a
/// breaker fresh (closed) or removes its upstream, a policy `force`, an open time that ran
/// out with no request to probe yet. Without this the gauge kept saying "open" after a
/// reload had replaced an open breaker, and "closed" for a breaker pinned open by the policy.
/// The same for `levee_upstream_latency_p95_seconds`, which only a reading makes, and for
/// `levee_breaker_pinned`, which an alert on the state reads to leave out what an operator did.
fn publish_upstream_states(shared: &Shared) {
    let policy = shared.store.load();
    let gauges = &shared.metrics.breaker_state;
    let pins = &shared.metrics.breaker_pinned;
    let latencies = &shared.metrics.upstream_latency_p95;
    let slots = &shared.metrics.upstream_inflight;
    gauges.clear();
    pins.clear();
    latencies.clear();
    slots.clear();
    let now = tokio::time::Instant::now();
    for upstream in policy.upstreams.values() {
        let labels = crate::metrics::BreakerLabels {
            upstream: upstream.name.clone().into(),
        };
        gauges
            .get_or_create(&labels)
            .set(upstream.breaker.state_value());
        pins.get_or_create(&labels)
            .set(i64::from(upstream.breaker.is_pinned()));
        if let Some(p95) = upstream.latency.p95(now, 1) {
            latencies.get_or_create(&labels).set(p95.as_secs_f64());
        }
        if let Some(bulkhead) = &upstream.bulkhead {
            slots
                .get_or_create(&labels)
                .set(i64::from(bulkhead.inflight()));
        }
    }
}

/// The operator dashboard: one self-contained page (no CDN, no build step) that polls
/// `/status`, `/metrics` and `/queues` and sends the same POSTs as the `levee` CLI.
const DASHBOARD_HTML: &str = include_str!("dashboard.html");

/// `GET /` and `GET /dashboard`.
fn dashboard() -> Response<ResponseBody> {
    let mut response = text_response(StatusCode::OK, DASHBOARD_HTML);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // Nothing from elsewhere, and never inside another site's frame (its buttons change state).
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; frame-ancestors 'none'"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

/// `GET /queues`: backlog, in-flight, delayed and dead letters of every queue route.
async fn queues(shared: &Shared) -> Response<ResponseBody> {
    let policy = shared.store.load();
    let (Some(redis), Some(settings)) = (&policy.redis, &policy.queue) else {
        return json_response(StatusCode::OK, &json!({}));
    };
    let mut out = serde_json::Map::new();
    // A queue Redis does not answer for (its Cluster node is out) gets its reason, not
    // figures; the others are still shown. Only when none answered is the whole a 503.
    let mut failed: Option<RedisFailure> = None;
    let mut answered = false;
    let mut figures = |stats: Result<serde_json::Value, RedisFailure>| match stats {
        Ok(stats) => {
            answered = true;
            stats
        }
        Err(failure) => {
            let shown = json!({ "error": redis.explain(&failure) });
            failed = Some(failure);
            shown
        }
    };
    // Every queue asked at once: one after the other, a Redis that does not answer cost each
    // its own timeout, and `levee status` in an incident waited for all of them.
    let queueing: Vec<(String, QueueKeys)> = policy
        .routes
        .routes
        .iter()
        .filter(|route| route.queue.is_some())
        .map(|route| {
            let keys = QueueKeys::new(policy.key_prefix(), &route.name.0);
            (route.name.to_string(), keys)
        })
        .collect();
    // Queues of routes that stopped queueing, still replayed until empty, and queues found in
    // Redis for routes the policy does not have (kept, not replayed).
    let former = shared.former_queues.list().into_iter();
    let kept: Vec<(String, QueueKeys, bool)> = former
        .map(|former| {
            let shown = crate::queue::shown_name(&policy, &former.keys, &former.route.name.0);
            (shown, former.keys, false)
        })
        .chain(
            shared
                .former_queues
                .unrouted()
                .into_iter()
                .map(|(route, keys)| (route, keys, true)),
        )
        .collect();
    let (current_stats, kept_stats) = futures_util::future::join(
        futures_util::future::join_all(
            queueing
                .iter()
                .map(|(_, keys)| worker::stats(redis, keys, settings)),
        ),
        futures_util::future::join_all(
            kept.iter()
                .map(|(_, keys, _)| worker::stats(redis, keys, settings)),
        ),
    )
    .await;
    for ((route, _), stats) in queueing.into_iter().zip(current_stats) {
        out.insert(route, figures(stats));
    }
    for ((route, keys, route_missing), stats) in kept.into_iter().zip(kept_stats) {
        let mut stats = figures(stats);
        if let Some(fields) = stats.as_object_mut() {
            fields.insert("stopped_queueing".into(), json!(true));
            // Listed under its stream key when its route queues under other keys now.
            if route == keys.stream {
                fields.insert("stream".into(), json!(keys.stream));
            }
            if route_missing {
                fields.insert("route_missing".into(), json!(true));
            }
        }
        out.entry(route).or_insert(stats);
    }
    match failed {
        Some(failure) if !answered => queues_unreadable(&redis.explain(&failure)),
        Some(failure) => {
            tracing::warn!(%failure, "GET /queues: Redis did not give some queues' figures");
            json_response(StatusCode::OK, &serde_json::Value::Object(out))
        }
        None => json_response(StatusCode::OK, &serde_json::Value::Object(out)),
    }
}

/// Which dead letters `GET /queues/ROUTE/dead` lists: the newest `limit` older than `before`.
struct DeadLetterPage {
    limit: usize,
    before: Option<String>,
}

impl DeadLetterPage {
    fn parse(query: Option<&str>) -> Result<DeadLetterPage, String> {
        let mut page = DeadLetterPage {
            limit: DEAD_LETTERS_LISTED,
            before: None,
        };
        for pair in query
            .unwrap_or_default()
            .split('&')
            .filter(|pair| !pair.is_empty())
        {
            match pair.split_once('=') {
                Some(("limit", value)) => {
                    page.limit = value
                        .parse()
                        .ok()
                        .filter(|limit| (1..=MOST_DEAD_LETTERS_LISTED).contains(limit))
                        .ok_or_else(|| {
                            format!(
                                "limit `{}` is not a number from 1 to {MOST_DEAD_LETTERS_LISTED}",
                                value.escape_debug()
                            )
                        })?;
                }
                Some(("before", value)) if is_entry_id(value) => {
                    page.before = Some(value.to_string())
                }
                Some(("before", value)) => {
                    return Err(format!(
                        "before `{}` is not a dead letter's id (like 1700000000000-0)",
                        value.escape_debug()
                    ))
                }
                _ => {
                    return Err(format!(
                        "unknown parameter `{}`; use limit and before",
                        pair.escape_debug()
                    ))
                }
            }
        }
        Ok(page)
    }
}

/// The queues' figures live in Redis alone: without it there are none to show, and 200 with
/// made-up counts would tell a monitor the queues are fine.
fn queues_unreadable(failure: &str) -> Response<ResponseBody> {
    tracing::warn!(%failure, "GET /queues: Redis did not give the queues' figures");
    text_response(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("503 queue figures are unreadable: {failure}\n"),
    )
}

/// Dead letters listed at once when `limit` does not say: the newest.
const DEAD_LETTERS_LISTED: usize = 100;
/// The most `limit` may ask for.
const MOST_DEAD_LETTERS_LISTED: usize = 1000;

/// `GET /queues/ROUTE/dead[?limit=N&before=ID]`, `POST /queues/ROUTE/dead/ID/retry`,
/// `POST /queues/ROUTE/dead/ID/drop`.
async fn dead_letter_request(
    shared: &Shared,
    method: &Method,
    path: &str,
    query: Option<&str>,
) -> Response<ResponseBody> {
    let policy = shared.store.load();
    let parts: Vec<String> = path
        .trim_start_matches("/queues/")
        .split('/')
        .map(path_segment)
        .collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    let Some(redis) = &policy.redis else {
        return text_response(StatusCode::NOT_FOUND, "404 no queues without [redis]\n");
    };
    let queueing = parts.first().and_then(|name| {
        policy
            .routes
            .routes
            .iter()
            .find(|route| &*route.name.0 == *name && route.queue.is_some())
            .map(|route| QueueKeys::new(policy.key_prefix(), &route.name.0))
    });
    let Some(keys) = queueing.or_else(|| {
        parts
            .first()
            .and_then(|name| shared.former_queues.keys_named(name))
    }) else {
        return text_response(
            StatusCode::NOT_FOUND,
            "404 no queue route by that name; GET /queues lists them\n",
        );
    };
    match (method, parts.as_slice()) {
        (&Method::GET, [_, "dead"]) => {
            let page = match DeadLetterPage::parse(query) {
                Ok(page) => page,
                Err(reason) => return text_response(StatusCode::BAD_REQUEST, format!("400 {reason}\n")),
            };
            let listed = worker::dead_letters(redis, &keys, page.limit, page.before.as_deref()).await;
            let Ok((jobs, more)) = listed else {
                let error = listed.err().map(|error| error.to_string()).unwrap_or_default();
                return text_response(StatusCode::SERVICE_UNAVAILABLE, format!("503 {error}\n"));
            };
            let mut response = json_response(
                StatusCode::OK,
                &json!(jobs
                    .iter()
                    .map(|(id, job)| json!({
                        "id": id,
                        "job": job.idempotency_key(),
                        "idempotency_key": job.key_the_app_sees(),
                        "accepted_at_unix_ms": job.enqueued_at_ms,
                        "method": job.method,
                        // The client's API key in the query is a credential: hidden as
                        // in log lines (the job itself keeps it, for its replay).
                        "target": policy
                            .identity
                            .redacted_target(&job.target)
                            .unwrap_or_else(|| job.target.clone()),
                        "version": crate::queue::job::version_name(job.version),
                        "client_ip": job.client_ip,
                        "attempts": job.attempts,
                        "error": job.last_error,
                        "body_bytes": job.body.len(),
                    }))
                    .collect::<Vec<_>>()),
            );
            // Older letters are there: the next page, as a `Link` (RFC 8288) a script follows.
            if let (true, Some((last, _))) = (more, jobs.last()) {
                // The name as a path segment again: `通知` or `my api` make no header value.
                let route = crate::admin::client::path_segment(parts[0]);
                let next = format!("</queues/{route}/dead?limit={}&before={last}>; rel=\"next\"", page.limit);
                if let Ok(value) = http::HeaderValue::from_str(&next) {
                    response.headers_mut().insert(http::header::LINK, value);
                }
            }
            response
        }
        (&Method::POST, [_, "dead", id, "retry" | "drop"]) if !is_entry_id(id) => {
            text_response(
                StatusCode::BAD_REQUEST,
                format!(
                    "400 `{}` is not a dead letter's id; GET /queues/ROUTE/dead lists them (like 1700000000000-0)\n",
                    id.escape_debug()
                ),
            )
        }
        (&Method::POST, [_, "dead", id, action @ ("retry" | "drop")]) => {
            match worker::resolve_dead_letter(redis, &keys, id, *action == "retry").await {
                Ok(worker::Resolved::Done) => json_response(
                    StatusCode::OK,
                    &json!({ "ok": true, "id": id, "action": action }),
                ),
                Ok(worker::Resolved::NotFound) => {
                    text_response(StatusCode::NOT_FOUND, "404 no such dead letter\n")
                }
                Ok(worker::Resolved::Unreadable(reason)) => text_response(
                    StatusCode::CONFLICT,
                    format!("409 this dead letter is not a whole job ({reason}) and cannot be queued again; drop it\n"),
                ),
                Err(error) => {
                    text_response(StatusCode::SERVICE_UNAVAILABLE, format!("503 {error}\n"))
                }
            }
        }
        (_, [_, "dead"]) => method_not_allowed("GET"),
        (_, [_, "dead", _, "retry" | "drop"]) => method_not_allowed("POST"),
        _ => text_response(
            StatusCode::NOT_FOUND,
            "404 use GET /queues/ROUTE/dead, POST /queues/ROUTE/dead/ID/retry or /drop\n",
        ),
    }
}

/// 405, naming the method the path takes (RFC 9110 15.5.6 asks for `Allow`).
fn method_not_allowed(allow: &'static str) -> Response<ResponseBody> {
    let mut response = text_response(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("405 method not allowed; this path takes {allow}\n"),
    );
    response
        .headers_mut()
        .insert(http::header::ALLOW, HeaderValue::from_static(allow));
    response
}

/// A whole stream entry id, `MILLISECONDS-SEQUENCE`, as `GET /queues/ROUTE/dead` lists them.
/// Anything else is the operator's typo: Redis would refuse it (answered 503, as if Redis were
/// down), or read it as a range (`-`, `+`, a bare time) and act on an entry nobody named.
fn is_entry_id(id: &str) -> bool {
    id.split_once('-').is_some_and(|(time, sequence)| {
        [time, sequence].iter().all(|number| {
            number.bytes().all(|byte| byte.is_ascii_digit()) && number.parse::<u64>().is_ok()
        })
    })
}

/// A name from the admin path, percent-decoded: the dashboard encodes module, breaker and
/// route names (`通知`, `my api`) with `encodeURIComponent`, as the CLI does.
fn path_segment(segment: &str) -> String {
    crate::limit::key::decode_percent(segment, false).into_owned()
}

/// An admin listener on loopback answers only requests that name it so: a `Host` that is a
/// loopback address or `localhost`. A web page whose own name was made to resolve to
/// 127.0.0.1 (DNS rebinding) sends its own name, and its `Origin` matches that `Host`, so the
/// origin check alone would let it read everything (and, without tokens, change it). Tokens
/// do not lift this: reading needs none. A request without `Host` (HTTP/1.0 tools) passes;
/// browsers always send one.
fn loopback_host(
    shared: &Shared,
    request: &Request<Incoming>,
) -> Result<(), Box<Response<ResponseBody>>> {
    if !shared
        .store
        .load()
        .admin
        .listen
        .ip()
        .to_canonical()
        .is_loopback()
    {
        return Ok(());
    }
    let Some(host) = request.headers().get(header::HOST) else {
        return Ok(());
    };
    if host.to_str().is_ok_and(is_loopback_host) {
        return Ok(());
    }
    tracing::warn!(host = ?host, "admin request for another host name refused");
    Err(Box::new(text_response(
        StatusCode::FORBIDDEN,
        "403 the admin listener answers only to Host 127.0.0.1, [::1] or localhost\n",
    )))
}

/// `localhost`, a loopback address (IPv4, `[::1]`, or IPv4-mapped), with or without a port
/// and a trailing dot.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(bracketed) => bracketed.split_once(']').map_or("", |(name, _)| name),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|address| address.to_canonical().is_loopback())
}

/// Checks `Authorization: Bearer <token>` against the configured tokens; `Ok(Some(name))`
/// names the token used, `Ok(None)` when no tokens are configured.
fn authorize(
    shared: &Shared,
    request: &Request<Incoming>,
    peer: std::net::SocketAddr,
) -> Result<Option<String>, Box<Response<ResponseBody>>> {
    // A web page the operator happens to have open must not be able to flip switches on a
    // loopback admin listener: browsers name the page's origin on cross-site requests.
    // Every `Origin` field is checked (a browser sends one; two is no browser's doing), and
    // a browser that sent none but says the request is cross-site (`Sec-Fetch-Site`, sent
    // by browsers that may leave `Origin` out) is refused as well.
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|value| value.to_str().ok());
    let policy = shared.store.load();
    // The listener's own pages, or a page an operator let in (`[admin] origins`: the
    // dashboard behind a proxy, whose origin is the proxy's).
    let same_origin = |origin: &HeaderValue| {
        let Ok(origin) = origin.to_str() else {
            return false;
        };
        origin
            .strip_prefix("http://")
            .is_some_and(|origin_host| Some(origin_host) == host)
            || policy
                .admin
                .origins
                .iter()
                .any(|allowed| allowed.eq_ignore_ascii_case(origin))
    };
    let origins = request.headers().get_all(header::ORIGIN);
    let cross_site_fetch = request
        .headers()
        .get("sec-fetch-site")
        .is_some_and(|site| site.as_bytes() == b"cross-site" || site.as_bytes() == b"same-site");
    let foreign = origins.iter().find(|origin| !same_origin(origin));
    if foreign.is_some() || (origins.iter().next().is_none() && cross_site_fetch) {
        tracing::warn!(origin = ?foreign, "admin request from another site refused");
        return Err(Box::new(text_response(
            StatusCode::FORBIDDEN,
            "403 admin actions are only accepted from the admin listener's own pages or from tools\n",
        )));
    }
    if policy.admin.tokens.is_empty() {
        return Ok(None);
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .map(str::trim)
        // The scheme is case-insensitive (RFC 9110 11.1).
        .and_then(|value| {
            value
                .split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, token)| token.trim())
        });
    let matched = presented.and_then(|presented| {
        policy
            .admin
            .tokens
            .iter()
            .find(|(_, secret)| constant_time_eq(secret.as_bytes(), presented.as_bytes()))
            .map(|(name, _)| name.clone())
    });
    match matched {
        Some(name) => Ok(Some(name)),
        None => {
            let reading = request.method() == Method::GET || request.method() == Method::HEAD;
            let reason = if presented.is_some() {
                "401 the token was not accepted: it is none of [admin] tokens\n"
            } else if reading {
                "401 reading this admin path needs a token: send Authorization: Bearer <token> (the levee CLI: --token or LEVEE_ADMIN_TOKEN; the dashboard: its token field)\n"
            } else {
                "401 this admin action needs a token: send Authorization: Bearer <token> (the levee CLI: --token or LEVEE_ADMIN_TOKEN)\n"
            };
            // At most once per 10 s, with the count held back: a script guessing tokens wrote
            // a line per guess (5 MB a second), filling the disk the log is on.
            static REFUSED: crate::log_throttle::LogThrottle =
                crate::log_throttle::LogThrottle::new(std::time::Duration::from_secs(10));
            if let Some(held_back) = REFUSED.allow(std::time::Instant::now()) {
                tracing::warn!(client = %peer.ip(), path = %request.uri().path(), token_sent = presented.is_some(), held_back, "admin request refused: missing or wrong token");
            }
            let mut response = text_response(StatusCode::UNAUTHORIZED, reason);
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            Err(Box::new(response))
        }
    }
}

/// Compares secrets without leaking, through timing, how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Who changed a switch: the `X-Levee-Operator` header, else the admin client's address.
fn operator(request: &Request<Incoming>, peer: std::net::SocketAddr) -> String {
    request
        .headers()
        .get("x-levee-operator")
        .and_then(|value| value.to_str().ok())
        .map(|name| {
            name.chars()
                .filter(|c| !c.is_control())
                .take(64)
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .map_or_else(|| peer.to_string(), |name| format!("{name} ({peer})"))
}

/// How long an admin request's body may take to arrive. The bodies are one word; a client
/// that sends its head and then nothing would otherwise hold its connection and task open.
const ADMIN_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// The one word an admin action sends (`off`, `2`, `open`): the trimmed body, or with an empty
/// body the value of the query's parameter (`?force=open`); else a ready 400 or 408.
async fn read_word<B>(request: Request<B>) -> Result<String, Response<ResponseBody>>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let from_query = request.uri().query().and_then(|query| {
        query
            .split('&')
            .find_map(|pair| pair.split_once('=').map(|(_, value)| value.to_string()))
    });
    let reading = http_body_util::Limited::new(request.into_body(), 1024).collect();
    let body = match tokio::time::timeout(ADMIN_BODY_TIMEOUT, reading).await {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(_)) => {
            return Err(text_response(
                StatusCode::BAD_REQUEST,
                "400 body too large or unreadable; send one word, like off\n",
            ))
        }
        Err(_) => {
            tracing::warn!("admin request body not received in time");
            return Err(text_response(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "408 the body did not arrive within {}s\n",
                    ADMIN_BODY_TIMEOUT.as_secs()
                ),
            ));
        }
    };
    let body = String::from_utf8_lossy(&body)
        .trim()
        .trim_matches('"')
        .to_string();
    Ok(match (body.is_empty(), from_query) {
        (true, Some(from_query)) => path_segment(&from_query),
        _ => body,
    })
}

/// Runs an admin action that changes state to its end in a task of its own. A client that
/// goes away (its `--max-time`, a dropped SSH tunnel) closes the connection, and the
/// request's future is dropped: a reload cut off while compiling was neither swapped in nor
/// recorded, and a switch cut off while its state file was written was saved but not put in
/// effect until the next start. `None` when the task panicked.
async fn run_to_end<T: Send + 'static>(
    action: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    match tokio::spawn(action).await {
        Ok(done) => Some(done),
        Err(error) => {
            tracing::error!("admin action failed: {error}");
            None
        }
    }
}

/// Saves a switch and puts it in effect, to its end even if the operator's client goes.
async fn run_change(
    shared: &Arc<Shared>,
    policy: &Arc<crate::config::Policy>,
    change: Change,
    by: &str,
) -> Result<(), String> {
    let (shared, policy, by) = (shared.clone(), policy.clone(), by.to_string());
    run_to_end(async move {
        switches::apply(&shared.degrade, &policy, change, &by, &shared.metrics).await
    })
    .await
    .unwrap_or_else(|| Err("the switch task failed; see the log".to_string()))
}

async fn apply_switch(shared: &Arc<Shared>, change: Change, by: &str) -> Response<ResponseBody> {
    let policy = shared.store.load();
    match run_change(shared, &policy, change, by).await {
        Ok(()) => json_response(
            StatusCode::OK,
            &json!({ "ok": true, "degrade": degrade_status(shared, &policy) }),
        ),
        Err(message) if message.starts_with("no module") || message.starts_with("level") => {
            text_response(StatusCode::BAD_REQUEST, format!("400 {message}\n"))
        }
        Err(message) => text_response(StatusCode::SERVICE_UNAVAILABLE, format!("503 {message}\n")),
    }
}

fn degrade_status(shared: &Shared, policy: &crate::config::Policy) -> serde_json::Value {
    let view = shared.degrade.view(policy);
    let runtime = shared.degrade.runtime();
    let level_origin = if shared.degrade.auto_level()
        > runtime
            .level
            .as_ref()
            .map_or(policy.degrade.level, |s| s.value)
    {
        "automatic"
    } else if runtime.level.is_some() {
        "runtime"
    } else {
        "policy"
    };
    let modules: serde_json::Map<String, serde_json::Value> = policy
        .degrade
        .modules
        .iter()
        .map(|(name, tier)| {
            let switch = runtime.modules.get(name);
            (
                name.clone(),
                json!({
                    "off": view.module_off(name),
                    "tier": tier,
                    "origin": view.module_origin(name),
                    "changed_by": switch.map(|s| s.by.clone()),
                    "changed_at_unix": switch.map(|s| s.at_unix),
                    // The runtime switch, in effect or not (a level may override it): what
                    // comes back in effect when the level drops.
                    "switch": switch.map(|s| if s.value { "off" } else { "on" }),
                }),
            )
        })
        .collect();
    // Switches saved for names the policy no longer has (a route or upstream a reload took
    // out): not in effect, and back in effect, unannounced, if a reload brings the name back.
    let saved_modules: serde_json::Map<String, serde_json::Value> = runtime
        .modules
        .iter()
        .filter(|(name, _)| !policy.degrade.modules.contains_key(name.as_str()))
        .map(|(name, switch)| {
            (
                name.clone(),
                json!({ "off": switch.value, "changed_by": switch.by, "changed_at_unix": switch.at_unix }),
            )
        })
        .collect();
    let saved_breakers: serde_json::Map<String, serde_json::Value> = runtime
        .breakers
        .iter()
        .filter(|(name, _)| !policy.upstreams.contains_key(name.as_str()))
        .map(|(name, pin)| {
            (
                name.clone(),
                json!({ "force": crate::breaker::Force::word(Some(pin.value)), "changed_by": pin.by, "changed_at_unix": pin.at_unix }),
            )
        })
        .collect();
    json!({
        "saved_not_in_policy": { "modules": saved_modules, "breakers": saved_breakers },
        "level": view.level,
        "level_origin": level_origin,
        "policy_level": policy.degrade.level,
        "automatic_level": shared.degrade.auto_level(),
        // Which triggers raised it, which hold now, when it comes down.
        "automatic": shared.degrade.auto_report(),
        "level_changed_by": runtime.level.as_ref().map(|s| s.by.clone()),
        // The level set at runtime, in effect or not (an automatic level may be above it).
        "runtime_level": runtime.level.as_ref().map(|s| s.value),
        "level_changed_at_unix": runtime.level.as_ref().map(|s| s.at_unix),
        "modules": modules,
        "switches_stored_in": if policy.redis.is_some() { "redis".to_string() } else { policy.degrade.state_file.display().to_string() },
    })
}

/// `POST /breakers/NAME` with `open`, `closed` or `auto` as the body (or `?force=`): a pin
/// saved with the switches, so the whole fleet follows it and it survives restarts.
async fn set_breaker(
    shared: &Arc<Shared>,
    name: &str,
    request: Request<Incoming>,
    by: &str,
) -> Response<ResponseBody> {
    let wanted = match read_word(request).await {
        Ok(wanted) => wanted,
        Err(response) => return response,
    };
    let wanted = wanted.as_str();
    let force = match wanted {
        "open" => Some(Force::Open),
        "closed" => Some(Force::Closed),
        "auto" => None,
        other => {
            return text_response(
                StatusCode::BAD_REQUEST,
                format!(
                    "400 unknown breaker state `{}`; send open, closed or auto\n",
                    other.escape_debug()
                ),
            )
        }
    };
    let policy = shared.store.load();
    match run_change(
        shared,
        &policy,
        Change::Breaker(name.to_string(), force),
        by,
    )
    .await
    {
        Ok(()) => json_response(
            StatusCode::OK,
            &json!({
                "ok": true,
                "upstream": name,
                "breaker": policy.upstreams.get(name).map(|upstream| upstream.breaker.status()),
                "pinned": breaker_pin(shared, name),
            }),
        ),
        Err(message) if message.starts_with("no upstream") => text_response(
            StatusCode::NOT_FOUND,
            format!("404 {}\n", message.escape_debug()),
        ),
        Err(message) => text_response(StatusCode::SERVICE_UNAVAILABLE, format!("503 {message}\n")),
    }
}

/// Who pinned an upstream's breaker at runtime, and when; `null` when nobody did.
fn breaker_pin(shared: &Shared, name: &str) -> serde_json::Value {
    match shared.degrade.runtime().breakers.get(name) {
        Some(pin) => json!({
            "force": crate::breaker::Force::word(Some(pin.value)),
            "by": pin.by,
            "at_unix": pin.at_unix,
        }),
        None => serde_json::Value::Null,
    }
}

/// Every condition a route matches on, keyed as the policy's `match` table writes them
/// (`host`, `client`, `method`, and one of `path`, `path_prefix`, `path_regex`): `{}` only for
/// a route that takes every request. (It showed the path alone, and `null` for a route that
/// matched on its host or its clients only: read as a catch-all.)
fn route_match(route: &Route) -> serde_json::Value {
    let mut conditions = serde_json::Map::new();
    if !route.hosts.is_empty() {
        let hosts: Vec<_> = route.hosts.iter().map(HostMatch::pattern).collect();
        conditions.insert("host".into(), json!(hosts));
    }
    if !route.clients.is_empty() {
        let clients: Vec<_> = route.clients.iter().map(ToString::to_string).collect();
        conditions.insert("client".into(), json!(clients));
    }
    if !route.methods.is_empty() {
        let methods: Vec<_> = route.methods.iter().map(Method::as_str).collect();
        conditions.insert("method".into(), json!(methods));
    }
    match &route.path {
        PathMatch::Any => {}
        PathMatch::Exact(path) => {
            conditions.insert("path".into(), json!(path));
        }
        PathMatch::Prefix(prefix) => {
            conditions.insert("path_prefix".into(), json!(prefix));
        }
        PathMatch::Regex(regex) => {
            conditions.insert("path_regex".into(), json!(regex.as_str()));
        }
    }
    serde_json::Value::Object(conditions)
}

fn status(shared: &Shared) -> serde_json::Value {
    let policy = shared.store.load();
    let view = shared.degrade.view(&policy);
    let routes: Vec<_> = policy
        .routes
        .routes
        .iter()
        .chain(policy.routes.fallback.iter())
        .map(|route| {
            json!({
                "name": route.name.to_string(),
                "upstream": route.upstream.name,
                "methods": route.methods.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
                "match": route_match(route),
                "max_body": route.max_body,
                "limits": route.limits.iter().map(|rule| rule.name.to_string()).collect::<Vec<_>>(),
                "tier": route.tier,
                "queue": route.queue.is_some(),
                "always_queue": route.always_queue,
                "answer_format": route.answer_format.as_str(),
                "module": route.module.as_deref(),
                // Off now, and by what: its tier (the level) or its module.
                "off": view.route_off(route).then(|| {
                    if crate::degrade::tier_off(route.tier, view.level) { "tier" } else { "module" }
                }),
            })
        })
        .collect();
    let upstreams: Vec<_> = policy
        .upstreams
        .values()
        .map(|upstream| {
            json!({
                "name": upstream.name,
                "url": format!("{}://{}", upstream.settings.scheme, upstream.settings.authority),
                "socket": upstream.settings.socket.as_ref().map(|path| path.display().to_string()),
                "breaker": upstream.breaker.status(),
                "pinned": breaker_pin(shared, &upstream.name),
                "latency_p95_ms": upstream
                    .latency
                    .p95(tokio::time::Instant::now(), 1)
                    .map(|p95| p95.as_secs_f64() * 1000.0),
                // Slots taken, calls whose clients left and that run on included (they are
                // the ones no request count shows).
                "inflight": upstream.bulkhead.as_ref().map(|bulkhead| bulkhead.inflight()),
                "max_inflight": upstream.bulkhead.as_ref().map(|bulkhead| bulkhead.settings.max_inflight),
                // Requests refused at `max_inflight` since levee started, by tier (as
                // `levee_shed_total`): what an operator asks first when pages fail under load.
                "shed": upstream.bulkhead.as_ref().map(|_| {
                    (1..=3u8)
                        .map(|tier| {
                            let labels = crate::metrics::ShedLabels {
                                upstream: upstream.name.clone().into(),
                                tier,
                            };
                            (tier.to_string(), json!(shared.metrics.shed.get(&labels).map_or(0, |count| count.get())))
                        })
                        .collect::<serde_json::Map<_, _>>()
                }),
            })
        })
        .collect();
    let limits: Vec<_> = policy
        .limits
        .values()
        .map(|rule| {
            json!({
                "name": rule.name.to_string(),
                "rate": rule.rate_text,
                "burst": rule.rate.burst,
                "dry_run": rule.dry_run,
                "on_redis_error": format!("{:?}", rule.on_redis_error).to_lowercase(),
            })
        })
        .collect();
    let redis = policy.redis.as_ref().map(|redis| {
        json!({
            "target": match &redis.settings.target {
                crate::redis_store::RedisTarget::Single(url) => json!(crate::redis_store::redact_url(url)),
                crate::redis_store::RedisTarget::Cluster(nodes) => json!(nodes.iter().map(|n| crate::redis_store::redact_url(n)).collect::<Vec<_>>()),
                crate::redis_store::RedisTarget::Sentinel(sentinel) => json!({
                    "sentinels": sentinel.nodes.iter().map(|n| crate::redis_store::redact_url(n)).collect::<Vec<_>>(),
                    "master": sentinel.master,
                }),
            },
            "master": redis.sentinel_master().map(|address| address.to_string()),
            "up": redis.is_up(),
            "last_error": redis.last_error(),
            "rate_limits": redis.rate_limit_source(),
            "full": redis.full_refusal().map(|(error, ago)| json!({"error": error, "seconds_ago": ago.as_secs()})),
            "maxmemory_policy": redis.eviction_policy(),
            "nodes": redis.cluster_nodes().into_iter().map(|(node, up)| json!({"node": node, "up": up})).collect::<Vec<_>>(),
        })
    });
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        // The commit built (see build.rs): a fleet mid-upgrade tells old binaries from new.
        "commit": env!("LEVEE_COMMIT"),
        "instance": shared.instance,
        "draining": shared.draining.load(Ordering::Relaxed),
        "connections": {
            "open": shared.metrics.connections_open.get(),
            "max": policy.server.max_connections,
        },
        "policy": {
            "dir": shared.store.dir().display().to_string(),
            "generation": policy.generation,
            "hash": policy.hash,
            "files": policy.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
            // By file name: instances whose directories differ in a file of their own (a
            // per-instance `[redis]` file) have different `hash`es, and these tell which of
            // the shared files they agree on mid-deploy.
            "file_hashes": policy.file_hashes.iter().map(|(path, hash)| {
                let name = path.file_name().map_or_else(|| path.display().to_string(), |name| name.to_string_lossy().into_owned());
                (name, json!(hash))
            }).collect::<serde_json::Map<_, _>>(),
            "last_reload_ok_unix": shared.store.last_success_unix(),
            // When the running generation was put in effect (a reload that found nothing
            // changed moves `last_reload_ok_unix` only).
            "loaded_at_unix": policy.loaded_at_unix,
            "last_reload_error": shared.store.last_failure(),
            // A reload asked for now waits for these to be closed.
            "watch_error": shared.store.watch_problem(),
            "being_written": shared.store.being_written().iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
            "warnings": policy.warnings.iter().map(ToString::to_string).collect::<Vec<_>>(),
        },
        "routes": routes,
        "upstreams": upstreams,
        "limits": limits,
        "redis": redis,
        "degrade": degrade_status(shared, &policy),
        // Cookies the app sets in answers not marked private: requests carrying them get no
        // copy on stale routes that learn them (`learn_private_cookies`).
        "learned_private_cookies": shared.app_cookies.names(),
    })
}

fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<ResponseBody> {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    let mut response = Response::new(full_body(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{Full, StreamBody};

    async fn word(uri: &str, body: &'static str) -> Result<String, u16> {
        let request = Request::post(uri)
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request");
        read_word(request)
            .await
            .map_err(|answer| answer.status().as_u16())
    }

    #[tokio::test]
    async fn the_word_is_the_body_or_else_the_query_parameter() {
        assert_eq!(word("/level", " 2\n").await, Ok("2".into()));
        assert_eq!(word("/level", "\"off\"").await, Ok("off".into()));
        assert_eq!(
            word("/breakers/app?force=open", "").await,
            Ok("open".into())
        );
        assert_eq!(word("/modules/m?state=%6Fff", "").await, Ok("off".into()));
        assert_eq!(
            word("/breakers/app?force=open", "closed").await,
            Ok("closed".into()),
            "the body wins, as everywhere"
        );
        assert_eq!(word("/level", "").await, Ok(String::new()));
        let long: &'static str = "x".repeat(2000).leak();
        assert_eq!(word("/level", long).await, Err(400));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_comes_is_a_408_after_the_time_limit() {
        let never = futures_util::stream::pending::<
            Result<hyper::body::Frame<Bytes>, std::convert::Infallible>,
        >();
        let request = Request::post("/level")
            .body(StreamBody::new(never))
            .expect("request");
        let started = tokio::time::Instant::now();
        let answer = read_word(request).await.expect_err("no word");
        assert_eq!(answer.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(started.elapsed(), ADMIN_BODY_TIMEOUT);
    }
}
