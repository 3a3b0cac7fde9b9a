//! Last good copies of `stale` routes ("serve the cached ranking").
//!
//! Each good response of a stale route refreshes its copy: in memory (L1, bounded by bytes)
//! and in Redis when configured (shared by the fleet, survives restarts). The copy answers
//! when the route is switched off, when its upstream's breaker is open, or when the upstream
//! fails. Concurrent requests for a key that is being fetched wait for that one fetch
//! instead of all going upstream.
//!
//! A route keeps at most `max_copies` copies, in memory and in Redis each: the one stored
//! longest ago goes first. In Redis a route's copies and its index (a sorted set of the copy
//! keys by store time) share one hash tag, so a store and its trimming run as one script on
//! one node of a cluster.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{CopyQuery, StaleSettings};
use crate::error::{full_body, BoxError};
use crate::limit::key::{hashed, hex};
use crate::metrics::Metrics;
use crate::proxy::body::{BodyPieces, ResponseBody};
use crate::proxy::header::{field_lines, response_spelling, ReceivedHead};
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

/// Copies are stamped and aged on a step-free clock, and their times written into Redis on
/// the fleet's (see [`crate::fleet_clock`]).
fn now_ms() -> u64 {
    crate::fleet_clock::local_ms()
}

impl StaleCopy {
    pub fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.stored_at_ms))
    }

    /// The copy as a response. `stale` adds `X-Levee-Stale: 1`; both carry `Age`.
    pub fn to_response(&self, stale: bool) -> Response<ResponseBody> {
        let mut response = Response::new(full_body(self.body.clone()));
        *response.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        // Copies stored in Redis by older versions may still hold a cookie.
        let (map, lines) = field_lines(
            self.headers
                .iter()
                .filter(|(name, _)| !name.eq_ignore_ascii_case("set-cookie"))
                .map(|(name, value)| (name.as_str(), value.as_slice())),
        );
        // The names go back as the app spelled them (copies stored by older versions hold
        // them in lower case).
        *response.headers_mut() = map;
        response.extensions_mut().insert(ReceivedHead(lines));
        let headers = response.headers_mut();
        headers.insert(header::AGE, HeaderValue::from(self.age().as_secs()));
        if stale {
            headers.insert(
                HeaderName::from_static("x-levee-stale"),
                HeaderValue::from_static("1"),
            );
        }
        response
    }

    /// Redis value: JSON head (its time on the fleet's clock), a newline, then the body bytes.
    fn encode(&self) -> Vec<u8> {
        let shared = StaleCopy {
            stored_at_ms: crate::fleet_clock::to_fleet(self.stored_at_ms),
            ..self.clone()
        };
        let mut out = serde_json::to_vec(&shared).unwrap_or_default();
        out.push(b'\n');
        out.extend_from_slice(&self.body);
        out
    }

    fn decode(bytes: &[u8]) -> Option<StaleCopy> {
        let split = bytes.iter().position(|b| *b == b'\n')?;
        let mut copy: StaleCopy = serde_json::from_slice(&bytes[..split]).ok()?;
        copy.stored_at_ms = crate::fleet_clock::to_local(copy.stored_at_ms);
        copy.body = Bytes::copy_from_slice(&bytes[split + 1..]);
        Some(copy)
    }
}

/// What a copy stored under `key` costs in memory: its body and fields, and what holds them
/// and the key (the map's slot, the key written twice, in the map and in its route's order,
/// the route's name, each field's and the copy's own allocations). Counted as the body and
/// fields alone, a store of small pages held two to five times the bytes it was allowed.
fn entry_weight(key: &CopyKey, copy: &StaleCopy) -> usize {
    /// The map slot, the `Entry`, the copy's `Arc` and struct, the order entry, and the
    /// allocator's share of each (measured: some 1 KB per small page in all, with a few
    /// fields and a key of 100 bytes).
    const PER_COPY: usize = 512;
    /// A field's two allocations and their place in the list.
    const PER_FIELD: usize = 80;
    copy.body.len()
        + copy
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.len() + PER_FIELD)
            .sum::<usize>()
        + 2 * key.key.len()
        + key.index.len()
        + PER_COPY
}

/// A copy in memory, with the number of its store (`order` entries naming another number are
/// left over from an earlier store of the key, or from a copy since removed) and its route's
/// index key.
struct Entry {
    copy: Arc<StaleCopy>,
    /// Its [`entry_weight`], counted in the store's and its route's bytes.
    weight: usize,
    stored: u64,
    route: String,
    /// When a copy of this key last went to Redis from here, or came from there (ms).
    in_redis_at_ms: u64,
}

/// One route's copies in memory, oldest store first (with left-over entries, see [`Entry`]).
#[derive(Default)]
struct RouteCopies {
    order: VecDeque<(String, u64)>,
    live: usize,
    bytes: usize,
}

#[derive(Default)]
struct L1 {
    copies: HashMap<String, Entry>,
    /// By route index key: each route's copies, bounded by its `max_copies`; when memory is
    /// full, the route holding the most gives up its oldest.
    routes: HashMap<String, RouteCopies>,
    stores: u64,
    bytes: usize,
    /// Keys whose copy here is past `max_age` and for which Redis had nothing newer, with
    /// when it was asked (ms): it is not asked again for a moment (see `StaleStore::get`).
    asked_redis: HashMap<String, u64>,
    /// Keys with no copy here that Redis had none of either, with when it was asked (ms):
    /// not asked again for a moment, as above. A route that is off or failing with no copy
    /// (cache-busting queries, pages nobody fetched while it was healthy) otherwise made a
    /// Redis read of every request. At most [`MAX_MISSES`] keys; past it, forgotten at once.
    /// Kept by a hash of the key (with this process's random seed), not the key: keys hold
    /// the path, query and `vary` values a client chose, up to the header size limit each.
    missed_redis: HashMap<u64, u64>,
    /// The seed of those hashes.
    miss_seed: std::hash::RandomState,
}

/// Most keys remembered as missing from Redis (see `L1::missed_redis`).
const MAX_MISSES: usize = 10_000;

/// How long a key whose copy in memory is too old waits before Redis is asked again for a
/// newer one: a tenth of `max_age`, at most a second. Every request of a route that is off,
/// shed or failing looks for its copy, and each would otherwise wait for Redis in vain.
fn ask_redis_again_after(max_age: Duration) -> Duration {
    (max_age / 10).min(Duration::from_secs(1))
}

type Inflight = HashMap<String, watch::Receiver<FetchState>>;

/// How far the fetch of a copy has come, as its waiters see it.
#[derive(Clone)]
pub enum FetchState {
    /// Upstream has not answered yet.
    Fetching,
    /// The answer's head is in, and it is being kept as the copy; its body comes as fast as
    /// the upstream sends it and the leading request's client reads it (see [`BodyPace`]).
    Answered(Arc<BodyPace>),
    /// The copy is stored.
    Done(Arc<StaleCopy>),
    /// Upstream did not answer within its response timeout: nor would it for the waiters.
    TimedOut,
}

/// How long, in all, the client of the request that fetches a copy (its reader) may hold the
/// copy's body back before the requests waiting for the copy stop waiting and go upstream
/// themselves: a slow reader (a phone on a bad line, a large page) would otherwise hold every
/// waiter. A healthy upstream's page read at a normal pace is in well within this. Only the
/// time the body's bytes are there for the reader to take and it has not asked for them
/// counts (see [`BodyPace`]): while the upstream is still making the page (a PHP script that
/// flushed its head before a slow query), the waiters keep waiting, up to their own response
/// timeout, since a fetch of their own would be as slow and would take a php-fpm worker each.
pub const MAX_READER_HOLD: Duration = Duration::from_secs(1);

/// How the body of a fetch's answer is coming, as its [`Capture`] sees it: whether the
/// upstream is what it waits for (no bytes yet) or the reader, the leading request's client
/// (bytes there that it has not asked for), and how long the reader has held it back in all.
/// Waiters go upstream once the reader has held it back for [`MAX_READER_HOLD`]; time spent
/// waiting for the upstream does not count.
///
/// The capture learns that the upstream has sent more by being the waker the upstream's body
/// wakes (see `Capture::poll_frame`): the response writer polls the body once, and when it
/// has nothing, flushes what it gathered to the client before polling again; a client that
/// stops reading then holds the writer in that flush, which is the reader's time once the
/// upstream's next bytes are in, not the upstream's.
pub struct BodyPace {
    state: Mutex<PaceState>,
}

struct PaceState {
    /// How long the reader held the body back before `reader_since`.
    held: Duration,
    /// Since when the body (or the head) has been there for the reader to take without its
    /// asking for more; `None` while the capture waits for the upstream.
    reader_since: Option<Instant>,
    /// The task reading the body, woken when the upstream has more.
    reader: Option<Waker>,
    /// The reader went away and the capture reads the rest itself, taking each frame as it
    /// comes (see `Capture`'s `Drop`): from then on only the upstream is waited for.
    read_on: bool,
}

impl BodyPace {
    /// The head is in, handed to the reader at `now`.
    fn new(now: Instant) -> BodyPace {
        BodyPace {
            state: Mutex::new(PaceState {
                held: Duration::ZERO,
                reader_since: Some(now),
                reader: None,
                read_on: false,
            }),
        }
    }

    /// How long the reader has held the body back in all, by `now`.
    pub fn held(&self, now: Instant) -> Duration {
        self.state.lock().map_or(Duration::ZERO, |state| {
            state.held
                + state
                    .reader_since
                    .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
        })
    }

    /// The reader (whose task `waker` wakes) asks for more at `now`: its hold ends.
    fn asked(&self, now: Instant, waker: &Waker) {
        if let Ok(mut state) = self.state.lock() {
            if let Some(since) = state.reader_since.take() {
                state.held += now.saturating_duration_since(since);
            }
            if !state
                .reader
                .as_ref()
                .is_some_and(|old| old.will_wake(waker))
            {
                state.reader = Some(waker.clone());
            }
        }
    }

