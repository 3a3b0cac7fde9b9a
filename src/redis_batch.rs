//! Rate-limit decisions on a single Redis server, batched.
//!
//! Every request with Redis limits needs one script call. Instead of one call per request,
//! one worker task owns a connection and keeps up to two calls in flight: the decisions that
//! arrive meanwhile go out together in the next call (`limit/script.lua` decides a batch in
//! order, each request's rules all or nothing, so a batch answers exactly as one call per
//! request would). At low load a batch is a single decision and nothing waits for anything;
//! under load Redis runs one script call for dozens of requests, which costs it a fraction
//! of the CPU, and levee a fraction of the system calls.
//!
//! How long a decision may wait is the caller's business (`RedisStore::decide_all` bounds it
//! by `[redis] timeout` and falls back). The worker gives each call `call_bound` from the
//! moment it is taken from the queue, connecting and writing included, and drops the
//! connection when Redis does not answer in time or answers something unreadable, so a late
//! answer is never read as the answer to a later batch. The next batch connects again (and loads the script again). A `NOSCRIPT` answer
//! (Redis lost its scripts but not the connection) is mended on the spot: the script is
//! loaded again and the batch sent again, once.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use crate::redis_sentinel::Sentinels;
use crate::redis_store::{RedisAsk, RedisFailure, RedisTls, RemoteVerdict};

/// Requests decided by one script call at most. Redis runs a script to its end before it
/// serves anyone else, so a batch is kept well below a millisecond of Redis time.
const MOST_PER_BATCH: usize = 128;
/// Decisions that may wait for the worker; past this, a decision fails at once (and falls
/// back) instead of queueing without bound behind a Redis that has stalled.
const MOST_WAITING: usize = 8192;
/// Longest reply line or bulk string accepted from Redis.
const MOST_REPLY_BYTES: usize = 16 << 20;
/// Buckets whose last Redis answer levee remembers for admitting ahead.
const MOST_HEADROOM_KEYS: usize = 100_000;
/// A bucket's last answer older than this is not used to admit ahead: the bucket may have
/// been emptied by other instances since (or refilled, which only costs a round trip). Under
/// steady traffic, where admitting ahead pays, answers are a round trip old.
const HEADROOM_FRESH: Duration = Duration::from_millis(250);
/// Script calls at Redis at once. With a second call, a decision that comes while a call
/// (often only charges) is at Redis goes out at once instead of waiting for that answer, so it
/// waits one round trip, not up to two. Charges alone never take the second call.
const MOST_CALLS_IN_FLIGHT: usize = 2;
/// How often the worker forgets buckets whose answers are no longer fresh. Often, so that the
/// table holds about a second of distinct buckets: with traffic from many clients (every
/// request another address), ten seconds' worth is tens of thousands of entries, megabytes.
const HEADROOM_SWEEP_EVERY: Duration = Duration::from_secs(1);
/// While only charges for requests admitted ahead are queued, the worker sends them at most
/// this often (tokio's timers round up to the next millisecond), and only while no call is
/// in flight. Under steady load one script call then carries a millisecond or two of traffic
/// (merged into one entry per set of buckets) instead of one round trip's: 4-5 times fewer
/// calls for Redis in levee's benchmark. A decision that waits is never held: it goes out at
/// once, with the charges queued before it.
const CHARGE_HOLD: Duration = Duration::from_millis(1);

/// Where the single Redis server is, and how to log in: read from `[redis] url`, or the
/// master the sentinels name.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    address: Address,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    /// Check that the server is a master before using it (`INFO replication`): the sentinels
    /// named it, and one may not have seen a failover yet.
    expect_master: bool,
}

/// Where the worker connects: one fixed server, or whichever master the sentinels name at
/// each (re)connection.
pub enum BatchTarget {
    Fixed(Endpoint),
    Sentinel(Arc<Sentinels>),
}

impl BatchTarget {
    /// Where to connect now, and the sentinels' generation that belongs to (0 for a fixed
    /// server).
    async fn endpoint(&self, bound: Duration) -> Result<(Endpoint, u64), BatchFailure> {
        let sentinels = match self {
            BatchTarget::Fixed(endpoint) => return Ok((endpoint.clone(), 0)),
            BatchTarget::Sentinel(sentinels) => sentinels,
        };
        sentinels.watch();
        // A connection made again: the last one broke, or its server may be master no more.
        sentinels.check_soon();
        let (master, generation) = sentinels.master(bound).await.map_err(|error| {
            BatchFailure::NoMaster(match error {
                RedisFailure::Connection(text) => text,
                other => other.to_string(),
            })
        })?;
        let target = &sentinels.target;
        let address = match &sentinels.tls_client {
            None => Address::Tcp(master.host, master.port),
            Some(Ok(client)) => Address::Tls(master.host, master.port, TlsClient(client.clone())),
            Some(Err(error)) => {
                return Err(BatchFailure::NoMaster(format!(
                    "redis TLS settings: {error}"
                )))
            }
        };
        let endpoint = Endpoint {
            address,
            username: target.username.clone(),
            password: target.password.clone(),
            db: target.db,
            expect_master: true,
        };
        Ok((endpoint, generation))
    }

    /// True when the sentinels named another master since `connection` was made.
    fn moved_from(&self, connection: &Option<Connection>) -> bool {
        connection
            .as_ref()
            .is_some_and(|open| self.moved_since(open.generation))
    }

    /// True when the sentinels named another master since `generation`.
    fn moved_since(&self, generation: u64) -> bool {
        match self {
            BatchTarget::Sentinel(sentinels) => generation != sentinels.generation(),
            BatchTarget::Fixed(_) => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Address {
    Tcp(String, u16),
    Unix(PathBuf),
    /// `rediss://`: TLS over TCP.
    Tls(String, u16, TlsClient),
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(host, port) | Address::Tls(host, port, _) => write!(f, "{host}:{port}"),
            Address::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The TLS settings of a `rediss://` endpoint.
#[derive(Clone)]
struct TlsClient(Arc<rustls::ClientConfig>);

impl PartialEq for TlsClient {
    fn eq(&self, other: &TlsClient) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsClient")
    }
}

impl Endpoint {
    /// The endpoint of a `redis://`, `rediss://` (with `tls`, `[redis] ca_file` and the
    /// client certificate) or `redis+unix://` URL. `None` for anything this client does not
    /// speak (TLS without checking the server's certificate, `#insecure`); such a server is
    /// used through the general client instead.
    pub fn from_url(url: &str, tls: Option<&RedisTls>) -> Option<Endpoint> {
        let client = redis::Client::open(url).ok()?;
        let info = client.get_connection_info();
        let address = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => Address::Tcp(host.clone(), *port),
            redis::ConnectionAddr::Unix(path) => Address::Unix(path.clone()),
            redis::ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                ..
            } => match crate::redis_store::rustls_config(tls) {
                Ok(config) => Address::Tls(host.clone(), *port, TlsClient(Arc::new(config))),
                Err(error) => {
                    tracing::warn!(
                        "redis TLS settings: {error}; rate limits use the general client"
                    );
                    return None;
                }
            },
            _ => return None,
        };
        let settings = info.redis_settings();
        Some(Endpoint {
            address,
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
            db: settings.db(),
            expect_master: false,
        })
    }
}

/// A batch's answer for one request: whether any rule blocked it, and each rule's verdict.
pub type Answer = (bool, Vec<RemoteVerdict>);

/// The verdicts of a request admitted ahead, one per rule: kept off the heap (rules are
/// few), as this is every request's path while its buckets are far from their limits.
pub type AheadVerdicts = smallvec::SmallVec<[RemoteVerdict; 2]>;

/// The queue of decisions and the worker that sends them to Redis in batches.
pub struct DecisionBatcher {
    shared: Arc<Shared>,
    call_bound: Duration,
    /// `[redis] admit_ahead_above`.
    admit_ahead_above: f64,
}

struct Shared {
    target: BatchTarget,
    script: &'static str,
    queue: Mutex<Queue>,
    wake: Notify,
    /// Per bucket key: what Redis said last, and levee's requests admitted since.
    headroom: Mutex<HashMap<String, Headroom>>,
    /// `CHARGE_HOLD`; tests set another.
    charge_hold: Duration,
    /// `MOST_HEADROOM_KEYS`; tests set another.
    most_headroom_keys: usize,
    /// Decisions queued or at Redis that are in no pending count (the table was full when
    /// they came). Their tokens are invisible to the headroom, so while there are any nothing
    /// is admitted ahead. Each holds an [`Uncounted`] that takes itself off when dropped.
    uncounted: Arc<AtomicUsize>,
}

/// One decision of `Shared::uncounted`, for as long as it exists.
struct Uncounted(Arc<AtomicUsize>);

impl Drop for Uncounted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What levee knows of one bucket in Redis.
#[derive(Debug, Clone, Copy)]
struct Headroom {
    burst: u32,
    /// Tokens left by Redis's last answer for this bucket (0 while unknown or distrusted).
    remaining: u32,
    /// This instance's requests on the bucket that Redis has not answered yet: decisions
    /// waiting, and requests admitted ahead. All of them may take a token before any later
    /// request does.
    pending: u32,
    as_of: Instant,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Waiting>,
    /// Entries of `waiting` that are decisions (not charges): while there are none, the
    /// worker may hold the charges back (`CHARGE_HOLD`).
    decisions: usize,
    worker_started: bool,
    closed: bool,
}

/// One request's decision (or, admitted ahead, a charge of `ahead` requests with the same
/// buckets), its part of the script call already encoded.
struct Waiting {
    rules: usize,
    /// RESP bulk strings: the request's keys, then (from `rules_at`) per rule its interval,
    /// burst and dry-run flag.
    encoded: Vec<u8>,
    rules_at: usize,
    /// 0 for a decision; else the requests admitted ahead that this charges.
    ahead: u32,
    /// Held by a decision that is not counted (see `counted`), until it is answered or
    /// dropped.
    uncounted: Option<Uncounted>,
    /// A charge already in a call that failed, queued once more (see `fail`).
    charged_again: bool,
    caller: Caller,
}

enum Caller {
    /// The request waits for the answer.
    Waits(oneshot::Sender<Result<Answer, RedisFailure>>),
    /// The request was admitted ahead; the answer only updates the headroom (and counts an
    /// overrun when Redis refused).
    Ahead(Counter),
}

impl Waiting {
    #[cfg(test)]
    fn new(asks: &[RedisAsk<'_>], caller: Caller, uncounted: Option<Uncounted>) -> Waiting {
        let mut encoded = Vec::new();
        let rules_at = encode_asks(&mut encoded, asks);
        Waiting::encoded(asks.len(), encoded, rules_at, caller, uncounted)
    }

    /// From its part of a script call (`encode_asks`), which starts its `rules` rules at
    /// `rules_at`. `uncounted`: `None` when the request is in its buckets' pending counts (a
    /// charge always is).
    fn encoded(
        rules: usize,
        encoded: Vec<u8>,
        rules_at: usize,
        caller: Caller,
        uncounted: Option<Uncounted>,
    ) -> Waiting {
        Waiting {
            rules,
            encoded,
            rules_at,
            ahead: u32::from(matches!(caller, Caller::Ahead(_))),
            uncounted,
            charged_again: false,
            caller,
        }
    }

    /// Its requests are in the pending counts of all its buckets (see `Shared::reserve`), so
    /// answering or dropping it takes them off; otherwise it never touches a pending count.
    fn counted(&self) -> bool {
        self.uncounted.is_none()
    }

    /// The requests this entry stands for: 1 for a decision, `ahead` for merged charges.
    fn requests(&self) -> u32 {
        self.ahead.max(1)
    }

    fn given_up(&self) -> bool {
        match &self.caller {
            Caller::Waits(reply) => reply.is_closed(),
            Caller::Ahead(_) => false,
        }
    }

    /// The request's bucket keys and bursts, read back from its encoded part.
    fn buckets(&self) -> impl Iterator<Item = (&str, u32)> + '_ {
        let keys = Bulks(&self.encoded[..self.rules_at]);
        let mut rules = Bulks(&self.encoded[self.rules_at..]);
        keys.map_while(move |key| {
            let _interval = rules.next()?;
            let burst = std::str::from_utf8(rules.next()?).ok()?.parse().ok()?;
            let _dry_run = rules.next()?;
            Some((std::str::from_utf8(key).ok()?, burst))
        })
    }

