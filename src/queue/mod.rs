//! Accept now, apply later: degraded writes stored in Redis Streams and replayed to the app.
//!
//! A `queue` route (switched off, or `always_queue`) stores the request — method, target,
//! headers, body, client IP, time — with `XADD` and answers 202 with the job id only after Redis
//! confirmed the write; if Redis cannot take it the client gets 503 and is told to retry. Every
//! levee instance runs replay workers in one consumer group per route: each job is sent to the
//! route's upstream with `Idempotency-Key: <job id>` and the original client identity, retried
//! with exponential back-off and jitter, and after `max_attempts` moved to a dead-letter stream.
//! A worker renews its hold on the jobs it read until it has dealt with them; a job whose
//! hold was not renewed for `claim_after` (its worker died) is taken over (`XAUTOCLAIM`).
//! Finished jobs are deleted from the stream, so it does not grow without bound.

pub mod job;
pub mod worker;

use crate::log_throttle::LogThrottle;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Limited};

use crate::config::Policy;
use crate::error::{full_body, ProxyError};
use crate::metrics::{Metrics, QueueLabels, QueueResultLabels};
use crate::proxy::body::{find_cause, BodyIdleTimeout, IdleTimeout, ResponseBody};
use crate::proxy::route::Route;
use crate::redis_store::{Guard, RedisFailure};
pub use job::Job;

/// The shortest `claim_after` a policy may set: a worker renews its hold on its jobs every
/// third of it, and each renewal is a Redis call.
pub const MIN_CLAIM_AFTER: Duration = Duration::from_secs(1);

/// `[queue]`, compiled. Queues need `[redis]`.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSettings {
    /// Consumer group shared by every levee instance. Default `levee`.
    pub group: String,
    /// A job whose worker has not renewed its hold for this long is taken over. Default 30s.
    pub claim_after: Duration,
    /// Attempts before a job goes to the dead-letter stream. Default 5.
    pub max_attempts: u32,
    /// First retry delay; doubled each attempt (with jitter). Default 1s.
    pub backoff_base: Duration,
    /// Longest retry delay. Default 5m.
    pub backoff_max: Duration,
    /// Largest body accepted into the queue (413 above). Default 1 MiB.
    pub max_body: usize,
    /// Replays per second per route, per instance. Default 50.
    pub replay_rate: f64,
    /// How often workers look for work. Default 200ms.
    pub poll_interval: Duration,
    /// Dead letters kept per route; the oldest beyond it are dropped. Default 1000.
    pub max_dead_letters: u32,
    /// Replicas that must hold a job before it is answered 202. Default 0: the master's
    /// answer is enough.
    pub wait_replicas: u32,
    /// How long a job waits for `wait_replicas`. Default 100ms.
    pub wait_timeout: Duration,
    /// What fewer replicas than `wait_replicas` within `wait_timeout` mean. Default refuse.
    pub unconfirmed: Unconfirmed,
}

/// `[queue] when_unconfirmed`: the answer for a job fewer than `wait_replicas` replicas
/// confirmed in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unconfirmed {
    /// The job is withdrawn and the client gets 503 (unless withdrawing it failed or came
    /// too late, see `SETTLE_WRITE`): as a rule a 202 means the replicas hold it.
    Refuse,
    /// The client gets 202 all the same; levee warns and counts it.
    Accept,
}

/// The longest `[queue] wait_timeout`. A client may wait twice that for its answer (its job
/// waits for the batch before its own), on top of the write's and a withdrawal's time.
pub const MAX_WAIT_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings {
            group: "levee".into(),
            claim_after: Duration::from_secs(30),
            max_attempts: 5,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            max_body: 1 << 20,
            replay_rate: 50.0,
            poll_interval: Duration::from_millis(200),
            max_dead_letters: 1000,
            wait_replicas: 0,
            wait_timeout: Duration::from_millis(100),
            unconfirmed: Unconfirmed::Refuse,
        }
    }
}

/// A route's queue answer (202 page) from the policy.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueAction {
    /// 202 body for browsers; `{job}` is the job id. Default: a short English page.
    pub body_html: Option<Arc<str>>,
    /// 202 body for API clients. Default `{"status":"accepted","job":"…"}`.
    pub body_json: Option<Arc<str>>,
}

