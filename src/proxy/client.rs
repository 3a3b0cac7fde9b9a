//! levee's HTTP/1.1 client for upstreams: one keep-alive pool per upstream.
//!
//! The request's own task does all the work. It takes an idle connection from the pool (or
//! connects), writes the request, reads the response head, and hands back a body that reads
//! the same socket as the caller polls it. When the body has been read to its end, the
//! connection goes back to the pool. No connection task and no channel sits between a
//! request and its socket, so one request costs two reads and two writes and nothing else,
//! as in nginx.
//!
//! What makes a connection reusable is decided strictly: a response whose end cannot be
//! told from its framing (no length, not chunked, `Connection: close`, HTTP/1.0, both
//! `Content-Length` and `Transfer-Encoding`), or one that left extra bytes behind, closes it.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpSocket, TcpStream, UnixStream};
use tokio::time::{Instant, Sleep};
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::body::ResendableBody;
use super::deadline;

use super::h1::chunked::{ChunkedDecoder, ChunkedError};
use super::h1::encode::{encode_chunk_start, encode_field, encode_field_named, LAST_CHUNK};
use super::h1::parse::{list_items, parse_content_length};
use super::header::{
    header_bytes, upstream_spelling, ForwardedWriter, FromClient, ReceivedHead, FORWARDED_BYTES,
    HOP_BY_HOP, RATELIMIT, RATELIMIT_POLICY,
};
use super::upstream::UpstreamBody;
use super::upstream_fields::{FieldLines, UpstreamFields};
use crate::error::BoxError;

mod fastcgi;
pub use fastcgi::{FastCgiSettings, Unsendable};

/// Most header fields accepted in a response head. nginx counts none: a PHP page may set a
/// few hundred cookies, and refusing the answer would be levee's failure, not the app's.
const MAX_HEADERS: usize = 512;
/// Longest response head accepted.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Room made for each read of a response head.
const HEAD_READ_SIZE: usize = 8 * 1024;
/// Room made for each read of response body bytes.
const BODY_READ_SIZE: usize = 32 * 1024;
/// Request body pieces up to this size are copied next to their chunk framing (one write).
const COPY_LIMIT: usize = 16 * 1024;

/// Where and how to connect, from the upstream's settings.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// Host name or address literal, without brackets.
    pub host: String,
    pub port: u16,
    /// `host[:port]` as the upstream's URL gave it: the `Host` sent when a request has none.
    pub authority: HeaderValue,
    /// TLS (`https://` upstreams) with this configuration.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    pub connect_timeout: Duration,
    pub pool_idle_timeout: Duration,
    pub pool_max_idle: usize,
    /// Connect to this unix socket instead of `host:port`.
    pub socket: Option<std::path::PathBuf>,
    /// Speak FastCGI (php-fpm) instead of HTTP, with these settings.
    pub fastcgi: Option<Arc<FastCgiSettings>>,
}

impl ClientSettings {
    /// Where connections go, for logs: `host:port` or `unix:PATH`.
    pub fn address(&self) -> String {
        match &self.socket {
            Some(path) => format!("unix:{}", path.display()),
            // An IPv6 address with brackets, as in a URL: `[::1]:8081`, not `::1:8081`.
            None if self.host.contains(':') => format!("[{}]:{}", self.host, self.port),
            None => format!("{}:{}", self.host, self.port),
        }
    }
}

/// A failed upstream call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection could be made (refused, unreachable, timed out, TLS handshake).
    #[error("connect to {target}: {source}")]
    Connect { target: String, source: io::Error },
    /// The client's request body failed while it was being sent (the client's fault).
    #[error("request body: {0}")]
    RequestBody(#[source] BoxError),
    /// The connection broke while sending or receiving.
    #[error("upstream connection: {0}")]
    Io(#[from] io::Error),
    /// The upstream closed the connection before a complete response head.
    #[error("the upstream closed the connection before answering")]
    Closed,
    /// The response could not be read as HTTP/1.1.
    #[error("malformed response: {0}")]
    Protocol(String),
    /// The app answered something levee cannot pass on: a header field (a name that is not a
    /// token, a control byte in a value, or too many fields), or a 1xx status as its final
    /// answer (`http_response_code(103)`: an interim head, then the page's body where the
    /// final head belongs). A page's own doing, so not held against the upstream's breaker.
    #[error("malformed response: {0}")]
    Unpassable(String),
    /// The upstream did not answer within the response timeout after the request was sent
    /// whole, or stopped reading the request's body for that long.
    #[error("no answer within {0:?}")]
    ResponseTimeout(Duration),
    /// A request sent again (its pooled connection had just been closed) failed to connect:
    /// answered as that failure, but the first try may have reached the app.
    #[error("{0} (sent again after a pooled connection closed)")]
    Resent(Box<ClientError>),
    /// The request cannot be put to a FastCGI upstream as it is: the client's doing.
    #[error("{0}")]
    Unsendable(#[from] Unsendable),
}

/// Whether `error` is this process (`EMFILE`) or the system (`ENFILE`) out of file
/// descriptors.
pub fn is_out_of_files(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(code) if code == rustix::io::Errno::MFILE.raw_os_error()
            || code == rustix::io::Errno::NFILE.raw_os_error()
    )
}

/// A handshake's failure, with what to do where rustls's words do not say it: a server
/// certificate made with `openssl req -x509` is a CA certificate, which `ca_files` trusts as
/// a CA and TLS then refuses as the server's own ("CaUsedAsEndEntity").
fn explain_tls_failure(error: io::Error) -> io::Error {
    if !format!("{error:?}").contains("CaUsedAsEndEntity") {
        return error;
    }
    io::Error::new(
        error.kind(),
        format!(
            "{error}: the upstream's own certificate is a CA certificate (as `openssl req -x509` makes by default), which TLS does not take from a server even when ca_files trusts it; give the server a certificate with basicConstraints=CA:FALSE, signed by the CA in ca_files"
        ),
    )
}

/// The words of a TLS handshake that did not finish within `connect_timeout`.
const HANDSHAKE_TIMED_OUT: &str = "TLS handshake timed out";

impl ClientError {
    /// Does this failure say the upstream is failing (for its breaker)? Not when the app
    /// answered and only its header fields could not be passed on: one page reflecting a
    /// visitor's input into a header must not cut every page off.
    pub fn is_upstream_failure(&self) -> bool {
        match self {
            ClientError::Unpassable(_) | ClientError::Unsendable(_) => false,
            // levee out of file descriptors (its open-file limit, or the system's): the app
            // may be idle and well. Held against it, the breaker cut the whole site off.
            ClientError::Connect { source, .. } => !is_out_of_files(source),
            ClientError::Resent(first) => first.is_upstream_failure(),
            _ => true,
        }
    }

    /// Did the call fail before a connection existed?
    pub fn is_connect(&self) -> bool {
        match self {
            ClientError::Connect { .. } => true,
            ClientError::Resent(first) => first.is_connect(),
            _ => false,
        }
    }

    /// Did connecting run out of time, and waiting for what: "connection", or "TLS
    /// handshake" (a listener that accepts and never speaks TLS)?
    pub fn connect_timed_out(&self) -> Option<&'static str> {
        match self {
            ClientError::Connect { source, .. } if source.kind() == io::ErrorKind::TimedOut => {
                Some(if source.to_string() == HANDSHAKE_TIMED_OUT {
                    "TLS handshake"
                } else {
                    "connection"
                })
            }
            ClientError::Resent(first) => first.connect_timed_out(),
            _ => None,
        }
    }

    /// Did no byte of the request leave levee? Only a first try that could not connect: a
    /// request sent again may have reached the app the first time.
    pub fn never_sent(&self) -> bool {
        matches!(self, ClientError::Connect { .. })
    }
}

impl From<ChunkedError> for ClientError {
    fn from(error: ChunkedError) -> Self {
        ClientError::Protocol(format!("chunked body: {error}"))
    }
}

/// On a response whose body ends where the upstream closes the connection (no length, no
/// chunks: an HTTP/1.0-style answer). Its end cannot be told from a connection cut short, so
/// such a body is passed on but never kept as a stale copy.
#[derive(Clone, Copy, Debug)]
pub struct CloseDelimited;

/// On a response that is an event stream (`Content-Type: text/event-stream`): its body is
/// open-ended by design (see `proxy::forward`). Set by both clients, HTTP (whether its fields
/// were parsed or are only relayed) and FastCGI.
#[derive(Clone, Copy, Debug)]
pub struct EventStream;

/// A response head and when the request had gone out whole (or the answer came before it
/// had): the upstream's own latency counts from there.
pub struct Answered {
    pub response: Response<Incoming>,
    /// The upstream's header lines as received, when they were asked for
    /// ([`ResponseFields::Relayed`]) and the head allowed it; the response's `HeaderMap` is
    /// then empty. They travel beside the response rather than in its extensions, whose map
    /// cost an allocation and a hash on every request.
    pub relayed: Option<UpstreamFields>,
    pub request_sent_at: Instant,
}

