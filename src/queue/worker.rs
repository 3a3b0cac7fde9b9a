//! Replay workers: every levee instance runs one loop that serves all queue routes as a member
//! of each route's consumer group.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use redis::streams::{StreamInfoConsumer, StreamInfoConsumersReply};
use tokio::sync::watch;
use tokio::time::Instant;

use super::job::{bytes_of, entries, Job};
use super::{QueueKeys, QueueSettings};
use crate::breaker::Outcome;
use crate::config::Policy;
use crate::log_throttle::LogThrottle;
use crate::metrics::{QueueLabels, QueueResultLabels};
use crate::printable::printable;
use crate::proxy::route::Route;
use crate::proxy::Shared;
use crate::redis_store::{RedisFailure, RedisStore, RedisTarget};

/// Moves due delayed jobs back into the stream. A job is due by Redis's clock (`TIME`), as
/// its due time was set ([`Pass::delay`]): with each instance's own clock, one running ahead
/// moved every instance's retries at once, and one set back held them all.
/// KEYS: delayed zset, stream. ARGV: max.
const MOVE_DUE: &str = r#"
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
for _, job_key in ipairs(due) do
  local fields = redis.call('HGETALL', job_key)
  if #fields > 0 then
    redis.call('XADD', KEYS[2], '*', unpack(fields))
  end
  redis.call('DEL', job_key)
  redis.call('ZREM', KEYS[1], job_key)
end
return #due
"#;

/// Renews this worker's hold on the entries it still holds: resets their idle time, so that
/// no other instance's XAUTOCLAIM takes them while this one is busy, and leaves alone any
/// entry another consumer holds now. Checking the holder and claiming happen in one script:
/// XCLAIM alone would take an entry from whoever holds it.
/// KEYS: stream. ARGV: group, consumer, ids. Returns the ids still held.
const RENEW_HOLD: &str = r#"
local held = {}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    held[#held + 1] = ARGV[i]
  end
end
return held
"#;

/// Hands back entries this worker holds but will not replay now (a replay the breaker or a
/// full upstream held, or levee stopping): their idle time is set to `claim_after`, so the
/// next XAUTOCLAIM (this worker's next pass, or another instance's) takes them at once,
/// where they would otherwise wait out `claim_after` with every job behind them. Entries
/// another consumer holds now are left alone, as in [`RENEW_HOLD`]. Their delivery count is
/// set to 0, which tells whoever takes them next ([`TAKE_OVER`]) that this holder did not
/// send them to the app: XREADGROUP and XAUTOCLAIM count every delivery from 1 up, and no
/// other call of levee's changes the count.
/// KEYS: stream. ARGV: group, consumer, claim_after (ms), ids. Returns how many.
const HAND_BACK: &str = r#"
local handed = 0
for i = 4, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'RETRYCOUNT', 0, 'JUSTID')
    handed = handed + 1
  end
end
return handed
"#;

/// Milliseconds by which Redis's idle time of an entry may exceed levee's own measure.
const IDLE_CLOCK_SLACK_MS: u64 = 25;

/// Hands back, as [`HAND_BACK`] does, the entries this worker was given no longer than
/// ARGV[4] ms ago: those of a pass whose answer it never got.
/// KEYS: stream. ARGV: group, consumer, claim_after (ms), within (ms), count. Returns how
/// many.
const HAND_BACK_UNANSWERED: &str = r#"
local handed = 0
for _, pending in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', ARGV[5], ARGV[2])) do
  if pending[3] <= tonumber(ARGV[4]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, pending[1], 'IDLE', ARGV[3], 'RETRYCOUNT', 0, 'JUSTID')
    handed = handed + 1
  end
end
return handed
"#;

/// Takes over up to ARGV[4] jobs whose hold was not renewed for `claim_after` (`XAUTOCLAIM`,
/// from the start of the pending list), and says whose they were: the holders are read
/// (`XPENDING … IDLE`, the same filter in the same order, so it lists every job the claim
/// takes) in the same step as the claim, which makes the new holder the only one named after.
/// KEYS: stream. ARGV: group, consumer, claim_after (ms), count. Returns the `XAUTOCLAIM`
/// reply, then for each job taken (in its order) its former holder and delivery count, flat;
/// a job the list missed (never seen) is named '' with a count of 1.
const TAKE_OVER: &str = r#"
local held_by = {}
for _, pending in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', ARGV[4])) do
  held_by[pending[1]] = {pending[2], pending[4]}
end
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0', 'COUNT', ARGV[4])
local from = {}
for _, entry in ipairs(claimed[2]) do
  if type(entry) == 'table' then
    local holder = held_by[entry[1]] or {'', 1}
    from[#from + 1] = holder[1]
    from[#from + 1] = holder[2]
  end
end
return {claimed, from}
"#;

/// Right before replaying a job that waits for replicas: whether its writer has decided
/// (Redis's clock is past the job's `confirm_by`, after which the writer no longer withdraws
/// it), checked in the same step as this worker's hold, which it renews. Going ahead, it marks
/// the write's record `decided:<id>` (if the record is still there), which bars a withdrawal
/// even should Redis's clock step back. Answers 0 (replay it), the µs left until
/// `confirm_by`, -1 (held by another worker now) or -2 (no longer in the stream: withdrawn by
/// its writer, or finished by another worker). KEYS: stream, write record. ARGV: group,
/// consumer, id, confirm_by.
pub const HOLD_WHEN_DECIDED: &str = r#"
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 0 then
  if #redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3]) == 0 then
    return -2
  end
  return -1
end
local now = redis.call('TIME')
local left = tonumber(ARGV[4]) - (tonumber(now[1]) * 1000000 + tonumber(now[2]))
if left > 0 then
  return left
end
redis.call('SET', KEYS[2], 'decided:' .. ARGV[3], 'XX', 'KEEPTTL')
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 0
"#;

/// Opening of the scripts that act on a replay's outcome: they do nothing (and answer -1)
/// unless this worker still holds the entry. ARGV: group, id, consumer, …
const IF_STILL_HELD: &str = r#"
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3]) == 0 then
  return -1
end
"#;

/// Acknowledges and deletes a finished entry. KEYS: stream. ARGV: group, id, consumer.
const FINISH: &str = r#"
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XDEL', KEYS[1], ARGV[2])
"#;

/// Removes those of the consumers named that still hold no job and are still idle over the
/// bound: `XGROUP DELCONSUMER` drops a consumer's pending entries with it, and no worker could
/// take those jobs over or finish them any more. The consumers were chosen from a list read
/// earlier; one that has read a job since holds it, and one that has read at all since is
/// alive, so each is looked at again in the same script as its removal. (`XINFO` may be called
/// in a script: Redis replicates scripts by their effects, by default since 5.0 and always
/// since 7.0, and the queue needs 6.2 for `XAUTOCLAIM`.)
/// KEYS: stream. ARGV: group, idle bound (ms), names. Returns how many were removed.
const REMOVE_IF_IDLE: &str = r#"
local named = {}
for i = 3, #ARGV do
  named[ARGV[i]] = true
end
local removed = 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do
    info[consumer[i]] = consumer[i + 1]
  end
  if named[info['name']] and info['pending'] == 0 and info['idle'] > tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    removed = removed + 1
  end
end
return removed
"#;

/// A name for this instance in the consumer groups and the fleet view: host, process id,
/// start time, and a count of the instances this process started (two in one process, as
/// in tests, or a container's pid 1 restarted in the same nanosecond, never share one).
pub(crate) fn consumer_name() -> String {
    static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let started = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!(
        "{}-{}-{:x}{:08x}-{started}",
        host.trim(),
        std::process::id(),
        since.as_secs(),
        since.subsec_nanos()
    )
}

/// `base × 2^(attempt-1)`, capped, with ±20% jitter so retries of many jobs spread out.
pub fn backoff(settings: &QueueSettings, attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(1).min(20);
    let raw = settings
        .backoff_base
        .saturating_mul(1u32 << exponent)
        .min(settings.backoff_max);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let jitter = 0.8 + 0.4 * (f64::from(nanos % 1000) / 1000.0);
    raw.mul_f64(jitter).min(settings.backoff_max)
}

/// The queue routes of a policy, with the keys of their queues.
fn queue_routes(policy: &Policy) -> Vec<(QueueKeys, Arc<Route>)> {
    policy
        .routes
        .routes
        .iter()
        .filter(|route| route.queue.is_some())
        .map(|route| {
            (
                QueueKeys::new(policy.key_prefix(), &route.name.0),
                Arc::clone(route),
            )
        })
        .collect()
}

/// The policy's route of that name, queueing or not.
fn route_named<'a>(policy: &'a Policy, name: &str) -> Option<&'a Arc<Route>> {
    policy
        .routes
        .routes
        .iter()
        .find(|route| *route.name.0 == *name)
}

/// The queues to serve in one pass: the policy's queue routes (`queueing`), then the queues
/// of routes that stopped queueing with jobs still stored (each through the route of that
/// name as it is now, or as it was when it still queued), marked `true`.
fn queues_to_serve(
    shared: &Shared,
    policy: &Policy,
    queueing: Vec<(QueueKeys, Arc<Route>)>,
) -> Vec<(QueueKeys, Arc<Route>, bool)> {
    let mut serve: Vec<(QueueKeys, Arc<Route>, bool)> = queueing
        .into_iter()
        .map(|(keys, route)| (keys, route, false))
        .collect();
    for former in shared.former_queues.list() {
        if serve
            .iter()
            .any(|(keys, _, _)| keys.stream == former.keys.stream)
        {
            // The route queues again, under the same keys.
            shared.former_queues.forget(&former.keys.stream);
            continue;
        }
        let route = route_named(policy, &former.route.name.0).map_or(former.route, Arc::clone);
        serve.push((former.keys, route, true));
    }
    serve
}

/// How often the registry of queues is read again, in passes of `poll_interval` (10 s at
/// the default 200 ms): one `SMEMBERS`, and a look at the queues it names that this instance
/// does not serve.
const REGISTRY_EVERY_PASSES: u32 = 50;

/// How long a consumer of a queue's group must have been idle to be removed: well beyond what
/// a live worker shows. A live worker reads its queues every `poll_interval`, and renews its
/// hold on the jobs it has every third of `claim_after`; each call resets its idle time. Ten
/// times the longer of the two, and at least an hour, leaves room for a slow Redis or a
/// stalled process. A live worker does pass it while its route is off or its upstream's
/// breaker is open, as it reads nothing then; removing its consumer costs nothing, as one is
/// removed only while it holds no job, and Redis makes it again on the worker's next read.
fn idle_consumer_bound(settings: &QueueSettings) -> Duration {
    settings
        .claim_after
        .max(settings.poll_interval)
        .saturating_mul(10)
        .max(Duration::from_secs(3600))
}

/// The consumers to remove from a queue's group, of those `XINFO CONSUMERS` listed: idle over
/// `idle_bound` and holding no job, other than this worker's own (`own`).
fn idle_consumers_to_remove(
    consumers: &[StreamInfoConsumer],
    own: &str,
    idle_bound: Duration,
) -> Vec<String> {
    consumers
        .iter()
        .filter(|consumer| {
            consumer.name != own
                && consumer.pending == 0
                && Duration::from_millis(consumer.idle as u64) > idle_bound
        })
        .map(|consumer| consumer.name.clone())
        .collect()
}

