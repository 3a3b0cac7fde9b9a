//! The fleet view. The operator's switches are the fleet's (one Redis hash), but the
//! automatic level and the breakers are each instance's own: its triggers and breakers count
//! its own calls, so one instance may shed a module while the others do not. With Redis, every
//! instance writes what it is doing into one more hash at each switch sync, and `/status`
//! (and the dashboard) show every instance's line, so that "why does one page in three lack
//! its ranking?" has an answer on one screen.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::Policy;
use crate::proxy::Shared;
use crate::redis_store::RedisStore;

/// Bound on each fleet call: the view is for people, and never holds up a sync or `/status`
/// for long.
const FLEET_TIMEOUT: Duration = Duration::from_millis(300);
/// A report this old is from an instance that went away without saying so (killed, or cut
/// off from Redis): it is shown as silent, and removed after [`FORGET_AFTER`].
const SILENT_AFTER_SYNCS: u32 = 3;
const SILENT_AT_LEAST: Duration = Duration::from_secs(5);
const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// What one instance reports of itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The level in effect there (the operator's or the policy's, or its automatic one).
    pub level: u8,
    /// Its triggers' level.
    pub automatic_level: u8,
    /// Its breakers that are not closed, by upstream: `open` or `half_open`.
    #[serde(default)]
    pub breakers: BTreeMap<String, String>,
    #[serde(default)]
    pub draining: bool,
    pub version: String,
    /// Its `sync_interval`: how often it writes, from which it is told silent.
    #[serde(default)]
    pub sync_interval_ms: u64,
    /// When it wrote this, by Redis's clock (from the line's stamp).
    #[serde(default)]
    pub at_unix_ms: u64,
}

fn key(redis: &RedisStore) -> String {
    format!("{}fleet", redis.settings.key_prefix)
}

/// Whether two policies' Redis sections write one fleet view (the same servers and prefix).
pub fn same_view(a: &RedisStore, b: &RedisStore) -> bool {
    a.settings.target == b.settings.target && a.settings.key_prefix == b.settings.key_prefix
}

/// This instance's report, from its policy and degrade state now.
pub fn report_of(shared: &Shared, policy: &Policy) -> Report {
    let degrade = &shared.degrade;
    let breakers = policy
        .upstreams
        .iter()
        .filter_map(|(name, upstream)| {
            let state = upstream.breaker.status().state;
            (state != "closed").then(|| (name.clone(), state.to_string()))
        })
        .collect();
    Report {
        level: degrade.view(policy).level,
        automatic_level: degrade.auto_level(),
        breakers,
        draining: shared.draining.load(Ordering::Relaxed),
        version: concat!(env!("CARGO_PKG_VERSION"), " (", env!("LEVEE_COMMIT"), ")").to_string(),
        sync_interval_ms: policy.degrade.sync_interval.as_millis() as u64,
        at_unix_ms: 0,
    }
}

/// Writes `report` as `instance`'s line. Not tried while Redis is known to be down (the sync
/// must not wait on it), and a failure is only logged (at debug): Redis being away is told
/// elsewhere, and the line merely goes silent.
pub async fn write(redis: &RedisStore, instance: &str, report: &Report) {
    let Ok(text) = serde_json::to_string(report) else {
        return;
    };
    if !redis.answers_for(&key(redis)) {
        return;
    }
    let written = async {
        // Stamped with Redis's clock (`<ms> <report>`), so that every instance's age is told
        // by one clock, not by clocks that may disagree. (Two plain calls, not a script:
        // scripts would crowd Redis's script cache and its EVAL counts.)
        let now = redis_now_ms(redis).await?;
        let mut command = redis::cmd("HSET");
        command
            .arg(key(redis))
            .arg(instance)
            .arg(format!("{now} {text}"));
        redis
            .command::<i64>(&command, FLEET_TIMEOUT, None)
            .await
            .map_err(|error| error.to_string())
    };
    if let Err(error) = written.await {
        tracing::debug!("cannot write this instance's line of the fleet view: {error}");
    }
}

/// Redis's clock, in ms since the epoch.
async fn redis_now_ms(redis: &RedisStore) -> Result<u64, String> {
    let asked = std::time::Instant::now();
    let (seconds, micros): (u64, u64) = redis
        .command(&redis::cmd("TIME"), FLEET_TIMEOUT, None)
        .await
        .map_err(|error| error.to_string())?;
    let now = seconds * 1000 + micros / 1000;
    // Stale copies are aged on this clock too (see `fleet_clock`).
    crate::fleet_clock::follow_redis(now, asked, std::time::Instant::now());
    Ok(now)
}

/// Removes `instance`'s line (a clean stop: it is gone, not silent).
pub async fn leave(redis: &RedisStore, instance: &str) {
    let mut command = redis::cmd("HDEL");
    command.arg(key(redis)).arg(instance);
    if let Err(error) = redis.command::<i64>(&command, FLEET_TIMEOUT, None).await {
        tracing::debug!("cannot remove this instance from the fleet view: {error}");
    }
}