/// An upstream connection: TCP, TLS over TCP, or a unix socket (`socket` in the policy).
#[derive(Debug)]
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
    Unix(UnixStream),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Unix(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::Unix(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Stream::Unix(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(stream) => stream.is_write_vectored(),
            Stream::Unix(stream) => stream.is_write_vectored(),
            Stream::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Unix(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Unix(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// One upstream connection and what it has read past the last response.
#[derive(Debug)]
struct Connection {
    stream: Stream,
    buffer: BytesMut,
    /// Has it carried a request before (so a close may be the pool's race, not an answer)?
    reused: bool,
    /// The upstream answered before the whole request was sent: not reusable.
    request_unfinished: bool,
    /// The upstream sent an interim (1xx) answer to the request in flight: it has the
    /// request, so a close before the final answer is not the pool's race.
    interim_seen: bool,
    idle_since: Instant,
    /// The response timer of the requests it carries, armed at the first (see
    /// `proxy::deadline`).
    response_timer: Option<Pin<Box<Sleep>>>,
}

impl Connection {
    fn new(stream: Stream) -> Connection {
        Connection {
            stream,
            buffer: BytesMut::new(),
            reused: false,
            request_unfinished: false,
            interim_seen: false,
            idle_since: Instant::now(),
            response_timer: None,
        }
    }

    /// Reads the next answer into the start of the buffer's memory when the buffer is empty
    /// and no piece of the last answer is still alive: otherwise each answer is read behind
    /// the one before, and a kept connection walks through its whole allocation (up to
    /// 32 KiB) before it comes back to the start, 2 MiB over 64 connections instead of what
    /// the caches hold. Measured under the bench's CPU limit: 1.5–3% less CPU per
    /// pass-through request (bench/README, 2026-12-05, 20:05–21:50).
    fn rewind_buffer(&mut self) {
        if self.buffer.is_empty() {
            // False when a piece of the last answer is still being written to its client:
            // the read then goes behind it, as before.
            let _ = self.buffer.try_reclaim(HEAD_READ_SIZE);
        }
    }

    /// An idle connection is still usable when the socket has nothing to say: a close, a
    /// reset or stray bytes from the upstream all end it. Asks without waiting; for a plain
    /// socket that saw no event since its last read this costs no system call.
    fn is_usable(&mut self) -> bool {
        let mut context = Context::from_waker(std::task::Waker::noop());
        let mut probe = [0u8; 64];
        let mut room = ReadBuf::new(&mut probe);
        // Pending: nothing to read (a TLS stream may have taken in a session ticket and still
        // have nothing for the caller). Ready: a close, stray bytes, or an error.
        Pin::new(&mut self.stream)
            .poll_read(&mut context, &mut room)
            .is_pending()
    }
}

/// The idle connections of one upstream, newest last.
#[derive(Debug)]
struct Pool {
    idle: Mutex<VecDeque<Connection>>,
    idle_timeout: Duration,
    max_idle: usize,
}

impl Pool {
    /// The newest idle connection that is still usable at `now`.
    fn take(&self, now: Instant) -> Option<Connection> {
        let mut idle = self.idle.lock().ok()?;
        while let Some(mut connection) = idle.pop_back() {
            if now.saturating_duration_since(connection.idle_since) >= self.idle_timeout {
                // The newest is too old: so are all the others.
                idle.clear();
                return None;
            }
            if connection.is_usable() {
                connection.rewind_buffer();
                return Some(connection);
            }
        }
        None
    }

    fn put(&self, mut connection: Connection) {
        let now = Instant::now();
        connection.idle_since = now;
        connection.reused = true;
        let Ok(mut idle) = self.idle.lock() else {
            return;
        };
        while idle.front().is_some_and(|oldest| {
            now.saturating_duration_since(oldest.idle_since) >= self.idle_timeout
        }) {
            idle.pop_front();
        }
        if idle.len() < self.max_idle {
            idle.push_back(connection);
        }
    }
}

/// An upstream's HTTP/1.1 client and keep-alive pool.
#[derive(Debug, Clone)]
pub struct Client {
    settings: Arc<ClientSettings>,
    pool: Arc<Pool>,
}

/// The upstream side of a `101 Switching Protocols`: the raw connection and the bytes the
/// upstream sent after the 101 head, found in the response's extensions.
#[derive(Debug, Clone)]
pub struct UpstreamUpgrade(Arc<Mutex<Option<(Stream, Bytes)>>>);

impl UpstreamUpgrade {
    pub fn take(&self) -> Option<(Stream, Bytes)> {
        self.0.lock().ok()?.take()
    }
}

impl Client {
    pub fn new(settings: ClientSettings) -> Client {
        let pool = Pool {
            idle: Mutex::new(VecDeque::new()),
            idle_timeout: settings.pool_idle_timeout,
            max_idle: settings.pool_max_idle,
        };
        Client {
            settings: Arc::new(settings),
            pool: Arc::new(pool),
        }
    }

    /// Sends `request` (its URI's path and query are the request target) and reads the
    /// response head, its fields parsed, with no bound on the wait (the caller sets one). The
    /// body streams from the connection as it is polled.
    pub async fn send(
        &self,
        request: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, ClientError> {
        self.send_within(
            request,
            ResponseFields::Parsed,
            FromClient::default(),
            None,
            Instant::now(),
            None,
        )
        .await
        .map(|answered| answered.response)
    }

    /// Sends `request` and reads the response head, waiting at most `response_timeout` for
    /// the head once the request is sent whole, and at most that long for the upstream to
    /// take each piece of the body. Time spent waiting for the client's own body is not
    /// counted: a slow upload is the client's (bounded by its idle timer), not a sign of a
    /// failing upstream, and must not open its breaker.
    ///
    /// `now` is the caller's reading of the clock: a request with no body that goes out on a
    /// pooled connection counts as sent then, without reading the clock again (see
    /// `proxy::RequestClock`). `sent_whole`, when given, is set once the whole request has
    /// been written.
    pub async fn send_within(
        &self,
        request: Request<UpstreamBody>,
        fields: ResponseFields,
        from_client: FromClient,
        response_timeout: Option<Duration>,
        now: Instant,
        sent_whole: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Answered, ClientError> {
        if let Some(fastcgi) = &self.settings.fastcgi {
            // Boxed: an HTTP request's future does not carry the FastCGI one's room.
            return Box::pin(self.send_fastcgi(
                fastcgi,
                request,
                from_client,
                response_timeout,
                now,
                sent_whole,
            ))
            .await;
        }
        let (parts, mut body) = request.into_parts();
        let head = encode_request_head(&parts, &body, &self.settings.authority, &from_client);
        // Not kept while the request is sent and answered.
        drop(from_client);
        let chunked = head.chunked;
        let has_body = !body.is_end_stream();
        let upgrade = head.upgrade;
        let mut retried = false;
        // Whether sending may have taken time: a body streams at the client's pace, and a
        // new connection or a second try takes round trips.
        let mut waited = has_body;
        let (connection, mut response_head, request_sent_at) = loop {
            let mut connection = self.connection_for_try(now, retried, &mut waited).await?;
            let sent = send_on(
                &mut connection,
                &head.bytes,
                &mut body,
                (has_body, chunked),
                response_timeout,
            )
            .await;
            let request_sent_at = if waited { Instant::now() } else { now };
            if let (Ok(()), Some(flag)) = (&sent, sent_whole) {
                flag.store(true, std::sync::atomic::Ordering::Release);
            }
            let outcome = match sent {
                Ok(()) => match response_timeout {
                    Some(limit) => {
                        let deadline = request_sent_at + limit;
                        let mut timer = connection
                            .response_timer
                            .take()
                            .unwrap_or_else(|| Box::pin(tokio::time::sleep_until(deadline)));
                        let reading = read_response_head(&mut connection, fields);
                        let read =
                            deadline::within(deadline, timer.as_mut(), std::pin::pin!(reading))
                                .await;
                        connection.response_timer = Some(timer);
                        read.unwrap_or(Err(ClientError::ResponseTimeout(limit)))
                    }
                    None => read_response_head(&mut connection, fields).await,
                },
                Err(error) => Err(error),
            };
            match outcome {
                // RFC 9110 15.2.2: a switch only to what the request's Upgrade names. Passed
                // on, a 101 nobody asked for would reach a client that cannot take it (an
                // HTTP/1.0 one may get no 1xx at all). A page setting its own status
                // (`http_response_code(101)`): its doing, not held against the breaker.
                Ok(response_head)
                    if response_head.status == StatusCode::SWITCHING_PROTOCOLS && !upgrade =>
                {
                    return Err(ClientError::Unpassable(
                        "101 Switching Protocols to a request that asked for no upgrade".into(),
                    ));
                }
                // RFC 9110 7.8: a 101 names the protocol it switches to. levee tunnels only
                // WebSocket (`header::is_upgrade`), so a 101 must say so: a page that answers
                // a bare 101 (a script setting its own status) would otherwise have the
                // client's next bytes, requests included, go to the upstream untouched by
                // routes and limits. (An upgrade's fields are always parsed: see `forward`.)
                Ok(response_head)
                    if response_head.status == StatusCode::SWITCHING_PROTOCOLS
                        && !super::header::is_upgrade(&response_head.headers) =>
                {
                    return Err(ClientError::Unpassable(
                        "101 Switching Protocols without `Connection: upgrade` and `Upgrade: websocket`"
                            .into(),
                    ));
                }
                Ok(response_head) => break (connection, response_head, request_sent_at),
                Err(error) => {
                    // A reused connection that the upstream had just closed: the request
                    // never reached it. Sent again once on a new connection, when nothing of
                    // it is lost (no body, or one read whole before it was sent) and sending
                    // twice is harmless.
                    let race = connection.reused
                        && connection.buffer.is_empty()
                        && !connection.interim_seen
                        && matches!(&error, ClientError::Closed | ClientError::Io(_));
                    if race && !retried && is_idempotent(&parts.method) {
                        let again = match parts.extensions.get::<ResendableBody>() {
                            _ if !has_body => true,
                            Some(copy) => {
                                body = copy.body();
                                true
                            }
                            None => false,
                        };
                        if again {
                            retried = true;
                            waited = true;
                            continue;
                        }
                    }
                    return Err(error);
                }
            }
        };
        let relayed = response_head.relayed.take();
        Ok(Answered {
            response: self.response_from(connection, response_head, &parts.method, upgrade),
            relayed,
            request_sent_at,
        })
    }

    /// A kept connection, or a new one (then `waited` is set: connecting takes round trips).
    /// A second try always gets a new one: the upstream that closed the first kept connection
    /// has often closed the others kept with it (its keep-alive timeout, a restart), and the
    /// close may not have arrived yet.
    async fn connection_for_try(
        &self,
        now: Instant,
        retried: bool,
        waited: &mut bool,
    ) -> Result<Connection, ClientError> {
        if !retried {
            if let Some(connection) = self.pool.take(now) {
                return Ok(connection);
            }
        }
        *waited = true;
        // Boxed: a TLS handshake's state would double the size of every request's future
        // (see `proxy::forward`); a new connection is rare and costly anyway.
        match Box::pin(self.connect()).await {
            Ok(connection) => Ok(connection),
            // Not "never sent" (which a queue route would store, and have applied a second
            // time): the first try may have reached the app.
            Err(error) if retried => Err(ClientError::Resent(Box::new(error))),
            Err(error) => Err(error),
        }
    }

    async fn connect(&self) -> Result<Connection, ClientError> {
        let settings = &self.settings;
        // One `connect_timeout` for the connection and its TLS handshake together: a client
        // waited up to twice it, one for each.
        let deadline = tokio::time::Instant::now() + settings.connect_timeout;
        let target = || settings.address();
        if let Some(path) = &settings.socket {
            let connecting = UnixStream::connect(path);
            let stream = match tokio::time::timeout(settings.connect_timeout, connecting).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(source)) => {
                    return Err(ClientError::Connect {
                        target: target(),
                        source,
                    })
                }
                Err(_elapsed) => {
                    return Err(ClientError::Connect {
                        target: target(),
                        source: io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
                    })
                }
            };
            return Ok(Connection::new(Stream::Unix(stream)));
        }
        let connecting = connect_tcp(&settings.host, settings.port);
        let stream = match tokio::time::timeout_at(deadline, connecting).await {
            Err(_elapsed) => {
                return Err(ClientError::Connect {
                    target: target(),
                    source: io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
                })
            }
            Ok(Err(source)) => {
                return Err(ClientError::Connect {
                    target: target(),
                    source,
                })
            }
            Ok(Ok(stream)) => stream,
        };
        let stream = match &settings.tls {
            None => Stream::Plain(stream),
            Some(config) => {
                let name = rustls_pki_types::ServerName::try_from(settings.host.clone()).map_err(
                    |error| ClientError::Connect {
                        target: target(),
                        source: io::Error::new(io::ErrorKind::InvalidInput, error),
                    },
                )?;
                let handshake = TlsConnector::from(config.clone()).connect(name, stream);
                match tokio::time::timeout_at(deadline, handshake).await {
                    Err(_elapsed) => {
                        return Err(ClientError::Connect {
                            target: target(),
                            source: io::Error::new(io::ErrorKind::TimedOut, HANDSHAKE_TIMED_OUT),
                        })
                    }
                    Ok(Err(source)) => {
                        return Err(ClientError::Connect {
                            target: target(),
                            source: explain_tls_failure(source),
                        })
                    }
                    Ok(Ok(stream)) => Stream::Tls(Box::new(stream)),
                }
            }
        };
        Ok(Connection::new(stream))
    }

    fn response_from(
        &self,
        mut connection: Connection,
        head: Box<ResponseHead>,
        method: &Method,
        upgrade: bool,
    ) -> Response<Incoming> {
        let mut response = Response::new(Incoming::empty());
        *response.status_mut() = head.status;
        *response.version_mut() = head.version;
        *response.headers_mut() = head.headers;
        if let Some(reason) = head.reason {
            response.extensions_mut().insert(UpstreamReason {
                status: head.status,
                reason,
            });
        }
        if let Some(received) = head.received {
            response.extensions_mut().insert(received);
        }
        if head.status == StatusCode::SWITCHING_PROTOCOLS && upgrade {
            let rest = connection.buffer.split().freeze();
            response
                .extensions_mut()
                .insert(UpstreamUpgrade(Arc::new(Mutex::new(Some((
                    connection.stream,
                    rest,
                ))))));
            return response;
        }
        // A 204 may frame no body (RFC 9110 8.6, RFC 9112 6.1): one that announces a length
        // or chunks is not read, and the body it may still send would answer the next
        // request on the connection.
        let announced_body = head.status == StatusCode::NO_CONTENT
            && !matches!(head.framing, Framing::UntilClose | Framing::Length(0));
        let framing = if *method == Method::HEAD
            || head.status.is_informational()
            || head.status == StatusCode::NO_CONTENT
            || head.status == StatusCode::NOT_MODIFIED
        {
            Framing::Done
        } else {
            match head.framing {
                Framing::Length(0) => Framing::Done,
                framing => framing,
            }
        };
        // A 101 nobody asked for: whatever the upstream speaks now, it is not HTTP/1.1. A body
        // that ends with the connection leaves nothing to reuse.
        let reusable = head.keep_alive
            && !head.status.is_informational()
            && !announced_body
            && !matches!(framing, Framing::UntilClose);
        if matches!(framing, Framing::UntilClose) {
            response.extensions_mut().insert(CloseDelimited);
        }
        if head.event_stream {
            response.extensions_mut().insert(EventStream);
        }
        let mut body = Incoming {
            connection: Some(connection),
            framing,
            reusable,
            pool: Some(self.pool.clone()),
            answers_head: *method == Method::HEAD,
        };
        body.finish_if_done();
        *response.body_mut() = body;
        response
    }
}

pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Connects to `host:port`, trying each address the name resolves to in turn.
async fn connect_tcp(host: &str, port: u16) -> io::Result<TcpStream> {
    let addresses: Vec<SocketAddr> = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((host, port)).await?.collect(),
    };
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
    for address in addresses {
        let socket = if address.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        // Dead peers on long-idle pooled connections are found by the kernel, not by a 502.
        socket.set_keepalive(true)?;
        match socket.connect(address).await {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(error) => last_error = error,
        }
    }
    Err(last_error)
}

/// An encoded request head and how its body is framed.
struct RequestHeadBytes {
    bytes: BytesMut,
    chunked: bool,
    /// The request asks for an upgrade (has an `Upgrade` field).
    upgrade: bool,
}

/// The request head as it goes upstream. `forwarded`: the forwarding fields to set on the way
/// (see `header::ForwardedWriter`); `None` sends the request's own.
fn encode_request_head(
    parts: &http::request::Parts,
    body: &UpstreamBody,
    authority: &HeaderValue,
    from_client: &FromClient,
) -> RequestHeadBytes {
    let forwarded = from_client.forwarded;
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |path_and_query| path_and_query.as_str());
    let modules_off = from_client.modules_off.as_ref();
    let fields = header_bytes(&parts.headers)
        + forwarded.map_or(0, |_| FORWARDED_BYTES)
        + modules_off.map_or(0, |modules| modules.len() + 24);
    let mut out = BytesMut::with_capacity(parts.method.as_str().len() + target.len() + fields + 80);
    out.put_slice(parts.method.as_str().as_bytes());
    out.put_u8(b' ');
    out.put_slice(target.as_bytes());
    out.put_slice(b" HTTP/1.1\r\n");
    if !parts.headers.contains_key(header::HOST) {
        encode_field(&mut out, "Host", authority.as_bytes());
    }
    // Names go as the client spelled them (see `header::upstream_spelling`).
    let received_head = &from_client.received_head;
    let mut forwarded = forwarded.map(|from| ForwardedWriter::new(from, modules_off));
    // Noted on the way rather than looked up: each lookup hashes the name.
    let mut has_length = false;
    let mut upgrade = false;
    for (name, value) in &parts.headers {
        // levee frames the body itself; the client's framing fields were hop-by-hop.
        if name == header::TRANSFER_ENCODING {
            continue;
        }
        has_length |= name == header::CONTENT_LENGTH;
        upgrade |= name == header::UPGRADE;
        if let Some(writer) = forwarded.as_mut() {
            if !writer.passes(&mut out, &parts.headers, name) {
                continue;
            }
        }
        let value = value.as_bytes();
        encode_field_named(
            &mut out,
            upstream_spelling(received_head, name, value),
            value,
        );
    }
    if let Some(writer) = forwarded {
        writer.finish(&mut out);
    }
    let mut chunked = false;
    if !has_length {
        match body.size_hint().exact() {
            Some(0) if body.is_end_stream() => {
                // Methods that carry a body say that this one is empty, as browsers do.
                if matches!(parts.method, Method::POST | Method::PUT | Method::PATCH) {
                    encode_field(&mut out, "Content-Length", b"0");
                }
            }
            Some(length) => {
                // Rare: a client body of known size comes with its own Content-Length.
                let _ = write!(out, "Content-Length: {length}\r\n");
            }
            None => {
                encode_field(&mut out, "Transfer-Encoding", b"chunked");
                chunked = true;
            }
        }
    }
    out.put_slice(b"\r\n");
    RequestHeadBytes {
        bytes: out,
        chunked,
        upgrade,
    }
}

/// Writes the head, then the body frame by frame (chunk-encoded when its length is unknown).
///
/// While a body goes out, the connection is read too: an upstream that answers before it has
/// the whole body (a refusal judged from the head alone) is heard at once, even when it has
/// stopped reading, or closed the connection on the rest. The rest of the body is then not
/// sent, and the connection is not reused.
async fn send_on(
    connection: &mut Connection,
    head: &BytesMut,
    body: &mut UpstreamBody,
    (has_body, chunked): (bool, bool),
    stall_limit: Option<Duration>,
) -> Result<(), ClientError> {
    if !has_body {
        connection.stream.write_all(head).await?;
        // A TLS stream may keep records of a write it took in its session (see below).
        connection.stream.flush().await?;
        return Ok(());
    }
    // Small pieces are copied behind the head (or the chunk framing) so that they leave in
    // one write; a large one is written from where it is.
    let mut out = BytesMut::from(&head[..]);
    let mut large: Option<Bytes> = None;
    let mut body_done = false;
    // Armed while the upstream does not take what is ready for it (boxed: it is rare).
    let mut stalled: Option<Pin<Box<Sleep>>> = None;
    std::future::poll_fn(|cx| loop {
        let buffer = &mut connection.buffer;
        if buffer.capacity() - buffer.len() < 1024 {
            buffer.reserve(HEAD_READ_SIZE);
        }
        if let Poll::Ready(read) = std::pin::pin!(connection.stream.read_buf(buffer)).poll(cx) {
            match read {
                // The upstream closed (or reset) while the body went out: an answer it sent
                // first (a refusal judged from the head) is read by `read_response_head`,
                // which, without one, ends `Closed` as this would have.
                Ok(0) | Err(_) => {
                    connection.request_unfinished = true;
                    return Poll::Ready(Ok(()));
                }
                // A head over the limit is an answer too: `read_response_head` refuses it.
                // Read on, it would grow for as long as the client's upload lasts.
                Ok(_)
                    if connection.buffer.len() >= MAX_HEAD_BYTES
                        || final_head_buffered(&connection.buffer) =>
                {
                    connection.request_unfinished =
                        !body_done || !out.is_empty() || large.is_some();
                    return Poll::Ready(Ok(()));
                }
                Ok(_) => continue,
            }
        }
        if !body_done && large.is_none() && out.len() < COPY_LIMIT {
            match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(None) => {
                    if chunked {
                        out.put_slice(LAST_CHUNK);
                    }
                    body_done = true;
                    continue;
                }
                Poll::Ready(Some(Err(error))) => {
                    // The upstream saw part of a request: this connection cannot be reused.
                    connection.request_unfinished = true;
                    return Poll::Ready(Err(ClientError::RequestBody(error)));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    // Trailers are not forwarded.
                    if let Some(data) = frame.into_data().ok().filter(|data| !data.is_empty()) {
                        if chunked {
                            encode_chunk_start(&mut out, data.len());
                        }
                        if data.len() <= COPY_LIMIT {
                            out.put_slice(&data);
                            if chunked {
                                out.put_slice(b"\r\n");
                            }
                        } else {
                            large = Some(data);
                        }
                    }
                    continue;
                }
                Poll::Pending => {}
            }
        }
        let pending: &mut dyn Buf = if !out.is_empty() {
            &mut out
        } else if let Some(data) = large.as_mut() {
            data
        } else if body_done {
            // A TLS stream takes a write whose records the socket had no room for, and keeps
            // them in its session until it is written again or flushed: the request's end
            // would stay there while levee waits for the answer. (A no-op on plain sockets.)
            return match Pin::new(&mut connection.stream).poll_flush(cx) {
                Poll::Ready(flushed) => Poll::Ready(flushed.map_err(ClientError::Io)),
                Poll::Pending => write_stalled(&mut stalled, stall_limit, connection, cx),
            };
        } else {
            return Poll::Pending; // waiting for the client's body
        };
        match Pin::new(&mut connection.stream).poll_write(cx, pending.chunk()) {
            Poll::Ready(Ok(0)) => {
                return Poll::Ready(Err(ClientError::Io(io::ErrorKind::WriteZero.into())))
            }
            Poll::Ready(Ok(written)) => {
                stalled = None;
                pending.advance(written);
                if large.as_ref().is_some_and(Bytes::is_empty) {
                    large = None;
                    if chunked {
                        out.put_slice(b"\r\n");
                    }
                }
            }
            // The same: an upstream that answered and went resets the rest of the upload.
            Poll::Ready(Err(_)) => {
                connection.request_unfinished = true;
                return Poll::Ready(Ok(()));
            }
            Poll::Pending => return write_stalled(&mut stalled, stall_limit, connection, cx),
        }
    })
    .await
}

/// A write the upstream does not take: pending until it has taken nothing for `stall_limit`
/// (the timer armed at the first such write, disarmed by any progress), then the timeout, and
/// the connection, holding part of a request, is not reused.
fn write_stalled(
    stalled: &mut Option<Pin<Box<Sleep>>>,
    stall_limit: Option<Duration>,
    connection: &mut Connection,
    cx: &mut Context<'_>,
) -> Poll<Result<(), ClientError>> {
    let Some(limit) = stall_limit else {
        return Poll::Pending;
    };
    let timer = stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
    if timer.as_mut().poll(cx).is_ready() {
        connection.request_unfinished = true;
        return Poll::Ready(Err(ClientError::ResponseTimeout(limit)));
    }
    Poll::Pending
}

/// Room for a response head's fields, uninitialised: zeroing a hundred of them for every
/// response cost more than parsing the few a response has.
fn uninit_fields<'buf>() -> [std::mem::MaybeUninit<httparse::Header<'buf>>; MAX_HEADERS] {
    [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS]
}

/// Is a final (not interim 1xx) response head, or something that is not one at all, in
/// `buffer`? Used to hear an answer that comes before the request is sent whole.
fn final_head_buffered(buffer: &[u8]) -> bool {
    let mut at = 0;
    loop {
        let mut fields = uninit_fields();
        let mut parsed = httparse::Response::new(&mut []);
        match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut parsed,
            &buffer[at..],
            &mut fields,
        ) {
            Ok(httparse::Status::Complete(length)) => match parsed.code {
                Some(code) if (100..200).contains(&code) && code != 101 => at += length,
                _ => return true,
            },
            Ok(httparse::Status::Partial) => return false,
            Err(_) => return true,
        }
    }
}

