//! Automatic degradation: triggers watch each upstream and raise the level when it shows
//! distress, with hysteresis — a condition must hold for `for` before the level rises, and the
//! level comes back down only after `cool_down` without any trigger holding.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::Degrade;
use crate::config::{Policy, PolicyStore};
use crate::metrics::Metrics;

/// What a trigger watches.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// The upstream's breaker is open or half-open.
    BreakerOpen,
    /// p95 latency (to the end of the answer's body) over the last `LATENCY_WINDOW` above
    /// this.
    LatencyP95(Duration),
    /// In-flight requests above this share of `max_inflight`.
    Inflight(f64),
    /// Failure share of the breaker's window above this.
    ErrorRatio(f64),
}

/// As the policy writes it (`latency_p95 above 600ms`), for the log.
impl std::fmt::Display for Condition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Condition::BreakerOpen => f.write_str("breaker_open"),
            Condition::LatencyP95(above) => {
                write!(
                    f,
                    "latency_p95 above {}",
                    crate::config::units::Shown(*above)
                )
            }
            Condition::Inflight(above) => write!(f, "inflight above {above}"),
            Condition::ErrorRatio(above) => write!(f, "error_ratio above {above}"),
        }
    }
}

/// A compiled `[[degrade.trigger]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Trigger {
    pub upstream: String,
    pub condition: Condition,
    /// How long the condition must hold. Default 5s.
    pub hold: Duration,
    /// The level it raises to. Default 1.
    pub level: u8,
    /// Calls the window must hold before a ratio or a percentile of them is judged (one
    /// 502 on an idle site was an error ratio of 1, and turned tier 3 off for the whole site).
    pub min_calls: u32,
}

/// `min_calls` when the policy leaves it out: the breaker's own `min_requests` default.
pub const MIN_CALLS: u32 = 20;

/// Latencies are judged over this window.
pub const LATENCY_WINDOW: Duration = Duration::from_secs(10);
pub const MAX_SAMPLES: usize = 2048;

/// Recent response-head latencies of one upstream.
#[derive(Debug, Default)]
pub struct LatencyWindow {
    samples: Mutex<VecDeque<(Instant, Duration)>>,
}

impl LatencyWindow {
    pub fn record(&self, now: Instant, latency: Duration) {
        if let Ok(mut samples) = self.samples.lock() {
            if samples.len() == MAX_SAMPLES {
                samples.pop_front();
            }
            samples.push_back((now, latency));
        }
    }

    /// 95th percentile of the samples inside the window, if there are at least `min` (and
    /// one).
    pub fn p95(&self, now: Instant, min: u32) -> Option<Duration> {
        let mut latencies: Vec<Duration> = {
            let mut samples = self.samples.lock().ok()?;
            while samples
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > LATENCY_WINDOW)
            {
                samples.pop_front();
            }
            samples.iter().map(|(_, latency)| *latency).collect()
        };
        // Sorted with the lock given back: every answer's `record` waits for it.
        if latencies.is_empty() || latencies.len() < min as usize {
            return None;
        }
        latencies.sort_unstable();
        let index = ((latencies.len() as f64) * 0.95).ceil() as usize;
        latencies.get(index.saturating_sub(1)).copied()
    }
}

/// The hysteresis, pure: fed with which triggers hold now, it says what level to be at.
#[derive(Debug, Default)]
pub struct Hysteresis {
    /// Since when each trigger has held, beside the trigger it belongs to: a reload that
    /// adds, removes or reorders triggers hands each its own time (matched by upstream,
    /// condition and level), never another's.
    held_since: Vec<(Trigger, Option<Instant>)>,
    /// Last time the current automatic level was still wanted.
    last_wanted: Option<Instant>,
    /// The level the triggers wanted at the last step (held for their `for`).
    wanted: u8,
}

impl Hysteresis {
    /// How long each trigger has held at `now` (`None`: it does not hold), in the order of
    /// the triggers last stepped with.
    pub fn held_for(&self, now: Instant) -> impl Iterator<Item = (&Trigger, Option<Duration>)> {
        self.held_since.iter().map(move |(trigger, since)| {
            (
                trigger,
                since.map(|since| now.saturating_duration_since(since)),
            )
        })
    }

    /// While the level `current` is up and the triggers did not want it at the last step:
    /// how long until `cool_down` lets it down.
    pub fn lowers_in(&self, now: Instant, current: u8, cool_down: Duration) -> Option<Duration> {
        if current == 0 || self.wanted >= current {
            return None;
        }
        let last = self.last_wanted?;
        Some(cool_down.saturating_sub(now.saturating_duration_since(last)))
    }