    fn fail(self, failure: &BatchFailure) {
        if let Caller::Waits(reply) = self.caller {
            let _ = reply.send(Err(failure.for_caller()));
        }
    }
}

impl DecisionBatcher {
    /// `call_bound` limits each connection attempt and each script call of the worker.
    pub fn new(
        target: BatchTarget,
        script: &'static str,
        call_bound: Duration,
        admit_ahead_above: f64,
    ) -> DecisionBatcher {
        DecisionBatcher {
            shared: Arc::new(Shared {
                target,
                script,
                queue: Mutex::new(Queue::default()),
                wake: Notify::new(),
                headroom: Mutex::new(HashMap::new()),
                charge_hold: CHARGE_HOLD,
                most_headroom_keys: MOST_HEADROOM_KEYS,
                uncounted: Arc::new(AtomicUsize::new(0)),
            }),
            call_bound,
            admit_ahead_above,
        }
    }

    /// Decides one request's rules, in the next batch.
    pub async fn decide(&self, asks: &[RedisAsk<'_>]) -> Result<Answer, RedisFailure> {
        let (reply, answer) = oneshot::channel();
        let now = Instant::now();
        let uncounted = self.shared.reserve(asks, now);
        let counted = uncounted.is_none();
        if let Err(failure) = self.enqueue(asks, Caller::Waits(reply), uncounted) {
            if counted {
                self.shared.release(asks.iter().map(|ask| ask.key), 1);
            }
            return Err(failure);
        }
        answer.await.unwrap_or(Err(RedisFailure::Connection(
            "the redis worker stopped".into(),
        )))
    }

    /// Admits the request at once when, for every rule, Redis's last answer (fresh) less this
    /// instance's requests Redis has not answered yet leaves more than `admit_ahead_above` of
    /// the burst. The request is then charged in the next batch like any other. `None`: not
    /// enough known headroom; decide with [`Self::decide`].
    ///
    /// A request admitted ahead can be one Redis would have refused only when other
    /// instances used up more than that share of the bucket since this instance's last
    /// answer for it (at most `HEADROOM_FRESH` old); `overruns` counts those.
    ///
    /// A dry-run rule refuses nothing, so it never makes a request wait: with fresh headroom
    /// its verdict is given at once whatever is left, "would be refused" when nothing is
    /// (told from the same answer, and charged in Redis like the rest: never past a full
    /// bucket). `now` is the request's reading of the clock.
    pub fn admit_ahead(
        &self,
        asks: &[RedisAsk<'_>],
        overruns: &Counter,
        now: Instant,
    ) -> Option<AheadVerdicts> {
        if self.admit_ahead_above >= 1.0 || asks.is_empty() {
            return None;
        }
        // The charge is queued before the headroom lock goes. Otherwise a decision counted
        // after this admission (so relying on Redis to refuse it once this request's token
        // is gone) could be queued ahead of the charge, take that token at Redis, and leave
        // the charge to overrun the burst: a rush on one bucket from several threads did.
        let mut headroom = lock(&self.shared.headroom);
        // (Counted up under this lock, by `reserve`.)
        if self.shared.uncounted.load(Ordering::Acquire) > 0 {
            return None;
        }
        // One lookup per ask: each is admitted as it is checked, and the ones admitted are
        // taken back if a later one cannot be.
        let mut verdicts = AheadVerdicts::new();
        for ask in asks {
            let Some(known) = headroom.get_mut(ask.key) else {
                break;
            };
            let left = known.remaining.saturating_sub(known.pending);
            let ahead = known.burst == ask.rule.burst
                && now.saturating_duration_since(known.as_of) <= HEADROOM_FRESH
                && (ask.rule.dry_run
                    || (left > 0
                        && f64::from(left) > self.admit_ahead_above * f64::from(ask.rule.burst)));
            if !ahead {
                break;
            }
            // Only a dry-run rule gets here with nothing left: it would refuse.
            let allowed = known.remaining > known.pending;
            known.pending += 1;
            let remaining = known.remaining.saturating_sub(known.pending);
            let used = u64::from(ask.rule.burst.saturating_sub(remaining));
            verdicts.push(RemoteVerdict {
                allowed,
                remaining,
                reset_ms: used.saturating_mul(ask.rule.interval_us).div_ceil(1000),
                // A dry run's refusal is counted, never answered: no wait to say.
                retry_after_ms: 0,
            });
        }
        if verdicts.len() < asks.len() {
            let admitted = asks[..verdicts.len()].iter().map(|ask| ask.key);
            take_off_pending(&mut headroom, admitted, 1);
            return None;
        }
        if self
            .enqueue(asks, Caller::Ahead(overruns.clone()), None)
            .is_err()
        {
            take_off_pending(&mut headroom, asks.iter().map(|ask| ask.key), 1);
            return None;
        }
        drop(headroom);
        Some(verdicts)
    }

    /// `uncounted`: see [`Waiting::encoded`].
    fn enqueue(
        &self,
        asks: &[RedisAsk<'_>],
        caller: Caller,
        uncounted: Option<Uncounted>,
    ) -> Result<(), RedisFailure> {
        // Encoded once, in a buffer of the thread's, before the lock: a charge like the one
        // queued last joins it (under load most of the queue is charges for the same
        // buckets, and they go to Redis as one, in their place in the order), and anything
        // else is queued with a copy of it.
        thread_local! {
            static ENCODED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        // (Nothing in the closure enters `enqueue` again, which would find the buffer taken.)
        ENCODED.with_borrow_mut(|encoded| {
            encoded.clear();
            let rules_at = encode_asks(encoded, asks);
            let ahead = matches!(caller, Caller::Ahead(_));
            // A decision never joins a charge: its copy is made before the lock, which every
            // request and the worker take. Only a charge that does not join is copied under it.
            let mut copy = (!ahead).then(|| encoded.clone());
            let mut queue = self.shared.lock();
            if let Some(last) = queue.waiting.last_mut() {
                // Not into a charge queued again after a failure: a second failure drops it.
                if ahead && last.ahead > 0 && !last.charged_again && last.encoded == *encoded {
                    last.ahead = last.ahead.saturating_add(1);
                    return Ok(());
                }
            }
            if queue.waiting.len() >= MOST_WAITING {
                return Err(RedisFailure::Overloaded(MOST_WAITING));
            }
            queue.waiting.push(Waiting::encoded(
                asks.len(),
                copy.take().unwrap_or_else(|| encoded.clone()),
                rules_at,
                caller,
                uncounted,
            ));
            if !queue.worker_started {
                queue.worker_started = true;
                tokio::spawn(work(Arc::clone(&self.shared), self.call_bound));
            }
            if !ahead {
                queue.decisions += 1;
            }
            // Wake the worker when there is something new to send: the first entry, or the
            // first decision, which ends a hold on the charges before it.
            if queue.waiting.len() == 1 || (!ahead && queue.decisions == 1) {
                self.shared.wake.notify_one();
            }
            Ok(())
        })
    }
}

/// Locks `mutex`, going on after a panic elsewhere: every state kept under these locks is
/// valid at any point a holder could have panicked.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Drop for DecisionBatcher {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_one();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        lock(&self.queue)
    }

    /// Counts a decision about to be queued against its buckets, remembering the buckets it
    /// is the first to ask about (their tokens unknown until Redis answers). All or none:
    /// when the buckets it would add do not fit in `most_headroom_keys` (after forgetting
    /// the stale ones), nothing is counted, and the decision must not take itself off any
    /// pending count later either, or it would take off another's. It then gets an
    /// [`Uncounted`], which stops admitting ahead until it is answered.
    fn reserve(&self, asks: &[RedisAsk<'_>], now: Instant) -> Option<Uncounted> {
        let mut headroom = lock(&self.headroom);
        let new = asks
            .iter()
            .filter(|ask| !headroom.contains_key(ask.key))
            .count();
        if new > 0 && headroom.len() + new > self.most_headroom_keys {
            forget_stale(&mut headroom, now);
            if headroom.len() + new > self.most_headroom_keys {
                // Under the headroom lock, so that no admission ahead after this misses it.
                self.uncounted.fetch_add(1, Ordering::AcqRel);
                return Some(Uncounted(Arc::clone(&self.uncounted)));
            }
        }
        for ask in asks {
            if let Some(known) = headroom.get_mut(ask.key) {
                known.pending = known.pending.saturating_add(1);
                continue;
            }
            headroom.insert(
                ask.key.to_owned(),
                Headroom {
                    burst: ask.rule.burst,
                    remaining: 0,
                    pending: 1,
                    as_of: now,
                },
            );
        }
        None
    }

    /// Takes `requests` off the pending count of `keys`: they will not be answered.
    fn release<'a>(&self, keys: impl Iterator<Item = &'a str>, requests: u32) {
        take_off_pending(&mut lock(&self.headroom), keys, requests);
    }

    /// A call failed: nothing known of any bucket is to be trusted until Redis answers again,
    /// so every request waits for it (and meets the health breaker). What is still pending
    /// stays counted: those requests are still queued.
    fn distrust(&self, batch: &[Waiting]) {
        let mut headroom = lock(&self.headroom);
        for waiting in batch.iter().filter(|waiting| waiting.counted()) {
            let keys = waiting.buckets().map(|(key, _)| key);
            take_off_pending(&mut headroom, keys, waiting.requests());
        }
        for known in headroom.values_mut() {
            known.remaining = 0;
        }
    }

    /// Puts charges of a failed call back at the front of the queue, marked as charged again.
    fn charge_again(&self, mut charges: Vec<Waiting>) {
        for charge in &mut charges {
            charge.charged_again = true;
        }
        let mut queue = self.lock();
        queue.waiting.splice(0..0, charges);
        drop(queue);
        self.wake.notify_one();
    }

    /// Takes in Redis's answers: each bucket's tokens left, and the requests on it that are
    /// now answered.
    fn learn(&self, batch: &[Waiting], answers: &[(u64, Vec<RemoteVerdict>)], now: Instant) {
        let mut headroom = lock(&self.headroom);
        for (waiting, (blocked, verdicts)) in batch.iter().zip(answers) {
            if let Caller::Ahead(overruns) = &waiting.caller {
                overruns.inc_by(*blocked);
            }
            for ((key, burst), verdict) in waiting.buckets().zip(verdicts) {
                let remaining = if verdict.allowed {
                    verdict.remaining
                } else {
                    0
                };
                if let Some(known) = headroom.get_mut(key) {
                    known.burst = burst;
                    known.remaining = remaining;
                    known.as_of = now;
                    if waiting.counted() {
                        known.pending = known.pending.saturating_sub(waiting.requests());
                    }
                }
            }
        }
    }

    /// Forgets buckets not answered lately and with nothing pending.
    fn forget_stale(&self, now: Instant) {
        forget_stale(&mut lock(&self.headroom), now);
    }
}

/// Takes `requests` off the pending count of `keys`, under a lock the caller holds.
fn take_off_pending<'a>(
    headroom: &mut HashMap<String, Headroom>,
    keys: impl Iterator<Item = &'a str>,
    requests: u32,
) {
    for key in keys {
        if let Some(known) = headroom.get_mut(key) {
            known.pending = known.pending.saturating_sub(requests);
        }
    }
}

fn forget_stale(headroom: &mut HashMap<String, Headroom>, now: Instant) {
    headroom.retain(|_, known| {
        known.pending > 0 || now.saturating_duration_since(known.as_of) <= HEADROOM_FRESH
    });
    // A table grown in a rush gives its memory back once the rush is over.
    if headroom.capacity() > 4 * headroom.len().max(1024) {
        headroom.shrink_to(2 * headroom.len());
    }
}

/// The RESP bulk strings of an encoded part, in order (levee wrote them: no error path).
struct Bulks<'a>(&'a [u8]);

impl<'a> Iterator for Bulks<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let rest = self.0.strip_prefix(b"$")?;
        let line_end = memchr::memmem::find(rest, b"\r\n")?;
        let length: usize = std::str::from_utf8(&rest[..line_end]).ok()?.parse().ok()?;
        let start = line_end + 2;
        let value = rest.get(start..start + length)?;
        self.0 = rest.get(start + length + 2..)?;
        Some(value)
    }
}