/// How the response body's end is known.
#[derive(Debug)]
enum Framing {
    Length(u64),
    Chunked(ChunkedDecoder),
    /// No length: the body ends when the upstream closes the connection.
    UntilClose,
    /// FastCGI `STDOUT` records, up to the request's `END_REQUEST`.
    FastCgi(Box<fastcgi::FastCgiBody>),
    Done,
}

#[derive(Debug)]
struct ResponseHead {
    status: StatusCode,
    version: Version,
    /// The status line's reason phrase, when it is not the standard one for the status.
    reason: Option<Bytes>,
    /// Empty when the fields are relayed.
    headers: HeaderMap,
    relayed: Option<UpstreamFields>,
    /// The head `headers` were parsed from (their values are slices of it).
    received: Option<ReceivedHead>,
    framing: Framing,
    keep_alive: bool,
    /// `Content-Type: text/event-stream`.
    event_stream: bool,
}

/// The reason phrase the upstream wrote on its status line, when it is not the standard one:
/// passed on with the status it came with (a status levee changed gets the standard phrase).
#[derive(Debug, Clone)]
pub struct UpstreamReason {
    pub status: StatusCode,
    pub reason: Bytes,
}

impl UpstreamReason {
    /// The phrase to write for `status`, from a response's extensions.
    pub fn for_status(extensions: &http::Extensions, status: StatusCode) -> Option<&[u8]> {
        extensions
            .get::<UpstreamReason>()
            .filter(|upstream| upstream.status == status)
            .map(|upstream| &upstream.reason[..])
    }
}