/// Removes the consumers of the queue's group that have been idle over `idle_bound` and hold no
/// job, other than `own`; returns how many were removed. Every levee process joins the group
/// under a name of its own ([`consumer_name`]), so each restart leaves one behind, and Redis
/// keeps them for ever. One that still holds jobs stays until another worker takes them over.
pub async fn remove_idle_consumers(
    redis: &RedisStore,
    keys: &QueueKeys,
    group: &str,
    own: &str,
    idle_bound: Duration,
) -> Result<usize, RedisFailure> {
    let mut list = redis::cmd("XINFO");
    list.arg("CONSUMERS").arg(&keys.stream).arg(group);
    let listed: StreamInfoConsumersReply =
        redis.command(&list, redis.background_bound(), None).await?;
    let names = idle_consumers_to_remove(&listed.consumers, own, idle_bound);
    if names.is_empty() {
        return Ok(0);
    }
    remove_consumers_if_idle(redis, keys, group, &names, idle_bound).await
}

/// Removes those of `names` that hold no job and have been idle over `idle_bound` in the
/// queue's group, both checked in one script with the removal ([`REMOVE_IF_IDLE`]); returns
/// how many were removed.
pub async fn remove_consumers_if_idle(
    redis: &RedisStore,
    keys: &QueueKeys,
    group: &str,
    names: &[String],
    idle_bound: Duration,
) -> Result<usize, RedisFailure> {
    let mut args = vec![
        group.as_bytes().to_vec(),
        (idle_bound.as_millis() as u64).to_string().into_bytes(),
    ];
    args.extend(names.iter().map(|name| name.as_bytes().to_vec()));
    let removed = eval(redis, REMOVE_IF_IDLE, &[&keys.stream], args).await?;
    match removed {
        redis::Value::Int(removed) => Ok(usize::try_from(removed).unwrap_or(0)),
        other => Err(RedisFailure::BadReply(format!(
            "removing idle consumers: {other:?}"
        ))),
    }
}

/// [`remove_idle_consumers`] for the worker, bounded by [`idle_consumer_bound`]. Best effort:
/// what Redis did not do is tried again on the next look.
async fn remove_consumers_left_behind(
    redis: &RedisStore,
    keys: &QueueKeys,
    settings: &QueueSettings,
    own: &str,
    route: &str,
) {
    let bound = idle_consumer_bound(settings);
    match remove_idle_consumers(redis, keys, &settings.group, own, bound).await {
        Ok(0) => {}
        Ok(removed) => tracing::info!(
            route,
            stream = %keys.stream,
            "removed {removed} consumers from the queue's consumer group, idle for over {}s \
             with no job pending (left by instances that stopped)",
            bound.as_secs()
        ),
        Err(error) => {
            tracing::debug!(
                route,
                "the queue's idle consumers could not be removed: {error}"
            )
        }
    }
}

/// Jobs read from a queue at a time (claimed from silent workers, and new ones, each).
const BATCH: usize = 20;

/// What came of one queue's batch, replayed in a task of its own: its stream, the outcome
/// (`Ok(true)`: a whole batch, more may wait), and what the next pass carries on with.
type Replayed = (String, Result<bool, RedisFailure>, Carried);

/// What a queue's passes carry from one to the next.
#[derive(Debug, Clone)]
struct Carried {
    /// When its next job may start, so that `replay_rate` holds across batches and passes.
    next_start: Instant,
    /// A pass that began then took or read jobs and got no answer from Redis: Redis may
    /// have given them to this worker all the same (its answer lost in a stall). The next
    /// pass hands back what this worker was given since then, which it never sent; held,
    /// such a job waited out `claim_after` and was then said perhaps sent twice.
    unanswered_since: Option<Instant>,
    /// Jobs of a batch Redis failed in the middle of that were not sent to the app: handed
    /// back by the next pass that reaches Redis.
    unsent: Vec<String>,
}

impl Carried {
    fn new() -> Carried {
        Carried {
            next_start: Instant::now(),
            unanswered_since: None,
            unsent: Vec::new(),
        }
    }
}

/// The batches being replayed, and the stream of each task.
#[derive(Default)]
struct Replays {
    tasks: tokio::task::JoinSet<Replayed>,
    streams: HashMap<tokio::task::Id, String>,
}

impl Replays {
    fn running(&self, stream: &str) -> bool {
        self.streams.values().any(|running| running == stream)
    }

    /// Waits for every batch in flight to end (each stops starting jobs once `stop` is set).
    async fn finish(&mut self) {
        while self.tasks.join_next().await.is_some() {}
        self.streams.clear();
    }
}

/// The worker loop's own record of the queues it serves, kept up to date as batches end.
struct Served {
    groups_made: HashSet<String>,
    /// Per queue (stream key): its jobs as the last pass counted them while its group was
    /// there, for telling how many went with a group that disappeared.
    counted: HashMap<String, JobCount>,
    /// Per queue (stream key): what its next pass carries on with (see [`Carried`]).
    carried: HashMap<String, Carried>,
    /// A route replayed a whole batch: a backlog is draining, and the next pass follows at
    /// once rather than after `poll_interval`.
    backlog: bool,
    /// The Redis servers the groups made and jobs counted above are on: a reload that points
    /// `[redis]` elsewhere leaves them behind.
    on: Option<RedisTarget>,
}

impl Served {
    /// Takes note of the Redis servers this pass reads queues from. When a reload pointed
    /// `[redis]` at other servers, what was known of the former ones is dropped (their groups
    /// would be taken for gone, and said lost), and the jobs counted there are said to stay
    /// there: this instance no longer replays them. Returns whether the servers changed.
    fn read_from(&mut self, target: &RedisTarget) -> bool {
        // Every pass asks: the same target as a rule, told at once.
        if self.on.as_ref() == Some(target) {
            return false;
        }
        let before = self.on.replace(target.clone());
        if before
            .as_ref()
            .is_none_or(|before| before.same_servers(target))
        {
            return false;
        }
        self.groups_made.clear();
        for (stream, count) in self.counted.drain() {
            let jobs = count.stream + count.delayed;
            if jobs == 0 {
                continue;
            }
            let jobs = crate::config::units::counted(jobs, "job");
            tracing::warn!(%stream, "[redis] now names other servers: the {jobs} stored in this queue at the former ones when levee last counted, {} before, stay there and are not replayed by this instance (keep an instance with the former [redis] running until its queues are empty, or move the keys)", crate::config::units::Shown(count.at.elapsed()));
        }
        tracing::info!("queues are now read from the redis that [redis] names since the reload");
        true
    }

    fn settle(
        &mut self,
        replays: &mut Replays,
        ended: Result<(tokio::task::Id, Replayed), tokio::task::JoinError>,
    ) {
        let (stream, result, carried) = match ended {
            Ok((id, replayed)) => {
                replays.streams.remove(&id);
                replayed
            }
            Err(error) => {
                let stream = replays.streams.remove(&error.id()).unwrap_or_default();
                tracing::error!(%stream, "a queue's replay task ended abnormally; it starts again on the next pass: {error}");
                return;
            }
        };
        self.carried.insert(stream.clone(), carried);
        match result {
            Ok(more) => self.backlog |= more,
            // The group went away between the pass's count and the batch's calls.
            Err(error) if is_no_group(&error) => self.group_gone(&stream, None, &error),
            Err(error) => {
                tracing::debug!(%stream, "replay paused: {error}");
            }
        }
    }

    /// The queue's consumer group is gone from Redis: the stream went away (a Redis restarted
    /// without persistence, a `FLUSHALL`, an evicted key, a failover to a replica that did not
    /// have it yet), and the next XADD may have made it again without the group. Says so, with
    /// how many jobs went with it as far as levee knows (`now`: the count that found the group
    /// gone, if one did), and has the group made again on the next pass, or the jobs stored
    /// since would never run.
    fn group_gone(&mut self, stream: &str, now: Option<&JobCount>, error: &dyn std::fmt::Display) {
        self.groups_made.remove(stream);
        let before = self.counted.remove(stream);
        let lost = lost_jobs(before.as_ref(), now, Instant::now());
        // An error only when jobs are known lost: after a Redis restart every queue route finds
        // its group gone, and an alert on errors fired for routes that had nothing queued.
        let said = format!("the queue's consumer group is gone from redis (restarted without persistence, flushed, its keys evicted, or a replica's full resync from an empty master): {lost}; jobs stored since are replayed once the group is made again ({error})");
        if before.as_ref().is_some_and(|count| count.stream == 0) {
            tracing::warn!(%stream, "{said}");
        } else {
            tracing::error!(%stream, "{said}");
        }
    }
}

/// What a queue's group took with it when it went, from the last count made while it was
/// there (`before`) and the one that found it gone (`now`, if a count did), said as levee
/// knows it: about, as jobs may have been finished or stored between that count and the loss.
fn lost_jobs(before: Option<&JobCount>, now: Option<&JobCount>, at: Instant) -> String {
    let Some(before) = before else {
        return "the jobs its stream held when it went are lost; how many levee cannot say (it \
                had not counted them since it started or last found the group gone)"
            .into();
    };
    let ago = at.saturating_duration_since(before.at);
    let mut lost = if before.stream == 0 {
        format!(
            "its stream held no job when levee last counted, {ago:.1?} before, so none is \
             known lost (only jobs stored after that count, if any)"
        )
    } else {
        let read = before.pending.map_or(String::new(), |read| {
            format!(" ({read} of them read by a worker)")
        });
        format!(
            "about {jobs} lost with it: its stream held {held}{read} when levee last counted \
             (each instance that notices says its own count: one loss), {ago:.1?} before \
             (fewer if workers finished some since, more if some were stored since)",
            jobs = crate::config::units::counted(before.stream, "job"),
            held = before.stream
        )
    };
    // Retries wait in a set of their own, which a restart without persistence empties too,
    // while a stream deleted or evicted alone leaves it.
    match now {
        Some(now) if now.delayed < before.delayed => lost.push_str(&format!(
            ", and up to {} of the {} jobs that waited for a retry are gone too",
            before.delayed - now.delayed,
            before.delayed
        )),
        Some(_) => {}
        None if before.delayed > 0 => lost.push_str(&format!(
            "; {} more waited for a retry then (lost too if redis lost its data: /queues \
             shows `delayed`)",
            before.delayed
        )),
        None => {}
    }
    lost
}

