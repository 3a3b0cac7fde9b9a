//! Redis Sentinel: which server is the master of a named group now.
//!
//! levee asks the sentinels (`SENTINEL get-master-addr-by-name`) at the first connection,
//! then a task asks them every [`WATCH_EVERY`], and at once after a connection broke or a
//! call failed. Polling, not waiting for failures: a failover that leaves the old master
//! running (an operator's `SENTINEL FAILOVER`, or a master cut off from the sentinels) keeps
//! its connections open and writable for a while. The task follows what most sentinels that
//! answer say, so one that lags behind does not move levee back and forth; while none answers,
//! levee goes on with the master named before. When the named master changes, the
//! connections to the old one are dropped. Every connection to a named master is checked to
//! be a master (`INFO replication`), so a sentinel that has not seen a failover yet does not
//! send levee to a replica.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::select_ok;
use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::{AsyncConnectionConfig, IntoConnectionInfo, RedisConnectionInfo};
use tokio::sync::Notify;

use crate::redis_store::{
    client_for, connection_manager, redact_url, rustls_config, RedisFailure, RedisTls,
};

/// How often the sentinels are asked which server is master, calls failing or not.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);
/// The least time between two asks of the watching task, however often calls fail.
const LEAST_BETWEEN_ASKS: Duration = Duration::from_millis(200);

/// `[redis.sentinel]`, compiled.
#[derive(Clone, PartialEq)]
pub struct SentinelTarget {
    /// The sentinels' URLs (a password in one is that sentinel's own).
    pub nodes: Vec<String>,
    /// The name the sentinels monitor the master under.
    pub master: String,
    /// The master's login and database.
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
    /// The sentinels' URLs are `rediss://`: the sentinels and the master speak TLS, checked
    /// with `[redis] ca_file` (and `cert_file`, `key_file` given to both).
    pub tls: bool,
}

/// Shown with the passwords hidden, should the settings ever be logged.
impl std::fmt::Debug for SentinelTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelTarget")
            .field(
                "nodes",
                &self
                    .nodes
                    .iter()
                    .map(|node| redact_url(node))
                    .collect::<Vec<_>>(),
            )
            .field("master", &self.master)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .field("tls", &self.tls)
            .finish()
    }
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
pub struct Sentinels {
    pub target: SentinelTarget,
    /// Over TLS: `[redis] ca_file`, `cert_file` and `key_file` (`None` for the defaults).
    tls_files: Option<RedisTls>,
    /// Over TLS: the rustls settings of the batched rate-limit connection to the master, or
    /// why there are none (its decisions then fail, and follow `on_redis_error`).
    pub tls_client: Option<Result<Arc<rustls::ClientConfig>, String>>,
    /// The master named last, for the connections, the log and `/status`.
    named: std::sync::Mutex<Option<MasterAddress>>,
    /// Goes up each time the sentinels name another master: a connection made under an
    /// older value is to a server that may no longer be master.
    generation: AtomicU64,
    /// The watching task is running (see [`Sentinels::watch`]).
    watching: AtomicBool,
    /// Wakes the watching task before its interval (a connection broke, a call failed).
    check_soon: Notify,
    /// The last ask of the watching task got no answer (to log the change once).
    unreachable: AtomicBool,
    /// Per sentinel (in `target.nodes` order), the watching task's connection, kept between
    /// asks (a TLS handshake and a read of the trust store each second would be wasted), and
    /// whether its last ask failed (to log each sentinel going and coming once).
    links: Vec<SentinelLink>,
}

#[derive(Default)]
struct SentinelLink {
    connection: std::sync::Mutex<Option<MultiplexedConnection>>,
    failing: AtomicBool,
}

impl Sentinels {
    /// `tls`: `[redis] ca_file`, `cert_file` and `key_file`, for sentinels over TLS.
    pub fn new(target: SentinelTarget, tls: Option<RedisTls>) -> Sentinels {
        let tls_client = target
            .tls
            .then(|| rustls_config(tls.as_ref()).map(Arc::new));
        let links = target
            .nodes
            .iter()
            .map(|_| SentinelLink::default())
            .collect();
        Sentinels {
            tls_files: tls,
            tls_client,
            target,
            named: std::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
            watching: AtomicBool::new(false),
            check_soon: Notify::new(),
            unreachable: AtomicBool::new(false),
            links,
        }
    }

