//! One client connection: request heads, bodies and responses, in order, until it closes.
//!
//! Memory is the point of this module. Between requests a connection holds no buffer at all:
//! it waits for the socket to become readable, then reads the next head into a small buffer
//! that lives only as long as the request needs it (a pipelined request that is already
//! buffered keeps it). Response heads are encoded into a buffer made for that response.
//! Per-request state (the handler's future, the body reader, the write loop) lives in one
//! boxed future, so the connection task itself stays small while it waits.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Method, Request, Response, StatusCode, Version};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::chunked::ChunkedDecoder;
use super::encode::{self, ResponseFraming};
use super::parse::{parse_head, BodyFraming, HeadError, RequestHead};
use super::request_body::{BodyPiece, RequestBody, RequestBodyError};
use super::upgrade::{ClientUpgrade, UpgradedClient};
use crate::error::ProxyError;
use crate::proxy::body::{ResponseBody, JOINED_PIECE};
use crate::proxy::client::UpstreamReason;
use crate::proxy::deadline;
use crate::proxy::header::ReceivedHead;
use crate::proxy::server::{ConnectionLimits, ConnectionSlot};
use crate::proxy::upstream_fields::UpstreamFields;

/// Room for reading a request head: the first read lands on the stack (so an idle
/// connection's wake-up allocates nothing); a head that needs more reads grows by this much.
const HEAD_READ_SIZE: usize = 4 * 1024;
/// Room made in the read buffer for each read of request body bytes.
const BODY_READ_SIZE: usize = 64 * 1024;
/// A response body of known length up to this size gets room after the head, and is copied
/// there (one contiguous write for small answers); other pieces go out from where they are.
const COPY_LIMIT: usize = 16 * 1024;
/// Response bytes are written out once this many have gathered.
const FLUSH_LIMIT: usize = 64 * 1024;
/// Response pieces up to this size are copied rather than gathered.
const SMALL_PIECE: usize = 1024;
/// Most slices one vectored write hands the kernel.
const WRITE_SLICES: usize = 16;
/// After a response, an unread rest of the request body is read and thrown away up to
/// this much, so the connection can serve the next request; a longer rest closes it.
const DRAIN_LIMIT: u64 = 64 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(1);
/// Before closing after a response, what the client still sends is read (and dropped) for a
/// moment: closing a socket with unread bytes sends a reset, which can destroy the response
/// before the client has read it. As with nginx's lingering close, time is the real bound: an
/// upload refused early (a 413 from the app) is still arriving at loopback speed, and it must
/// be swallowed whole for the client to see the refusal; the byte bound only stops a flood.
const LINGER_LIMIT: usize = 64 * 1024 * 1024;
const LINGER_TIME: Duration = Duration::from_secs(1);

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// A handler's response as the connection writes it.
pub struct Answer {
    pub response: Response<ResponseBody>,
    /// The upstream's own header lines, when a pass-through relays them as received: written
    /// in place of the response's (then empty) `HeaderMap`, after levee's own fields.
    pub relayed: Option<UpstreamFields>,
}

impl From<Response<ResponseBody>> for Answer {
    fn from(response: Response<ResponseBody>) -> Self {
        Answer {
            response,
            relayed: None,
        }
    }
}

/// What happens to the connection after one exchange.
enum After {
    KeepAlive,
    Close,
    /// The response was cut short where only the connection's end marks the body's end: a
    /// reset, not a FIN, so the client does not take the part it got for the whole.
    Abort,
    Upgrade(oneshot::Sender<UpgradedClient>),
}

/// Serves requests on `stream` until the client or levee closes it.
///
/// `slot` counts the connection while it lives, and goes with it into a tunnel after a 101.
pub(super) async fn serve_connection<H, F>(
    mut stream: TcpStream,
    peer: SocketAddr,
    handler: H,
    limits: ConnectionLimits,
    slot: ConnectionSlot,
    stop: watch::Receiver<bool>,
) where
    H: Fn(SocketAddr, Box<Request<RequestBody>>) -> F,
    F: Future + Send + 'static,
    F::Output: Into<Answer> + Send,
{
    // The parser's own bound, above the operator's limit on the request line and on the
    // fields (each `max_header_bytes`): levee's check of those on the parsed head gives the
    // client a precise 414 or 431 (see `proxy::forward`); this one only stops a head from
    // growing without end. It is also what a slow client's unfinished head can hold for
    // `header_read_timeout`: it was at least 64 KiB, in a buffer grown to twice that.
    let max_head_bytes = 2 * limits.max_header_bytes + 8192;
    let mut read_buffer = BytesMut::new();
    let mut stop = Stop {
        switch: stop,
        stopping: false,
    };
    // One timer for every head the connection reads: see `deadline::within`.
    let head_timer = tokio::time::sleep(limits.header_read_timeout);
    tokio::pin!(head_timer);
    // No request has been read on this connection yet.
    let mut fresh = true;
    loop {
        // The timeout also runs while a keep-alive connection waits for its next request,
        // so idle connections are closed after it, as with hyper before.
        let now = Instant::now();
        // Once per request: the most regular point at which a busy thread passes.
        crate::cpu_quota::settle(now.into_std());
        let deadline = now + limits.header_read_timeout;
        let read = {
            let reading = read_head(
                &mut stream,
                &mut read_buffer,
                max_head_bytes,
                &mut stop,
                fresh,
            );
            deadline::within(deadline, head_timer.as_mut(), std::pin::pin!(reading)).await
        };
        let head = match read {
            None => {
                tracing::debug!(%peer, "no complete request head within the header read timeout");
                return;
            }
            Some(HeadRead::Closed) => return,
            Some(HeadRead::Refused { error, method }) => {
                let error = error.naming_limit(limits.max_header_bytes);
                // Said as the handler's refusals are (its budget is per listener here, as no
                // request reached the handler): a site whose visitors report 400s finds them.
                static HEADS_REFUSED: crate::log_throttle::LogBudget =
                    crate::log_throttle::LogBudget::new(20, Duration::from_secs(1));
                match HEADS_REFUSED.allow(std::time::Instant::now()) {
                    Some(held_back) => {
                        tracing::info!(client = %peer.ip(), held_back, "refused: request head refused: {error}");
                    }
                    None => tracing::debug!(%peer, "request head refused: {error}"),
                }
                Box::pin(refuse(&mut stream, error, &method, &limits)).await;
                Box::pin(linger_close(stream)).await;
                return;
            }
            Some(HeadRead::Head(head)) => head,
        };
        fresh = false;
        let exchange = crate::proxy::boxed_in_place(|| {
            serve_request(
                &mut stream,
                &mut read_buffer,
                head,
                peer,
                &handler,
                &mut stop,
                limits.send_timeout,
            )
        });
        match exchange.await {
            After::KeepAlive => {
                if read_buffer.is_empty() {
                    // Nothing pipelined: give the buffer back while the connection idles.
                    read_buffer = BytesMut::new();
                }
            }
            After::Close => {
                Box::pin(linger_close(stream)).await;
                return;
            }
            After::Abort => {
                // SO_LINGER 0: closing sends RST at once (and cannot block: nothing waits to
                // be sent out).
                if let Err(error) = stream.set_zero_linger() {
                    tracing::debug!(%peer, "cannot reset the connection: {error}");
                }
                return;
            }
            After::Upgrade(sender) => {
                let _ = sender.send(UpgradedClient::new(stream, read_buffer.freeze(), slot));
                return;
            }
        }
    }
}