/// What the caller of [`Client::send_within`] does with the response's header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFields {
    /// Reads them: they are parsed into the response's `HeaderMap`.
    Parsed,
    /// Only passes them on to its client: when the head allows, they stay as received, in
    /// [`Answered::relayed`] (without the hop-by-hop and framing fields), and the response's
    /// `HeaderMap` is empty.
    Relayed,
}

/// Reads until a final response head is buffered (interim 1xx heads other than 101 are
/// skipped) and parses it. Boxed where it is parsed: it is moved some five times on its way
/// to `response_from`, 330 bytes each time into cold lines (357 instructions and 8% of the
/// first-level data misses per pass-through request, `bench/callgrind.sh` with CACHE=1).
async fn read_response_head(
    connection: &mut Connection,
    fields: ResponseFields,
) -> Result<Box<ResponseHead>, ClientError> {
    loop {
        if !connection.buffer.is_empty() {
            let parsed = parse_response_head(&mut connection.buffer, fields);
            let parsed = match parsed {
                // A page that set a 1xx status as its own: its web server sent that as an
                // interim head and the page's body after it. One page's doing: counted against
                // the breaker, it cut every page off (as for FastCGI, where it is refused too).
                Err(ClientError::Protocol(reason)) if connection.interim_seen => {
                    return Err(ClientError::Unpassable(format!(
                        "{reason}, after an interim (1xx) answer: a page that sets a 1xx status as its own final one"
                    )));
                }
                parsed => parsed?,
            };
            if let Some(head) = parsed {
                if head.status.is_informational() && head.status != StatusCode::SWITCHING_PROTOCOLS
                {
                    connection.interim_seen = true;
                    continue;
                }
                connection.interim_seen = false;
                return Ok(head);
            }
            if connection.buffer.len() >= MAX_HEAD_BYTES {
                return Err(ClientError::Protocol(format!(
                    "response head over {MAX_HEAD_BYTES} bytes"
                )));
            }
        }
        if connection.buffer.capacity() - connection.buffer.len() < 1024 {
            connection.buffer.reserve(HEAD_READ_SIZE);
        }
        let read = connection.stream.read_buf(&mut connection.buffer).await?;
        if read == 0 {
            return Err(if connection.interim_seen {
                ClientError::Protocol(
                    "the connection closed after an interim (1xx) answer, before the final one"
                        .into(),
                )
            } else if connection.buffer.is_empty() {
                ClientError::Closed
            } else {
                ClientError::Protocol("the connection closed inside the response head".into())
            });
        }
    }
}