/// The fleet view as `/status` shows it: `null` without Redis; with it, every instance's line
/// and the highest level in effect anywhere, or the reason Redis could not be read.
pub async fn status(shared: &Shared, policy: &Policy) -> serde_json::Value {
    let Some(redis) = &policy.redis else {
        return serde_json::Value::Null;
    };
    match read(redis, &shared.instance, policy.degrade.sync_interval).await {
        Ok(mut members) => {
            // The answering instance as it is now, not as it wrote itself at its last sync:
            // right after `levee level 1` its own line read level 0 for up to a sync.
            // (When it last wrote its line stays, as `seen_ms_ago` says.)
            for member in members.iter_mut().filter(|member| member.this) {
                let written_at = member.report.at_unix_ms;
                member.report = report_of(shared, policy);
                member.report.at_unix_ms = written_at;
            }
            let highest = members
                .iter()
                .filter(|member| !member.silent)
                .map(|member| member.report.level)
                .max();
            serde_json::json!({
                "instances": members,
                "highest_level": highest,
            })
        }
        Err(error) => serde_json::json!({ "error": error }),
    }
}

/// One instance as `/status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Member {
    pub instance: String,
    /// This is the instance answering.
    pub this: bool,
    /// Its report is older than a few syncs: killed, hung, or cut off from Redis.
    pub silent: bool,
    /// How long ago it wrote its report (by this instance's clock, so a skewed clock shows).
    pub seen_ms_ago: u64,
    #[serde(flatten)]
    pub report: Report,
}

/// Every instance's line, in name order; lines unreadable or older than an hour are left out
/// (and the old ones removed).
pub async fn read(
    redis: &RedisStore,
    this_instance: &str,
    sync_interval: Duration,
) -> Result<Vec<Member>, String> {
    if !redis.answers_for(&key(redis)) {
        return Err(format!(
            "redis is down{}",
            redis
                .last_error()
                .map(|error| format!(" ({error})"))
                .unwrap_or_default()
        ));
    }
    let mut command = redis::cmd("HGETALL");
    command.arg(key(redis));
    let lines: BTreeMap<String, String> = redis
        .command(&command, FLEET_TIMEOUT, None)
        .await
        .map_err(|error| error.to_string())?;
    let now = redis_now_ms(redis).await?;
    let (members, forgotten) = members_of(lines, this_instance, now, sync_interval);
    if !forgotten.is_empty() {
        let mut command = redis::cmd("HDEL");
        command.arg(key(redis)).arg(&forgotten);
        if let Err(error) = redis.command::<i64>(&command, FLEET_TIMEOUT, None).await {
            tracing::debug!("cannot remove long-gone instances from the fleet view: {error}");
        }
    }
    Ok(members)
}

/// The members among `lines` (`<ms> <report>`) at `now` (both by Redis's clock), and the
/// names of the lines to forget. A line is silent after a few of its writer's syncs
/// (`sync_interval`, this instance's, for a line that does not say).
fn members_of(
    lines: BTreeMap<String, String>,
    this_instance: &str,
    now: u64,
    sync_interval: Duration,
) -> (Vec<Member>, Vec<String>) {
    let mut members = Vec::new();
    let mut forgotten = Vec::new();
    for (instance, line) in lines {
        let parsed = line.split_once(' ').and_then(|(stamp, text)| {
            let mut report = serde_json::from_str::<Report>(text).ok()?;
            report.at_unix_ms = stamp.parse().ok()?;
            Some(report)
        });
        let Some(report) = parsed else {
            // Written by a later levee, or by hand: not shown, and not removed either.
            continue;
        };
        let interval = match report.sync_interval_ms {
            0 => sync_interval,
            ms => Duration::from_millis(ms),
        };
        let silent_after = interval
            .saturating_mul(SILENT_AFTER_SYNCS)
            .max(SILENT_AT_LEAST);
        let seen_ms_ago = now.saturating_sub(report.at_unix_ms);
        if seen_ms_ago > FORGET_AFTER.as_millis() as u64 {
            forgotten.push(instance);
            continue;
        }
        members.push(Member {
            this: instance == this_instance,
            silent: seen_ms_ago > silent_after.as_millis() as u64,
            seen_ms_ago,
            instance,
            report,
        });
    }
    (members, forgotten)
}

/// How often the fleet's size is compared with `[redis] instances`.
const SIZE_CHECK_EVERY: Duration = Duration::from_secs(60);
/// How long the fleet must differ from `instances` before it is said: a rolling deploy
/// adds or takes one out for a while.
const SIZE_DIFFERS_FOR: Duration = Duration::from_secs(120);
/// How often a fleet that still differs is said again.
const SIZE_SAID_EVERY: Duration = Duration::from_secs(600);

/// Compares the instances the fleet view shows alive with `[redis] instances`. One instance
/// with another `key_prefix` or database sees a fleet of one, and shares no limit, switch or
/// queue with the others: with `instances = 3` and nothing said, limits admitted three times
/// their rate across the fleet. (And the local fallback admits `rate / instances` on each
/// instance: a fleet larger than `instances` admits more than `rate` while Redis is down.)
#[derive(Debug, Default)]
pub struct FleetSize {
    next_check: Option<std::time::Instant>,
    /// Since when the fleet has differed from `instances`, and by what it was.
    differs_since: Option<(std::time::Instant, usize)>,
    said_at: Option<std::time::Instant>,
}

