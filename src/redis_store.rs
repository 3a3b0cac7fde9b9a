//! The Redis connection levee shares between rate limits, switches and stale copies, with
//! its health breaker; and the rate-limit decisions on the Redis server clock, behind a short
//! timeout and the health breaker: batched on a single server (`redis_batch`), one Lua script
//! per slot group in a cluster.
//!
//! Redis is advisory on the request path. Every call is bounded by `timeout`; after
//! `failures_to_open` consecutive failures the health breaker opens and requests stop calling
//! Redis for `cooldown`; then a single probe goes through, and Redis is used again as soon
//! as it answers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::redis_batch::{lock, read_answer, DecisionBatcher, Endpoint};

/// Shortest bound on a refund call (see `give_back`).
const REFUND_BOUND: Duration = Duration::from_secs(1);

/// The rate-limit script: GCRA for a batch of requests (see its header).
const SCRIPT: &str = include_str!("limit/script.lua");

/// `[redis]`, compiled. A reload with equal settings keeps the connection.
#[derive(Debug, Clone, PartialEq)]
pub struct RedisSettings {
    pub target: RedisTarget,
    /// Bound on every call. Default 25ms.
    pub timeout: Duration,
    /// Consecutive failures that open the health breaker. Default 3.
    pub failures_to_open: u32,
    /// How long Redis is left alone once the breaker opened. Default 1s.
    pub cooldown: Duration,
    /// Prefix of every key levee writes. Default `levee:`.
    pub key_prefix: String,
    /// levee instances sharing these limits; the `local` fallback admits `rate / instances`.
    /// Default 1.
    pub instances: u32,
    /// Share of a bucket's burst that must be left, by Redis's last answer less levee's own
    /// requests since, for a request to be admitted at once and charged in the background.
    /// 1 turns it off. Default [`DEFAULT_ADMIT_AHEAD_ABOVE`], or `1 - 1/instances` when
    /// that is higher.
    pub admit_ahead_above: f64,
}

/// `[redis] admit_ahead_above` when the policy does not set it (and `instances` is 1 or 2).
pub const DEFAULT_ADMIT_AHEAD_ABOVE: f64 = 0.5;

#[derive(Debug, Clone, PartialEq)]
pub enum RedisTarget {
    Single(String),
    Cluster(Vec<String>),
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Why a Redis call did not give a decision.
#[derive(Debug, thiserror::Error)]
pub enum RedisFailure {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis answered something unexpected: {0}")]
    BadReply(String),
    #[error("redis is marked down; not calling it until the cool-down ends")]
    Down,
    #[error("redis connection failed: {0}")]
    Connection(String),
    #[error("{0} rate-limit decisions are already waiting for redis")]
    Overloaded(usize),
}

/// One bucket to decide in Redis.
pub struct RedisAsk<'a> {
    pub key: &'a str,
    pub tag: &'a str,
    pub interval_us: u64,
    pub burst: u32,
    pub dry_run: bool,
}

/// Redis's answer for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteVerdict {
    pub allowed: bool,
    pub remaining: u32,
    pub reset_ms: u64,
    pub retry_after_ms: u64,
}

#[derive(Debug, Default)]
struct Health {
    consecutive_failures: u32,
    open_until: Option<Instant>,
    probing: bool,
}

/// Leave to call Redis on the request path. A probe's permit ends the probe when it is
/// dropped, recorded or not: a request that goes away in the middle of its probe (the client
/// left) hands the probe on, instead of leaving the health breaker waiting for it forever.
struct Permit<'a> {
    health: &'a Mutex<Health>,
    probe: bool,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe {
            lock(self.health).probing = false;
        }
    }
}

pub struct RedisStore {
    pub settings: RedisSettings,
    connection: OnceCell<Connection>,
    health: Mutex<Health>,
    script: Arc<KeyedScript>,
    refund: Arc<KeyedScript>,
    /// Rate-limit decisions on a single server, batched (`redis_batch`). `None` for a
    /// cluster, whose decisions go one call per slot group through redis-rs.
    batcher: Option<DecisionBatcher>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("settings", &self.settings)
            .finish()
    }
}

