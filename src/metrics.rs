//! Prometheus metrics, served as text by the admin listener at `GET /metrics`.

use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::proxy::route::RouteName;

/// A label value written in the policy or learned at run time (an upstream's or module's
/// name, a Redis node's address): any text, so `"`, `\` and line breaks are escaped as the
/// text format asks. The encoder writes values as given, and one quote in a name made every
/// scrape of the whole page fail.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct LabelText(pub String);

impl From<String> for LabelText {
    fn from(text: String) -> LabelText {
        LabelText(text)
    }
}

impl From<&str> for LabelText {
    fn from(text: &str) -> LabelText {
        LabelText(text.to_string())
    }
}

impl EncodeLabelValue for LabelText {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        write_escaped(encoder, &self.0)
    }
}

/// Writes `text` as a label value: `\` as `\\`, `"` as `\"`, a line feed as `\n`.
pub(crate) fn write_escaped(out: &mut impl std::fmt::Write, text: &str) -> std::fmt::Result {
    let mut rest = text;
    while let Some(at) = rest.find(['\\', '"', '\n']) {
        out.write_str(&rest[..at])?;
        out.write_str(match rest.as_bytes()[at] {
            b'\\' => "\\\\",
            b'"' => "\\\"",
            _ => "\\n",
        })?;
        rest = &rest[at + 1..];
    }
    out.write_str(rest)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteStatusLabels {
    pub route: RouteName,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
    pub commit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: RouteName,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamErrorLabels {
    pub upstream: LabelText,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub rule: RouteName,
    pub result: DecisionResult,
    pub source: DecisionSource,
}

/// What a rate-limit decision said: its `result` label.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DecisionResult {
    Allowed,
    Limited,
    /// A dry-run rule would have refused.
    DryRunLimited,
}

/// Who made a rate-limit decision: its `source` label.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DecisionSource {
    Redis,
    /// Admitted at once, charged in the next script call.
    Ahead,
    /// No Redis configured.
    Local,
    /// Redis unavailable.
    Fallback,
    /// Known refused.
    Cache,
}

impl DecisionResult {
    /// Every `result` label.
    pub const ALL: [DecisionResult; 3] = [
        DecisionResult::Allowed,
        DecisionResult::Limited,
        DecisionResult::DryRunLimited,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionResult::Allowed => "allowed",
            DecisionResult::Limited => "limited",
            DecisionResult::DryRunLimited => "dry_run_limited",
        }
    }
}

impl DecisionSource {
    /// Every `source` label.
    pub const ALL: [DecisionSource; 5] = [
        DecisionSource::Redis,
        DecisionSource::Ahead,
        DecisionSource::Local,
        DecisionSource::Fallback,
        DecisionSource::Cache,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionSource::Redis => "redis",
            DecisionSource::Ahead => "ahead",
            DecisionSource::Local => "local",
            DecisionSource::Fallback => "fallback",
            DecisionSource::Cache => "cache",
        }
    }
}