    /// A frame was handed to the reader at `now`: its turn again.
    fn handed(&self, now: Instant) {
        if let Ok(mut state) = self.state.lock() {
            if !state.read_on {
                state.reader_since = Some(now);
            }
        }
    }

    /// The reader went away at `now` and the capture reads the rest of the body itself: what
    /// the reader held back so far stays counted, and nothing more is (no client holds bytes
    /// any more; the body waits only for the upstream).
    fn read_on(&self, now: Instant) {
        if let Ok(mut state) = self.state.lock() {
            if let Some(since) = state.reader_since.take() {
                state.held += now.saturating_duration_since(since);
            }
            state.read_on = true;
        }
    }
}

impl std::task::Wake for BodyPace {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    /// The upstream has more (or its body's timer ran out): the reader's turn, until it asks.
    fn wake_by_ref(self: &Arc<Self>) {
        let reader = self.state.lock().ok().and_then(|mut state| {
            if !state.read_on {
                state.reader_since.get_or_insert_with(Instant::now);
            }
            state.reader.clone()
        });
        if let Some(reader) = reader {
            reader.wake();
        }
    }
}

/// How often one key's copy goes to Redis from one instance at most. Every good answer of a
/// `stale` route replaces the copy in memory; each one sent to Redis too (the whole page
/// through an EVAL) made a page served 1,000 times a second 1,000 writes of its size a second,
/// on the connection rate-limit calls share. Other instances read Redis only when their own
/// copy aged, so a copy there a second older changes nothing they serve.
const REDIS_REFRESH_MS: u64 = 1000;

/// Copies on their way to Redis at once, at most: past this (Redis slow, pages large) a copy
/// stays in memory only, as when Redis is down, rather than every request leaving a page
/// waiting for Redis in memory.
const REDIS_STORES_IN_FLIGHT: usize = 16;

/// What a request that waited for another's fetch does next.
#[derive(Debug)]
pub enum Waited {
    /// The fetch stored this copy: it answers the waiter too.
    Copy(Arc<StaleCopy>),
    /// No copy is coming (the fetch failed, or its answer is not kept), or the fetch's client
    /// holds the body back (see [`MAX_READER_HOLD`]): go upstream.
    GoUpstream,
    /// The waiter has waited as long as it would have for an answer of its own (its response
    /// timeout) and no head came, or the fetch's upstream timed out.
    TimedOut,
}

/// Waits for the copy the fetch `receiver` follows will store: for its answer's head at most
/// `for_answer` (the wait the request would have for an answer of its own: the upstream's
/// response timeout), and, once the head is in, for as long as the upstream writes the body,
/// but only while the fetch's client has held the body back for less than `reader_may_hold`
/// in all (see [`BodyPace`]; [`MAX_READER_HOLD`]). A request that joins a fetch whose client
/// has held it back that long already goes upstream at once. A fetch that timed out, or no
/// head by `for_answer`, ends the wait with [`Waited::TimedOut`].
pub async fn wait_for_copy(
    mut receiver: watch::Receiver<FetchState>,
    for_answer: Duration,
    reader_may_hold: Duration,
) -> Waited {
    let deadline = Instant::now() + for_answer;
    // While the upstream is what the body waits for, the client's hold does not grow; the
    // waiter looks again no more often than this, rather than being woken at every frame.
    let recheck = reader_may_hold / 10;
    loop {
        let now = Instant::now();
        let (until, answered) = match &*receiver.borrow_and_update() {
            FetchState::Done(copy) => return Waited::Copy(copy.clone()),
            FetchState::TimedOut => return Waited::TimedOut,
            FetchState::Fetching => (deadline, false),
            FetchState::Answered(pace) => {
                let held = pace.held(now);
                if held >= reader_may_hold {
                    return Waited::GoUpstream;
                }
                // The hold grows no faster than time passes: it cannot reach the bound sooner.
                // `for_answer` bounds the wait for the head, which came: a request of its own
                // would be reading the same slow body now (the fetch fails, and the waiters
                // with it, when the upstream goes silent for its `idle_body_timeout`).
                (now + (reader_may_hold - held).max(recheck), true)
            }
        };
        match tokio::time::timeout_at(until, receiver.changed()).await {
            Ok(Ok(())) => {}
            // The leader let go without a copy (the channel closed).
            Ok(Err(_)) => {
                return match &*receiver.borrow() {
                    FetchState::Done(copy) => Waited::Copy(copy.clone()),
                    FetchState::TimedOut => Waited::TimedOut,
                    _ => Waited::GoUpstream,
                }
            }
            Err(_elapsed) if !answered && Instant::now() >= deadline => return Waited::TimedOut,
            Err(_elapsed) => {}
        }
    }
}

pub struct StaleStore {
    l1: Mutex<L1>,
    /// `[degrade] stale_memory` of the policy in force (see [`Self::set_max_bytes`]).
    max_bytes: std::sync::atomic::AtomicUsize,
    inflight: Mutex<Inflight>,
    redis_stores: Arc<tokio::sync::Semaphore>,
}

/// The outcome of asking to fetch a key.
pub enum Fetch {
    /// Go upstream; the guard tells the waiters what came of it.
    Lead(FetchGuard),
    /// Someone else is fetching it: wait for their copy ([`wait_for_copy`]).
    Wait(watch::Receiver<FetchState>),
}

/// Held by the one request that fetches a key; dropping it without a copy lets the waiters
/// go upstream themselves.
pub struct FetchGuard {
    store: Arc<StaleStore>,
    key: String,
    sender: watch::Sender<FetchState>,
}

impl FetchGuard {
    /// The answer's head is in and is being kept: from now, waiters wait only while this
    /// request's client does not hold the body back for long (see [`wait_for_copy`]).
    pub fn answered(&self) {
        self.sender.send_if_modified(|state| {
            let fetching = matches!(state, FetchState::Fetching);
            if fetching {
                *state = FetchState::Answered(Arc::new(BodyPace::new(Instant::now())));
            }
            fetching
        });
    }

    /// How the answer's body is coming, once its head is in (see [`Self::answered`]).
    fn pace(&self) -> Option<Arc<BodyPace>> {
        match &*self.sender.borrow() {
            FetchState::Answered(pace) => Some(pace.clone()),
            _ => None,
        }
    }

    /// Upstream did not answer within its response timeout: the waiters answer as this
    /// request does, instead of each waiting that long again.
    pub fn timed_out(&self) {
        self.sender.send_if_modified(|state| {
            let fetching = matches!(state, FetchState::Fetching);
            if fetching {
                *state = FetchState::TimedOut;
            }
            fetching
        });
    }

    fn finish(&self, copy: Arc<StaleCopy>) {
        let _ = self.sender.send(FetchState::Done(copy));
        if let Ok(mut inflight) = self.store.inflight.lock() {
            inflight.remove(&self.key);
        }
    }
}

impl Drop for FetchGuard {
    fn drop(&mut self) {
        if !matches!(*self.sender.borrow(), FetchState::Done(_)) {
            // Wake waiters with "no copy" (the channel closes without one).
            if let Ok(mut inflight) = self.store.inflight.lock() {
                inflight.remove(&self.key);
            }
        }
    }
}

impl L1 {
    fn remove(&mut self, key: &str) {
        let Some(entry) = self.copies.remove(key) else {
            return;
        };
        self.bytes -= entry.weight;
        self.asked_redis.remove(key);
        if let Some(route) = self.routes.get_mut(&entry.route) {
            route.live -= 1;
            route.bytes -= entry.weight;
            if route.live == 0 {
                self.routes.remove(&entry.route);
            }
        }
    }

    /// Is this `order` entry the key's current store?
    fn current(&self, (key, stored): &(String, u64)) -> bool {
        self.copies
            .get(key)
            .is_some_and(|entry| entry.stored == *stored)
    }
}

impl StaleStore {
    pub fn new(max_bytes: usize) -> StaleStore {
        StaleStore {
            l1: Mutex::new(L1::default()),
            max_bytes: std::sync::atomic::AtomicUsize::new(max_bytes),
            inflight: Mutex::new(HashMap::new()),
            redis_stores: Arc::new(tokio::sync::Semaphore::new(REDIS_STORES_IN_FLIGHT)),
        }
    }

    /// The freshest copy of `key` at hand: the one in memory while it is within `max_age`;
    /// otherwise Redis is asked too, since another instance may have stored a newer one
    /// there (this instance's own copy ages while its upstream fails or its route is off,
    /// when the others may still have fetched the page). Without Redis, or when Redis does
    /// not answer within its timeout, the copy in memory is all there is.
    pub async fn get(
        &self,
        copy_key: &CopyKey,
        settings: &StaleSettings,
        redis: Option<&RedisStore>,
        metrics: &Metrics,
    ) -> Option<Arc<StaleCopy>> {
        let (key, max_age) = (copy_key.key.as_str(), settings.max_age);
        let local = copy_key.in_memory();
        let (in_memory, asked_at) = match self.l1.lock() {
            Ok(l1) => {
                let copy = l1.copies.get(local).map(|entry| entry.copy.clone());
                let asked = if copy.is_some() {
                    l1.asked_redis.get(local).copied()
                } else {
                    let hashed = l1.miss_seed.hash_one(local);
                    l1.missed_redis.get(&hashed).copied()
                };
                (copy, asked)
            }
            Err(_) => (None, None),
        };
        if in_memory.as_ref().is_some_and(|copy| copy.age() <= max_age) {
            return in_memory;
        }
        let again = ask_redis_again_after(max_age).as_millis() as u64;
        if asked_at.is_some_and(|at| now_ms().saturating_sub(at) < again) {
            return in_memory;
        }
        let Some(redis) = redis else {
            return in_memory;
        };
        let mut command = redis::cmd("GET");
        command.arg(key);
        // Only an answer is remembered as one: a failure counts against Redis's health
        // breaker on each request, which is what stops the asking while it is down.
        let (shared, answered) = match redis
            .command::<Option<Vec<u8>>>(
                &command,
                redis.settings.timeout,
                Some(crate::redis_store::Guard { key, metrics }),
            )
            .await
        {
            Ok(bytes) => (
                bytes.as_deref().and_then(StaleCopy::decode).map(Arc::new),
                true,
            ),
            Err(error) => {
                tracing::debug!(%key, "stale copy not read from redis: {error}");
                (None, false)
            }
        };
        match shared {
            // A fresher copy may have been stored here meanwhile: the newest wins.
            Some(shared) => Some(self.remember_if_newer(copy_key, shared, settings.max_copies)),
            None => {
                if let Ok(mut l1) = self.l1.lock() {
                    if l1.copies.contains_key(local) {
                        l1.asked_redis.insert(local.to_string(), now_ms());
                    } else if in_memory.is_none() && answered {
                        if l1.missed_redis.len() >= MAX_MISSES {
                            l1.missed_redis.clear();
                        }
                        let hashed = l1.miss_seed.hash_one(local);
                        l1.missed_redis.insert(hashed, now_ms());
                    }
                }
                in_memory
            }
        }
    }

