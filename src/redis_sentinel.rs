//! Redis Sentinel: which server is the master of a named group now.
//!
//! levee asks the sentinels (`SENTINEL get-master-addr-by-name`) whenever it connects to the
//! master: at the first call, and after a connection broke or a call failed. A task also
//! asks them every [`WATCH_EVERY`]: a failover that leaves the old master running (an
//! operator's `SENTINEL FAILOVER`, or a master cut off from the sentinels) keeps its
//! connections open and writable for a while, so levee must not wait for them to fail. When
//! the named master changes, the connections to the old one are dropped. Every connection to
//! a named master is checked to be a master (`INFO replication`), so a sentinel that has not
//! seen a failover yet is not followed to a replica.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::select_ok;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, IntoConnectionInfo, RedisConnectionInfo};

use crate::redis_store::{redact_url, RedisFailure};

/// How often the sentinels are asked which server is master, calls failing or not.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);

/// `[redis.sentinel]`, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct SentinelTarget {
    /// The sentinels' URLs (a password in one is that sentinel's own).
    pub nodes: Vec<String>,
    /// The name the sentinels monitor the master under.
    pub master: String,
    /// The master's login and database.
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
}

/// The master's address, as the sentinels give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterAddress {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for MasterAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Asks the sentinels of one target.
#[derive(Debug)]
pub struct Sentinels {
    pub target: SentinelTarget,
    /// The master named last, for the log and `/status`.
    named: std::sync::Mutex<Option<MasterAddress>>,
    /// Goes up each time the sentinels name another master: a connection made under an
    /// older value is to a server that may no longer be master.
    generation: AtomicU64,
    /// The watching task is running (see [`Sentinels::watch`]).
    watching: AtomicBool,
    /// The last ask of the watching task got no answer (to log the change once).
    unreachable: AtomicBool,
}

impl Sentinels {
    pub fn new(target: SentinelTarget) -> Sentinels {
        Sentinels {
            target,
            named: std::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
            watching: AtomicBool::new(false),
            unreachable: AtomicBool::new(false),
        }
    }

    /// The master named last, if the sentinels were asked.
    pub fn last_named(&self) -> Option<MasterAddress> {
        crate::redis_batch::lock(&self.named).clone()
    }

    /// How many times the named master changed.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Starts asking the sentinels every [`WATCH_EVERY`], once, until these sentinels are
    /// dropped (a reload that changes `[redis]`).
    pub fn watch(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let sentinels: Weak<Sentinels> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(WATCH_EVERY).await;
                let Some(sentinels) = sentinels.upgrade() else {
                    return;
                };
                let asked = sentinels.master(WATCH_EVERY).await;
                let was_unreachable = sentinels.unreachable.swap(asked.is_err(), Ordering::AcqRel);
                match asked {
                    Err(error) if !was_unreachable => tracing::warn!(
                        "{error}; levee keeps using the master named before and asks again every {WATCH_EVERY:?}"
                    ),
                    Ok(_) if was_unreachable => {
                        tracing::info!("the sentinels answer again");
                    }
                    _ => {}
                }
            }
        });
    }

    /// Asks every sentinel at once and takes the first that names the master; within `bound`.
    /// Returns the master and the [`Self::generation`] it belongs to.
    pub async fn master(&self, bound: Duration) -> Result<(MasterAddress, u64), RedisFailure> {
        let asks = self
            .target
            .nodes
            .iter()
            .map(|node| Box::pin(ask(node, &self.target.master, bound)));
        let answer = tokio::time::timeout(bound, select_ok(asks)).await;
        let address = match answer {
            Ok(Ok((address, _))) => address,
            Ok(Err(last)) => return Err(last),
            Err(_elapsed) => {
                return Err(RedisFailure::Connection(format!(
                    "no sentinel named the master `{}` within {bound:?}",
                    self.target.master
                )))
            }
        };
        let mut named = crate::redis_batch::lock(&self.named);
        if named.as_ref() != Some(&address) {
            match named.as_ref() {
                None => tracing::info!(
                    master = %self.target.master,
                    address = %address,
                    "redis sentinel names the master"
                ),
                Some(before) => tracing::warn!(
                    master = %self.target.master,
                    before = %before,
                    now = %address,
                    "redis sentinel names another master (a failover): levee follows it"
                ),
            }
            if named.is_some() {
                self.generation.fetch_add(1, Ordering::AcqRel);
            }
            *named = Some(address.clone());
        }
        Ok((address, self.generation()))
    }

    /// How to reach and log in to the master at `address`.
    pub fn master_info(
        &self,
        address: &MasterAddress,
    ) -> Result<redis::ConnectionInfo, RedisFailure> {
        let mut login = RedisConnectionInfo::default().set_db(self.target.db);
        if let Some(username) = &self.target.username {
            login = login.set_username(username);
        }
        if let Some(password) = &self.target.password {
            login = login.set_password(password);
        }
        Ok(
            redis::ConnectionAddr::Tcp(address.host.clone(), address.port)
                .into_connection_info()?
                .set_redis_settings(login),
        )
    }
}