impl EncodeLabelValue for DecisionResult {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl EncodeLabelValue for DecisionSource {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RedisStateLabels {
    pub to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RedisNodeLabels {
    pub node: LabelText,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BreakerLabels {
    pub upstream: LabelText,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BreakerTransitionLabels {
    pub upstream: LabelText,
    /// open, half_open, closed
    pub to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BreakerProbeLabels {
    pub upstream: LabelText,
    /// success, failure
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModuleLabels {
    pub module: LabelText,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NotKeptLabels {
    pub route: RouteName,
    /// private, credentials, set_cookie, vary, content_coded, too_large
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DegradedLabels {
    pub route: RouteName,
    /// stale, stale_missing, reject
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    pub upstream: LabelText,
    pub tier: u8,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LevelChangeLabels {
    /// up, down
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub route: LabelText,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueResultLabels {
    pub route: LabelText,
    /// done, retry, permanent, held
    pub result: &'static str,
}

/// The `kind`s of `levee_upstream_errors_total`.
const UPSTREAM_ERROR_KINDS: [&str; 4] = ["connect", "timeout", "failed", "body_cut"];
/// The `to`s of `levee_breaker_transitions_total`.
const BREAKER_STATES: [&str; 3] = ["open", "half_open", "closed"];

/// All of levee's metrics. Handles are cheap clones of shared atomics.
pub struct Metrics {
    pub registry: Registry,
    /// Held through a scrape (see `scrape`).
    scraping: std::sync::Mutex<()>,
    pub requests: Family<RouteStatusLabels, Counter>,
    pub request_duration: Family<RouteLabels, Histogram>,
    pub upstream_errors: Family<UpstreamErrorLabels, Counter>,
    pub inflight: Gauge,
    pub connections_open: Gauge,
    pub connection_cap_waits: Counter,
    pub accept_failures: Counter,
    pub policy_reloads: Counter,
    pub policy_reload_failures: Counter,
    /// 1 while the policy files on disk are refused (the latest reload failed), 0 once one
    /// loads.
    pub policy_refused: Gauge,
    /// Set when `/metrics` is read: the process's start, memory and open files.
    pub process_start_time: Gauge,
    pub process_resident_memory: Gauge,
    pub process_open_fds: Gauge,
    pub policy_generation: Gauge,
    pub ratelimit_decisions: Family<DecisionLabels, Counter>,
    pub redis_latency: Histogram,
    pub redis_up: Gauge,
    pub redis_full: Gauge,
    pub ratelimit_ahead_overruns: Counter,
    pub redis_transitions: Family<RedisStateLabels, Counter>,
    pub redis_node_up: Family<RedisNodeLabels, Gauge>,
    pub breaker_state: Family<BreakerLabels, Gauge>,
    pub breaker_pinned: Family<BreakerLabels, Gauge>,
    /// Set when `/metrics` is read, from the window the `latency_p95` trigger reads.
    pub upstream_latency_p95: Family<BreakerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub upstream_inflight: Family<BreakerLabels, Gauge>,
    pub breaker_transitions: Family<BreakerTransitionLabels, Counter>,
    pub breaker_rejected: Family<BreakerLabels, Counter>,
    pub breaker_probes: Family<BreakerProbeLabels, Counter>,
    pub degrade_level: Gauge,
    pub module_off: Family<ModuleLabels, Gauge>,
    pub degraded_responses: Family<DegradedLabels, Counter>,
    pub stale_not_kept: Family<NotKeptLabels, Counter>,
    pub breaker_held_closed: Family<BreakerLabels, Counter>,
    pub shed: Family<ShedLabels, Counter>,
    pub degrade_level_changes: Family<LevelChangeLabels, Counter>,
    pub queue_enqueued: Family<QueueLabels, Counter>,
    pub queue_replayed: Family<QueueResultLabels, Counter>,
    pub queue_retries: Family<QueueLabels, Counter>,
    pub queue_dead_lettered: Family<QueueLabels, Counter>,
    pub queue_dead_letters_dropped: Family<QueueLabels, Counter>,
    /// Jobs taken over from a worker that held them without renewing its hold for
    /// `claim_after` (not those a worker handed back unbegun).
    pub queue_taken_over: Family<QueueLabels, Counter>,
    pub queue_unconfirmed: Family<QueueResultLabels, Counter>,
    pub queue_backlog: Family<QueueLabels, Gauge>,
    pub queue_oldest_age: Family<QueueLabels, Gauge>,
}

fn duration_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// One route's request series, looked up in their families once per policy rather than on
/// every request: each lookup hashes the labels (SipHash) under the family's lock, and the
/// two of them cost more than the rest of reporting a request.
#[derive(Debug, Default)]
pub struct RouteSeries {
    duration: OnceLock<Histogram>,
    /// `levee_requests_total` with status 200, by far the most common.
    ok: OnceLock<Counter>,
    /// When the route last said in the log a thing said once a minute: why an answer was not
    /// kept as its stale copy (by reason), that its queue took up jobs another instance
    /// handed back.
    said: std::sync::Mutex<Vec<(&'static str, std::time::Instant)>>,
    /// A reload removed the route and dropped its series: a request still in flight then
    /// counts nowhere, or its end would bring them back for good.
    retired: std::sync::atomic::AtomicBool,
}

impl RouteSeries {
    /// Whether a reload removed the route (see [`Metrics::forget_removed`]).
    pub fn is_retired(&self) -> bool {
        self.retired.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the route may say `what` again (once a minute, each route and thing for
    /// itself: a visitor's logged-in page, `credentials`, must not take the line that says
    /// every view sets a cookie).
    pub fn said_due(&self, what: &'static str, now: std::time::Instant) -> bool {
        let mut said = self
            .said
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match said.iter_mut().find(|(known, _)| *known == what) {
            Some((_, last)) => {
                let due =
                    now.saturating_duration_since(*last) >= std::time::Duration::from_secs(60);
                if due {
                    *last = now;
                }
                due
            }
            None => {
                said.push((what, now));
                true
            }
        }
    }
}

/// One rate-limit rule's most common decision series (admitted, by the three usual sources),
/// looked up once per policy for the same reason as [`RouteSeries`]: a request with two rules
/// otherwise hashed two label sets on every request.
#[derive(Debug, Default)]
pub struct DecisionSeries {
    allowed_redis: OnceLock<Counter>,
    allowed_ahead: OnceLock<Counter>,
    allowed_local: OnceLock<Counter>,
    /// As [`RouteSeries`]'s: the rule was removed by a reload.
    retired: std::sync::atomic::AtomicBool,
}

impl Metrics {
    /// Counts one rate-limit decision of `rule` (named `name`; `series` is its cache).
    pub fn record_decision(
        &self,
        name: &Arc<str>,
        series: &DecisionSeries,
        result: DecisionResult,
        source: DecisionSource,
    ) {
        if series.retired.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let lookup = || {
            self.ratelimit_decisions
                .get_or_create(&DecisionLabels {
                    rule: RouteName(name.clone()),
                    result,
                    source,
                })
                .clone()
        };
        let cached = match (result, source) {
            (DecisionResult::Allowed, DecisionSource::Redis) => Some(&series.allowed_redis),
            (DecisionResult::Allowed, DecisionSource::Ahead) => Some(&series.allowed_ahead),
            (DecisionResult::Allowed, DecisionSource::Local) => Some(&series.allowed_local),
            _ => None,
        };
        match cached {
            Some(cell) => cell.get_or_init(lookup).inc(),
            None => lookup().inc(),
        };
    }

    /// Counts one finished request of `route` and its duration. `series` is the route's cache
    /// of its own series (`None` for requests that matched no route).
    pub fn record_request(
        &self,
        route: &RouteName,
        series: Option<&RouteSeries>,
        status: u16,
        seconds: f64,
    ) {
        let requests = |status| {
            self.requests
                .get_or_create(&RouteStatusLabels {
                    route: route.clone(),
                    status,
                })
                .clone()
        };
        let duration = || {
            self.request_duration
                .get_or_create(&RouteLabels {
                    route: route.clone(),
                })
                .clone()
        };
        match series {
            Some(series) if series.is_retired() => {}
            Some(series) => {
                if status == 200 {
                    series.ok.get_or_init(|| requests(200)).inc();
                } else {
                    requests(status).inc();
                }
                series.duration.get_or_init(duration).observe(seconds);
            }
            None => {
                requests(status).inc();
                duration().observe(seconds);
            }
        }
    }

    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("levee");
        let requests = Family::<RouteStatusLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests answered, by route and status",
            requests.clone(),
        );
        let request_duration = Family::<RouteLabels, Histogram>::new_with_constructor(
            duration_histogram as fn() -> Histogram,
        );
        registry.register(
            "request_duration_seconds",
            "Time from request head to the end of the response body, by route",
            request_duration.clone(),
        );
        let upstream_errors = Family::<UpstreamErrorLabels, Counter>::default();
        registry.register(
            "upstream_errors",
            "Failed upstream calls, by upstream and kind (connect, timeout, failed)",
            upstream_errors.clone(),
        );
        let inflight = Gauge::default();
        registry.register(
            "inflight_requests",
            "Requests being handled right now",
            inflight.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "connections_open",
            "Client connections open on the public listener, upgraded tunnels included",
            connections_open.clone(),
        );
        let connection_cap_waits = Counter::default();
        registry.register(
            "connection_cap_waits",
            "Times the public listener stopped accepting because max_connections were open",
            connection_cap_waits.clone(),
        );
        let accept_failures = Counter::default();
        registry.register(
            "accept_failures",
            "Failed attempts of the public listener to take a connection from the kernel (mostly out of open files; tried again every 50 ms while it lasts)",
            accept_failures.clone(),
        );
        let policy_reloads = Counter::default();
        registry.register(
            "policy_reloads",
            "Policy reloads that compiled and were swapped in",
            policy_reloads.clone(),
        );
        let policy_reload_failures = Counter::default();
        registry.register(
            "policy_reload_failures",
            "Policy reloads refused because the new files had errors",
            policy_reload_failures.clone(),
        );
        let policy_refused = Gauge::default();
        registry.register(
            "policy_refused",
            "1 while the policy files on disk are refused (the latest reload failed; the running policy stays), 0 once a reload loads them",
            policy_refused.clone(),
        );
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                commit: env!("LEVEE_COMMIT"),
            })
            .set(1);
        registry.register(
            "build_info",
            "1, labelled with levee's version and the commit it was built from",
            build_info,
        );
        let process_start_time = Gauge::default();
        process_start_time.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_secs() as i64),
        );
        registry.register(
            "process_start_time_seconds",
            "When levee started, in seconds since the Unix epoch: a restart moves it",
            process_start_time.clone(),
        );
        let process_resident_memory = Gauge::default();
        registry.register(
            "process_resident_memory_bytes",
            "levee's resident memory (read when /metrics is)",
            process_resident_memory.clone(),
        );
        let process_open_fds = Gauge::default();
        registry.register(
            "process_open_fds",
            "File descriptors levee has open (read when /metrics is): about two per client connection, against the open-file limit",
            process_open_fds.clone(),
        );
        let policy_generation = Gauge::default();
        registry.register(
            "policy_generation",
            "Generation number of the active policy",
            policy_generation.clone(),
        );
        let ratelimit_decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "ratelimit_decisions",
            "Rate-limit decisions by rule, result and where they were made",
            ratelimit_decisions.clone(),
        );
        let redis_latency =
            Histogram::new([0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1]);
        registry.register(
            "redis_latency_seconds",
            "Time of rate-limit calls to Redis, including timeouts",
            redis_latency.clone(),
        );
        let redis_up = Gauge::default();
        redis_up.set(1);
        registry.register(
            "redis_up",
            "1 while levee's latest call to Redis (of any kind) got an answer, 0 while it failed",
            redis_up.clone(),
        );
        let redis_full = Gauge::default();
        registry.register(
            "redis_full",
            "1 for a minute after a full Redis (OOM) refused a call: it answers reads and refuses writes (queue routes answer 503, rate limits fall back)",
            redis_full.clone(),
        );
        let ratelimit_ahead_overruns = Counter::default();
        registry.register(
            "ratelimit_ahead_overruns",
            "Requests admitted ahead of Redis (source=ahead) that Redis then refused: another instance had used the tokens in the meantime",
            ratelimit_ahead_overruns.clone(),
        );
        let redis_transitions = Family::<RedisStateLabels, Counter>::default();
        registry.register(
            "redis_transitions",
            "Switches between Redis and the fallback (to=down / to=up)",
            redis_transitions.clone(),
        );
        let redis_node_up = Family::<RedisNodeLabels, Gauge>::default();
        registry.register(
            "redis_node_up",
            "Redis Cluster: 1 while a master node is used for the rate-limit buckets, queue streams and stale copies it holds, 0 while its health breaker is open",
            redis_node_up.clone(),
        );
        let breaker_state = Family::<BreakerLabels, Gauge>::default();
        registry.register(
            "breaker_state",
            "Breaker state per upstream: 0 closed, 1 open, 2 half-open",
            breaker_state.clone(),
        );
        let breaker_pinned = Family::<BreakerLabels, Gauge>::default();
        registry.register(
            "breaker_pinned",
            "1 while the upstream's breaker is pinned open or closed (by the policy's force or at runtime), 0 while it counts for itself",
            breaker_pinned.clone(),
        );
        let upstream_latency_p95 =
            Family::<BreakerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "upstream_latency_p95_seconds",
            "95th percentile of the upstream's latency over the last 10 s, from the request sent whole to the end of the answer's body, counting only the wait for the upstream's bytes (the latency_p95 trigger's input); absent while it has no samples",
            upstream_latency_p95.clone(),
        );
        let upstream_inflight = Family::<BreakerLabels, Gauge>::default();
        registry.register(
            "upstream_inflight",
            "Slots of the upstream's max_inflight taken now, calls whose clients left and that run on included; only for an upstream with max_inflight",
            upstream_inflight.clone(),
        );
        let breaker_transitions = Family::<BreakerTransitionLabels, Counter>::default();
        registry.register(
            "breaker_transitions",
            "Breaker state changes per upstream (to=open counts the opens)",
            breaker_transitions.clone(),
        );
        let breaker_rejected = Family::<BreakerLabels, Counter>::default();
        registry.register(
            "breaker_rejected",
            "Requests answered with the fallback because the upstream's breaker was open",
            breaker_rejected.clone(),
        );
        let breaker_probes = Family::<BreakerProbeLabels, Counter>::default();
        registry.register(
            "breaker_probes",
            "Half-open probes and their outcome",
            breaker_probes.clone(),
        );
        let degrade_level = Gauge::default();
        registry.register(
            "degrade_level",
            "Degrade level in effect (0 normal, 1 tier 3 off, 2 tiers 2 and 3 off)",
            degrade_level.clone(),
        );
        let module_off = Family::<ModuleLabels, Gauge>::default();
        registry.register(
            "module_off",
            "1 while a module is switched off",
            module_off.clone(),
        );
        let degraded_responses = Family::<DegradedLabels, Counter>::default();
        registry.register(
            "degraded_responses",
            "Responses given by a degrade action instead of the upstream",
            degraded_responses.clone(),
        );
        let stale_not_kept = Family::<NotKeptLabels, Counter>::default();
        registry.register(
            "stale_not_kept",
            "Answers of 200 on a stale route not kept as its copy, by why (private, credentials, cookie_no_cache, set_cookie, vary, content_coded, too_large, event_stream, own_cookie): a route whose every answer is refused has no copy to serve when the app fails",
            stale_not_kept.clone(),
        );
        let breaker_held_closed = Family::<BreakerLabels, Counter>::default();
        registry.register(
            "breaker_held_closed",
            "Failures that would have opened the upstream's breaker but came from fewer distinct clients than failing_clients: a page failing for a few visitors, or an outage on a site with fewer visitors than that",
            breaker_held_closed.clone(),
        );
        let shed = Family::<ShedLabels, Counter>::default();
        registry.register(
            "shed",
            "Requests refused because the upstream was at max_inflight, by tier",
            shed.clone(),
        );
        let degrade_level_changes = Family::<LevelChangeLabels, Counter>::default();
        registry.register(
            "degrade_level_changes",
            "Automatic level changes by triggers",
            degrade_level_changes.clone(),
        );
        let queue_enqueued = Family::<QueueLabels, Counter>::default();
        registry.register(
            "queue_enqueued",
            "Jobs stored by queue routes (each answered 202)",
            queue_enqueued.clone(),
        );
        let queue_replayed = Family::<QueueResultLabels, Counter>::default();
        registry.register(
            "queue_replayed",
            "Job replays by result (done, retry, permanent, held)",
            queue_replayed.clone(),
        );
        let queue_retries = Family::<QueueLabels, Counter>::default();
        registry.register(
            "queue_retries",
            "Jobs parked for a retry with back-off",
            queue_retries.clone(),
        );
        let queue_dead_lettered = Family::<QueueLabels, Counter>::default();
        registry.register(
            "queue_dead_lettered",
            "Jobs moved to the dead-letter stream",
            queue_dead_lettered.clone(),
        );
        let queue_dead_letters_dropped = Family::<QueueLabels, Counter>::default();
        registry.register(
            "queue_dead_letters_dropped",
            "Oldest dead letters dropped to keep max_dead_letters",
            queue_dead_letters_dropped.clone(),
        );
        let queue_taken_over = Family::<QueueLabels, Counter>::default();
        registry.register(
            "queue_taken_over",
            "Jobs taken over from a worker that had not renewed its hold for claim_after (it died, hung or lost Redis): the app may see one of them a second time",
            queue_taken_over.clone(),
        );
        let queue_unconfirmed = Family::<QueueResultLabels, Counter>::default();
        registry.register(
            "queue_unconfirmed",
            "Jobs fewer than wait_replicas replicas confirmed within wait_timeout, by result (withdrawn, accepted, kept, unsettled)",
            queue_unconfirmed.clone(),
        );
        let queue_backlog = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "queue_backlog",
            "Jobs waiting (in the stream or parked for a retry)",
            queue_backlog.clone(),
        );
        let queue_oldest_age = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "queue_oldest_job_age_seconds",
            "Age of the oldest job in the stream",
            queue_oldest_age.clone(),
        );
        Metrics {
            registry,
            scraping: std::sync::Mutex::new(()),
            queue_enqueued,
            queue_replayed,
            queue_retries,
            queue_dead_lettered,
            queue_dead_letters_dropped,
            queue_taken_over,
            queue_unconfirmed,
            queue_backlog,
            queue_oldest_age,
            degrade_level_changes,
            shed,
            degrade_level,
            module_off,
            degraded_responses,
            stale_not_kept,
            breaker_held_closed,
            breaker_state,
            breaker_pinned,
            upstream_latency_p95,
            upstream_inflight,
            breaker_transitions,
            breaker_rejected,
            breaker_probes,
            ratelimit_decisions,
            redis_latency,
            redis_up,
            redis_full,
            ratelimit_ahead_overruns,
            redis_transitions,
            connections_open,
            connection_cap_waits,
            accept_failures,
            redis_node_up,
            requests,
            request_duration,
            upstream_errors,
            inflight,
            policy_reloads,
            policy_reload_failures,
            policy_refused,
            process_start_time,
            process_resident_memory,
            process_open_fds,
            policy_generation,
        }
    }

    /// Reads the process's memory and open files, for a scrape (Linux's /proc; left as they
    /// were elsewhere).
    pub fn read_process(&self) {
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            let resident_kib = status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|value| {
                    value
                        .trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<i64>()
                        .ok()
                });
            if let Some(kib) = resident_kib {
                self.process_resident_memory.set(kib.saturating_mul(1024));
            }
        }
        if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
            // Less the descriptor this read holds open.
            self.process_open_fds
                .set((entries.count() as i64).saturating_sub(1));
        }
    }