    /// Keeps `copy` unless the copy in memory is at least as new; returns the one kept.
    fn remember_if_newer(
        &self,
        key: &CopyKey,
        copy: Arc<StaleCopy>,
        max_copies: usize,
    ) -> Arc<StaleCopy> {
        let Ok(mut l1) = self.l1.lock() else {
            return copy;
        };
        if let Some(current) = l1.copies.get(key.in_memory()) {
            if current.copy.stored_at_ms >= copy.stored_at_ms {
                let current = current.copy.clone();
                l1.asked_redis.insert(key.in_memory().to_string(), now_ms());
                return current;
            }
        }
        self.insert(&mut l1, key, copy.clone(), max_copies, now_ms());
        copy
    }

    /// Keeps `copy` in memory. Returns whether it is to go to Redis too: when no copy of the
    /// key went there (or came from there) for [`REDIS_REFRESH_MS`], and `to_redis` is asked.
    fn remember(
        &self,
        key: &CopyKey,
        copy: Arc<StaleCopy>,
        max_copies: usize,
        to_redis: bool,
    ) -> bool {
        let Ok(mut l1) = self.l1.lock() else {
            return false;
        };
        let now = now_ms();
        let last = l1
            .copies
            .get(key.in_memory())
            .map_or(0, |entry| entry.in_redis_at_ms);
        let send = to_redis && now.saturating_sub(last) >= REDIS_REFRESH_MS;
        self.insert(
            &mut l1,
            key,
            copy,
            max_copies,
            if send { now } else { last },
        );
        send
    }

    fn max_bytes(&self) -> usize {
        self.max_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bounds the copies in memory to `bytes` (the policy's `stale_memory`, applied at start
    /// and within a `sync_interval` of a reload), dropping copies now when they are over it.
    pub fn set_max_bytes(&self, bytes: usize) {
        let before = self
            .max_bytes
            .swap(bytes, std::sync::atomic::Ordering::Relaxed);
        if bytes < before {
            if let Ok(mut l1) = self.l1.lock() {
                Self::trim(&mut l1, bytes);
            }
        }
    }

    /// While memory is over `max_bytes`, drops the oldest copy of the route that holds the
    /// most.
    fn trim(l1: &mut L1, max_bytes: usize) {
        while l1.bytes > max_bytes {
            let largest = l1
                .routes
                .iter()
                .max_by_key(|(_, route)| route.bytes)
                .map(|(name, _)| name.clone());
            let oldest = largest
                .and_then(|name| l1.routes.get_mut(&name))
                .and_then(|route| route.order.pop_front());
            let Some(oldest) = oldest else {
                break;
            };
            if l1.current(&oldest) {
                l1.remove(&oldest.0);
            }
        }
    }

    /// Keeps `copy` as the newest store, then drops the route's oldest copies beyond
    /// `max_copies`, and while memory is over its bound, the oldest copy of the route that
    /// holds the most: a route flooded with keys (cache-busting queries) evicts its own copies
    /// before any other route's.
    fn insert(
        &self,
        l1: &mut L1,
        key: &CopyKey,
        copy: Arc<StaleCopy>,
        max_copies: usize,
        in_redis_at_ms: u64,
    ) {
        let weight = entry_weight(key, &copy);
        let max_bytes = self.max_bytes();
        if weight > max_bytes {
            return;
        }
        let (local, route_key) = (key.in_memory(), key.route_in_memory());
        l1.asked_redis.remove(local);
        let hashed = l1.miss_seed.hash_one(local);
        l1.missed_redis.remove(&hashed);
        l1.stores += 1;
        let stored = l1.stores;
        let entry = Entry {
            copy,
            weight,
            stored,
            route: route_key.to_string(),
            in_redis_at_ms,
        };
        let replaced = l1.copies.insert(local.to_string(), entry);
        let route = l1.routes.entry(route_key.to_string()).or_default();
        match &replaced {
            Some(old) => route.bytes -= old.weight,
            None => route.live += 1,
        }
        route.bytes += weight;
        route.order.push_back((local.to_string(), stored));
        l1.bytes += weight;
        if let Some(old) = replaced {
            l1.bytes -= old.weight;
        }

        loop {
            let oldest = match l1.routes.get_mut(route_key) {
                Some(route) if route.live > max_copies => route.order.pop_front(),
                _ => None,
            };
            let Some(oldest) = oldest else {
                break;
            };
            if l1.current(&oldest) {
                l1.remove(&oldest.0);
            }
        }
        Self::trim(l1, max_bytes);

        // Left-over entries (of keys stored again, or removed) are dropped once they
        // outnumber the route's copies, so its queue stays within twice the copies kept.
        let overgrown = l1
            .routes
            .get(route_key)
            .is_some_and(|route| route.order.len() > 2 * route.live + 16);
        if overgrown {
            if let Some(mut route) = l1.routes.remove(route_key) {
                route.order.retain(|entry| l1.current(entry));
                l1.routes.insert(route_key.to_string(), route);
            }
        }
    }

    /// Stores a fresh copy in memory now and in Redis in the background (at most once a
    /// [`REDIS_REFRESH_MS`] per key), where the route's oldest copies beyond `max_copies` are
    /// deleted in the same script. When Redis fails or does not answer within its timeout (at
    /// least 250 ms here, as no request waits for it), the copy is kept in memory only: it
    /// still answers this instance's requests.
    pub fn put(
        &self,
        key: &CopyKey,
        copy: Arc<StaleCopy>,
        redis: Option<Arc<RedisStore>>,
        metrics: &Arc<crate::metrics::Metrics>,
        settings: &StaleSettings,
    ) {
        // While Redis is known to be down (its health breaker is open) the copy is kept in
        // memory only, as when a store fails; the next fresh answer after Redis is back goes
        // to Redis again. So is it while enough copies are on their way there. Once the
        // breaker's cool-down is over the store is its probe (on a site whose routes have no
        // rate limits, nothing else would find Redis back); while it is closed, a store that
        // fails (a large copy on a busy Redis) does not count against it.
        let leave = redis.as_ref().and_then(|redis| redis.leave_for(&key.key));
        let redis = redis.filter(|_| leave.is_some());
        let probe = leave == Some(true);
        let permit = redis
            .as_ref()
            .and_then(|_| self.redis_stores.clone().try_acquire_owned().ok());
        let send = self.remember(key, copy.clone(), settings.max_copies, permit.is_some());
        if let (Some(redis), Some(permit), true) = (redis, permit, send) {
            let key = key.clone();
            let metrics = metrics.clone();
            let (max_age, max_copies) = (settings.max_age, settings.max_copies);
            tokio::spawn(async move {
                let mut command = redis::cmd("EVAL");
                command
                    .arg(STORE_SCRIPT)
                    .arg(2)
                    .arg(&key.key)
                    .arg(&key.index)
                    .arg(copy.encode())
                    .arg(max_age.as_millis().max(1) as u64)
                    .arg(crate::fleet_clock::to_fleet(copy.stored_at_ms))
                    .arg(max_copies);
                let timeout = redis.settings.timeout.max(Duration::from_millis(250));
                let guard = probe.then_some(crate::redis_store::Guard {
                    key: &key.key,
                    metrics: &metrics,
                });
                if let Err(error) = redis.command::<i64>(&command, timeout, guard).await {
                    tracing::debug!(key = %key.key, "stale copy not stored in redis: {error}");
                }
                drop(permit);
            });
        }
    }

    /// Wait for the fetch of `key` in flight, if there is one; never leads one.
    pub fn fetch_in_flight(&self, key: &str) -> Option<Fetch> {
        let inflight = self.inflight.lock().ok()?;
        inflight.get(key).cloned().map(Fetch::Wait)
    }

    /// Either lead the fetch of `key` or wait for the one in flight.
    pub fn fetch(self: &Arc<Self>, key: &str) -> Fetch {
        let Ok(mut inflight) = self.inflight.lock() else {
            let (sender, _) = watch::channel(FetchState::Fetching);
            return Fetch::Lead(FetchGuard {
                store: self.clone(),
                key: key.to_string(),
                sender,
            });
        };
        if let Some(receiver) = inflight.get(key) {
            return Fetch::Wait(receiver.clone());
        }
        let (sender, receiver) = watch::channel(FetchState::Fetching);
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
    why_not_storable(status, headers, settings, credentials, false).is_none()
}

/// Why a response cannot be kept as the route's last good copy (`None`: it can), as the
/// `reason` of `levee_stale_not_kept_total` names it.
pub fn why_not_storable(
    status: StatusCode,
    headers: &HeaderMap,
    settings: &StaleSettings,
    credentials: bool,
    cookies: bool,
) -> Option<&'static str> {
    let not = Some;
    if status != StatusCode::OK {
        return not("status");
    }
    // An event stream never ends as a page does, and its events are each client's own: kept
    // (or shared), a second visitor waited for the first one's whole stream and got its
    // events in one lump, and one at a degraded level got a recording.
    if is_event_stream(headers) {
        return not("event_stream");
    }
    let cache_control = headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",")
        .to_ascii_lowercase();
    if cache_control.contains("private") || cache_control.contains("no-store") {
        return not("private");
    }
    // The answer to a request with credentials is that user's page, unless the app says it
    // may be shared (RFC 9111 3.5).
    let shared_anyway = ["public", "s-maxage", "must-revalidate"]
        .iter()
        .any(|directive| cache_control.contains(directive));
    if credentials && !shared_anyway {
        return not("credentials");
    }
    // An answer the app says must not be used again without asking it (`no-cache`,
    // `max-age=0`), made for a request that carried cookies, is taken for that visitor's
    // page: WordPress marks a logged-in user's pages so, and no more, and a copy of one
    // showed the admin bar to every visitor. Pages for requests without cookies are kept,
    // and `public` or `s-maxage` says the app means them for everyone.
    let must_ask_again = cache_control.contains("no-cache")
        || cache_control
            .split(',')
            .any(|directive| directive.trim() == "max-age=0");
    let shared = ["public", "s-maxage"]
        .iter()
        .any(|directive| cache_control.contains(directive));
    if cookies && must_ask_again && !shared && !settings.keep_no_cache {
        return not("cookie_no_cache");
    }
    if !settings.allow_set_cookie && headers.contains_key(header::SET_COOKIE) {
        return not("set_cookie");
    }
    if !vary_is_keyed(headers, settings) {
        return not("vary");
    }
    // A copy answers any client, including one that cannot decode gzip: levee asks for an
    // uncompressed page, and an upstream that compresses anyway is not kept.
    if crate::proxy::header::is_content_coded(headers) {
        return not("content_coded");
    }
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if length.is_some_and(|length| length > settings.max_body) {
        return not("too_large");
    }
    None
}

/// Whether the answer is an event stream (`Content-Type: text/event-stream`, Server-Sent
/// Events).
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| is_event_stream_type(value.as_bytes()))
}