impl RedisStore {
    pub fn new(settings: RedisSettings) -> RedisStore {
        let batcher = match &settings.target {
            RedisTarget::Single(url) => Endpoint::from_url(url).map(|endpoint| {
                // The worker's own bound on a call: at least the caller's timeout, and
                // long enough for a connection to be made even with a tight timeout.
                let call_bound = settings.timeout.max(Duration::from_millis(200));
                DecisionBatcher::new(endpoint, SCRIPT, call_bound, settings.admit_ahead_above)
            }),
            RedisTarget::Cluster(_) => None,
        };
        RedisStore {
            batcher,
            settings,
            connection: OnceCell::new(),
            health: Mutex::new(Health::default()),
            script: Arc::new(KeyedScript::new(SCRIPT)),
            refund: Arc::new(KeyedScript::new(include_str!("limit/refund.lua"))),
        }
    }

    /// True while the health breaker is closed (Redis is being used).
    pub fn is_up(&self) -> bool {
        self.health
            .lock()
            .map(|health| health.open_until.is_none())
            .unwrap_or(true)
    }

    async fn connect(&self) -> Result<Connection, RedisFailure> {
        let timeout = self.settings.timeout;
        let connection = self
            .connection
            .get_or_try_init(|| async {
                match &self.settings.target {
                    RedisTarget::Single(url) => {
                        let client = redis::Client::open(url.as_str())?;
                        let config = redis::aio::ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(timeout.max(Duration::from_millis(200))))
                            .set_response_timeout(Some(timeout))
                            .set_number_of_retries(2);
                        let manager = ConnectionManager::new_with_config(client, config).await?;
                        Ok::<_, RedisFailure>(Connection::Single(manager))
                    }
                    RedisTarget::Cluster(nodes) => {
                        let client = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                            .connection_timeout(timeout.max(Duration::from_millis(200)))
                            .response_timeout(timeout)
                            .retries(1)
                            .build()?;
                        Ok(Connection::Cluster(client.get_async_connection().await?))
                    }
                }
            })
            .await?;
        Ok(connection.clone())
    }

    fn permit(&self) -> Option<Permit<'_>> {
        let mut health = lock(&self.health);
        let probe = match health.open_until {
            None => false,
            Some(until) if Instant::now() < until || health.probing => return None,
            Some(_) => {
                health.probing = true;
                true
            }
        };
        Some(Permit {
            health: &self.health,
            probe,
        })
    }

    fn record(&self, permit: Permit<'_>, ok: bool, metrics: &Metrics) {
        drop(permit);
        let mut health = lock(&self.health);
        if ok {
            health.consecutive_failures = 0;
            if health.open_until.take().is_some() {
                tracing::info!("redis answers again: rate limits are shared through redis");
                metrics.redis_up.set(1);
                metrics
                    .redis_transitions
                    .get_or_create(&crate::metrics::RedisStateLabels { to: "up" })
                    .inc();
            }
            return;
        }
        health.consecutive_failures += 1;
        let was_open = health.open_until.is_some();
        if was_open || health.consecutive_failures >= self.settings.failures_to_open {
            health.open_until = Some(Instant::now() + self.settings.cooldown);
            if !was_open {
                tracing::warn!(
                    failures = health.consecutive_failures,
                    cooldown = ?self.settings.cooldown,
                    "redis is failing: rate limits use each rule's on_redis_error fallback"
                );
                metrics.redis_up.set(0);
                metrics
                    .redis_transitions
                    .get_or_create(&crate::metrics::RedisStateLabels { to: "down" })
                    .inc();
            }
        }
    }

    /// Runs one command. On the request path (`guarded`), it goes through the health breaker
    /// like rate-limit calls (no waiting on a Redis known to be down); operator and
    /// background calls (`guarded = false`) always try, bounded by `timeout`.
    pub async fn command<T: redis::FromRedisValue>(
        &self,
        command: &redis::Cmd,
        timeout: Duration,
        guarded: Option<&Metrics>,
    ) -> Result<T, RedisFailure> {
        let permit = match guarded {
            Some(_) => Some(self.permit().ok_or(RedisFailure::Down)?),
            None => None,
        };
        let call = async {
            let connection = self.connect().await?;
            Ok::<T, RedisFailure>(query(&connection, command).await?)
        };
        let result = match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_elapsed) => Err(RedisFailure::Timeout(timeout)),
        };
        if let (Some(permit), Some(metrics)) = (permit, guarded) {
            self.record(permit, result.is_ok(), metrics);
        }
        result
    }

    /// Admits every ask at once when Redis's last answers left each bucket more than
    /// `admit_ahead_above` of its burst; the decision still goes to Redis, in the next batch,
    /// and its answer updates what levee knows. `None`: decide with [`Self::decide_all`].
    /// Never while the health breaker is open, nor for a cluster.
    pub fn admit_ahead(
        &self,
        asks: &[RedisAsk<'_>],
        metrics: &Metrics,
    ) -> Option<Vec<RemoteVerdict>> {
        let batcher = self.batcher.as_ref()?;
        if !self.is_up() {
            return None;
        }
        batcher.admit_ahead(asks, &metrics.ratelimit_ahead_overruns)
    }

    /// Decides every ask. In a cluster, asks are grouped by hash tag (one slot each) and the
    /// groups run concurrently; a request that is not admitted whole consumes nothing: when
    /// a group refuses, fails or overruns the timeout, the groups that admitted are refunded.
    pub async fn decide_all(
        &self,
        asks: &[RedisAsk<'_>],
        metrics: &Metrics,
    ) -> Result<Vec<RemoteVerdict>, RedisFailure> {
        let permit = self.permit().ok_or(RedisFailure::Down)?;
        let started = Instant::now();
        let result = self.run(asks, started + self.settings.timeout).await;
        metrics
            .redis_latency
            .observe(started.elapsed().as_secs_f64());
        self.record(permit, result.is_ok(), metrics);
        result
    }

    async fn run(
        &self,
        asks: &[RedisAsk<'_>],
        deadline: Instant,
    ) -> Result<Vec<RemoteVerdict>, RedisFailure> {
        let timeout = self.settings.timeout;
        if let Some(batcher) = &self.batcher {
            let (_, verdicts) = within(deadline, timeout, batcher.decide(asks)).await?;
            return Ok(verdicts);
        }
        let connection = within(deadline, timeout, self.connect()).await?;
        let single_slot = asks.windows(2).all(|pair| pair[0].tag == pair[1].tag);
        if matches!(connection, Connection::Single(_)) || single_slot {
            let call = invoke(&self.script, &connection, asks.iter().collect());
            let (_, verdicts) = within(deadline, timeout, call).await?;
            return Ok(verdicts);
        }
        // Cluster with several slots: decided in a task of its own, so that a request that
        // goes away meanwhile (its client hung up) still gives back what some groups charged
        // when another refused or failed.
        let owned: Vec<OwnedAsk> = asks.iter().map(OwnedAsk::from).collect();
        let script = self.script.clone();
        let refund = self.refund.clone();
        let (verdict_sender, verdict) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let asks: Vec<RedisAsk<'_>> = owned.iter().map(OwnedAsk::borrowed).collect();
            let (result, to_refund) =
                decide_in_groups(&script, &connection, &asks, deadline, timeout).await;
            let _ = verdict_sender.send(result);
            let bound = timeout.max(REFUND_BOUND);
            give_back(&refund, &connection, &asks, &to_refund, bound).await;
        });
        let result = verdict.await.unwrap_or_else(|_| {
            Err(RedisFailure::Connection(
                "the rate-limit decision ended without an answer".into(),
            ))
        });
        // A refund is waited for until the deadline, so that the next request usually sees
        // it done; it goes on after that when this request has run out of time.
        let _ = tokio::time::timeout_at(deadline, task).await;
        result
    }
}

