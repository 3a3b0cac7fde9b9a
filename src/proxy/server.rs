//! The admin listener's HTTP/1.1 server (hyper), with graceful shutdown, and the
//! per-connection limits shared with the public listener's own server (`proxy::h1`).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// `accept` failing (out of file descriptors): one warn line every 10 s.
static ACCEPT_FAILED_SAID: crate::log_throttle::LogThrottle =
    crate::log_throttle::LogThrottle::new(Duration::from_secs(10));

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};

use super::body::ResponseBody;
use crate::config::PolicyStore;
use crate::log_throttle::LogThrottle;

/// Admin connections open at once, at most. Operators, scrapers and dashboards need a few;
/// past this a new one is closed at once, so that connections left open (by a client that
/// sends requests and never reads) cannot use up the file descriptors the public listener
/// and upstream connections need.
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// One admin connection of `ADMIN_MAX_CONNECTIONS`, given back when dropped.
struct AdminSlot(Arc<std::sync::atomic::AtomicUsize>);

impl AdminSlot {
    fn take(open: &Arc<std::sync::atomic::AtomicUsize>) -> Option<AdminSlot> {
        use std::sync::atomic::Ordering;
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            (now < ADMIN_MAX_CONNECTIONS).then_some(now + 1)
        })
        .ok()
        .map(|_| AdminSlot(open.clone()))
    }
}

impl Drop for AdminSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// An admin connection's socket, whose writes fail once the client has taken nothing for
/// `send_timeout` (as the public listener's own connections do): hyper has no such limit,
/// and a client that sends requests and never reads held its connection, and what the
/// answers waiting on it held, for good.
struct SendDeadline<S> {
    inner: S,
    limit: Duration,
    /// Since when a write has waited for room; `None` while writes go through.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> SendDeadline<S> {
    fn new(inner: S, limit: Duration) -> SendDeadline<S> {
        SendDeadline {
            inner,
            limit,
            stalled: None,
        }
    }

