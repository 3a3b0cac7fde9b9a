//! Writes that count only once replicas hold them (`[queue] wait_replicas`).
//!
//! `WAIT n timeout` counts the replicas that have acknowledged every write made *on its own
//! connection* so far, and Redis serves nothing else on that connection until they did or the
//! timeout passed. On the connection every other call shares, one WAIT would hold rate-limit
//! decisions and switch reads behind it (for the whole timeout while a replica is away), so
//! these writes go over a connection of their own.
//!
//! There, the writes that come while one batch waits go out together in the next, followed
//! by one WAIT (a group commit): any number of writers cost one round trip to the replicas,
//! and a replica outage costs each write one timeout, not a queue of them. No task runs for
//! this: the first writer to find the connection free sends what is waiting, in a task of its
//! own, so a writer that gives up (its client left) takes nobody's answer with it.
//! Each batch is followed by a new turn, and a new connect (with Sentinel, to the master named
//! since): a writer whose write is left for a later batch waits for the turn again.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionManager;
use tokio::sync::oneshot;

use crate::log_throttle::LogThrottle;
use crate::redis_batch::lock;
use crate::redis_store::RedisFailure;

/// Writes sent in one batch at most: a batch is one pipeline, and a Redis that runs scripts
/// back to back serves no one else meanwhile.
const MOST_PER_BATCH: usize = 64;
/// Writes that may wait for the connection; past this a write fails at once (the queue route
/// answers 503, nothing stored) instead of queueing without bound behind a stalled Redis.
const MOST_WAITING: usize = 4096;

/// What became of one write: Redis's answer to it, and how many replicas had it (and every
/// write before it on the connection) when the batch's WAIT returned.
#[derive(Debug)]
pub struct Confirmed {
    pub answer: redis::Value,
    pub replicas: u32,
}

/// One write waiting for its batch.
struct Pending {
    command: redis::Cmd,
    replicas: u32,
    wait: Duration,
    /// How long the batch carrying this write may take, connecting excluded.
    bound: Duration,
    answer: oneshot::Sender<Result<Confirmed, RedisFailure>>,
}

/// The writes waiting for the connection to one server, and whose turn it is to send them.
#[derive(Default)]
pub struct WaitingWrites {
    pending: Arc<Mutex<VecDeque<Pending>>>,
    /// Held by the batch at Redis: one at a time, since a WAIT holds the connection anyway.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The connection to a fixed server (a single one, or a cluster node), once made. With
    /// Sentinel, the master link keeps it instead, to follow the master the sentinels name.
    connection: tokio::sync::OnceCell<ConnectionManager>,
}

impl WaitingWrites {
    /// The connection to the fixed server `client` leads to, made the first time. It
    /// connects again by itself; its calls have no response timeout of their own, since
    /// each batch is bounded by its writers.
    pub async fn fixed_connection(
        &self,
        client: impl FnOnce() -> Result<redis::Client, RedisFailure>,
        timeout: Duration,
    ) -> Result<ConnectionManager, RedisFailure> {
        let connection = self
            .connection
            .get_or_try_init(|| async {
                crate::redis_store::connection_manager(client()?, timeout, None).await
            })
            .await?;
        Ok(connection.clone())
    }

    /// Sends `command` in the next batch, and waits for that batch's WAIT for `replicas`
    /// replicas (at most `wait`). `connect` gives the connection of these writes each time
    /// this writer sends a batch. The caller bounds the whole; the batch itself is bounded by
    /// `bound`, so a write whose writer gave up never holds the others.
    pub async fn write<F, C>(
        &self,
        command: redis::Cmd,
        replicas: u32,
        wait: Duration,
        bound: Duration,
        connect: C,
    ) -> Result<Confirmed, RedisFailure>
    where
        C: Fn() -> F,
        F: std::future::Future<Output = Result<ConnectionManager, RedisFailure>>,
    {
        let (answer, mut answered) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            if pending.len() >= MOST_WAITING {
                // Writes whose writers left count for nothing (else a stall that outlived
                // its writers would refuse every write after it, with nobody left to send).
                pending.retain(|write| !write.answer.is_closed());
            }
            if pending.len() >= MOST_WAITING {
                return Err(RedisFailure::Overloaded(pending.len()));
            }
            pending.push_back(Pending {
                command,
                replicas,
                wait,
                bound,
                answer,
            });
        }
        let lost = || RedisFailure::Connection("the write's batch ended without an answer".into());
        loop {
            let turn = tokio::select! {
                biased;
                answer = &mut answered => return answer.unwrap_or_else(|_| Err(lost())),
                turn = self.turn.clone().lock_owned() => turn,
            };
            // No batch is out while this writer has the turn: with none waiting either, its
            // own write was sent, and answered.
            if lock(&self.pending).is_empty() {
                drop(turn);
                return answered.await.unwrap_or_else(|_| Err(lost()));
            }
            // Connected anew for each batch (a cached connection, as a rule): with Sentinel, a
            // master named since is followed. Connecting happens before the batch is taken, so
            // a writer that gives up meanwhile leaves the writes where the next one finds
            // them. One batch, then the turn goes to the writers waiting for it, this one
            // among them while its own write waits.
            let connection = match connect().await {
                Ok(connection) => connection,
                Err(error) => {
                    // Nothing was sent: every write waiting is told so at once, rather than
                    // each trying a connection that just failed.
                    let message = error.to_string();
                    let everyone = std::mem::take(&mut *lock(&self.pending));
                    fail_all(everyone, || RedisFailure::NotSent(message.clone()));
                    drop(turn);
                    return answered
                        .await
                        .unwrap_or_else(|_| Err(RedisFailure::NotSent(message)));
                }
            };
            let batch = take_batch(&self.pending);
            tokio::spawn(async move {
                send_batch(connection, batch).await;
                drop(turn);
            });
        }
    }
}