/// Queues of routes that stopped queueing while jobs were stored in them: a reload changed
/// the route's action, renamed or removed the route, or changed `key_prefix`. Those jobs were
/// answered 202, so they are still replayed (through the route of that name as it is now, or
/// as it was) and listed in `/queues` until their queue, dead letters included, is empty.
///
/// Queues found at start in Redis's list of queue routes (see [`QueueKeys::registry`]) are
/// taken on the same way. One whose route name the policy lacks cannot be replayed (levee
/// does not know where its jobs go): it is held as *unrouted*, listed in `/queues`, and taken
/// on as soon as a reload brings a route of that name.
#[derive(Default)]
pub struct FormerQueues {
    by_stream: std::sync::Mutex<std::collections::BTreeMap<String, FormerQueue>>,
    /// Route name → keys of queues holding jobs for a route the policy does not have.
    unrouted: std::sync::Mutex<std::collections::BTreeMap<String, QueueKeys>>,
}

#[derive(Clone)]
pub struct FormerQueue {
    pub keys: QueueKeys,
    pub route: Arc<Route>,
}

impl FormerQueues {
    /// Takes on a queue its route no longer serves; `false` when it is already known.
    pub fn adopt(&self, keys: QueueKeys, route: Arc<Route>) -> bool {
        let mut by_stream = crate::redis_batch::lock(&self.by_stream);
        if by_stream.contains_key(&keys.stream) {
            return false;
        }
        by_stream.insert(keys.stream.clone(), FormerQueue { keys, route });
        true
    }

    pub fn forget(&self, stream: &str) {
        crate::redis_batch::lock(&self.by_stream).remove(stream);
    }

    pub fn list(&self) -> Vec<FormerQueue> {
        crate::redis_batch::lock(&self.by_stream)
            .values()
            .cloned()
            .collect()
    }

    /// The keys of the former or unrouted queue named `name` (its route's name, or its
    /// stream key: see [`shown_name`]), if one is kept.
    pub fn keys_named(&self, name: &str) -> Option<QueueKeys> {
        let by_stream = crate::redis_batch::lock(&self.by_stream);
        let former = by_stream
            .get(name)
            .or_else(|| {
                by_stream
                    .values()
                    .find(|former| &*former.route.name.0 == name)
            })
            .map(|former| former.keys.clone());
        drop(by_stream);
        former.or_else(|| crate::redis_batch::lock(&self.unrouted).get(name).cloned())
    }

    /// Holds a queue whose route the policy lacks; `false` when it is already held.
    pub fn hold_unrouted(&self, route: &str, keys: QueueKeys) -> bool {
        let mut unrouted = crate::redis_batch::lock(&self.unrouted);
        if unrouted.contains_key(route) {
            return false;
        }
        unrouted.insert(route.to_string(), keys);
        true
    }

    /// The unrouted queues: route name and keys.
    pub fn unrouted(&self) -> Vec<(String, QueueKeys)> {
        crate::redis_batch::lock(&self.unrouted)
            .iter()
            .map(|(route, keys)| (route.clone(), keys.clone()))
            .collect()
    }

    pub fn forget_unrouted(&self, route: &str) {
        crate::redis_batch::lock(&self.unrouted).remove(route);
    }
}

/// The name a queue goes by in `/queues`, in its metrics' `route` label and in its admin
/// paths: its route's, or, for a queue its route no longer uses while that route queues under
/// other keys (`key_prefix` changed), its stream key. Under the route's name both, the old
/// queue was hidden behind the new one in `/queues`, its dead letters out of the API's reach,
/// and the two took turns in one gauge.
pub fn shown_name(policy: &Policy, keys: &QueueKeys, route: &str) -> String {
    let queues_elsewhere = policy.routes.routes.iter().any(|current| {
        &*current.name.0 == route
            && current.queue.is_some()
            && QueueKeys::new(policy.key_prefix(), route).stream != keys.stream
    });
    if queues_elsewhere {
        keys.stream.clone()
    } else {
        route.to_string()
    }
}

