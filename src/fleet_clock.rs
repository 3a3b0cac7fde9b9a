//! The wall times stale copies are stamped and aged by, in ms since the epoch: two clocks the
//! machine's own wall clock is not.
//! - The local clock ([`local_ms`]): steps do not move it. It runs on the monotonic clock from
//!   the wall time read at start, so an NTP step after a VM migration (an hour back or forth)
//!   neither makes every copy in memory look an hour old (none served in the outage that
//!   follows) nor keeps an old one young for an hour.
//! - The fleet's clock ([`to_fleet`], [`to_local`]): Redis's, once levee has read it
//!   (`TIME`, every `sync_interval` with the fleet view), which times written into Redis are
//!   converted to and read back from, so instances whose clocks disagree agree on a shared
//!   copy's age: one five minutes ahead refused every copy the others stored, and its own
//!   copies looked fresh to them for five minutes too long. Copies in memory stay on the local
//!   clock: one kept before Redis's clock was first read is not aged anew when it is.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The wall time read once, and the monotonic instant it was read at.
fn base() -> &'static (u64, Instant) {
    static BASE: OnceLock<(u64, Instant)> = OnceLock::new();
    BASE.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        (wall, Instant::now())
    })
}

/// This process's step-free wall time at `at`.
fn local_ms_at(at: Instant) -> u64 {
    let (wall, read_at) = base();
    wall + at.saturating_duration_since(*read_at).as_millis() as u64
}

/// A step-free wall clock that follows Redis's once told it.
struct Clock {
    /// Redis's clock minus this process's, in ms, as last measured (0 until then, or
    /// without `[redis]`).
    redis_offset_ms: AtomicI64,
}

impl Clock {
    fn to_fleet(&self, local: u64) -> u64 {
        local.saturating_add_signed(self.redis_offset_ms.load(Ordering::Relaxed))
    }

    fn to_local(&self, fleet: u64) -> u64 {
        fleet.saturating_add_signed(-self.redis_offset_ms.load(Ordering::Relaxed))
    }

    fn follow_redis(&self, redis_ms: u64, asked: Instant, answered: Instant) {
        let middle = asked + answered.saturating_duration_since(asked) / 2;
        let offset = redis_ms as i64 - local_ms_at(middle) as i64;
        self.redis_offset_ms.store(offset, Ordering::Relaxed);
    }
}

static FLEET: Clock = Clock {
    redis_offset_ms: AtomicI64::new(0),
};

/// Now on the local clock: the wall time at start carried on by the monotonic clock.
pub fn local_ms() -> u64 {
    local_ms_at(Instant::now())
}

/// A time of the local clock on the fleet's (Redis's, once read), for Redis.
pub fn to_fleet(local: u64) -> u64 {
    FLEET.to_fleet(local)
}

/// A time of the fleet's clock, read from Redis, on the local clock.
pub fn to_local(fleet: u64) -> u64 {
    FLEET.to_local(fleet)
}

/// Takes Redis's clock as the fleet's: `redis_ms` is its `TIME`, asked at `asked` and
/// answered at `answered` (it is taken for the middle of the two).
pub fn follow_redis(redis_ms: u64, asked: Instant, answered: Instant) {
    FLEET.follow_redis(redis_ms, asked, answered);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn redis_time_is_followed_from_the_middle_of_its_call() {
        let clock = Clock {
            redis_offset_ms: AtomicI64::new(0),
        };
        let ahead = |clock: &Clock| {
            let local = local_ms();
            clock.to_fleet(local) as i64 - local as i64
        };
        assert_eq!(ahead(&clock), 0);
        let asked = Instant::now();
        let answered = asked + Duration::from_millis(10);
        // Redis's clock five minutes ahead of this process's.
        let redis = local_ms_at(asked + Duration::from_millis(5)) + 300_000;
        clock.follow_redis(redis, asked, answered);
        assert_eq!(ahead(&clock), 300_000);
        assert_eq!(clock.to_local(clock.to_fleet(1_000_000)), 1_000_000);
        clock.follow_redis(redis - 600_000, asked, answered);
        assert_eq!(ahead(&clock), -300_000);
    }
}