/// Starts the replay loop; it lasts until `stop`. A job whose replay has begun is finished
/// (and acknowledged, or retried, or dead-lettered) first: the task ends after it, so a
/// shutdown that waits for the task never cuts a replay off halfway, which the app may still
/// complete and another worker would then replay again. Each queue's batch is replayed in a
/// task of its own: one whose upstream hangs (each job waiting out `response_timeout` until
/// the breaker opens) no longer holds every other route's replays, and the passes that move
/// due retries back, for as long.
pub fn spawn_workers(
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let consumer = shared.instance.clone();
        // The queue routes of the last pass: one gone from the policy since leaves its queue
        // to `former_queues`, so the jobs stored in it are not stranded.
        let mut served_before: Vec<(QueueKeys, Arc<Route>)> = Vec::new();
        // Passes until the registry is read again (0: this pass). It names the queues every
        // instance stored jobs in: one left by a route that stopped queueing while no
        // instance ran, or by an instance of another policy (during a rolling deploy, an old
        // instance still queueing for a route this one does not) is taken on from there.
        let mut registry_in: u32 = 0;
        let mut registry_read_once = false;
        let mut served = Served {
            groups_made: HashSet::new(),
            counted: HashMap::new(),
            carried: HashMap::new(),
            backlog: false,
            on: None,
        };
        // Per queue: its batch being replayed; the queue is left alone by the passes until
        // it ends.
        let mut replays = Replays::default();
        let poll_interval = |policy: &Policy| {
            policy
                .queue
                .as_ref()
                .map_or(Duration::from_secs(1), |q| q.poll_interval)
        };
        // When the next pass is due. A batch ending meanwhile does not push it back; one that
        // ends with more to do brings it forward.
        let mut next_pass = Instant::now() + poll_interval(&shared.store.load());
        loop {
            while let Some(ended) = replays.tasks.try_join_next_with_id() {
                served.settle(&mut replays, ended);
            }
            if std::mem::take(&mut served.backlog) {
                if *stop.borrow() {
                    replays.finish().await;
                    return;
                }
            } else {
                let stopping = tokio::select! {
                    _ = tokio::time::sleep_until(next_pass) => false,
                    Some(ended) = replays.tasks.join_next_with_id(), if !replays.tasks.is_empty() => {
                        served.settle(&mut replays, ended);
                        continue;
                    }
                    _ = stop.wait_for(|stopped| *stopped) => true,
                };
                if stopping {
                    replays.finish().await;
                    return;
                }
            }
            next_pass = Instant::now() + poll_interval(&shared.store.load());
            let policy = shared.store.load();
            let queueing = queue_routes(&policy);
            for (keys, route) in std::mem::replace(&mut served_before, queueing.clone()) {
                if !queueing.iter().any(|(now, _)| now.stream == keys.stream)
                    && shared.former_queues.adopt(keys.clone(), Arc::clone(&route))
                {
                    if policy.redis.is_some() {
                        tracing::warn!(route = %route.name, stream = %keys.stream, "this route no longer queues under these keys (its action changed, or it was renamed or removed, or key_prefix changed); the jobs stored in its queue are still replayed until it is empty");
                    } else {
                        no_redis_for_stored_jobs(
                            &route.name.0,
                            &keys.stream,
                            served.counted.get(&keys.stream),
                        );
                    }
                }
            }
            let (Some(redis), Some(settings)) = (policy.redis.clone(), policy.queue.clone()) else {
                // No queue can be read now (a reload took `[redis]` or `[queue]` out): no
                // figure left at its last value.
                shared.metrics.queue_backlog.clear();
                shared.metrics.queue_oldest_age.clear();
                continue;
            };
            // Consumers that stopped instances left in the groups are looked for on the passes
            // that read the registry, when Redis answered that read: rare work, and none while
            // Redis is down.
            let mut look_for_consumers_left = false;
            if served.read_from(&redis.settings.target) {
                // The registry of queues to take on is the new servers' own.
                registry_in = 0;
            }
            registry_in = match registry_in.checked_sub(1) {
                Some(left) => left,
                None => {
                    let read = take_on_stranded_queues(
                        &shared,
                        &redis,
                        &policy,
                        &queueing,
                        !registry_read_once,
                    )
                    .await;
                    registry_read_once |= read;
                    look_for_consumers_left = read;
                    // Tried again on the next pass when Redis did not answer.
                    if read {
                        REGISTRY_EVERY_PASSES
                    } else {
                        0
                    }
                }
            };
            route_unrouted_queues(&shared, &redis, &policy, &queueing).await;
            for (keys, route, former) in queues_to_serve(&shared, &policy, queueing) {
                if *stop.borrow() {
                    replays.finish().await;
                    return;
                }
                if replays.running(&keys.stream) {
                    continue;
                }
                // Its gauges' label (a former queue's may be its stream key).
                let shown = super::shown_name(&policy, &keys, &route.name.0);
                if former && queue_is_empty(&redis, &keys).await {
                    tracing::info!(route = %route.name, stream = %keys.stream, "the queue of a route that stopped queueing is empty; forgetting it");
                    shared.former_queues.forget(&keys.stream);
                    redis.answered_records.forget(&keys.stream);
                    served.counted.remove(&keys.stream);
                    forget_backlog(&shared, &shown);
                    unregister(&redis, &keys, &route.name.0).await;
                    continue;
                }
                let route = &route;
                if !served.groups_made.contains(&keys.stream) {
                    match make_group(&redis, &keys, &settings).await {
                        Ok(()) => {
                            served.groups_made.insert(keys.stream.clone());
                        }
                        Err(error) => {
                            tracing::debug!(route = %route.name, "queue not reachable: {error}");
                            forget_backlog(&shared, &shown);
                            continue;
                        }
                    }
                }
                match report_backlog(&shared, &redis, &keys, &settings.group, &shown).await {
                    Some(count) if count.pending.is_none() => {
                        served.group_gone(&keys.stream, Some(&count), &"XPENDING answered NOGROUP");
                        continue;
                    }
                    Some(count) => {
                        served.counted.insert(keys.stream.clone(), count);
                    }
                    None => {}
                }
                // Every pass, former queues included (they are not empty here): listed again
                // should anything have taken the name off while jobs are stored.
                register(&redis, &keys, &route.name.0, redis.background_bound()).await;
                if look_for_consumers_left {
                    remove_consumers_left_behind(
                        &redis,
                        &keys,
                        &settings,
                        &consumer,
                        &route.name.0,
                    )
                    .await;
                }
                // Paused while the route is off, its dependency's breaker would refuse a call
                // (open, or half-open with its probes out), or its upstream has no slot free
                // for the route's tier (`max_inflight`): no batch is taken that would wait
                // (and be handed back, pass after pass); resumes by itself.
                if shared.degrade.view(&policy).route_off(route)
                    || !route.upstream.breaker.would_admit(Instant::now())
                    || route
                        .upstream
                        .bulkhead
                        .as_ref()
                        .is_some_and(|bulkhead| !bulkhead.has_free(route.tier))
                {
                    continue;
                }
                let mut carried = served
                    .carried
                    .remove(&keys.stream)
                    .unwrap_or_else(Carried::new);
                let (shared, redis, settings) = (shared.clone(), redis.clone(), settings.clone());
                let (route, consumer) = (route.clone(), consumer.clone());
                let (stream, keys, mut stop) = (keys.stream.clone(), keys, stop.clone());
                let replaying = replays.tasks.spawn(async move {
                    let pass = Pass {
                        shared: &shared,
                        redis: &redis,
                        settings: &settings,
                        keys: &keys,
                        route: &route,
                        consumer: &consumer,
                    };
                    let result = pass.replay_route(&mut stop, &mut carried).await;
                    (keys.stream.clone(), result, carried)
                });
                replays.streams.insert(replaying.id(), stream);
            }
        }
    })
}

/// Takes on the queues listed in the registry whose routes do not queue here (the policy
/// changed while no instance ran, or another instance runs another policy), so the jobs in
/// them are still replayed. `false` when Redis did not answer (the next pass tries again).
/// `forget_empty` (the first read): empty queues are taken off the registry. Not on later
/// reads: another instance that still queues for the route may be storing a job in it right
/// then, and would list it again only after the job was stored.
async fn take_on_stranded_queues(
    shared: &Shared,
    redis: &RedisStore,
    policy: &Policy,
    queueing: &[(QueueKeys, Arc<Route>)],
    forget_empty: bool,
) -> bool {
    let registry = QueueKeys::registry_of(policy.key_prefix());
    let mut members = redis::cmd("SMEMBERS");
    members.arg(&registry);
    let names: Vec<String> = match redis
        .command(&members, redis.background_bound(), None)
        .await
    {
        Ok(names) => names,
        Err(error) => {
            tracing::debug!("the list of queue routes in redis could not be read: {error}");
            return false;
        }
    };
    for name in names {
        let keys = QueueKeys::new(policy.key_prefix(), &name);
        if queueing.iter().any(|(now, _)| now.stream == keys.stream) {
            continue;
        }
        if queue_is_empty(redis, &keys).await {
            if forget_empty {
                unregister(redis, &keys, &name).await;
            }
            continue;
        }
        match route_named(policy, &name) {
            Some(route) => {
                if shared.former_queues.adopt(keys.clone(), Arc::clone(route)) {
                    tracing::warn!(route = %name, stream = %keys.stream, "found jobs stored while this route still queued (it no longer does); replaying them through the route until the queue is empty");
                }
            }
            None => {
                if shared.former_queues.hold_unrouted(&name, keys.clone()) {
                    tracing::warn!(route = %crate::printable::printable(&name), stream = %crate::printable::printable(&keys.stream), "found jobs stored for a route the policy no longer has; they stay in redis and are replayed once a route of that name is back (GET /queues lists them)");
                }
            }
        }
    }
    true
}

/// Takes on the unrouted queues whose route the policy has again, and forgets those that
/// were emptied (dead letters dropped through the admin API).
async fn route_unrouted_queues(
    shared: &Shared,
    redis: &RedisStore,
    policy: &Policy,
    queueing: &[(QueueKeys, Arc<Route>)],
) {
    for (name, keys) in shared.former_queues.unrouted() {
        if queueing.iter().any(|(now, _)| now.stream == keys.stream) {
            // The route is back and queues under the same keys: served as any queue route.
            shared.former_queues.forget_unrouted(&name);
            continue;
        }
        if let Some(route) = route_named(policy, &name) {
            shared.former_queues.forget_unrouted(&name);
            if shared.former_queues.adopt(keys.clone(), Arc::clone(route)) {
                tracing::info!(route = %name, stream = %keys.stream, "a route of this name is back: replaying the jobs stored for it");
            }
            continue;
        }
        if queue_is_empty(redis, &keys).await {
            shared.former_queues.forget_unrouted(&name);
            unregister(redis, &keys, &name).await;
        }
    }
}

/// Lists the route in the registry (see [`QueueKeys::registry`]), after a job is stored and on
/// every replay pass. Best effort: should it fail, the next pass lists it.
pub(super) async fn register(redis: &RedisStore, keys: &QueueKeys, route: &str, bound: Duration) {
    registry_change(redis, "SADD", keys, route, bound).await;
}

/// Takes a route whose queue was found empty off the registry. A job may be stored between
/// that look and the removal (another instance still queueing on the route): the queue is
/// looked at again after, and the name listed again unless it is still empty. Since storing a
/// job lists the name after the job is written, the name is listed whenever a job is stored.
async fn unregister(redis: &RedisStore, keys: &QueueKeys, route: &str) {
    if registry_change(redis, "SREM", keys, route, redis.background_bound()).await
        && !queue_is_empty(redis, keys).await
    {
        register(redis, keys, route, redis.background_bound()).await;
    }
}

/// `SADD` or `SREM` of the route's name in the registry; `false` (logged) when Redis did not
/// answer.
async fn registry_change(
    redis: &RedisStore,
    command: &str,
    keys: &QueueKeys,
    route: &str,
    bound: Duration,
) -> bool {
    let mut change = redis::cmd(command);
    change.arg(&keys.registry).arg(route);
    match redis.command::<i64>(&change, bound, None).await {
        Ok(_) => true,
        Err(error) => {
            tracing::debug!(
                route,
                "{command} of the queue route in redis failed: {error}"
            );
            false
        }
    }
}

/// Is the queue empty: no job in its stream, none waiting for a retry, no dead letter? Only
/// a Redis that answers all three can say so.
async fn queue_is_empty(redis: &RedisStore, keys: &QueueKeys) -> bool {
    let mut total = 0;
    for (command, key) in [
        ("XLEN", &keys.stream),
        ("ZCARD", &keys.delayed),
        ("XLEN", &keys.dead),
    ] {
        let mut count = redis::cmd(command);
        count.arg(key);
        match redis
            .command::<i64>(&count, redis.background_bound(), None)
            .await
        {
            Ok(found) => total += found,
            Err(_) => return false,
        }
    }
    total == 0
}