enum HeadRead {
    /// Boxed as soon as it is parsed: on its way into the exchange's box it is moved some
    /// six times (out of `read_head`, `deadline::within`, into `serve_request`'s future),
    /// 264 bytes each time into cold lines, which cost more than the allocation.
    Head(Box<RequestHead>),
    /// With the method to answer as: a HEAD request still gets no body (RFC 9110 9.3.2),
    /// or its client would take the body for its next answer.
    Refused {
        error: HeadError,
        method: Method,
    },
    Closed,
}

/// Reads until a whole request head is buffered. No buffer is allocated before the first
/// byte of the head arrives.
///
/// The parser starts from the head's first byte each time, so it runs again only when a read
/// brought a line's end (or the head outgrew its bound): a head trickled in a byte at a time
/// would otherwise be parsed once per byte, and a 64 KiB one cost some two billion byte
/// steps. Lines are bounded too (`MAX_HEADERS`), so the parses per head are.
async fn read_head(
    stream: &mut TcpStream,
    buffer: &mut BytesMut,
    max_head_bytes: usize,
    stop: &mut Stop,
    fresh: bool,
) -> HeadRead {
    // Where the bytes not yet seen by the parser begin; `None`: parse what is there now
    // (a pipelined head, or a first read, whose garbage is refused at once).
    let mut unparsed_from: Option<usize> = None;
    // Once levee stops: how long a connection opened just before may take to send its
    // first request.
    let mut grace: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    loop {
        let worth_parsing = match unparsed_from {
            None => true,
            Some(from) => {
                buffer.len() > max_head_bytes
                    || buffer
                        .get(from..)
                        .is_none_or(|new| memchr::memchr(b'\n', new).is_some())
            }
        };
        if !buffer.is_empty() && worth_parsing {
            // Read before parsing: a head refused half-way has been split off the buffer.
            let asks_head = buffer.starts_with(b"HEAD ");
            match parse_head(buffer, max_head_bytes) {
                Ok(Some(head)) => return HeadRead::Head(Box::new(head)),
                Ok(None) => {}
                Err(error) => {
                    let method = if asks_head { Method::HEAD } else { Method::GET };
                    return HeadRead::Refused { error, method };
                }
            }
        }
        if buffer.capacity() != 0 && buffer.capacity() - buffer.len() < 512 {
            // Doubled as the head grows, but never much past what the parser reads (a grown
            // `BytesMut` may double past what it is asked for).
            let wanted = (2 * buffer.len())
                .max(buffer.len() + HEAD_READ_SIZE)
                .min(max_head_bytes + 1)
                .max(buffer.len() + 512);
            let mut grown = BytesMut::with_capacity(wanted);
            grown.extend_from_slice(buffer);
            *buffer = grown;
        }
        let before = buffer.len();
        tokio::select! {
            read = read_some(stream, buffer) => match read {
                Ok(0) | Err(_) => return HeadRead::Closed,
                Ok(_) => unparsed_from = (before > 0).then_some(before),
            },
            () = stopped(&mut stop.switch), if !stop.stopping => {
                stop.stopping = true;
                // A head already on its way is still answered (`Connection: close`).
                if buffer.is_empty() {
                    // A front opens a connection to send a request on it at once, and one
                    // not answered is not sent again if it was a POST: a connection opened
                    // just before the stop gets a moment for its first request. An idle
                    // keep-alive connection is closed now, unless its next request is
                    // already in the socket.
                    if fresh {
                        grace = Some(Box::pin(tokio::time::sleep(FIRST_REQUEST_GRACE)));
                    } else if !read_waiting(stream, buffer) {
                        return HeadRead::Closed;
                    }
                }
            }
            () = async { if let Some(grace) = grace.as_mut() { grace.await } }, if grace.is_some() && buffer.is_empty() => {
                return HeadRead::Closed;
            }
        }
    }
}

/// How long a connection accepted just before levee stopped may take to send its first
/// request, which is then answered (with `Connection: close`).
const FIRST_REQUEST_GRACE: Duration = Duration::from_secs(1);

/// Reads into `buffer` what the socket holds now, without waiting; whether anything came.
/// Asked of the socket itself: the runtime's note of its readiness may not yet know of bytes
/// that have just arrived.
fn read_waiting(stream: &TcpStream, buffer: &mut BytesMut) -> bool {
    let mut waiting = [0u8; HEAD_READ_SIZE];
    match rustix::net::recv(stream, &mut waiting[..], rustix::net::RecvFlags::DONTWAIT) {
        Ok((read, _)) if read > 0 => {
            buffer.extend_from_slice(&waiting[..read]);
            true
        }
        _ => false,
    }
}

/// Reads what the socket has into `buffer`. Reading goes through `poll_read`, which, after a
/// read shorter than the room offered, knows the socket is drained without asking the kernel
/// again: the close watch that follows each head then costs no extra `recv`.
async fn read_some(stream: &mut TcpStream, buffer: &mut BytesMut) -> std::io::Result<usize> {
    std::future::poll_fn(|cx| {
        if buffer.capacity() == 0 {
            // Nothing buffered: read onto the stack first, so that a wake-up without data
            // allocates nothing, and the array is not part of the idle connection's task.
            // Uninitialised: the read fills what it returns, and zeroing 4 KiB on every
            // wake-up cost more than the read's own work in levee.
            let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); HEAD_READ_SIZE];
            let mut room = tokio::io::ReadBuf::uninit(&mut probe);
            std::task::ready!(tokio::io::AsyncRead::poll_read(
                std::pin::Pin::new(&mut *stream),
                cx,
                &mut room
            ))?;
            // Exactly what arrived: usually the whole head, which then needs no more room
            // (with thousands of requests in flight at once this is most of their memory).
            // A head that is still incomplete grows the buffer.
            let read = room.filled();
            buffer.reserve(read.len());
            buffer.extend_from_slice(read);
            std::task::Poll::Ready(Ok(read.len()))
        } else {
            // `read_buf` keeps no state between polls: a fresh one per poll loses nothing.
            std::pin::pin!(stream.read_buf(buffer)).poll(cx)
        }
    })
    .await
}

/// The handler's answer; never ready once the handler's future is gone.
fn answer_of<F: Future>(
    mut answering: std::pin::Pin<&mut Option<F>>,
) -> impl Future<Output = F::Output> + '_ {
    std::future::poll_fn(move |cx| match answering.as_mut().as_pin_mut() {
        Some(future) => future.poll(cx),
        None => std::task::Poll::Pending,
    })
}