/// Why a batch got no answers. Each waiting decision gets its own `RedisFailure` from it.
#[derive(Debug)]
enum BatchFailure {
    Timeout(Duration),
    Io(std::io::Error),
    /// An answer that is not what the call asks for: the connection is dropped.
    Reply(String),
    /// Redis answered the call with an error (`OOM`, `BUSY`…): the connection stays in step
    /// and is kept.
    Refused(String),
    /// The server is a replica now (`READONLY`, a failover happened): the connection is
    /// dropped, and the next one goes to the master (the sentinels are asked again).
    NotMaster(String),
    /// No sentinel named the master, or the server named is not one.
    NoMaster(String),
}

impl BatchFailure {
    fn for_caller(&self) -> RedisFailure {
        match self {
            BatchFailure::Timeout(bound) => RedisFailure::Timeout(*bound),
            BatchFailure::Io(error) => RedisFailure::Connection(error.to_string()),
            BatchFailure::Reply(text) => RedisFailure::BadReply(text.clone()),
            // Full, it is up and answers at once: each decision falls back on its own, and
            // the health breaker stays closed. Taken for a failure, it opened, and the queue's
            // answered writes closed it again, every second while Redis stayed full.
            BatchFailure::Refused(text) if text.starts_with("OOM") => {
                RedisFailure::Full(format!("the rate-limit call was refused: {text}"))
            }
            BatchFailure::Refused(text) => {
                RedisFailure::BadReply(format!("redis refused the rate-limit call: {text}"))
            }
            BatchFailure::NotMaster(text) => RedisFailure::MasterMoved(text.clone()),
            BatchFailure::NoMaster(text) => RedisFailure::Connection(text.clone()),
        }
    }
}

impl From<std::io::Error> for BatchFailure {
    fn from(error: std::io::Error) -> BatchFailure {
        BatchFailure::Io(error)
    }
}

/// A command the worker has sent and Redis has not answered yet. Redis answers in order.
struct InFlight {
    sent_at: Instant,
    sent: Sent,
}

enum Sent {
    /// A script call deciding (and charging) `batch`. `resent`: already sent once more after
    /// `NOSCRIPT`.
    Call { batch: Vec<Waiting>, resent: bool },
    /// `SCRIPT LOAD`, sent after a `NOSCRIPT` answer.
    ScriptLoad,
}

/// What the worker finds in the queue.
enum Take {
    /// To send now.
    Batch(Vec<Waiting>),
    /// Only charges are queued: they wait for a decision, the answer to the call in flight,
    /// or (none in flight) until `CHARGE_HOLD` after the last call went out.
    Hold(Option<Instant>),
    /// Nothing queued; `true` once the batcher is dropped.
    Empty(bool),
}

/// `calls`: script calls in flight; `sent_at`: when the last one went out.
fn take(shared: &Shared, calls: usize, sent_at: Option<Instant>) -> Take {
    let mut queue = shared.lock();
    if queue.waiting.is_empty() {
        return Take::Empty(queue.closed);
    }
    if !queue.closed && queue.decisions == 0 && queue.waiting.len() < MOST_PER_BATCH {
        // Only charges: they never take the second call, which is kept for a decision, and
        // go at most once per `CHARGE_HOLD`.
        if calls > 0 {
            return Take::Hold(None);
        }
        if let Some(until) = sent_at.map(|sent_at| sent_at + shared.charge_hold) {
            if Instant::now() < until {
                return Take::Hold(Some(until));
            }
        }
    }
    let count = queue.waiting.len().min(MOST_PER_BATCH);
    let batch: Vec<Waiting> = queue.waiting.drain(..count).collect();
    let decisions = batch.iter().filter(|waiting| waiting.ahead == 0).count();
    queue.decisions = queue.decisions.saturating_sub(decisions);
    Take::Batch(batch)
}

