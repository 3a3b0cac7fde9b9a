//! Warnings that would come once per request during an outage (a queue write refused for
//! every POST while Redis is down) are let through at most once per interval, each saying how
//! many like it were held back: the log stays readable during the incident it is read for.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    /// When a line was last let through, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogThrottle {
    pub const fn new(every: Duration) -> LogThrottle {
        LogThrottle {
            every,
            state: Mutex::new((None, 0)),
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
        let (last, held_back) = &mut *state;
        if last.is_some_and(|last| now.saturating_duration_since(last) < self.every) {
            *held_back += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(held_back))
    }
}

/// Lines let through `lines` at a time per interval, the rest counted: for lines each worth
/// reading, of which a client can cause one per request (a refused request's reason).
#[derive(Debug)]
pub struct LogBudget {
    every: Duration,
    lines: u32,
    /// When the current interval began, lines let through in it, and lines held back since
    /// the last one let through.
    state: Mutex<(Option<Instant>, u32, u64)>,
}

impl LogBudget {
    pub const fn new(lines: u32, every: Duration) -> LogBudget {
        LogBudget {
            every,
            lines,
            state: Mutex::new((None, 0, 0)),
        }
    }

    /// Like [`LogThrottle::allow`]: `Some(held back since the last line let through)`, or
    /// `None` once this interval's lines are spent.
    pub fn allow(&self, now: Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (began, used, held_back) = &mut *state;
        if began.is_none_or(|began| now.saturating_duration_since(began) >= self.every) {
            *began = Some(now);
            *used = 0;
        }
        if *used >= self.lines {
            *held_back += 1;
            return None;
        }
        *used += 1;
        Some(std::mem::take(held_back))
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
}