/// Awaits `call` until `deadline`; a timeout (of `timeout`, the setting) after it.
async fn within<T>(
    deadline: Instant,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<T, RedisFailure>>,
) -> Result<T, RedisFailure> {
    tokio::time::timeout_at(deadline, call)
        .await
        .unwrap_or(Err(RedisFailure::Timeout(timeout)))
}

/// A [`RedisAsk`] that owns its key and tag, for a decision that outlives its request.
struct OwnedAsk {
    key: String,
    tag: String,
    interval_us: u64,
    burst: u32,
    dry_run: bool,
}

impl From<&RedisAsk<'_>> for OwnedAsk {
    fn from(ask: &RedisAsk<'_>) -> OwnedAsk {
        OwnedAsk {
            key: ask.key.to_string(),
            tag: ask.tag.to_string(),
            interval_us: ask.interval_us,
            burst: ask.burst,
            dry_run: ask.dry_run,
        }
    }
}

impl OwnedAsk {
    fn borrowed(&self) -> RedisAsk<'_> {
        RedisAsk {
            key: &self.key,
            tag: &self.tag,
            interval_us: self.interval_us,
            burst: self.burst,
            dry_run: self.dry_run,
        }
    }
}

/// Decides asks of several slots in a cluster: one script per tag group, each bounded by the
/// deadline itself, so that the groups which did answer are known even when another did not.
/// A request that is not admitted whole consumes nothing: when a group refuses, fails or
/// overruns the deadline, the buckets the other groups charged are returned for refunding:
/// their indices in `asks`, by slot group.
async fn decide_in_groups(
    script: &KeyedScript,
    connection: &Connection,
    asks: &[RedisAsk<'_>],
    deadline: Instant,
    timeout: Duration,
) -> (Result<Vec<RemoteVerdict>, RedisFailure>, Vec<Vec<usize>>) {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (index, ask) in asks.iter().enumerate() {
        match groups.iter_mut().find(|(tag, _)| *tag == ask.tag) {
            Some((_, members)) => members.push(index),
            None => groups.push((ask.tag, vec![index])),
        }
    }
    let calls = groups.iter().map(|(_, members)| {
        let group: Vec<&RedisAsk<'_>> = members.iter().map(|&i| &asks[i]).collect();
        within(deadline, timeout, invoke(script, connection, group))
    });
    let answers = futures_util::future::join_all(calls).await;
    let mut verdicts = vec![
        RemoteVerdict {
            allowed: true,
            remaining: 0,
            reset_ms: 0,
            retry_after_ms: 0
        };
        asks.len()
    ];
    let mut any_blocked = false;
    let mut failure = None;
    // Per group whose script admitted: the buckets it charged.
    let mut charged: Vec<Vec<usize>> = Vec::new();
    for ((_, members), answer) in groups.iter().zip(answers) {
        match answer {
            Ok((blocked, group_verdicts)) => {
                any_blocked |= blocked;
                let mut group_charged = Vec::new();
                for (&index, verdict) in members.iter().zip(group_verdicts) {
                    verdicts[index] = verdict;
                    if !blocked && verdict.allowed {
                        group_charged.push(index);
                    }
                }
                if !group_charged.is_empty() {
                    charged.push(group_charged);
                }
            }
            Err(error) => {
                failure.get_or_insert(error);
            }
        }
    }
    // Refused, or left to the fallback (Redis did not admit the request whole): what the
    // other groups charged goes back.
    let to_refund = if any_blocked || failure.is_some() {
        charged
    } else {
        Vec::new()
    };
    let result = match failure {
        Some(error) => Err(error),
        None => Ok(verdicts),
    };
    (result, to_refund)
}

async fn invoke(
    script: &KeyedScript,
    connection: &Connection,
    asks: Vec<&RedisAsk<'_>>,
) -> Result<(bool, Vec<RemoteVerdict>), RedisFailure> {
    let reply: String = script
        .run(connection, |command| {
            command.arg(asks.len());
            for ask in &asks {
                command.arg(ask.key);
            }
            // One request in the batch (see `limit/script.lua`), waiting for its decision.
            command.arg(1).arg(asks.len()).arg(0);
            for ask in &asks {
                command
                    .arg(ask.interval_us)
                    .arg(ask.burst)
                    .arg(if ask.dry_run { "1" } else { "0" });
            }
        })
        .await?;
    parse_reply(&reply, asks.len())
}

/// Gives one token back to each of `asks` that `groups` lists (one script call per slot
/// group, all at once), each call bounded by `bound`: a late refund is as right as an early one, and it
/// runs off the request path, so it gets longer than a decision, for a cluster that is
/// catching up after a failure.
async fn give_back(
    script: &KeyedScript,
    connection: &Connection,
    asks: &[RedisAsk<'_>],
    groups: &[Vec<usize>],
    bound: Duration,
) {
    let calls = groups.iter().map(|members| async move {
        let call = script.run::<i64>(connection, |command| {
            command.arg(members.len());
            for &index in members {
                command.arg(asks[index].key);
            }
            for &index in members {
                command.arg(asks[index].interval_us);
            }
        });
        match tokio::time::timeout(bound, call).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(
                keys = members.len(),
                "rate-limit refund failed: {error}; those tokens stay spent"
            ),
            Err(_elapsed) => tracing::warn!(
                keys = members.len(),
                "rate-limit refund got no answer within {bound:?}; those tokens may stay spent"
            ),
        }
    });
    futures_util::future::join_all(calls).await;
}

/// A Lua script called by its hash (`EVALSHA`), and sent whole (`EVAL`) to the one server
/// that does not have it yet (a new or restarted node).
///
/// redis-rs's own fallback loads a missing script with `SCRIPT LOAD`, which a cluster client
/// sends to every master: one frozen or dead master then failed the calls meant for all the
/// others, refunds included. `EVAL` carries the script to the node that serves the keys.
struct KeyedScript {
    code: &'static str,
    hash: String,
}

impl KeyedScript {
    fn new(code: &'static str) -> KeyedScript {
        KeyedScript {
            code,
            hash: redis::Script::new(code).get_hash().to_string(),
        }
    }

    /// Runs the script; `fill` appends the number of keys, the keys and the arguments.
    async fn run<T: redis::FromRedisValue>(
        &self,
        connection: &Connection,
        fill: impl Fn(&mut redis::Cmd),
    ) -> Result<T, redis::RedisError> {
        let mut by_hash = redis::cmd("EVALSHA");
        by_hash.arg(&self.hash);
        fill(&mut by_hash);
        match query(connection, &by_hash).await {
            Err(error)
                if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                let mut whole = redis::cmd("EVAL");
                whole.arg(self.code);
                fill(&mut whole);
                query(connection, &whole).await
            }
            answer => answer,
        }
    }
}