async fn make_group(
    redis: &RedisStore,
    keys: &QueueKeys,
    settings: &QueueSettings,
) -> Result<(), RedisFailure> {
    let mut command = redis::cmd("XGROUP");
    command
        .arg("CREATE")
        .arg(&keys.stream)
        .arg(&settings.group)
        .arg("0")
        .arg("MKSTREAM");
    match redis
        .command::<()>(&command, redis.background_bound(), None)
        .await
    {
        Ok(()) => Ok(()),
        Err(RedisFailure::Redis(error)) if error.to_string().contains("BUSYGROUP") => Ok(()),
        Err(error) => Err(error),
    }
}

/// Redis's answer to a group command on a stream without that group (or without the stream).
fn is_no_group(error: &RedisFailure) -> bool {
    matches!(error, RedisFailure::Redis(error) if error.code() == Some("NOGROUP"))
}

/// A queue's jobs, counted in one step (see [`COUNT_JOBS`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct JobCount {
    /// In the stream: waiting, or read by a worker and not finished.
    stream: u64,
    /// Waiting for a retry (the delayed set).
    delayed: u64,
    /// Of those in the stream, the ones read by a worker and not finished; `None` when the
    /// consumer group is gone.
    pending: Option<u64>,
    /// When they were counted.
    at: Instant,
}

/// Counts a queue's jobs: in its stream, waiting for a retry, and read by a worker (the
/// group's pending count, -1 when the group is gone). KEYS: stream, delayed set. ARGV: group.
const COUNT_JOBS: &str = r#"
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if type(pending) == 'table' and pending.err then
  if string.sub(pending.err, 1, 8) ~= 'NOGROUP ' then
    return pending
  end
  pending = -1
else
  pending = pending[1]
end
return {redis.call('XLEN', KEYS[1]), redis.call('ZCARD', KEYS[2]), pending}
"#;

/// Says what becomes of a queue's jobs when a reload takes `[redis]` out: they wait there,
/// unreplayed, until `[redis]` is back. A warning only when jobs were there at the last count
/// (or it is not known): an empty queue was warned of as one holding jobs, which sent
/// operators looking for work that was not lost.
fn no_redis_for_stored_jobs(route: &str, stream: &str, last_count: Option<&JobCount>) {
    match last_count {
        Some(count) if count.stream + count.delayed == 0 => {
            tracing::info!(route = %route, stream = %stream, "the policy no longer has [redis]; this route's queue held no job when levee last counted, {} before (jobs other instances store there wait in redis until a policy with [redis] is loaded again)", crate::config::units::Shown(count.at.elapsed()));
        }
        Some(count) => {
            let jobs = crate::config::units::counted(count.stream + count.delayed, "job");
            tracing::warn!(route = %route, stream = %stream, "the policy no longer has [redis]: the {jobs} stored in this route's queue when levee last counted, {} before, wait in redis, not replayed, until a policy with [redis] is loaded again", crate::config::units::Shown(count.at.elapsed()));
        }
        None => {
            tracing::warn!(route = %route, stream = %stream, "the policy no longer has [redis]: the jobs stored in this route's queue (not counted since levee started) wait in redis, not replayed, until a policy with [redis] is loaded again");
        }
    }
}

/// Counts a queue's jobs and sets its gauges from the count; a figure Redis did not give is
/// taken out of the metrics rather than left at its last value (a backlog frozen while Redis
/// is down read as a queue that was fine, and an alert on the oldest job's age could not
/// fire): a monitor sees that it cannot tell, as `/queues` says with its 503. `None` when
/// Redis gave no count.
async fn report_backlog(
    shared: &Shared,
    redis: &RedisStore,
    keys: &QueueKeys,
    group: &str,
    route: &str,
) -> Option<JobCount> {
    let labels = QueueLabels {
        route: route.to_string().into(),
    };
    let mut count = redis::cmd("EVAL");
    count
        .arg(COUNT_JOBS)
        .arg(2)
        .arg(&keys.stream)
        .arg(&keys.delayed)
        .arg(group);
    let count = match redis
        .command::<(u64, u64, i64)>(&count, redis.background_bound(), None)
        .await
    {
        Ok((stream, delayed, pending)) => Some(JobCount {
            stream,
            delayed,
            pending: u64::try_from(pending).ok(),
            at: Instant::now(),
        }),
        Err(error) => {
            tracing::debug!(route, "the queue's jobs could not be counted: {error}");
            None
        }
    };
    let age = oldest_job_age(redis, keys).await;
    let metrics = &shared.metrics;
    if let Some(count) = &count {
        let backlog = i64::try_from(count.stream + count.delayed).unwrap_or(i64::MAX);
        metrics.queue_backlog.get_or_create(&labels).set(backlog);
    } else {
        metrics.queue_backlog.remove(&labels);
    }
    if let Some(age) = age {
        metrics
            .queue_oldest_age
            .get_or_create(&labels)
            .set(age as i64);
    } else {
        metrics.queue_oldest_age.remove(&labels);
    }
    count
}

/// Takes a queue's gauges out of the metrics: its route no longer queues, or Redis cannot
/// be read for it.
fn forget_backlog(shared: &Shared, route: &str) {
    let labels = QueueLabels {
        route: route.to_string().into(),
    };
    shared.metrics.queue_backlog.remove(&labels);
    shared.metrics.queue_oldest_age.remove(&labels);
}

/// How long ago (ms, by Redis's clock) the oldest waiting job was first stored: its `at`
/// field, which a retry keeps (a retry waits for its time in the delayed set, where the
/// stream's first entry id never shows it, then goes back into the stream under a new entry
/// id). Looks at the stream's first entry and the first 100 of the delayed set (which is in
/// due order): a due retry behind newer jobs in the stream is not seen, so with one the
/// figure is an estimate. Only the first entry: it is read whole, body included, and 100 of
/// them were up to 100 bodies of `max_body` copied inside Redis on every pass (five a second)
/// and every `/queues`. The age is taken against Redis's `TIME`, the clock `at` is written
/// from ([`super::ENQUEUE_BEFORE`]): against the asking instance's own clock, the same fresh
/// job read 300 s old on an instance 5 minutes ahead and 0 on one behind. 0 when nothing
/// waits, and for a job stored "later" than now (an `at` an earlier version wrote from a
/// clock that ran ahead). KEYS: stream, delayed zset.
const OLDEST_JOB_AGE: &str = r#"
local oldest = 0
local function take(at)
  at = tonumber(at)
  if at and at > 0 and (oldest == 0 or at < oldest) then oldest = at end
end
for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)) do
  local fields = entry[2]
  local found = false
  for i = 1, #fields, 2 do
    if fields[i] == 'at' then take(fields[i + 1]); found = true end
  end
  if not found then take(string.match(entry[1], '^(%d+)')) end
end
for _, job_key in ipairs(redis.call('ZRANGE', KEYS[2], 0, 99)) do
  take(redis.call('HGET', job_key, 'at'))
end
if oldest == 0 then
  return 0
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
return math.max(now_ms - oldest, 0)
"#;

/// Seconds since the oldest waiting job (retries included) was stored, by Redis's clock; 0
/// when none waits.
async fn oldest_job_age(redis: &RedisStore, keys: &QueueKeys) -> Option<u64> {
    let mut oldest = redis::cmd("EVAL");
    oldest
        .arg(OLDEST_JOB_AGE)
        .arg(2)
        .arg(&keys.stream)
        .arg(&keys.delayed);
    let age_ms: u64 = redis
        .command(&oldest, redis.background_bound(), None)
        .await
        .ok()?;
    Some(age_ms / 1000)
}

/// One worker's pass over one queue route: what its replays and their outcomes act on.
struct Pass<'a> {
    shared: &'a Shared,
    redis: &'a RedisStore,
    settings: &'a QueueSettings,
    keys: &'a QueueKeys,
    route: &'a Route,
    /// This worker's name in the consumer group: the holder of the jobs it reads.
    consumer: &'a str,
}