    pub fn step(
        &mut self,
        now: Instant,
        triggers: &[Trigger],
        holding: &[bool],
        current: u8,
        cool_down: Duration,
    ) -> u8 {
        let same_triggers = self.held_since.len() == triggers.len()
            && self
                .held_since
                .iter()
                .zip(triggers)
                .all(|((known, _), trigger)| known == trigger);
        if !same_triggers {
            let mut before = std::mem::take(&mut self.held_since);
            self.held_since = triggers
                .iter()
                .map(|trigger| {
                    let since = before
                        .iter()
                        .position(|(known, _)| {
                            known.upstream == trigger.upstream
                                && known.condition == trigger.condition
                                && known.level == trigger.level
                        })
                        .and_then(|at| before.swap_remove(at).1);
                    (trigger.clone(), since)
                })
                .collect();
        }
        let mut wanted = 0;
        for ((trigger, holds), (_, since)) in
            triggers.iter().zip(holding).zip(self.held_since.iter_mut())
        {
            if *holds {
                let since = *since.get_or_insert(now);
                if now.saturating_duration_since(since) >= trigger.hold {
                    wanted = wanted.max(trigger.level);
                }
            } else {
                *since = None;
            }
        }
        self.wanted = wanted;
        if wanted >= current {
            if wanted > 0 {
                self.last_wanted = Some(now);
            }
            return wanted;
        }
        // Lower only after cool_down without the current level being wanted.
        match self.last_wanted {
            Some(last) if now.saturating_duration_since(last) < cool_down => current,
            _ => {
                self.last_wanted = (wanted > 0).then_some(now);
                wanted
            }
        }
    }
}

/// How many of the last readings of an upstream's in-flight share an `inflight` trigger
/// averages: a second's worth at the 200 ms the triggers are read. One reading alone let any
/// dip between bursts (a pool busy on average, idle for an instant) start `for` again.
pub const INFLIGHT_READINGS: usize = 5;

/// The last [`INFLIGHT_READINGS`] readings of each watched upstream's in-flight share of
/// `max_inflight`.
#[derive(Debug, Default)]
pub struct InflightReadings {
    by_upstream: std::collections::HashMap<String, VecDeque<f64>>,
}

impl InflightReadings {
    /// Reads the in-flight share of every upstream an `inflight` trigger watches (once each,
    /// however many triggers watch it), and forgets the others.
    fn read(&mut self, policy: &Policy) {
        let watched: std::collections::BTreeSet<&str> = policy
            .degrade
            .triggers
            .iter()
            .filter(|trigger| matches!(trigger.condition, Condition::Inflight(_)))
            .map(|trigger| trigger.upstream.as_str())
            .collect();
        self.by_upstream
            .retain(|name, _| watched.contains(name.as_str()));
        for name in watched {
            let share = policy
                .upstreams
                .get(name)
                .and_then(|upstream| upstream.bulkhead.as_ref())
                .map(|bulkhead| {
                    f64::from(bulkhead.inflight())
                        / f64::from(bulkhead.settings.max_inflight.max(1))
                });
            if let Some(share) = share {
                self.push(name, share);
            }
        }
    }

    fn push(&mut self, upstream: &str, share: f64) {
        let readings = self.by_upstream.entry(upstream.to_string()).or_default();
        if readings.len() == INFLIGHT_READINGS {
            readings.pop_front();
        }
        readings.push_back(share);
    }

    /// The mean of `upstream`'s last readings, if it has any.
    fn mean(&self, upstream: &str) -> Option<f64> {
        let readings = self.by_upstream.get(upstream).filter(|r| !r.is_empty())?;
        Some(readings.iter().sum::<f64>() / readings.len() as f64)
    }
}

fn holds(policy: &Policy, trigger: &Trigger, now: Instant, inflight: &InflightReadings) -> bool {
    let Some(upstream) = policy.upstreams.get(&trigger.upstream) else {
        return false;
    };
    match &trigger.condition {
        // Open or half-open; but a breaker ready to probe that no request has probed for the
        // trigger's `for` lets go: the level it raised may have switched off every route that
        // would send the probe, and must come down for one to come.
        Condition::BreakerOpen => {
            let status = upstream.breaker.status();
            match status.state {
                "open" => true,
                "half_open" => status
                    .ready_to_probe_ms
                    .is_none_or(|ready| u128::from(ready) < trigger.hold.as_millis()),
                _ => false,
            }
        }
        Condition::LatencyP95(limit) => upstream
            .latency
            .p95(now, trigger.min_calls)
            .is_some_and(|p95| p95 > *limit),
        Condition::Inflight(share) => inflight
            .mean(&trigger.upstream)
            .is_some_and(|mean| mean > *share),
        Condition::ErrorRatio(ratio) => {
            let status = upstream.breaker.status();
            // (`min_calls` is at least 1: no division by 0.)
            status.window_calls >= trigger.min_calls.max(1)
                && f64::from(status.window_failures) / f64::from(status.window_calls) > *ratio
        }
    }
}

