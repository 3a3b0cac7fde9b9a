//! Keeps a busy thread's CPU account with the kernel up to date, so that a CPU quota (a
//! container's CPU limit) holds levee back in short, even pauses instead of long ones.
//!
//! Under a cgroup CPU quota (`cpu.max`, or `cpu.cfs_quota_us` per `cpu.cfs_period_us`), Linux
//! charges a running thread's time to the quota when the thread enters the scheduler, or at
//! a timer tick: every 4 ms at the common `HZ=250`. A levee thread under load rarely enters
//! the scheduler, because its event loop always finds more work; it then runs past its quota
//! until the next tick, and the kernel takes the overrun out of the next period. Measured
//! with a quota of 4 ms per 10 ms period: levee ran 7 ms and paused 3, then ran 1 ms and
//! paused 9, where the quota means 4 and 6; a request caught before a 9 ms pause waited it
//! out whole, and p99 was 10 ms against HAProxy's 7 (HAProxy reads its thread's CPU time
//! twice per loop, which settles the account). Asking the kernel for the thread's own CPU
//! time brings the account up to date, which throttles the thread as soon as its quota is
//! spent. It costs a system call (under a microsecond), made at most once per
//! [`SETTLE_EVERY`] per thread: without a quota it settles nothing and costs about 0.1% of
//! a core at full load.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// How often a busy thread settles its account: the most it can overrun a quota by, beyond
/// the time one request takes.
pub const SETTLE_EVERY: Duration = Duration::from_micros(500);

thread_local! {
    static SETTLED_AT: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Settles this thread's CPU account with the kernel if [`SETTLE_EVERY`] has passed since it
/// last did; `now` is a time the caller read anyway. Returns whether it asked the kernel.
pub fn settle(now: Instant) -> bool {
    SETTLED_AT.with(|settled_at| {
        if !due(settled_at.get(), now) {
            return false;
        }
        settled_at.set(Some(now));
        // The value is not needed: reading it is what makes the kernel charge the time
        // this thread has run so far (`task_sched_runtime` updates the running task first).
        // The fallible call: a kernel built without CPU-time clocks refuses it, and the
        // infallible one would panic then.
        let _ = rustix::time::clock_gettime_dynamic(rustix::time::DynamicClockId::Known(
            rustix::time::ClockId::ThreadCPUTime,
        ));
        true
    })
}

fn due(settled_at: Option<Instant>, now: Instant) -> bool {
    settled_at.is_none_or(|at| now.saturating_duration_since(at) >= SETTLE_EVERY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_settles_at_most_once_per_interval() {
        // A thread of its own, so that the first call below is its first.
        let calls = std::thread::spawn(|| {
            let start = Instant::now();
            [
                settle(start),
                settle(start + SETTLE_EVERY / 2),
                settle(start + SETTLE_EVERY),
                settle(start + SETTLE_EVERY),
            ]
        })
        .join()
        .expect("the thread ends");
        // First call; too soon after it; due again after the interval; not twice for one time.
        assert_eq!(calls, [true, false, true, false]);
    }

    #[test]
    fn an_earlier_time_than_the_last_settling_is_not_due() {
        let start = Instant::now() + Duration::from_secs(1);
        assert!(!due(Some(start), start - Duration::from_millis(5)));
        assert!(due(None, start));
    }
}
