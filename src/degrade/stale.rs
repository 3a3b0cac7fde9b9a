//! Last good copies of `stale` routes ("serve the cached ranking").
//!
//! Each good response of a stale route refreshes its copy: in memory (L1, bounded by bytes)
//! and in Redis when configured (shared by the fleet, survives restarts). The copy answers
//! when the route is switched off, when its upstream's breaker is open, or when the upstream
//! fails. Concurrent requests for a key that is being fetched wait for that one fetch
//! instead of all going upstream.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::watch;

use super::StaleSettings;
use crate::error::{full_body, BoxError};
use crate::metrics::Metrics;
use crate::proxy::body::ResponseBody;
use crate::redis_store::RedisStore;

/// Status and kept headers of a response being captured.
type StoredHead = (u16, Vec<(String, Vec<u8>)>);

/// Default bound on the in-memory copies, in bytes.
pub const L1_MAX_BYTES: usize = 64 << 20;

/// A stored response.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct StaleCopy {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    #[serde(skip)]
    pub body: Bytes,
    pub stored_at_ms: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl StaleCopy {
    pub fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.stored_at_ms))
    }

    /// The copy as a response. `stale` adds `X-Levee-Stale: 1`; both carry `Age`.
    pub fn to_response(&self, stale: bool) -> Response<ResponseBody> {
        let mut response = Response::new(full_body(self.body.clone()));
        *response.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let headers = response.headers_mut();
        for (name, value) in &self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(value),
            ) {
                headers.append(name, value);
            }
        }
        headers.insert(header::AGE, HeaderValue::from(self.age().as_secs()));
        if stale {
            headers.insert(
                HeaderName::from_static("x-levee-stale"),
                HeaderValue::from_static("1"),
            );
        }
        response
    }

    /// Redis value: JSON head, a newline, then the body bytes.
    fn encode(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec(self).unwrap_or_default();
        out.push(b'\n');
        out.extend_from_slice(&self.body);
        out
    }

    fn decode(bytes: &[u8]) -> Option<StaleCopy> {
        let split = bytes.iter().position(|b| *b == b'\n')?;
        let mut copy: StaleCopy = serde_json::from_slice(&bytes[..split]).ok()?;
        copy.body = Bytes::copy_from_slice(&bytes[split + 1..]);
        Some(copy)
    }

    fn weight(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
            + 64
    }
}

#[derive(Default)]
struct L1 {
    copies: HashMap<String, Arc<StaleCopy>>,
    order: VecDeque<String>,
    bytes: usize,
    /// Keys whose copy here is past `max_age` and for which Redis had nothing newer, with
    /// when it was asked (ms): it is not asked again for a moment (see `StaleStore::get`).
    asked_redis: HashMap<String, u64>,
}

/// How long a key whose copy in memory is too old waits before Redis is asked again for a
/// newer one: a tenth of `max_age`, at most a second. Every request of a route that is off,
/// shed or failing looks for its copy, and each would otherwise wait for Redis in vain.
fn ask_redis_again_after(max_age: Duration) -> Duration {
    (max_age / 10).min(Duration::from_secs(1))
}

type Inflight = HashMap<String, watch::Receiver<Option<Arc<StaleCopy>>>>;

pub struct StaleStore {
    l1: Mutex<L1>,
    max_bytes: usize,
    inflight: Mutex<Inflight>,
}

/// The outcome of asking to fetch a key.
pub enum Fetch {
    /// Go upstream; the guard tells the waiters what came of it.
    Lead(FetchGuard),
    /// Someone else is fetching it: wait for their copy.
    Wait(watch::Receiver<Option<Arc<StaleCopy>>>),
}

/// Held by the one request that fetches a key; dropping it without a copy lets the waiters
/// go upstream themselves.
pub struct FetchGuard {
    store: Arc<StaleStore>,
    key: String,
    sender: watch::Sender<Option<Arc<StaleCopy>>>,
}