/// For the fuzzer (`fuzz/fuzz_targets/upstream_response_head.rs`): parses every response
/// head it can off the front of `bytes`, as the client reads an upstream's answers, and
/// returns how many it parsed. Any input must give an answer, never a panic.
///
/// Each head is parsed both ways, and the two must agree: the same status, framing and
/// connection reuse, and, when the fields are relayed, exactly the fields the parsed path
/// passes on (without hop-by-hop fields and `Content-Length`) and the same length. A
/// disagreement panics, so the fuzzer reports it.
#[doc(hidden)]
pub fn parse_response_heads_for_fuzzing(bytes: &[u8]) -> usize {
    let mut parsed_buffer = BytesMut::from(bytes);
    let mut relayed_buffer = BytesMut::from(bytes);
    let mut heads = 0;
    loop {
        let parsed = parse_response_head(&mut parsed_buffer, ResponseFields::Parsed);
        let relayed = parse_response_head(&mut relayed_buffer, ResponseFields::Relayed);
        let (parsed, relayed) = match (parsed, relayed) {
            (Ok(Some(parsed)), Ok(Some(relayed))) => (parsed, relayed),
            (Ok(None), Ok(None)) | (Err(_), Err(_)) => return heads,
            (parsed, relayed) => {
                panic!("parsed and relayed heads disagree: {parsed:?} / {relayed:?}")
            }
        };
        assert_eq!(parsed.status, relayed.status);
        assert_eq!(parsed.keep_alive, relayed.keep_alive);
        assert_eq!(
            format!("{:?}", parsed.framing),
            format!("{:?}", relayed.framing)
        );
        assert_eq!(parsed_buffer, relayed_buffer, "both took the same bytes");
        if let Some(fields) = &relayed.relayed {
            let mut passed_on = parsed.headers.clone();
            super::header::strip_hop_by_hop(&mut passed_on, false);
            let length = passed_on
                .remove(header::CONTENT_LENGTH)
                .and_then(|value| parse_content_length(value.as_bytes()));
            assert_eq!(fields.content_length, length, "relayed length");
            assert_eq!(relayed_field_map(fields), passed_on, "relayed fields");
        }
        heads += 1;
    }
}

/// The fields of relayed lines, read back as a client would.
fn relayed_field_map(fields: &UpstreamFields) -> HeaderMap {
    let mut out = BytesMut::new();
    fields.write_to(&mut out);
    assert_eq!(out.len(), fields.len());
    let mut map = HeaderMap::new();
    let mut rest = &out[..];
    while !rest.is_empty() {
        let end = rest
            .windows(2)
            .position(|pair| pair == b"\r\n")
            .expect("every relayed line ends in CRLF");
        let line = &rest[..end];
        rest = &rest[end + 2..];
        let colon = line
            .iter()
            .position(|byte| *byte == b':')
            .expect("a relayed line is a field");
        let name = HeaderName::from_bytes(&line[..colon]).expect("a valid field name");
        let value = line[colon + 1..].trim_ascii();
        let value = HeaderValue::from_bytes(value).expect("a valid field value");
        map.append(name, value);
    }
    map
}