/// Answers a head that could not be accepted, through the one place errors become responses.
async fn refuse(
    stream: &mut TcpStream,
    error: HeadError,
    method: &Method,
    limits: &ConnectionLimits,
) {
    let error = match error {
        HeadError::TooLarge { size, limit } => ProxyError::HeadersTooLarge { size, limit },
        HeadError::TooManyHeaders { limit } => ProxyError::TooManyHeaders { limit },
        HeadError::TargetTooLong { limit } => ProxyError::TargetTooLong { limit },
        HeadError::Malformed(reason) => ProxyError::bad_request(reason),
    };
    // A head that could not be read says nothing reliable of what the client reads: no
    // `Accept` is taken from it, so the answer is the page browsers get unless the site's
    // `answer_format` says JSON.
    let wants_json = limits.answer_format.is_json(std::iter::empty());
    let (mut parts, body) = error.to_response(wants_json).into_parts();
    let mut keep_alive = false;
    let framing = encode::frame_response(
        method,
        Version::HTTP_11,
        parts.status,
        &mut parts.headers,
        None,
        body.size_hint().exact(),
        &mut keep_alive,
    );
    let mut out = BytesMut::new();
    encode::encode_head(
        &mut out,
        (parts.status, None),
        (&parts.headers, None),
        None,
        0,
    );
    let (mut reader, writer) = stream.split();
    let mut writer = ClientWriter {
        half: writer,
        send_timeout: limits.send_timeout,
    };
    let mut no_body = RequestBodyReader::finished();
    let mut no_buffer = BytesMut::new();
    write_body(
        &mut writer,
        out,
        body,
        framing,
        &mut no_body,
        &mut reader,
        &mut no_buffer,
    )
    .await;
}

/// One exchange: the handler runs while the request body streams in; then the response is
/// written while any rest of the request body still streams in.
async fn serve_request<H, F>(
    stream: &mut TcpStream,
    read_buffer: &mut BytesMut,
    head: Box<RequestHead>,
    peer: SocketAddr,
    handler: &H,
    stop: &mut Stop,
    send_timeout: Duration,
) -> After
where
    H: Fn(SocketAddr, Box<Request<RequestBody>>) -> F,
    F: Future + Send + 'static,
    F::Output: Into<Answer> + Send,
{
    let RequestHead {
        method,
        uri,
        version,
        headers,
        framing,
        keep_alive,
        expect_continue,
        wants_upgrade,
        close_after,
        received,
    } = *head;
    let (mut continue_wanted, wanted) = if expect_continue {
        let (sender, receiver) = oneshot::channel();
        (Some(receiver), Some(sender))
    } else {
        (None, None)
    };
    let (mut body_reader, body) = RequestBodyReader::new(framing, wanted);
    let body = body.with_received_head(received);
    // Boxed once here: the handler's futures move their arguments from state to state (about
    // five times from here to `proxy::forward`), and a 304-byte request moved each time cost
    // 430 instructions per request and a fifth of its first-level data misses (callgrind's
    // cache simulation, `bench/callgrind.sh` with CACHE=1).
    let mut request = Box::new(Request::new(body));
    *request.method_mut() = method.clone();
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    let upgrade = wants_upgrade.then(|| {
        let (sender, upgrade) = ClientUpgrade::new();
        request.extensions_mut().insert(upgrade);
        sender
    });
    let mut must_close = close_after;

    let (mut reader, writer) = stream.split();
    let mut writer = ClientWriter {
        half: writer,
        send_timeout,
    };
    // In this exchange's own box (see `serve_connection`), not one of its own: one allocation
    // per request fewer. Held in an `Option` to be dropped as soon as it has answered.
    let mut answering = std::pin::pin!(Some(handler(peer, request)));
    // A client waiting for 100 Continue sends nothing until the body is asked for: its
    // leaving is watched for meanwhile, or its request would go on to the bulkhead and the
    // upstream for nobody. Once it sends anything (it may send the body without waiting),
    // the body reader takes over when the body is wanted.
    let mut watch_close_before_continue = continue_wanted.is_some();
    let answer = loop {
        let waits_for_continue = continue_wanted.is_some();
        tokio::select! {
            biased;
            answer = answer_of(answering.as_mut()) => break answer.into(),
            wanted = body_wanted(&mut continue_wanted), if continue_wanted.is_some() => {
                continue_wanted = None;
                if !wanted {
                    // Dropped unread: whether (and when) the client sends the body is
                    // unknown, so the connection cannot be reused.
                    must_close = true;
                } else if !writer.send_all(&mut &CONTINUE[..]).await {
                    // The client is gone, or took nothing for send_timeout: the request is
                    // cancelled, as for a client that went away, freeing its upstream slot.
                    tracing::debug!(%peer, "the client did not take 100 Continue");
                    return After::Close;
                }
            }
            present = body_reader.progress(&mut reader, read_buffer, waits_for_continue),
                if (waits_for_continue && watch_close_before_continue)
                    || (!waits_for_continue && body_reader.has_work()) => {
                if waits_for_continue {
                    watch_close_before_continue = false;
                }
                if !present {
                    // Like hyper: a client that went away cancels its request, so the
                    // upstream slot it holds is freed instead of waiting for an answer
                    // nobody will read.
                    tracing::debug!(%peer, "client closed the connection before the response");
                    return After::Close;
                }
            }
        }
    };
    // Whether levee began to stop while the handler ran: read once here rather than watched
    // in the loop above, where the watch cost a waiter registered and removed on every poll.
    // It only decides whether this response keeps the connection.
    // A stop switch that is gone counts as stop, as in `stopped`.
    if !stop.stopping && (*stop.switch.borrow() || stop.switch.has_changed().is_err()) {
        stop.stopping = true;
    }
    answering.set(None);
    if continue_wanted.is_some() {
        // Answered without asking for the body and without sending 100: the client may or
        // may not send it now, so the connection cannot be reused.
        must_close = true;
    }

    let Answer {
        response,
        mut relayed,
    } = answer;
    let (mut parts, response_body) = response.into_parts();
    let mut keep_alive = keep_alive && !must_close && !stop.stopping;
    let switching = parts.status == StatusCode::SWITCHING_PROTOCOLS;
    let framing = encode::frame_response(
        &method,
        version,
        parts.status,
        &mut parts.headers,
        relayed.as_mut(),
        response_body.size_hint().exact(),
        &mut keep_alive,
    );
    let mut out = BytesMut::new();
    // A small body known in length is copied after the head (see `write_body`): room for both
    // at once, so the buffer is not grown for the body.
    let body_room = match framing {
        ResponseFraming::Length(length) => usize::try_from(length)
            .ok()
            .filter(|length| *length <= COPY_LIMIT)
            .unwrap_or(0),
        _ => 0,
    };
    encode::encode_head(
        &mut out,
        (
            parts.status,
            UpstreamReason::for_status(&parts.extensions, parts.status),
        ),
        (&parts.headers, parts.extensions.get::<ReceivedHead>()),
        relayed.as_ref(),
        body_room,
    );
    // The relayed fields hold the upstream head's bytes: not kept while the body is written.
    drop(parts);
    drop(relayed);
    let complete = write_body(
        &mut writer,
        out,
        response_body,
        framing,
        &mut body_reader,
        &mut reader,
        read_buffer,
    )
    .await;
    if !complete {
        // An HTTP/1.1 client sees a short length or a missing last chunk; a close-delimited
        // body (an HTTP/1.0 client's, when the upstream's length was not known) ends at the
        // connection's end, and a FIN would make the part look whole.
        return if framing == ResponseFraming::UntilClose {
            After::Abort
        } else {
            After::Close
        };
    }
    if switching {
        return match upgrade {
            Some(sender) => After::Upgrade(sender),
            // A 101 nobody asked for: the connection's protocol is unknown from here on.
            None => After::Close,
        };
    }
    if !keep_alive || *stop.switch.borrow() {
        return After::Close;
    }
    if body_reader.is_reading() {
        // The handler answered without reading the whole body (a refusal, a cached copy):
        // read the rest away if it is short, so the connection can be reused.
        let drained =
            tokio::time::timeout(DRAIN_TIME, body_reader.drain(&mut reader, read_buffer)).await;
        if !matches!(drained, Ok(true)) {
            return After::Close;
        }
    }
    if body_reader.is_done() {
        After::KeepAlive
    } else {
        After::Close
    }
}