impl FetchGuard {
    fn finish(&self, copy: Option<Arc<StaleCopy>>) {
        let _ = self.sender.send(copy);
        if let Ok(mut inflight) = self.store.inflight.lock() {
            inflight.remove(&self.key);
        }
    }
}

impl Drop for FetchGuard {
    fn drop(&mut self) {
        if self.sender.borrow().is_none() {
            // Wake waiters with "no copy" (the channel closes with None in it).
            if let Ok(mut inflight) = self.store.inflight.lock() {
                inflight.remove(&self.key);
            }
        }
    }
}

impl StaleStore {
    pub fn new(max_bytes: usize) -> StaleStore {
        StaleStore {
            l1: Mutex::new(L1::default()),
            max_bytes,
            inflight: Mutex::new(HashMap::new()),
        }
    }

    /// The freshest copy of `key` at hand: the one in memory while it is within `max_age`;
    /// otherwise Redis is asked too, since another instance may have stored a newer one
    /// there (this instance's own copy ages while its upstream fails or its route is off,
    /// when the others may still have fetched the page). Without Redis, or when Redis does
    /// not answer within its timeout, the copy in memory is all there is.
    pub async fn get(
        &self,
        key: &str,
        max_age: Duration,
        redis: Option<&RedisStore>,
        metrics: &Metrics,
    ) -> Option<Arc<StaleCopy>> {
        let (in_memory, asked_at) = match self.l1.lock() {
            Ok(l1) => (
                l1.copies.get(key).cloned(),
                l1.asked_redis.get(key).copied(),
            ),
            Err(_) => (None, None),
        };
        if let Some(copy) = &in_memory {
            if copy.age() <= max_age {
                return in_memory;
            }
            let again = ask_redis_again_after(max_age).as_millis() as u64;
            if asked_at.is_some_and(|at| now_ms().saturating_sub(at) < again) {
                return in_memory;
            }
        }
        let Some(redis) = redis else {
            return in_memory;
        };
        let mut command = redis::cmd("GET");
        command.arg(key);
        let shared = match redis
            .command::<Option<Vec<u8>>>(
                &command,
                redis.settings.timeout,
                Some(crate::redis_store::Guard { key, metrics }),
            )
            .await
        {
            Ok(bytes) => bytes.as_deref().and_then(StaleCopy::decode).map(Arc::new),
            Err(error) => {
                tracing::debug!(%key, "stale copy not read from redis: {error}");
                None
            }
        };
        match shared {
            // A fresher copy may have been stored here meanwhile: the newest wins.
            Some(shared) => Some(self.remember_if_newer(key, shared)),
            None => {
                if in_memory.is_some() {
                    if let Ok(mut l1) = self.l1.lock() {
                        if l1.copies.contains_key(key) {
                            l1.asked_redis.insert(key.to_string(), now_ms());
                        }
                    }
                }
                in_memory
            }
        }
    }

    /// Keeps `copy` unless the copy in memory is at least as new; returns the one kept.
    fn remember_if_newer(&self, key: &str, copy: Arc<StaleCopy>) -> Arc<StaleCopy> {
        let Ok(mut l1) = self.l1.lock() else {
            return copy;
        };
        if let Some(current) = l1.copies.get(key) {
            if current.stored_at_ms >= copy.stored_at_ms {
                let current = current.clone();
                l1.asked_redis.insert(key.to_string(), now_ms());
                return current;
            }
        }
        self.insert(&mut l1, key, copy.clone());
        copy
    }

    fn remember(&self, key: &str, copy: Arc<StaleCopy>) {
        if let Ok(mut l1) = self.l1.lock() {
            self.insert(&mut l1, key, copy);
        }
    }