    /// The master named last, if the sentinels were asked.
    pub fn last_named(&self) -> Option<MasterAddress> {
        crate::redis_batch::lock(&self.named).clone()
    }

    /// Starts from the master other sentinels of the same group named (a reload that changed
    /// other `[redis]` settings), instead of the first sentinel that answers; the watching
    /// task corrects it as ever.
    pub fn start_from(&self, previous: &Sentinels) {
        let same_group = previous.target.nodes == self.target.nodes
            && previous.target.master == self.target.master;
        if let (true, Some(address)) = (same_group, previous.last_named()) {
            crate::redis_batch::lock(&self.named).get_or_insert(address);
        }
    }

    /// How many times the named master changed.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Something failed at the master: the watching task asks the sentinels now rather than
    /// at its next interval.
    pub fn check_soon(&self) {
        self.check_soon.notify_one();
    }

    /// The master to connect to, with the [`Self::generation`] it belongs to: the one named
    /// last, without a round trip. Only before any was named are the sentinels asked here
    /// (the first that names one wins); after that, only the watching task asks them, so a
    /// request never waits on a sentinel and two asks never undo each other.
    pub async fn master(&self, bound: Duration) -> Result<(MasterAddress, u64), RedisFailure> {
        {
            let named = crate::redis_batch::lock(&self.named);
            if let Some(address) = named.as_ref() {
                return Ok((address.clone(), self.generation()));
            }
        }
        let asks = self.target.nodes.iter().map(|node| {
            Box::pin(async move {
                let mut connection = self.connect(node, bound).await?;
                ask(&mut connection, node, &self.target.master).await
            })
        });
        let address = match tokio::time::timeout(bound, select_ok(asks)).await {
            Ok(Ok((address, _))) => address,
            Ok(Err(last)) => return Err(last),
            Err(_elapsed) => return Err(self.no_answer(bound)),
        };
        let mut named = crate::redis_batch::lock(&self.named);
        // The watching task (or another first ask) may have named one meanwhile: it stands.
        if named.is_none() {
            self.follow(&mut named, address.clone());
        }
        Ok((named.clone().unwrap_or(address), self.generation()))
    }

    /// Makes `address` the master named, in `named` (the guarded [`Self::named`]): logged,
    /// and a change of master counted in [`Self::generation`].
    fn follow(&self, named: &mut Option<MasterAddress>, address: MasterAddress) {
        match named.as_ref() {
            Some(before) if *before == address => return,
            None => tracing::info!(
                master = %self.target.master,
                address = %address,
                "redis sentinel names the master"
            ),
            Some(before) => {
                tracing::warn!(
                    master = %self.target.master,
                    before = %before,
                    now = %address,
                    "redis sentinel names another master (a failover): levee follows it"
                );
                self.generation.fetch_add(1, Ordering::AcqRel);
            }
        }
        *named = Some(address);
    }

    fn no_answer(&self, bound: Duration) -> RedisFailure {
        RedisFailure::Connection(format!(
            "no sentinel named the master `{}` within {bound:?}",
            self.target.master
        ))
    }