/// Parses a complete head off the front of `buffer`; `Ok(None)` while it is incomplete.
fn parse_response_head(
    buffer: &mut BytesMut,
    wanted: ResponseFields,
) -> Result<Option<Box<ResponseHead>>, ClientError> {
    let mut fields = uninit_fields();
    let mut parsed = httparse::Response::new(&mut []);
    // The default configuration matters to relaying: it refuses folded lines and does not
    // skip invalid ones, so the bytes between one field's name and the next are exactly the
    // first field's value and line end (see `FieldLines`).
    let length = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        buffer,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        // Read again with the control bytes of its values blanked (see
        // `blank_controls_in_values`); only once, as blanking again changes nothing.
        Err(httparse::Error::HeaderValue)
            if super::header::blank_response_controls(buffer, false) =>
        {
            return parse_response_head(buffer, wanted)
        }
        Err(
            error @ (httparse::Error::HeaderName
            | httparse::Error::HeaderValue
            | httparse::Error::TooManyHeaders),
        ) => return Err(ClientError::Unpassable(error.to_string())),
        Err(error) => return Err(ClientError::Protocol(error.to_string())),
    };
    let status = parsed
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or_else(|| ClientError::Protocol("invalid status code".into()))?;
    let version = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // A PHP page's own wording (`header("HTTP/1.1 404 Not Here")`) goes back as written.
    let reason = parsed
        .reason
        .filter(|reason| Some(*reason) != status.canonical_reason())
        .map(|reason| Bytes::copy_from_slice(reason.as_bytes()));
    // One pass over the fields, while the parser still borrows the buffer: what the framing
    // and connection fields say, and, when the caller only passes the fields on, which lines
    // to relay. Lines are kept as offsets, so the head can then be split off the buffer.
    let base = buffer.as_ptr() as usize;
    let offset = |bytes: &[u8]| bytes.as_ptr() as usize - base;
    // Relayed: interim heads keep the parsed path (a 101 is only read when upgrading, which
    // parses); fields named by `Connection` must go, which the parsed path does by name. A
    // 204 or 304 is relayed too, its length field set by the same framing rules.
    let mut lines =
        (wanted == ResponseFields::Relayed && !status.is_informational()).then(FieldLines::new);
    // A line runs from its name to the next line's name; the last one to the blank line.
    let fields_end = length - 2;
    let mut keep_alive = version == Version::HTTP_11;
    let mut length_field: Option<u64> = None;
    let mut chunked = false;
    let mut content_type = None;
    for (index, field) in parsed.headers.iter().enumerate() {
        let kind = FieldKind::of(field.name.as_bytes());
        if kind == FieldKind::ContentType {
            content_type = Some(field.value);
        }
        match kind {
            FieldKind::ContentLength => {
                let parsed = parse_content_length(field.value.trim_ascii())
                    .ok_or_else(|| ClientError::Protocol("invalid content-length".into()))?;
                if length_field.is_some_and(|earlier| earlier != parsed) {
                    return Err(ClientError::Protocol(
                        "conflicting content-length fields".into(),
                    ));
                }
                length_field = Some(parsed);
            }
            FieldKind::TransferEncoding => {
                // Only `chunked`, once. Another coding (`gzip, chunked`) would reach the client
                // still coded and without its field (hop-by-hop), or, listed after `chunked`,
                // with the chunk framing in the body: a 502 with the reason is the clear
                // answer (no PHP stack sends them).
                let mut codings = list_items(field.value).peekable();
                if codings.peek().is_none() {
                    return Err(ClientError::Protocol("empty transfer-encoding".into()));
                }
                for coding in codings {
                    if chunked || !coding.eq_ignore_ascii_case(b"chunked") {
                        return Err(ClientError::Protocol(format!(
                            "unsupported transfer-encoding `{}` (only chunked, once)",
                            String::from_utf8_lossy(field.value.trim_ascii())
                        )));
                    }
                    chunked = true;
                }
            }
            FieldKind::Connection => {
                for token in list_items(field.value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        keep_alive = false;
                    } else if !token.eq_ignore_ascii_case(b"keep-alive")
                        && !token.eq_ignore_ascii_case(b"upgrade")
                    {
                        // Names a field that must not be passed on.
                        lines = None;
                    }
                }
            }
            FieldKind::HopByHop => {}
            FieldKind::RateLimit => lines = None,
            FieldKind::Date | FieldKind::ContentType | FieldKind::Other => {
                if let Some(kept) = &mut lines {
                    let start = offset(field.name.as_bytes());
                    let end = parsed
                        .headers
                        .get(index + 1)
                        .map_or(fields_end, |next| offset(next.name.as_bytes()));
                    if !kept.keep_line(buffer, start, end, kind == FieldKind::Date) {
                        lines = None;
                    }
                }
            }
        }
    }
    let framing = if chunked {
        // With both fields the length is ignored, and the connection is not trusted after.
        if length_field.is_some() {
            keep_alive = false;
        }
        Framing::Chunked(ChunkedDecoder::new())
    } else if let Some(length) = length_field {
        Framing::Length(length)
    } else {
        // Ends with the connection, unless the status or the method says there is no body
        // (204, 304, HEAD): `Client::response_from` decides.
        Framing::UntilClose
    };
    let length_stands = matches!(framing, Framing::Length(_));
    // An event stream has no length (it is chunked, or ends with the connection): the type
    // is read only then, not on every page.
    let event_stream =
        !length_stands && content_type.is_some_and(crate::degrade::stale::is_event_stream_type);

    // The blank line must be CRLF too for the lines before it to be relayed as they are.
    if let Some(kept) = lines.filter(|_| buffer[fields_end..length] == *b"\r\n") {
        let head = buffer.split_to(length).freeze();
        let content_length = length_field.filter(|_| length_stands);
        return Ok(Some(Box::new(ResponseHead {
            status,
            version,
            reason,
            headers: HeaderMap::new(),
            relayed: Some(kept.over(head, content_length)),
            received: None,
            framing,
            keep_alive,
            event_stream,
        })));
    }

    // Parsed: values become slices of the head, not copies.
    let spans: Vec<FieldSpan> = parsed
        .headers
        .iter()
        .map(|field| FieldSpan {
            name: offset(field.name.as_bytes()),
            name_len: field.name.len(),
            value: offset(field.value),
            value_len: field.value.len(),
        })
        .collect();
    let head = buffer.split_to(length).freeze();
    // Room for the fields levee may add (rate-limit state, Date) without growing.
    let mut headers = HeaderMap::with_capacity(spans.len() + 3);
    let mut length_kept = false;
    for span in &spans {
        let name = HeaderName::from_bytes(&head[span.name..span.name + span.name_len])
            .map_err(|_| ClientError::Unpassable("invalid header name".into()))?;
        let value =
            HeaderValue::from_maybe_shared(head.slice(span.value..span.value + span.value_len))
                .map_err(|_| ClientError::Unpassable(format!("invalid value of {name}")))?;
        if name == header::CONTENT_LENGTH {
            // Chunked or another coding decides the end: the length is not passed on. A
            // length repeated (the same value, checked above) is passed on once (RFC 9110
            // 8.6): two fields get the answer refused by a front nginx.
            if !length_stands || length_kept {
                continue;
            }
            length_kept = true;
        }
        headers.append(name, value);
    }
    Ok(Some(Box::new(ResponseHead {
        status,
        version,
        reason,
        headers,
        relayed: None,
        received: Some(ReceivedHead(head)),
        framing,
        keep_alive,
        event_stream,
    })))
}

/// Where one field of a head lies in it.
#[derive(Debug, Clone, Copy)]
struct FieldSpan {
    name: usize,
    name_len: usize,
    value: usize,
    value_len: usize,
}

/// The fields a response head's framing and forwarding care about, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FieldKind {
    ContentLength,
    TransferEncoding,
    Connection,
    /// The other hop-by-hop fields (RFC 9110 7.6.1): never passed on.
    HopByHop,
    Date,
    ContentType,
    /// `RateLimit` and `RateLimit-Policy`, which levee sets in place of the upstream's own
    /// when the route has limits: such a head is parsed, so that they are replaced.
    RateLimit,
    Other,
}

impl FieldKind {
    fn of(name: &[u8]) -> FieldKind {
        // (Comparing lengths first, most names are told apart without comparing a byte.)
        let is = |known: &HeaderName| name.eq_ignore_ascii_case(known.as_str().as_bytes());
        if is(&header::CONTENT_LENGTH) {
            FieldKind::ContentLength
        } else if is(&header::TRANSFER_ENCODING) {
            FieldKind::TransferEncoding
        } else if is(&header::CONNECTION) {
            FieldKind::Connection
        } else if is(&header::DATE) {
            FieldKind::Date
        } else if is(&header::CONTENT_TYPE) {
            FieldKind::ContentType
        } else if HOP_BY_HOP.iter().any(|hop| is(hop)) {
            FieldKind::HopByHop
        } else if is(&RATELIMIT) || is(&RATELIMIT_POLICY) {
            FieldKind::RateLimit
        } else {
            FieldKind::Other
        }
    }
}

/// A response body read straight from the upstream connection, which goes back to the pool
/// once the body has been read to its end.
#[derive(Debug)]
pub struct Incoming {
    connection: Option<Connection>,
    framing: Framing,
    reusable: bool,
    pool: Option<Arc<Pool>>,
    /// The answer to a HEAD: it has no body, but the body a GET would get has a length this
    /// one does not know, so its size is not given as 0.
    answers_head: bool,
}

impl Incoming {
    fn empty() -> Incoming {
        Incoming {
            connection: None,
            framing: Framing::Done,
            reusable: false,
            pool: None,
            answers_head: false,
        }
    }

    /// Returns the connection to the pool when the body is complete and nothing else came.
    fn finish_if_done(&mut self) {
        if !matches!(self.framing, Framing::Done) {
            return;
        }
        let (Some(connection), Some(pool)) = (self.connection.take(), self.pool.take()) else {
            return;
        };
        if self.reusable && connection.buffer.is_empty() && !connection.request_unfinished {
            pool.put(connection);
        }
    }

    /// The next piece of body data in the buffer, if the framing allows one.
    fn buffered_piece(&mut self) -> Result<Option<Bytes>, ClientError> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(None);
        };
        let buffer = &mut connection.buffer;
        match &mut self.framing {
            Framing::Length(remaining) => {
                if *remaining == 0 {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                if buffer.is_empty() {
                    return Ok(None);
                }
                let take = usize::try_from(*remaining)
                    .unwrap_or(usize::MAX)
                    .min(buffer.len());
                *remaining -= take as u64;
                let piece = buffer.split_to(take).freeze();
                if *remaining == 0 {
                    self.framing = Framing::Done;
                }
                Ok(Some(piece))
            }
            Framing::Chunked(decoder) => {
                let piece = decoder.decode(buffer)?;
                if decoder.is_done() {
                    self.framing = Framing::Done;
                }
                Ok(piece)
            }
            Framing::UntilClose => {
                if buffer.is_empty() {
                    Ok(None)
                } else {
                    Ok(Some(buffer.split().freeze()))
                }
            }
            Framing::FastCgi(body) => {
                let mut ended = false;
                let piece = body.decode(buffer, &mut ended)?;
                if ended {
                    self.framing = Framing::Done;
                }
                Ok(piece)
            }
            Framing::Done => Ok(None),
        }
    }
}