/// Waits until the client either closes the connection (true) or has sent something more
/// (false: bytes buffered or waiting in the socket, which stay there). Cancel-safe.
async fn client_leaves(reader: &mut ReadHalf<'_>, buffer: &BytesMut) -> bool {
    if !buffer.is_empty() {
        return false;
    }
    let mut probe = [0u8; 1];
    matches!(reader.peek(&mut probe).await, Ok(0) | Err(_))
}

/// levee's stop switch as one connection sees it.
struct Stop {
    switch: watch::Receiver<bool>,
    /// levee has begun to stop: the connection closes after the exchange in progress.
    stopping: bool,
}

/// Resolves once levee stops (or can no longer tell whether it should).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`; it must not live across an await.
    let _ = stop.wait_for(|stopped| *stopped).await.map(|_| ());
}

/// Resolves when the request body is first polled (true) or dropped unpolled (false).
async fn body_wanted(wanted: &mut Option<oneshot::Receiver<()>>) -> bool {
    match wanted {
        Some(receiver) => receiver.await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Writes the encoded head and the response body with the chosen framing, keeping the
/// request body flowing meanwhile. True when the whole response went out correctly framed.
async fn write_body(
    writer: &mut ClientWriter<'_>,
    mut out: BytesMut,
    mut body: ResponseBody,
    framing: ResponseFraming,
    body_reader: &mut RequestBodyReader,
    reader: &mut ReadHalf<'_>,
    read_buffer: &mut BytesMut,
) -> bool {
    if framing == ResponseFraming::None {
        drop(body);
        return writer.send_all(&mut out).await;
    }
    let mut length_left = match framing {
        ResponseFraming::Length(length) => length,
        _ => 0,
    };
    // What goes out in the next write: `out`'s bytes (head, chunk framing, small pieces
    // copied) split off in order between the body's own pieces, which are not copied.
    let mut gather = Gather::default();
    loop {
        // Frames that are ready now (a small answer, data that came with the upstream's
        // head) are gathered into one write; only when the body has to wait is it flushed.
        let next = match body.frame().now_or_never() {
            Some(next) => next,
            None => {
                if !writer.flush(&mut gather, &mut out).await {
                    return false;
                }
                loop {
                    tokio::select! {
                        biased;
                        next = body.frame() => break next,
                        present = body_reader.progress(reader, read_buffer, false), if body_reader.has_work() => {
                            if !present {
                                return false;
                            }
                        }
                    }
                }
            }
        };
        let data = match next {
            None => break,
            Some(Err(error)) => {
                tracing::debug!("response body failed, closing the connection: {error}");
                let _ = writer.flush(&mut gather, &mut out).await;
                return false;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => data,
                // Trailers are not forwarded; empty frames carry nothing.
                _ => continue,
            },
        };
        match framing {
            ResponseFraming::Length(_) => {
                let length = data.len() as u64;
                if length > length_left {
                    tracing::debug!("response body is longer than its Content-Length");
                    let _ = writer.flush(&mut gather, &mut out).await;
                    return false;
                }
                length_left -= length;
            }
            ResponseFraming::Chunked => encode::encode_chunk_start(&mut out, data.len()),
            _ => {}
        }
        // A piece that fits the room made after the head (a small answer), or a small piece
        // (a PHP page's chunks), is copied: one contiguous write, no list of pieces. Anything
        // else goes out from where it is.
        if data.len() <= out.capacity() - out.len() || data.len() <= SMALL_PIECE {
            out.put_slice(&data);
        } else {
            gather.push(out.split().freeze());
            gather.push(data);
        }
        if framing == ResponseFraming::Chunked {
            out.put_slice(b"\r\n");
        }
        let flush_now = gather.remaining() + out.len() >= FLUSH_LIMIT || gather.is_full();
        if flush_now && !writer.flush(&mut gather, &mut out).await {
            return false;
        }
        if body.is_end_stream() {
            break;
        }
    }
    if framing == ResponseFraming::Chunked {
        out.put_slice(encode::LAST_CHUNK);
    }
    if !writer.flush(&mut gather, &mut out).await {
        return false;
    }
    if length_left > 0 {
        tracing::debug!("response body ended {length_left} bytes short of its Content-Length");
        return false;
    }
    true
}

/// Pieces of a response written together with one vectored write, in order, none copied.
#[derive(Default)]
struct Gather {
    pieces: std::collections::VecDeque<Bytes>,
    remaining: usize,
}

impl Gather {
    /// At most this many pieces: one `writev` takes them all (see `write_some`), a body
    /// piece and its chunk framing on each side included.
    const MAX_PIECES: usize = WRITE_SLICES - 3;

    fn push(&mut self, piece: Bytes) {
        if !piece.is_empty() {
            self.remaining += piece.len();
            self.pieces.push_back(piece);
        }
    }

    fn is_full(&self) -> bool {
        self.pieces.len() >= Self::MAX_PIECES
    }
}

impl Buf for Gather {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.pieces.front().map_or(&[], |piece| &piece[..])
    }

    fn chunks_vectored<'a>(&'a self, slices: &mut [std::io::IoSlice<'a>]) -> usize {
        let mut count = 0;
        for (slot, piece) in slices.iter_mut().zip(&self.pieces) {
            *slot = std::io::IoSlice::new(piece);
            count += 1;
        }
        count
    }

    fn advance(&mut self, mut count: usize) {
        self.remaining = self.remaining.saturating_sub(count);
        while count > 0 {
            let Some(front) = self.pieces.front_mut() else {
                return;
            };
            if count < front.len() {
                front.advance(count);
                return;
            }
            count -= front.len();
            self.pieces.pop_front();
        }
    }
}

/// The client connection's write half, with the bound on how long the client may take nothing.
struct ClientWriter<'a> {
    half: WriteHalf<'a>,
    send_timeout: Duration,
}