    /// Makes, at zero, the series of counters the policy's upstreams and queue routes may
    /// count, before their first event: a series that appears at its first count has no
    /// earlier sample, so `increase()` and `rate()` saw nothing of the first burst (the
    /// first jobs dead-lettered after a start were never alerted on).
    pub fn prime(&self, policy: &crate::config::Policy) {
        for upstream in policy.upstreams.values() {
            let name: LabelText = upstream.name.clone().into();
            for kind in UPSTREAM_ERROR_KINDS {
                drop(self.upstream_errors.get_or_create(&UpstreamErrorLabels {
                    upstream: name.clone(),
                    kind,
                }));
            }
            for to in BREAKER_STATES {
                drop(
                    self.breaker_transitions
                        .get_or_create(&BreakerTransitionLabels {
                            upstream: name.clone(),
                            to,
                        }),
                );
            }
            drop(self.breaker_rejected.get_or_create(&BreakerLabels {
                upstream: name.clone(),
            }));
            if upstream.bulkhead.is_some() {
                for tier in 1..=3 {
                    drop(self.shed.get_or_create(&ShedLabels {
                        upstream: name.clone(),
                        tier,
                    }));
                }
            }
        }
        for route in policy
            .routes
            .routes
            .iter()
            .filter(|route| route.queue.is_some())
        {
            let labels = QueueLabels {
                route: route.name.to_string().into(),
            };
            for family in [
                &self.queue_enqueued,
                &self.queue_retries,
                &self.queue_dead_lettered,
                &self.queue_dead_letters_dropped,
            ] {
                drop(family.get_or_create(&labels));
            }
        }
        if policy.redis.is_some() {
            for to in ["down", "up"] {
                drop(
                    self.redis_transitions
                        .get_or_create(&RedisStateLabels { to }),
                );
            }
        }
    }