/// Redis keys of a route's queue.
#[derive(Clone)]
pub struct QueueKeys {
    pub stream: String,
    pub dead: String,
    pub delayed: String,
    /// The set of route names that have had a queue under this `key_prefix`: an instance
    /// that starts reads it to find queues that still hold jobs for routes that no longer
    /// queue (the policy changed while it was down), so those jobs are not stranded.
    pub registry: String,
    /// Start of the keys that record what became of each write (see [`ENQUEUE_BEFORE`]).
    writes: String,
}

impl QueueKeys {
    pub fn new(prefix: &str, route: &str) -> QueueKeys {
        // One hash tag per route: in a cluster, a route's stream, dead letters and delayed
        // jobs share a slot, so the scripts that move jobs between them stay atomic.
        QueueKeys {
            stream: format!("{prefix}queue:{{{route}}}:jobs"),
            dead: format!("{prefix}queue:{{{route}}}:dead"),
            delayed: format!("{prefix}queue:{{{route}}}:delayed"),
            registry: QueueKeys::registry_of(prefix),
            writes: format!("{prefix}queue:{{{route}}}:write:"),
        }
    }

    /// The key that records what became of the write named `token`.
    fn write_record(&self, token: &str) -> String {
        format!("{}{token}", self.writes)
    }

    /// The registry's key under `prefix` (see [`QueueKeys::registry`]).
    pub fn registry_of(prefix: &str) -> String {
        format!("{prefix}queue:routes")
    }
}

/// Stores a job, unless Redis's clock is past levee's deadline for it or levee has already
/// settled the write without it ([`SETTLE_WRITE`] left a tombstone, an empty record), and
/// records the entry's id under the write's own key, so that levee can ask what became of a
/// write whose answer it did not get. It also removes the records of earlier writes whose
/// answers came (see [`AnsweredRecords`]), after the job's `XADD`: Redis refuses a script's
/// writes for a full memory (`noeviction`) only until the script has written, so with the
/// removals first a full Redis took every job and grew past `maxmemory`. With the job stored, it lists the route in the
/// registry (see [`QueueKeys::registry`]) in the same step, so a stored job's route is always
/// listed; in a cluster the registry lives in another slot, and levee lists the route with a
/// call of its own after the write.
///
/// KEYS: stream, write record, the registry unless ARGV[3] is empty, then those records.
/// ARGV: deadline (µs, Redis clock), record TTL (ms), the route's name ('' in a cluster), the
/// job's fields. The job's `at` (when it was stored, ms) is set here from Redis's clock, the
/// clock its age is read against (see `worker::OLDEST_JOB_AGE`): the writing instance's own
/// clock may be minutes off the others'. A write run twice (a client library that sent it again after a dropped
/// connection) finds its own record and answers the id it stored the first time, whatever
/// the clock says by then: the job is stored once, and its writer answers 202.
pub const ENQUEUE_BEFORE: &str = r#"
local lists = ARGV[3] ~= ''
local first_answered = 3
if lists then
  first_answered = 4
end
local function forget_answered()
  for i = first_answered, #KEYS do
    redis.call('UNLINK', KEYS[i])
  end
end
local prior = redis.call('GET', KEYS[2])
if prior then
  forget_answered()
  if string.sub(prior, 1, 8) == 'decided:' then
    return string.sub(prior, 9)
  end
  if prior ~= '' then
    return prior
  end
  return false
end
local now = redis.call('TIME')
if tonumber(now[1]) * 1000000 + tonumber(now[2]) > tonumber(ARGV[1]) then
  forget_answered()
  return false
end
local fields = {unpack(ARGV, 4)}
local at = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
local has_at = false
for i = 1, #fields, 2 do
  if fields[i] == 'at' then
    fields[i + 1] = at
    has_at = true
  end