/// The worker: takes what waits, sends it as one script call, hands out the answers; until
/// the batcher is dropped (a reload that changed `[redis]`) and what was queued has gone out,
/// so the requests admitted ahead are charged.
///
/// Up to `MOST_CALLS_IN_FLIGHT` calls are at Redis at once, on one connection: a decision
/// that comes while a call is out goes at once in the next, instead of waiting for the
/// answer first. Each call must be answered within `call_bound` of being sent; otherwise, or
/// when the connection fails or Redis answers something unreadable, every call in flight
/// fails, the connection is dropped, and the next batch connects again.
async fn work(shared: Arc<Shared>, call_bound: Duration) {
    let mut connection: Option<Connection> = None;
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let mut command: Vec<u8> = Vec::new();
    let mut swept_at = Instant::now();
    // When the last call went out; `None` after a failure, so the next goes out at once.
    let mut sent_at: Option<Instant> = None;
    loop {
        if shared.target.moved_from(&connection) {
            // The server may still take writes, but they would be lost with it: what is at it
            // falls back now, and the next call goes to the new master.
            let moved = BatchFailure::NotMaster("the sentinels name another master".into());
            fail_all(&shared, &mut in_flight, &moved);
            connection = None;
            sent_at = None;
        }
        let calls = in_flight
            .iter()
            .filter(|call| matches!(call.sent, Sent::Call { .. }))
            .count();
        let room = calls < MOST_CALLS_IN_FLIGHT;
        let mut hold_until = None;
        if room {
            match take(&shared, calls, sent_at) {
                Take::Batch(batch) => {
                    let batch = skip_given_up(&shared, batch);
                    if batch.is_empty() {
                        continue;
                    }
                    let now = Instant::now();
                    if now.saturating_duration_since(swept_at) >= HEADROOM_SWEEP_EVERY {
                        shared.forget_stale(now);
                        swept_at = now;
                    }
                    sent_at = Some(now);
                    in_flight.push_back(InFlight {
                        sent_at: now,
                        sent: Sent::Call {
                            batch,
                            resent: false,
                        },
                    });
                    if let Err(failure) = send_last(
                        &shared,
                        &mut connection,
                        &in_flight,
                        &mut command,
                        call_bound,
                    )
                    .await
                    {
                        fail_all(&shared, &mut in_flight, &failure);
                        connection = None;
                        sent_at = None;
                    }
                    continue;
                }
                Take::Hold(until) => hold_until = until,
                Take::Empty(closed) => {
                    if closed && in_flight.is_empty() {
                        return;
                    }
                }
            }
        }
        let answer_due = in_flight.front().map(|oldest| oldest.sent_at + call_bound);
        let far = Instant::now() + HEADROOM_SWEEP_EVERY;
        tokio::select! {
            biased;
            reply = read_next(&mut connection), if !in_flight.is_empty() => {
                let outcome = match reply {
                    Ok(reply) => take_in(&shared, &mut connection, &mut in_flight, reply, &mut command, call_bound).await,
                    Err(failure) => Err(failure),
                };
                if let Err(failure) = outcome {
                    fail_all(&shared, &mut in_flight, &failure);
                    connection = None;
                    sent_at = None;
                }
            }
            _ = tokio::time::sleep_until(answer_due.unwrap_or(far)), if answer_due.is_some() => {
                fail_all(&shared, &mut in_flight, &BatchFailure::Timeout(call_bound));
                connection = None;
                sent_at = None;
            }
            _ = shared.wake.notified(), if room => {}
            _ = tokio::time::sleep_until(hold_until.unwrap_or(far)), if hold_until.is_some() => {}
        }
    }
}

/// A decision whose caller gave up (its timeout) is not worth Redis's time.
fn skip_given_up(shared: &Shared, batch: Vec<Waiting>) -> Vec<Waiting> {
    let mut kept = Vec::with_capacity(batch.len());
    for waiting in batch {
        if waiting.given_up() {
            if waiting.counted() {
                shared.release(waiting.buckets().map(|(key, _)| key), waiting.requests());
            }
        } else {
            kept.push(waiting);
        }
    }
    kept
}

/// Sends the call last in `in_flight` (connecting first when needed).
async fn send_last(
    shared: &Shared,
    connection: &mut Option<Connection>,
    in_flight: &VecDeque<InFlight>,
    command: &mut Vec<u8>,
    call_bound: Duration,
) -> Result<(), BatchFailure> {
    let (
        Some(oldest),
        Some(InFlight {
            sent: Sent::Call { batch, .. },
            ..
        }),
    ) = (in_flight.front(), in_flight.back())
    else {
        return Ok(());
    };
    // Connecting and writing count against the oldest call's answer: that is when it fails.
    let answer_due = oldest.sent_at + call_bound;
    // A connection that sat idle may have been closed by Redis meanwhile (a restart, a
    // `timeout` in redis.conf, a proxy in between): nothing reads it while no call is out.
    // Found now, a new one is opened; found after sending, the call would fail, and with it
    // every decision of the batch, and a healthy Redis could be taken for a failing one.
    if in_flight.len() == 1 && connection.as_mut().is_some_and(|idle| !idle.is_usable()) {
        tracing::debug!("the idle rate-limit connection to redis was closed; opening another");
        *connection = None;
    }
    let connection = match connection {
        Some(connection) => connection,
        None => {
            let open = async {
                let (endpoint, generation) = shared.target.endpoint(call_bound).await?;
                let mut opened = match Connection::open(&endpoint, shared.script).await {
                    Ok(opened) => opened,
                    // The server named was found no master while the sentinels named
                    // another: a failover under way, not a failing Redis.
                    Err(BatchFailure::NoMaster(why)) if shared.target.moved_since(generation) => {
                        return Err(BatchFailure::NotMaster(why))
                    }
                    Err(failure) => return Err(failure),
                };
                opened.generation = generation;
                Ok::<_, BatchFailure>(opened)
            };
            let opened = tokio::time::timeout_at(answer_due, open)
                .await
                .map_err(|_elapsed| BatchFailure::Timeout(call_bound))??;
            connection.insert(opened)
        }
    };
    encode_call(command, &connection.script_sha, batch);
    connection.write(command, answer_due, call_bound).await
}

async fn read_next(connection: &mut Option<Connection>) -> Result<Reply, BatchFailure> {
    match connection {
        Some(connection) => connection.read_reply().await,
        None => std::future::pending().await,
    }
}

/// Takes in the answer to the oldest command in flight. `Err`: the connection is no longer
/// to be trusted (the caller fails everything in flight).
async fn take_in(
    shared: &Shared,
    connection: &mut Option<Connection>,
    in_flight: &mut VecDeque<InFlight>,
    reply: Reply,
    command: &mut Vec<u8>,
    call_bound: Duration,
) -> Result<(), BatchFailure> {
    // (Answers come only on a connection, and only while something is in flight.)
    let (Some(connection), Some(oldest)) = (connection.as_mut(), in_flight.pop_front()) else {
        return Err(BatchFailure::Reply(format!(
            "an answer to nothing: {reply:?}"
        )));
    };
    let (mut batch, resent) = match oldest.sent {
        Sent::ScriptLoad => return connection.take_script_sha(reply),
        Sent::Call { batch, resent } => (batch, resent),
    };
    match reply {
        Reply::Bulk(Some(text)) => {
            if let Err(failure) = hand_out(shared, &text, &mut batch) {
                in_flight.push_front(InFlight {
                    sent_at: oldest.sent_at,
                    sent: Sent::Call { batch, resent },
                });
                return Err(failure);
            }
            Ok(())
        }
        Reply::Error(message) if message.starts_with("NOSCRIPT") && !resent => {
            // Redis lost its scripts (`SCRIPT FLUSH`, a failover to a replica that never saw
            // the load) while keeping the connection: load it again and send the batch again,
            // behind the calls already out. Nothing of the batch ran, so nothing is counted
            // twice; its decisions now come after those calls'. The script, and so its SHA1,
            // is the same.
            command.clear();
            put_command(command, &[b"SCRIPT", b"LOAD", shared.script.as_bytes()]);
            put_call(command, &connection.script_sha, &batch);
            let now = Instant::now();
            let answer_due = in_flight.front().map_or(now, |oldest| oldest.sent_at) + call_bound;
            in_flight.push_back(InFlight {
                sent_at: now,
                sent: Sent::ScriptLoad,
            });
            in_flight.push_back(InFlight {
                sent_at: now,
                sent: Sent::Call {
                    batch,
                    resent: true,
                },
            });
            connection.write(command, answer_due, call_bound).await
        }
        Reply::Error(message) if message.starts_with("READONLY") => {
            // A master turned replica keeps its clients' connections open (unless a sentinel
            // closes them): the next batch connects anew, to the master of now.
            let failure = BatchFailure::NotMaster(message);
            fail(shared, batch, &failure);
            Err(failure)
        }
        Reply::Error(message) => {
            // Redis's own error answer (`OOM`, `BUSY`…) leaves the connection in step.
            fail(shared, batch, &BatchFailure::Refused(message));
            Ok(())
        }
        other => {
            let failure = BatchFailure::Reply(format!("the rate-limit script returned {other:?}"));
            fail(shared, batch, &failure);
            Err(failure)
        }
    }
}

/// Every call in flight failed: nothing known of the buckets is to be trusted until Redis
/// answers again, and each waiting decision gets the failure.
fn fail_all(shared: &Shared, in_flight: &mut VecDeque<InFlight>, failure: &BatchFailure) {
    for call in in_flight.drain(..) {
        if let Sent::Call { batch, .. } = call.sent {
            fail(shared, batch, failure);
        }
    }
}

fn fail(shared: &Shared, batch: Vec<Waiting>, failure: &BatchFailure) {
    tracing::debug!("rate-limit batch of {} failed: {failure:?}", batch.len());
    // Requests admitted ahead went through on the strength of their charge, and a charge
    // that never reached Redis would leave their tokens in the bucket for others. So a
    // failed charge goes out once more, first in the queue and still counted. If the failed
    // call did reach Redis after all, the bucket pays twice: it refuses more, never admits
    // more. A second failure drops the charge.
    let (again, failed): (Vec<Waiting>, Vec<Waiting>) = batch
        .into_iter()
        .partition(|waiting| waiting.ahead > 0 && !waiting.charged_again);
    shared.distrust(&failed);
    if !again.is_empty() {
        shared.charge_again(again);
    }
    for waiting in failed {
        waiting.fail(failure);
    }
}

/// A request's part of a script call: its keys, then per rule its interval, burst and dry-run
/// flag. Returns where the rules start.
fn encode_asks(out: &mut Vec<u8>, asks: &[RedisAsk<'_>]) -> usize {
    for ask in asks {
        put_bulk(out, ask.key.as_bytes());
    }
    let rules_at = out.len();
    for ask in asks {
        out.extend_from_slice(&ask.rule.encoded);
    }
    rules_at
}

/// A limit rule as the rate-limit script takes it: the interval between tokens, the burst and
/// the dry-run flag. Every request's part of a script call carries them, so they are encoded
/// once, when the policy is compiled, not per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisRule {
    pub interval_us: u64,
    pub burst: u32,
    pub dry_run: bool,
    /// The three, as the bulk strings of a script call.
    encoded: Box<[u8]>,
}