    /// Starts asking the sentinels every [`WATCH_EVERY`] (and soon after
    /// [`Self::check_soon`]), once, until these sentinels are dropped (a reload that changes
    /// `[redis]`).
    pub fn watch(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let sentinels: Weak<Sentinels> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                // Held for one round only: once a reload dropped every other reference, the
                // task ends within a round.
                let Some(strong) = sentinels.upgrade() else {
                    return;
                };
                let _ = tokio::time::timeout(WATCH_EVERY, strong.check_soon.notified()).await;
                strong.poll().await;
                drop(strong);
                // However often calls fail, the sentinels are asked at most this often.
                tokio::time::sleep(LEAST_BETWEEN_ASKS).await;
            }
        });
    }

    /// Asks every sentinel and follows what most of those that answer name (the master
    /// named before, on a tie), so that one sentinel that has not seen a failover, or is cut
    /// off from the others, does not move levee back and forth.
    async fn poll(&self) {
        let asks = (0..self.target.nodes.len()).map(|index| self.ask_kept(index));
        let answers = futures_util::future::join_all(asks).await;
        let mut errors = Vec::new();
        let mut named = Vec::new();
        for answer in answers {
            match answer {
                Ok(address) => named.push(address),
                Err(error) => errors.push(error.to_string()),
            }
        }
        let was_unreachable = self.unreachable.swap(named.is_empty(), Ordering::AcqRel);
        let mut current = crate::redis_batch::lock(&self.named);
        let Some(address) = pick_master(&named, current.as_ref()) else {
            if !was_unreachable {
                let using = match current.as_ref() {
                    Some(address) => {
                        format!("levee keeps using the master named before, {address}")
                    }
                    None => "levee has no master to use".to_string(),
                };
                tracing::warn!(
                    master = %self.target.master,
                    "no sentinel names the master ({}); {using}, and asks again every {WATCH_EVERY:?}",
                    errors.join("; ")
                );
            }
            return;
        };
        if was_unreachable {
            tracing::info!(master = %self.target.master, "the sentinels answer again");
        }
        self.follow(&mut current, address);
    }

    /// Asks sentinel `index` on the connection kept for it (made when there is none, dropped
    /// when an ask fails); logs the sentinel going and coming back.
    async fn ask_kept(&self, index: usize) -> Result<MasterAddress, RedisFailure> {
        let node = &self.target.nodes[index];
        let link = &self.links[index];
        let kept = crate::redis_batch::lock(&link.connection).clone();
        let answer = async {
            let mut connection = match kept {
                Some(connection) => connection,
                None => {
                    let made = self.connect(node, WATCH_EVERY).await?;
                    *crate::redis_batch::lock(&link.connection) = Some(made.clone());
                    made
                }
            };
            ask(&mut connection, node, &self.target.master).await
        }
        .await;
        let failed = answer.is_err();
        if failed {
            *crate::redis_batch::lock(&link.connection) = None;
        }
        match (&answer, link.failing.swap(failed, Ordering::AcqRel)) {
            (Err(error), false) => tracing::warn!("{error}; the other sentinels are asked still"),
            (Ok(_), true) => tracing::info!(sentinel = %redact_url(node), "sentinel answers again"),
            _ => {}
        }
        answer
    }

    /// A connection to one sentinel, within `bound` for connecting and for each answer.
    async fn connect(
        &self,
        node: &str,
        bound: Duration,
    ) -> Result<MultiplexedConnection, RedisFailure> {
        let unreachable = |why: String| sentinel_failure(node, why);
        let client = client_for(node, self.tls_files.as_ref())
            .map_err(|error| unreachable(error.to_string()))?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(bound))
            .set_response_timeout(Some(bound));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|error| unreachable(error.to_string()))
    }

    /// A client for the master at `address`: logged in, on its database, over TLS when the
    /// sentinels are.
    pub fn master_client(&self, address: &MasterAddress) -> Result<redis::Client, RedisFailure> {
        Ok(client_for(
            self.master_info(address)?,
            self.tls_files.as_ref(),
        )?)
    }

    /// How to reach and log in to the master at `address`.
    fn master_info(&self, address: &MasterAddress) -> Result<redis::ConnectionInfo, RedisFailure> {
        let mut login = RedisConnectionInfo::default().set_db(self.target.db);
        if let Some(username) = &self.target.username {
            login = login.set_username(username);
        }
        if let Some(password) = &self.target.password {
            login = login.set_password(password);
        }
        let (host, port) = (address.host.clone(), address.port);
        let at = if self.target.tls {
            redis::ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            redis::ConnectionAddr::Tcp(host, port)
        };
        Ok(at.into_connection_info()?.set_redis_settings(login))
    }
}

/// One sentinel's answer on `connection`: the master's address, or why there is none.
async fn ask(
    connection: &mut MultiplexedConnection,
    node: &str,
    master: &str,
) -> Result<MasterAddress, RedisFailure> {
    let unknown = |why: String| sentinel_failure(node, why);
    let named: Option<(String, String)> = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(master)
        .query_async(connection)
        .await
        .map_err(|error| unknown(error.to_string()))?;
    let (host, port) =
        named.ok_or_else(|| unknown(format!("it monitors no master named `{master}`")))?;
    let port = port
        .parse()
        .map_err(|_| unknown(format!("it gave the port `{port}`")))?;
    Ok(MasterAddress { host, port })
}

/// What went wrong with the sentinel at `node` (its password hidden).
fn sentinel_failure(node: &str, why: String) -> RedisFailure {
    RedisFailure::Connection(format!("sentinel {}: {why}", redact_url(node)))
}