impl Pass<'_> {
    /// Replays one batch of the route's jobs. `Ok(true)`: a whole batch was replayed, so
    /// more may be waiting and the next pass should not wait `poll_interval`.
    async fn replay_route(
        &self,
        stop: &mut watch::Receiver<bool>,
        carried: &mut Carried,
    ) -> Result<bool, RedisFailure> {
        let Pass {
            redis,
            settings,
            keys,
            route,
            ..
        } = *self;
        let mut move_due = redis::cmd("EVAL");
        move_due
            .arg(MOVE_DUE)
            .arg(2)
            .arg(&keys.delayed)
            .arg(&keys.stream)
            .arg(100);
        let _: i64 = redis
            .command(&move_due, redis.background_bound(), None)
            .await?;
        if let Some(since) = carried.unanswered_since {
            self.hand_back_unanswered(since).await?;
            carried.unanswered_since = None;
        }
        if !carried.unsent.is_empty() {
            self.hand_back(std::mem::take(&mut carried.unsent)).await;
        }

        let batch = self.take_batch(&mut carried.unanswered_since).await?;
        if batch.is_empty() {
            return Ok(false);
        }
        let full = batch.len() >= BATCH;
        let next_start = &mut carried.next_start;
        // The batch is replayed one job after another, each for up to the upstream's
        // response_timeout: the jobs still waiting, and the one being replayed, would sit idle
        // longer than claim_after, and another instance would take them over and replay them a
        // second time. So the hold on all of them is renewed every third of claim_after until
        // the batch is done; only a worker that died, stopped or lost Redis for claim_after
        // loses its jobs.
        let ids: Vec<String> = batch.iter().map(|(id, _)| id.clone()).collect();
        let renew_every = (settings.claim_after / 3).max(Duration::from_millis(10));
        let keep_hold = async {
            loop {
                tokio::time::sleep(renew_every).await;
                if let Err(error) = self.renew_hold(&ids).await {
                    tracing::debug!(route = %route.name, "cannot renew the hold on queued jobs: {error}");
                }
            }
        };
        tokio::select! {
            result = self.replay_batch(stop, batch, next_start, &mut carried.unsent) => {
                // Handed back once the hold is no longer renewed: a renewal in flight would
                // set their idle time back to nothing.
                let (all_done, left) = result?;
                self.hand_back(left).await;
                Ok(all_done && full)
            }
            _ = keep_hold => Ok(false),
        }
    }

    /// Takes a batch: jobs of workers that went silent first (their hold not renewed for
    /// `claim_after`, or handed back), then new ones. Should the read of new ones get no
    /// answer, `unanswered_since` says since when (see [`Carried::unanswered_since`]).
    async fn take_batch(
        &self,
        unanswered_since: &mut Option<Instant>,
    ) -> Result<Vec<(String, HashMap<String, Vec<u8>>)>, RedisFailure> {
        let Pass {
            redis,
            settings,
            keys,
            consumer,
            ..
        } = *self;
        let mut claim = redis::cmd("EVAL");
        claim
            .arg(TAKE_OVER)
            .arg(1)
            .arg(&keys.stream)
            .arg(&settings.group)
            .arg(consumer)
            .arg(settings.claim_after.as_millis() as u64)
            .arg(BATCH);
        let taken: redis::Value = redis
            .command(&claim, redis.background_bound(), None)
            .await?;
        let (claimed, holders) = match &taken {
            redis::Value::Array(parts) if parts.len() == 2 => (&parts[0], &parts[1]),
            other => {
                return Err(RedisFailure::BadReply(format!(
                    "taking over queued jobs: {other:?}"
                )))
            }
        };
        let mut batch = match claimed {
            redis::Value::Array(parts) if parts.len() >= 2 => entries(&parts[1]),
            _ => Vec::new(),
        };
        self.tell_takeover(&TakenOver::from_holders(holders));
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP")
            .arg(&settings.group)
            .arg(consumer)
            .arg("COUNT")
            .arg(BATCH)
            .arg("STREAMS")
            .arg(&keys.stream)
            .arg(">");
        let reading_since = Instant::now();
        let fresh: redis::Value = redis
            .command(&read, redis.background_bound(), None)
            .await
            .inspect_err(|_| *unanswered_since = Some(reading_since))?;
        if let redis::Value::Array(streams) = &fresh {
            for stream in streams {
                if let redis::Value::Array(pair) = stream {
                    if let Some(items) = pair.get(1) {
                        batch.extend(entries(items));
                    }
                }
            }
        }
        Ok(batch)
    }

    /// Hands back the jobs Redis gave this worker since `since`, in a pass whose answer it
    /// never got: they were not sent to the app (see [`Carried::unanswered_since`]).
    async fn hand_back_unanswered(&self, since: Instant) -> Result<(), RedisFailure> {
        // Given since then: idle no longer than that (and a few milliseconds, as Redis
        // counts idle time by its own clock's milliseconds). Jobs of an earlier batch cut
        // short were last renewed before, and keep waiting `claim_after` (one may have been
        // sent).
        let within_ms = u64::try_from(since.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(IDLE_CLOCK_SLACK_MS);
        let mut command = redis::cmd("EVAL");
        command
            .arg(HAND_BACK_UNANSWERED)
            .arg(1)
            .arg(&self.keys.stream)
            .arg(&self.settings.group)
            .arg(self.consumer)
            .arg(self.settings.claim_after.as_millis() as u64)
            .arg(within_ms)
            .arg(2 * BATCH);
        let handed: i64 = self
            .redis
            .command(&command, self.redis.background_bound(), None)
            .await?;
        if handed > 0 {
            tracing::debug!(route = %self.route.name, handed, "handed back queued jobs Redis gave this worker in a pass it got no answer for");
        }
        Ok(())
    }

    /// Renews the hold on the job `id` right before its replay. A job that waits for replicas
    /// (it has a `confirm_by`) is held back until its writer has decided (see
    /// [`HOLD_WHEN_DECIDED`]): its replay waits a second or so after it was stored.
    async fn hold_when_decided(
        &self,
        stop: &watch::Receiver<bool>,
        id: &str,
        fields: &HashMap<String, Vec<u8>>,
    ) -> Result<Hold, RedisFailure> {
        let text = |name: &str| {
            fields
                .get(name)
                .and_then(|value| std::str::from_utf8(value).ok())
        };
        let confirm_by = text(super::CONFIRM_BY_FIELD).and_then(|value| value.parse::<u64>().ok());
        let record = text(super::CONFIRM_RECORD_FIELD);
        let (Some(confirm_by), Some(record)) = (confirm_by, record) else {
            let held = !self.renew_hold(&[id.to_string()]).await?.is_empty();
            return Ok(if held { Hold::Held } else { Hold::Lost });
        };
        loop {
            let mut command = redis::cmd("EVAL");
            command
                .arg(HOLD_WHEN_DECIDED)
                .arg(2)
                .arg(&self.keys.stream)
                .arg(record)
                .arg(&self.settings.group)
                .arg(self.consumer)
                .arg(id)
                .arg(confirm_by);
            let left: i64 = self
                .redis
                .command(&command, self.redis.background_bound(), None)
                .await?;
            match left {
                0 => return Ok(Hold::Held),
                -2 => return Ok(Hold::Gone),
                left if left < 0 => return Ok(Hold::Lost),
                left => {
                    // `confirm_by` is a second or two after the write; a clock far off on
                    // one side is not waited out in one sleep.
                    let micros = u64::try_from(left).unwrap_or(0).min(1_000_000);
                    let mut stopping = stop.clone();
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_micros(micros)) => {}
                        _ = stopping.wait_for(|stopped| *stopped) => return Ok(Hold::Stopped),
                    }
                }
            }
        }
    }

    /// Says what taking over `taken` means, once for the batch. Jobs a worker kept without
    /// renewing its hold may have reached the app there (its replay was in flight when it
    /// went): a warning, counted. Jobs handed back unsent by another worker (it stopped, or
    /// its replays were held) are only noted; those this worker handed back itself, not at all.
    fn tell_takeover(&self, taken: &TakenOver) {
        let route = &self.route.name;
        let abandoned: u64 = taken.abandoned.iter().map(|(_, jobs)| jobs).sum();
        if abandoned > 0 {
            self.shared
                .metrics
                .queue_taken_over
                .get_or_create(&QueueLabels {
                    route: route.to_string().into(),
                })
                .inc_by(abandoned);
            let from = holders_text(&taken.abandoned, self.consumer);
            let jobs = if abandoned == 1 { "job" } else { "jobs" };
            tracing::warn!(
                route = %route,
                jobs = abandoned,
                "took over {abandoned} queued {jobs} from {from}: the hold on them had not been \
                 renewed for claim_after ({:?}), as when an instance dies, hangs or loses Redis \
                 in the middle of a batch. They are replayed here; one their worker had already \
                 sent to the app (as a rule at most one per worker: the job it was replaying \
                 then) reaches the app a second time, with the same Idempotency-Key",
                self.settings.claim_after
            );
        }
        let handed_back: Vec<(String, u64)> = taken
            .handed_back
            .iter()
            .filter(|(holder, _)| holder != self.consumer)
            .cloned()
            .collect();
        if !handed_back.is_empty() {
            let jobs: u64 = handed_back.iter().map(|(_, jobs)| jobs).sum();
            let from = holders_text(&handed_back, self.consumer);
            // While the app is down every instance hands the batch back on each pass (its
            // replays are held): said once a minute per route, not thousands of times.
            if self
                .route
                .series
                .said_due("handed_back", std::time::Instant::now())
            {
                tracing::info!(
                    route = %route,
                    jobs,
                    "took up {jobs} queued jobs handed back by {from}, which had not sent them to \
                     the app (its replays were held back: the breaker, a full upstream, an app \
                     that cannot be reached; or it stopped); said once a minute"
                );
            } else {
                tracing::debug!(route = %route, jobs, "took up {jobs} queued jobs handed back by {from}");
            }
        }
    }

    /// Hands `ids` back (see [`HAND_BACK`]). A failure only means they wait `claim_after`.
    async fn hand_back(&self, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        let mut command = redis::cmd("EVAL");
        command
            .arg(HAND_BACK)
            .arg(1)
            .arg(&self.keys.stream)
            .arg(&self.settings.group)
            .arg(self.consumer)
            .arg(self.settings.claim_after.as_millis() as u64)
            .arg(&ids);
        let handed: Result<i64, _> = self
            .redis
            .command(&command, self.redis.background_bound(), None)
            .await;
        if let Err(error) = handed {
            tracing::debug!(route = %self.route.name, "cannot hand back {} queued jobs; they wait claim_after: {error}", ids.len());
        }
    }

    /// Renews the hold on `ids` (see [`RENEW_HOLD`]); returns those this worker still holds.
    async fn renew_hold(&self, ids: &[String]) -> Result<Vec<String>, RedisFailure> {
        let mut command = redis::cmd("EVAL");
        command
            .arg(RENEW_HOLD)
            .arg(1)
            .arg(&self.keys.stream)
            .arg(&self.settings.group)
            .arg(self.consumer)
            .arg(ids);
        self.redis
            .command(&command, self.redis.background_bound(), None)
            .await
    }

    /// Replays `batch` in order, starting at most `replay_rate` jobs a second: none before
    /// `next_start`, which it moves on. `Ok((true, _))`: every job was taken up; otherwise
    /// with the ids of the jobs left (held back by the breaker or a full upstream, or by a
    /// stop), to be handed back.
    async fn replay_batch(
        &self,
        stop: &mut watch::Receiver<bool>,
        batch: Vec<(String, HashMap<String, Vec<u8>>)>,
        next_start: &mut Instant,
        unsent: &mut Vec<String>,
    ) -> Result<(bool, Vec<String>), RedisFailure> {
        let Pass {
            shared,
            settings,
            route,
            ..
        } = *self;
        // Jobs start `pause` apart, counted from one start to the next: a pause after each job
        // on top of its own Redis calls and replay held a backlog far below `replay_rate`.
        let pause = Duration::from_secs_f64(1.0 / settings.replay_rate.max(0.001));
        let mut jobs = batch.into_iter();
        // The job not replayed now and those behind it, handed back for the next pass.
        let rest = |id: String, jobs: std::vec::IntoIter<(String, HashMap<String, Vec<u8>>)>| {
            std::iter::once(id)
                .chain(jobs.map(|(id, _)| id))
                .collect::<Vec<_>>()
        };
        // Should Redis fail in the middle of the batch, the jobs not sent to the app (in
        // `unsent`) are handed back on the next pass that reaches Redis: held, they waited
        // out claim_after and were then said perhaps sent twice. The job whose replay went
        // out is not among them: its outcome could not be written.
        let not_sent =
            |unsent: &mut Vec<String>,
             current: Option<&String>,
             jobs: &std::vec::IntoIter<(String, HashMap<String, Vec<u8>>)>| {
                unsent.extend(current.cloned());
                unsent.extend(jobs.as_slice().iter().map(|(id, _)| id.clone()));
            };
        while let Some((id, fields)) = jobs.next() {
            // A stop during the pause is heard at once (a low replay_rate pauses long).
            let stopping = tokio::select! {
                _ = tokio::time::sleep_until(*next_start) => false,
                _ = stop.wait_for(|stopped| *stopped) => true,
            };
            if stopping || *stop.borrow() {
                return Ok((false, rest(id, jobs)));
            }
            *next_start = Instant::now() + pause;
            // Right before sending: a job another instance took over (this one could not renew
            // its hold in time) is that one's to replay now, not this one's too.
            let hold = self
                .hold_when_decided(stop, &id, &fields)
                .await
                .inspect_err(|_| not_sent(unsent, Some(&id), &jobs))?;
            match hold {
                Hold::Held => {}
                Hold::Lost => {
                    tracing::warn!(route = %route.name, %id, "job taken over by another worker before its replay here; left to that one");
                    continue;
                }
                Hold::Gone => {
                    tracing::debug!(route = %route.name, %id, "job no longer in the stream (withdrawn by its writer, its replicas not confirming it, or finished by another worker): not replayed");
                    continue;
                }
                Hold::Stopped => return Ok((false, rest(id, jobs))),
            }
            let mut job = match Job::from_fields(&id, &fields) {
                Ok(job) => job,
                Err(unreadable) => {
                    let reason = unreadable.reason.clone();
                    if self
                        .dead_letter(&id, &unreadable.into_dead_letter())
                        .await
                        .inspect_err(|_| not_sent(unsent, Some(&id), &jobs))?
                    {
                        tracing::warn!(route = %route.name, %id, %reason, "unreadable job moved to dead letters");
                        self.count(&shared.metrics.queue_dead_lettered);
                        self.keep_dead_letters_within_bound(shared).await;
                    }
                    continue;
                }
            };
            let result = match unless_it_panics(replay(shared, route, &job, stop)).await {
                Ok(result) => result,
                Err(panic) => {
                    tracing::error!(route = %route.name, key = job.idempotency_key(), "levee failed while replaying a job, a defect (please report it); the job goes to the dead letters: {panic}");
                    Replay::Permanent(format!("levee failed while replaying the job ({panic}); the app may have run it, and a retry runs it again"))
                }
            };
            let labels = QueueResultLabels {
                route: route.name.to_string().into(),
                result: result.label(),
            };
            shared.metrics.queue_replayed.get_or_create(&labels).inc();
            // The app's own "not before" (a 503 or 429 with `Retry-After`, as in maintenance
            // mode) is heeded up to backoff_max: retried sooner, the job would spend its
            // attempts on the answer it had already.
            let asked = match &result {
                Replay::Retry(_, Some(asked)) | Replay::ProbeFailed(_, Some(asked)) => *asked,
                _ => Duration::ZERO,
            };
            let unanswered = matches!(result, Replay::Unanswered(_));
            match result {
                Replay::Done => {
                    self.finish(&id)
                        .await
                        .inspect_err(|_| not_sent(unsent, None, &jobs))?;
                }
                Replay::Retry(error, _) | Replay::Unanswered(error) | Replay::Permanent(error) => {
                    job.attempts += 1;
                    job.last_error = Some(error.clone());
                    let permanent = matches!(labels.result, "permanent");
                    if permanent || job.attempts >= settings.max_attempts {
                        if self
                            .dead_letter(&id, &job)
                            .await
                            .inspect_err(|_| not_sent(unsent, None, &jobs))?
                        {
                            tracing::warn!(route = %route.name, key = %job.key_the_app_sees(), job = %job.idempotency_key(), attempts = job.attempts, "job moved to dead letters: {error}");
                            self.count(&shared.metrics.queue_dead_lettered);
                            self.keep_dead_letters_within_bound(shared).await;
                        }
                    } else {
                        let wait =
                            backoff(settings, job.attempts).max(asked.min(settings.backoff_max));
                        if self
                            .delay(&id, &job, wait)
                            .await
                            .inspect_err(|_| not_sent(unsent, None, &jobs))?
                        {
                            // `key`: the Idempotency-Key the app saw, to look for in its log.
                            let (key, job_id) = (job.key_the_app_sees(), job.idempotency_key());
                            let retry_in = crate::config::units::Shown(wait);
                            if unanswered {
                                tracing::warn!(route = %route.name, %key, job = %job_id, attempts = job.attempts, %retry_in, "replay failed, to be tried again: {error}");
                            } else {
                                tracing::info!(route = %route.name, %key, job = %job_id, attempts = job.attempts, %retry_in, "replay failed, to be tried again: {error}");
                            }
                            self.count(&shared.metrics.queue_retries);
                        }
                    }
                }
                Replay::ProbeFailed(error, _) => {
                    // While the breaker is half-open only probes go, and a failed one is no
                    // verdict when all its failures are the queue's (one client to
                    // `failing_clients`): the breaker stayed half-open, and each job spent its
                    // attempts on the outage, the backlog reaching the dead letters within
                    // seconds of a database going down.
                    job.last_error = Some(error.clone());
                    let wait =
                        backoff(settings, job.attempts.max(1)).max(asked.min(settings.backoff_max));
                    // The queue's next job starts no sooner either: a dead app is felt for
                    // at the back-off's pace, not on every pass (five a second).
                    *next_start = Instant::now() + wait;
                    if self
                        .delay(&id, &job, wait)
                        .await
                        .inspect_err(|_| not_sent(unsent, None, &jobs))?
                    {
                        static STILL_FAILING: LogThrottle =
                            LogThrottle::new(Duration::from_secs(60));
                        if let Some(held_back) = STILL_FAILING.allow(std::time::Instant::now()) {
                            let retry_in = crate::config::units::Shown(wait);
                            tracing::warn!(route = %route.name, upstream = %route.upstream.name, held_back, %retry_in, "queued jobs wait: a replay sent as the half-open breaker's probe failed ({error}); no attempt is spent, and the queue tries one job each back-off until the app answers");
                        }
                    }
                    return Ok((false, jobs.map(|(id, _)| id).collect()));
                }
                Replay::Held => {
                    // The breaker refused the call, no connection to the app could be made, or
                    // no bulkhead slot came free (or levee began to stop): no attempt spent,
                    // and this job and those behind it are
                    // handed back for the next pass (or another instance) to take up at once.
                    return Ok((false, rest(id, jobs)));
                }
            }
        }
        Ok((true, Vec::new()))
    }
}