    /// After a write that could not go through: an error once it has waited `limit`.
    fn waited(&mut self, cx: &mut Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client took nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Passes a write's outcome on, starting or ending the wait as it says.
    fn outcome<T>(
        &mut self,
        polled: std::task::Poll<std::io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> std::task::Poll<std::io::Result<T>> {
        match polled {
            Poll::Ready(result) => {
                self.stalled = None;
                Poll::Ready(result)
            }
            Poll::Pending => match self.waited(cx) {
                Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
                _ => Poll::Pending,
            },
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for SendDeadline<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for SendDeadline<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.outcome(polled, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.outcome(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        this.outcome(polled, cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The public listener's open client connections, upgraded tunnels included, held to
/// `[server] max_connections`: past it, new connections wait in the kernel's listen backlog
/// until one closes, instead of levee running out of file descriptors (then it could open
/// neither upstream connections nor Redis ones, and every request would fail).
pub struct ConnectionCount {
    open: Gauge,
    waits: Counter,
    accept_failures: Counter,
    closed: Notify,
    full_log: LogThrottle,
}

impl ConnectionCount {
    /// `open` is `levee_connections_open`, `waits` `levee_connection_cap_waits_total`,
    /// `accept_failures` `levee_accept_failures_total`.
    pub fn new(open: Gauge, waits: Counter, accept_failures: Counter) -> Arc<ConnectionCount> {
        Arc::new(ConnectionCount {
            open,
            waits,
            accept_failures,
            closed: Notify::new(),
            full_log: LogThrottle::new(Duration::from_secs(10)),
        })
    }

    fn admit(self: &Arc<Self>) -> ConnectionSlot {
        self.open.inc();
        ConnectionSlot(Some(self.clone()))
    }

    /// Waits until fewer than the active policy's `max_connections` are open; false when
    /// `stop` turned true meanwhile.
    async fn room(&self, store: &PolicyStore, stop: &mut watch::Receiver<bool>) -> bool {
        if self.open.get() < i64::from(store.load().server.max_connections) {
            return true;
        }
        let mut waited = false;
        loop {
            // Registered before the count is read again, so a close in between is not missed.
            let closed = self.closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            let cap = store.load().server.max_connections;
            let open = self.open.get();
            if open < i64::from(cap) {
                return true;
            }
            if !waited {
                waited = true;
                self.waits.inc();
                if let Some(held_back) = self.full_log.allow(std::time::Instant::now()) {
                    tracing::warn!(
                        open,
                        max_connections = cap,
                        held_back,
                        "connection cap reached: new connections wait in the listen backlog until one closes"
                    );
                }
            }
            tokio::select! {
                _ = closed => {}
                // A reload may have raised the cap.
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.wait_for(|stopped| *stopped) => return false,
            }
        }
    }
}

/// One client connection counted in a [`ConnectionCount`] until it is dropped; it goes with
/// the connection into an upgraded tunnel. The admin listener's are not counted.
pub struct ConnectionSlot(Option<Arc<ConnectionCount>>);

impl ConnectionSlot {
    pub fn uncounted() -> ConnectionSlot {
        ConnectionSlot(None)
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        if let Some(count) = self.0.take() {
            count.open.dec();
            count.closed.notify_one();
        }
    }
}

impl std::fmt::Debug for ConnectionSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ConnectionSlot(counted)"
        } else {
            "ConnectionSlot(uncounted)"
        })
    }
}

/// Per-connection limits, read from the active policy when the connection is accepted.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub send_timeout: Duration,
    /// `[server] answer_format`, for the refusal of a head levee could not read.
    pub answer_format: crate::config::policy::AnswerFormat,
}

impl ConnectionLimits {
    pub fn from_store(store: &PolicyStore) -> ConnectionLimits {
        let policy = store.load();
        ConnectionLimits {
            header_read_timeout: policy.server.header_read_timeout,
            max_header_bytes: policy.server.max_header_bytes,
            send_timeout: policy.server.send_timeout,
            answer_format: policy.server.answer_format,
        }
    }
}

/// Most connections taken from the listen backlog when levee stops accepting.
const STOP_SWEEP_MAX: usize = 1024;

/// Accepts connections until `stop` turns true and spawns `serve_connection` for each, with
/// the limits of the policy active at accept time. Shared by both listeners.
///
/// Every connection task holds a clone of `alive`; the caller learns that all connections
/// have finished when the receiving side sees the channel close. With `count`, connections
/// are counted and held to `max_connections`.
pub(crate) async fn accept_loop<C, Fut>(
    listener: TcpListener,
    store: Arc<PolicyStore>,
    mut stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
    count: Option<Arc<ConnectionCount>>,
    serve_connection: C,
) where
    C: Fn(TcpStream, SocketAddr, ConnectionLimits, ConnectionSlot, watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let start = |stream: TcpStream, peer: SocketAddr, stop: &watch::Receiver<bool>| {
        let _ = stream.set_nodelay(true);
        let limits = ConnectionLimits::from_store(&store);
        let slot = count
            .as_ref()
            .map_or_else(ConnectionSlot::uncounted, |count| count.admit());
        let connection = serve_connection(stream, peer, limits, slot, stop.clone());
        let alive = alive.clone();
        tokio::spawn(async move {
            let _alive = alive;
            connection.await;
        });
    };
    loop {
        if let Some(count) = &count {
            if !count.room(&store, &mut stop).await {
                break;
            }
        }
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopped| *stopped) => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                if let Some(count) = &count {
                    count.accept_failures.inc();
                }
                // Usually out of file descriptors: back off instead of spinning, and say so
                // once in a while, not twenty times a second.
                if let Some(held_back) = ACCEPT_FAILED_SAID.allow(std::time::Instant::now()) {
                    let hint = if crate::proxy::client::is_out_of_files(&error) {
                        ": levee is out of open files; lower [server] max_connections or raise its open-file limit"
                    } else {
                        ""
                    };
                    tracing::warn!(held_back, "accept failed: {error}{hint}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        start(stream, peer, &stop);
    }
    // Stopped. The connections the kernel completed that levee has not taken yet: closing the
    // listener would reset them, and a front does not send again a POST it has written
    // (nginx's `proxy_next_upstream` leaves non-idempotent requests alone). Taken now,
    // straight from the socket (the reactor may not have seen the last ones arrive), each is
    // given its first request's answer, with `Connection: close`.
    let Ok(listener) = listener.into_std() else {
        return;
    };
    // Bounded: a flood held in the backlog at the connection cap is not all taken.
    for _ in 0..STOP_SWEEP_MAX {
        let Ok((stream, peer)) = listener.accept() else {
            break;
        };
        let stream = stream
            .set_nonblocking(true)
            .and_then(|()| TcpStream::from_std(stream));
        if let Ok(stream) = stream {
            start(stream, peer, &stop);
        }
    }
}

/// The admin listener: accepts connections until `stop` turns true, serving each with
/// `handler` on hyper's HTTP/1.1 server.
///
/// On stop, idle keep-alive connections are closed and busy ones finish their current
/// request first.
pub async fn serve<H, F>(
    listener: TcpListener,
    store: Arc<PolicyStore>,
    handler: H,
    stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
) where
    H: Fn(SocketAddr, Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ResponseBody>> + Send + 'static,
{
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    accept_loop(
        listener,
        store,
        stop,
        alive,
        None,
        move |stream, peer, limits, _slot, mut stop| {
            let handler = handler.clone();
            let admitted = AdminSlot::take(&open);
            async move {
                let Some(_slot) = admitted else {
                    // Closed at once (the file descriptor freed), not kept waiting.
                    static FULL_LOG: LogThrottle = LogThrottle::new(Duration::from_secs(60));
                    if let Some(held_back) = FULL_LOG.allow(std::time::Instant::now()) {
                        tracing::warn!(%peer, "admin listener: {ADMIN_MAX_CONNECTIONS} connections open already; this one is closed ({held_back} more not logged)");
                    }
                    return;
                };
                let stream = SendDeadline::new(stream, limits.send_timeout);
                let service = service_fn(move |request| {
                    let response = handler(peer, request);
                    async move { Ok::<_, Infallible>(response.await) }
                });
                let mut builder = http1::Builder::new();
                builder
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_read_timeout)
                    // hyper answers 431 itself past this; levee's own (smaller) limit is checked
                    // per request so the client gets a reason.
                    .max_buf_size((limits.max_header_bytes + 8192).max(64 * 1024))
                    .keep_alive(true);
                let connection = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .with_upgrades();
                tokio::pin!(connection);
                let finished = tokio::select! {
                    result = connection.as_mut() => Some(result),
                    _ = stop.wait_for(|stopped| *stopped) => None,
                };
                let result = match finished {
                    Some(result) => result,
                    None => {
                        connection.as_mut().graceful_shutdown();
                        connection.await
                    }
                };
                if let Err(error) = result {
                    tracing::debug!(%peer, "connection ended: {error}");
                }
            }
        },
    )
    .await;
}