/// The address most of `named` give; on a tie, `current` when it is among the most named,
/// else the first of them in `named` (the order the sentinels are listed in). `None` when
/// nobody named one.
pub fn pick_master(
    named: &[MasterAddress],
    current: Option<&MasterAddress>,
) -> Option<MasterAddress> {
    let votes = |address: &MasterAddress| named.iter().filter(|other| *other == address).count();
    let most = named.iter().map(votes).max()?;
    if let Some(current) = current {
        if votes(current) == most {
            return Some(current.clone());
        }
    }
    named.iter().find(|address| votes(address) == most).cloned()
}

/// True when an `INFO replication` answer is a master's.
pub fn is_master(info: &str) -> bool {
    info.lines().any(|line| line.trim_end() == "role:master")
}

/// The connections to the master the sentinels name, made anew when they name another: the
/// shared one (queue writes, switches, stale copies), and the one queue writes that wait for
/// replicas have to themselves (see `redis_wait`).
pub struct MasterLink {
    pub sentinels: Arc<Sentinels>,
    current: tokio::sync::Mutex<Option<Current>>,
    waiting_writes: tokio::sync::Mutex<Option<Current>>,
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
            waiting_writes: tokio::sync::Mutex::new(None),
        }
    }

    /// The shared connection to the master named last (the connection reconnects by itself
    /// to the same server; a failed call asks the watching task to check the sentinels).
    pub async fn connection(&self, timeout: Duration) -> Result<ConnectionManager, RedisFailure> {
        let response_timeout = crate::redis_store::shared_response_timeout(timeout);
        self.connection_in(&self.current, timeout, Some(response_timeout))
            .await
    }

    /// The connection of the writes that wait for replicas, to the master named last. Its
    /// calls have no response timeout of their own: each batch is bounded by its caller.
    pub async fn waiting_writes_connection(
        &self,
        timeout: Duration,
    ) -> Result<ConnectionManager, RedisFailure> {
        self.connection_in(&self.waiting_writes, timeout, None)
            .await
    }

    async fn connection_in(
        &self,
        slot: &tokio::sync::Mutex<Option<Current>>,
        timeout: Duration,
        response_timeout: Option<Duration>,
    ) -> Result<ConnectionManager, RedisFailure> {
        self.sentinels.watch();
        let mut current = slot.lock().await;
        if let Some(known) = current.as_ref() {
            if known.generation == self.sentinels.generation() {
                return Ok(known.connection.clone());
            }
        }
        let (address, generation) = self.sentinels.master(timeout).await?;
        if let Some(known) = current.as_mut() {
            if known.address == address {
                known.generation = generation;
                return Ok(known.connection.clone());
            }
        }
        let connection = self
            .connect_to(&address, timeout, response_timeout)
            .await
            .inspect_err(|_| self.sentinels.check_soon())?;
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
        response_timeout: Option<Duration>,
    ) -> Result<ConnectionManager, RedisFailure> {
        let client = self.sentinels.master_client(address)?;
        let mut connection = connection_manager(client, timeout, response_timeout).await?;
        // Bounded here: the connection of writes that wait for replicas has no response
        // timeout of its own.
        let info: String = tokio::time::timeout(
            timeout,
            redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut connection),
        )
        .await
        .map_err(|_| RedisFailure::Timeout(timeout))??;
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

    fn at(port: u16) -> MasterAddress {
        MasterAddress {
            host: "10.0.0.1".into(),
            port,
        }
    }

    #[test]
    fn the_master_most_sentinels_name_is_followed_and_a_tie_keeps_the_one_before() {
        assert_eq!(pick_master(&[], Some(&at(1))), None);
        // One sentinel lags behind the failover: the two that saw it win.
        assert_eq!(
            pick_master(&[at(1), at(2), at(2)], Some(&at(1))),
            Some(at(2))
        );
        // One against one: the master named before stays.
        assert_eq!(pick_master(&[at(2), at(1)], Some(&at(1))), Some(at(1)));
        // A tie without the one before among them (or none before): the first answer.
        assert_eq!(pick_master(&[at(3), at(2)], Some(&at(1))), Some(at(3)));
        assert_eq!(pick_master(&[at(2)], None), Some(at(2)));
    }

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