/// `future`'s output, or what it said when it panicked. A job whose replay makes levee panic
/// (a defect) would otherwise end its queue's task with the job still held, to be taken up
/// and panic again on every pass, its queue stuck behind it; caught, it is dead-lettered.
async fn unless_it_panics<F: std::future::Future>(future: F) -> Result<F::Output, String> {
    use std::task::Poll;
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => Poll::Ready(Err(panic
                .downcast_ref::<&str>()
                .map(|message| (*message).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned()))),
        }
    })
    .await
}

/// Whose jobs one pass took over (see [`TAKE_OVER`]): per former holder, in the order met,
/// how many.
#[derive(Debug, Default, PartialEq)]
struct TakenOver {
    /// Jobs their holder kept without renewing its hold for `claim_after`: it may have sent
    /// one of them to the app before it went silent.
    abandoned: Vec<(String, u64)>,
    /// Jobs their holder handed back unsent (a delivery count of 0, see [`HAND_BACK`]).
    handed_back: Vec<(String, u64)>,
}

impl TakenOver {
    /// From [`TAKE_OVER`]'s list of former holders and delivery counts.
    fn from_holders(holders: &redis::Value) -> TakenOver {
        let mut taken = TakenOver::default();
        let redis::Value::Array(flat) = holders else {
            return taken;
        };
        for pair in flat.chunks(2) {
            let [holder, deliveries] = pair else {
                continue;
            };
            let holder = bytes_of(holder)
                .map(|name| String::from_utf8_lossy(&name).into_owned())
                .unwrap_or_default();
            let list = if matches!(deliveries, redis::Value::Int(0)) {
                &mut taken.handed_back
            } else {
                &mut taken.abandoned
            };
            match list.iter_mut().find(|(known, _)| *known == holder) {
                Some((_, jobs)) => *jobs += 1,
                None => list.push((holder, 1)),
            }
        }
        taken
    }
}