/// The oldest waiting writes, up to a batch, whose writers still wait.
fn take_batch(pending: &Mutex<VecDeque<Pending>>) -> Vec<Pending> {
    let mut pending = lock(pending);
    pending.retain(|write| !write.answer.is_closed());
    let count = pending.len().min(MOST_PER_BATCH);
    pending.drain(..count).collect()
}

/// Sends the writes in one pipeline followed by one WAIT, and answers each writer.
async fn send_batch(mut connection: ConnectionManager, batch: Vec<Pending>) {
    if batch.is_empty() {
        return;
    }
    let replicas = batch.iter().map(|write| write.replicas).max().unwrap_or(1);
    let wait = batch
        .iter()
        .map(|write| write.wait)
        .max()
        .unwrap_or_default();
    let bound = batch
        .iter()
        .map(|write| write.bound)
        .max()
        .unwrap_or_default();
    let mut pipeline = redis::pipe();
    pipeline.ignore_errors();
    for write in &batch {
        pipeline.add_command(write.command.clone());
    }
    pipeline.cmd("WAIT").arg(replicas).arg(wait_millis(wait));
    let sent = tokio::time::timeout(
        bound,
        pipeline.query_async::<Vec<redis::RedisResult<redis::Value>>>(&mut connection),
    )
    .await;
    let mut answers = match sent {
        Ok(Ok(answers)) if answers.len() == batch.len() + 1 => answers,
        Ok(Ok(answers)) => {
            let failure = format!(
                "{} answers to a batch of {} writes and a WAIT",
                answers.len(),
                batch.len()
            );
            return fail_all(batch, || RedisFailure::BadReply(failure.clone()));
        }
        Ok(Err(error)) => return fail_all(batch, || failure_of(&error)),
        Err(_elapsed) => return fail_all(batch, || RedisFailure::Timeout(bound)),
    };
    let confirmed_by = match answers.pop() {
        Some(Ok(redis::Value::Int(count))) => u32::try_from(count).unwrap_or(0),
        other => {
            // The writes ran; only their confirmation is unknown, so none counts as confirmed.
            // (Redis refuses WAIT to a user whose ACL lacks it, and on a replica.)
            static NOT_A_COUNT: LogThrottle = LogThrottle::new(Duration::from_secs(10));
            if let Some(held_back) = NOT_A_COUNT.allow(std::time::Instant::now()) {
                tracing::warn!(held_back, "redis's answer to WAIT was not a count of replicas, so no job counts as confirmed: {other:?}");
            }
            0
        }
    };
    for (write, answer) in batch.into_iter().zip(answers) {
        let _ = write.answer.send(match answer {
            Ok(answer) => Ok(Confirmed {
                answer,
                replicas: confirmed_by,
            }),
            Err(error) => Err(RedisFailure::Redis(error)),
        });
    }
}

/// Answers every write of `writes` with a failure of its own (a `RedisFailure` is not
/// `Clone`).
fn fail_all(writes: impl IntoIterator<Item = Pending>, failure: impl Fn() -> RedisFailure) {
    for write in writes {
        let _ = write.answer.send(Err(failure()));
    }
}

/// WAIT's timeout in milliseconds: never 0, which would make Redis wait for ever.
fn wait_millis(wait: Duration) -> u64 {
    u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A failure of the whole batch, for each of its writers (a `RedisError` is not `Clone`).
fn failure_of(error: &redis::RedisError) -> RedisFailure {
    if error.code() == Some("READONLY") {
        RedisFailure::MasterMoved(error.to_string())
    } else {
        RedisFailure::Connection(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_is_never_for_ever() {
        assert_eq!(wait_millis(Duration::ZERO), 1);
        assert_eq!(wait_millis(Duration::from_micros(300)), 1);
        assert_eq!(wait_millis(Duration::from_millis(250)), 250);
    }

    #[tokio::test]
    async fn writes_whose_writers_left_are_not_sent() {
        let pending = Mutex::new(VecDeque::new());
        let (kept, _kept_answer) = oneshot::channel();
        let (left, left_answer) = oneshot::channel();
        drop(left_answer);
        for answer in [left, kept] {
            lock(&pending).push_back(Pending {
                command: redis::cmd("PING"),
                replicas: 1,
                wait: Duration::from_millis(1),
                bound: Duration::from_millis(1),
                answer,
            });
        }
        assert_eq!(take_batch(&pending).len(), 1);
        assert!(lock(&pending).is_empty());
    }
}
