//! The admin listener: status, metrics and reload for operators. It listens on its own
//! address (default `127.0.0.1:9901`) and is never reachable through the public listener.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use crate::config::ReloadTrigger;
use crate::error::{full_body, text_response};
use crate::proxy::body::ResponseBody;
use crate::proxy::route::PathMatch;
use crate::proxy::Shared;

/// Answers one admin request.
pub async fn handle(shared: Arc<Shared>, request: Request<Incoming>) -> Response<ResponseBody> {
    match (request.method(), request.uri().path()) {
        (&Method::GET, "/status") => json_response(StatusCode::OK, &status(&shared)),
        (&Method::GET, "/metrics") => {
            let mut response = text_response(StatusCode::OK, shared.metrics.encode());
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
        (&Method::POST, "/reload") => match shared.store.reload(ReloadTrigger::Admin).await {
            Ok(outcome) => json_response(
                StatusCode::OK,
                &json!({ "ok": true, "generation": outcome.generation, "hash": outcome.hash, "changed": outcome.changed }),
            ),
            Err(diagnostics) => json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({
                    "ok": false,
                    "active_generation": shared.store.load().generation,
                    "errors": diagnostics.0.iter().map(|d| json!({
                        "location": d.location(), "message": d.message, "hint": d.hint,
                    })).collect::<Vec<_>>(),
                }),
            ),
        },
        (_, "/status" | "/metrics" | "/reload") => {
            text_response(StatusCode::METHOD_NOT_ALLOWED, "405 method not allowed\n")
        }
        _ => text_response(
            StatusCode::NOT_FOUND,
            "404 not found; admin paths: GET /status, GET /metrics, POST /reload\n",
        ),
    }
}

fn status(shared: &Shared) -> serde_json::Value {
    let policy = shared.store.load();
    let routes: Vec<_> = policy
        .routes
        .routes
        .iter()
        .chain(policy.routes.fallback.iter())
        .map(|route| {
            let path = match &route.path {
                PathMatch::Any => json!(null),
                PathMatch::Exact(path) => json!({ "path": path }),
                PathMatch::Prefix(prefix) => json!({ "path_prefix": prefix }),
                PathMatch::Regex(regex) => json!({ "path_regex": regex.as_str() }),
            };
            json!({
                "name": route.name.to_string(),
                "upstream": route.upstream.name,
                "methods": route.methods.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
                "match": path,
                "max_body": route.max_body,
                "limits": route.limits.iter().map(|rule| rule.name.to_string()).collect::<Vec<_>>(),
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
                crate::limit::redis::RedisTarget::Single(url) => json!(redact(url)),
                crate::limit::redis::RedisTarget::Cluster(nodes) => json!(nodes.iter().map(|n| redact(n)).collect::<Vec<_>>()),
            },
            "up": redis.is_up(),
        })
    });
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "draining": shared.draining.load(Ordering::Relaxed),
        "policy": {
            "dir": shared.store.dir().display().to_string(),
            "generation": policy.generation,
            "hash": policy.hash,
            "files": policy.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
            "last_reload_ok_unix": shared.store.last_success_unix(),
            "last_reload_error": shared.store.last_failure(),
        },
        "routes": routes,
        "upstreams": upstreams,
        "limits": limits,
        "redis": redis,
    })
}

/// Hides a password in a Redis URL (`redis://:secret@host` → `redis://:***@host`).
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}***{}", &url[..scheme_end + 3], &url[at..])
        }
        _ => url.to_string(),
    }
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