impl RedisRule {
    pub fn new(interval_us: u64, burst: u32, dry_run: bool) -> RedisRule {
        let mut encoded = Vec::with_capacity(48);
        put_number(&mut encoded, interval_us);
        put_number(&mut encoded, u64::from(burst));
        put_bulk(&mut encoded, if dry_run { b"1" } else { b"0" });
        RedisRule {
            interval_us,
            burst,
            dry_run,
            encoded: encoded.into_boxed_slice(),
        }
    }
}

/// `EVALSHA sha numkeys keys… requests args…`, from the parts each decision encoded.
fn encode_call(command: &mut Vec<u8>, sha: &str, batch: &[Waiting]) {
    command.clear();
    put_call(command, sha, batch);
}

/// Appends the script call of [`encode_call`] to `command`.
fn put_call(command: &mut Vec<u8>, sha: &str, batch: &[Waiting]) {
    let keys: usize = batch.iter().map(|waiting| waiting.rules).sum();
    let args: usize = 1 + batch
        .iter()
        .map(|waiting| 2 + 3 * waiting.rules)
        .sum::<usize>();
    command.push(b'*');
    put_digits(command, (3 + keys + args) as u64);
    command.extend_from_slice(b"\r\n");
    put_bulk(command, b"EVALSHA");
    put_bulk(command, sha.as_bytes());
    put_number(command, keys as u64);
    for waiting in batch {
        command.extend_from_slice(&waiting.encoded[..waiting.rules_at]);
    }
    put_number(command, batch.len() as u64);
    for waiting in batch {
        put_number(command, waiting.rules as u64);
        put_number(command, u64::from(waiting.ahead));
        command.extend_from_slice(&waiting.encoded[waiting.rules_at..]);
    }
}

/// Splits the script's reply among the batch, in order, and sends each its answer.
fn hand_out(shared: &Shared, reply: &[u8], batch: &mut Vec<Waiting>) -> Result<(), BatchFailure> {
    let mut numbers = reply_numbers(reply);
    let mut answers = Vec::with_capacity(batch.len());
    let shown = || String::from_utf8_lossy(reply.get(..80).unwrap_or(reply)).into_owned();
    for waiting in batch.iter() {
        match read_answer(&mut numbers, waiting.rules) {
            Some(answer) => answers.push(answer),
            None => {
                return Err(BatchFailure::Reply(format!(
                    "unreadable reply: {}",
                    shown()
                )))
            }
        }
    }
    if numbers.next().is_some() {
        return Err(BatchFailure::Reply(format!("reply too long: {}", shown())));
    }
    shared.learn(batch, &answers, Instant::now());
    for (waiting, (blocked, verdicts)) in batch.drain(..).zip(answers) {
        if let Caller::Waits(reply) = waiting.caller {
            let _ = reply.send(Ok((blocked > 0, verdicts)));
        }
    }
    Ok(())
}

/// Reads one request's part of the script's reply: blocked (a count, for a charge of
/// requests admitted ahead), then four numbers per rule (see `limit/script.lua`). `None`
/// when the numbers run out or one is not a number.
pub fn read_answer<'a>(
    numbers: &mut impl Iterator<Item = &'a [u8]>,
    rules: usize,
) -> Option<(u64, Vec<RemoteVerdict>)> {
    let mut next = || integer(numbers.next()?);
    let blocked = u64::try_from(next()?).unwrap_or(0);
    let mut verdicts = Vec::with_capacity(rules);
    for _ in 0..rules {
        let allowed = next()? == 1;
        let remaining = next()?;
        let reset_ms = next()?;
        let retry_after_ms = next()?;
        verdicts.push(RemoteVerdict {
            allowed,
            remaining: u32::try_from(remaining).unwrap_or(0),
            reset_ms: u64::try_from(reset_ms).unwrap_or(0),
            retry_after_ms: u64::try_from(retry_after_ms).unwrap_or(0),
        });
    }
    Some((blocked, verdicts))
}

/// The space-separated numbers of the script's reply, read as bytes: every request's answer
/// passes through here, and checking the whole reply for UTF-8 first, then searching it as
/// text, cost more than reading the digits.
pub fn reply_numbers(reply: &[u8]) -> impl Iterator<Item = &[u8]> {
    reply.split(|byte| *byte == b' ')
}

/// A decimal integer with an optional `-`, as Redis writes one; `None` for anything else
/// (an empty word, a `+`, a digit beyond ASCII, a value beyond i64).
fn integer(word: &[u8]) -> Option<i64> {
    let (negative, digits) = match word.split_first()? {
        (b'-', digits) => (true, digits),
        _ => (false, word),
    };
    if digits.is_empty() {
        return None;
    }
    let mut value: i64 = 0;
    for digit in digits {
        if !digit.is_ascii_digit() {
            return None;
        }
        let digit = i64::from(digit - b'0');
        value = value.checked_mul(10)?;
        value = if negative {
            value.checked_sub(digit)?
        } else {
            value.checked_add(digit)?
        };
    }
    Some(value)
}

trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

/// The worker's connection, logged in, on its database, with the script loaded.
struct Connection {
    stream: Pin<Box<dyn Duplex>>,
    read: BytesMut,
    script_sha: String,
    /// With Redis Sentinel, the sentinels' generation of the master it goes to.
    generation: u64,
}

impl Connection {
    async fn open(endpoint: &Endpoint, script: &str) -> Result<Connection, BatchFailure> {
        let stream: Pin<Box<dyn Duplex>> = match &endpoint.address {
            Address::Tcp(host, port) => {
                let stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                stream.set_nodelay(true)?;
                Box::pin(stream)
            }
            Address::Unix(path) => Box::pin(tokio::net::UnixStream::connect(path).await?),
            Address::Tls(host, port, client) => {
                let stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                stream.set_nodelay(true)?;
                let name = rustls_pki_types::ServerName::try_from(host.clone()).map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("`{host}` is not a name a TLS certificate can be checked against"),
                    )
                })?;
                let connector = tokio_rustls::TlsConnector::from(client.0.clone());
                Box::pin(connector.connect(name, stream).await?)
            }
        };
        let mut connection = Connection {
            stream,
            read: BytesMut::with_capacity(16 << 10),
            script_sha: String::new(),
            generation: 0,
        };
        // The login, the database and the script, in one write; the replies come in order.
        let mut hello = Vec::new();
        let mut expected = Vec::new();
        if let Some(password) = &endpoint.password {
            let mut words: Vec<&[u8]> = vec![b"AUTH"];
            if let Some(username) = &endpoint.username {
                words.push(username.as_bytes());
            }
            words.push(password.as_bytes());
            put_command(&mut hello, &words);
            expected.push("AUTH");
        }
        if endpoint.db != 0 {
            let db = endpoint.db.to_string();
            put_command(&mut hello, &[b"SELECT", db.as_bytes()]);
            expected.push("SELECT");
        }
        if endpoint.expect_master {
            put_command(&mut hello, &[b"INFO", b"replication"]);
        }
        put_command(&mut hello, &[b"SCRIPT", b"LOAD", script.as_bytes()]);
        connection.stream.write_all(&hello).await?;
        connection.stream.flush().await?;
        for command in expected {
            match connection.read_reply().await? {
                Reply::Status(_) => {}
                Reply::Error(message) => {
                    return Err(BatchFailure::Reply(format!("{command} refused: {message}")))
                }
                other => return Err(BatchFailure::Reply(format!("{command} answered {other:?}"))),
            }
        }
        if endpoint.expect_master {
            let info = connection.read_reply().await?;
            let role = match &info {
                Reply::Bulk(Some(text)) => {
                    crate::redis_sentinel::is_master(&String::from_utf8_lossy(text))
                }
                // NOAUTH (a password missing), NOPERM (an ACL user without INFO)…
                Reply::Error(message) => {
                    return Err(BatchFailure::Reply(format!(
                        "INFO replication refused by {}: {message}",
                        endpoint.address
                    )))
                }
                _ => false,
            };
            if !role {
                // Counted against Redis's health (unlike a master that moves under a
                // connection): a sentinel that keeps naming a replica must not have every
                // batch connect to it again.
                return Err(BatchFailure::NoMaster(format!(
                    "the sentinels named {} as master, but it is not one (yet)",
                    endpoint.address
                )));
            }
        }
        let reply = connection.read_reply().await?;
        connection.take_script_sha(reply)?;
        Ok(connection)
    }

    /// Whether an idle connection can carry a call: the socket has nothing to say. A close,
    /// a reset or bytes nobody asked for all end it. Asks without waiting.
    fn is_usable(&mut self) -> bool {
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        let mut probe = [0u8; 64];
        let mut room = tokio::io::ReadBuf::new(&mut probe);
        self.stream
            .as_mut()
            .poll_read(&mut context, &mut room)
            .is_pending()
    }

    /// Takes in the answer to `SCRIPT LOAD`: the script's SHA1, used by every call after it.
    fn take_script_sha(&mut self, reply: Reply) -> Result<(), BatchFailure> {
        match reply {
            Reply::Bulk(Some(sha)) if sha.len() == 40 && sha.is_ascii() => {
                self.script_sha = String::from_utf8_lossy(&sha).into_owned();
                Ok(())
            }
            Reply::Error(message) => Err(BatchFailure::Reply(format!(
                "SCRIPT LOAD refused: {message}"
            ))),
            other => Err(BatchFailure::Reply(format!(
                "SCRIPT LOAD answered {other:?}"
            ))),
        }
    }

    /// Writes `command`, failing with `Timeout(call_bound)` at `deadline`.
    async fn write(
        &mut self,
        command: &[u8],
        deadline: Instant,
        call_bound: Duration,
    ) -> Result<(), BatchFailure> {
        // Flushed: TLS keeps what was written until then (a no-op on a plain socket).
        let written = async {
            self.stream.write_all(command).await?;
            self.stream.flush().await
        };
        match tokio::time::timeout_at(deadline, written).await {
            Ok(written) => Ok(written?),
            Err(_elapsed) => Err(BatchFailure::Timeout(call_bound)),
        }
    }

    /// Reads one reply. Cancel-safe: what was read stays in `self.read` for the next call.
    async fn read_reply(&mut self) -> Result<Reply, BatchFailure> {
        loop {
            if let Some(reply) = take_reply(&mut self.read)? {
                return Ok(reply);
            }
            self.read.reserve(16 << 10);
            if self.stream.read_buf(&mut self.read).await? == 0 {
                return Err(BatchFailure::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "redis closed the connection",
                )));
            }
        }
    }
}