    fn insert(&self, l1: &mut L1, key: &str, copy: Arc<StaleCopy>) {
        let weight = copy.weight();
        if weight > self.max_bytes {
            return;
        }
        l1.asked_redis.remove(key);
        if let Some(old) = l1.copies.insert(key.to_string(), copy) {
            l1.bytes -= old.weight();
        } else {
            l1.order.push_back(key.to_string());
        }
        l1.bytes += weight;
        while l1.bytes > self.max_bytes {
            let Some(oldest) = l1.order.pop_front() else {
                break;
            };
            l1.asked_redis.remove(&oldest);
            if let Some(old) = l1.copies.remove(&oldest) {
                l1.bytes -= old.weight();
            }
        }
    }

    /// Stores a fresh copy in memory now and in Redis in the background.
    pub fn put(
        &self,
        key: &str,
        copy: Arc<StaleCopy>,
        redis: Option<Arc<RedisStore>>,
        max_age: Duration,
    ) {
        self.remember(key, copy.clone());
        if let Some(redis) = redis {
            let key = key.to_string();
            tokio::spawn(async move {
                let mut command = redis::cmd("SET");
                command
                    .arg(&key)
                    .arg(copy.encode())
                    .arg("PX")
                    .arg(max_age.as_millis().max(1) as u64);
                let timeout = redis.settings.timeout.max(Duration::from_millis(250));
                if let Err(error) = redis.command::<()>(&command, timeout, None).await {
                    tracing::debug!(%key, "stale copy not stored in redis: {error}");
                }
            });
        }
    }

    /// Either lead the fetch of `key` or wait for the one in flight.
    pub fn fetch(self: &Arc<Self>, key: &str) -> Fetch {
        let Ok(mut inflight) = self.inflight.lock() else {
            let (sender, _) = watch::channel(None);
            return Fetch::Lead(FetchGuard {
                store: self.clone(),
                key: key.to_string(),
                sender,
            });
        };
        if let Some(receiver) = inflight.get(key) {
            return Fetch::Wait(receiver.clone());
        }
        let (sender, receiver) = watch::channel(None);
        inflight.insert(key.to_string(), receiver);
        Fetch::Lead(FetchGuard {
            store: self.clone(),
            key: key.to_string(),
            sender,
        })
    }
}

/// Can this response be kept as the route's last good copy? `credentials`: the request
/// carried `Authorization`.
pub fn storable(
    status: StatusCode,
    headers: &HeaderMap,
    settings: &StaleSettings,
    credentials: bool,
) -> bool {
    if status != StatusCode::OK {
        return false;
    }
    let cache_control = headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",")
        .to_ascii_lowercase();
    if cache_control.contains("private") || cache_control.contains("no-store") {
        return false;
    }
    // The answer to a request with credentials is that user's page, unless the app says it
    // may be shared (RFC 9111 3.5).
    let shared_anyway = ["public", "s-maxage", "must-revalidate"]
        .iter()
        .any(|directive| cache_control.contains(directive));
    if credentials && !shared_anyway {
        return false;
    }
    if !settings.allow_set_cookie && headers.contains_key(header::SET_COOKIE) {
        return false;
    }
    // A copy answers any client, including one that cannot decode gzip: levee asks for an
    // uncompressed page, and an upstream that compresses anyway is not kept. Every field line
    // and every element counts: `identity` then `gzip` (two lines, or `identity, gzip`) is
    // a gzipped body (RFC 9110 8.4).
    let encoded = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .flat_map(|value| value.as_bytes().split(|byte| *byte == b','))
        .map(<[u8]>::trim_ascii)
        .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity"));
    if encoded {
        return false;
    }
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    length.is_none_or(|length| length <= settings.max_body)
}

/// The headers kept with a copy: everything but `Date`/`Age` (set fresh when served) and
/// cookies unless the route allows them.
fn kept_headers(headers: &HeaderMap, allow_set_cookie: bool) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| **name != header::DATE && **name != header::AGE)
        .filter(|(name, _)| allow_set_cookie || **name != header::SET_COOKIE)
        .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
        .collect()
}

