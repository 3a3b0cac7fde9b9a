//! In-process buckets: the embedded default (no `[redis]`) and the `local` fallback while
//! Redis is down. Memory is bounded: idle buckets (already full again) are swept, and a shard
//! that still grows past its share of `max_keys` forgets the half of its buckets that are
//! nearest to full again, rather than growing without end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::gcra::{decide, Rate, Verdict};

const SHARDS: usize = 16;

/// One bucket to decide: its key, its rate, and whether it is a dry run.
pub struct Ask<'a> {
    pub key: &'a str,
    pub rate: Rate,
    pub dry_run: bool,
    /// A TAT the bucket is at least at, known from elsewhere: for the fallback, when Redis's
    /// last refusal of the key said its shared bucket is full again (levee's clock). Without
    /// it, each switch to the fallback found a full bucket and gave a flooding client a fresh
    /// burst.
    pub at_least: Option<u64>,
}

pub struct LocalStore {
    shards: Vec<Mutex<HashMap<String, Bucket>>>,
    max_keys_per_shard: usize,
}

/// One bucket: its theoretical arrival time, and the time a full bucket spans (interval ×
/// burst), by which how full it is can be told whatever its rule's rate.
#[derive(Clone, Copy)]
struct Bucket {
    tat: u64,
    span: u64,
}

impl Bucket {
    /// How much of the bucket is used, in thousandths: 0 is full again, 1000 and more is a
    /// client being refused.
    fn used(&self, now: u64) -> u64 {
        self.tat.saturating_sub(now).saturating_mul(1000) / self.span.max(1)
    }
}

/// Forgets the half of `map`'s buckets that are nearest to full again, measured against each
/// bucket's own span: their loss gives a client the least extra. Buckets of clients being
/// refused are the last to go, whatever their rules' rates, so a flood of new keys cannot
/// reset them.
fn forget_nearest_to_full(map: &mut HashMap<String, Bucket>, now: u64) {
    let mut used: Vec<u64> = map.values().map(|bucket| bucket.used(now)).collect();
    if used.is_empty() {
        return;
    }
    let middle = used.len() / 2;
    let (_, &mut median, _) = used.select_nth_unstable(middle);
    map.retain(|_, bucket| bucket.used(now) > median);
}

impl LocalStore {
    /// `max_keys`: the most buckets kept in memory (default 100,000, about 10 MB).
    pub fn new(max_keys: usize) -> LocalStore {
        LocalStore {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            max_keys_per_shard: (max_keys / SHARDS).max(16),
        }
    }

    fn shard_of(key: &str) -> usize {
        // FNV-1a: cheap and stable; the shard only spreads lock contention.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in key.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        (hash % SHARDS as u64) as usize
    }

