//! Redis Cluster: which master node holds a bucket, and one health breaker per node, so that
//! a node that is down or frozen sends to `on_redis_error` only the requests whose buckets it
//! holds, while the other nodes go on deciding theirs.
//!
//! levee reads the cluster's slot map (`CLUSTER SLOTS`) before its first call that counts
//! against a node's health (that call, and those that come meanwhile, wait for the read),
//! again soon after a call fails (a failover or a resharding moves slots), and every
//! [`REFRESH_EVERY`] while decisions are made. The map only says whose health a call counts
//! against: redis-rs routes the calls themselves, following redirections, so a stale map
//! never sends a call astray.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::time::Instant;

use crate::metrics::RedisNodeLabels;
use crate::redis_batch::lock;
use crate::redis_store::Health;

/// Slots in a Redis Cluster.
const SLOTS: u16 = 16384;

/// Shortest time between two reads of the slot map after calls failed.
const REFRESH_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// Age at which the slot map is read again, failures or not.
const REFRESH_EVERY: Duration = Duration::from_secs(30);

/// Address of the stand-in node for slots the map does not place (not read yet, or a slot
/// being moved): calls on them share one health, as all calls did before the map was known.
pub const UNMAPPED: &str = "unmapped";

/// The slot of a key, by Redis Cluster's rule: CRC16 of the hash tag (the text between the
/// first `{` and the `}` after it, when not empty), or of the whole key, modulo 16384.
pub fn hash_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            match rest.iter().position(|&b| b == b'}') {
                Some(0) | None => None,
                Some(close) => Some(&rest[..close]),
            }
        })
        .unwrap_or(bytes);
    crc16_xmodem(hashed) % SLOTS
}

/// CRC16 with polynomial 0x1021 and initial value 0 (XMODEM), the one Redis Cluster hashes
/// keys with.
fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// A master node, by the address the cluster gives for it, and its health breaker.
#[derive(Clone)]
pub struct Node {
    pub address: Arc<str>,
    pub health: Arc<Mutex<Health>>,
}

impl Node {
    fn new(address: &str) -> Node {
        Node {
            address: Arc::from(address),
            health: Arc::new(Mutex::new(Health::default())),
        }
    }
}

/// One range of slots the map places: `(first, last, index in nodes)`.
type SlotRange = (u16, u16, usize);

#[derive(Default)]
struct SlotMap {
    /// Sorted by first slot.
    ranges: Vec<SlotRange>,
    nodes: Vec<Node>,
    /// When the map was last read successfully.
    read_at: Option<Instant>,
    /// When the last read started, successful or not.
    tried_at: Option<Instant>,
}

/// The slot map and the nodes' health breakers.
pub struct ClusterHealth {
    map: Mutex<SlotMap>,
    unmapped: Node,
    /// A read of the map is under way (one at a time).
    reading: AtomicBool,
    /// A map was installed once (asked on every call, so without taking `map`'s lock).
    read_once: AtomicBool,
    /// Counts the reads that ended, installed or failed: calls that came while the first read
    /// was under way wait on it (see [`Self::wait_for_read_under_way`]).
    reads_ended: tokio::sync::watch::Sender<u64>,
}