pin_project! {
    /// Passes a response body through unchanged while keeping a copy (up to `max_body`);
    /// when the body ends complete, the copy is stored and waiting requests get it.
    pub struct Capture<B> {
        #[pin]
        inner: B,
        buffer: Option<BytesMut>,
        head: Option<StoredHead>,
        finish: Option<CaptureTarget>,
    }
}

/// Where a finished capture goes.
pub struct CaptureTarget {
    pub store: Arc<StaleStore>,
    pub key: String,
    pub redis: Option<Arc<RedisStore>>,
    pub settings: Arc<StaleSettings>,
    pub guard: Option<FetchGuard>,
}

impl<B> Capture<B> {
    pub fn new(
        inner: B,
        status: StatusCode,
        headers: &HeaderMap,
        target: CaptureTarget,
    ) -> Capture<B> {
        Capture {
            inner,
            buffer: Some(BytesMut::new()),
            head: Some((
                status.as_u16(),
                kept_headers(headers, target.settings.allow_set_cookie),
            )),
            finish: Some(target),
        }
    }
}

fn complete(
    buffer: &mut Option<BytesMut>,
    head: &mut Option<StoredHead>,
    finish: &mut Option<CaptureTarget>,
) {
    let (Some(body), Some((status, headers)), Some(target)) =
        (buffer.take(), head.take(), finish.take())
    else {
        return;
    };
    let copy = Arc::new(StaleCopy {
        status,
        headers,
        body: body.freeze(),
        stored_at_ms: now_ms(),
    });
    target.store.put(
        &target.key,
        copy.clone(),
        target.redis.clone(),
        target.settings.max_age,
    );
    if let Some(guard) = &target.guard {
        guard.finish(Some(copy));
    }
}