/// Whether a `Content-Type` value names an event stream (`text/event-stream; charset=utf-8`).
pub fn is_event_stream_type(value: &[u8]) -> bool {
    let kind = value.split(|&byte| byte == b';').next().unwrap_or_default();
    kind.trim_ascii().eq_ignore_ascii_case(b"text/event-stream")
}

/// Every `reason` a page is not kept for (`levee_stale_not_kept_total{reason}`), each said
/// by [`not_kept_because`]: the series of a route a reload removed are dropped by these.
pub const NOT_KEPT_REASONS: [&str; 10] = [
    "private",
    "credentials",
    "cookie_no_cache",
    "set_cookie",
    "vary",
    "content_coded",
    "too_large",
    "event_stream",
    "own_cookie",
    "status",
];

/// What a `reason` of [`why_not_storable`] means, for the log.
pub fn not_kept_because(reason: &str) -> &'static str {
    match reason {
        "private" => "the app marked it Cache-Control: private or no-store",
        "credentials" => "the request carried Authorization and the app did not mark the answer public",
        "cookie_no_cache" => "the request carried cookies and the app marked the answer no-cache or max-age=0 (a logged-in user's page, as WordPress marks them), not public (keep_no_cache = true keeps them, for an app that marks every page so)",
        "set_cookie" => "it sets a cookie (Set-Cookie) and allow_set_cookie is false: a page that starts a session on every view is never kept",
        "vary" => "its Vary names a field the copy is not keyed by (list it in vary)",
        "content_coded" => "the app compressed it, though levee asked for it uncompressed",
        "too_large" => "it is larger than max_body",
        "event_stream" => "it is an event stream (text/event-stream), open-ended and each client's own: give it a route without stale",
        "own_cookie" => "the app set again a cookie the request carried (that visitor's session, renewed): the page is that visitor's",
        _ => "its status is not 200",
    }
}

/// Whether every field the answer's `Vary` names also selects its copy (RFC 9111 4.1): the
/// app says the page differs by them, and a copy kept under a key without them would answer
/// one client with another's page (`Vary: Cookie` on a personal page). Keyed are:
/// `Accept-Encoding` (copies are fetched and kept uncompressed, see `storable`), a field that
/// `vary` names as `header:NAME`, and `Cookie` when `vary` names one of its cookies (the
/// operator's word that those are the cookies the page depends on). `Vary: *` never is.
fn vary_is_keyed(headers: &HeaderMap, settings: &StaleSettings) -> bool {
    let keyed = |field: &str| {
        field.eq_ignore_ascii_case("accept-encoding")
            // Keyed by what a trusted front says of them (`forwarded_description`); from
            // anyone else they never reach the app.
            || crate::proxy::header::keys_copies(field)
            || settings.vary.iter().any(|source| match source {
                crate::limit::key::Source::Header(name) => {
                    field.eq_ignore_ascii_case(name.as_str())
                }
                crate::limit::key::Source::Cookie(_) => field.eq_ignore_ascii_case("cookie"),
                crate::limit::key::Source::Query(_) => false,
            })
    };
    crate::proxy::header::list_elements(headers, &header::VARY)
        .all(|field| std::str::from_utf8(field).is_ok_and(|field| field != "*" && keyed(field)))
}

/// The headers kept with a copy: everything but `Age` (the copy's own is set when it is
/// served, from the age it came with: see `Capture::new`) and `Set-Cookie`. `Date` stays the
/// app's, when the page was made (RFC 9110 6.6.1), so a cache downstream reckons the copy's
/// age right. A copy answers every client, and a cookie the app set for one (its session)
/// must never reach another; with `allow_set_cookie` the page is kept, its cookies are not.
/// Names are kept as the app spelled them (see `ReceivedHead`).
fn kept_headers(headers: &HeaderMap, received: Option<&ReceivedHead>) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| **name != header::AGE && **name != header::SET_COOKIE)
        .map(|(name, value)| {
            let spelled = response_spelling(received, name, value.as_bytes());
            (
                String::from_utf8_lossy(spelled).into_owned(),
                value.as_bytes().to_vec(),
            )
        })
        .collect()
}

/// Passes a response body through unchanged while keeping a copy (up to `max_body`);
/// when the body ends complete, the copy is stored and waiting requests get it.
///
/// Dropped before the copy is complete (the leading request's client went away mid-page: a
/// visitor who gives up on a slow page and reloads), it reads the rest of the body on a task
/// of its own and stores the copy as at a normal end. Letting go of the fetch there would
/// release every request waiting for it at once, each to fetch the page from the app itself:
/// a stampede on php-fpm exactly when it is slow, for a page it is still making anyway. The
/// rest is read until the body ends, fails (a body stalled past `idle_body_timeout` fails
/// inside it), grows past `max_body` (nothing more would be kept), or for at most the bound
/// given to `new` in all; short of its end, the waiters go upstream as before. Each waiter's
/// own bounds still hold (see [`wait_for_copy`]). A bulkhead slot inside the body
/// (`SlotHeld`) stays taken until the body is read: the script is still running.
pub struct Capture {
    inner: Option<ResponseBody>,
    // The body's frames as they passed (shared with the response, small ones copied
    // together: see `BodyPieces`), put together once, in a buffer of the body's exact
    // size, when the body is complete: a buffer grown frame by frame doubles its room,
    // and a frame kept as it is may be a slice of a larger read buffer; either way a copy
    // would hold up to twice its size in memory, beyond what the store's budget counts.
    buffer: Option<BodyPieces>,
    head: Option<StoredHead>,
    // The age the answer already had (its `Age`: a cache between levee and the app
    // kept it that long), counted into the copy's.
    arrived_aged_ms: u64,
    finish: Option<CaptureTarget>,
    // Of the fetch this capture leads while its waiters wait for the copy: who the body
    // waits for (see `BodyPace`).
    pace: Option<Arc<BodyPace>>,
    // How long the rest of the body may take once its reader is gone; `None` in the task
    // that reads it (it is not read on again when that ends).
    read_on_within: Option<Duration>,
}

/// Where a finished capture goes.
pub struct CaptureTarget {
    pub store: Arc<StaleStore>,
    pub key: CopyKey,
    pub redis: Option<Arc<RedisStore>>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub settings: Arc<StaleSettings>,
    pub guard: Option<FetchGuard>,
    /// Whether the copy is kept as the route's; `false` for a page the app was told to make
    /// without some modules (`[degrade] tell_app`): it answers the requests waiting for this
    /// fetch, which see the same switches, but is no page to serve once the modules are back.
    pub keep: bool,
}

impl Capture {
    /// Keeps the copy of the answer whose head is `status` and `headers` as `inner` passes.
    /// Dropped before the copy is complete, it reads the rest for at most `read_on_within`
    /// (the upstream's `response_timeout`).
    pub fn new(
        inner: ResponseBody,
        status: StatusCode,
        (headers, received): (&HeaderMap, Option<&ReceivedHead>),
        target: CaptureTarget,
        read_on_within: Duration,
    ) -> Capture {
        let arrived_aged_ms = headers
            .get(header::AGE)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok())
            .map_or(0, |seconds| seconds.saturating_mul(1000));
        let pace = target.guard.as_ref().and_then(FetchGuard::pace);
        Capture {
            inner: Some(inner),
            buffer: Some(BodyPieces::default()),
            head: Some((status.as_u16(), kept_headers(headers, received))),
            arrived_aged_ms,
            finish: Some(target),
            pace,
            read_on_within: Some(read_on_within),
        }
    }
}