/// One sentinel's answer: the master's address, or why there is none.
async fn ask(node: &str, master: &str, bound: Duration) -> Result<MasterAddress, RedisFailure> {
    let unknown =
        |why: String| RedisFailure::Connection(format!("sentinel {}: {why}", redact_url(node)));
    let client = redis::Client::open(node)?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(bound))
        .set_response_timeout(Some(bound));
    let mut connection: MultiplexedConnection = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|error| unknown(error.to_string()))?;
    let named: Option<(String, String)> = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(master)
        .query_async(&mut connection)
        .await
        .map_err(|error| unknown(error.to_string()))?;
    let (host, port) =
        named.ok_or_else(|| unknown(format!("it monitors no master named `{master}`")))?;
    let port = port
        .parse()
        .map_err(|_| unknown(format!("it gave the port `{port}`")))?;
    Ok(MasterAddress { host, port })
}

/// True when an `INFO replication` answer is a master's.
pub fn is_master(info: &str) -> bool {
    info.lines().any(|line| line.trim_end() == "role:master")
}

/// The shared connection (queue writes, switches, stale copies) to the master the sentinels
/// name; they are asked again after a failed call, and the connection is made anew when they
/// name another master.
pub struct MasterLink {
    pub sentinels: Arc<Sentinels>,
    current: tokio::sync::Mutex<Option<Current>>,
    /// A call on the current connection failed: ask the sentinels before the next.
    suspect: AtomicBool,
}

struct Current {
    address: MasterAddress,
    connection: ConnectionManager,
    /// The sentinels' generation the address belongs to.
    generation: u64,
}

impl MasterLink {
    pub fn new(sentinels: Arc<Sentinels>) -> MasterLink {
        MasterLink {
            sentinels,
            current: tokio::sync::Mutex::new(None),
            suspect: AtomicBool::new(false),
        }
    }

    /// A call on the connection failed: the master may have moved.
    pub fn suspect(&self) {
        self.suspect.store(true, Ordering::Release);
    }

    /// The connection to the master, asking the sentinels first when it is due.
    pub async fn connection(&self, timeout: Duration) -> Result<ConnectionManager, RedisFailure> {
        self.sentinels.watch();
        let mut current = self.current.lock().await;
        let suspect = self.suspect.swap(false, Ordering::AcqRel);
        if let Some(known) = current.as_ref() {
            if !suspect && known.generation == self.sentinels.generation() {
                return Ok(known.connection.clone());
            }
        }
        let (address, generation) = match self.sentinels.master(timeout).await {
            Ok(named) => named,
            // The sentinels are out of reach: the master known before may well answer (the
            // call that failed may only have been slow); the next failure asks again.
            Err(error) => match current.as_ref() {
                Some(known) => {
                    tracing::debug!("{error}; trying the master named before, {}", known.address);
                    return Ok(known.connection.clone());
                }
                None => return Err(error),
            },
        };
        if let Some(known) = current.as_mut() {
            if known.address == address {
                known.generation = generation;
                return Ok(known.connection.clone());
            }
        }
        let connection = self
            .connect_to(&address, timeout)
            .await
            .inspect_err(|_| self.suspect())?;
        *current = Some(Current {
            address,
            connection: connection.clone(),
            generation,
        });
        Ok(connection)
    }

    /// Connects to `address` and checks that it is a master.
    async fn connect_to(
        &self,
        address: &MasterAddress,
        timeout: Duration,
    ) -> Result<ConnectionManager, RedisFailure> {
        let client = redis::Client::open(self.sentinels.master_info(address)?)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(200))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2);
        let mut connection = ConnectionManager::new_with_config(client, config).await?;
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut connection)
            .await?;
        if !is_master(&info) {
            return Err(RedisFailure::Connection(format!(
                "the sentinels named {address} as master of `{}`, but it is not a master (yet)",
                self.sentinels.target.master
            )));
        }
        Ok(connection)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_master_role_is_a_master() {
        assert!(is_master(
            "# Replication\r\nrole:master\r\nconnected_slaves:1\r\n"
        ));
        assert!(!is_master(
            "# Replication\r\nrole:slave\r\nmaster_host:127.0.0.1\r\n"
        ));
        assert!(!is_master(""));
    }
}