impl<B> Body for Capture<B>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(buffer)) = (frame.data_ref(), this.buffer.as_mut()) {
                    let limit = this
                        .finish
                        .as_ref()
                        .map_or(0, |target| target.settings.max_body);
                    if buffer.len() + data.len() > limit {
                        // Too big to keep: pass it on, store nothing.
                        *this.buffer = None;
                        *this.finish = None;
                    } else {
                        buffer.extend_from_slice(data);
                    }
                }
                if this.inner.is_end_stream() {
                    complete(this.buffer, this.head, this.finish);
                }
            }
            Poll::Ready(None) => complete(this.buffer, this.head, this.finish),
            Poll::Ready(Some(Err(_))) => {
                *this.buffer = None;
                *this.finish = None;
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The key of a route's copy: route, the `Host` the app is sent, normalised path and query,
/// and the `vary` values.
///
/// Every part is written with its length in front (`7:ranking`), and a missing query as `-`:
/// parts come from clients and may hold any separator (a `vary` cookie with `|`, a query with
/// `:`), and two different requests must never be given one key.
pub fn copy_key(
    prefix: &str,
    route: &str,
    host: &str,
    path: &str,
    query: Option<&str>,
    vary: &[String],
) -> String {
    let mut key = String::with_capacity(
        prefix.len() + route.len() + host.len() + path.len() + query.map_or(0, str::len) + 32,
    );
    key.push_str(prefix);
    key.push_str("stale:");
    push_part(&mut key, route);
    push_part(&mut key, host);
    push_part(&mut key, path);
    match query {
        Some(query) => {
            key.push('?');
            push_part(&mut key, query);
        }
        None => key.push('-'),
    }
    for value in vary {
        push_part(&mut key, value);
    }
    key
}

/// `len:part`: a part that reads the same whatever bytes it holds.
fn push_part(key: &mut String, part: &str) {
    use std::fmt::Write as _;
    let _ = write!(key, "{}:", part.len());
    key.push_str(part);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_round_trip_through_the_redis_encoding() {
        let copy = StaleCopy {
            status: 200,
            headers: vec![("content-type".into(), b"text/html".to_vec())],
            body: Bytes::from_static(b"<ol>\n<li>a</li></ol>"),
            stored_at_ms: 42,
        };
        let decoded = StaleCopy::decode(&copy.encode()).expect("decodes");
        assert_eq!(decoded.body, copy.body);
        assert_eq!(decoded.headers, copy.headers);
        assert_eq!(decoded.stored_at_ms, 42);
    }

    #[test]
    fn different_requests_never_share_a_key() {
        let key = |path: &str, query: Option<&str>, vary: &[&str]| {
            let vary: Vec<String> = vary.iter().map(|value| value.to_string()).collect();
            copy_key("levee:", "ranking", "example.com", path, query, &vary)
        };
        // A `|` in a vary value once ran into the next value.
        assert_ne!(key("/r", None, &["a|b", ""]), key("/r", None, &["a", "b|"]));
        assert_ne!(key("/r", None, &["a|", "b"]), key("/r", None, &["a", "|b"]));
        // Nor may a query run into the vary values, or a missing query be an empty one.
        assert_ne!(
            key("/r", Some("x|en"), &[""]),
            key("/r", Some("x"), &["en|"])
        );
        assert_ne!(key("/r", None, &[]), key("/r", Some(""), &[]));
        assert_ne!(key("/r?x", None, &[]), key("/r", Some("x"), &[]));
        // The same request is the same key.
        assert_eq!(
            key("/r", Some("x=1"), &["en"]),
            key("/r", Some("x=1"), &["en"])
        );
        // Routes and hosts do not run into each other either.
        assert_ne!(
            copy_key("levee:", "a", "b.example", "/", None, &[]),
            copy_key("levee:", "a:b", ".example", "/", None, &[])
        );
    }

    #[test]
    fn memory_is_bounded_by_bytes() {
        let store = StaleStore::new(1000);
        for i in 0..20 {
            let copy = StaleCopy {
                status: 200,
                headers: vec![],
                body: Bytes::from(vec![b'x'; 200]),
                stored_at_ms: 0,
            };
            store.remember(&format!("k{i}"), Arc::new(copy));
        }
        let l1 = store.l1.lock().expect("lock");
        assert!(l1.bytes <= 1000, "{}", l1.bytes);
        assert!(l1.copies.contains_key("k19") && !l1.copies.contains_key("k0"));
    }

    #[test]
    fn only_good_public_responses_are_kept() {
        let settings = StaleSettings {
            max_age: Duration::from_secs(60),
            vary: vec![],
            allow_set_cookie: false,
            max_body: 100,
        };
        let mut headers = HeaderMap::new();
        assert!(storable(StatusCode::OK, &headers, &settings, false));
        assert!(!storable(StatusCode::OK, &headers, &settings, true));
        assert!(!storable(StatusCode::NOT_FOUND, &headers, &settings, false));
        headers.insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static("private, max-age=0"),
        );
        assert!(!storable(StatusCode::OK, &headers, &settings, false));
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, max-age=60"),
        );
        assert!(storable(StatusCode::OK, &headers, &settings, true));
        let mut headers = HeaderMap::new();
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("a=1"));
        assert!(!storable(StatusCode::OK, &headers, &settings, false));
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("101"));
        assert!(!storable(StatusCode::OK, &headers, &settings, false));
    }

    #[test]
    fn every_content_encoding_counts_not_only_the_first() {
        let settings = StaleSettings {
            max_age: Duration::from_secs(60),
            vary: vec![],
            allow_set_cookie: false,
            max_body: 100,
        };
        let encoded = |values: &[&'static str]| {
            let mut headers = HeaderMap::new();
            for value in values {
                headers.append(header::CONTENT_ENCODING, HeaderValue::from_static(value));
            }
            !storable(StatusCode::OK, &headers, &settings, false)
        };
        assert!(!encoded(&[]));
        assert!(!encoded(&["identity"]));
        assert!(!encoded(&["Identity", " identity ,"]));
        assert!(encoded(&["gzip"]));
        assert!(encoded(&["identity", "gzip"]));
        assert!(encoded(&["identity, gzip"]));
        assert!(encoded(&["IDENTITY,br"]));
    }
}