impl Drop for Capture {
    /// The copy is still wanted (kept as the route's, or awaited by the fetch's waiters) and
    /// the body has not ended: its reader went away. The rest is read on a task of its own
    /// (see [`Capture`]). The task holds only the body and what
    /// the copy goes to, none of the request's other parts (its exchange, its client's
    /// connection). Outside a runtime (levee is stopping) the copy is dropped here.
    fn drop(&mut self) {
        let Some(within) = self.read_on_within.take() else {
            return;
        };
        let wanted = self
            .finish
            .as_ref()
            .is_some_and(|target| target.keep || target.guard.is_some());
        if !wanted || self.inner.is_none() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Some(pace) = &self.pace {
            pace.read_on(Instant::now());
        }
        let rest = Capture {
            inner: self.inner.take(),
            buffer: self.buffer.take(),
            head: self.head.take(),
            arrived_aged_ms: self.arrived_aged_ms,
            finish: self.finish.take(),
            pace: self.pace.take(),
            read_on_within: None,
        };
        runtime.spawn(read_rest(rest, within));
    }
}

/// Reads the rest of a body whose reader went away, for its copy (see [`Capture`]): until the
/// copy is stored, or abandoned (the body failed or grew too big to keep), or `within` has
/// passed. Dropping the capture then lets the waiters go, and the upstream's body with it (a
/// bulkhead slot inside reads on by itself).
async fn read_rest(mut capture: Capture, within: Duration) {
    use http_body_util::BodyExt;
    let reading = async {
        while capture.finish.is_some() {
            if !matches!(capture.frame().await, Some(Ok(_))) {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(within, reading).await;
}

fn complete(
    buffer: &mut Option<BodyPieces>,
    head: &mut Option<StoredHead>,
    arrived_aged_ms: u64,
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
        body: crate::proxy::body::joined(&body.into_pieces()),
        stored_at_ms: now_ms().saturating_sub(arrived_aged_ms),
    });
    if target.keep {
        target.store.put(
            &target.key,
            copy.clone(),
            target.redis.clone(),
            &target.metrics,
            &target.settings,
        );
    }
    if let Some(guard) = &target.guard {
        guard.finish(copy);
    }
}

impl Body for Capture {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = match this.pace.as_ref() {
            None => Pin::new(inner).poll_frame(cx),
            // The upstream's body is polled with the pace as its waker: when it has more, the
            // pace hears of it before the reader's task is woken (see `BodyPace`).
            Some(pace) => {
                let now = Instant::now();
                pace.asked(now, cx.waker());
                let waker = Waker::from(pace.clone());
                let polled = Pin::new(inner).poll_frame(&mut Context::from_waker(&waker));
                if matches!(polled, Poll::Ready(Some(Ok(_)))) {
                    pace.handed(now);
                }
                polled
            }
        };
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(buffer)) = (frame.data_ref(), this.buffer.as_mut()) {
                    let limit = this
                        .finish
                        .as_ref()
                        .map_or(0, |target| target.settings.max_body);
                    if buffer.bytes_kept() + data.len() > limit {
                        // Too big to keep: pass it on, store nothing.
                        this.buffer = None;
                        this.finish = None;
                    } else {
                        buffer.push(data.clone());
                    }
                }
                if this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    complete(
                        &mut this.buffer,
                        &mut this.head,
                        this.arrived_aged_ms,
                        &mut this.finish,
                    );
                }
            }
            Poll::Ready(None) => complete(
                &mut this.buffer,
                &mut this.head,
                this.arrived_aged_ms,
                &mut this.finish,
            ),
            Poll::Ready(Some(Err(_))) => {
                this.buffer = None;
                this.finish = None;
            }
            Poll::Pending => {}
        }
        if this.finish.is_none() {
            // Stored, or not to be: the waiters no longer look at the pace.
            this.pace = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

/// Stores a copy and trims its route's index: KEYS[1] the copy, KEYS[2] the route's index (a
/// sorted set of its copy keys by store time); ARGV the encoded copy, `max_age` in ms, the
/// store time in ms and `max_copies`. Entries older than `max_age` (their copies expired)
/// leave the index, then the oldest copies beyond `max_copies` are deleted with their
/// entries. Every key it touches shares KEYS[2]'s hash tag, so in a cluster they are on the
/// node the script runs on. Returns how many copies it deleted.
const STORE_SCRIPT: &str = r"
local max_age = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', max_age)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - max_age)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  for _, key in ipairs(redis.call('ZRANGE', KEYS[2], 0, over - 1)) do
    redis.call('DEL', key)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, over - 1)
else
  over = 0
end
redis.call('PEXPIRE', KEYS[2], max_age)
return over
";

/// A copy's Redis key and its route's index key. Both begin `{prefix}stale:{route}:` — the
/// route (or, for a name with braces, a hash of it) as the Redis Cluster hash tag — so a
/// route's copies and index share one slot: a route's copies all live on one node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CopyKey {
    pub key: String,
    pub index: String,
    /// Where `[redis] key_prefix` ends in both: memory keeps copies by the rest, so that a
    /// reload that adds `[redis]` or changes its prefix does not lose the copies at hand
    /// (the next outage of the app would find none).
    local: usize,
}

impl CopyKey {
    /// The key of the copy in memory.
    fn in_memory(&self) -> &str {
        self.key.get(self.local..).unwrap_or(&self.key)
    }

    /// The key of the route's copies in memory.
    fn route_in_memory(&self) -> &str {
        self.index.get(self.local..).unwrap_or(&self.index)
    }
}

/// The key of a route's copy: route, the `Host` the app is sent, normalised path, the query
/// (as chosen by [`selected_query`]), and the `vary` values.
///
/// Every part after the route is written with its length in front (`9:127.0.0.1`), and a
/// missing query as `-`: parts come from clients and may hold any separator (a `vary` cookie
/// with `|`, a query with `:`), and two different requests must never be given one key.
pub fn copy_key(
    prefix: &str,
    route: &str,
    host: &str,
    path: &str,
    query: Option<&str>,
    vary: &[Vec<u8>],
) -> CopyKey {
    let tag = route_tag(route);
    let mut key = String::with_capacity(
        prefix.len() + tag.len() + host.len() + path.len() + query.map_or(0, str::len) + 32,
    );
    key.push_str(prefix);
    key.push_str("stale:{");
    key.push_str(&tag);
    key.push_str("}:");
    let index = format!("{key}index");
    // After the tag, a copy key goes on with a digit and the index with `index`.
    push_text_part(&mut key, host);
    push_text_part(&mut key, path);
    match query {
        Some(query) => {
            key.push('?');
            push_text_part(&mut key, query);
        }
        None => key.push('-'),
    }
    for value in vary {
        match std::str::from_utf8(value) {
            Ok(text) => push_text_part(&mut key, text),
            // A legacy site's Latin-1 or GBK cookie, byte for byte (not read as text, where
            // every such value would be U+FFFD, one copy for all of them).
            Err(_) => push_hex_part(&mut key, value),
        }
    }
    CopyKey {
        key,
        index,
        local: prefix.len(),
    }
}

/// A part that is text, as it is unless it holds control characters: a path's `%0A` is a
/// newline once decoded, which would break the key across lines wherever an operator lists
/// keys (`redis-cli --scan`) or a log line shows one.
fn push_text_part(key: &mut String, part: &str) {
    if part.bytes().any(|byte| byte < 0x20 || byte == 0x7f) {
        push_hex_part(key, part.as_bytes());
    } else {
        push_part(key, part);
    }
}

/// `~` and the bytes in hex, which no text part can be taken for, as each begins with its
/// length or, when hashed, with `#`.
fn push_hex_part(key: &mut String, part: &[u8]) {
    key.push('~');
    push_part(key, &hex(part));
}

/// A route name as a hash tag: as it is, unless a brace would end the tag early (or make it
/// the empty `{}`, which Redis does not take for a tag); then `#` and a hash of it, and a name
/// that begins with `#` is hashed too so that it cannot pass for another's hash.
fn route_tag(route: &str) -> Cow<'_, str> {
    if !route.is_empty() && !route.starts_with('#') && !route.contains(['{', '}']) {
        return Cow::Borrowed(route);
    }
    Cow::Owned(hashed(route.as_bytes()))
}

/// The part of a request's query that selects its copy (`query` of the route's stale
/// settings): all of it, none, or only the named parameters (named as PHP names them, an
/// array's `[…]` left out), sorted by name so that their order does not matter; the values of
/// one name keep their order (PHP reads the last one, or all of an array).
pub fn selected_query<'a>(query: Option<&'a str>, select: &CopyQuery) -> Option<Cow<'a, str>> {
    let query = query?;
    let names = match select {
        CopyQuery::All => return Some(Cow::Borrowed(query)),
        CopyQuery::Ignored => return None,
        CopyQuery::Only(names) => names,
    };
    let mut kept: Vec<(String, &str)> = query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .filter_map(|pair| {
            let name = crate::limit::key::query_name(pair.split_once('=').map_or(pair, |(n, _)| n));
            names.binary_search(&name).is_ok().then_some((name, pair))
        })
        .collect();
    if kept.is_empty() {
        return None;
    }
    kept.sort_by(|(a, _), (b, _)| a.cmp(b));
    let mut out = String::with_capacity(query.len());
    for (index, (_, pair)) in kept.iter().enumerate() {
        if index > 0 {
            out.push('&');
        }
        out.push_str(pair);
    }
    Some(Cow::Owned(out))
}

/// `len:part`: a part that reads the same whatever bytes it holds.
/// A part of a copy key: its length, `:` and itself; or, longer than [`LONG_PART`], `#` and
/// its hash (`#` tells it from a length), so that a client's 30 KiB query does not make a
/// 30 KiB Redis key, stored twice (the copy and its index).
fn push_part(key: &mut String, part: &str) {
    use std::fmt::Write as _;
    if part.len() > LONG_PART {
        key.push_str(&crate::limit::key::hashed(part.as_bytes()));
        key.push(':');
        return;
    }
    let _ = write!(key, "{}:", part.len());
    key.push_str(part);
}