end
if not has_at then
  fields[#fields + 1] = 'at'
  fields[#fields + 1] = at
end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('SET', KEYS[2], id, 'PX', ARGV[2])
if lists then
  redis.call('SADD', KEYS[3], ARGV[3])
end
forget_answered()
return id
"#;

/// Settles a write whose answer levee did not get, in one step, so that the client's answer
/// is true: a write that has not run is barred from running later (a tombstone), and one
/// stored that no worker has read yet is withdrawn; both answer `absent`. A job a worker has
/// read (pending), or has already replayed, stands: `stands <id>`. A job that waits for
/// replicas is withdrawn even once read while Redis's clock is before its `confirm_by` and no
/// worker has marked its record `decided:<id>`: no worker replays it before both (see
/// `worker::HOLD_WHEN_DECIDED`), so whichever comes first wins, whatever the clock does.
/// KEYS: stream, write record. ARGV: consumer group, record TTL (ms), and the job's
/// `confirm_by` (µs, Redis clock) when it waits for replicas.
pub const SETTLE_WRITE: &str = r#"
local id = redis.call('GET', KEYS[2])
if id and string.sub(id, 1, 8) == 'decided:' then
  return {'stands', string.sub(id, 9)}
end
if id and id ~= '' then
  local undecided = false
  if ARGV[3] then
    local now = redis.call('TIME')
    undecided = tonumber(now[1]) * 1000000 + tonumber(now[2]) < tonumber(ARGV[3])
  end
  if undecided then
    redis.pcall('XACK', KEYS[1], ARGV[1], id)
    redis.call('XDEL', KEYS[1], id)
  else
    local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], id, id, 1)
    local read = type(pending) == 'table' and pending.err == nil and #pending > 0
    if read or redis.call('XDEL', KEYS[1], id) == 0 then
      return {'stands', id}
    end
  end
end
redis.call('SET', KEYS[2], '', 'PX', ARGV[2])
return {'absent'}
"#;

/// The job field that holds when a job that waits for replicas is decided (µs, Redis's
/// clock): its writer withdraws it only before then, and no worker replays it before then.
pub const CONFIRM_BY_FIELD: &str = "confirm_by";
/// The job field that names its write's record, which the worker that replays a job that
/// waited for replicas marks `decided:<id>` first (see [`SETTLE_WRITE`]).
pub const CONFIRM_RECORD_FIELD: &str = "confirm_record";

/// How long a write's record lives: far longer than a write and its settling can take (the
/// deadline bars a late write after a few hundred milliseconds at most).
const WRITE_RECORD_TTL_MS: u64 = 60_000;

/// The records of writes whose answers came, per stream, which the route's next write from
/// this instance removes ([`ENQUEUE_BEFORE`]), kept with the Redis they are in. Only a write
/// whose answer is lost asks its record what became of it ([`SETTLE_WRITE`]); left to
/// expire, a record per job costs Redis a million keys at a few thousand jobs a second, and
/// Redis 7.0 reclaims expiring keys lazily until about a tenth of them are stale, then in
/// slices of up to 25 ms (the benchmark's queue section saw 36-40 ms stalls, longer than a
/// rate-limit call waits). Removed one by one with later writes, they cost nothing at once.
/// A record not removed (the list is full, the write that took it failed, or its stream gets
/// no more writes) expires as before.
#[derive(Debug, Default)]
pub struct AnsweredRecords {
    by_stream: std::sync::Mutex<std::collections::HashMap<String, Vec<String>>>,
}

/// Most records one write removes, and most kept waiting per stream.
const RECORDS_REMOVED_PER_WRITE: usize = 16;
const RECORDS_KEPT_PER_STREAM: usize = 4096;

impl AnsweredRecords {
    /// `record`'s write was answered: the stream's next write may remove it.
    fn put(&self, stream: &str, record: String) {
        let mut by_stream = crate::redis_batch::lock(&self.by_stream);
        match by_stream.get_mut(stream) {
            Some(records) if records.len() >= RECORDS_KEPT_PER_STREAM => {}
            Some(records) => records.push(record),
            None => {
                by_stream.insert(stream.to_string(), vec![record]);
            }
        }
    }

    /// Up to [`RECORDS_REMOVED_PER_WRITE`] records for the stream's next write to remove. The
    /// stream's entry stays, empty, rather than be made again by the write's own `put`: a
    /// route that stops queueing leaves at most the few records answered after its last take.
    fn take(&self, stream: &str) -> Vec<String> {
        let mut by_stream = crate::redis_batch::lock(&self.by_stream);
        let Some(records) = by_stream.get_mut(stream) else {
            return Vec::new();
        };
        let from = records.len().saturating_sub(RECORDS_REMOVED_PER_WRITE);
        records.split_off(from)
    }