impl ClientWriter<'_> {
    /// Writes what `gather` holds, then `out`'s bytes; false as `send_all`. A small answer
    /// that lies whole in `out` is written from there.
    async fn flush(&mut self, gather: &mut Gather, out: &mut BytesMut) -> bool {
        if gather.pieces.is_empty() {
            return self.send_all(out).await;
        }
        gather.push(out.split().freeze());
        self.send_all(gather).await
    }

    /// Writes all of `buf`, vectored. False when the client is gone or took no byte for
    /// `send_timeout` (a client that stops reading must not hold its upstream connection, and
    /// the bulkhead slot with it, for ever). The bound is between writes that make progress,
    /// as nginx's `send_timeout`, so a slow reader that keeps reading is not cut off; a write
    /// the socket takes at once sets no timer.
    async fn send_all<B: Buf>(&mut self, buf: &mut B) -> bool {
        let limit = self.send_timeout;
        while buf.has_remaining() {
            let written = match write_some(&mut self.half, buf).now_or_never() {
                Some(written) => written,
                None => match tokio::time::timeout(limit, write_some(&mut self.half, buf)).await {
                    Ok(written) => written,
                    Err(_elapsed) => {
                        tracing::debug!(
                            "the client took no response byte for {limit:?} (send_timeout): closing"
                        );
                        return false;
                    }
                },
            };
            match written {
                Ok(0) | Err(_) => return false,
                Ok(written) => buf.advance(written),
            }
        }
        true
    }
}

/// One vectored write of what `buf` holds; `buf` is not advanced.
async fn write_some<B: Buf>(writer: &mut WriteHalf<'_>, buf: &B) -> std::io::Result<usize> {
    std::future::poll_fn(|cx| {
        let mut slices = [std::io::IoSlice::new(&[]); WRITE_SLICES];
        let count = buf.chunks_vectored(&mut slices);
        tokio::io::AsyncWrite::poll_write_vectored(
            std::pin::Pin::new(&mut *writer),
            cx,
            &slices[..count],
        )
    })
    .await
}

/// Sends FIN after the last response, then reads and drops what the client still sends for
/// a moment, so that closing does not reset the connection under the client's feet.
async fn linger_close(mut stream: TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut sink = vec![0u8; 8192];
    let mut total = 0;
    let _ = tokio::time::timeout(LINGER_TIME, async {
        while total < LINGER_LIMIT {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(read) => total += read,
            }
        }
    })
    .await;
}

/// Where the request body's bytes stand on the wire.
#[derive(Debug)]
enum WireBody {
    Length { remaining: u64 },
    Chunked(ChunkedDecoder),
    Done,
    Failed,
}

/// The connection's side of a request body: reads body bytes from the socket (only when
/// the [`RequestBody`] has room for them), decodes the framing, and passes data on.
struct RequestBodyReader {
    wire: WireBody,
    /// `None` once the body is complete, or when there never was one.
    pieces: Option<mpsc::Sender<BodyPiece>>,
    /// Bytes read after the request path let go of the body.
    discarded: u64,
    /// Once the body is read, the socket is watched for the client closing it, until the
    /// next request starts to arrive.
    watch_close: bool,
}

impl RequestBodyReader {
    fn new(
        framing: BodyFraming,
        wanted: Option<oneshot::Sender<()>>,
    ) -> (RequestBodyReader, RequestBody) {
        let (wire, length) = match framing {
            BodyFraming::Empty => return (RequestBodyReader::bodiless(), RequestBody::empty()),
            BodyFraming::Length(length) => (WireBody::Length { remaining: length }, Some(length)),
            BodyFraming::Chunked => (WireBody::Chunked(ChunkedDecoder::new()), None),
        };
        // One piece in flight: the socket is read only when the body has been taken from.
        let (sender, receiver) = mpsc::channel(1);
        (
            RequestBodyReader {
                wire,
                pieces: Some(sender),
                discarded: 0,
                watch_close: true,
            },
            RequestBody::streaming(receiver, length, wanted),
        )
    }

    fn finished() -> RequestBodyReader {
        RequestBodyReader {
            wire: WireBody::Done,
            pieces: None,
            discarded: 0,
            watch_close: false,
        }
    }

    /// A bodiless request: nothing to read, but the client's leaving is watched for.
    fn bodiless() -> RequestBodyReader {
        RequestBodyReader {
            watch_close: true,
            ..RequestBodyReader::finished()
        }
    }

    /// Something to do on the reading side: body bytes to move, or a close to watch for.
    fn has_work(&self) -> bool {
        self.is_reading() || self.watch_close
    }

    /// Moves the body on by one piece, or, once it is read (or while the client waits for
    /// 100 Continue: `only_watch`), waits until the client either closes the connection
    /// (false) or sends something (true, and the watch ends). Cancel-safe.
    async fn progress(
        &mut self,
        reader: &mut ReadHalf<'_>,
        buffer: &mut BytesMut,
        only_watch: bool,
    ) -> bool {
        if only_watch {
            return !client_leaves(reader, buffer).await;
        }
        if self.is_reading() {
            self.step(reader, buffer).await;
            return true;
        }
        let leaves = client_leaves(reader, buffer).await;
        if !leaves {
            self.watch_close = false;
        }
        !leaves
    }

    fn is_reading(&self) -> bool {
        matches!(self.wire, WireBody::Length { .. } | WireBody::Chunked(_))
    }

    fn is_done(&self) -> bool {
        matches!(self.wire, WireBody::Done)
    }

    /// Moves the body on by one piece: waits for room in the body, reads from the socket if
    /// nothing is buffered, and hands over (or, once the body is dropped, discards) the data.
    /// Cancel-safe: nothing is lost if the future is dropped at an await.
    async fn step(&mut self, reader: &mut ReadHalf<'_>, buffer: &mut BytesMut) {
        let RequestBodyReader {
            wire,
            pieces,
            discarded,
            ..
        } = self;
        {
            let permit = match pieces.as_ref() {
                Some(sender) => sender.reserve().await.ok(),
                None => None,
            };
            let chunked = matches!(wire, WireBody::Chunked(_));
            let piece = next_piece(wire, reader, buffer).await;
            match (piece, permit) {
                (Ok(Some(data)), Some(permit)) => permit.send(Ok(data)),
                (Ok(Some(data)), None) => *discarded += data.len() as u64,
                // The last chunk came: said in so many words, as a channel that closes is
                // also what the body sees when this task ends mid-body (the client went
                // away, levee stopped), and a chunked body has no length to tell them apart.
                (Ok(None), Some(permit)) if chunked => permit.send(Ok(Bytes::new())),
                (Ok(None), _) => {}
                (Err(error), permit) => {
                    tracing::debug!("request body ended early: {error}");
                    *wire = WireBody::Failed;
                    if let Some(permit) = permit {
                        permit.send(Err(error));
                    }
                }
            }
        }
        if !matches!(wire, WireBody::Length { .. } | WireBody::Chunked(_)) {
            // Complete or failed: closing the channel ends the body for its reader.
            *pieces = None;
        } else if pieces.as_ref().is_some_and(mpsc::Sender::is_closed) {
            *pieces = None;
        }
    }