/// One RESP2 reply, of the kinds the limiter's commands give.
#[derive(Debug, PartialEq)]
enum Reply {
    Status(String),
    Error(String),
    Integer(i64),
    Bulk(Option<BytesMut>),
}

/// For the fuzzer (`fuzz/fuzz_targets/redis_reply.rs`): reads every reply it can off the front
/// of `bytes`, as the worker reads Redis's answers, then splits each bulk reply as a batch of
/// `rules`-rule answers; returns how many replies it read. Never a panic.
#[doc(hidden)]
pub fn read_replies_for_fuzzing(bytes: &[u8], rules: usize) -> usize {
    let mut read = BytesMut::from(bytes);
    let mut replies = 0;
    while let Ok(Some(reply)) = take_reply(&mut read) {
        replies += 1;
        if let Reply::Bulk(Some(text)) = reply {
            let mut numbers = reply_numbers(&text);
            while read_answer(&mut numbers, rules).is_some() {}
        }
    }
    replies
}

/// Takes one whole reply off the front of `read`; `None` while it is incomplete.
fn take_reply(read: &mut BytesMut) -> Result<Option<Reply>, BatchFailure> {
    let Some(line_end) = memchr::memmem::find(read, b"\r\n") else {
        if read.len() > MOST_REPLY_BYTES {
            return Err(BatchFailure::Reply("reply line too long".into()));
        }
        return Ok(None);
    };
    let line = |read: &BytesMut| String::from_utf8_lossy(&read[1..line_end]).into_owned();
    let reply = match read.first() {
        Some(b'+') => Reply::Status(line(read)),
        Some(b'-') => Reply::Error(line(read)),
        Some(b':') => {
            Reply::Integer(integer(&read[1..line_end]).ok_or_else(|| {
                BatchFailure::Reply(format!("bad integer reply {:?}", line(read)))
            })?)
        }
        Some(b'$') => {
            let length = integer(&read[1..line_end])
                .ok_or_else(|| BatchFailure::Reply(format!("bad bulk length {:?}", line(read))))?;
            if length < 0 {
                read.advance(line_end + 2);
                return Ok(Some(Reply::Bulk(None)));
            }
            let length = usize::try_from(length).unwrap_or(usize::MAX);
            if length > MOST_REPLY_BYTES {
                return Err(BatchFailure::Reply(format!("bulk reply of {length} bytes")));
            }
            let start = line_end + 2;
            if read.len() < start + length + 2 {
                return Ok(None);
            }
            if &read[start + length..start + length + 2] != b"\r\n" {
                return Err(BatchFailure::Reply("bulk reply not ended by CRLF".into()));
            }
            read.advance(start);
            let text = read.split_to(length);
            read.advance(2);
            return Ok(Some(Reply::Bulk(Some(text))));
        }
        _ => {
            return Err(BatchFailure::Reply(format!(
                "unexpected reply {:?}",
                String::from_utf8_lossy(&read[..line_end.min(80)])
            )))
        }
    };
    read.advance(line_end + 2);
    Ok(Some(reply))
}

fn put_command(out: &mut Vec<u8>, words: &[&[u8]]) {
    out.push(b'*');
    put_digits(out, words.len() as u64);
    out.extend_from_slice(b"\r\n");
    for word in words {
        put_bulk(out, word);
    }
}