    /// A stream no route writes to any more (its queue is forgotten): its records are left
    /// to expire, and its entry goes.
    pub(crate) fn forget(&self, stream: &str) {
        crate::redis_batch::lock(&self.by_stream).remove(stream);
    }
}

/// A name for one write, unique across instances and restarts.
fn write_token() -> String {
    static INSTANCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let instance = INSTANCE.get_or_init(worker::consumer_name);
    let number = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{instance}-{number}")
}

/// Asks Redis what became of a write whose answer did not come ([`SETTLE_WRITE`]):
/// `Ok(Some(id))` when the job is stored for good, `Ok(None)` when it is not and never will be.
async fn settle_write(
    redis: &crate::redis_store::RedisStore,
    keys: &QueueKeys,
    record: &str,
    group: &str,
    confirm_by: Option<u64>,
    timeout: Duration,
) -> Result<Option<String>, RedisFailure> {
    let mut command = redis::cmd("EVAL");
    command
        .arg(SETTLE_WRITE)
        .arg(2)
        .arg(&keys.stream)
        .arg(record)
        .arg(group)
        .arg(WRITE_RECORD_TTL_MS);
    if let Some(confirm_by) = confirm_by {
        command.arg(confirm_by);
    }
    let answer: Vec<String> = redis.command(&command, timeout, None).await?;
    match answer.as_slice() {
        [absent] if absent == "absent" => Ok(None),
        [stands, id] if stands == "stands" => Ok(Some(id.clone())),
        _ => Err(RedisFailure::BadReply(format!(
            "settling a write: {answer:?}"
        ))),
    }
}

/// Counts a job fewer replicas confirmed than `wait_replicas` asks for, by what became of it.
fn count_unconfirmed(metrics: &Metrics, route: &Route, result: &'static str) {
    metrics
        .queue_unconfirmed
        .get_or_create(&QueueResultLabels {
            route: route.name.to_string().into(),
            result,
        })
        .inc();
}

const DEFAULT_ACCEPTED_HTML: &str = "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>Accepted</title></head>\n<body><h1>Accepted</h1><p>Your request was received and takes effect shortly.</p><p>Reference: {job}</p><p><a href=\"javascript:history.back()\">Back to the page</a></p></body></html>\n";
const DEFAULT_ACCEPTED_JSON: &str = "{\"status\":\"accepted\",\"job\":\"{job}\"}\n";