    /// Reads the rest of a body nobody wants any more; false if it is longer than
    /// [`DRAIN_LIMIT`] or broken.
    async fn drain(&mut self, reader: &mut ReadHalf<'_>, buffer: &mut BytesMut) -> bool {
        while self.is_reading() {
            if self.discarded > DRAIN_LIMIT {
                return false;
            }
            self.step(reader, buffer).await;
        }
        self.is_done()
    }
}

/// The next piece of body data from the buffer, reading the socket when the buffer has none.
/// `Ok(None)` when the body is complete.
async fn next_piece(
    wire: &mut WireBody,
    reader: &mut ReadHalf<'_>,
    buffer: &mut BytesMut,
) -> Result<Option<Bytes>, RequestBodyError> {
    loop {
        match wire {
            WireBody::Length { remaining } => {
                if !buffer.is_empty() {
                    let take = usize::try_from(*remaining)
                        .unwrap_or(usize::MAX)
                        .min(buffer.len());
                    *remaining -= take as u64;
                    let data = buffer.split_to(take).freeze();
                    if *remaining == 0 {
                        *wire = WireBody::Done;
                    }
                    return Ok(Some(data));
                }
            }
            WireBody::Chunked(decoder) => {
                let mut data = decoder.decode(buffer)?;
                // Small chunks already in the buffer go on as one piece: a body sent a few
                // bytes per chunk was one piece (and one pass through every body layer)
                // per chunk, sixteen times nginx's CPU for it.
                if let Some(first) = data.take_if(|first| first.len() < JOINED_PIECE) {
                    let mut joined = BytesMut::with_capacity(JOINED_PIECE);
                    joined.extend_from_slice(&first);
                    while joined.len() < JOINED_PIECE {
                        match decoder.decode(buffer)? {
                            Some(more) => joined.extend_from_slice(&more),
                            None => break,
                        }
                    }
                    data = Some(joined.freeze());
                }
                // Done once no data came with it: the next call says the body ended, which
                // the body's reader is told apart from a client gone away (see `step`).
                if decoder.is_done() && data.is_none() {
                    *wire = WireBody::Done;
                }
                if data.is_some() || matches!(wire, WireBody::Done) {
                    return Ok(data);
                }
            }
            WireBody::Done | WireBody::Failed => return Ok(None),
        }
        if buffer.capacity() - buffer.len() < 4096 {
            buffer.reserve(BODY_READ_SIZE);
        }
        match reader.read_buf(buffer).await {
            Ok(0) => return Err(RequestBodyError::Incomplete),
            Ok(_) => {}
            Err(error) => return Err(RequestBodyError::Io(error)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_pieces_are_written_in_order_across_partial_writes() {
        let mut gather = Gather::default();
        let pieces = ["HTTP/1.1 200 OK\r\n\r\n", "", "a", "bcdef", "ghij"];
        for piece in pieces {
            gather.push(Bytes::from_static(piece.as_bytes()));
        }
        assert_eq!(gather.pieces.len(), 4, "empty pieces are not kept");
        let mut slices = [std::io::IoSlice::new(&[]); WRITE_SLICES];
        assert_eq!(gather.chunks_vectored(&mut slices), 4);
        let mut sent = Vec::new();
        // Writes of 3 bytes at a time end inside pieces and at their edges.
        while gather.has_remaining() {
            let take = gather.chunk().len().min(3);
            sent.extend_from_slice(&gather.chunk()[..take]);
            gather.advance(take);
        }
        assert_eq!(sent, pieces.concat().as_bytes());
        assert_eq!(gather.remaining(), 0);
        assert!(gather.pieces.is_empty());
    }
    use crate::error::full_body;
    use tokio::net::TcpListener;

    const LIMITS: ConnectionLimits = ConnectionLimits {
        header_read_timeout: Duration::from_secs(2),
        send_timeout: Duration::from_secs(5),
        max_header_bytes: 16 * 1024,
        answer_format: crate::config::policy::AnswerFormat::ByAccept,
    };

    /// [`serve_connection`] with the test limits, not counted against any cap.
    fn serve_test_connection<H, F>(
        stream: TcpStream,
        peer: SocketAddr,
        handler: H,
        stop: watch::Receiver<bool>,
    ) -> impl Future<Output = ()>
    where
        H: Fn(SocketAddr, Box<Request<RequestBody>>) -> F,
        F: Future + Send + 'static,
        F::Output: Into<Answer> + Send,
    {
        serve_connection(
            stream,
            peer,
            handler,
            LIMITS,
            ConnectionSlot::uncounted(),
            stop,
        )
    }

    /// Answers `METHOD PATH body=N`, reading the body unless the path is `/ignore`.
    async fn echo(request: Box<Request<RequestBody>>) -> Response<ResponseBody> {
        let line = format!("{} {}", request.method(), request.uri().path());
        let length = if request.uri().path() == "/ignore" {
            0
        } else {
            match request.into_body().collect().await {
                Ok(collected) => collected.to_bytes().len(),
                Err(error) => return Response::new(full_body(format!("error: {error}"))),
            }
        };
        Response::new(full_body(format!("{line} body={length}")))
    }

    /// A connection served by [`serve_connection`] with [`echo`]; returns the client side
    /// and levee's stop switch.
    async fn connect() -> (TcpStream, watch::Sender<bool>) {
        connect_to(|_peer, request| echo(request)).await
    }

    /// A connection served by [`serve_connection`] with `handler`.
    async fn connect_to<H, F>(handler: H) -> (TcpStream, watch::Sender<bool>)
    where
        H: Fn(SocketAddr, Box<Request<RequestBody>>) -> F + Send + Sync + 'static,
        F: Future<Output = Response<ResponseBody>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (stop_sender, stop) = watch::channel(false);
        tokio::spawn(async move {
            if let Ok((stream, peer)) = listener.accept().await {
                serve_test_connection(stream, peer, handler, stop).await;
            }
        });
        let client = TcpStream::connect(address).await.expect("connect");
        (client, stop_sender)
    }

    /// Reads responses until `count` bodies have arrived or the connection closes.
    async fn read_responses(client: &mut TcpStream, count: usize) -> String {
        let mut seen = Vec::new();
        let mut chunk = [0u8; 4096];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while String::from_utf8_lossy(&seen).matches(" body=").count()
            + String::from_utf8_lossy(&seen).matches("error:").count()
            < count
        {
            let read = tokio::time::timeout_at(deadline, client.read(&mut chunk)).await;
            match read {
                Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                Ok(Ok(read)) => seen.extend_from_slice(&chunk[..read]),
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    }

    async fn is_closed(client: &mut TcpStream) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(3), client.read(&mut byte)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    /// A response body of the given pieces that is not ready at every other poll, so the
    /// writer both gathers ready pieces and flushes while it waits.
    struct Pieces {
        pieces: std::collections::VecDeque<Bytes>,
        polls: usize,
        exact: Option<u64>,
    }

    impl Body for Pieces {
        type Data = Bytes;
        type Error = crate::error::BoxError;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            self.polls += 1;
            if self.polls % 7 < 3 {
                cx.waker().wake_by_ref();
                return std::task::Poll::Pending;
            }
            let piece = self.pieces.pop_front();
            std::task::Poll::Ready(piece.map(|piece| Ok(http_body::Frame::data(piece))))
        }

        fn size_hint(&self) -> http_body::SizeHint {
            self.exact.map_or_else(
                http_body::SizeHint::default,
                http_body::SizeHint::with_exact,
            )
        }
    }

    /// Serves one request with a body of `pieces`, and returns the raw response.
    async fn answer_with(pieces: Vec<Bytes>, exact: bool) -> Vec<u8> {
        let total: usize = pieces.iter().map(Bytes::len).sum();
        let body = Pieces {
            pieces: pieces.into(),
            polls: 0,
            exact: exact.then_some(total as u64),
        };
        let body = std::sync::Mutex::new(Some(body));
        let (mut client, _stop) = connect_to(move |_peer, _request| {
            let body = body.lock().ok().and_then(|mut body| body.take());
            async move {
                match body {
                    Some(body) => Response::new(body.boxed_unsync()),
                    None => Response::new(full_body("again")),
                }
            }
        })
        .await;
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut raw))
            .await
            .expect("answered in time")
            .expect("read");
        raw
    }

    /// Decodes a chunked body (no extensions, no trailers).
    fn unchunk(mut body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let line_end = memchr::memmem::find(body, b"\r\n").expect("size line");
            let size_text = std::str::from_utf8(&body[..line_end]).expect("hex");
            let size = usize::from_str_radix(size_text, 16).expect("size");
            body = &body[line_end + 2..];
            if size == 0 {
                assert_eq!(body, b"\r\n", "the last chunk ends the body");
                return out;
            }
            out.extend_from_slice(&body[..size]);
            assert_eq!(&body[size..size + 2], b"\r\n");
            body = &body[size + 2..];
        }
    }

    #[tokio::test]
    async fn many_body_pieces_of_any_size_arrive_whole_and_in_order() {
        // More pieces than one vectored write takes, tiny ones among large ones.
        let pieces: Vec<Bytes> = (0..60usize)
            .map(|i| {
                let size = [1, 7, 300, 5000, 20_000, 70_000][i % 6];
                Bytes::from(vec![b'a' + (i % 26) as u8; size])
            })
            .collect();
        let expected: Vec<u8> = pieces.concat();
        for exact in [false, true] {
            let raw = answer_with(pieces.clone(), exact).await;
            let head_end = memchr::memmem::find(&raw, b"\r\n\r\n").expect("head") + 4;
            let head = String::from_utf8_lossy(&raw[..head_end]).to_lowercase();
            let body = if exact {
                assert!(
                    head.contains(&format!("content-length: {}", expected.len())),
                    "{head}"
                );
                raw[head_end..].to_vec()
            } else {
                assert!(head.contains("transfer-encoding: chunked"), "{head}");
                unchunk(&raw[head_end..])
            };
            assert!(body == expected, "exact {exact}: body differs");
        }
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order() {
        let (mut client, _stop) = connect().await;
        client
            .write_all(
                b"GET /one HTTP/1.1\r\nHost: a\r\n\r\n\
                  POST /two HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello\
                  POST /three HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n\
                  GET /four HTTP/1.1\r\nHost: a\r\n\r\n",
            )
            .await
            .expect("write");
        let answers = read_responses(&mut client, 4).await;
        let order: Vec<usize> = [
            "GET /one body=0",
            "POST /two body=5",
            "POST /three body=3",
            "GET /four body=0",
        ]
        .iter()
        .map(|line| {
            answers
                .find(line)
                .unwrap_or_else(|| panic!("{line}: {answers}"))
        })
        .collect();
        assert!(order.windows(2).all(|pair| pair[0] < pair[1]), "{answers}");
        assert_eq!(
            answers.matches("HTTP/1.1 200 OK\r\n").count(),
            4,
            "{answers}"
        );
        assert!(!answers.contains("Connection: close"), "{answers}");
    }

    #[tokio::test]
    async fn a_request_split_at_every_byte_is_read_the_same() {
        let raw: &[u8] = b"POST /split HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nwiki\r\n5;x=y\r\npedia\r\n0\r\nT: 1\r\n\r\n";
        for split in 1..raw.len() {
            let (mut client, _stop) = connect().await;
            client.write_all(&raw[..split]).await.expect("write");
            client.flush().await.expect("flush");
            tokio::task::yield_now().await;
            client.write_all(&raw[split..]).await.expect("write");
            let answer = read_responses(&mut client, 1).await;
            assert!(
                answer.contains("POST /split body=9"),
                "split at {split}: {answer}"
            );
        }
    }

    /// The head is parsed again only when a line has ended: a head trickled in one byte at a
    /// time is still read whole, and a bad line sent in pieces is still refused at its end.
    #[tokio::test]
    async fn a_head_trickled_a_byte_at_a_time_is_read_and_a_bad_line_refused() {
        let value = "v".repeat(3000);
        let good = format!("GET /trickled HTTP/1.1\r\nHost: a\r\nX-Long: {value}\r\n\r\n");
        let bad = b"GET /bad HTTP/1.1\r\nHost: a\r\nBad\x01Name: x\r\nMore: y";
        for (raw, expected) in [
            (good.as_bytes(), "GET /trickled body=0"),
            (&bad[..], " 400 "),
        ] {
            let (mut client, _stop) = connect().await;
            for byte in raw {
                client
                    .write_all(std::slice::from_ref(byte))
                    .await
                    .expect("write");
                client.flush().await.expect("flush");
                tokio::task::yield_now().await;
            }
            let answer = read_responses(&mut client, 1).await;
            assert!(answer.contains(expected), "{answer}");
        }
    }

    #[tokio::test]
    async fn expect_100_continue_is_answered_when_the_body_is_wanted() {
        let (mut client, _stop) = connect().await;
        client
            .write_all(b"POST /up HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            .await
            .expect("write");
        let mut interim = vec![0u8; CONTINUE.len()];
        tokio::time::timeout(Duration::from_secs(5), client.read_exact(&mut interim))
            .await
            .expect("100 in time")
            .expect("read");
        assert_eq!(interim, CONTINUE);
        client.write_all(b"data").await.expect("write body");
        let answer = read_responses(&mut client, 1).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("POST /up body=4"), "{answer}");

        // A handler that never reads the body: no 100, a final answer, and the connection
        // closes because the client may still send the body or not.
        let (mut client, _stop) = connect().await;
        client
            .write_all(b"POST /ignore HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            .await
            .expect("write");
        let answer = read_responses(&mut client, 1).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("Connection: close"), "{answer}");
        assert!(is_closed(&mut client).await);
    }

    #[tokio::test]
    async fn http_1_0_closes_unless_asked_to_keep_alive() {
        let (mut client, _stop) = connect().await;
        client
            .write_all(b"GET /old HTTP/1.0\r\n\r\n")
            .await
            .expect("write");
        let answer = read_responses(&mut client, 1).await;
        assert!(answer.contains("GET /old body=0"), "{answer}");
        assert!(!answer.contains("keep-alive"), "{answer}");
        assert!(is_closed(&mut client).await);

        let (mut client, _stop) = connect().await;
        client
            .write_all(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .await
            .expect("write");
        let answer = read_responses(&mut client, 1).await;
        assert!(answer.contains("Connection: keep-alive\r\n"), "{answer}");
        assert!(answer.contains("Content-Length: 13\r\n"), "{answer}");
        client
            .write_all(b"GET /b HTTP/1.0\r\n\r\n")
            .await
            .expect("write");
        assert!(read_responses(&mut client, 1)
            .await
            .contains("GET /b body=0"));
    }

    #[tokio::test]
    async fn head_responses_have_a_length_and_no_body() {
        let (mut client, _stop) = connect().await;
        client
            .write_all(b"HEAD /h HTTP/1.1\r\nHost: a\r\n\r\nGET /after HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .expect("write");
        let answers = read_responses(&mut client, 1).await;
        let (first, second) = answers.split_once("\r\n\r\n").expect("a head");
        assert!(first.contains("Content-Length: 14"), "{first}");
        assert!(
            second.starts_with("HTTP/1.1 200 OK"),
            "no body after a HEAD head: {second}"
        );
        assert!(second.contains("GET /after body=0"), "{second}");
    }

    #[tokio::test]
    async fn unread_bodies_are_drained_when_short_and_close_the_connection_when_long() {
        let (mut client, _stop) = connect().await;
        client
            .write_all(b"POST /ignore HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n0123456789GET /next HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .expect("write");
        let answers = read_responses(&mut client, 2).await;
        assert!(answers.contains("POST /ignore body=0"), "{answers}");
        assert!(answers.contains("GET /next body=0"), "{answers}");

        let (mut client, _stop) = connect().await;
        let long = DRAIN_LIMIT * 4;
        client
            .write_all(
                format!("POST /ignore HTTP/1.1\r\nHost: a\r\nContent-Length: {long}\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .expect("write");
        let answer = read_responses(&mut client, 1).await;
        assert!(answer.contains("POST /ignore body=0"), "{answer}");
        // The client never sends the promised body: after the drain time the connection closes.
        assert!(is_closed(&mut client).await);
    }

    #[tokio::test]
    async fn broken_chunked_bodies_reach_the_handler_as_errors_and_close() {
        let (mut client, _stop) = connect().await;
        client
            .write_all(b"POST /bad HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
            .await
            .expect("write");
        let answer = read_responses(&mut client, 1).await;
        assert!(
            answer.contains("error: malformed chunked request body"),
            "{answer}"
        );
        assert!(is_closed(&mut client).await);
    }

    #[tokio::test]
    async fn idle_connections_close_at_once_on_stop() {
        let (mut client, stop) = connect().await;
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .expect("write");
        assert!(read_responses(&mut client, 1).await.contains("body=0"));
        let _ = stop.send(true);
        assert!(is_closed(&mut client).await);
    }

    #[tokio::test]
    async fn a_request_in_flight_at_stop_is_answered_then_the_connection_closes() {
        let (mut client, stop) = connect().await;
        // The 100 says the handler runs and waits for the body: the request is in flight.
        client
            .write_all(
                b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
            )
            .await
            .expect("write");
        let mut interim = [0u8; CONTINUE.len()];
        client.read_exact(&mut interim).await.expect("100 continue");
        assert_eq!(&interim[..], CONTINUE);
        let _ = stop.send(true);
        client.write_all(b"abcde").await.expect("write");
        let answer = read_responses(&mut client, 1).await;
        assert!(answer.contains("POST /x body=5"), "{answer}");
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("\r\nconnection: close\r\n"),
            "{answer}"
        );
        assert!(is_closed(&mut client).await);
    }

    /// Sends on drop: tells a test that a handler's future was dropped.
    struct DropSignal(Option<oneshot::Sender<()>>);

    impl Drop for DropSignal {
        fn drop(&mut self) {
            if let Some(sender) = self.0.take() {
                let _ = sender.send(());
            }
        }
    }

    #[tokio::test]
    async fn a_client_that_leaves_cancels_its_request() {
        a_client_that_leaves_after(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n").await;
        // Waiting for 100 Continue, which the handler never asks for.
        a_client_that_leaves_after(
            b"POST /slow HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n",
        )
        .await;
    }

    /// Sends `head`, leaves, and checks that the handler's future was dropped and the
    /// connection's task ended.
    async fn a_client_that_leaves_after(head: &'static [u8]) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (_stop_sender, stop) = watch::channel(false);
        let (dropped_sender, dropped) = oneshot::channel::<()>();
        let signal = std::sync::Mutex::new(Some(dropped_sender));
        let served = tokio::spawn(async move {
            let (stream, peer) = listener.accept().await.expect("accept");
            let handler = move |_peer, request: Box<Request<RequestBody>>| {
                let guard = DropSignal(signal.lock().ok().and_then(|mut sender| sender.take()));
                async move {
                    let _guard = guard;
                    // Held, body unread, as a request waiting for its upstream is.
                    let _request = request;
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Response::new(full_body("too late"))
                }
            };
            serve_test_connection(stream, peer, handler, stop).await;
        });
        let mut client = TcpStream::connect(address).await.expect("connect");
        client.write_all(head).await.expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(client);
        tokio::time::timeout(Duration::from_secs(3), dropped)
            .await
            .expect("the handler was cancelled")
            .expect("signal");
        tokio::time::timeout(Duration::from_secs(3), served)
            .await
            .expect("the connection task ended")
            .expect("no panic");
    }

    #[tokio::test]
    async fn a_waiting_connection_is_a_small_task() {
        let (_client, server) = {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let client = TcpStream::connect(listener.local_addr().expect("address"))
                .await
                .expect("connect");
            (client, listener.accept().await.expect("accept"))
        };
        let (_stop_sender, stop) = watch::channel(false);
        let (stream, peer) = server;
        let connection = serve_test_connection(stream, peer, |_peer, request| echo(request), stop);
        // The task's whole state while idle: everything per request is boxed on demand.
        let size = std::mem::size_of_val(&connection);
        assert!(size < 2048, "connection future is {size} bytes");
    }
}
