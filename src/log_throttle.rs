//! Warnings that would come once per request during an outage (a queue write refused for
//! every POST while Redis is down) are let through at most once per interval, each saying how
//! many like it were held back: the log stays readable during the incident it is read for.
//! The count is of the spell the line belongs to: lines held back in an earlier one, which
//! ended two intervals or more before (nothing came for that long), are not carried into the
//! first line of the next (an outage's first line said `held_back=50` of one minutes before;
//! the metrics count every event).

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    /// When a line was last let through, how many were held back since, and when the last
    /// of those was.
    state: Mutex<(Option<Instant>, u64, Option<Instant>)>,
}

impl LogThrottle {
    pub const fn new(every: Duration) -> LogThrottle {
        LogThrottle {
            every,
            state: Mutex::new((None, 0, None)),
        }
    }

    /// Whether a line would be let through at `now`, without counting one held back.
    pub fn is_due(&self, now: Instant) -> bool {
        let state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state
            .0
            .is_none_or(|last| now.saturating_duration_since(last) >= self.every)
    }

    /// Whether a line may be logged at `now`: `Some(held back since the last one)`, or `None`
    /// (it is counted instead).
    pub fn allow(&self, now: Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (last, held_back, last_held) = &mut *state;
        if last.is_some_and(|last| now.saturating_duration_since(last) < self.every) {
            *held_back += 1;
            *last_held = Some(now);
            return None;
        }
        *last = Some(now);
        Some(of_this_spell(held_back, last_held, now, self.every))
    }
}

/// Lines let through `lines` at a time per interval, the rest counted: for lines each worth
/// reading, of which a client can cause one per request (a refused request's reason).
#[derive(Debug)]
pub struct LogBudget {
    every: Duration,
    lines: u32,
    /// When the current interval began, lines let through in it, lines held back since the
    /// last one let through, and when the last of those was.
    state: Mutex<(Option<Instant>, u32, u64, Option<Instant>)>,
}

impl LogBudget {
    pub const fn new(lines: u32, every: Duration) -> LogBudget {
        LogBudget {
            every,
            lines,
            state: Mutex::new((None, 0, 0, None)),
        }
    }

    /// Like [`LogThrottle::allow`]: `Some(held back since the last line let through)`, or
    /// `None` once this interval's lines are spent.
    pub fn allow(&self, now: Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (began, used, held_back, last_held) = &mut *state;
        if began.is_none_or(|began| now.saturating_duration_since(began) >= self.every) {
            *began = Some(now);
            *used = 0;
        }
        if *used >= self.lines {
            *held_back += 1;
            *last_held = Some(now);
            return None;
        }
        *used += 1;
        Some(of_this_spell(held_back, last_held, now, self.every))
    }
}

/// The lines held back, taken for the line let through at `now`: none when the last of them
/// came two intervals or more before (an earlier spell's).
fn of_this_spell(
    held_back: &mut u64,
    last_held: &mut Option<Instant>,
    now: Instant,
    every: Duration,
) -> u64 {
    let held = std::mem::take(held_back);
    match last_held.take() {
        Some(at) if now.saturating_duration_since(at) < every.saturating_mul(2) => held,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_lets_its_lines_through_each_interval_and_counts_the_rest() {
        let budget = LogBudget::new(2, Duration::from_secs(1));
        let start = Instant::now();
        assert_eq!(budget.allow(start), Some(0));
        assert_eq!(budget.allow(start), Some(0));
        assert_eq!(budget.allow(start), None);
        assert_eq!(budget.allow(start + Duration::from_millis(500)), None);
        assert_eq!(budget.allow(start + Duration::from_secs(1)), Some(2));
        assert_eq!(budget.allow(start + Duration::from_secs(1)), Some(0));
        assert_eq!(budget.allow(start + Duration::from_secs(1)), None);
    }

    #[test]
    fn one_line_per_interval_with_the_count_of_those_held_back() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(throttle.allow(start), Some(0));
        assert_eq!(throttle.allow(start + Duration::from_secs(1)), None);
        assert_eq!(throttle.allow(start + Duration::from_secs(9)), None);
        assert!(!throttle.is_due(start + Duration::from_secs(9)));
        assert!(throttle.is_due(start + Duration::from_secs(10)));
        assert_eq!(throttle.allow(start + Duration::from_secs(10)), Some(2));
        assert_eq!(throttle.allow(start + Duration::from_secs(11)), None);
    }

    #[test]
    fn lines_held_back_in_an_earlier_spell_are_not_said_with_the_next() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        assert_eq!(throttle.allow(at(0)), Some(0));
        assert_eq!(throttle.allow(at(1)), None);
        assert_eq!(throttle.allow(at(2)), None);
        // Quiet from 2 s to 60 s: a new outage's first line says none held back.
        assert_eq!(throttle.allow(at(60)), Some(0));
        let budget = LogBudget::new(1, Duration::from_secs(1));
        assert_eq!(budget.allow(at(0)), Some(0));
        assert_eq!(budget.allow(at(0)), None);
        assert_eq!(budget.allow(at(30)), Some(0));
        assert_eq!(budget.allow(at(30)), None);
        assert_eq!(budget.allow(at(31)), Some(1));
    }
}