/// Evaluates the triggers every `every` until `stop`.
pub fn spawn_triggers(
    degrade: Arc<Degrade>,
    store: Arc<PolicyStore>,
    metrics: Arc<Metrics>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    tokio::spawn(async move {
        let mut hysteresis = Hysteresis::default();
        let mut inflight = InflightReadings::default();
        let mut ticks = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = stop.wait_for(|stopped| *stopped) => return,
            }
            let policy = store.load();
            let now = Instant::now();
            inflight.read(&policy);
            let holding: Vec<bool> = policy
                .degrade
                .triggers
                .iter()
                .map(|trigger| holds(&policy, trigger, now, &inflight))
                .collect();
            let current = degrade.auto_level();
            let next = hysteresis.step(
                now,
                &policy.degrade.triggers,
                &holding,
                current,
                policy.degrade.cool_down,
            );
            let named = |trigger: &Trigger| format!("{} {}", trigger.upstream, trigger.condition);
            // When it rises, the triggers that raised it: those held for their `for` (one
            // holding for less is listed under `holding`, not as a reason).
            let reasons: Vec<String> = if next > current {
                hysteresis
                    .held_for(now)
                    .filter(|(trigger, held)| held.is_some_and(|held| held >= trigger.hold))
                    .map(|(trigger, _)| named(trigger))
                    .collect()
            } else {
                Vec::new()
            };
            degrade.note_auto_report(|report| {
                report.holding = hysteresis
                    .held_for(now)
                    .filter_map(|(trigger, held)| {
                        held.map(|held| super::HoldingTrigger {
                            trigger: named(trigger),
                            level: trigger.level,
                            for_ms: held.as_millis() as u64,
                            needs_ms: trigger.hold.as_millis() as u64,
                        })
                    })
                    .collect();
                report.lowers_in_ms = hysteresis
                    .lowers_in(now, next, policy.degrade.cool_down)
                    .map(|left| left.as_millis() as u64);
                if next != current {
                    report.changed_at_unix = Some(crate::degrade::switches::now_unix());
                    if next > current {
                        report.raised_by = reasons.clone();
                    } else if next == 0 {
                        report.raised_by.clear();
                    }
                }
            });
            if next != current {
                if next > current {
                    tracing::warn!(from = current, to = next, reasons = %reasons.join(", "), "degrade level raised automatically");
                } else {
                    tracing::info!(
                        from = current,
                        to = next,
                        cool_down = ?policy.degrade.cool_down,
                        "no trigger held for the cool-down: degrade level lowered"
                    );
                }
                degrade.set_auto_level(next);
                metrics
                    .degrade_level_changes
                    .get_or_create(&crate::metrics::LevelChangeLabels {
                        direction: if next > current { "up" } else { "down" },
                    })
                    .inc();
                super::switches::publish(&degrade, &policy, &metrics);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_inflight_trigger_judges_the_mean_of_a_second_of_readings() {
        let mut readings = super::InflightReadings::default();
        assert_eq!(readings.mean("app"), None);
        // A busy pool with one idle instant: the mean stays above 0.8.
        for share in [1.0, 1.0, 0.25, 1.0, 1.0] {
            readings.push("app", share);
        }
        assert!(readings.mean("app").is_some_and(|mean| mean > 0.8));
        // Only the last five count: a second of idle readings brings it down.
        for _ in 0..super::INFLIGHT_READINGS {
            readings.push("app", 0.0);
        }
        assert_eq!(readings.mean("app"), Some(0.0));
        assert_eq!(readings.mean("other"), None);
    }

    #[test]
    fn a_condition_is_logged_as_the_policy_writes_it() {
        use super::Condition;
        let said: Vec<String> = [
            Condition::BreakerOpen,
            Condition::LatencyP95(std::time::Duration::from_millis(600)),
            Condition::Inflight(0.8),
            Condition::ErrorRatio(0.5),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            said,
            [
                "breaker_open",
                "latency_p95 above 600ms",
                "inflight above 0.8",
                "error_ratio above 0.5"
            ]
        );
    }

    use super::*;

    fn trigger(hold: u64, level: u8) -> Trigger {
        Trigger {
            upstream: "app".into(),
            condition: Condition::BreakerOpen,
            hold: Duration::from_secs(hold),
            level,
            min_calls: MIN_CALLS,
        }
    }

    #[test]
    fn a_trigger_added_ahead_of_a_holding_one_does_not_take_its_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let cool = s(30);
        let latency = Trigger {
            condition: Condition::LatencyP95(Duration::from_millis(800)),
            ..trigger(5, 2)
        };
        let mut h = Hysteresis::default();
        assert_eq!(h.step(t0, &[trigger(5, 1)], &[true], 0, cool), 0);
        // Reloaded with a latency trigger first; both hold from now on.
        let reloaded = [latency, trigger(5, 1)];
        assert_eq!(h.step(t0 + s(4), &reloaded, &[true, true], 0, cool), 0);
        assert_eq!(
            h.step(t0 + s(5), &reloaded, &[true, true], 0, cool),
            1,
            "the breaker trigger kept its time; the new one has held 1 s of its 5"
        );
        assert_eq!(h.step(t0 + s(9), &reloaded, &[true, true], 1, cool), 2);
    }

    #[test]
    fn the_cool_down_left_is_told_only_while_no_trigger_wants_the_level() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let cool = s(30);
        let triggers = [trigger(5, 1)];
        let mut h = Hysteresis::default();
        assert_eq!(h.step(t0 + s(5), &triggers, &[true], 0, cool), 0);
        assert_eq!(h.step(t0 + s(10), &triggers, &[true], 0, cool), 1);
        assert_eq!(h.lowers_in(t0 + s(10), 1, cool), None, "wanted still");
        let held: Vec<_> = h.held_for(t0 + s(10)).map(|(_, held)| held).collect();
        assert_eq!(held, [Some(s(5))]);
        assert_eq!(h.step(t0 + s(12), &triggers, &[false], 1, cool), 1);
        assert_eq!(h.lowers_in(t0 + s(12), 1, cool), Some(s(28)));
        assert_eq!(
            h.held_for(t0 + s(12)).next().map(|(_, held)| held),
            Some(None)
        );
        assert_eq!(h.lowers_in(t0 + s(12), 0, cool), None, "nothing to lower");
    }

    #[test]
    fn rises_after_hold_and_falls_only_after_cool_down() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let triggers = [trigger(5, 1), trigger(10, 2)];
        let cool = s(30);
        let mut h = Hysteresis::default();
        assert_eq!(
            h.step(t0, &triggers, &[true, false], 0, cool),
            0,
            "not held long enough"
        );
        assert_eq!(h.step(t0 + s(4), &triggers, &[true, false], 0, cool), 0);
        assert_eq!(h.step(t0 + s(5), &triggers, &[true, false], 0, cool), 1);
        // A blip of health does not lower it.
        assert_eq!(h.step(t0 + s(6), &triggers, &[false, false], 1, cool), 1);
        assert_eq!(
            h.step(t0 + s(7), &triggers, &[true, true], 1, cool),
            1,
            "hold restarts after the blip"
        );
        assert_eq!(h.step(t0 + s(12), &triggers, &[true, true], 1, cool), 1);
        assert_eq!(h.step(t0 + s(17), &triggers, &[true, true], 1, cool), 2);
        // Healthy: the level stays for cool_down, then drops to what is still wanted.
        assert_eq!(h.step(t0 + s(18), &triggers, &[false, false], 2, cool), 2);
        assert_eq!(h.step(t0 + s(46), &triggers, &[false, false], 2, cool), 2);
        assert_eq!(h.step(t0 + s(48), &triggers, &[false, false], 2, cool), 0);
    }

    #[test]
    fn p95_looks_at_the_recent_window_only() {
        let t0 = Instant::now();
        let window = LatencyWindow::default();
        for i in 0..100u64 {
            window.record(t0, Duration::from_millis(if i < 94 { 10 } else { 900 }));
        }
        assert_eq!(window.p95(t0, 1), Some(Duration::from_millis(900)));
        assert_eq!(window.p95(t0, 100), Some(Duration::from_millis(900)));
        assert_eq!(window.p95(t0, 101), None, "fewer samples than asked for");
        window.record(t0 + Duration::from_secs(11), Duration::from_millis(20));
        assert_eq!(
            window.p95(t0 + Duration::from_secs(11), 1),
            Some(Duration::from_millis(20))
        );
    }
}