impl Body for Incoming {
    type Data = Bytes;
    type Error = ClientError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientError>>> {
        let this = self.get_mut();
        loop {
            match this.buffered_piece() {
                Ok(Some(piece)) => {
                    this.finish_if_done();
                    return Poll::Ready(Some(Ok(Frame::data(piece))));
                }
                Ok(None) => {}
                Err(error) => {
                    this.connection = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(Some(Err(error)));
                }
            }
            if matches!(this.framing, Framing::Done) {
                this.finish_if_done();
                return Poll::Ready(None);
            }
            let Some(connection) = this.connection.as_mut() else {
                return Poll::Ready(None);
            };
            // A script may read the rest of its input only once its first megabyte of answer
            // has gone: the input goes out between reads of the answer.
            let input_taken = match &mut this.framing {
                Framing::FastCgi(body) => match body.send_input(connection, cx) {
                    Ok(taken) => taken,
                    Err(error) => {
                        this.connection = None;
                        this.framing = Framing::Done;
                        return Poll::Ready(Some(Err(error)));
                    }
                },
                _ => false,
            };
            let buffer = &mut connection.buffer;
            if buffer.capacity() - buffer.len() < 4096 {
                buffer.reserve(BODY_READ_SIZE);
            }
            // `read_buf` keeps no state between polls: a fresh one per poll loses nothing.
            let read = match std::pin::pin!(connection.stream.read_buf(buffer)).poll(cx) {
                Poll::Ready(read) => read,
                // php-fpm reading a slow upload says nothing meanwhile, yet it is busy: an
                // empty frame tells the idle timer around this body (`idle_body_timeout`).
                Poll::Pending if input_taken => {
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::new()))))
                }
                Poll::Pending => return Poll::Pending,
            };
            match read {
                Ok(0) => {
                    if matches!(this.framing, Framing::UntilClose) {
                        this.framing = Framing::Done;
                        this.connection = None;
                        return Poll::Ready(None);
                    }
                    this.connection = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(Some(Err(ClientError::Protocol(
                        "the upstream closed the connection inside the body".into(),
                    ))));
                }
                Ok(_) => {}
                Err(error) => {
                    this.connection = None;
                    this.framing = Framing::Done;
                    return Poll::Ready(Some(Err(ClientError::Io(error))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A length that reaches zero becomes `Done` at once.
        matches!(self.framing, Framing::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(remaining) => SizeHint::with_exact(remaining),
            Framing::FastCgi(ref body) => body
                .remaining()
                .map_or_else(SizeHint::default, SizeHint::with_exact),
            Framing::Done if self.answers_head => SizeHint::default(),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::upstream_fields::MOST_RUNS;
    use super::*;

    fn head(text: &str) -> Result<Option<Box<ResponseHead>>, ClientError> {
        parse_response_head(&mut BytesMut::from(text), ResponseFields::Parsed)
    }

    /// The field lines of an encoded request head, sorted (field order between different
    /// names carries no meaning).
    fn sent_fields(
        parts: &http::request::Parts,
        forwarded: Option<super::super::header::ForwardedFrom>,
    ) -> Vec<String> {
        let body: UpstreamBody = super::super::body::empty();
        let authority = HeaderValue::from_static("app.internal");
        let from_client = FromClient {
            forwarded,
            received_head: bytes::Bytes::new(),
            modules_off: None,
        };
        let head = encode_request_head(parts, &body, &authority, &from_client).bytes;
        let text = String::from_utf8(head.to_vec()).expect("text");
        let mut lines: Vec<String> = text.split("\r\n").skip(1).map(str::to_string).collect();
        lines.sort();
        lines
    }

    #[test]
    fn forwarding_fields_written_by_the_encoder_are_those_set_forwarded_sets() {
        let ip = |text: &str| text.parse::<std::net::IpAddr>().expect("ip");
        // The client's fields; the peer, whether it is trusted; the client levee resolved.
        type Case<'a> = (&'a [(&'a str, &'a [u8])], &'a str, bool, &'a str);
        let cases: &[Case] = &[
            (&[], "203.0.113.9", false, "203.0.113.9"),
            (&[], "127.0.0.1", true, "127.0.0.1"),
            (
                &[
                    ("x-forwarded-for", b"1.1.1.1"),
                    ("x-real-ip", b"2.2.2.2"),
                    ("x-forwarded-proto", b"https"),
                ],
                "203.0.113.9",
                false,
                "203.0.113.9",
            ),
            (
                &[
                    ("x-forwarded-for", b"6.6.6.6, 203.0.113.9"),
                    ("cookie", b"a=1"),
                    ("x-forwarded-for", b"198.51.100.1"),
                    ("x-real-ip", b"203.0.113.9"),
                    ("x-forwarded-proto", b"https"),
                ],
                "::ffff:127.0.0.1",
                true,
                "198.51.100.1",
            ),
            (
                &[("x-forwarded-for", b"caf\xc3\xa9")],
                "127.0.0.1",
                true,
                "127.0.0.1",
            ),
            (
                &[("x-forwarded-proto", b"https")],
                "::1",
                true,
                "2001:db8::7",
            ),
            (
                &[
                    ("forwarded", b"host=evil.example"),
                    ("x-forwarded-host", b"evil.example"),
                    ("front-end-https", b"on"),
                ],
                "203.0.113.9",
                false,
                "203.0.113.9",
            ),
            (
                &[
                    ("x-forwarded-host", b"shop.example"),
                    ("x-forwarded-port", b"443"),
                ],
                "127.0.0.1",
                true,
                "198.51.100.1",
            ),
        ];
        for (fields, peer, peer_trusted, client) in cases {
            let mut request = Request::get("/page?x=1").body(()).expect("request");
            for (name, value) in *fields {
                request.headers_mut().append(
                    HeaderName::from_bytes(name.as_bytes()).expect("name"),
                    HeaderValue::from_bytes(value).expect("value"),
                );
            }
            request
                .headers_mut()
                .insert(header::USER_AGENT, HeaderValue::from_static("wrk"));
            let (parts, ()) = request.into_parts();
            let from = super::super::header::ForwardedFrom {
                peer: ip(peer),
                peer_trusted: *peer_trusted,
                client: ip(client),
            };
            let mut set = parts.clone();
            super::super::header::set_forwarded(
                &mut set.headers,
                from.peer,
                from.peer_trusted,
                from.client,
            );
            assert_eq!(
                sent_fields(&parts, Some(from)),
                sent_fields(&set, None),
                "{fields:?} from {peer} (trusted: {peer_trusted})"
            );
        }
    }

    #[test]
    fn levee_out_of_files_is_no_failure_of_the_upstream() {
        let connect = |errno: rustix::io::Errno| ClientError::Connect {
            target: "127.0.0.1:8081".into(),
            source: io::Error::from_raw_os_error(errno.raw_os_error()),
        };
        assert!(!connect(rustix::io::Errno::MFILE).is_upstream_failure());
        assert!(!connect(rustix::io::Errno::NFILE).is_upstream_failure());
        assert!(
            !ClientError::Resent(Box::new(connect(rustix::io::Errno::MFILE))).is_upstream_failure()
        );
        assert!(connect(rustix::io::Errno::CONNREFUSED).is_upstream_failure());
    }

    #[test]
    fn framing_follows_the_strict_rules() {
        let length = head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(matches!(length.framing, Framing::Length(5)) && length.keep_alive);
        let chunked = head("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(matches!(chunked.framing, Framing::Chunked(_)) && chunked.keep_alive);
        let both =
            head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n")
                .unwrap()
                .unwrap();
        assert!(matches!(both.framing, Framing::Chunked(_)) && !both.keep_alive);
        assert!(!both.headers.contains_key(header::CONTENT_LENGTH));
        let close = head("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
        assert!(matches!(close.framing, Framing::UntilClose));
        let old = head("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!old.keep_alive);
        let closing = head("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!closing.keep_alive);
        assert!(head("HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n").is_err());
        // Codings other than one chunked: the body could not be passed on as it was meant.
        for codings in [
            "transfer-encoding: gzip, chunked",
            "transfer-encoding: gzip\r\ntransfer-encoding: chunked",
            "transfer-encoding: chunked, chunked",
            "transfer-encoding: chunked\r\ntransfer-encoding: chunked",
            "transfer-encoding: identity",
            "transfer-encoding: ",
        ] {
            let text = format!("HTTP/1.1 200 OK\r\n{codings}\r\n\r\n");
            assert!(
                matches!(head(&text), Err(ClientError::Protocol(_))),
                "{codings:?}"
            );
        }
        let repeated = head("HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 02\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(matches!(repeated.framing, Framing::Length(2)));
        assert_eq!(
            repeated
                .headers
                .get_all(header::CONTENT_LENGTH)
                .iter()
                .count(),
            1,
            "a repeated length is passed on once"
        );
        assert!(head("HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n").is_err());
        assert!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none());
        assert!(head("garbage\r\n\r\n").is_err());
    }

    /// A PHP `header()` with a control byte in its value (nginx passes it) is passed on with
    /// a space in its place, parsed or relayed, and the body is left as it is; a NUL or a bare
    /// CR still makes the head unreadable.
    #[test]
    fn control_bytes_in_response_values_are_passed_as_spaces() {
        let text = "HTTP/1.1 200 OK\r\nX-File: a\x01b\x7f\r\nContent-Length: 2\r\n\r\n\x01\x02";
        let mut buffer = BytesMut::from(text);
        let parsed = parse_response_head(&mut buffer, ResponseFields::Parsed)
            .expect("readable")
            .expect("whole");
        assert_eq!(parsed.headers["x-file"], "a b");
        assert_eq!(&buffer[..], b"\x01\x02");
        let fields = relayed(text).expect("relayed");
        assert_eq!(relayed_text(&fields), "X-File: a b \r\n");
        for text in [
            "HTTP/1.1 200 OK\r\nX-File: a\x00b\x01\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX-File: a\rb\x01\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX-\x01File: ab\r\n\r\n",
        ] {
            assert!(
                matches!(head(text), Err(ClientError::Unpassable(_))),
                "{text:?}"
            );
        }
    }

    fn relayed(text: &str) -> Option<UpstreamFields> {
        parse_response_head(&mut BytesMut::from(text), ResponseFields::Relayed)
            .expect("valid head")
            .expect("complete head")
            .relayed
    }

    fn relayed_text(fields: &UpstreamFields) -> String {
        let mut out = BytesMut::new();
        fields.write_to(&mut out);
        String::from_utf8(out.to_vec()).expect("ascii")
    }

    #[test]
    fn relayed_fields_are_the_received_lines_without_hop_by_hop_and_length() {
        let fields = relayed(
            "HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: Tue, 01 Dec 2026 10:00:00 GMT\r\n\
             Content-Type: text/html\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\
             Keep-Alive: timeout=5\r\nX-Powered-By:  PHP/8.2 \r\nSet-Cookie: a=1\r\n\
             Set-Cookie: b=2\r\n\r\nhello",
        )
        .expect("relayed");
        assert_eq!(
            relayed_text(&fields),
            "Server: nginx\r\nDate: Tue, 01 Dec 2026 10:00:00 GMT\r\nContent-Type: text/html\r\n\
             X-Powered-By:  PHP/8.2 \r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n"
        );
        assert_eq!(fields.content_length, Some(5));
        assert!(fields.has_date());
        // Every hop-by-hop field goes; a chunked body's length is not the body's.
        let fields = relayed(
            "HTTP/1.1 200 OK\r\nTE: x\r\nTrailer: y\r\nUpgrade: z\r\nProxy-Connection: k\r\n\
             Transfer-Encoding: chunked\r\nContent-Length: 9\r\nETag: \"1\"\r\n\r\n",
        )
        .expect("relayed");
        assert_eq!(relayed_text(&fields), "ETag: \"1\"\r\n");
        assert_eq!(fields.content_length, None);
        assert!(!fields.has_date());
    }

    /// A 304 keeps its fields as the app spelled them, as a 200 does; the length it gives
    /// (of the page a GET would get) goes with it.
    #[test]
    fn bodiless_answers_are_relayed_as_received() {
        let fields = relayed(
            "HTTP/1.1 304 Not Modified\r\nETag: \"1\"\r\nX-Custom: a\r\nContent-Length: 1234\r\n\r\n",
        )
        .expect("relayed");
        assert_eq!(relayed_text(&fields), "ETag: \"1\"\r\nX-Custom: a\r\n");
        assert_eq!(fields.content_length, Some(1234));
        let fields = relayed("HTTP/1.1 204 No Content\r\nX-Custom: a\r\n\r\n").expect("relayed");
        assert_eq!(relayed_text(&fields), "X-Custom: a\r\n");
        assert_eq!(fields.content_length, None);
    }

    #[test]
    fn heads_that_cannot_be_relayed_as_received_are_parsed() {
        for text in [
            // A line ending in a bare LF must not reach the client.
            "HTTP/1.1 200 OK\r\nA: 1\nContent-Length: 0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nA: 1\r\nContent-Length: 0\n\n",
            // A field named by Connection is hop-by-hop too.
            "HTTP/1.1 200 OK\r\nConnection: x-secret\r\nX-Secret: 1\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
            // Fields levee may set in place of the upstream's.
            "HTTP/1.1 200 OK\r\nRateLimit: limit=9\r\nContent-Length: 0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nratelimit-policy: 9;w=1\r\nContent-Length: 0\r\n\r\n",
        ] {
            let head = parse_response_head(&mut BytesMut::from(text), ResponseFields::Relayed)
                .expect("valid head")
                .expect("complete head");
            assert!(head.relayed.is_none(), "{text:?}");
            assert!(!head.headers.is_empty(), "{text:?}");
        }
        // More separate ranges than there is room for.
        let mut text = String::from("HTTP/1.1 200 OK\r\n");
        for index in 0..=MOST_RUNS {
            text.push_str(&format!("X-{index}: 1\r\nKeep-Alive: 1\r\n"));
        }
        text.push_str("\r\n");
        assert!(relayed(&text).is_none());
    }

    #[test]
    fn relayed_and_parsed_heads_pass_on_the_same_fields() {
        for text in [
            "HTTP/1.1 200 OK\r\nServer: a\r\nContent-Length: 3\r\nConnection: close\r\n\r\n",
            "HTTP/1.0 404 Not Found\r\nX-A: 1\r\nKeep-Alive: 2\r\nX-B: \t2\r\n\r\n",
            "HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\nX: é\r\n\r\n",
            "HTTP/1.1 200 OK\r\nconnection: upgrade, keep-alive\r\nupgrade: h2c\r\nvary: a\r\n\r\n",
        ] {
            let parsed = parse_response_head(&mut BytesMut::from(text), ResponseFields::Parsed)
                .expect("valid")
                .expect("complete");
            let relayed = relayed(text).expect("relayed");
            let mut expected = parsed.headers.clone();
            crate::proxy::header::strip_hop_by_hop(&mut expected, false);
            expected.remove(header::CONTENT_LENGTH);
            let mut from_relayed = HeaderMap::new();
            for line in relayed_text(&relayed).split_terminator("\r\n") {
                let (name, value) = line.split_once(':').expect("a field line");
                from_relayed.append(
                    HeaderName::from_bytes(name.as_bytes()).expect("name"),
                    HeaderValue::from_bytes(value.trim().as_bytes()).expect("value"),
                );
            }
            assert_eq!(from_relayed, expected, "{text:?}");
            let parsed_length = parsed
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|value| value.to_str().ok()?.parse().ok());
            assert_eq!(relayed.content_length, parsed_length, "{text:?}");
        }
    }

    #[test]
    fn header_values_are_kept_byte_for_byte() {
        let parsed = head("HTTP/1.1 404 Not Found\r\nX-Thing: a b\r\nset-cookie: x=1\r\nset-cookie: y=2\r\ncontent-length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(parsed.status, StatusCode::NOT_FOUND);
        assert_eq!(parsed.headers["x-thing"], "a b");
        assert_eq!(parsed.headers.get_all("set-cookie").iter().count(), 2);
    }

    #[tokio::test]
    async fn a_connection_taken_from_the_pool_reads_at_the_start_of_its_buffer() {
        let pool = Pool {
            idle: Mutex::new(VecDeque::new()),
            idle_timeout: Duration::from_secs(60),
            max_idle: 4,
        };
        // A connection that has read one answer of 1,000 bytes, passed on and gone.
        let kept = |piece_alive: bool| {
            let (stream, peer) = UnixStream::pair().expect("socket pair");
            let mut connection = Connection::new(Stream::Unix(stream));
            connection.buffer.reserve(HEAD_READ_SIZE);
            let whole = connection.buffer.capacity();
            connection.buffer.extend_from_slice(&[b'x'; 1000]);
            let answer = connection.buffer.split_to(1000).freeze();
            (connection, whole, piece_alive.then_some(answer), peer)
        };

        let (connection, whole, _gone, _peer) = kept(false);
        pool.put(connection);
        let taken = pool.take(Instant::now()).expect("usable");
        assert_eq!(taken.buffer.capacity(), whole, "read from the start again");

        // A piece of the last answer still on its way to the client stays where it is.
        let (connection, whole, alive, _peer) = kept(true);
        pool.put(connection);
        let taken = pool.take(Instant::now()).expect("usable");
        assert_eq!(
            taken.buffer.capacity(),
            whole - 1000,
            "read behind the live piece"
        );
        assert_eq!(alive.as_deref(), Some(&[b'x'; 1000][..]));
    }
}
