//! GCRA (generic cell rate algorithm): a token bucket of `burst` tokens refilled at `rate`,
//! stored as one number per key — the theoretical arrival time (TAT) of the next request.
//!
//! The same arithmetic runs in-process ([`decide`]) and inside Redis (`script.lua`); all
//! times are microseconds on one clock (levee's monotonic clock in-process, the Redis server's
//! `TIME` in Redis), passed in so tests control time.

/// A rule's rate: one token every `interval_us`, at most `burst` tokens saved up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub interval_us: u64,
    pub burst: u32,
}

impl Rate {
    /// Time for an empty bucket to fill up: the longest a key needs to be remembered.
    pub fn capacity_us(&self) -> u64 {
        self.interval_us.saturating_mul(u64::from(self.burst))
    }

    /// Requests per second.
    pub fn per_second(&self) -> f64 {
        1_000_000.0 / self.interval_us as f64
    }

    /// This rate divided among `instances` (each instance's share when Redis is down).
    pub fn share(&self, instances: u32) -> Rate {
        let instances = instances.max(1);
        Rate {
            interval_us: self.interval_us.saturating_mul(u64::from(instances)),
            burst: (self.burst / instances).max(1),
        }
    }
}

/// The decision for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Admitted. Store `new_tat`; `remaining` tokens are left; the bucket is full again
    /// after `reset_us`.
    Allow {
        new_tat: u64,
        remaining: u32,
        reset_us: u64,
    },
    /// Refused; a token is available again after `retry_after_us`.
    Deny { retry_after_us: u64, reset_us: u64 },
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        matches!(self, Verdict::Allow { .. })
    }
}

/// Decides one request against a stored TAT (`None`: the key is unknown, its bucket full).
pub fn decide(tat: Option<u64>, now: u64, rate: Rate) -> Verdict {
    let capacity = rate.capacity_us();
    // A TAT further out than an empty bucket is one a stricter rule left (the policy was
    // loosened since): it counts as empty under this rule, so a client refused for a day by
    // "5/day" waits one interval of "100/h", not the rest of the day. (The stores keep the
    // TAT so brought in, so that the bucket refills from then.)
    let tat = tat
        .unwrap_or(now)
        .max(now)
        .min(now.saturating_add(capacity));
    let new_tat = tat.saturating_add(rate.interval_us);
    let used = new_tat - now;
    if used > capacity {
        Verdict::Deny {
            retry_after_us: used - capacity,
            reset_us: tat - now,
        }
    } else {
        Verdict::Allow {
            new_tat,
            remaining: u32::try_from((capacity - used) / rate.interval_us.max(1))
                .unwrap_or(u32::MAX),
            reset_us: used,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000;

    /// Sends `per_second` evenly spaced requests for `seconds` and counts admissions.
    fn admitted(rate: Rate, per_second: u64, seconds: u64) -> u64 {
        let mut tat = None;
        let mut count = 0;
        let step = SECOND / per_second;
        let mut now = 1_000 * SECOND;
        let end = now + seconds * SECOND;
        while now < end {
            if let Verdict::Allow { new_tat, .. } = decide(tat, now, rate) {
                tat = Some(new_tat);
                count += 1;
            }
            now += step;
        }
        count
    }

    #[test]
    fn a_bucket_emptied_under_a_stricter_rule_is_only_empty_under_a_looser_one() {
        let per_day = Rate {
            interval_us: 86_400 * SECOND / 5,
            burst: 5,
        };
        let per_hour = Rate {
            interval_us: 36 * SECOND,
            burst: 5,
        };
        let now = 1_000 * SECOND;
        let mut tat = None;
        for _ in 0..5 {
            match decide(tat, now, per_day) {
                Verdict::Allow { new_tat, .. } => tat = Some(new_tat),
                Verdict::Deny { .. } => panic!("within the burst"),
            }
        }
        assert!(!decide(tat, now, per_day).allowed());
        // The operator loosens the rule: one interval of the new rate, not the rest of the day.
        assert_eq!(
            decide(tat, now, per_hour),
            Verdict::Deny {
                retry_after_us: 36 * SECOND,
                reset_us: 5 * 36 * SECOND,
            }
        );
    }

    #[test]
    fn admits_burst_plus_rate_times_duration() {
        // 3 per minute, burst 3, hammered at 50/s for 60 s: 3 + 3 = 6 (±1).
        let per_minute = Rate {
            interval_us: 20 * SECOND,
            burst: 3,
        };
        let count = admitted(per_minute, 50, 60);
        assert!((5..=7).contains(&count), "{count}");
        // 10/s, burst 5, 100/s for 10 s: 5 + 100.
        let fast = Rate {
            interval_us: SECOND / 10,
            burst: 5,
        };
        let count = admitted(fast, 100, 10);
        assert!((104..=106).contains(&count), "{count}");
    }

    #[test]
    fn deny_reports_when_to_retry() {
        let rate = Rate {
            interval_us: SECOND,
            burst: 2,
        };
        let now = 5 * SECOND;
        let Verdict::Allow {
            new_tat, remaining, ..
        } = decide(None, now, rate)
        else {
            panic!()
        };
        assert_eq!(remaining, 1);
        let Verdict::Allow {
            new_tat,
            remaining,
            reset_us,
        } = decide(Some(new_tat), now, rate)
        else {
            panic!()
        };
        assert_eq!((remaining, reset_us), (0, 2 * SECOND));
        assert_eq!(
            decide(Some(new_tat), now, rate),
            Verdict::Deny {
                retry_after_us: SECOND,
                reset_us: 2 * SECOND
            }
        );
        // A second later one token is back.
        assert!(decide(Some(new_tat), now + SECOND, rate).allowed());
    }

    #[test]
    fn shares_divide_rate_and_burst() {
        let rate = Rate {
            interval_us: SECOND,
            burst: 10,
        };
        assert_eq!(
            rate.share(4),
            Rate {
                interval_us: 4 * SECOND,
                burst: 2
            }
        );
        assert_eq!(rate.share(20).burst, 1);
    }
}