impl FleetSize {
    /// Whether a look at the fleet is due at `now`.
    pub fn due(&mut self, now: std::time::Instant) -> bool {
        if self.next_check.is_some_and(|next| now < next) {
            return false;
        }
        self.next_check = Some(now + SIZE_CHECK_EVERY);
        true
    }

    /// Takes note of `alive` instances against `expected`; what to say, when it is time.
    pub fn observe(
        &mut self,
        alive: usize,
        expected: u32,
        now: std::time::Instant,
    ) -> Option<String> {
        let expected = usize::try_from(expected).unwrap_or(usize::MAX);
        if alive == expected || alive == 0 {
            self.differs_since = None;
            self.said_at = None;
            return None;
        }
        let since = match self.differs_since {
            Some((since, before)) if before == alive => since,
            _ => {
                self.differs_since = Some((now, alive));
                now
            }
        };
        if now.saturating_duration_since(since) < SIZE_DIFFERS_FOR
            || self
                .said_at
                .is_some_and(|said| now.saturating_duration_since(said) < SIZE_SAID_EVERY)
        {
            return None;
        }
        self.said_at = Some(now);
        let minutes = now.saturating_duration_since(since).as_secs() / 60;
        Some(if alive < expected {
            format!(
                "[redis] instances = {expected}, but the fleet view has shown {alive} instance(s) alive for {minutes} minutes: the others are down, or use another key_prefix or redis database, and then share no limit, switch or queue with this one (each admits a limit's whole rate); set instances to the fleet's size"
            )
        } else {
            format!(
                "[redis] instances = {expected}, but the fleet view has shown {alive} instances alive for {minutes} minutes: while redis is down each admits rate / {expected}, together more than a limit's rate; set instances to the fleet's size"
            )
        })
    }
}

/// Looks at the fleet's size when due (see [`FleetSize`]), and says what differs.
pub async fn check_size(redis: &RedisStore, instance: &str, policy: &Policy, size: &mut FleetSize) {
    let now = std::time::Instant::now();
    if !size.due(now) {
        return;
    }
    let Ok(members) = read(redis, instance, policy.degrade.sync_interval).await else {
        return;
    };
    let alive = members.iter().filter(|member| !member.silent).count();
    if let Some(said) = size.observe(alive, redis.settings.instances, now) {
        tracing::warn!(key = %key(redis), "{said}");
    }
}

#[cfg(test)]
mod size_tests {
    use super::*;

    #[test]
    fn a_fleet_that_differs_from_instances_is_said_after_two_minutes_then_every_ten() {
        let mut size = FleetSize::default();
        let start = std::time::Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        assert_eq!(size.observe(1, 3, at(0)), None);
        assert_eq!(size.observe(1, 3, at(60)), None);
        let said = size.observe(1, 3, at(120)).expect("said");
        assert!(
            said.contains(
                "instances = 3, but the fleet view has shown 1 instance(s) alive for 2 minutes"
            ),
            "{said}"
        );
        assert_eq!(size.observe(1, 3, at(180)), None, "not again at once");
        assert!(
            size.observe(1, 3, at(720)).is_some(),
            "again ten minutes later"
        );
        // The right size ends it; a rolling deploy's extra instance for a minute is not said.
        assert_eq!(size.observe(3, 3, at(780)), None);
        assert_eq!(size.observe(4, 3, at(840)), None);
        assert_eq!(size.observe(3, 3, at(900)), None);
        assert_eq!(size.observe(4, 3, at(960)), None);
        assert!(size
            .observe(4, 3, at(1080))
            .expect("said")
            .contains("together more than a limit's rate"));
        assert_eq!(FleetSize::default().observe(1, 1, at(0)), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(level: u8, at_unix_ms: u64) -> String {
        let report = serde_json::to_string(&Report {
            level,
            automatic_level: level,
            breakers: BTreeMap::from([("app".to_string(), "open".to_string())]),
            draining: false,
            version: "0.1.0".into(),
            sync_interval_ms: 500,
            at_unix_ms: 0,
        })
        .expect("json");
        format!("{at_unix_ms} {report}")
    }

    #[test]
    fn silent_instances_are_marked_and_long_gone_ones_forgotten() {
        let now = 10_000_000;
        let lines = BTreeMap::from([
            ("a".to_string(), line(0, now - 200)),
            ("b".to_string(), line(2, now - 8_000)),
            ("c".to_string(), line(1, now - 4_000_000)),
            ("d".to_string(), "not json".to_string()),
        ]);
        let (members, forgotten) = members_of(lines, "a", now, Duration::from_secs(1));
        assert_eq!(forgotten, ["c"]);
        let shown: Vec<(&str, bool, bool, u8)> = members
            .iter()
            .map(|m| (m.instance.as_str(), m.this, m.silent, m.report.level))
            .collect();
        assert_eq!(shown, [("a", true, false, 0), ("b", false, true, 2)]);
        assert_eq!(members[1].report.breakers["app"], "open");
    }
}
