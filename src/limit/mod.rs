//! Rate limits: GCRA per IP / user / route / API key / header / cookie / query, shared
//! through Redis (decisions batched into script calls, or admitted ahead and charged right
//! after) or in-process without Redis.
//!
//! Order of a decision:
//! 1. build each rule's bucket key (a rule whose key part is missing is skipped, or keyed by
//!    IP when the rule says `missing = "ip"`);
//! 2. keys already known to be refused (deny cache) are refused without asking anyone;
//! 3. with Redis: one script decides all rules at once, all or nothing (batched with other
//!    requests' decisions on a single server); while Redis's last answers left every bucket
//!    more than `[redis] admit_ahead_above` of its burst, the request is admitted at once and
//!    the script charges it in the background (`source="ahead"`); without Redis (or while its
//!    health breaker is open), each rule's `on_redis_error` decides: an in-process share
//!    (its bucket no fuller than Redis's last refusal of the key left it), allow or deny;
//! 4. dry-run rules are counted and logged, never enforced.

pub mod gcra;
pub mod key;
pub mod local;

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, StatusCode};
use smallvec::SmallVec;
use tokio::time::Instant;

use crate::error::ProxyError;
use crate::metrics::{DecisionResult, DecisionSeries, DecisionSource, Metrics};
use crate::redis_batch::RedisRule;
use crate::redis_store::{RedisAsk, RedisStore, RemoteVerdict};
use gcra::{Rate, Verdict};
pub use key::client_network;
use key::{bucket_key_within, BucketKey, KeyPart, RequestFacts};
use local::{Ask, DenyCache, LocalStore, Refused};

/// What a rule does while Redis cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRedisError {
    /// Apply `rate / instances` in-process (default).
    Local,
    /// Let every request through.
    Allow,
    /// Refuse every request (429).
    Deny,
}

/// A compiled `[limit.NAME]` rule.
#[derive(Debug)]
pub struct LimitRule {
    pub name: Arc<str>,
    pub parts: Vec<KeyPart>,
    pub rate: Rate,
    /// As written in the policy, for headers and `/status`.
    pub rate_text: String,
    /// A request without a key part is keyed by client IP instead of skipping the rule.
    pub missing_uses_ip: bool,
    /// The IPv6 network one client is, when keyed by `ip` (`ipv6_prefix`, 64 by default).
    pub ipv6_prefix: u8,
    pub dry_run: bool,
    pub on_redis_error: OnRedisError,
    /// `RateLimit-Policy` / `RateLimit` on 429 answers. Default true.
    pub headers: bool,
    /// `RateLimit-Policy` / `RateLimit` on admitted answers too. Default false.
    pub headers_on_allow: bool,
    /// Status of a refusal. Default 429.
    pub status: StatusCode,
    pub body_html: Option<Arc<str>>,
    pub body_json: Option<Arc<str>>,
    /// This rule's cached `/metrics` series.
    pub series: DecisionSeries,
    /// `rate` and `dry_run` as the Redis script takes them.
    pub redis: RedisRule,
}

/// A refusal, turned into a response by [`ProxyError::to_response`].
#[derive(Debug)]
pub struct Denial {
    pub rule: Arc<LimitRule>,
    /// The rate the refusing bucket applied: the rule's own, or this instance's share of
    /// it while Redis is out (`rate / instances`), so `RateLimit-Policy` says the quota
    /// the client actually met.
    pub quota: Rate,
    pub retry_after: Duration,
    pub reset: Duration,
}

/// Header values for an admitted request whose rules ask for them.
#[derive(Debug, Clone)]
pub struct RateLimitHeaders {
    pub policy: HeaderValue,
    pub state: HeaderValue,
}

/// `"name";q=BURST;w=SECONDS` — the quota of the IETF `RateLimit-Policy` field for `rule`
/// applied at `rate` (its own, or an instance's share while Redis is out). `None` for a
/// rule whose name a structured field cannot carry (see [`quoted_name`]).
pub fn policy_field(rule: &LimitRule, rate: Rate) -> Option<String> {
    let capacity = Duration::from_micros(rate.capacity_us()).as_secs_f64();
    let window = capacity.ceil().max(1.0);
    // The draft's window is whole seconds. A bucket that fills in under one (`10/s` with
    // `burst = 5`) has its steady rate said as the quota of one second: said as `burst`
    // per second, it read as half the rate it is.
    let quota = if capacity < 1.0 {
        u64::from(rate.burst).max(rate.per_second().floor() as u64)
    } else {
        u64::from(rate.burst)
    };
    let mut field = quoted_name(&rule.name)?;
    let _ = write!(field, ";q={quota};w={}", window as u64);
    Some(field)
}