    /// Drops the series of the routes, upstreams and rate-limit rules that `policy` no longer
    /// has and `previous` had: each name ever loaded kept its ~20 lines on the page (a soak of
    /// reloads adding and removing a route grew it without end). A queue route's stay while
    /// its jobs may still be in Redis. Requests of a removed route (and decisions of a removed
    /// rule) still in flight count nowhere after this: their ends brought the series back.
    pub fn forget_removed(&self, previous: &crate::config::Policy, policy: &crate::config::Policy) {
        let kept: std::collections::HashSet<&str> = policy
            .routes
            .routes
            .iter()
            .map(|route| &*route.name.0)
            .collect();
        for route in previous
            .routes
            .routes
            .iter()
            .filter(|route| !kept.contains(&*route.name.0))
        {
            route
                .series
                .retired
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let name = &route.name;
            for status in 100..=999 {
                self.requests.remove(&RouteStatusLabels {
                    route: name.clone(),
                    status,
                });
            }
            self.request_duration.remove(&RouteLabels {
                route: name.clone(),
            });
            for action in ["stale", "stale_missing", "reject"] {
                self.degraded_responses.remove(&DegradedLabels {
                    route: name.clone(),
                    action,
                });
            }
            for reason in crate::degrade::stale::NOT_KEPT_REASONS {
                self.stale_not_kept.remove(&NotKeptLabels {
                    route: name.clone(),
                    reason,
                });
            }
        }
        for upstream in previous
            .upstreams
            .keys()
            .filter(|name| !policy.upstreams.contains_key(*name))
        {
            let upstream: LabelText = upstream.clone().into();
            for kind in UPSTREAM_ERROR_KINDS {
                self.upstream_errors.remove(&UpstreamErrorLabels {
                    upstream: upstream.clone(),
                    kind,
                });
            }
            for to in BREAKER_STATES {
                self.breaker_transitions.remove(&BreakerTransitionLabels {
                    upstream: upstream.clone(),
                    to,
                });
            }
            for result in ["success", "failure"] {
                self.breaker_probes.remove(&BreakerProbeLabels {
                    upstream: upstream.clone(),
                    result,
                });
            }
            let labels = BreakerLabels {
                upstream: upstream.clone(),
            };
            self.breaker_rejected.remove(&labels);
            self.breaker_held_closed.remove(&labels);
            for tier in 1..=3 {
                self.shed.remove(&ShedLabels {
                    upstream: upstream.clone(),
                    tier,
                });
            }
        }
        for (rule, removed) in previous
            .limits
            .iter()
            .filter(|(name, _)| !policy.limits.contains_key(*name))
        {
            removed
                .series
                .retired
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let rule = RouteName(std::sync::Arc::from(rule.as_str()));
            for result in DecisionResult::ALL {
                for source in DecisionSource::ALL {
                    self.ratelimit_decisions.remove(&DecisionLabels {
                        rule: rule.clone(),
                        result,
                        source,
                    });
                }
            }
        }
    }