async fn query<T: redis::FromRedisValue>(
    connection: &Connection,
    command: &redis::Cmd,
) -> Result<T, redis::RedisError> {
    match connection.clone() {
        Connection::Single(mut connection) => command.query_async(&mut connection).await,
        Connection::Cluster(mut connection) => command.query_async(&mut connection).await,
    }
}

/// Reads the script's reply for one request (see `limit/script.lua`).
fn parse_reply(text: &str, count: usize) -> Result<(bool, Vec<RemoteVerdict>), RedisFailure> {
    let mut numbers = text.split(' ');
    match read_answer(&mut numbers, count) {
        Some((blocked, verdicts)) if numbers.next().is_none() => Ok((blocked > 0, verdicts)),
        _ => Err(RedisFailure::BadReply(format!(
            "not {count} rules' verdicts: {text:.80}"
        ))),
    }
}

/// Keeps the store alive in `Arc`s shared by policy generations.
pub type SharedRedis = Arc<RedisStore>;

/// A Redis URL fit to show (in `/status`, in `levee check` errors): the credentials of
/// `user:pass@` and the value of a `password` or `pass` query parameter become `***`.
pub fn redact_url(url: &str) -> String {
    // The credentials end at the last `@`, wherever it is: a password typed with a raw `?`,
    // `/` or `#` in it must not be taken for the start of the query or path and shown. An `@`
    // in the query hides the host as well, which errs on the safe side.
    let (scheme, rest) = match url.find("://") {
        Some(scheme_end) => url.split_at(scheme_end + 3),
        None => ("", url),
    };
    let (userinfo_hidden, rest) = match rest.rfind('@') {
        Some(at) => (true, &rest[at..]),
        None => (false, rest),
    };
    let (address, query) = match rest.split_once('?') {
        Some((address, query)) => (address, Some(query)),
        None => (rest, None),
    };
    let mut out = format!(
        "{scheme}{}{address}",
        if userinfo_hidden { "***" } else { "" }
    );
    if let Some(query) = query {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _))
                    if key.eq_ignore_ascii_case("password") || key.eq_ignore_ascii_case("pass") =>
                {
                    format!("{key}=***")
                }
                _ => pair.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&pairs.join("&"));
    }
    out
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url;

    #[test]
    fn credentials_are_hidden_wherever_the_url_carries_them() {
        assert_eq!(
            redact_url("redis://levee:s3cret@127.0.0.1:6379/0"),
            "redis://***@127.0.0.1:6379/0"
        );
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?db=1&pass=s3cret"),
            "redis+unix:///run/redis.sock?db=1&pass=***"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        for typed in [
            "redis://levee:pa?ss@127.0.0.1:6379/0",
            "redis://levee:pa/ss@127.0.0.1:6379/0",
            "redis://levee:pa#ss@127.0.0.1:6379/0",
            "redis://levee:pa@ss@127.0.0.1:6379/0",
        ] {
            let shown = redact_url(typed);
            assert_eq!(shown, "redis://***@127.0.0.1:6379/0", "{typed}");
        }
    }
}