/// `"name";r=REMAINING;t=SECONDS` — the IETF `RateLimit` field. `None` as for
/// [`policy_field`].
pub fn state_field(rule: &LimitRule, remaining: u32, reset: Duration) -> Option<String> {
    let mut field = quoted_name(&rule.name)?;
    let _ = write!(
        field,
        ";r={};t={}",
        remaining,
        reset.as_secs_f64().ceil() as u64
    );
    Some(field)
}

/// A rule's name as a structured-field string (RFC 8941 3.3.3): quoted, with `"` and `\`
/// escaped. Such a string holds printable ASCII only: a name with anything else (`发帖`)
/// has no spelling a client's parser would accept, so its fields are left out rather than
/// sent broken (a client that reads them would reject the whole field).
fn quoted_name(name: &str) -> Option<String> {
    if !name.bytes().all(|byte| (b' '..=b'~').contains(&byte)) {
        return None;
    }
    // Room for the parameters the caller writes after it.
    let mut quoted = String::with_capacity(name.len() + 48);
    quoted.push('"');
    for c in name.chars() {
        if matches!(c, '"' | '\\') {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    Some(quoted)
}

/// Process-wide limiter state. It outlives policy reloads, so buckets survive them.
pub struct Limiter {
    local: LocalStore,
    fallback: LocalStore,
    denied: DenyCache,
    epoch: Instant,
    metrics: Arc<Metrics>,
}

/// Default bound on in-process buckets (each store) and on the deny cache.
pub const MAX_LOCAL_KEYS: usize = 100_000;

struct Planned<'a> {
    rule: &'a Arc<LimitRule>,
    key: Cow<'a, BucketKey>,
}

/// A request's decisions, one per rule: kept off the heap, as rules are few.
type Decisions = SmallVec<[Decided; 2]>;

/// Per rule: allowed?, remaining, reset, retry-after, and where the decision came from.
struct Decided {
    allowed: bool,
    remaining: u32,
    reset: Duration,
    retry_after: Duration,
    source: DecisionSource,
    /// A bucket was asked: `remaining` and `reset` say something. False for a rule let
    /// through (or refused) by its `on_redis_error` without any bucket, whose fields would
    /// tell a client "none left" about a bucket nobody looked at.
    measured: bool,
}

impl Limiter {
    pub fn new(metrics: Arc<Metrics>) -> Limiter {
        Limiter {
            local: LocalStore::new(MAX_LOCAL_KEYS),
            fallback: LocalStore::new(MAX_LOCAL_KEYS),
            denied: DenyCache::new(MAX_LOCAL_KEYS),
            epoch: Instant::now(),
            metrics,
        }
    }

    /// levee's clock in µs (tokio's, so tests can pause and advance it).
    fn now_us(&self) -> u64 {
        self.micros_at(Instant::now())
    }

    /// A reading of levee's clock in µs.
    fn micros_at(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_micros())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    /// Drops idle buckets and expired deny-cache entries. Called periodically.
    pub fn sweep(&self) {
        let now = self.now_us();
        self.local.sweep(now);
        self.fallback.sweep(now);
        self.denied.sweep(now);
    }

    /// Decides a request against `rules`. `Ok(headers)` admits it (with `RateLimit` headers
    /// when a rule asks for them on admitted answers); `Err` is the 429.
    /// `fixed_keys`: per rule, its key when the route alone decides it (`Route::fixed_keys`,
    /// built with the same `prefix`), or empty.
    /// `read_at`: the request's reading of the clock, microseconds old (a read costs as much
    /// as a tenth of the decision).
    pub async fn check(
        &self,
        rules: &[Arc<LimitRule>],
        fixed_keys: &[Option<BucketKey>],
        redis: Option<&RedisStore>,
        prefix: &str,
        facts: &RequestFacts<'_>,
        read_at: Instant,
    ) -> Result<Option<RateLimitHeaders>, ProxyError> {
        // A key the app may read otherwise than levee would be a fresh bucket per decoy.
        // The client is told what is ambiguous in its request; only the log names the rule.
        if let Some((rule, reason)) = rules
            .iter()
            .filter(|rule| !rule.dry_run)
            .find_map(|rule| key::unreadable_part(&rule.parts, facts).map(|reason| (rule, reason)))
        {
            let detail = format!("{reason} (rate limit `{}` is keyed by it)", rule.name);
            return Err(ProxyError::BadRequest {
                reason,
                detail: Some(detail),
            });
        }
        debug_assert!(fixed_keys.is_empty() || fixed_keys.len() == rules.len());
        let planned: SmallVec<[Planned<'_>; 2]> = rules
            .iter()
            .enumerate()
            .filter_map(|(at, rule)| {
                let key = match fixed_keys.get(at) {
                    Some(Some(fixed)) => Cow::Borrowed(fixed),
                    _ => Cow::Owned(bucket_key_within(
                        prefix,
                        &rule.name,
                        &rule.parts,
                        facts,
                        rule.missing_uses_ip,
                        rule.ipv6_prefix,
                    )?),
                };
                Some(Planned { rule, key })
            })
            .collect();
        if planned.is_empty() {
            return Ok(None);
        }
        let now = self.micros_at(read_at);

        // Keys that Redis already refused until a known time: refuse without a round trip,
        // naming the rule that refuses longest (a client told the quick rule's wait would
        // come back to the slow rule's refusal).
        if redis.is_some() {
            let cached = planned
                .iter()
                .filter_map(|plan| {
                    if plan.rule.dry_run {
                        return None;
                    }
                    self.denied
                        .refused(&plan.key.key, plan.rule.rate, now)
                        .map(|refused| (plan, refused))
                })
                .max_by_key(|(_, refused)| refused.until);
            if let Some((plan, refused)) = cached {
                let wait = Duration::from_micros(refused.until.saturating_sub(now));
                let reset = Duration::from_micros(refused.full_at.saturating_sub(now)).max(wait);
                self.count(plan.rule, DecisionResult::Limited, DecisionSource::Cache);
                return Err(deny(plan.rule, plan.rule.rate, wait, reset));
            }
        }

        let decided = match redis {
            Some(redis) => self.decide_with_redis(&planned, redis, read_at).await,
            None => self.decide_locally(&planned, false, 1),
        };

        let mut refusal: Option<(&Planned<'_>, &Decided)> = None;
        // A rule that refuses because Redis is out (`on_redis_error = "deny"`), even when
        // another rule's refusal is the one the client is told.
        let mut refused_for_redis: Option<&Planned<'_>> = None;
        let mut tightest: Option<(&Planned<'_>, &Decided)> = None;
        for (plan, decision) in planned.iter().zip(&decided) {
            let result = match (decision.allowed, plan.rule.dry_run) {
                (true, _) => DecisionResult::Allowed,
                (false, true) => DecisionResult::DryRunLimited,
                (false, false) => DecisionResult::Limited,
            };
            self.count(plan.rule, result, decision.source);
            if !decision.allowed && plan.rule.dry_run {
                // At most once per 10 s (a rule too tight for its traffic wrote one line per
                // request, more than the access log), and without the key, which may hold a
                // session cookie or an API key: the count is in the metrics.
                static DRY_RUN: crate::log_throttle::LogThrottle =
                    crate::log_throttle::LogThrottle::new(Duration::from_secs(10));
                if let Some(held_back) = DRY_RUN.allow(std::time::Instant::now()) {
                    tracing::info!(rule = %plan.rule.name, client = %facts.client_ip, held_back, "dry run: a request would have been rate limited (said at most every 10 s; levee_ratelimit_decisions_total{{result=\"dry_run_limited\"}} counts them)");
                }
            }
            if !decision.allowed && !plan.rule.dry_run {
                if redis.is_some() && decision.source == DecisionSource::Redis {
                    let after = |wait: Duration| {
                        now.saturating_add(u64::try_from(wait.as_micros()).unwrap_or(u64::MAX))
                    };
                    let refused = Refused {
                        until: after(decision.retry_after),
                        full_at: after(decision.reset),
                        rate: plan.rule.rate,
                    };
                    self.denied.insert(&plan.key.key, refused, now);
                }
                if decision.source == DecisionSource::Fallback && !decision.measured {
                    refused_for_redis = refused_for_redis.or(Some(plan));
                }
                if refusal.is_none_or(|(_, worst)| decision.retry_after > worst.retry_after) {
                    refusal = Some((plan, decision));
                }
            }
            if decision.allowed
                && decision.measured
                && plan.rule.headers_on_allow
                && tightest.is_none_or(|(_, t)| decision.remaining < t.remaining)
            {
                tightest = Some((plan, decision));
            }
        }
        // Not a client over its rate: say so where the operator looks, as the 429 and the
        // access log read alike either way.
        if let Some(plan) = refused_for_redis {
            if let Some(held_back) = REDIS_DENIALS.allow(std::time::Instant::now()) {
                tracing::warn!(rule = %plan.rule.name, held_back, "requests refused because redis cannot be used and the rule's on_redis_error is \"deny\"");
            }
        }
        // The quota a fallback bucket applied is this instance's share of the rule's.
        let quota = |plan: &Planned<'_>, decision: &Decided| match (decision.source, redis) {
            (DecisionSource::Fallback, Some(redis)) => {
                plan.rule.rate.share(redis.settings.instances)
            }
            _ => plan.rule.rate,
        };
        if let Some((plan, decision)) = refusal {
            return Err(deny(
                plan.rule,
                quota(plan, decision),
                decision.retry_after,
                decision.reset,
            ));
        }
        Ok(tightest.and_then(|(plan, decision)| {
            let policy =
                HeaderValue::from_str(&policy_field(plan.rule, quota(plan, decision))?).ok()?;
            let state =
                HeaderValue::from_str(&state_field(plan.rule, decision.remaining, decision.reset)?)
                    .ok()?;
            Some(RateLimitHeaders { policy, state })
        }))
    }

    async fn decide_with_redis(
        &self,
        planned: &[Planned<'_>],
        redis: &RedisStore,
        now: Instant,
    ) -> Decisions {
        let asks: SmallVec<[RedisAsk<'_>; 2]> = planned
            .iter()
            .map(|plan| RedisAsk {
                key: &plan.key.key,
                tag: plan.key.tag(),
                rule: &plan.rule.redis,
            })
            .collect();
        let from_redis = |verdicts: &[RemoteVerdict], source: DecisionSource| -> Decisions {
            verdicts
                .iter()
                .map(|verdict| Decided {
                    allowed: verdict.allowed,
                    remaining: verdict.remaining,
                    reset: Duration::from_millis(verdict.reset_ms),
                    retry_after: Duration::from_millis(verdict.retry_after_ms),
                    source,
                    measured: true,
                })
                .collect()
        };
        if let Some(verdicts) = redis.admit_ahead(&asks, &self.metrics, now) {
            return from_redis(&verdicts, DecisionSource::Ahead);
        }
        // Boxed: the Redis call's state is most of a limited request's future, which every
        // request through `proxy::handle` would otherwise carry and copy (see `proxy::forward`).
        match Box::pin(redis.decide_all(&asks, &self.metrics)).await {
            Ok(verdicts) => from_redis(&verdicts, DecisionSource::Redis),
            Err(failure) => {
                tracing::debug!("rate limit falls back: {failure}");
                self.decide_locally(planned, true, redis.settings.instances)
                    .into_iter()
                    .zip(planned)
                    .map(|(mut decision, plan)| {
                        if plan.rule.on_redis_error == OnRedisError::Deny {
                            decision.retry_after = redis.settings.cooldown;
                        }
                        decision
                    })
                    .collect()
            }
        }
    }

    /// In-process decisions. As a Redis fallback (`fallback`), each rule follows its
    /// `on_redis_error`, and `local` rules get `rate / instances`.
    fn decide_locally(&self, planned: &[Planned<'_>], fallback: bool, instances: u32) -> Decisions {
        let store = if fallback {
            &self.fallback
        } else {
            &self.local
        };
        let uses_store =
            |plan: &Planned<'_>| !fallback || plan.rule.on_redis_error == OnRedisError::Local;
        // A request an enforced `deny` rule refuses uses up no tokens of its `local` rules, as
        // a request one rule refuses uses up none of the others'.
        let refused_anyway = fallback
            && planned
                .iter()
                .any(|plan| plan.rule.on_redis_error == OnRedisError::Deny && !plan.rule.dry_run);
        let asks: Vec<Ask<'_>> = planned
            .iter()
            .filter(|plan| !refused_anyway && uses_store(plan))
            .map(|plan| Ask {
                key: &plan.key.key,
                rate: if fallback {
                    plan.rule.rate.share(instances)
                } else {
                    plan.rule.rate
                },
                dry_run: plan.rule.dry_run,
                // As full as Redis's last refusal left the shared bucket: a switch to the
                // fallback is no fresh burst for a client Redis was holding back.
                at_least: if fallback {
                    self.denied.full_at(&plan.key.key, plan.rule.rate)
                } else {
                    None
                },
            })
            .collect();
        let mut verdicts = store.decide_all(&asks, || self.now_us()).into_iter();
        let source = if fallback {
            DecisionSource::Fallback
        } else {
            DecisionSource::Local
        };
        planned
            .iter()
            .map(|plan| {
                if !uses_store(plan) {
                    let allowed = plan.rule.on_redis_error == OnRedisError::Allow;
                    return Decided {
                        allowed,
                        remaining: 0,
                        reset: Duration::ZERO,
                        retry_after: Duration::ZERO,
                        source,
                        measured: false,
                    };
                }
                match verdicts.next() {
                    Some(Verdict::Allow {
                        remaining,
                        reset_us,
                        ..
                    }) => Decided {
                        allowed: true,
                        remaining,
                        reset: Duration::from_micros(reset_us),
                        retry_after: Duration::ZERO,
                        source,
                        measured: true,
                    },
                    Some(Verdict::Deny {
                        retry_after_us,
                        reset_us,
                    }) => Decided {
                        allowed: false,
                        remaining: 0,
                        reset: Duration::from_micros(reset_us),
                        retry_after: Duration::from_micros(retry_after_us),
                        source,
                        measured: true,
                    },
                    None => Decided {
                        allowed: true,
                        remaining: 0,
                        reset: Duration::ZERO,
                        retry_after: Duration::ZERO,
                        source,
                        measured: false,
                    },
                }
            })
            .collect()
    }

    fn count(&self, rule: &LimitRule, result: DecisionResult, source: DecisionSource) {
        self.metrics
            .record_decision(&rule.name, &rule.series, result, source);
    }
}

/// Bounds the warnings of requests an `on_redis_error = "deny"` rule refuses while Redis is
/// out: one a request otherwise.
static REDIS_DENIALS: crate::log_throttle::LogThrottle =
    crate::log_throttle::LogThrottle::new(Duration::from_secs(10));

/// The 429 (or the rule's status) for a request `rule` refuses, in the form the exchange
/// chooses for all of levee's own answers (see `ProxyError::to_response`).
fn deny(rule: &Arc<LimitRule>, quota: Rate, retry_after: Duration, reset: Duration) -> ProxyError {
    ProxyError::RateLimited(Box::new(Denial {
        rule: rule.clone(),
        quota,
        retry_after,
        reset,
    }))
}

/// Starts the periodic sweep of idle buckets; it lasts until `stop` turns true.
pub fn spawn_sweeper(
    limiter: Arc<Limiter>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = ticks.tick() => limiter.sweep(),
                _ = stop.wait_for(|stopped| *stopped) => return,
            }
        }
    });
}

/// The fastest rate a bucket can count: one request per microsecond, its interval's unit.
pub const MAX_RATE_PER_SECOND: f64 = 1_000_000.0;
/// The slowest: one request per 10,000,000 seconds (about 116 days), so that a bucket's
/// timestamps stay within what Redis and the in-process store keep exactly.
pub const MIN_RATE_PER_SECOND: f64 = 1e-7;

/// Parses `"3/min"`, `"0.05/s"`, `"100/h"`, `"2/day"` into a GCRA interval.
pub fn parse_rate(text: &str) -> Result<(f64, u64), String> {
    let (count, unit) = text
        .split_once('/')
        .ok_or_else(|| format!("rate `{text}` is not written as N/s, N/min, N/h or N/day"))?;
    // nginx writes `5r/s` and `30r/m`.
    if let Some(number) = count
        .trim()
        .strip_suffix('r')
        .filter(|number| number.trim().parse::<f64>().is_ok())
    {
        let unit = match unit.trim() {
            "m" => "min",
            other => other,
        };
        return Err(format!(
            "rate `{text}` is written as nginx writes it: levee's is \"{}/{unit}\"",
            number.trim()
        ));
    }
    let count: f64 = count
        .trim()
        .parse()
        .map_err(|_| format!("rate `{text}` does not start with a number"))?;
    let seconds = match unit.trim() {
        "s" | "sec" | "second" => 1.0,
        "m" | "min" | "minute" => 60.0,
        "h" | "hour" => 3600.0,
        "d" | "day" => 86_400.0,
        other => return Err(format!("unknown rate unit `{other}`; use s, min, h or day")),
    };
    // `inf` and `NaN` parse as numbers; neither is a count of requests.
    if !count.is_finite() {
        return Err(format!("rate `{text}` does not start with a number"));
    }
    if count <= 0.0 {
        return Err(format!("rate `{text}` must be above zero"));
    }
    let per_second = count / seconds;
    // Checked before rounding: `"1500000/s"` would round to one request per microsecond and
    // silently count as 1000000/s.
    if per_second > MAX_RATE_PER_SECOND {
        return Err(format!(
            "rate `{text}` is above the fastest rate levee counts, 1000000/s"
        ));
    }
    if per_second < MIN_RATE_PER_SECOND {
        return Err(format!(
            "rate `{text}` is below the slowest rate levee counts, one request per 10000000 s (0.0087/day)"
        ));
    }
    let interval_us = (1_000_000.0 / per_second).round();
    Ok((per_second, interval_us as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse() {
        assert_eq!(parse_rate("3/min"), Ok((0.05, 20_000_000)));
        assert_eq!(parse_rate("0.05/s"), Ok((0.05, 20_000_000)));
        assert_eq!(parse_rate("10/s").map(|r| r.1), Ok(100_000));
        assert_eq!(parse_rate("3600/h").map(|r| r.1), Ok(1_000_000));
        assert!(parse_rate("3 per minute").is_err());
        assert!(parse_rate("0/s").is_err());
        assert!(parse_rate("5/fortnight").is_err());
    }

    #[test]
    fn rate_errors_say_the_accepted_forms_and_range() {
        assert_eq!(parse_rate("1000000/s").map(|r| r.1), Ok(1));
        assert_eq!(parse_rate("0.0087/day").map(|r| r.1), Ok(9_931_034_482_759));
        assert_eq!(
            parse_rate("inf/s"),
            Err("rate `inf/s` does not start with a number".into())
        );
        assert_eq!(
            parse_rate("NaN/s"),
            Err("rate `NaN/s` does not start with a number".into())
        );
        assert_eq!(
            parse_rate("300 per minute"),
            Err("rate `300 per minute` is not written as N/s, N/min, N/h or N/day".into())
        );
        assert_eq!(
            parse_rate("1000000000/s"),
            Err("rate `1000000000/s` is above the fastest rate levee counts, 1000000/s".into())
        );
        // Once rounded to a microsecond this was 1000000/s, taken without a word.
        assert!(parse_rate("1500000/s").is_err());
        assert_eq!(
            parse_rate("0.001/day"),
            Err("rate `0.001/day` is below the slowest rate levee counts, one request per 10000000 s (0.0087/day)".into())
        );
    }

    #[test]
    fn ietf_fields() {
        let named = |name: &str| LimitRule {
            name: Arc::from(name),
            parts: vec![KeyPart::User],
            rate: Rate {
                interval_us: 20_000_000,
                burst: 3,
            },
            rate_text: "3/min".into(),
            missing_uses_ip: false,
            ipv6_prefix: key::DEFAULT_IPV6_PREFIX,
            dry_run: false,
            on_redis_error: OnRedisError::Local,
            headers: true,
            headers_on_allow: false,
            status: StatusCode::TOO_MANY_REQUESTS,
            body_html: None,
            body_json: None,
            series: DecisionSeries::default(),
            redis: RedisRule::new(20_000_000, 3, false),
        };
        let rule = named("post_per_user");
        assert_eq!(
            policy_field(&rule, rule.rate).as_deref(),
            Some("\"post_per_user\";q=3;w=60")
        );
        assert_eq!(
            state_field(&rule, 0, Duration::from_millis(19_500)).as_deref(),
            Some("\"post_per_user\";r=0;t=20")
        );
        // A name is a structured-field string: quotes and backslashes escaped; a name that
        // cannot be one gives no field instead of a broken one.
        assert_eq!(
            policy_field(&named("say \"hi\" \\o/"), named("x").rate).as_deref(),
            Some("\"say \\\"hi\\\" \\\\o/\";q=3;w=60")
        );
        assert_eq!(policy_field(&named("发帖"), named("x").rate), None);
        assert_eq!(state_field(&named("a\tb"), 0, Duration::ZERO), None);
        // A bucket that fills in under a second says its rate per second (`10/s`, `burst =
        // 5` read as 5 per second).
        let mut fast = named("api");
        fast.rate = Rate {
            interval_us: 100_000,
            burst: 5,
        };
        assert_eq!(
            policy_field(&fast, fast.rate).as_deref(),
            Some("\"api\";q=10;w=1")
        );
        fast.rate.burst = 30;
        assert_eq!(
            policy_field(&fast, fast.rate).as_deref(),
            Some("\"api\";q=30;w=3")
        );
    }
}
