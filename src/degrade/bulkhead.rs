//! `max_inflight` per upstream: a bound on concurrent requests (set it near php-fpm's
//! `pm.max_children`) that sheds by tier when the pool fills. Tier 3 may use up to
//! `1 - 2 × reserve` of the slots, tier 2 up to `1 - reserve`, tier 1 all of them; tiers 1
//! and 2 wait up to `max_wait` for a slot, tier 3 never waits. So php-fpm's pool never
//! overflows into nginx 502s, and the core of the site keeps its share.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BulkheadSettings {
    pub max_inflight: u32,
    /// Share of slots kept for tier 1 (and again for tier 2 over tier 3). Default 0.2.
    pub reserve: f64,
    /// Longest wait for a slot (tiers 1 and 2). Default 100ms.
    pub max_wait: Duration,
}

#[derive(Debug)]
pub struct Bulkhead {
    pub settings: BulkheadSettings,
    inflight: AtomicU32,
    /// Waiters of tier 1 and of tier 2, woken apart: a freed slot that a tier-2 waiter may
    /// not take (above its share) must still reach a tier-1 waiter, which may.
    freed: [Notify; 2],
}

/// A taken slot; dropping it frees the slot.
pub struct Slot {
    bulkhead: Arc<Bulkhead>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.bulkhead.inflight.fetch_sub(1, Ordering::AcqRel);
        for waiters in &self.bulkhead.freed {
            waiters.notify_one();
        }
    }
}