/// Stores the request as a job and answers 202, or fails with 503 (not stored) / 413. The
/// request's hop-by-hop fields are gone and its forwarded fields set (`header::set_forwarded`):
/// the job is replayed with the headers it is stored with.
#[allow(clippy::too_many_arguments)]
pub async fn enqueue(
    policy: &Policy,
    route: &Route,
    action: &QueueAction,
    parts: http::request::Parts,
    received_head: Bytes,
    body: crate::proxy::body::JobBody,
    client_ip: std::net::IpAddr,
    wants_json: bool,
    metrics: &Metrics,
) -> Result<Response<ResponseBody>, ProxyError> {
    let (Some(redis), Some(settings)) = (&policy.redis, &policy.queue) else {
        return Err(ProxyError::Internal(
            "queue route without [redis] and [queue]".into(),
        ));
    };
    let limit = settings
        .max_body
        .min(usize::try_from(route.max_body).unwrap_or(usize::MAX));
    let keys = QueueKeys::new(policy.key_prefix(), &route.name.0);
    let not_stored = |error: String| {
        // One line per refused POST would flood the log while Redis is down.
        static NOT_STORED: LogThrottle = LogThrottle::new(Duration::from_secs(10));
        match NOT_STORED.allow(std::time::Instant::now()) {
            Some(held_back) => {
                tracing::warn!(route = %route.name, held_back, "job not stored: {error}")
            }
            None => {
                tracing::debug!(route = %route.name, "job not stored: {error}")
            }
        }
        ProxyError::QueueUnavailable {
            route: route.name.to_string(),
            unsettled: false,
        }
    };
    // With Redis known to be down (its health breaker open), the job cannot be stored: the
    // client is answered now, before it uploads a body for nothing (or is told `100 Continue`).
    // Once the cool-down is over, writes coming together all pass here and one of them is the
    // probe; the others are refused (503) when they ask Redis, after their bodies.
    if redis.leave_for(&keys.stream).is_none() {
        return Err(not_stored(
            "Redis is down (its health breaker is open)".into(),
        ));
    }
    // A body announced over the limit is refused before it is read: a client that sent
    // `Expect: 100-continue` is told 413 instead of `100 Continue` and an upload for nothing.
    if crate::proxy::content_length(&parts.headers).is_some_and(|length| length > limit as u64) {
        return Err(ProxyError::BodyTooLarge {
            limit: limit as u64,
        });
    }
    // A client that sends the head and then stalls its body is cut off with 408 as on a
    // forwarded request, instead of holding its connection and this task for ever.
    let client_body_timeout = policy.server.client_body_timeout;
    let body = IdleTimeout::new(body, client_body_timeout, "client");
    let body: Bytes = match collect_joined(Limited::new(body, limit)).await {
        Ok(body) => body,
        Err(error) => {
            // Over this limit, or the route's own (a body that met a refusal on its way
            // to the upstream).
            if find_cause::<http_body_util::LengthLimitError>(&*error).is_some() {
                return Err(ProxyError::BodyTooLarge {
                    limit: limit as u64,
                });
            }
            if find_cause::<BodyIdleTimeout>(&*error).is_some() {
                return Err(ProxyError::ClientBodyTimeout {
                    after: client_body_timeout,
                });
            }
            return Err(crate::proxy::unreadable_body(&*error));
        }
    };
    let job = Job::from_request(&route.name.0, &parts, &received_head, body, client_ip);
    // Writes are worth a little more patience than limit checks, but never unbounded.
    let timeout = redis.settings.timeout.max(Duration::from_millis(500));
    // A plain XADD that times out here is not cancelled: a Redis that was only frozen or slow
    // runs it later, so work the client was told was *not* stored (503, retry) got applied
    // anyway — and applied twice once the client retried (the fault tests found this with a
    // SIGSTOPped Redis). So the write carries a deadline on Redis's own clock and is
    // refused by Redis once levee may have given up. The deadline keeps half of the
    // remaining time for the reply to travel back.
    let started = tokio::time::Instant::now();
    let guard = Guard {
        key: &keys.stream,
        metrics,
    };
    // A job that waits for replicas may wait for them twice: for the batch at Redis when it
    // came (see `redis_wait`), then for its own.
    let confirming = settings.wait_replicas > 0;
    let write_timeout = if confirming {
        timeout + 2 * settings.wait_timeout
    } else {
        timeout
    };
    let (deadline_us, remaining) = redis
        .write_deadline(&keys.stream, write_timeout, Some(guard))
        .await
        .map_err(|error| not_stored(error.to_string()))?;
    let record = keys.write_record(&write_token());
    let answered = redis.answered_records.take(&keys.stream);
    // Listing the route in the script saves a call per job; a cluster refuses a script whose
    // keys lie in two slots.
    let lists_in_script = !redis.is_cluster();
    let mut command = redis::cmd("EVAL");
    command
        .arg(ENQUEUE_BEFORE)
        .arg(2 + usize::from(lists_in_script) + answered.len())
        .arg(&keys.stream)
        .arg(&record);
    if lists_in_script {
        command.arg(&keys.registry);
    }
    command
        .arg(&answered)
        .arg(deadline_us)
        .arg(WRITE_RECORD_TTL_MS)
        .arg(if lists_in_script { &*route.name.0 } else { "" });
    job.write_fields(&mut command);
    // Past the write's deadline, its wait for replicas and two calls' time to withdraw it: by
    // then this writer has withdrawn the job or stopped trying. Workers replay it only after.
    let confirm_by = confirming.then(|| {
        let after = settings.wait_timeout + 2 * timeout;
        deadline_us.saturating_add(u64::try_from(after.as_micros()).unwrap_or(u64::MAX))
    });
    if let Some(confirm_by) = confirm_by {
        command
            .arg(CONFIRM_BY_FIELD)
            .arg(confirm_by)
            .arg(CONFIRM_RECORD_FIELD)
            .arg(&record);
    }
    let (written, confirmed_by) = if confirming {
        match redis
            .command_confirmed(
                command,
                settings.wait_replicas,
                settings.wait_timeout,
                remaining,
                guard,
            )
            .await
        {
            Ok(confirmed) => (
                redis::from_redis_value::<Option<String>>(confirmed.answer)
                    .map_err(|error| RedisFailure::BadReply(error.to_string())),
                confirmed.replicas,
            ),
            Err(error) => (Err(error), 0),
        }
    } else {
        (redis.command(&command, remaining, Some(guard)).await, 0)
    };
    // A write in doubt (why, and whether it was to wait for replicas) is settled with Redis
    // below.
    let in_doubt = match written {
        Ok(Some(id)) if confirmed_by >= settings.wait_replicas => Ok(id),
        Ok(Some(id)) => {
            let short = format!(
                "{confirmed_by} of the {} replicas wait_replicas asks for confirmed the job within {:?}",
                settings.wait_replicas, settings.wait_timeout
            );
            if settings.unconfirmed == Unconfirmed::Accept {
                count_unconfirmed(metrics, route, "accepted");
                // Every job while a replica is away: one line per ten seconds says it.
                static ACCEPTED: LogThrottle = LogThrottle::new(Duration::from_secs(10));
                if let Some(held_back) = ACCEPTED.allow(std::time::Instant::now()) {
                    tracing::warn!(route = %route.name, job = %id, held_back, "job stored at the master only: {short}; answering 202 (when_unconfirmed = \"accept\")");
                }
                Ok(id)
            } else {
                Err((short, true))
            }
        }
        Ok(None) => return Err(not_stored("redis ran the write after its deadline".into())),
        // Not sent at all: nothing to settle.
        Err(
            error @ (RedisFailure::Down | RedisFailure::Overloaded(_) | RedisFailure::NotSent(_)),
        ) => return Err(not_stored(error.to_string())),
        // A full Redis (`noeviction`) refused the job's `XADD`, the write's first: nothing was
        // stored, and asking what became of the write would be refused as well.
        Err(RedisFailure::Redis(error)) if error.code() == Some("OOM") => {
            return Err(not_stored(format!(
                "redis is full (maxmemory reached, nothing evictable): {error}"
            )))
        }
        // Refused before the script ran (a cluster moving the stream's slot, a failover, a
        // Redis still loading): nothing was stored, and asking what became of the write would
        // be refused the same way (each such write logged "perhaps stored", unthrottled).
        Err(RedisFailure::Redis(error)) if was_refused_unrun(&error) => {
            return Err(not_stored(format!("redis did not run the write: {error}")))
        }
        // Sent, but its answer did not come: Redis may have run it (say the answer was slow
        // to travel back). The same connection carries the question after the write, so
        // Redis answers it after running the write, if it ever does. (A write that waits for
        // replicas has a connection of its own, but it checks the write's record before it
        // stores anything: once the question has left its mark there, it stores nothing.)
        Err(error) => Err((format!("the write's answer was lost ({error})"), confirming)),
    };
    // Its fate is settled with Redis before the client hears anything.
    let id = match in_doubt {
        Ok(id) => {
            // Answered: nobody asks this write's record any more.
            redis.answered_records.put(&keys.stream, record);
            id
        }
        Err((doubt, unconfirmed)) => {
            // With wait_replicas, no replica confirmed what follows: it is counted.
            let settled =
                settle_write(redis, &keys, &record, &settings.group, confirm_by, timeout).await;
            if unconfirmed {
                let result = match &settled {
                    Ok(None) => "withdrawn",
                    Ok(Some(_)) => "kept",
                    Err(_) => "unsettled",
                };
                count_unconfirmed(metrics, route, result);
            }
            match settled {
                Ok(Some(id)) => {
                    tracing::info!(
                        route = %route.name,
                        job = %id,
                        "{doubt}, but Redis keeps the job and a worker has it: answering 202"
                    );
                    id
                }
                Ok(None) => {
                    return Err(not_stored(format!(
                        "{doubt}; Redis holds no such job and will not store it"
                    )))
                }
                Err(settling) => {
                    // Redis may hold the job: a check queued behind the write withdraws it if
                    // it runs, but a Redis that saved the write and died before answering
                    // keeps it. Every such write while Redis fails: a line per ten seconds.
                    static PERHAPS_STORED: LogThrottle = LogThrottle::new(Duration::from_secs(10));
                    if let Some(held_back) = PERHAPS_STORED.allow(std::time::Instant::now()) {
                        tracing::warn!(
                            route = %route.name,
                            held_back,
                            "job perhaps stored, answering 503: {doubt}; what became of the \
                             write could not be checked either ({settling})"
                        );
                    }
                    return Err(ProxyError::QueueUnavailable {
                        route: route.name.to_string(),
                        unsettled: true,
                    });
                }
            }
        }
    };
    // Listed after the job is written, so an instance that starts later finds this queue even
    // if the route stops queueing meanwhile (see `QueueKeys::registry`); the script did it
    // unless this is a cluster. The job is stored already: a failure here does not change
    // the answer.
    if !lists_in_script {
        let left = timeout
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(50));
        worker::register(redis, &keys, &route.name.0, left).await;
    }
    metrics
        .queue_enqueued
        .get_or_create(&QueueLabels {
            route: route.name.to_string().into(),
        })
        .inc();
    let (template, content_type) = if wants_json {
        (
            action.body_json.as_deref().unwrap_or(DEFAULT_ACCEPTED_JSON),
            "application/json; charset=utf-8",
        )
    } else {
        (
            action.body_html.as_deref().unwrap_or(DEFAULT_ACCEPTED_HTML),
            "text/html; charset=utf-8",
        )
    };
    // The client learns the job by the key the app will see it under (hex: safe in a body and
    // a header); the stream entry id is Redis's bookkeeping, logged and listed in dead letters.
    tracing::debug!(route = %route.name, entry = %id, job = job.idempotency_key(), "job stored");
    let mut response = Response::new(full_body(template.replace("{job}", job.idempotency_key())));
    *response.status_mut() = StatusCode::ACCEPTED;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Ok(value) = HeaderValue::from_str(job.idempotency_key()) {
        response.headers_mut().insert("x-levee-job", value);
    }
    // levee's own answer: a page of a site in `cors_origins` may read it (see `proxy::cors`).
    response
        .extensions_mut()
        .insert(crate::proxy::cors::OwnAnswer);
    Ok(response)
}