/// The holders of jobs taken over, for the log: `host-1-…-0 (3 jobs), this instance
/// (host-2-…-0, 1 job)`.
fn holders_text(holders: &[(String, u64)], own: &str) -> String {
    holders
        .iter()
        .map(|(holder, jobs)| {
            let jobs = crate::config::units::counted(*jobs, "job");
            if holder.is_empty() {
                format!("a worker the pending list did not name ({jobs})")
            } else if holder == own {
                format!("this instance ({}, {jobs})", printable(holder))
            } else {
                format!("{} ({jobs})", printable(holder))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether this worker may replay a job now (see [`Pass::hold_when_decided`]).
enum Hold {
    Held,
    /// Another worker holds it now.
    Lost,
    /// No longer in the stream: its writer withdrew it (its replicas did not confirm it), or
    /// another worker finished it.
    Gone,
    /// levee is stopping.
    Stopped,
}

enum Replay {
    Done,
    /// Tried and failed, to be tried again: not before the app's `Retry-After`, if it gave one.
    Retry(String, Option<Duration>),
    /// Sent whole, and no answer came (a timeout, a connection lost): the app may have run
    /// it, and the retry may run it twice. Tried again as a `Retry`, and said as a warning.
    Unanswered(String),
    Permanent(String),
    Held,
    /// Sent as one of a half-open breaker's probes, and the app still failed it (a failure
    /// status, or no answer): the app's outage, not the job's fault. Tried again after a
    /// back-off (not before the app's `Retry-After`), no attempt spent, and the rest of the
    /// batch waits for a later pass: the queue feels for the app's return one job at a time.
    ProbeFailed(String, Option<Duration>),
}

impl Replay {
    fn label(&self) -> &'static str {
        match self {
            Replay::Done => "done",
            Replay::Retry(..) | Replay::Unanswered(_) => "retry",
            // No attempt spent: the app's outage, not the job's failure.
            Replay::ProbeFailed(..) => "probe_failed",
            Replay::Permanent(_) => "permanent",
            Replay::Held => "held",
        }
    }
}

/// How often a replay looks for a free slot of a full upstream, and for how long: briefly,
/// as the route's batch holds its jobs meanwhile (the pass skips a route whose upstream is
/// full; this covers a slot taken between that look and the replay).
const REPLAY_SLOT_STEP: Duration = Duration::from_millis(10);
const REPLAY_SLOT_WAIT: Duration = Duration::from_millis(200);
/// Who replays are to the breaker's `failing_clients`: one client, the queue. No visitor has
/// this id (an IPv4 network's is below 2^24, an IPv6 one's has only its top bit set beside
/// its 48 bits).
const REPLAY_CLIENT: crate::breaker::ClientId = u64::MAX;

/// Sends one job to the route's upstream, as the original client, with its idempotency key.
async fn replay(shared: &Shared, route: &Route, job: &Job, stop: &watch::Receiver<bool>) -> Replay {
    let upstream = &route.upstream;
    // A replay takes a slot of the upstream's bulkhead as a request of the route's tier does,
    // held until its answer is read: queued work never pushes php-fpm past `max_inflight`
    // (a write queued because it was shed would otherwise go straight back to the full
    // pool). It looks for a free slot now and then rather than queueing with requests for
    // one; with none free soon the job waits for a later pass.
    let _slot = match &upstream.bulkhead {
        Some(bulkhead) => {
            match bulkhead
                .take_when_free(route.tier, REPLAY_SLOT_STEP, REPLAY_SLOT_WAIT)
                .await
            {
                Some(slot) => Some(slot),
                None => return Replay::Held,
            }
        }
        None => None,
    };
    // Draining began while it waited: no new job goes to the app.
    if *stop.borrow() {
        return Replay::Held;
    }
    let Ok(permit) = upstream
        .breaker
        .admit(Instant::now(), REPLAY_CLIENT, &shared.metrics)
    else {
        return Replay::Held;
    };
    let probe = permit.is_probe();
    let Ok(uri) = upstream.uri_for(&job.target) else {
        return Replay::Permanent(format!("bad target {}", job.target));
    };
    let Ok(method) = Method::from_bytes(job.method.as_bytes()) else {
        return Replay::Permanent(format!("bad method {}", job.method));
    };
    let mut request = Request::new(
        Full::new(job.body.clone())
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    // The client's, as a forwarded request keeps it: a FastCGI upstream is told it as
    // `SERVER_PROTOCOL` (PHP saw a queued HTTP/1.0 request as HTTP/1.1); an HTTP upstream is
    // sent HTTP/1.1 either way (see `client::encode_request_head`).
    *request.version_mut() = job.version;
    let (fields, spelled) = job.replayed_fields();
    *request.headers_mut() = fields;
    let headers = request.headers_mut();
    // levee's word alone, as on a forwarded request (see `header::ForwardedWriter`): jobs
    // stored before it was dropped at the door may hold a client's.
    headers.remove(&crate::proxy::header::X_LEVEE_MODULES_OFF);
    if let Some(host) = &upstream.settings.host {
        headers.insert(http::header::HOST, host.clone());
    }
    // The client's Content-Length stays when it says the body's length: a DELETE's `0`
    // reached PHP as an empty CONTENT_LENGTH, not the "0" the request had. Otherwise levee
    // writes the length itself (a body that came chunked).
    let says_length = {
        let mut lengths = headers.get_all(http::header::CONTENT_LENGTH).iter();
        let first = lengths.next().and_then(|value| value.to_str().ok());
        lengths.next().is_none()
            && first.and_then(|value| value.trim().parse::<usize>().ok()) == Some(job.body.len())
    };
    if !says_length {
        headers.remove(http::header::CONTENT_LENGTH);
    }
    // A key the client sent itself stays: it names the client's one operation across its
    // retries (each a job of its own), which the job id cannot. A blank one names nothing,
    // and the app could not tell a replay sent twice: the job id stands in for it.
    let clients_key = headers
        .get_all("idempotency-key")
        .iter()
        .any(|key| !key.as_bytes().trim_ascii().is_empty());
    if !clients_key {
        if let Ok(key) = HeaderValue::from_str(job.idempotency_key()) {
            headers.insert("idempotency-key", key);
        }
    }
    // The job holds the forwarded fields a request forwarded then would have carried (the
    // trusted front's chain as it came): kept, so the app reads the client as it would have.
    // A job stored without them gets the client's address.
    if let Ok(client) = HeaderValue::from_str(&job.client_ip) {
        if !headers.contains_key("x-real-ip") {
            headers.insert("x-real-ip", client.clone());
        }
        if !headers.contains_key("x-forwarded-for") {
            headers.insert("x-forwarded-for", client);
        }
    }
    // The names go as the client spelled them; the forwarding fields are the job's own.
    let from_client = crate::proxy::header::FromClient {
        forwarded: None,
        received_head: spelled,
        modules_off: None,
    };
    let sent = upstream.client.send_within(
        request,
        crate::proxy::client::ResponseFields::Parsed,
        from_client,
        None,
        Instant::now(),
        None,
    );
    match tokio::time::timeout(upstream.settings.response_timeout, sent).await {
        Err(_) => {
            permit.record(Outcome::Failure, Instant::now(), &shared.metrics);
            // Said in the letter too: the app may have run it, and a retry runs it again.
            let error = format!(
                "no answer within {} (the app may have run it: a retry runs it again)",
                crate::config::units::Shown(upstream.settings.response_timeout)
            );
            if probe {
                Replay::ProbeFailed(error, None)
            } else {
                Replay::Unanswered(error)
            }
        }
        // Not the upstream's failure, and no use trying again: a job a FastCGI upstream
        // cannot run (its path names no script), or an answer whose head levee cannot read
        // (the app has run the job: sent again, it would run twice). Dead letters, for a
        // person to look at; the breaker does not count it.
        Ok(Err(error)) if !error.is_upstream_failure() => {
            permit.record(Outcome::Abandoned, Instant::now(), &shared.metrics);
            // The letter says which: an operator retrying one the app ran runs it twice.
            Replay::Permanent(match error {
                crate::proxy::client::ClientError::Unpassable(_) => format!(
                    "the app ran the job but its answer could not be read ({error}): a retry runs it again"
                ),
                _ => format!("cannot be replayed: {error}"),
            })
        }
        // Nothing reached the app (refused, unreachable, no connection in connect_timeout): a
        // failure for the breaker, but no attempt spent. The job and those behind it wait, as
        // they do while the breaker is open, and are replayed once the app takes requests
        // again: an outage of php-fpm no longer used up every job's attempts in seconds and
        // left work a client was told was accepted in the dead letters.
        // As a half-open breaker's probe, it waits its back-off like a failed one: held, it
        // was tried again on every pass (a connect five times a second to a dead php-fpm).
        Ok(Err(error)) if error.never_sent() && probe => {
            permit.record(Outcome::Failure, Instant::now(), &shared.metrics);
            Replay::ProbeFailed(format!("the upstream cannot be reached ({error})"), None)
        }
        Ok(Err(error)) if error.never_sent() => {
            permit.record(Outcome::Failure, Instant::now(), &shared.metrics);
            static UNREACHABLE: LogThrottle = LogThrottle::new(Duration::from_secs(60));
            if let Some(held_back) = UNREACHABLE.allow(std::time::Instant::now()) {
                tracing::warn!(route = %route.name, upstream = %upstream.name, held_back, "queued jobs wait: the upstream cannot be reached ({error}); no attempt is spent");
            }
            Replay::Held
        }
        Ok(Err(error)) => {
            permit.record(Outcome::Failure, Instant::now(), &shared.metrics);
            let error = format!("upstream error after the job was sent: {error} (the app may have run it: a retry runs it again)");
            if probe {
                Replay::ProbeFailed(error, None)
            } else {
                Replay::Unanswered(error)
            }
        }
        Ok(Ok(answered)) => {
            let response = answered.response;
            let status = response.status();
            let asked_to_wait = matches!(status.as_u16(), 429 | 503)
                .then(|| retry_after(response.headers()))
                .flatten();
            let failed = permit.record_status(status.as_u16(), Instant::now(), &shared.metrics);
            // Drain the body so the connection can be reused, but not for longer than the
            // upstream's idle_body_timeout: the outcome is known, and the worker keeps its
            // hold on the batch while it waits here.
            let drain = response.into_body().collect();
            let _ = tokio::time::timeout(upstream.settings.idle_body_timeout, drain).await;
            if status.is_success() || status.is_redirection() {
                Replay::Done
            } else if status.is_client_error() && !matches!(status.as_u16(), 408 | 425 | 429) {
                Replay::Permanent(format!("the app refused the job with {status}"))
            } else if probe && failed {
                Replay::ProbeFailed(format!("the app answered {status}"), asked_to_wait)
            } else {
                Replay::Retry(format!("the app answered {status}"), asked_to_wait)
            }
        }
    }
}

/// A `Retry-After` in seconds (the form PHP apps send: maintenance modes, rate limiters);
/// an HTTP date is not read, and the job waits its own backoff.
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

async fn eval(
    redis: &RedisStore,
    script: &str,
    keys: &[&str],
    args: Vec<Vec<u8>>,
) -> Result<redis::Value, RedisFailure> {
    let mut command = redis::cmd("EVAL");
    command.arg(script).arg(keys.len());
    for key in keys {
        command.arg(*key);
    }
    for arg in args {
        command.arg(arg);
    }
    redis
        .command(&command, redis.background_bound(), None)
        .await
}

/// Fields of a job as command arguments.
fn job_args(job: &Job) -> Vec<Vec<u8>> {
    let mut command = redis::cmd("X");
    job.write_fields(&mut command);
    command
        .args_iter()
        .skip(1)
        .filter_map(|arg| match arg {
            redis::Arg::Simple(bytes) => Some(bytes.to_vec()),
            _ => None,
        })
        .collect()
}

impl Pass<'_> {
    /// Runs a script that acts on a replay's outcome (its ARGV start with group, id, consumer)
    /// only while this worker still holds the entry `id`. One that lost it (another instance took
    /// the job over while the replay ran: this worker could not renew its hold for claim_after)
    /// leaves the job to the new holder, whose replay decides what becomes of it.
    /// `Ok(false)` when another worker holds the job now (the script did nothing), so what
    /// this worker would have done is not counted.
    async fn eval_if_still_held(
        &self,
        script: &str,
        keys: &[&str],
        id: &str,
        rest: Vec<Vec<u8>>,
    ) -> Result<bool, RedisFailure> {
        let mut args = vec![
            self.settings.group.clone().into_bytes(),
            id.as_bytes().to_vec(),
            self.consumer.as_bytes().to_vec(),
        ];
        args.extend(rest);
        let script = format!("{IF_STILL_HELD}{script}");
        // The app has had the job by now: were the outcome left unrecorded because Redis
        // failed this once (restarted, failed over, a broken connection), the job would be
        // taken over after claim_after and sent to the app again. So it is tried again until
        // Redis answers, for as long as no other worker could have taken the job over; the
        // script does nothing if one has.
        let give_up_at = Instant::now() + self.settings.claim_after;
        let mut tried_before = false;
        let outcome = loop {
            match eval(self.redis, &script, keys, args.clone()).await {
                Err(error) if !is_no_group(&error) && Instant::now() < give_up_at => {
                    tried_before = true;
                    tracing::debug!(
                        id,
                        "the outcome of a replayed job is not recorded yet, trying again: {error}"
                    );
                    tokio::time::sleep(self.settings.poll_interval).await;
                }
                outcome => break outcome?,
            }
        };
        if let redis::Value::Int(-1) = outcome {
            if tried_before {
                // An earlier try whose answer was lost may have run the script: the job is
                // no longer this worker's either way, and most likely by its own doing.
                tracing::debug!(
                    id,
                    "the outcome of a replayed job was recorded by an earlier try, or the job was taken over meanwhile"
                );
                return Ok(true);
            }
            tracing::warn!(
                id,
                "job taken over by another worker while its replay ran here; left to that one"
            );
            return Ok(false);
        }
        Ok(true)
    }

    /// Counts one outcome of this pass's route in a per-route counter.
    fn count(&self, counter: &Family<QueueLabels, Counter>) {
        counter
            .get_or_create(&QueueLabels {
                route: self.route.name.to_string().into(),
            })
            .inc();
    }

    /// Drops the oldest dead letters beyond `max_dead_letters`. Each keeps its whole body
    /// (up to `max_body`) until an operator retries or drops it: without a bound, a client
    /// sending work the app refuses (a 4xx goes there at once) fills Redis, and a full Redis
    /// stops every queue, switch and shared limit. A failure here is left to the next letter.
    async fn keep_dead_letters_within_bound(&self, shared: &Shared) {
        let mut trim = redis::cmd("XTRIM");
        trim.arg(&self.keys.dead)
            .arg("MAXLEN")
            .arg(self.settings.max_dead_letters);
        match self
            .redis
            .command::<u64>(&trim, self.redis.background_bound(), None)
            .await
        {
            Ok(0) => {}
            Ok(dropped) => {
                tracing::warn!(route = %self.route.name, dropped, max_dead_letters = self.settings.max_dead_letters, "oldest dead letters dropped to keep max_dead_letters");
                shared
                    .metrics
                    .queue_dead_letters_dropped
                    .get_or_create(&QueueLabels {
                        route: self.route.name.to_string().into(),
                    })
                    .inc_by(dropped);
            }
            Err(error) => {
                tracing::debug!(route = %self.route.name, "dead letters not trimmed: {error}");
            }
        }
    }

    async fn finish(&self, id: &str) -> Result<bool, RedisFailure> {
        self.eval_if_still_held(FINISH, &[&self.keys.stream], id, Vec::new())
            .await
    }

    /// Moves a job to the dead-letter stream with its last error, atomically with the ack.
    async fn dead_letter(&self, id: &str, job: &Job) -> Result<bool, RedisFailure> {
        const SCRIPT: &str = r#"
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XDEL', KEYS[1], ARGV[2])
"#;
        self.eval_if_still_held(
            SCRIPT,
            &[&self.keys.stream, &self.keys.dead],
            id,
            job_args(job),
        )
        .await
    }

    /// Parks a job until its retry time, atomically with the ack. The retry time is `wait`
    /// after Redis's clock (`TIME`), the clock [`MOVE_DUE`] reads: this instance's own clock
    /// may be minutes off the others'. ARGV (after group, id, consumer): wait (ms), the job's
    /// fields.
    async fn delay(&self, id: &str, job: &Job, wait: Duration) -> Result<bool, RedisFailure> {
        const SCRIPT: &str = r#"
local now = redis.call('TIME')
local due = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[4])
redis.call('HSET', KEYS[3], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], due, KEYS[3])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XDEL', KEYS[1], ARGV[2])
"#;
        let job_key = format!("{}:{}", self.keys.delayed, job.idempotency_key());
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let mut args = vec![wait_ms.to_string().into_bytes()];
        args.extend(job_args(job));
        self.eval_if_still_held(
            SCRIPT,
            &[&self.keys.stream, &self.keys.delayed, &job_key],
            id,
            args,
        )
        .await
    }
}

/// Dead letters read per call while listing them.
const DEAD_LETTER_BATCH: usize = 16;

/// Bodies a listing reads at most before it stops (each up to `[queue] max_body`, 1 MiB by
/// default): a page of a thousand was a gigabyte in one reply, on the connection rate-limit
/// calls wait on, and they timed out behind it into their fallbacks.
const DEAD_LETTER_PAGE_BYTES: usize = 4 * 1024 * 1024;

/// The newest `limit` dead letters of a route, or the newest older than the letter `before`,
/// and whether older ones may remain: read `DEAD_LETTER_BATCH` at a time, and fewer than
/// `limit` when `DEAD_LETTER_PAGE_BYTES` of them were read first (the next page has the rest).
pub async fn dead_letters(
    redis: &RedisStore,
    keys: &QueueKeys,
    limit: usize,
    before: Option<&str>,
) -> Result<(Vec<(String, Job)>, bool), RedisFailure> {
    let mut letters = Vec::new();
    let mut bytes = 0;
    let mut older_than = before.map(str::to_string);
    loop {
        // One more than the page needs: whether there are older letters.
        let wanted = (limit + 1 - letters.len()).min(DEAD_LETTER_BATCH);
        let mut command = redis::cmd("XREVRANGE");
        command
            .arg(&keys.dead)
            .arg(
                older_than
                    .as_ref()
                    .map_or_else(|| "+".to_string(), |id| format!("({id}")),
            )
            .arg("-")
            .arg("COUNT")
            .arg(wanted);
        let value: redis::Value = redis
            .command(&command, redis.background_bound(), None)
            .await?;
        let batch = entries(&value);
        let read = batch.len();
        for (id, fields) in batch {
            if letters.len() == limit {
                return Ok((letters, true));
            }
            bytes += fields.values().map(Vec::len).sum::<usize>();
            // Listed with what could be read, not left out: an operator must see every letter.
            let job = Job::from_fields(&id, &fields).unwrap_or_else(|unreadable| {
                let mut salvaged = unreadable.salvaged;
                salvaged.last_error = salvaged
                    .last_error
                    .or_else(|| Some(format!("unreadable job: {}", unreadable.reason)));
                salvaged
            });
            older_than = Some(id.clone());
            letters.push((id, job));
        }
        if read < wanted {
            return Ok((letters, false));
        }
        if bytes >= DEAD_LETTER_PAGE_BYTES {
            return Ok((letters, true));
        }
    }
}

/// What became of a dead letter an operator retried or dropped.
#[derive(Debug, PartialEq, Eq)]
pub enum Resolved {
    Done,
    /// No such letter (already retried or dropped, or never there).
    NotFound,
    /// A letter that is not a whole job cannot be queued again (it would be a dead letter
    /// again at once); it can be dropped.
    Unreadable(String),
}

/// Puts a dead letter back in the queue (attempts reset) or drops it.
pub async fn resolve_dead_letter(
    redis: &RedisStore,
    keys: &QueueKeys,
    id: &str,
    retry: bool,
) -> Result<Resolved, RedisFailure> {
    let mut read = redis::cmd("XRANGE");
    read.arg(&keys.dead).arg(id).arg(id);
    let value: redis::Value = redis.command(&read, redis.background_bound(), None).await?;
    let Some((_, fields)) = entries(&value).into_iter().next() else {
        return Ok(Resolved::NotFound);
    };
    if retry {
        let mut job = match Job::from_fields(id, &fields) {
            Ok(job) => job,
            Err(unreadable) => return Ok(Resolved::Unreadable(unreadable.reason)),
        };
        job.attempts = 0;
        job.last_error = None;
        // Queued again only by the call that removed the dead letter: two operators (or a
        // repeated click) retrying one job queue it once, and a retry racing a drop loses.
        const SCRIPT: &str = r#"
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then
  return 0
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
return 1
"#;
        let mut args = vec![id.as_bytes().to_vec()];
        args.extend(job_args(&job));
        let queued = eval(redis, SCRIPT, &[&keys.stream, &keys.dead], args).await?;
        Ok(if matches!(queued, redis::Value::Int(1)) {
            Resolved::Done
        } else {
            Resolved::NotFound
        })
    } else {
        let mut delete = redis::cmd("XDEL");
        delete.arg(&keys.dead).arg(id);
        let deleted: i64 = redis
            .command(&delete, redis.background_bound(), None)
            .await?;
        Ok(if deleted == 1 {
            Resolved::Done
        } else {
            Resolved::NotFound
        })
    }
}

/// Backlog figures of one route for the admin API. The first call Redis fails ends it: a
/// figure Redis did not give is not shown as a number (it had read -1, a count of jobs), and
/// the other calls would each wait out their timeout against a Redis that is down.
pub async fn stats(
    redis: &RedisStore,
    keys: &QueueKeys,
    settings: &QueueSettings,
) -> Result<serde_json::Value, RedisFailure> {
    let count = |name: &'static str, key: &str| {
        let mut command = redis::cmd(name);
        command.arg(key);
        command
    };
    let backlog: i64 = redis
        .command(&count("XLEN", &keys.stream), redis.background_bound(), None)
        .await?;
    let delayed: i64 = redis
        .command(
            &count("ZCARD", &keys.delayed),
            redis.background_bound(),
            None,
        )
        .await?;
    let dead: i64 = redis
        .command(&count("XLEN", &keys.dead), redis.background_bound(), None)
        .await?;
    let mut pending = redis::cmd("XPENDING");
    pending.arg(&keys.stream).arg(&settings.group);
    // A queue whose group is not made yet (nothing stored since) has nothing in flight.
    let in_flight = match redis
        .command::<redis::Value>(&pending, redis.background_bound(), None)
        .await
    {
        Ok(redis::Value::Array(parts)) => parts
            .first()
            .and_then(bytes_of)
            .and_then(|b| String::from_utf8_lossy(&b).parse::<i64>().ok())
            .unwrap_or(0),
        Ok(_) => 0,
        Err(RedisFailure::Redis(error)) if error.code() == Some("NOGROUP") => 0,
        Err(failure) => return Err(failure),
    };
    let oldest_age_s = oldest_job_age(redis, keys).await;
    Ok(serde_json::json!({
        // Jobs not applied yet, retries waiting for their time included, as
        // `levee_queue_backlog` counts them.
        "backlog": backlog + delayed,
        "delayed": delayed,
        "in_flight": in_flight,
        "dead_letters": dead,
        "oldest_job_age_seconds": oldest_age_s,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_that_panics_is_caught_with_its_message() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            assert_eq!(unless_it_panics(async { 7 }).await, Ok(7));
            let waits_then_panics = async {
                tokio::task::yield_now().await;
                let fields: Vec<u8> = Vec::new();
                fields.first().copied().expect("a job with a body")
            };
            let caught = unless_it_panics(waits_then_panics).await;
            assert!(
                matches!(&caught, Err(message) if message.contains("a job with a body")),
                "{caught:?}"
            );
            assert_eq!(
                unless_it_panics(async { panic!("{} jobs", 3) }).await,
                Err::<(), _>("3 jobs".to_owned())
            );
        });
    }

    #[test]
    fn jobs_taken_over_are_told_apart_by_whether_their_holder_handed_them_back() {
        let name = |text: &str| redis::Value::BulkString(text.as_bytes().to_vec());
        let holders = redis::Value::Array(vec![
            name("a"),
            redis::Value::Int(1),
            name("b"),
            redis::Value::Int(0),
            name("a"),
            redis::Value::Int(3),
            name("me"),
            redis::Value::Int(2),
            name("b"),
            redis::Value::Int(0),
            name(""),
            redis::Value::Int(1),
        ]);
        let taken = TakenOver::from_holders(&holders);
        assert_eq!(
            taken,
            TakenOver {
                abandoned: vec![("a".into(), 2), ("me".into(), 1), (String::new(), 1)],
                handed_back: vec![("b".into(), 2)],
            }
        );
        assert_eq!(
            holders_text(&taken.abandoned, "me"),
            "a (2 jobs), this instance (me, 1 job), a worker the pending list did not name (1 job)"
        );
        assert_eq!(
            TakenOver::from_holders(&redis::Value::Nil),
            TakenOver::default()
        );
    }

    #[test]
    fn a_lost_group_is_told_with_the_jobs_last_counted_in_it() {
        let at = Instant::now();
        let count = |stream, delayed, pending| JobCount {
            stream,
            delayed,
            pending,
            at,
        };
        let later = at + Duration::from_millis(1500);
        assert_eq!(
            lost_jobs(Some(&count(3, 2, Some(1))), Some(&count(1, 0, None)), later),
            "about 3 jobs lost with it: its stream held 3 (1 of them read by a worker) when \
             levee last counted (each instance that notices says its own count: one loss), \
             1.5s before (fewer if workers finished some since, more if some were stored \
             since), and up to 2 of the 2 jobs that waited for a retry are gone too"
        );
        assert!(
            lost_jobs(Some(&count(1, 0, None)), Some(&count(0, 0, None)), later)
                .starts_with("about 1 job lost with it")
        );
        // A stream deleted alone: the retries are still there.
        assert!(
            !lost_jobs(Some(&count(3, 2, Some(0))), Some(&count(0, 2, None)), later)
                .contains("retry")
        );
        assert_eq!(
            lost_jobs(Some(&count(0, 0, Some(0))), None, later),
            "its stream held no job when levee last counted, 1.5s before, so none is known \
             lost (only jobs stored after that count, if any)"
        );
        assert!(
            lost_jobs(Some(&count(4, 5, Some(4))), None, later)
                .ends_with("; 5 more waited for a retry then (lost too if redis lost its data: /queues shows `delayed`)")
        );
        assert!(lost_jobs(None, None, later).contains("how many levee cannot say"));
    }

    #[test]
    fn backoff_doubles_with_jitter_and_a_cap() {
        let settings = QueueSettings {
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(10),
            ..QueueSettings::default()
        };
        for (attempt, base) in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)] {
            let wait = backoff(&settings, attempt).as_secs_f64();
            assert!(
                (base * 0.8..=base * 1.2).contains(&wait),
                "attempt {attempt}: {wait}"
            );
        }
        assert!(backoff(&settings, 30) <= Duration::from_secs(10));
    }

    #[test]
    fn only_consumers_idle_over_the_bound_and_holding_no_job_are_removed_never_our_own() {
        let hour = Duration::from_secs(3600);
        let consumer = |name: &str, pending: usize, idle: Duration| StreamInfoConsumer {
            name: name.into(),
            pending,
            idle: idle.as_millis() as usize,
        };
        let listed = [
            consumer("stopped-empty", 0, hour * 24),
            consumer("stopped-holding-a-job", 1, hour * 24),
            consumer("live", 0, Duration::from_millis(200)),
            consumer("at-the-bound", 0, hour),
            consumer("just-over-the-bound", 0, hour + Duration::from_millis(1)),
            consumer("this-worker", 0, hour * 24),
        ];
        assert_eq!(
            idle_consumers_to_remove(&listed, "this-worker", hour),
            ["stopped-empty", "just-over-the-bound"]
        );
        assert!(idle_consumers_to_remove(&[], "this-worker", hour).is_empty());
    }

    #[test]
    fn the_idle_bound_is_an_hour_or_ten_times_the_longest_gap_of_a_live_worker() {
        let hour = Duration::from_secs(3600);
        assert_eq!(idle_consumer_bound(&QueueSettings::default()), hour);
        let slow_claims = QueueSettings {
            claim_after: Duration::from_secs(600),
            ..QueueSettings::default()
        };
        assert_eq!(idle_consumer_bound(&slow_claims), Duration::from_secs(6000));
        let slow_polls = QueueSettings {
            poll_interval: hour,
            ..QueueSettings::default()
        };
        assert_eq!(idle_consumer_bound(&slow_polls), hour * 10);
    }
}