impl Bulkhead {
    pub fn new(settings: BulkheadSettings) -> Bulkhead {
        Bulkhead {
            settings,
            inflight: AtomicU32::new(0),
            freed: [Notify::new(), Notify::new()],
        }
    }

    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Acquire)
    }

    /// Slots a request of `tier` may fill up to.
    pub fn limit_for(&self, tier: u8) -> u32 {
        let max = f64::from(self.settings.max_inflight);
        let share = match tier {
            0 | 1 => 1.0,
            2 => 1.0 - self.settings.reserve,
            _ => 1.0 - 2.0 * self.settings.reserve,
        };
        ((max * share).floor() as u32).clamp(1, self.settings.max_inflight)
    }

    fn try_take(self: &Arc<Self>, limit: u32) -> Option<Slot> {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                (current < limit).then_some(current + 1)
            })
            .ok()
            .map(|_| Slot {
                bulkhead: self.clone(),
            })
    }

    /// A slot for a request of `tier` if one is free now, without waiting.
    pub fn take_free(self: &Arc<Self>, tier: u8) -> Option<Slot> {
        self.try_take(self.limit_for(tier))
    }

    /// Is a slot free within `tier`'s share now?
    pub fn has_free(&self, tier: u8) -> bool {
        self.inflight() < self.limit_for(tier)
    }

    /// Takes a slot within `tier`'s share as soon as one is free, looking every `step` for up
    /// to `longest`: for background work (queue replays), which yields to requests instead of
    /// queueing with them for freed slots.
    pub async fn take_when_free(
        self: &Arc<Self>,
        tier: u8,
        step: Duration,
        longest: Duration,
    ) -> Option<Slot> {
        let limit = self.limit_for(tier);
        let deadline = Instant::now() + longest;
        loop {
            if let Some(slot) = self.try_take(limit) {
                return Some(slot);
            }
            if Instant::now() + step > deadline {
                return None;
            }
            tokio::time::sleep(step).await;
        }
    }

    /// Takes a slot for a request of `tier`, or `None` when it must be shed.
    pub async fn acquire(self: &Arc<Self>, tier: u8) -> Option<Slot> {
        let limit = self.limit_for(tier);
        if let Some(slot) = self.try_take(limit) {
            return Some(slot);
        }
        if tier >= 3 {
            return None;
        }
        let deadline = Instant::now() + self.settings.max_wait;
        let waiters = &self.freed[usize::from(tier >= 2)];
        loop {
            let freed = waiters.notified();
            if let Some(slot) = self.try_take(limit) {
                return Some(slot);
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return self.try_take(limit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulkhead(max: u32) -> Arc<Bulkhead> {
        Arc::new(Bulkhead::new(BulkheadSettings {
            max_inflight: max,
            reserve: 0.2,
            max_wait: Duration::from_millis(50),
        }))
    }

    #[test]
    fn tiers_get_shares() {
        let bulkhead = bulkhead(10);
        assert_eq!(
            (
                bulkhead.limit_for(1),
                bulkhead.limit_for(2),
                bulkhead.limit_for(3)
            ),
            (10, 8, 6)
        );
        assert_eq!(
            self::bulkhead(1).limit_for(3),
            1,
            "every tier may use a pool of one"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn background_work_takes_a_slot_once_one_is_free_or_gives_up() {
        let bulkhead = bulkhead(1);
        let held = bulkhead.take_free(1).expect("the only slot");
        let step = Duration::from_millis(20);
        assert!(bulkhead
            .take_when_free(2, step, Duration::from_secs(1))
            .await
            .is_none());
        let waiting = tokio::spawn({
            let bulkhead = bulkhead.clone();
            async move {
                bulkhead
                    .take_when_free(2, step, Duration::from_secs(5))
                    .await
                    .is_some()
            }
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(held);
        assert!(waiting.await.expect("task"), "taken once freed");
        assert_eq!(bulkhead.inflight(), 0, "and freed again when dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn full_pools_shed_tier_3_first_and_keep_room_for_tier_1() {
        let bulkhead = bulkhead(10);
        let mut held = Vec::new();
        for _ in 0..6 {
            held.push(bulkhead.acquire(3).await.expect("tier 3 below its share"));
        }
        assert!(
            bulkhead.acquire(3).await.is_none(),
            "tier 3 is shed at 6 of 10"
        );
        held.push(bulkhead.acquire(2).await.expect("tier 2 still fits"));
        held.push(bulkhead.acquire(2).await.expect("tier 2 still fits"));
        assert!(
            bulkhead.acquire(2).await.is_none(),
            "tier 2 is shed at 8 of 10"
        );
        held.push(bulkhead.acquire(1).await.expect("tier 1 keeps its reserve"));
        held.push(bulkhead.acquire(1).await.expect("tier 1 keeps its reserve"));
        assert_eq!(bulkhead.inflight(), 10);
        // Full: tier 1 waits briefly; a slot freed meanwhile lets it in.
        let waiter = {
            let bulkhead = bulkhead.clone();
            tokio::spawn(async move { bulkhead.acquire(1).await })
        };
        tokio::task::yield_now().await;
        held.pop();
        held.push(waiter.await.expect("task").expect("the freed slot"));
        // Nobody frees a slot: after max_wait tier 1 is shed too.
        assert!(bulkhead.acquire(1).await.is_none());
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn a_freed_slot_a_tier_2_waiter_may_not_take_reaches_a_tier_1_waiter() {
        let bulkhead = bulkhead(10);
        let mut held = Vec::new();
        for _ in 0..10 {
            held.push(bulkhead.acquire(1).await.expect("room"));
        }
        // A tier-2 waiter first, then a tier-1 one.
        let tier_2 = {
            let bulkhead = bulkhead.clone();
            tokio::spawn(async move { bulkhead.acquire(2).await.is_some() })
        };
        tokio::task::yield_now().await;
        let tier_1 = {
            let bulkhead = bulkhead.clone();
            tokio::spawn(async move {
                let asked = Instant::now();
                let slot = bulkhead.acquire(1).await;
                (slot.is_some(), asked.elapsed())
            })
        };
        tokio::task::yield_now().await;
        // One slot frees: 9 in flight, above tier 2's share of 8, so only tier 1 may take it,
        // and at once, not when its wait runs out.
        held.pop();
        let (got, waited) = tier_1.await.expect("task");
        assert!(got, "tier 1 got the freed slot");
        assert!(waited < Duration::from_millis(50), "after {waited:?}");
        assert!(!tier_2.await.expect("task"), "tier 2 stays shed");
        drop(held);
    }
}