/// Whether Redis refused a command before running any of it: a Redis Cluster redirecting or
/// moving the key's slot (`MOVED`, `ASK`, `TRYAGAIN`), a cluster without a quorum, keys in
/// two slots, a replica or a master cut off from its own after a failover (`READONLY`,
/// `MASTERDOWN`), a Redis still loading its data or busy with a script.
pub(crate) fn was_refused_unrun(error: &redis::RedisError) -> bool {
    matches!(
        error.code(),
        Some(
            "MOVED"
                | "ASK"
                | "TRYAGAIN"
                | "CLUSTERDOWN"
                | "CROSSSLOT"
                | "READONLY"
                | "MASTERDOWN"
                | "LOADING"
                | "BUSY"
        )
    )
}

/// A body read whole into one buffer, its small pieces copied together as they come (see
/// `BodyPieces`: kept as they came, a body sent a byte per chunk held 40 bytes per byte).
async fn collect_joined<B>(mut body: B) -> Result<Bytes, B::Error>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut pieces = crate::proxy::body::BodyPieces::default();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            pieces.push(data);
        }
    }
    Ok(crate::proxy::body::joined(&pieces.into_pieces()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answered_records_go_out_newest_first_in_bounded_takes_and_a_forgotten_stream_goes() {
        let records = AnsweredRecords::default();
        for n in 0..20 {
            records.put("jobs", format!("record-{n}"));
        }
        let first = records.take("jobs");
        assert_eq!(first.len(), RECORDS_REMOVED_PER_WRITE);
        assert_eq!(first.last().map(String::as_str), Some("record-19"));
        assert_eq!(records.take("jobs").len(), 4, "the rest");
        assert!(records.take("jobs").is_empty());
        records.put("jobs", "record-20".into());
        records.forget("jobs");
        assert!(records.take("jobs").is_empty(), "left to expire");
        assert!(
            crate::redis_batch::lock(&records.by_stream).is_empty(),
            "no entry left behind"
        );
    }
}
