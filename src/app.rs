//! Starting and stopping levee: listeners, watcher, signals, drain.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::config::{Diagnostics, PolicyStore, ReloadTrigger};
use crate::metrics::Metrics;
use crate::proxy::{self, server, Shared};

/// How to run levee.
#[derive(Debug, Clone)]
pub struct Options {
    /// Directory of `*.toml` policy files. Default `policies`.
    pub policies: PathBuf,
    /// Reload when files in the directory change. Default true.
    pub watch: bool,
    /// Quiet time before a file change is reloaded. Default 200ms.
    pub debounce: Duration,
}

impl Options {
    pub fn new(policies: impl Into<PathBuf>) -> Options {
        Options {
            policies: policies.into(),
            watch: true,
            debounce: crate::config::watch::DEFAULT_DEBOUNCE,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the policy has errors:\n{0}")]
    Policy(Diagnostics),
    #[error("{}", listen_error(which, addr, written_at.as_deref(), source))]
    Listen {
        which: &'static str,
        addr: SocketAddr,
        /// Where the address is written in the policy (`file:line:col`); `None`: the default.
        written_at: Option<String>,
        source: std::io::Error,
    },
}

/// "cannot listen on …", saying where the address comes from and what usually causes the
/// error: the operator's next step.
fn listen_error(
    which: &str,
    addr: &SocketAddr,
    written_at: Option<&str>,
    source: &std::io::Error,
) -> String {
    let from = match written_at {
        Some(at) => format!("{at}: {which}"),
        None => format!("{which}, by default"),
    };
    let hint = match source.kind() {
        std::io::ErrorKind::AddrInUse => format!(
            "; port {} is in use, by another process's listener (perhaps another levee) or a connection (`ss -tanp 'sport = :{}'` names it)",
            addr.port(),
            addr.port()
        ),
        std::io::ErrorKind::PermissionDenied if addr.port() < 1024 => {
            "; ports below 1024 need root or CAP_NET_BIND_SERVICE (levee usually listens on a high port behind the front nginx)".to_string()
        }
        std::io::ErrorKind::AddrNotAvailable => {
            "; no network interface of this machine has that address".to_string()
        }
        _ => String::new(),
    };
    format!("cannot listen on {addr} ({from}): {source}{hint}")
}

/// A running levee. Dropping it does not stop it; call [`Running::shutdown`] and
/// [`Running::wait`].
pub struct Running {
    pub public_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    done: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Starts the drain: `/readyz` turns 503 at once, the listeners close after `drain`,
    /// in-flight requests get up to `shutdown_timeout` to finish. Same as SIGTERM.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }

    pub fn store(&self) -> &Arc<PolicyStore> {
        &self.shared.store
    }

    /// Waits until levee has stopped.
    pub async fn wait(self) {
        let _ = self.done.await;
    }
}

/// Loads the policy, binds both listeners and starts serving.
pub async fn start(options: Options) -> Result<Running, StartError> {
    // Before the policy is read: its check of max_connections against the limit sees the
    // raised one.
    crate::open_files::raise_and_log();
    let metrics = Arc::new(Metrics::new());
    let store = Arc::new(
        PolicyStore::open(&options.policies, metrics.clone()).map_err(StartError::Policy)?,
    );
    let policy = store.load();
    let written_at = &policy.listen_written_at;
    let server_listen = ("[server] listen", policy.server.listen, &written_at.server);
    let admin_listen = ("[admin] listen", policy.admin.listen, &written_at.admin);
    let failed = |(which, addr, written_at): (&'static str, SocketAddr, &Option<String>)| {
        let written_at = written_at.clone();
        move |source| StartError::Listen {
            which,
            addr,
            written_at,
            source,
        }
    };
    let public = bind_public(server_listen.1).map_err(failed(server_listen))?;
    let admin = TcpListener::bind(admin_listen.1)
        .await
        .map_err(failed(admin_listen))?;
    let public_addr = public.local_addr().map_err(failed(server_listen))?;
    let admin_addr = admin.local_addr().map_err(failed(admin_listen))?;

    let limiter = Arc::new(crate::limit::Limiter::new(metrics.clone()));
    let degrade = Arc::new(crate::degrade::Degrade::new());
    let shared = Arc::new(Shared {
        store: store.clone(),
        metrics,
        limiter: limiter.clone(),
        degrade: degrade.clone(),
        stale: Arc::new(crate::degrade::stale::StaleStore::new(
            crate::degrade::stale::L1_MAX_BYTES,
        )),
        draining: AtomicBool::new(false),
        cutting_off: AtomicBool::new(false),
        former_queues: Default::default(),
        instance: crate::queue::worker::consumer_name(),
        app_cookies: Default::default(),
        refusals_said: crate::log_throttle::LogBudget::new(
            crate::proxy::REFUSALS_SAID_PER_SECOND,
            std::time::Duration::from_secs(1),
        ),
    });
    let (stop_accepting, stop) = watch::channel(false);
    let (alive, mut all_closed) = mpsc::channel::<()>(1);

    // The saved switches are loaded before the listeners serve: a levee restarted during an
    // incident must not answer its first requests with the policy's switches (a switched-off
    // module back on, a queue route writing straight to the app). Connections that arrive
    // meanwhile wait in the listen backlog. (Found by tests/faults.rs: /status right after a
    // restart showed level 0 while Redis held level 1.)
    let sync_task = crate::degrade::switches::spawn_sync(shared.clone(), stop.clone()).await;

    let public_shared = shared.clone();
    let public_task = tokio::spawn(proxy::h1::serve(
        public,
        store.clone(),
        move |peer, request| proxy::handle(public_shared.clone(), peer, request),
        stop.clone(),
        alive.clone(),
        server::ConnectionCount::new(
            shared.metrics.connections_open.clone(),
            shared.metrics.connection_cap_waits.clone(),
            shared.metrics.accept_failures.clone(),
        ),
    ));
    let admin_shared = shared.clone();
    let admin_task = tokio::spawn(server::serve(
        admin,
        store.clone(),
        move |peer, request| crate::admin::handle(admin_shared.clone(), peer, request),
        stop.clone(),
        alive,
    ));
    crate::limit::spawn_sweeper(limiter, Duration::from_secs(10), stop.clone());
    // Queue workers stop taking jobs as soon as the drain starts (the instance is going away;
    // the jobs wait in Redis for the next one), and the one in flight is waited for below.
    let (stop_replaying, replaying_stop) = watch::channel(false);
    let queue_task = crate::queue::worker::spawn_workers(shared.clone(), replaying_stop);
    crate::degrade::trigger::spawn_triggers(
        degrade,
        store.clone(),
        shared.metrics.clone(),
        Duration::from_millis(200),
        stop.clone(),
    );
    if options.watch {
        crate::config::watch::spawn_watcher(store.clone(), options.debounce, stop.clone());
    }
    tracing::info!(
        public = %public_addr,
        admin = %admin_addr,
        policies = %options.policies.display(),
        generation = policy.generation,
        hash = %policy.hash,
        routes = policy.routes.routes.len(),
        upstreams = policy.upstreams.len(),
        "levee is listening"
    );

    let (shutdown, mut shutdown_requested) = watch::channel(false);
    let lifecycle_shared = shared.clone();
    let done = tokio::spawn(async move {
        let _ = shutdown_requested.wait_for(|requested| *requested).await;
        let settings = lifecycle_shared.store.load().server.clone();
        lifecycle_shared.draining.store(true, Ordering::Relaxed);
        let _ = stop_replaying.send(true);
        tracing::info!(drain = ?settings.drain, "shutting down: /readyz now answers 503, still serving");
        tokio::time::sleep(settings.drain).await;
        tracing::info!("drain over: no longer accepting connections");
        let _ = stop_accepting.send(true);
        let _ = public_task.await;
        let _ = admin_task.await;
        let deadline = tokio::time::Instant::now() + settings.shutdown_timeout;
        // `recv` yields None once every connection task has dropped its sender.
        if tokio::time::timeout_at(deadline, all_closed.recv())
            .await
            .is_err()
        {
            lifecycle_shared.cutting_off.store(true, Ordering::Relaxed);
            // How many: streams and downloads longer than drain and shutdown_timeout are
            // always among them (each logged `error=cut_off_at_shutdown`).
            let cut = lifecycle_shared.metrics.inflight.get();
            tracing::warn!(timeout = ?settings.shutdown_timeout, in_flight = cut, "in-flight requests did not finish in time; stopping anyway, cutting them off (access log error=cut_off_at_shutdown)");
        }
        if tokio::time::timeout_at(deadline, queue_task).await.is_err() {
            tracing::warn!(timeout = ?settings.shutdown_timeout, "a queued job's replay did not finish in time; stopping anyway (another worker replays it after claim_after, with the same Idempotency-Key)");
        }
        // Gone, not silent: this instance's line leaves the fleet view, once the switch sync
        // (which writes it) has ended, and before the process does.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), sync_task).await;
        if let Some(redis) = &lifecycle_shared.store.load().redis {
            crate::degrade::fleet::leave(redis, &lifecycle_shared.instance).await;
        }
        tracing::info!("levee stopped");
    });

    Ok(Running {
        public_addr,
        admin_addr,
        shared,
        shutdown,
        done,
    })
}

/// The public listener's backlog: connections the kernel completes before levee takes them
/// (a burst, the connection cap reached; the kernel holds it to `net.core.somaxconn`). The
/// standard library's 128 overflowed under a front's burst of new connections (each answer of
/// a drain says `Connection: close`), and an overflowing backlog drops connections.
const PUBLIC_BACKLOG: u32 = 1024;

fn bind_public(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As the standard library's bind: a restart finds its port while old connections linger
    // in TIME-WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(PUBLIC_BACKLOG)
}

/// Runs until SIGTERM or SIGINT, reloading on SIGHUP. A second SIGTERM or SIGINT while
/// levee drains stops it at once.
pub async fn run(options: Options) -> Result<(), StartError> {
    use tokio::signal::unix::{signal, SignalKind};
    // Listened for before starting: a SIGHUP sent while levee starts (it may wait for Redis)
    // must be a reload, not the default action of a signal, which is to end the process.
    let hangups = signal(SignalKind::hangup()).ok();
    let mut terminate = signal(SignalKind::terminate()).ok();
    // nginx reopens its log files on SIGUSR1, and a logrotate script written for it sends
    // one: its default action ended levee at once, without a drain. levee has no file to
    // reopen (it writes to stderr): said, and nothing else.
    let reopen_asks = signal(SignalKind::user_defined1()).ok();
    let running = start(options).await?;
    if let Some(mut reopen_asks) = reopen_asks {
        tokio::spawn(async move {
            while reopen_asks.recv().await.is_some() {
                tracing::warn!("SIGUSR1 received: levee has no log file to reopen, it writes to stderr (operations.md, \"Logs and their rotation\"); nothing done");
            }
        });
    }
    let store = running.store().clone();
    tokio::spawn(async move {
        let Some(mut hangups) = hangups else {
            tracing::warn!("cannot listen for SIGHUP; reload with the watcher or POST /reload");
            return;
        };
        while hangups.recv().await.is_some() {
            let _ = store.reload(ReloadTrigger::Sighup).await;
        }
    });
    tokio::select! {
        () = next_signal(&mut terminate) => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
    running.shutdown();
    let shared = running.shared.clone();
    tokio::select! {
        () = running.wait() => return Ok(()),
        () = next_signal(&mut terminate) => tracing::warn!("second SIGTERM: stopping now, without waiting for requests in flight"),
        _ = tokio::signal::ctrl_c() => tracing::warn!("second SIGINT: stopping now, without waiting for requests in flight"),
    }
    // Requests still running are cut off by levee, not by their clients.
    shared.cutting_off.store(true, Ordering::Relaxed);
    Ok(())
}

/// The next delivery of `signal`; never, when it could not be listened for.
async fn next_signal(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}