    /// Decides all asks at the time `clock` gives (µs), all or nothing: when a non-dry-run
    /// ask is refused, no bucket is charged.
    pub fn decide_all(&self, asks: &[Ask<'_>], clock: impl FnOnce() -> u64) -> Vec<Verdict> {
        // Lock the shards involved in index order, so two requests never deadlock.
        let mut shard_ids: Vec<usize> = asks.iter().map(|ask| Self::shard_of(ask.key)).collect();
        shard_ids.sort_unstable();
        shard_ids.dedup();
        let mut guards: Vec<(usize, std::sync::MutexGuard<'_, HashMap<String, Bucket>>)> =
            shard_ids
                .iter()
                .map(|&id| {
                    (
                        id,
                        self.shards[id]
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner()),
                    )
                })
                .collect();
        // The clock is read with the shards locked: a time read before, by a request that
        // then waited for the lock, could be older than the time of the decision that stored
        // the bucket's TAT meanwhile, and GCRA would refuse the last token of a burst for
        // those microseconds.
        let now = clock();
        let verdicts: Vec<Verdict> = asks
            .iter()
            .map(|ask| {
                let shard = Self::shard_of(ask.key);
                let stored = guards
                    .iter_mut()
                    .find(|(id, _)| *id == shard)
                    .and_then(|(_, map)| map.get_mut(ask.key))
                    .map(|bucket| {
                        // Further out than an empty bucket under this rule: a stricter rule
                        // (before a reload loosened it) left it. Brought in and kept so, the
                        // bucket refills from now at the new rate, refused or not.
                        let empty = now.saturating_add(ask.rate.capacity_us());
                        if bucket.tat > empty {
                            bucket.tat = empty;
                            bucket.span = ask.rate.capacity_us();
                        }
                        bucket.tat
                    });
                // `None` (no bucket) is below any time: the later of the two, or the one there.
                decide(stored.max(ask.at_least), now, ask.rate)
            })
            .collect();
        let blocked = asks
            .iter()
            .zip(&verdicts)
            .any(|(ask, verdict)| !ask.dry_run && !verdict.allowed());
        if !blocked {
            for (ask, verdict) in asks.iter().zip(&verdicts) {
                if let Verdict::Allow { new_tat, .. } = verdict {
                    let shard = Self::shard_of(ask.key);
                    if let Some((_, map)) = guards.iter_mut().find(|(id, _)| *id == shard) {
                        if map.len() >= self.max_keys_per_shard && !map.contains_key(ask.key) {
                            map.retain(|_, bucket| bucket.tat > now);
                            if map.len() >= self.max_keys_per_shard {
                                // Once per shard filling up: under a flood of new keys (every
                                // request from a new address) that was many lines a second.
                                static FULL: crate::log_throttle::LogThrottle =
                                    crate::log_throttle::LogThrottle::new(
                                        std::time::Duration::from_secs(10),
                                    );
                                if let Some(held_back) = FULL.allow(std::time::Instant::now()) {
                                    tracing::warn!(
                                        held_back,
                                        "in-process rate-limit store is full; forgetting the half of one shard's buckets nearest to full (said at most every 10 s)"
                                    );
                                }
                                forget_nearest_to_full(map, now);
                            }
                        }
                        let span = ask
                            .rate
                            .interval_us
                            .saturating_mul(u64::from(ask.rate.burst));
                        map.insert(
                            ask.key.to_string(),
                            Bucket {
                                tat: *new_tat,
                                span,
                            },
                        );
                    }
                }
            }
        }
        verdicts
    }

    /// Drops buckets that are full again (their TAT has passed): they mean the same as absent.
    pub fn sweep(&self, now: u64) {
        for shard in &self.shards {
            let mut map = shard
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            map.retain(|_, bucket| bucket.tat > now);
            if map.capacity() > 4 * map.len().max(64) {
                map.shrink_to_fit();
            }
        }
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.lock().map(|map| map.len()).unwrap_or(0))
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Keys known to be over their limit until a time: refused without asking Redis, so a flood
/// from one key does not become a flood on Redis. An entry is kept until its bucket is full
/// again, past the refusal: the fallback starts the key's in-process bucket as full as Redis
/// last said, if Redis stops answering meanwhile. Bounded to `max` entries; when full, the
/// refusals that still hold are kept first.
pub struct DenyCache {
    entries: Mutex<HashMap<String, Refused>>,
    /// Whether `entries` holds any: set under its lock. Nearly always false (nobody is over
    /// a limit), and then a lookup takes neither the lock nor a hash of the key.
    any: AtomicBool,
    max: usize,
}

/// What Redis said of a refused key, as times on levee's clock (µs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    /// When the next request may pass (`Retry-After`).
    pub until: u64,
    /// When the bucket is full again (`RateLimit`'s `t=`).
    pub full_at: u64,
    /// The rule's rate at the time: a reload that changes it makes the refusal unknown.
    pub rate: Rate,
}

impl DenyCache {
    pub fn new(max: usize) -> DenyCache {
        DenyCache {
            entries: Mutex::new(HashMap::new()),
            any: AtomicBool::new(false),
            max,
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Refused>> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Remembers that `key` is refused until `refused.until`.
    pub fn insert(&self, key: &str, refused: Refused, now: u64) {
        let mut entries = self.entries();
        if entries.len() >= self.max && !entries.contains_key(key) {
            entries.retain(|_, entry| entry.until > now);
            if entries.len() >= self.max {
                return;
            }
        }
        entries.insert(key.to_string(), refused);
        self.any.store(true, Ordering::Release);
    }

    /// Redis's last refusal of `key`, if it was made under `rate` (a reload that changed the
    /// rule makes it unknown).
    fn known(&self, key: &str, rate: Rate) -> Option<Refused> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.entries()
            .get(key)
            .copied()
            .filter(|entry| entry.rate == rate)
    }

    /// What is known of `key`'s refusal under `rate`, if it still holds at `now`.
    pub fn refused(&self, key: &str, rate: Rate, now: u64) -> Option<Refused> {
        self.known(key, rate).filter(|entry| entry.until > now)
    }

    /// When Redis's last refusal of `key` under `rate` said its bucket is full again: the
    /// TAT the fallback's bucket is at least at (a time already past means nothing more).
    pub fn full_at(&self, key: &str, rate: Rate) -> Option<u64> {
        self.known(key, rate).map(|entry| entry.full_at)
    }

    pub fn sweep(&self, now: u64) {
        let mut entries = self.entries();
        entries.retain(|_, entry| entry.full_at > now);
        self.any.store(!entries.is_empty(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000;

    #[test]
    fn a_refused_rule_charges_no_other_rule() {
        let store = LocalStore::new(1000);
        let per_ip = Rate {
            interval_us: SECOND,
            burst: 10,
        };
        let per_user = Rate {
            interval_us: SECOND,
            burst: 1,
        };
        let asks = |user: &'static str| {
            vec![
                Ask {
                    key: "ip",
                    rate: per_ip,
                    dry_run: false,
                    at_least: None,
                },
                Ask {
                    key: user,
                    rate: per_user,
                    dry_run: false,
                    at_least: None,
                },
            ]
        };
        let now = 100 * SECOND;
        assert!(store
            .decide_all(&asks("u1"), || now)
            .iter()
            .all(Verdict::allowed));
        // u1 is over its limit 5 times; the IP keeps its remaining 9 tokens.
        for _ in 0..5 {
            assert!(!store.decide_all(&asks("u1"), || now)[1].allowed());
        }
        let verdicts = store.decide_all(&asks("u2"), || now);
        assert!(
            matches!(verdicts[0], Verdict::Allow { remaining: 8, .. }),
            "{verdicts:?}"
        );
    }

    #[test]
    fn a_flood_of_new_keys_does_not_reset_a_bucket_that_is_refusing() {
        fn ask(key: &str, rate: Rate) -> Ask<'_> {
            Ask {
                key,
                rate,
                dry_run: false,
                at_least: None,
            }
        }
        let slow = Rate {
            interval_us: 3600 * SECOND,
            burst: 5,
        };
        let fast = Rate {
            interval_us: SECOND / 10,
            burst: 5,
        };
        let now = 100 * SECOND;
        // A flood of new keys (one request each) on either rule, with a client being refused
        // on the other: fullness is measured against each rule's own span, so the refusing
        // bucket outranks the flood's whatever the two rates.
        for (victim_rate, flood_rate) in [(slow, fast), (fast, slow)] {
            let store = LocalStore::new(256);
            while store.decide_all(&[ask("victim", victim_rate)], || now)[0].allowed() {}
            for i in 0..20_000 {
                let key = format!("flood|{i}");
                store.decide_all(&[ask(&key, flood_rate)], || now);
            }
            assert!(store.len() <= 256, "bounded: {}", store.len());
            assert!(
                !store.decide_all(&[ask("victim", victim_rate)], || now)[0].allowed(),
                "the refusing bucket survived the flood"
            );
        }
    }

    #[test]
    fn a_bucket_emptied_under_a_stricter_rule_refills_at_the_looser_rate() {
        let store = LocalStore::new(1000);
        let ask = |rate| {
            [Ask {
                key: "alice",
                rate,
                dry_run: false,
                at_least: None,
            }]
        };
        let per_day = Rate {
            interval_us: 86_400 * SECOND / 5,
            burst: 5,
        };
        let per_hour = Rate {
            interval_us: 36 * SECOND,
            burst: 5,
        };
        let now = 1_000 * SECOND;
        while store.decide_all(&ask(per_day), || now)[0].allowed() {}
        // Loosened: refused for one interval of the new rate, then let in.
        assert!(!store.decide_all(&ask(per_hour), || now)[0].allowed());
        assert!(!store.decide_all(&ask(per_hour), || now + 35 * SECOND)[0].allowed());
        assert!(store.decide_all(&ask(per_hour), || now + 36 * SECOND)[0].allowed());
    }

    #[test]
    fn dry_run_rules_never_block_and_are_not_charged_when_over() {
        let store = LocalStore::new(1000);
        let one = Rate {
            interval_us: SECOND,
            burst: 1,
        };
        let asks = [
            Ask {
                key: "dry",
                rate: one,
                dry_run: true,
                at_least: None,
            },
            Ask {
                key: "real",
                rate: Rate {
                    interval_us: SECOND,
                    burst: 5,
                },
                dry_run: false,
                at_least: None,
            },
        ];
        let now = 100 * SECOND;
        for round in 0..3 {
            let verdicts = store.decide_all(&asks, || now);
            assert_eq!(verdicts[0].allowed(), round == 0);
            assert!(verdicts[1].allowed());
        }
    }

    #[test]
    fn memory_stays_bounded() {
        let store = LocalStore::new(16 * 16);
        let rate = Rate {
            interval_us: SECOND,
            burst: 1,
        };
        for i in 0..10_000 {
            let key = format!("client-{i}");
            store.decide_all(
                &[Ask {
                    key: &key,
                    rate,
                    dry_run: false,
                    at_least: None,
                }],
                || 100 * SECOND,
            );
        }
        assert!(store.len() <= 16 * 16, "{}", store.len());
        store.sweep(200 * SECOND);
        assert!(store.is_empty());
    }

    #[test]
    fn concurrent_requests_of_a_fresh_bucket_all_get_its_burst() {
        // Threads on a real clock race for the same fresh bucket, again and again. A time read
        // before the lock could be older than the TAT stored by a rival meanwhile, which
        // refused the last token of the burst for those microseconds.
        const THREADS: u32 = 4;
        let store = LocalStore::new(100_000);
        let epoch = std::time::Instant::now();
        // The reader of the time is set aside right after reading it, as a busy thread is.
        let clock = || {
            let now = u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX) + 1;
            std::thread::yield_now();
            now
        };
        let rate = Rate {
            interval_us: 60 * SECOND,
            burst: THREADS,
        };
        let start = std::sync::Barrier::new(THREADS as usize);
        let refused = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..THREADS {
                scope.spawn(|| {
                    for round in 0..2_000 {
                        let key = format!("round-{round}");
                        let ask = [Ask {
                            key: &key,
                            rate,
                            dry_run: false,
                            at_least: None,
                        }];
                        start.wait();
                        if !store.decide_all(&ask, clock)[0].allowed() {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(refused.into_inner(), 0, "requests refused within the burst");
    }

    #[test]
    fn deny_cache_expires_and_is_bounded() {
        let cache = DenyCache::new(2);
        let rate = Rate {
            interval_us: SECOND,
            burst: 2,
        };
        let refused = |until| Refused {
            until,
            full_at: until + 100,
            rate,
        };
        cache.insert("a", refused(10), 0);
        cache.insert("b", refused(20), 0);
        cache.insert("c", refused(20), 0);
        assert_eq!(cache.refused("a", rate, 5), Some(refused(10)));
        assert_eq!(cache.refused("a", rate, 10), None);
        assert_eq!(
            cache.refused("c", rate, 5),
            None,
            "full cache takes no more"
        );
        cache.insert("c", refused(30), 15);
        assert_eq!(cache.refused("c", rate, 15), Some(refused(30)));
        let loosened = Rate { burst: 10, ..rate };
        assert_eq!(cache.refused("c", loosened, 15), None, "the rule changed");
        // Past the refusal, until the bucket is full again, it still says how full it is.
        assert_eq!(cache.full_at("c", rate), Some(130));
        assert_eq!(cache.full_at("c", loosened), None);
        cache.sweep(100);
        assert_eq!(cache.refused("c", rate, 100), None);
        assert_eq!(cache.full_at("c", rate), Some(130));
        cache.sweep(130);
        assert_eq!(cache.full_at("c", rate), None);
    }

    #[test]
    fn a_bucket_known_fuller_elsewhere_starts_from_there() {
        let store = LocalStore::new(1000);
        let rate = Rate {
            interval_us: SECOND,
            burst: 10,
        };
        let now = 100 * SECOND;
        let ask = |at_least| {
            [Ask {
                key: "flood",
                rate,
                dry_run: false,
                at_least,
            }]
        };
        // Redis said full again in 8.5 s: one token is there (not the ten of a new bucket).
        let seeded = ask(Some(now + 8 * SECOND + SECOND / 2));
        assert!(store.decide_all(&seeded, || now)[0].allowed());
        assert!(!store.decide_all(&seeded, || now)[0].allowed());
        // What the store holds counts when it is the fuller of the two.
        assert!(!store.decide_all(&ask(Some(now)), || now)[0].allowed());
        // A time already past is a full bucket.
        let other = LocalStore::new(1000);
        let verdicts = other.decide_all(&ask(Some(now - SECOND)), || now);
        assert!(
            matches!(verdicts[0], Verdict::Allow { remaining: 9, .. }),
            "{verdicts:?}"
        );
    }
}