impl Default for ClusterHealth {
    fn default() -> ClusterHealth {
        ClusterHealth {
            map: Mutex::new(SlotMap::default()),
            unmapped: Node::new(UNMAPPED),
            reading: AtomicBool::new(false),
            read_once: AtomicBool::new(false),
            reads_ended: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl ClusterHealth {
    /// The node that holds `key`, by the map last read.
    pub fn node_for(&self, key: &str) -> Node {
        let slot = hash_slot(key);
        let map = lock(&self.map);
        let at = map.ranges.partition_point(|&(first, _, _)| first <= slot);
        match at.checked_sub(1).map(|index| map.ranges[index]) {
            Some((_, last, node)) if slot <= last => map.nodes[node].clone(),
            _ => self.unmapped.clone(),
        }
    }

    /// Whether a map was ever read: until then every call counts against the stand-in.
    pub fn was_read(&self) -> bool {
        self.read_once.load(Ordering::Acquire)
    }

    /// Every node the map knows, and the stand-in for unplaced slots while it is in use
    /// (before the map was read, or while a slot is not placed).
    pub fn nodes(&self) -> Vec<Node> {
        let map = lock(&self.map);
        let mut nodes = map.nodes.clone();
        let unmapped_in_use = map.read_at.is_none() || covered(&map.ranges) < u32::from(SLOTS);
        if unmapped_in_use {
            nodes.push(self.unmapped.clone());
        }
        nodes
    }

    /// Claims the next read of the map when one is due: never read, older than
    /// [`REFRESH_EVERY`], or `after_failure` and not tried in the last second. The claim
    /// ends with [`Self::install`] or [`Self::read_failed`].
    pub fn claim_read(&self, after_failure: bool) -> bool {
        let now = Instant::now();
        {
            let map = lock(&self.map);
            let since = |at: Option<Instant>| at.map(|at| now.saturating_duration_since(at));
            let due = match (since(map.read_at), since(map.tried_at)) {
                (_, Some(tried)) if tried < REFRESH_AFTER_FAILURE => false,
                (None, _) => true,
                (Some(age), _) => after_failure || age >= REFRESH_EVERY,
            };
            if !due {
                return false;
            }
        }
        if self.reading.swap(true, Ordering::AcqRel) {
            return false;
        }
        lock(&self.map).tried_at = Some(now);
        true
    }

    /// Installs a map read from the cluster: `(first, last, address)` per range. A node
    /// already known keeps its health (a node cooling down stays so); `node_up` gets a
    /// series for each new node and loses those of nodes gone.
    pub fn install(
        &self,
        ranges: Vec<(u16, u16, String)>,
        node_up: &Family<RedisNodeLabels, Gauge>,
    ) {
        let mut map = lock(&self.map);
        let mut nodes: Vec<Node> = Vec::new();
        let mut placed: Vec<SlotRange> = Vec::with_capacity(ranges.len());
        for (first, last, address) in ranges {
            let index = match nodes.iter().position(|node| *node.address == *address) {
                Some(index) => index,
                None => {
                    let node = match map.nodes.iter().find(|node| *node.address == *address) {
                        Some(known) => known.clone(),
                        None => {
                            let node = Node::new(&address);
                            node_up.get_or_create(&labels(&node)).set(1);
                            node
                        }
                    };
                    nodes.push(node);
                    nodes.len() - 1
                }
            };
            placed.push((first, last, index));
        }
        placed.sort_unstable();
        for gone in map
            .nodes
            .iter()
            .filter(|old| !nodes.iter().any(|node| node.address == old.address))
        {
            node_up.remove(&labels(gone));
        }
        map.ranges = placed;
        map.nodes = nodes;
        map.read_at = Some(Instant::now());
        drop(map);
        self.read_once.store(true, Ordering::Release);
        self.end_read();
    }

    /// Ends a claimed read that failed; the map stays as it was.
    pub fn read_failed(&self) {
        self.end_read();
    }

    fn end_read(&self) {
        self.reading.store(false, Ordering::Release);
        self.reads_ended.send_modify(|ended| *ended += 1);
    }

    /// The first read found no node to connect to: from now on calls go by the stand-in
    /// node's breaker, which answers at once when open, instead of each waiting for a
    /// connection first. (No read was claimed: one under way is left to end by itself.)
    pub fn first_connect_failed(&self) {
        self.reads_ended.send_modify(|ended| *ended += 1);
    }

    /// Whether a read of the map ended, installed or failed.
    pub fn a_read_ended(&self) -> bool {
        *self.reads_ended.borrow() > 0
    }

    /// Waits, up to `timeout`, for the read of the map under way to end; whether one was under
    /// way and ended in that time. Returns at once when no read is under way.
    pub async fn wait_for_read_under_way(&self, timeout: Duration) -> bool {
        // Subscribed before `reading` is looked at: a read that ends in between still wakes
        // this wait.
        let mut ended = self.reads_ended.subscribe();
        if !self.reading.load(Ordering::Acquire) {
            return false;
        }
        matches!(
            tokio::time::timeout(timeout, ended.changed()).await,
            Ok(Ok(()))
        )
    }
}

/// The `levee_redis_node_up` series of a node.
pub fn labels(node: &Node) -> RedisNodeLabels {
    RedisNodeLabels {
        node: node.address.to_string().into(),
    }
}

/// Slots the ranges place (ranges do not overlap).
fn covered(ranges: &[SlotRange]) -> u32 {
    ranges
        .iter()
        .map(|&(first, last, _)| u32::from(last.saturating_sub(first)) + 1)
        .sum()
}

/// Reads a `CLUSTER SLOTS` reply: per range, its first and last slot and the master's
/// `host:port` (the first node listed; replicas follow it and are left out).
pub fn parse_slots(reply: &redis::Value) -> Option<Vec<(u16, u16, String)>> {
    let redis::Value::Array(ranges) = reply else {
        return None;
    };
    ranges
        .iter()
        .map(|range| {
            let redis::Value::Array(fields) = range else {
                return None;
            };
            let slot = |value: Option<&redis::Value>| match value {
                Some(redis::Value::Int(n)) => u16::try_from(*n).ok().filter(|&n| n < SLOTS),
                _ => None,
            };
            let (first, last) = (slot(fields.first())?, slot(fields.get(1))?);
            let Some(redis::Value::Array(master)) = fields.get(2) else {
                return None;
            };
            let host = match master.first()? {
                redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                redis::Value::SimpleString(text) => text.clone(),
                _ => return None,
            };
            let port = match master.get(1)? {
                redis::Value::Int(port) => *port,
                _ => return None,
            };
            (first <= last).then(|| (first, last, format!("{host}:{port}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_that_comes_while_the_first_read_runs_waits_for_its_end() {
        let cluster = Arc::new(ClusterHealth::default());
        assert!(
            !cluster
                .wait_for_read_under_way(Duration::from_secs(5))
                .await
        );
        assert!(cluster.claim_read(false));
        let waiting = {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                cluster
                    .wait_for_read_under_way(Duration::from_secs(5))
                    .await
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished());
        cluster.install(
            vec![(0, SLOTS - 1, "10.0.0.1:7000".to_string())],
            &Family::default(),
        );
        assert!(matches!(waiting.await, Ok(true)));
        assert!(cluster.was_read() && cluster.a_read_ended());
    }

    #[test]
    fn slots_are_redis_clusters() {
        // Slots as `CLUSTER KEYSLOT` gives them.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31c3);
        assert_eq!(hash_slot("foo"), 12182);
        assert_eq!(hash_slot("bar"), 5061);
        assert_eq!(hash_slot("{user1000}.following"), hash_slot("user1000"));
        assert_eq!(
            hash_slot("levee:rl:{alice}:per_user:alice"),
            hash_slot("alice")
        );
        // An empty tag hashes the whole key; only the first `{` counts.
        assert_eq!(hash_slot("foo{}{bar}"), crc16_xmodem(b"foo{}{bar}") % SLOTS);
        assert_eq!(hash_slot("foo{{bar}}zap"), hash_slot("{bar"));
        assert_eq!(hash_slot("foo{bar"), crc16_xmodem(b"foo{bar") % SLOTS);
    }

    fn reply(ranges: &[(i64, i64, &str, i64)]) -> redis::Value {
        redis::Value::Array(
            ranges
                .iter()
                .map(|&(first, last, host, port)| {
                    redis::Value::Array(vec![
                        redis::Value::Int(first),
                        redis::Value::Int(last),
                        redis::Value::Array(vec![
                            redis::Value::BulkString(host.as_bytes().to_vec()),
                            redis::Value::Int(port),
                            redis::Value::BulkString(b"id".to_vec()),
                        ]),
                    ])
                })
                .collect(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn each_node_keeps_its_health_across_reads_of_the_map() {
        let cluster = ClusterHealth::default();
        let node_up = Family::<RedisNodeLabels, Gauge>::default();
        let key_on = |slot_wanted: std::ops::RangeInclusive<u16>| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|key| slot_wanted.contains(&hash_slot(key)))
                .unwrap_or_default()
        };
        let (low, high) = (key_on(0..=8000), key_on(8192..=16383));
        assert_eq!(&*cluster.node_for(&low).address, UNMAPPED);
        assert!(cluster.claim_read(false));
        assert!(!cluster.claim_read(true), "one read at a time");

        let first = reply(&[(8192, 16383, "10.0.0.2", 7001), (0, 8191, "10.0.0.1", 7000)]);
        let ranges = parse_slots(&first).unwrap_or_default();
        cluster.install(ranges, &node_up);
        assert_eq!(&*cluster.node_for(&low).address, "10.0.0.1:7000");
        assert_eq!(&*cluster.node_for(&high).address, "10.0.0.2:7001");
        let addresses = |cluster: &ClusterHealth| -> Vec<String> {
            cluster
                .nodes()
                .iter()
                .map(|n| n.address.to_string())
                .collect()
        };
        assert_eq!(addresses(&cluster), ["10.0.0.2:7001", "10.0.0.1:7000"]);
        lock(&cluster.node_for(&high).health).consecutive_failures = 7;

        // Not due again at once, even after a failure; due a second later after one.
        assert!(!cluster.claim_read(true));
        tokio::time::advance(REFRESH_AFTER_FAILURE).await;
        assert!(!cluster.claim_read(false));
        assert!(cluster.claim_read(true));
        // A failover: 10.0.0.1's slots now on 10.0.0.3; half of them not placed yet.
        let second = reply(&[(0, 4095, "10.0.0.3", 7002), (8192, 16383, "10.0.0.2", 7001)]);
        cluster.install(parse_slots(&second).unwrap_or_default(), &node_up);
        assert_eq!(
            lock(&cluster.node_for(&high).health).consecutive_failures,
            7
        );
        let moved = cluster.node_for(&key_on(0..=4095));
        assert_eq!(&*moved.address, "10.0.0.3:7002");
        assert_eq!(&*cluster.node_for(&key_on(4096..=8191)).address, UNMAPPED);
        assert_eq!(
            addresses(&cluster),
            ["10.0.0.3:7002", "10.0.0.2:7001", UNMAPPED]
        );
        let series = |address: &str| RedisNodeLabels {
            node: address.to_string().into(),
        };
        assert!(
            !node_up.remove(&series("10.0.0.1:7000")),
            "gone node's series removed"
        );
        assert!(node_up.remove(&series("10.0.0.3:7002")));

        tokio::time::advance(REFRESH_EVERY).await;
        assert!(cluster.claim_read(false), "read again when old");
        cluster.read_failed();
    }

    #[test]
    fn replies_that_are_not_slot_maps_are_refused() {
        assert!(parse_slots(&redis::Value::Nil).is_none());
        assert!(parse_slots(&reply(&[(0, 16384, "h", 1)])).is_none());
        assert!(parse_slots(&reply(&[(9, 3, "h", 1)])).is_none());
        let no_master = redis::Value::Array(vec![redis::Value::Array(vec![
            redis::Value::Int(0),
            redis::Value::Int(1),
        ])]);
        assert!(parse_slots(&no_master).is_none());
        assert_eq!(parse_slots(&reply(&[])), Some(vec![]));
    }
}