fn put_bulk(out: &mut Vec<u8>, value: &[u8]) {
    out.push(b'$');
    put_digits(out, value.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

fn put_number(out: &mut Vec<u8>, value: u64) {
    let mut digits = itoa::Buffer::new();
    put_bulk(out, digits.format(value).as_bytes());
}

fn put_digits(out: &mut Vec<u8>, value: u64) {
    let mut digits = itoa::Buffer::new();
    out.extend_from_slice(digits.format(value).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take_all(bytes: &[u8]) -> Vec<Reply> {
        let mut read = BytesMut::from(bytes);
        let mut replies = Vec::new();
        while let Some(reply) = take_reply(&mut read).expect("readable") {
            replies.push(reply);
        }
        assert!(read.is_empty(), "left over: {read:?}");
        replies
    }

    #[test]
    fn replies_of_every_kind_are_read_and_partial_ones_wait() {
        let replies = take_all(b"+OK\r\n-ERR no\r\n:42\r\n$-1\r\n$5\r\n1 0 2\r\n$0\r\n\r\n");
        assert_eq!(
            replies,
            vec![
                Reply::Status("OK".into()),
                Reply::Error("ERR no".into()),
                Reply::Integer(42),
                Reply::Bulk(None),
                Reply::Bulk(Some(BytesMut::from(&b"1 0 2"[..]))),
                Reply::Bulk(Some(BytesMut::new())),
            ]
        );
        let whole = b"$11\r\nhello world\r\n";
        for cut in 0..whole.len() {
            let mut read = BytesMut::from(&whole[..cut]);
            assert_eq!(
                take_reply(&mut read).expect("readable"),
                None,
                "cut at {cut}"
            );
            assert_eq!(read.len(), cut, "nothing taken from a partial reply");
        }
    }

    #[test]
    fn malformed_replies_are_errors() {
        for bad in [&b"?what\r\n"[..], b"$x\r\n", b":1.5\r\n", b"$3\r\nabcd\r\n"] {
            let mut read = BytesMut::from(bad);
            assert!(take_reply(&mut read).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_call_carries_each_request_keys_first_then_counts_and_rules() {
        let waiting = |keys: &[&str], rules: &[(u64, u32, bool)], ahead: bool| {
            let rules: Vec<RedisRule> = rules
                .iter()
                .map(|&(interval_us, burst, dry_run)| RedisRule::new(interval_us, burst, dry_run))
                .collect();
            let asks: Vec<RedisAsk<'_>> = keys
                .iter()
                .zip(&rules)
                .map(|(key, rule)| RedisAsk { key, tag: "", rule })
                .collect();
            let caller = if ahead {
                Caller::Ahead(Counter::default())
            } else {
                Caller::Waits(oneshot::channel().0)
            };
            Waiting::new(&asks, caller, None)
        };
        let mut charge = waiting(&["c"], &[(30, 4, false)], true);
        charge.ahead += 6;
        let batch = vec![
            waiting(&["a", "b"], &[(10, 2, false), (20, 3, true)], false),
            charge,
        ];
        assert_eq!(batch[0].buckets().collect::<Vec<_>>(), [("a", 2), ("b", 3)]);
        let mut command = Vec::new();
        encode_call(&mut command, "sha", &batch);
        let words: Vec<&str> = std::str::from_utf8(&command)
            .expect("text")
            .split("\r\n")
            .filter(|word| !word.starts_with('$') && !word.is_empty())
            .collect();
        assert_eq!(
            words,
            [
                "*20", "EVALSHA", "sha", "3", "a", "b", "c", "2", "2", "0", "10", "2", "0", "20",
                "3", "1", "1", "7", "30", "4", "0"
            ]
        );
    }

    #[test]
    fn answers_are_split_in_order_and_a_short_reply_is_refused() {
        let mut numbers = reply_numbers(b"0 1 4 100 0 1 0 0 5 7");
        let first = read_answer(&mut numbers, 1).expect("first");
        assert_eq!(first.0, 0);
        assert_eq!(
            first.1,
            vec![RemoteVerdict {
                allowed: true,
                remaining: 4,
                reset_ms: 100,
                retry_after_ms: 0
            }]
        );
        let second = read_answer(&mut numbers, 1).expect("second");
        assert_eq!(second.0, 1);
        assert!(!second.1[0].allowed);
        assert_eq!(second.1[0].retry_after_ms, 7);
        assert!(read_answer(&mut numbers, 1).is_none());
        assert!(read_answer(&mut reply_numbers(b"0 1 x 0 0"), 1).is_none());
        assert!(read_answer(&mut reply_numbers(b"0 1 +4 0 0"), 1).is_none());
        assert!(read_answer(&mut reply_numbers(b"0 1  0 0"), 1).is_none());
    }

    #[test]
    fn integers_are_read_as_redis_writes_them() {
        assert_eq!(integer(b"0"), Some(0));
        assert_eq!(integer(b"-1"), Some(-1));
        assert_eq!(integer(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(integer(b"-9223372036854775808"), Some(i64::MIN));
        for bad in [
            &b""[..],
            b"-",
            b"+1",
            b"1.5",
            b"9223372036854775808",
            b"\xd9\xa3",
            b" 1",
        ] {
            assert_eq!(integer(bad), None, "{bad:?}");
        }
    }
}

/// The worker against a Redis stand-in that answers only when told, so the tests see what is
/// on the wire before any answer: calls in flight together, and `NOSCRIPT` among them.
#[cfg(test)]
mod pipeline_tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
    /// Long enough never to be reached in these tests (a call answered late fails them).
    const CALL_BOUND: Duration = Duration::from_secs(30);
    /// Bounds each wait of the stand-in, so a test that goes wrong fails instead of hanging.
    const PATIENCE: Duration = Duration::from_secs(20);

    struct StandIn {
        stream: TcpStream,
        read: BytesMut,
    }

    impl StandIn {
        /// Listens, and returns the batcher's URL and a task that accepts the worker's
        /// connection and takes its `SCRIPT LOAD`.
        async fn listen() -> (String, tokio::task::JoinHandle<StandIn>) {
            let (url, listener) = Self::bind().await;
            let accepted = tokio::spawn(async move { StandIn::accept(&listener).await });
            (url, accepted)
        }

        async fn bind() -> (String, TcpListener) {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let url = format!("redis://{}", listener.local_addr().expect("address"));
            (url, listener)
        }

        /// Accepts the worker's next connection and takes its `SCRIPT LOAD`.
        async fn accept(listener: &TcpListener) -> StandIn {
            let (stream, _) = tokio::time::timeout(PATIENCE, listener.accept())
                .await
                .expect("the worker connects")
                .expect("accept");
            let mut stand_in = StandIn {
                stream,
                read: BytesMut::new(),
            };
            assert_eq!(stand_in.command().await[..2], ["SCRIPT", "LOAD"]);
            stand_in.answer(&bulk(SHA)).await;
            stand_in
        }

        /// The next command the worker sent, as words.
        async fn command(&mut self) -> Vec<String> {
            loop {
                if let Some(words) = take_command(&mut self.read) {
                    return words;
                }
                let read = tokio::time::timeout(PATIENCE, self.stream.read_buf(&mut self.read))
                    .await
                    .expect("the worker sends a command")
                    .expect("read");
                assert!(read > 0, "the worker closed the connection");
            }
        }

        async fn answer(&mut self, resp: &str) {
            self.stream.write_all(resp.as_bytes()).await.expect("write");
        }
    }

    /// One RESP array of bulk strings off the front of `read`, when it is all there.
    fn take_command(read: &mut BytesMut) -> Option<Vec<String>> {
        let text = std::str::from_utf8(read).ok()?;
        let (count, mut rest) = text.strip_prefix('*')?.split_once("\r\n")?;
        let mut words = Vec::new();
        for _ in 0..count.parse::<usize>().ok()? {
            let (length, after) = rest.strip_prefix('$')?.split_once("\r\n")?;
            let length: usize = length.parse().ok()?;
            words.push(after.get(..length)?.to_owned());
            rest = after.get(length + 2..)?;
        }
        let used = read.len() - rest.len();
        read.advance(used);
        Some(words)
    }

    /// `text` as a RESP bulk string.
    fn bulk(text: &str) -> String {
        format!("${}\r\n{text}\r\n", text.len())
    }

    /// The script's answer for one request with one rule: allowed, `remaining` left.
    fn allowed(remaining: u32) -> String {
        bulk(&format!("0 1 {remaining} 100 0"))
    }

    fn batcher(url: &str) -> Arc<DecisionBatcher> {
        batcher_with(url, CALL_BOUND, 1.0)
    }

    /// Charges are not held for time here (`charge_hold` 0), so the tests see what else
    /// holds them.
    fn batcher_with(
        url: &str,
        call_bound: Duration,
        admit_ahead_above: f64,
    ) -> Arc<DecisionBatcher> {
        let endpoint = Endpoint::from_url(url, None).expect("a redis:// url");
        let mut batcher = DecisionBatcher::new(
            BatchTarget::Fixed(endpoint),
            "return 1",
            call_bound,
            admit_ahead_above,
        );
        Arc::get_mut(&mut batcher.shared)
            .expect("the worker has not started")
            .charge_hold = Duration::ZERO;
        Arc::new(batcher)
    }

    /// The rule every test ask is decided by: 10 at once, then one per millisecond.
    static RULE: std::sync::LazyLock<RedisRule> =
        std::sync::LazyLock::new(|| RedisRule::new(1000, 10, false));

    fn ask(key: &str) -> RedisAsk<'_> {
        RedisAsk {
            key,
            tag: key,
            rule: &RULE,
        }
    }

    /// Each request's `ahead` in a script call (0: a decision that waits).
    fn aheads_of(call: &[String]) -> Vec<u32> {
        let keys: usize = call[2].parse().expect("numkeys");
        let mut at = 3 + keys;
        let requests: usize = call[at].parse().expect("requests");
        at += 1;
        let mut aheads = Vec::new();
        for _ in 0..requests {
            let rules: usize = call[at].parse().expect("rules");
            aheads.push(call[at + 1].parse().expect("ahead"));
            at += 2 + 3 * rules;
        }
        assert_eq!(at, call.len(), "{call:?}");
        aheads
    }

    fn decide(batcher: &Arc<DecisionBatcher>, key: &'static str) -> Decision {
        let batcher = Arc::clone(batcher);
        tokio::spawn(async move { batcher.decide(&[ask(key)]).await })
    }

    /// The keys a script call carries.
    fn keys_of(call: &[String]) -> Vec<String> {
        assert_eq!(call[..2], ["EVALSHA".to_owned(), SHA.to_owned()]);
        let count: usize = call[2].parse().expect("numkeys");
        call[3..3 + count].to_vec()
    }

    async fn remaining(decision: Decision) -> u32 {
        let (blocked, verdicts) = decision
            .await
            .expect("the decision task ends")
            .expect("the decision is answered");
        assert!(!blocked);
        verdicts[0].remaining
    }

    type Decision = tokio::task::JoinHandle<Result<Answer, RedisFailure>>;

    /// Decisions on `rl:a` and `rl:b`, both sent, neither answered.
    async fn two_calls_in_flight(
        batcher: &Arc<DecisionBatcher>,
        accepted: tokio::task::JoinHandle<StandIn>,
    ) -> (StandIn, Decision, Decision) {
        let first = decide(batcher, "rl:a");
        let mut redis = accepted.await.expect("stand-in");
        assert_eq!(keys_of(&redis.command().await), ["rl:a"]);
        // The first call is not answered yet, and the second is already on the wire.
        let second = decide(batcher, "rl:b");
        assert_eq!(keys_of(&redis.command().await), ["rl:b"]);
        (redis, first, second)
    }

    /// A decision on `rl:k` that Redis answers with 9 of 10 tokens left, so that requests on
    /// it are admitted ahead after.
    async fn knowing_nine_left(
        batcher: &Arc<DecisionBatcher>,
        accepted: tokio::task::JoinHandle<StandIn>,
    ) -> StandIn {
        let first = decide(batcher, "rl:k");
        let mut redis = accepted.await.expect("stand-in");
        assert_eq!(keys_of(&redis.command().await), ["rl:k"]);
        redis.answer(&allowed(9)).await;
        assert_eq!(remaining(first).await, 9);
        redis
    }

    /// The worker closes the connection (so no late answer is read as another batch's).
    async fn closes(redis: &mut StandIn) {
        let mut read = [0u8; 1];
        let closed = tokio::time::timeout(PATIENCE, redis.stream.read(&mut read))
            .await
            .expect("the worker closes the connection");
        assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    }

    async fn fails(decision: Decision, failure: impl Fn(&RedisFailure) -> bool) {
        let failed = decision.await.expect("the decision task ends");
        assert!(
            matches!(&failed, Err(error) if failure(error)),
            "{failed:?}"
        );
    }

    #[tokio::test]
    async fn a_decision_goes_out_while_the_call_before_it_is_still_at_redis() {
        let (url, accepted) = StandIn::listen().await;
        let batcher = batcher(&url);
        let (mut redis, first, second) = two_calls_in_flight(&batcher, accepted).await;
        redis.answer(&allowed(9)).await;
        redis.answer(&allowed(8)).await;
        assert_eq!(remaining(first).await, 9);
        assert_eq!(remaining(second).await, 8);
    }

    #[tokio::test]
    async fn noscript_for_calls_in_flight_loads_the_script_and_sends_each_again_once() {
        let (url, accepted) = StandIn::listen().await;
        let batcher = batcher(&url);
        let (mut redis, first, second) = two_calls_in_flight(&batcher, accepted).await;
        redis.answer("-NOSCRIPT No matching script.\r\n").await;
        redis.answer("-NOSCRIPT No matching script.\r\n").await;
        for key in ["rl:a", "rl:b"] {
            assert_eq!(redis.command().await[..2], ["SCRIPT", "LOAD"]);
            assert_eq!(keys_of(&redis.command().await), [key]);
        }
        redis.answer(&bulk(SHA)).await;
        redis.answer(&allowed(9)).await;
        redis.answer(&bulk(SHA)).await;
        // A second NOSCRIPT for the same batch is an answer: that decision fails, and the
        // connection stays for the next.
        redis.answer("-NOSCRIPT No matching script.\r\n").await;
        assert_eq!(remaining(first).await, 9);
        fails(
            second,
            |error| matches!(error, RedisFailure::BadReply(text) if text.contains("NOSCRIPT")),
        )
        .await;
        let third = decide(&batcher, "rl:c");
        assert_eq!(keys_of(&redis.command().await), ["rl:c"]);
        redis.answer(&allowed(7)).await;
        assert_eq!(remaining(third).await, 7);
    }

    #[tokio::test]
    async fn an_unreadable_answer_fails_every_call_in_flight_and_drops_the_connection() {
        let (url, accepted) = StandIn::listen().await;
        let batcher = batcher(&url);
        let (mut redis, first, second) = two_calls_in_flight(&batcher, accepted).await;
        // Two numbers where one request's answer needs five.
        redis.answer("$3\r\n0 1\r\n").await;
        for decision in [first, second] {
            fails(decision, |error| matches!(error, RedisFailure::BadReply(_))).await;
        }
        closes(&mut redis).await;
    }

    #[tokio::test]
    async fn calls_in_flight_unanswered_within_the_bound_all_fail() {
        let (url, accepted) = StandIn::listen().await;
        // Long enough that the second call is surely out before the first times out.
        let bound = Duration::from_secs(2);
        let batcher = batcher_with(&url, bound, 1.0);
        let (mut redis, first, second) = two_calls_in_flight(&batcher, accepted).await;
        for decision in [first, second] {
            fails(
                decision,
                |error| matches!(error, RedisFailure::Timeout(after) if *after == bound),
            )
            .await;
        }
        closes(&mut redis).await;
    }

    #[tokio::test]
    async fn a_failed_charge_goes_out_once_more_and_a_second_failure_drops_it() {
        let (url, listener) = StandIn::bind().await;
        let batcher = batcher_with(&url, CALL_BOUND, 0.5);
        let overruns = Counter::default();
        let first = decide(&batcher, "rl:k");
        let mut redis = StandIn::accept(&listener).await;
        assert_eq!(keys_of(&redis.command().await), ["rl:k"]);
        redis.answer(&allowed(9)).await;
        assert_eq!(remaining(first).await, 9);
        assert!(batcher
            .admit_ahead(&[ask("rl:k")], &overruns, Instant::now())
            .is_some());
        let pending = || {
            lock(&batcher.shared.headroom)
                .get("rl:k")
                .map(|known| known.pending)
        };
        for attempt in ["first", "second"] {
            let charge = redis.command().await;
            assert_eq!(
                (keys_of(&charge), aheads_of(&charge)),
                (vec!["rl:k".into()], vec![1]),
                "{attempt} attempt"
            );
            // Unreadable: the call fails and the connection is dropped.
            redis.answer("$3\r\n0 1\r\n").await;
            closes(&mut redis).await;
            if attempt == "first" {
                // Still counted, and sent again at once on a new connection.
                assert_eq!(pending(), Some(1));
                redis = StandIn::accept(&listener).await;
            }
        }
        // Dropped after the second failure: the next call carries only the next decision.
        let next = decide(&batcher, "rl:other");
        let mut redis = StandIn::accept(&listener).await;
        let call = redis.command().await;
        assert_eq!(
            (keys_of(&call), aheads_of(&call)),
            (vec!["rl:other".into()], vec![0])
        );
        redis.answer(&allowed(9)).await;
        assert_eq!(remaining(next).await, 9);
        assert_eq!(pending(), Some(0));
    }

    #[tokio::test]
    async fn nothing_is_admitted_ahead_while_a_decision_counted_nowhere_is_out() {
        let (url, accepted) = StandIn::listen().await;
        let mut batcher = batcher_with(&url, CALL_BOUND, 0.5);
        Arc::get_mut(&mut Arc::get_mut(&mut batcher).expect("not shared yet").shared)
            .expect("the worker has not started")
            .most_headroom_keys = 1;
        let overruns = Counter::default();
        let mut redis = knowing_nine_left(&batcher, accepted).await;
        // The table holds one bucket, rl:k, just answered: a decision on another bucket
        // does not fit and is counted nowhere. Its token is invisible to rl:k's headroom
        // (were it a rule both share), so nothing is admitted ahead while it is out.
        let other = decide(&batcher, "rl:new");
        assert_eq!(keys_of(&redis.command().await), ["rl:new"]);
        assert!(batcher
            .admit_ahead(&[ask("rl:k")], &overruns, Instant::now())
            .is_none());
        redis.answer(&allowed(9)).await;
        assert_eq!(remaining(other).await, 9);
        assert_eq!(batcher.shared.uncounted.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn a_request_with_one_bucket_unknown_is_not_admitted_ahead_and_takes_nothing() {
        let (url, accepted) = StandIn::listen().await;
        let batcher = batcher_with(&url, CALL_BOUND, 0.5);
        let overruns = Counter::default();
        let _redis = knowing_nine_left(&batcher, accepted).await;
        // rl:k alone would be admitted ahead; with a bucket never answered for, the
        // request waits for Redis, and rl:k keeps all of its headroom.
        assert!(batcher
            .admit_ahead(&[ask("rl:k"), ask("rl:unknown")], &overruns, Instant::now())
            .is_none());
        let pending = |key: &str| {
            lock(&batcher.shared.headroom)
                .get(key)
                .map(|known| known.pending)
        };
        assert_eq!(pending("rl:k"), Some(0));
        assert_eq!(pending("rl:unknown"), None);
        assert!(batcher
            .admit_ahead(&[ask("rl:k")], &overruns, Instant::now())
            .is_some());
        assert_eq!(pending("rl:k"), Some(1));
    }

    #[tokio::test]
    async fn charges_wait_while_a_call_is_out_and_the_next_decision_takes_them_along() {
        let (url, accepted) = StandIn::listen().await;
        let batcher = batcher_with(&url, CALL_BOUND, 0.5);
        let overruns = Counter::default();
        let mut redis = knowing_nine_left(&batcher, accepted).await;
        // Admitted at once; its charge goes out as a call of its own (nothing else is out).
        assert!(batcher
            .admit_ahead(&[ask("rl:k")], &overruns, Instant::now())
            .is_some());
        let charge = redis.command().await;
        assert_eq!(
            (keys_of(&charge), aheads_of(&charge)),
            (vec!["rl:k".into()], vec![1])
        );
        // While that call is out, a second charge waits: the second call is kept for a
        // decision, which takes the charge along.
        assert!(batcher
            .admit_ahead(&[ask("rl:k")], &overruns, Instant::now())
            .is_some());
        let decision = decide(&batcher, "rl:other");
        let both = redis.command().await;
        assert_eq!(keys_of(&both), ["rl:k", "rl:other"]);
        assert_eq!(aheads_of(&both), [1, 0]);
        redis.answer(&allowed(8)).await;
        redis.answer(&bulk("0 1 7 100 0 0 1 9 100 0")).await;
        assert_eq!(remaining(decision).await, 9);
        assert_eq!(overruns.get(), 0);
    }

    #[tokio::test]
    async fn a_dropped_batcher_still_sends_the_charges_queued_then_closes() {
        let (url, accepted) = StandIn::listen().await;
        let batcher = batcher_with(&url, CALL_BOUND, 0.5);
        let overruns = Counter::default();
        let mut redis = knowing_nine_left(&batcher, accepted).await;
        assert!(batcher
            .admit_ahead(&[ask("rl:k")], &overruns, Instant::now())
            .is_some());
        // A reload replaced `[redis]`: the admitted request is charged all the same.
        drop(batcher);
        let charge = redis.command().await;
        assert_eq!(
            (keys_of(&charge), aheads_of(&charge)),
            (vec!["rl:k".into()], vec![1])
        );
        redis.answer(&allowed(8)).await;
        closes(&mut redis).await;
    }

    #[test]
    fn a_decision_whose_new_buckets_do_not_fit_counts_nothing_and_takes_nothing_off() {
        let endpoint = Endpoint::from_url("redis://127.0.0.1:1", None).expect("a redis:// url");
        let mut batcher =
            DecisionBatcher::new(BatchTarget::Fixed(endpoint), "return 1", CALL_BOUND, 0.5);
        Arc::get_mut(&mut batcher.shared)
            .expect("the worker has not started")
            .most_headroom_keys = 1;
        let shared = &batcher.shared;
        let now = Instant::now();
        let pending = |key: &str| lock(&shared.headroom).get(key).map(|known| known.pending);
        assert!(shared.reserve(&[ask("rl:a")], now).is_none());
        // rl:b does not fit beside rl:a, which has a request pending: nothing is counted, not
        // even on rl:a.
        let uncounted = shared.reserve(&[ask("rl:a"), ask("rl:b")], now);
        assert!(uncounted.is_some());
        assert_eq!((pending("rl:a"), pending("rl:b")), (Some(1), None));
        assert_eq!(shared.uncounted.load(Ordering::Acquire), 1);
        // Its answer tells what is left of rl:a, but takes nothing off rl:a's pending request.
        let verdict = |remaining| RemoteVerdict {
            allowed: true,
            remaining,
            reset_ms: 1,
            retry_after_ms: 0,
        };
        let uncounted = Waiting::new(
            &[ask("rl:a"), ask("rl:b")],
            Caller::Waits(oneshot::channel().0),
            uncounted,
        );
        shared.learn(&[uncounted], &[(0, vec![verdict(7), verdict(9)])], now);
        // Answered and gone: it no longer stops admitting ahead.
        assert_eq!(shared.uncounted.load(Ordering::Acquire), 0);
        assert_eq!(pending("rl:a"), Some(1));
        assert_eq!(
            lock(&shared.headroom)
                .get("rl:a")
                .map(|known| known.remaining),
            Some(7)
        );
        // The counted request's answer does.
        let counted = Waiting::new(&[ask("rl:a")], Caller::Waits(oneshot::channel().0), None);
        shared.learn(&[counted], &[(0, vec![verdict(6)])], now);
        assert_eq!(pending("rl:a"), Some(0));
    }

    #[test]
    fn a_sweep_forgets_stale_buckets_and_gives_back_a_table_grown_in_a_rush() {
        let then = Instant::now();
        let known = |pending| Headroom {
            burst: 10,
            remaining: 5,
            pending,
            as_of: then,
        };
        let mut headroom: HashMap<String, Headroom> =
            (0..20_000).map(|n| (format!("rl:{n}"), known(0))).collect();
        headroom.insert("rl:waiting".into(), known(1));
        forget_stale(
            &mut headroom,
            then + HEADROOM_FRESH + Duration::from_millis(1),
        );
        assert_eq!(headroom.keys().collect::<Vec<_>>(), ["rl:waiting"]);
        assert!(headroom.capacity() < 4096, "{}", headroom.capacity());
    }
}