    /// Runs `update` (what only a scrape sets: it may clear a family and fill it again) and
    /// encodes the page, one scrape at a time: a second scrape at once (two dashboard tabs,
    /// two Prometheus servers) encoded a family between its clearing and its filling, and a
    /// breaker's state was missing from its page.
    pub fn scrape(&self, update: impl FnOnce()) -> String {
        let _one_at_a_time = self
            .scraping
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        update();
        self.encode()
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_route_says_each_thing_once_a_minute_apart_from_the_others() {
        let series = RouteSeries::default();
        let start = std::time::Instant::now();
        let later = |seconds| start + std::time::Duration::from_secs(seconds);
        assert!(series.said_due("handed_back", start));
        assert!(!series.said_due("handed_back", later(59)));
        assert!(
            series.said_due("private", later(59)),
            "another thing is said apart"
        );
        assert!(series.said_due("handed_back", later(60)));
    }

    #[test]
    fn names_with_quotes_and_backslashes_are_escaped_in_label_values() {
        let metrics = Metrics::new();
        metrics
            .requests
            .get_or_create(&RouteStatusLabels {
                route: RouteName(Arc::from(r#"api "v2"\"#)),
                status: 200,
            })
            .inc();
        metrics
            .breaker_state
            .get_or_create(&BreakerLabels {
                upstream: "php \\ \"fpm\"\n".into(),
            })
            .set(1);
        let text = metrics.encode();
        assert!(
            text.contains(r#"levee_requests_total{route="api \"v2\"\\",status="200"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"levee_breaker_state{upstream="php \\ \"fpm\"\n"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn a_rules_cached_decision_series_are_the_families_own_across_reloads() {
        let metrics = Metrics::new();
        let rule: Arc<str> = Arc::from("per_ip");
        let before_reload = DecisionSeries::default();
        metrics.record_decision(
            &rule,
            &before_reload,
            DecisionResult::Allowed,
            DecisionSource::Ahead,
        );
        metrics.record_decision(
            &rule,
            &before_reload,
            DecisionResult::Allowed,
            DecisionSource::Ahead,
        );
        metrics.record_decision(
            &rule,
            &before_reload,
            DecisionResult::Limited,
            DecisionSource::Redis,
        );
        let after_reload = DecisionSeries::default();
        metrics.record_decision(
            &rule,
            &after_reload,
            DecisionResult::Allowed,
            DecisionSource::Ahead,
        );
        metrics.record_decision(
            &rule,
            &after_reload,
            DecisionResult::Allowed,
            DecisionSource::Fallback,
        );
        let text = metrics.encode();
        for line in [
            "levee_ratelimit_decisions_total{rule=\"per_ip\",result=\"allowed\",source=\"ahead\"} 3",
            "levee_ratelimit_decisions_total{rule=\"per_ip\",result=\"limited\",source=\"redis\"} 1",
            "levee_ratelimit_decisions_total{rule=\"per_ip\",result=\"allowed\",source=\"fallback\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }

    #[test]
    fn a_routes_cached_series_are_the_families_own_across_reloads() {
        let metrics = Metrics::new();
        let route = RouteName(Arc::from("shop"));
        let before_reload = RouteSeries::default();
        metrics.record_request(&route, Some(&before_reload), 200, 0.01);
        metrics.record_request(&route, Some(&before_reload), 404, 0.01);
        // A reload compiles the route again, with empty caches: the counts carry on.
        let after_reload = RouteSeries::default();
        metrics.record_request(&route, Some(&after_reload), 200, 0.01);
        metrics.record_request(&RouteName(Arc::from("-")), None, 404, 0.01);
        let text = metrics.encode();
        for line in [
            "levee_requests_total{route=\"shop\",status=\"200\"} 2",
            "levee_requests_total{route=\"shop\",status=\"404\"} 1",
            "levee_requests_total{route=\"-\",status=\"404\"} 1",
            "levee_request_duration_seconds_count{route=\"shop\"} 3",
            "levee_request_duration_seconds_count{route=\"-\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }
}