/// The longest part written into a copy key as it is.
const LONG_PART: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_a_page_is_not_kept_is_said_in_words_of_its_own() {
        for reason in NOT_KEPT_REASONS
            .iter()
            .filter(|reason| **reason != "status")
        {
            assert_ne!(
                not_kept_because(reason),
                not_kept_because("status"),
                "{reason}"
            );
        }
    }

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
            let vary: Vec<Vec<u8>> = vary.iter().map(|value| value.as_bytes().to_vec()).collect();
            copy_key("levee:", "ranking", "example.com", path, query, &vary).key
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
        // Values that are not UTF-8 are told apart byte for byte, and from any text.
        let bytes = |vary: &[u8]| {
            copy_key(
                "levee:",
                "ranking",
                "example.com",
                "/r",
                None,
                &[vary.to_vec()],
            )
            .key
        };
        assert_ne!(bytes(b"jos\xe9"), bytes(b"jos\xe8"));
        assert_ne!(bytes(b"\xe9"), key("/r", None, &["e9"]));
        assert_ne!(bytes(b"\xe9"), key("/r", None, &["~2:e9"]));
        assert_eq!(bytes("josé".as_bytes()), key("/r", None, &["josé"]));
        // A long part is its hash: short keys, still one per value, and never a short part
        // spelled like a hash.
        let long = "q=".repeat(15_000);
        let long_key = key("/r", Some(&long), &[]);
        assert!(long_key.len() < 100, "{long_key}");
        assert_ne!(long_key, key("/r", Some(&format!("{long}x")), &[]));
        let hash = crate::limit::key::hashed(long.as_bytes());
        assert_ne!(long_key, key("/r", Some(&hash), &[]));
        // A control character (a path's decoded `%0A`) never goes into a key as it is, and
        // its hex stands for no text part.
        let newline = key("/a\nb", None, &[]);
        assert!(!newline.contains('\n'), "{newline:?}");
        assert_ne!(newline, key("/a%0Ab", None, &[]));
        assert_ne!(newline, key("/r", None, &["2f610a62"]));
        assert_ne!(key("/r", Some("x=\t"), &[]), key("/r", Some("x= "), &[]));
        // Routes and hosts do not run into each other either.
        assert_ne!(
            copy_key("levee:", "a", "b.example", "/", None, &[]),
            copy_key("levee:", "a:b", ".example", "/", None, &[])
        );
    }

    #[test]
    fn a_routes_copies_and_index_share_one_hash_tag() {
        let tag = |key: &str| {
            let start = key.find('{').expect("a tag") + 1;
            let end = start + key[start..].find('}').expect("closed");
            key[start..end].to_string()
        };
        for route in ["ranking", "odd}name", "{", "#abc", ""] {
            let a = copy_key("levee:", route, "a.example", "/x", Some("p=1"), &[]);
            let b = copy_key("levee:", route, "b.example", "/y", None, &["en".into()]);
            assert_eq!(a.index, b.index, "{route}");
            let tags = [tag(&a.key), tag(&b.key), tag(&a.index)];
            assert!(
                tags.iter().all(|t| *t == tags[0] && !t.is_empty()),
                "{route}: {tags:?}"
            );
            assert_ne!(a.key, a.index);
        }
        assert_eq!(
            copy_key("levee:", "ranking", "a", "/", None, &[]).index,
            "levee:stale:{ranking}:index"
        );
        assert_ne!(
            copy_key("levee:", "{", "a", "/", None, &[]).index,
            copy_key("levee:", "}", "a", "/", None, &[]).index
        );
    }

    #[test]
    fn only_the_chosen_query_parameters_select_a_copy() {
        let only = CopyQuery::Only(vec!["page".into(), "week".into()]);
        let chosen = |query: &str| selected_query(Some(query), &only).map(Cow::into_owned);
        // Cache-busting and tracking parameters do not make another copy; order does not
        // matter; the values of the chosen ones do.
        assert_eq!(chosen("week=1&_=123"), Some("week=1".into()));
        assert_eq!(
            chosen("utm_source=x&week=1&page=2"),
            Some("page=2&week=1".into())
        );
        assert_eq!(chosen("page=2&week=1&x=9"), Some("page=2&week=1".into()));
        assert_ne!(chosen("week=1"), chosen("week=2"));
        // Named as PHP reads them: `w%65ek` is `week`, `page[]` is `page`.
        assert_eq!(chosen("w%65ek=1"), Some("w%65ek=1".into()));
        assert_eq!(
            chosen("page[]=1&page[]=2"),
            Some("page[]=1&page[]=2".into())
        );
        assert_eq!(chosen("_=1&&utm=2"), None);
        assert_eq!(selected_query(None, &only), None);
        assert_eq!(
            selected_query(Some("b=1&a=2"), &CopyQuery::All).as_deref(),
            Some("b=1&a=2")
        );
        assert_eq!(selected_query(Some("b=1"), &CopyQuery::Ignored), None);
    }

    fn key_of(route: &str, n: usize) -> CopyKey {
        // Of one length whatever `n`: each copy of a route weighs the same.
        copy_key(
            "levee:",
            route,
            "example.com",
            &format!("/{n:06}"),
            None,
            &[],
        )
    }

    /// What a small copy of `route` weighs in the store.
    fn small_weight(route: &str) -> usize {
        entry_weight(&key_of(route, 0), &small_copy())
    }

    fn small_copy() -> Arc<StaleCopy> {
        Arc::new(StaleCopy {
            status: 200,
            headers: vec![],
            body: Bytes::from_static(b"page"),
            stored_at_ms: 0,
        })
    }

    #[test]
    fn a_route_keeps_at_most_max_copies_in_memory_and_leaves_the_others_theirs() {
        let store = StaleStore::new(L1_MAX_BYTES);
        for n in 0..5 {
            store.remember(&key_of("good", n), small_copy(), 1000, false);
        }
        // A flood of cache-busting keys on another route.
        for n in 0..10_000 {
            store.remember(&key_of("busted", n), small_copy(), 100, false);
        }
        let l1 = store.l1.lock().expect("lock");
        let of = |route: &str| {
            l1.copies
                .values()
                .filter(|entry| entry.route == key_of(route, 0).route_in_memory())
                .count()
        };
        assert_eq!((of("good"), of("busted")), (5, 100));
        assert!(l1.copies.contains_key(key_of("busted", 9_999).in_memory()));
        assert!(!l1.copies.contains_key(key_of("busted", 9_899).in_memory()));
        assert_eq!(l1.routes[key_of("busted", 0).route_in_memory()].live, 100);
    }

    #[test]
    fn a_copy_weighs_its_key_and_bookkeeping_as_well_as_its_page() {
        // A 4-byte page: what holds it is most of what it costs.
        let key = copy_key("levee:", "r", "example.com", "/", Some("q=1"), &[]);
        assert_eq!(
            entry_weight(&key, &small_copy()),
            4 + 2 * key.key.len() + key.index.len() + 512
        );
    }

    #[test]
    fn when_memory_is_full_the_route_holding_the_most_gives_up_its_oldest() {
        // Room for 50 small copies. A route within its max_copies but flooding memory evicts
        // its own copies, not the other route's.
        let weight = small_weight("busted");
        assert_eq!(small_weight("gentle"), weight, "names of one length");
        let store = StaleStore::new(50 * weight);
        for n in 0..5 {
            store.remember(&key_of("gentle", n), small_copy(), 1000, false);
        }
        for n in 0..10_000 {
            store.remember(&key_of("busted", n), small_copy(), 1000, false);
        }
        let l1 = store.l1.lock().expect("lock");
        assert!(l1.bytes <= 50 * weight, "{}", l1.bytes);
        let good = l1.routes[key_of("gentle", 0).route_in_memory()].live;
        let busted = &l1.routes[key_of("busted", 0).route_in_memory()];
        assert_eq!((good, busted.live), (5, 45));
        assert_eq!(busted.bytes, 45 * weight);
        assert!(l1.copies.contains_key(key_of("busted", 9_999).in_memory()));
        assert!(busted.order.len() <= 2 * busted.live + 16);
    }

    #[test]
    fn a_lower_stale_memory_drops_copies_at_once_and_bounds_later_ones() {
        let weight = small_weight("busted");
        let store = StaleStore::new(L1_MAX_BYTES);
        for n in 0..100 {
            store.remember(&key_of("busted", n), small_copy(), 1000, false);
        }
        store.set_max_bytes(10 * weight);
        assert_eq!(
            store.l1.lock().expect("lock").copies.len(),
            10,
            "dropped at once"
        );
        store.remember(&key_of("busted", 100), small_copy(), 1000, false);
        let l1 = store.l1.lock().expect("lock");
        assert!(l1.bytes <= 10 * weight, "{}", l1.bytes);
        assert!(l1.copies.contains_key(key_of("busted", 100).in_memory()));
    }

    #[test]
    fn a_copy_stored_again_is_the_newest_and_queues_stay_bounded() {
        let store = StaleStore::new(L1_MAX_BYTES);
        for n in 0..3 {
            store.remember(&key_of("r", n), small_copy(), 3, false);
        }
        // The first copy is refreshed many times: it is the newest, so a fourth key evicts
        // the second.
        for _ in 0..1000 {
            store.remember(&key_of("r", 0), small_copy(), 3, false);
        }
        store.remember(&key_of("r", 3), small_copy(), 3, false);
        let l1 = store.l1.lock().expect("lock");
        let kept: Vec<bool> = (0..4)
            .map(|n| l1.copies.contains_key(key_of("r", n).in_memory()))
            .collect();
        assert_eq!(kept, [true, false, true, true]);
        let route = &l1.routes[key_of("r", 0).route_in_memory()];
        assert_eq!(route.live, 3);
        assert!(route.order.len() <= 2 * 3 + 16, "{}", route.order.len());
        assert_eq!(
            (route.bytes, l1.bytes),
            (3 * small_weight("r"), route.bytes)
        );
    }

    /// A reload that adds `[redis]` with a `key_prefix` of its own (or changes it) keeps the
    /// copies at hand: they answer the next outage, Redis down or not. The copy was missing
    /// when the app went down after such a reload.
    #[tokio::test]
    async fn copies_in_memory_outlive_a_new_key_prefix() {
        let store = StaleStore::new(L1_MAX_BYTES);
        let key = |prefix: &str| copy_key(prefix, "home", "example.com", "/", None, &[]);
        store.remember(&key("levee:"), small_copy(), 3, false);
        let found = store
            .get(&key("shop:"), &small_settings(), None, &Metrics::new())
            .await;
        assert!(found.is_some(), "the copy stored before the reload");
        // Redis keeps its prefix.
        assert!(key("shop:").key.starts_with("shop:stale:{home}:"));
        assert!(key("shop:").index.starts_with("shop:stale:{home}:"));
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
            store.remember(&key_of("r", i), Arc::new(copy), 1000, false);
        }
        let l1 = store.l1.lock().expect("lock");
        assert!(l1.bytes <= 1000, "{}", l1.bytes);
        assert!(
            l1.copies.contains_key(key_of("r", 19).in_memory())
                && !l1.copies.contains_key(key_of("r", 0).in_memory())
        );
    }

    /// Settings that keep bodies up to 100 bytes, keyed by nothing but the request.
    fn small_settings() -> StaleSettings {
        StaleSettings {
            max_age: Duration::from_secs(60),
            vary: vec![],
            allow_set_cookie: false,
            max_body: 100,
            query: CopyQuery::All,
            max_copies: 10,
            private_cookies: vec![],
            keep_no_cache: false,
            learn_private_cookies: true,
            on_status: Vec::new(),
        }
    }

    #[test]
    fn a_page_marked_no_cache_for_a_request_with_cookies_is_not_kept() {
        let settings = small_settings();
        let marked = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(value));
            headers
        };
        let reason = |headers: &HeaderMap, cookies: bool| {
            why_not_storable(StatusCode::OK, headers, &settings, false, cookies)
        };
        // WordPress's logged-in pages.
        let wordpress = marked("no-cache, must-revalidate, max-age=0");
        assert_eq!(reason(&wordpress, true), Some("cookie_no_cache"));
        let mut events = HeaderMap::new();
        events.insert(
            header::CONTENT_TYPE,
            "Text/Event-Stream; charset=utf-8".parse().expect("value"),
        );
        assert_eq!(reason(&events, false), Some("event_stream"));
        assert_eq!(reason(&wordpress, false), None);
        assert_eq!(reason(&marked("max-age=0"), true), Some("cookie_no_cache"));
        assert_eq!(reason(&marked("max-age=60"), true), None);
        assert_eq!(reason(&marked("public, no-cache"), true), None);
        assert_eq!(reason(&HeaderMap::new(), true), None);
        // An app that marks every page so, and says so in the policy.
        let settings = StaleSettings {
            keep_no_cache: true,
            learn_private_cookies: true,
            ..small_settings()
        };
        assert_eq!(
            why_not_storable(StatusCode::OK, &wordpress, &settings, false, true),
            None
        );
    }

    #[test]
    fn only_good_public_responses_are_kept() {
        let settings = small_settings();
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
    fn an_answer_that_varies_by_what_the_key_leaves_out_is_not_kept() {
        let mut settings = small_settings();
        let varying = |fields: &str| {
            let mut headers = HeaderMap::new();
            for field in fields.split('|') {
                headers.append(header::VARY, HeaderValue::from_str(field).expect("value"));
            }
            headers
        };
        let kept = |fields: &str, settings: &StaleSettings| {
            storable(StatusCode::OK, &varying(fields), settings, false)
        };
        // Copies are fetched uncompressed: Accept-Encoding selects nothing.
        assert!(kept("Accept-Encoding", &settings));
        for personal in [
            "Cookie",
            "*",
            "Accept-Language",
            "accept-encoding, User-Agent",
            "Accept-Encoding|Cookie",
        ] {
            assert!(!kept(personal, &settings), "{personal}");
        }
        settings.vary = vec![
            crate::limit::key::Source::parse("header:accept-language").expect("source"),
            crate::limit::key::Source::parse("cookie:lang").expect("source"),
        ];
        assert!(kept("Accept-Language, Accept-Encoding", &settings));
        assert!(
            kept("cookie", &settings),
            "the operator named the cookies that count"
        );
        assert!(!kept("*", &settings));
        assert!(!kept("User-Agent", &settings));
    }

    #[test]
    fn a_copy_never_keeps_or_sends_a_cookie() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("PHPSESSID=alice"),
        );
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html"));
        let kept = kept_headers(&headers, None);
        assert_eq!(kept, [("Content-Type".to_string(), b"text/html".to_vec())]);
        // One stored with its cookie (by an older version) is served without it.
        let copy = StaleCopy {
            status: 200,
            headers: vec![("set-cookie".into(), b"PHPSESSID=alice".to_vec())],
            body: Bytes::from_static(b"page"),
            stored_at_ms: now_ms(),
        };
        assert!(copy
            .to_response(true)
            .headers()
            .get(header::SET_COOKIE)
            .is_none());
    }

    /// A copy keeps the app's spelling of its field names and is served with it, as the page
    /// passed through is (a PHP client that reads `X-Page-Cache` by its exact name).
    #[test]
    fn a_copy_keeps_and_serves_the_apps_spelling_of_field_names() {
        let (headers, lines) = field_lines(
            [
                ("X-Page-Cache", &b"MISS"[..]),
                ("content-type", b"text/html"),
                ("Set-Cookie", b"a=1"),
                ("X-Empty", b""),
            ]
            .into_iter(),
        );
        let kept = kept_headers(&headers, Some(&ReceivedHead(lines)));
        assert_eq!(
            kept,
            [
                ("X-Page-Cache".to_string(), b"MISS".to_vec()),
                ("content-type".to_string(), b"text/html".to_vec()),
                ("X-Empty".to_string(), Vec::new()),
            ]
        );
        let copy = StaleCopy {
            status: 200,
            headers: kept,
            body: Bytes::from_static(b"page"),
            stored_at_ms: now_ms(),
        };
        let (parts, _) = copy.to_response(true).into_parts();
        let mut out = bytes::BytesMut::new();
        crate::proxy::h1::encode::encode_head(
            &mut out,
            (parts.status, None),
            (&parts.headers, parts.extensions.get::<ReceivedHead>()),
            None,
            0,
        );
        let head = String::from_utf8(out.to_vec()).expect("ascii");
        for line in [
            "\r\nX-Page-Cache: MISS\r\n",
            "\r\ncontent-type: text/html\r\n",
            "\r\nX-Empty: \r\n",
            "\r\nAge: 0\r\n",
            "\r\nX-Levee-Stale: 1\r\n",
        ] {
            assert!(head.contains(line), "{line:?} in {head}");
        }
    }

    #[test]
    fn every_content_encoding_counts_not_only_the_first() {
        let settings = small_settings();
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

    fn lead_and_wait(store: &Arc<StaleStore>) -> (FetchGuard, watch::Receiver<FetchState>) {
        let Fetch::Lead(guard) = store.fetch("k") else {
            panic!("the first request leads");
        };
        let Fetch::Wait(receiver) = store.fetch("k") else {
            panic!("the second one waits");
        };
        (guard, receiver)
    }

    const HEAD: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn waiters_stop_waiting_for_a_leader_whose_client_reads_its_body_slowly() {
        let store = Arc::new(StaleStore::new(L1_MAX_BYTES));
        let (guard, receiver) = lead_and_wait(&store);
        let started = Instant::now();
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        // Upstream takes its time to answer: the waiter waits, as it would for its own fetch.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiter.is_finished());
        // The head is in, and the leader's client then reads the body slowly (the copy is never
        // finished here): the waiter goes upstream after MAX_READER_HOLD, not after HEAD.
        guard.answered();
        let waited = waiter.await.expect("waiter");
        assert!(matches!(waited, Waited::GoUpstream), "{waited:?}");
        assert_eq!(started.elapsed(), Duration::from_secs(5) + MAX_READER_HOLD);

        // A request that comes once the head is older than the bound does not wait at all.
        let Fetch::Wait(late) = store.fetch("k") else {
            panic!("the fetch is still out");
        };
        let joined = Instant::now();
        let waited = wait_for_copy(late, HEAD, MAX_READER_HOLD).await;
        assert!(matches!(waited, Waited::GoUpstream), "{waited:?}");
        assert_eq!(joined.elapsed(), Duration::ZERO);
        drop(guard);
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_get_the_copy_stored_in_time_go_upstream_when_the_leader_gives_up_and_stop_at_its_timeout(
    ) {
        let store = Arc::new(StaleStore::new(L1_MAX_BYTES));
        let (guard, receiver) = lead_and_wait(&store);
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        guard.answered();
        tokio::time::sleep(MAX_READER_HOLD / 2).await;
        guard.finish(small_copy());
        let waited = waiter.await.expect("waiter");
        assert!(
            matches!(waited, Waited::Copy(ref copy) if copy.body == "page"),
            "{waited:?}"
        );
        drop(guard);

        // The next fetch's leader lets go without a copy: the waiter goes at once.
        let (guard, receiver) = lead_and_wait(&store);
        let started = Instant::now();
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(guard);
        let waited = waiter.await.expect("waiter");
        assert!(matches!(waited, Waited::GoUpstream), "{waited:?}");
        assert_eq!(started.elapsed(), Duration::from_millis(10));

        // An upstream that never answers: the waiter gives up after HEAD, and does not go
        // upstream to wait as long again.
        let (guard, receiver) = lead_and_wait(&store);
        let started = Instant::now();
        let waited = wait_for_copy(receiver, HEAD, MAX_READER_HOLD).await;
        assert!(matches!(waited, Waited::TimedOut), "{waited:?}");
        assert_eq!(started.elapsed(), HEAD);
        drop(guard);

        // The leader's upstream timed out: its waiters are told at once, whether they see it
        // before or after the leader lets go.
        let (guard, receiver) = lead_and_wait(&store);
        let Fetch::Wait(second) = store.fetch("k") else {
            panic!("the fetch is still out");
        };
        let started = Instant::now();
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        tokio::time::sleep(Duration::from_millis(10)).await;
        guard.timed_out();
        drop(guard);
        let waited = waiter.await.expect("waiter");
        assert!(matches!(waited, Waited::TimedOut), "{waited:?}");
        assert_eq!(started.elapsed(), Duration::from_millis(10));
        let waited = wait_for_copy(second, HEAD, MAX_READER_HOLD).await;
        assert!(matches!(waited, Waited::TimedOut), "{waited:?}");
    }

    /// An upstream's body whose pieces the test sends as it likes; it ends when the sender is
    /// dropped.
    struct Trickle(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

    impl Body for Trickle {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.get_mut()
                .0
                .poll_recv(cx)
                .map(|piece| piece.map(|bytes| Ok(Frame::data(bytes))))
        }
    }

    /// How long a captured page whose reader left is read on (the upstream's response timeout).
    const READ_ON: Duration = Duration::from_secs(20);

    /// The answer whose head `guard`'s fetch just got, kept as its copy: its body as the
    /// leading request's client reads it, and the upstream's end of that body.
    fn captured(
        guard: FetchGuard,
        store: &Arc<StaleStore>,
    ) -> (Capture, tokio::sync::mpsc::UnboundedSender<Bytes>) {
        guard.answered();
        let (upstream, body) = tokio::sync::mpsc::unbounded_channel();
        let target = CaptureTarget {
            store: store.clone(),
            key: key_of("r", 0),
            redis: None,
            metrics: Arc::new(Metrics::new()),
            settings: Arc::new(small_settings()),
            guard: Some(guard),
            keep: true,
        };
        let capture = Capture::new(
            http_body_util::BodyExt::boxed_unsync(Trickle(body)),
            StatusCode::OK,
            (&HeaderMap::new(), None),
            target,
            READ_ON,
        );
        (capture, upstream)
    }

    /// A PHP page that flushes its head at once, then runs a slow query: its waiters wait for
    /// the page (one fetch) instead of each going upstream a second after the head came (and
    /// taking a php-fpm worker for as long as the leader's).
    #[tokio::test(start_paused = true)]
    async fn waiters_wait_for_a_page_the_upstream_is_still_writing_up_to_their_response_timeout() {
        use http_body_util::BodyExt;
        let store = Arc::new(StaleStore::new(L1_MAX_BYTES));
        let (guard, receiver) = lead_and_wait(&store);
        let (capture, upstream) = captured(guard, &store);
        // The leader's client (a front nginx) reads every byte as it comes.
        let reader = tokio::spawn(capture.collect());
        let started = Instant::now();
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        upstream.send(Bytes::from_static(b"<head>")).expect("send");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!waiter.is_finished(), "the page is still being written");
        // A request that comes long after the head still waits, as the upstream is what is
        // slow.
        let Fetch::Wait(late) = store.fetch("k") else {
            panic!("the fetch is still out");
        };
        let late = tokio::spawn(wait_for_copy(late, HEAD, MAX_READER_HOLD));
        tokio::time::sleep(Duration::from_secs(2)).await;
        upstream.send(Bytes::from_static(b"</html>")).expect("send");
        drop(upstream);
        for waiter in [waiter, late] {
            let waited = waiter.await.expect("waiter");
            assert!(
                matches!(waited, Waited::Copy(ref copy) if copy.body == "<head></html>"),
                "{waited:?}"
            );
        }
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        let read = reader.await.expect("reader").expect("body");
        assert_eq!(read.to_bytes(), "<head></html>");

        // A page still being written when a waiter's own response timeout runs out: the
        // timeout bounds the wait for an answer's head, which came; a request of its own
        // would now be reading the same slow body, so the waiter goes on waiting for the
        // page (it got a 504 while the leader got the page).
        let (guard, receiver) = lead_and_wait(&store);
        let (capture, upstream) = captured(guard, &store);
        let reader = tokio::spawn(capture.collect());
        upstream.send(Bytes::from_static(b"<head>")).expect("send");
        let started = Instant::now();
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        tokio::time::sleep(HEAD + Duration::from_secs(2)).await;
        assert!(!waiter.is_finished(), "the page is still being written");
        upstream.send(Bytes::from_static(b"</html>")).expect("send");
        drop(upstream);
        let waited = waiter.await.expect("waiter");
        assert!(
            matches!(waited, Waited::Copy(ref copy) if copy.body == "<head></html>"),
            "{waited:?}"
        );
        assert_eq!(started.elapsed(), HEAD + Duration::from_secs(2));
        reader.await.expect("reader").expect("body");

        // No head by then: the waiter has waited as long as for an answer of its own (the
        // caller serves the route's copy, or a 504), and does not go upstream to wait as long
        // again.
        let (_guard, receiver) = lead_and_wait(&store);
        let started = Instant::now();
        let waited = wait_for_copy(receiver, HEAD, MAX_READER_HOLD).await;
        assert!(matches!(waited, Waited::TimedOut), "{waited:?}");
        assert_eq!(started.elapsed(), HEAD);
    }

    /// The response writer asks for the body, finds nothing yet and flushes what it has to
    /// its client, which stops reading: once the upstream's next bytes are in, the time is the
    /// client's, and the waiters go upstream after MAX_READER_HOLD of it, not at their
    /// response timeout.
    #[tokio::test(start_paused = true)]
    async fn waiters_stop_waiting_once_the_leaders_client_leaves_the_upstreams_bytes_untaken() {
        use futures_util::FutureExt;
        use http_body_util::BodyExt;
        let store = Arc::new(StaleStore::new(L1_MAX_BYTES));
        let (guard, receiver) = lead_and_wait(&store);
        let (mut capture, upstream) = captured(guard, &store);
        assert!(capture.frame().now_or_never().is_none(), "no bytes yet");
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        // The upstream takes its time: the waiter waits.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!waiter.is_finished());
        upstream.send(Bytes::from_static(b"<head>")).expect("send");
        let sent = Instant::now();
        let waited = waiter.await.expect("waiter");
        assert!(matches!(waited, Waited::GoUpstream), "{waited:?}");
        assert_eq!(sent.elapsed(), MAX_READER_HOLD);
        drop(capture);
    }

    /// A visitor gives up on a slow page midway and reloads: its request's body, the capture
    /// with it, is dropped. The page is read on for the copy, and the waiters get it when the
    /// upstream finishes, rather than all going to the slow app at once; nobody holds the
    /// bytes back any more, so the reader's bound does not send them either.
    #[tokio::test(start_paused = true)]
    async fn waiters_get_the_copy_of_a_page_whose_leaders_client_left_midway() {
        use futures_util::FutureExt;
        use http_body_util::BodyExt;
        let store = Arc::new(StaleStore::new(L1_MAX_BYTES));
        let (guard, receiver) = lead_and_wait(&store);
        let (mut capture, upstream) = captured(guard, &store);
        let started = Instant::now();
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        upstream.send(Bytes::from_static(b"<head>")).expect("send");
        let first = capture.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().expect("data"), "<head>");
        // Its client asks for more (and waits for the app) for a while, then leaves.
        assert!(capture.frame().now_or_never().is_none(), "no more yet");
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(capture);
        // The app goes on writing the page, slowly: far longer than a client may hold it.
        tokio::time::sleep(3 * MAX_READER_HOLD).await;
        assert!(
            !waiter.is_finished(),
            "the fetch goes on without its client"
        );
        upstream.send(Bytes::from_static(b"<body>")).expect("send");
        tokio::time::sleep(3 * MAX_READER_HOLD).await;
        assert!(!waiter.is_finished(), "the page is still being written");
        // A request that comes now waits for the same fetch.
        let Fetch::Wait(late) = store.fetch("k") else {
            panic!("the fetch is still out after its client left");
        };
        let late = tokio::spawn(wait_for_copy(late, HEAD, MAX_READER_HOLD));
        tokio::time::sleep(Duration::from_secs(1)).await;
        upstream.send(Bytes::from_static(b"</html>")).expect("send");
        drop(upstream);
        for waiter in [waiter, late] {
            let waited = waiter.await.expect("waiter");
            assert!(
                matches!(waited, Waited::Copy(ref copy) if copy.body == "<head><body></html>"),
                "{waited:?}"
            );
        }
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(3) + 6 * MAX_READER_HOLD
        );
        // Kept as the route's copy too.
        let stored = store
            .get(&key_of("r", 0), &small_settings(), None, &Metrics::new())
            .await
            .expect("the copy is stored");
        assert_eq!(stored.body, "<head><body></html>");

        // A page that grows past `max_body` once its client left: nothing more would be
        // kept, so the rest is not read, and the waiters go upstream at once.
        let (guard, receiver) = lead_and_wait(&store);
        let (capture, upstream) = captured(guard, &store);
        let waiter = tokio::spawn(wait_for_copy(receiver, HEAD, MAX_READER_HOLD));
        drop(capture);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!waiter.is_finished());
        let sent = Instant::now();
        upstream.send(Bytes::from(vec![b'x'; 101])).expect("send");
        let waited = waiter.await.expect("waiter");
        assert!(matches!(waited, Waited::GoUpstream), "{waited:?}");
        assert_eq!(sent.elapsed(), Duration::ZERO);
        assert!(upstream.is_closed(), "the upstream's body is let go");

        // A page whose rest never comes is read on for READ_ON at most (shorter than the
        // waiter's own bound here): then the waiter goes upstream.
        let (guard, receiver) = lead_and_wait(&store);
        let (capture, upstream) = captured(guard, &store);
        let dropped = Instant::now();
        drop(capture);
        let waited = wait_for_copy(receiver, 2 * READ_ON, MAX_READER_HOLD).await;
        assert!(matches!(waited, Waited::GoUpstream), "{waited:?}");
        assert_eq!(dropped.elapsed(), READ_ON);
        assert!(upstream.is_closed());
    }
}
