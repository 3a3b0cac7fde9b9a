//! levee's own HTTP/1.1 upstream client (`src/proxy/client.rs`), pinned down on the wire: a
//! real levee in front of a scripted raw TCP backend that reads request heads and bodies
//! and writes back exact bytes, counting its connections.
//!
//! What is covered: keep-alive reuse and its limits, the retry of a bodiless idempotent
//! request on a reused connection the upstream had just closed (and no retry otherwise),
//! every response framing, the framings that must end a connection (both `Content-Length`
//! and `Transfer-Encoding`, bytes past the length, `Connection: close`, HTTP/1.0), interim
//! 1xx answers, request body framing, early answers to uploads, malformed heads (502 with
//! the reason), bodies cut off mid-way (an aborted response, never a clean short one), and
//! bytes sent right behind a 101.
//!
//! Each test stops what it starts: levee through [`stop`] (the harness's `Levee` has no
//! `Drop`; a test that fails earlier leaves it to the test's runtime, which ends with the
//! test), the backend and all its connections when its `Scripted` is dropped.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The longest any single exchange may take before the test calls it hung.
const WITHIN: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// The scripted backend

/// One request as the backend read it off the wire.
#[derive(Debug, Clone)]
struct Seen {
    /// Which connection carried it: 1 for the first one accepted, and so on.
    conn: usize,
    /// Its place on that connection: 0 for the first request.
    nth: usize,
    method: String,
    target: String,
    /// Header fields, names lowercased, in order.
    headers: Vec<(String, String)>,
    /// The body bytes exactly as they came (chunk framing included).
    raw_body: Vec<u8>,
    /// The body once its framing is removed.
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(field, _)| field == name)
            .map(|(_, value)| value.as_str())
            .collect()
    }

    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("/")
    }
}

/// What the backend does after writing its bytes.
#[derive(Debug, Clone)]
enum Then {
    /// Reads the next request on the same connection.
    Keep,
    /// Closes the connection (FIN).
    Close,
    /// Resets the connection (RST, `SO_LINGER` 0).
    Reset,
    /// Echoes whatever arrives next, byte for byte, until the peer closes.
    Echo,
    /// Writes more bytes when the test says so, then reads the next request.
    Later(Arc<Later>),
    /// Keeps the connection open and reads nothing more.
    Hold,
    /// Reads and discards everything until the peer closes (nginx's lingering close).
    Drain,
}

/// Bytes the backend writes on a connection when the test tells it to.
#[derive(Debug)]
struct Later {
    bytes: Vec<u8>,
    go: tokio::sync::Notify,
    written: std::sync::atomic::AtomicBool,
}

impl Later {
    fn new(bytes: &[u8]) -> Arc<Later> {
        Arc::new(Later {
            bytes: bytes.to_vec(),
            go: tokio::sync::Notify::new(),
            written: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Lets the backend write the bytes and waits until it has.
    async fn write_now(&self) {
        self.go.notify_one();
        eventually(WITHIN, "the backend to write its late bytes", || async {
            self.written.load(Ordering::SeqCst)
        })
        .await;
    }
}

/// The backend's answer to one request: these writes, in order, then `then`.
struct Reply {
    writes: Vec<Vec<u8>>,
    then: Then,
}

impl Reply {
    fn keep(bytes: impl Into<Vec<u8>>) -> Reply {
        Reply {
            writes: vec![bytes.into()],
            then: Then::Keep,
        }
    }

    fn close(bytes: impl Into<Vec<u8>>) -> Reply {
        Reply {
            writes: vec![bytes.into()],
            then: Then::Close,
        }
    }

    fn reset(bytes: impl Into<Vec<u8>>) -> Reply {
        Reply {
            writes: vec![bytes.into()],
            then: Then::Reset,
        }
    }

    fn pieces(writes: &[&[u8]], then: Then) -> Reply {
        Reply {
            writes: writes.iter().map(|piece| piece.to_vec()).collect(),
            then,
        }
    }
}

/// `200 OK` with `Content-Length` and `body`.
fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

type Script = dyn Fn(&Seen) -> Reply + Send + Sync;

/// A raw HTTP/1.1 backend on a loopback port that answers each request as `script` says,
/// and records every connection and request. Dropping it stops it and all its connections.
struct Scripted {
    addr: SocketAddr,
    accepts: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Scripted {
    async fn start(script: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepts = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let script: Arc<Script> = Arc::new(script);
        let task = {
            let accepts = accepts.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                // Owned by this task: aborting it aborts every connection too.
                let mut connections = tokio::task::JoinSet::new();
                loop {
                    while connections.try_join_next().is_some() {}
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let conn = accepts.fetch_add(1, Ordering::SeqCst) + 1;
                    connections.spawn(serve_connection(stream, conn, script.clone(), seen.clone()));
                }
            })
        };
        Scripted {
            addr,
            accepts,
            seen,
            task,
        }
    }

    fn accepts(&self) -> usize {
        self.accepts.load(Ordering::SeqCst)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }

    fn last(&self) -> Seen {
        self.seen()
            .last()
            .cloned()
            .expect("the backend saw a request")
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    conn: usize,
    script: Arc<Script>,
    seen: Arc<Mutex<Vec<Seen>>>,
) {
    // Every write goes out at once, as its own segment (no Nagle delay on small pieces).
    let _ = stream.set_nodelay(true);
    let mut buffer = Vec::new();
    for nth in 0.. {
        let Some(request) = read_request(&mut stream, &mut buffer, conn, nth).await else {
            return;
        };
        seen.lock().expect("seen").push(request.clone());
        let reply = script(&request);
        for piece in &reply.writes {
            if stream.write_all(piece).await.is_err() || stream.flush().await.is_err() {
                return;
            }
        }
        match reply.then {
            Then::Keep => {}
            Then::Close => {
                let _ = stream.shutdown().await;
                return;
            }
            Then::Reset => {
                let _ = stream.set_zero_linger();
                return;
            }
            Then::Hold => {
                std::future::pending::<()>().await;
            }
            Then::Drain => {
                let mut piece = vec![0u8; 64 * 1024];
                while let Ok(1..) = stream.read(&mut piece).await {}
                return;
            }
            Then::Later(later) => {
                later.go.notified().await;
                if stream.write_all(&later.bytes).await.is_err() {
                    return;
                }
                later.written.store(true, Ordering::SeqCst);
            }
            Then::Echo => {
                if !buffer.is_empty() && stream.write_all(&buffer).await.is_err() {
                    return;
                }
                let mut piece = [0u8; 4096];
                loop {
                    match stream.read(&mut piece).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if stream.write_all(&piece[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Reads one request (head and body) off `stream`; `None` when the peer closed first.
async fn read_request(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    conn: usize,
    nth: usize,
) -> Option<Seen> {
    let head_end = loop {
        if let Some(at) = find(buffer, b"\r\n\r\n") {
            break at + 4;
        }
        if !read_more(stream, buffer).await {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    buffer.drain(..head_end);
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or("").split(' ');
    let method = request_line.next().unwrap_or("").to_string();
    let target = request_line.next().unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter(|line| !line.is_empty())
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    let field = |name: &str| {
        headers
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| value.clone())
    };
    let early = target.starts_with("/early");
    let (raw_body, body) = if early {
        // Answered before its body is read: the body is left on the connection.
        (Vec::new(), Vec::new())
    } else if field("transfer-encoding")
        .is_some_and(|coding| coding.to_ascii_lowercase().contains("chunked"))
    {
        loop {
            match decode_chunked(buffer) {
                Ok(Some((body, used))) => {
                    let raw: Vec<u8> = buffer.drain(..used).collect();
                    break (raw, body);
                }
                Ok(None) => {
                    if !read_more(stream, buffer).await {
                        return None;
                    }
                }
                Err(error) => panic!("conn {conn}: broken chunked request body ({error})"),
            }
        }
    } else {
        let length: usize = field("content-length")
            .map_or(0, |value| value.parse().expect("a numeric content-length"));
        while buffer.len() < length {
            if !read_more(stream, buffer).await {
                return None;
            }
        }
        let raw: Vec<u8> = buffer.drain(..length).collect();
        (raw.clone(), raw)
    };
    Some(Seen {
        conn,
        nth,
        method,
        target,
        headers,
        raw_body,
        body,
    })
}

async fn read_more(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> bool {
    let mut piece = [0u8; 16 * 1024];
    match stream.read(&mut piece).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buffer.extend_from_slice(&piece[..n]);
            true
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// Decodes a whole chunked body at the start of `raw`: the data and how many bytes it took,
/// `Ok(None)` while it is incomplete, `Err` when the framing is broken.
fn decode_chunked(raw: &[u8]) -> Result<Option<(Vec<u8>, usize)>, String> {
    let mut at = 0;
    let mut data = Vec::new();
    loop {
        let Some(line) = find(&raw[at..], b"\r\n") else {
            return Ok(None);
        };
        let size_line = String::from_utf8_lossy(&raw[at..at + line]).into_owned();
        let digits = size_line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(digits, 16)
            .map_err(|_| format!("chunk size line {size_line:?}"))?;
        at += line + 2;
        if size == 0 {
            // Trailer fields, then the empty line.
            loop {
                let Some(line) = find(&raw[at..], b"\r\n") else {
                    return Ok(None);
                };
                at += line + 2;
                if line == 0 {
                    return Ok(Some((data, at)));
                }
            }
        }
        if raw.len() < at + size + 2 {
            return Ok(None);
        }
        data.extend_from_slice(&raw[at..at + size]);
        if &raw[at + size..at + size + 2] != b"\r\n" {
            return Err(format!("no CRLF after a {size}-byte chunk"));
        }
        at += size + 2;
    }
}

// ---------------------------------------------------------------------------------------
// levee and its client

/// levee with one upstream `app` (the scripted backend): its breaker never trips (the tests
/// provoke many upstream failures on purpose) and its drain is instant. Its log is captured
/// (see `logged_502`).
async fn levee_for(backend: &Scripted, upstream_extra: &str) -> Levee {
    levee_with(backend, "", upstream_extra).await
}

async fn levee_with(backend: &Scripted, server_extra: &str, upstream_extra: &str) -> Levee {
    levee_log();
    let response_timeout = if upstream_extra.contains("response_timeout") {
        ""
    } else {
        "response_timeout = \"5s\"\n"
    };
    Levee::start(&policy_for(
        backend.addr,
        &format!("access_log = false\ndrain = \"0s\"\nshutdown_timeout = \"2s\"\n{server_extra}"),
        &format!(
            "{response_timeout}breaker = {{ consecutive_failures = 0, min_requests = 1000000 }}\n{upstream_extra}"
        ),
    ))
    .await
}

/// Shuts levee down and waits until it has stopped.
async fn stop(mut levee: Levee) {
    let running = levee.running.take().expect("running");
    running.shutdown();
    tokio::time::timeout(WITHIN, running.wait())
        .await
        .expect("levee stops");
}

/// What a client got: the head, and the body or why it did not end cleanly.
struct Fetched {
    status: u16,
    headers: HeaderMap,
    body: Result<Bytes, String>,
}

impl Fetched {
    fn text(&self) -> String {
        match &self.body {
            Ok(body) => String::from_utf8_lossy(body).into_owned(),
            Err(error) => format!("<body aborted: {error}>"),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }
}

/// Sends `request` through levee and reads the whole answer; a hang fails the test.
async fn fetch(request: Request<TestBody>) -> Fetched {
    let what = format!("{} {}", request.method(), request.uri());
    let exchange = async {
        let response = client()
            .request(request)
            .await
            .unwrap_or_else(|error| panic!("{what}: no response head: {error}"));
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map(|collected| collected.to_bytes())
            .map_err(|error| format!("{error:?}"));
        Fetched {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        }
    };
    tokio::time::timeout(WITHIN, exchange)
        .await
        .unwrap_or_else(|_| panic!("levee did not answer in time"))
}

async fn call(levee: &Levee, method: &str, path: &str) -> Fetched {
    fetch(
        Request::builder()
            .method(method)
            .uri(levee.url(path))
            .body(full(Bytes::new()))
            .expect("request"),
    )
    .await
}

/// A request body of unknown length: the client sends it chunk-encoded.
fn streamed(pieces: &[Vec<u8>]) -> TestBody {
    let frames: Vec<Result<Frame<Bytes>, BoxError>> = pieces
        .iter()
        .map(|piece| Ok(Frame::data(Bytes::from(piece.clone()))))
        .collect();
    StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
}

// ---------------------------------------------------------------------------------------
// 1. Keep-alive

#[tokio::test]
async fn sequential_requests_share_one_keep_alive_connection() {
    let backend = Scripted::start(|seen| Reply::keep(ok(&format!("answer {}", seen.target)))).await;
    let levee = levee_for(&backend, "").await;

    for n in 0..50 {
        let path = format!("/page/{n}");
        let answer = call(&levee, "GET", &path).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(answer.text(), format!("answer {path}"));
    }
    let seen = backend.seen();
    assert_eq!(seen.len(), 50, "every request reached the backend once");
    assert!(
        backend.accepts() <= 2,
        "50 sequential requests took {} connections (expected 1)",
        backend.accepts()
    );
    // In order, one after the other on the connection(s).
    for (n, request) in seen.iter().enumerate() {
        assert_eq!(request.target, format!("/page/{n}"));
        assert_eq!(request.method, "GET");
    }
    stop(levee).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_never_open_more_connections_than_are_in_flight() {
    let backend = Scripted::start(|_| Reply::keep(ok("fine"))).await;
    let levee = levee_for(&backend, "").await;

    let clients = 8;
    let answers = futures_util::future::join_all((0..clients).map(|_| {
        let url = levee.url("/concurrent");
        async move {
            let mut statuses = Vec::new();
            for _ in 0..25 {
                let request = Request::get(url.as_str())
                    .body(full(Bytes::new()))
                    .expect("request");
                let answer = fetch(request).await;
                statuses.push((answer.status, answer.text()));
            }
            statuses
        }
    }))
    .await;
    for (status, body) in answers.into_iter().flatten() {
        assert_eq!((status, body.as_str()), (200, "fine"));
    }
    assert_eq!(backend.seen().len(), clients * 25);
    assert!(
        backend.accepts() <= clients,
        "{} connections for {clients} requests in flight at most",
        backend.accepts()
    );
    stop(levee).await;
}

#[tokio::test]
async fn pool_max_idle_zero_keeps_no_connection() {
    let backend = Scripted::start(|_| Reply::keep(ok("fine"))).await;
    let levee = levee_for(&backend, "pool_max_idle = 0").await;

    for _ in 0..10 {
        assert_eq!(call(&levee, "GET", "/").await.text(), "fine");
    }
    assert_eq!(
        backend.accepts(),
        10,
        "with pool_max_idle = 0 every request has its own connection"
    );
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// 2. The keep-alive race: an upstream that closes a connection levee is about to reuse

#[tokio::test]
async fn an_upstream_that_closes_after_every_answer_still_serves_every_get() {
    // The upstream closes right behind each answer without saying `Connection: close`.
    let backend = Scripted::start(|_| Reply::close(ok("fine"))).await;
    let levee = levee_for(&backend, "").await;

    for n in 0..100 {
        let answer = call(&levee, "GET", &format!("/race/{n}")).await;
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (200, "fine"),
            "request {n}"
        );
    }
    let seen = backend.seen();
    assert_eq!(seen.len(), 100, "no request was lost or sent twice");
    assert!(seen.iter().all(|request| request.nth == 0));
    assert_eq!(
        backend.accepts(),
        100,
        "a closed connection is never reused"
    );
    stop(levee).await;
}

#[tokio::test]
async fn a_get_on_a_connection_closed_as_it_arrives_is_sent_again_once() {
    // Each connection answers one request; the next one on it is read and then the
    // connection is closed (FIN) or reset (RST) unanswered: the race, every time.
    for then in [Then::Close, Then::Reset] {
        let mode = then.clone();
        let backend = Scripted::start(move |seen| match (seen.nth, seen.method.as_str()) {
            (0, "HEAD") => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 42\r\n\r\n"),
            (0, _) => Reply::keep(ok(&format!("answer {}", seen.target))),
            _ => Reply {
                writes: Vec::new(),
                then: mode.clone(),
            },
        })
        .await;
        let levee = levee_for(&backend, "").await;

        for n in 0..100 {
            let method = if n % 10 == 9 { "HEAD" } else { "GET" };
            let path = format!("/race/{n}");
            let answer = call(&levee, method, &path).await;
            assert_eq!(
                answer.status,
                200,
                "{then:?} {method} {n}: {}",
                answer.text()
            );
            if method == "GET" {
                assert_eq!(answer.text(), format!("answer {path}"), "{then:?} {n}");
            }
        }
        // Request 0 opens connection 1; every later one reaches a reused connection first
        // (which closes) and then a fresh one (which answers).
        let seen = backend.seen();
        assert_eq!(backend.accepts(), 100, "{then:?}");
        assert_eq!(seen.len(), 199, "{then:?}: each request sent at most twice");
        for n in 1..100 {
            let path = format!("/race/{n}");
            let sent: Vec<&Seen> = seen.iter().filter(|s| s.target == path).collect();
            assert_eq!(sent.len(), 2, "{then:?} {path}");
            assert_eq!((sent[0].nth, sent[1].nth), (1, 0), "{then:?} {path}");
        }
        stop(levee).await;
    }
}

#[tokio::test]
async fn a_request_sent_again_goes_on_a_new_connection_not_the_next_kept_one() {
    // An upstream that closes its kept connections together (its keep-alive timeout, a
    // restart): the request that found the first one closed is sent again on a new
    // connection, not on the next kept one, which the upstream closed as well.
    let first = Later::new(&ok("kept"));
    let second = Later::new(&ok("kept"));
    let (one, two) = (first.clone(), second.clone());
    let backend = Scripted::start(move |seen| match (seen.conn, seen.nth) {
        (1, 0) => Reply::pieces(&[], Then::Later(one.clone())),
        (2, 0) => Reply::pieces(&[], Then::Later(two.clone())),
        (1 | 2, _) => Reply::pieces(&[], Then::Close),
        _ => Reply::keep(ok("new")),
    })
    .await;
    let levee = levee_for(&backend, "").await;
    // Two requests at once: two connections, both kept once answered.
    let answer_both = async {
        eventually(WITHIN, "both requests at the backend", || async {
            backend.seen().len() == 2
        })
        .await;
        first.write_now().await;
        second.write_now().await;
    };
    let (one, two, ()) = tokio::join!(
        call(&levee, "GET", "/one"),
        call(&levee, "GET", "/two"),
        answer_both
    );
    assert_eq!((one.text(), two.text()), ("kept".into(), "kept".into()));

    let third = call(&levee, "GET", "/three").await;
    assert_eq!(third.status, 200, "{}", third.text());
    assert_eq!(third.text(), "new");
    assert_eq!(backend.last().conn, 3);
    stop(levee).await;
}

#[tokio::test]
async fn a_request_that_must_not_be_repeated_is_not_sent_again() {
    // As above, but for a POST (not idempotent): the upstream may have acted on it, so levee
    // answers 502 rather than send it twice.
    let backend = Scripted::start(|seen| {
        if seen.nth == 0 {
            Reply::keep(ok("fine"))
        } else {
            Reply::close(Vec::new())
        }
    })
    .await;
    let levee = levee_for(&backend, "").await;

    let cases: [(&str, &str, &str); 2] = [
        ("POST", "/post-empty", ""),
        ("POST", "/post-form", "a=1&b=2"),
    ];
    for (method, path, body) in cases {
        // Warm a pooled connection, then send on it.
        assert_eq!(call(&levee, "GET", "/warm").await.text(), "fine");
        let answer = fetch(
            Request::builder()
                .method(method)
                .uri(levee.url(path))
                .body(full(body.to_string()))
                .expect("request"),
        )
        .await;
        assert_eq!(answer.status, 502, "{method} {path}: {}", answer.text());
        logged_502(path, &["closed the connection before answering"]);
        let sent = backend
            .seen()
            .into_iter()
            .filter(|seen| seen.target == path)
            .count();
        assert_eq!(sent, 1, "{method} {path} reached the upstream exactly once");
    }
    assert_eq!(call(&levee, "GET", "/after").await.text(), "fine");

    // A PUT is idempotent, and its body was read whole before it was sent (it is short): it
    // is sent again, body and all, as a GET would be. Chunked as the client sent it, too.
    for (path, chunked) in [("/put-body", false), ("/put-chunked", true)] {
        assert_eq!(call(&levee, "GET", "/warm").await.text(), "fine");
        let body = if chunked {
            streamed(&[b"new ".to_vec(), b"content".to_vec()])
        } else {
            full("new content")
        };
        let answer = fetch(
            Request::builder()
                .method("PUT")
                .uri(levee.url(path))
                .body(body)
                .expect("request"),
        )
        .await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.text());
        let sent: Vec<Seen> = backend
            .seen()
            .into_iter()
            .filter(|seen| seen.target == path)
            .collect();
        assert_eq!(sent.len(), 2, "{path}: sent again once");
        // The same content (its chunks may be cut otherwise).
        let content = |seen: &Seen| {
            if chunked {
                decode_chunked(&seen.raw_body)
                    .ok()
                    .flatten()
                    .map(|(content, _)| content)
            } else {
                Some(seen.raw_body.clone())
            }
        };
        assert_eq!(content(&sent[0]), Some(b"new content".to_vec()), "{path}");
        assert_eq!(
            content(&sent[0]),
            content(&sent[1]),
            "{path}: the same body"
        );
    }
    stop(levee).await;
}

#[tokio::test]
async fn a_close_after_an_interim_answer_is_not_taken_for_the_pool_race() {
    // The upstream had the request (it sent 103 or 100) and then closed: a GET on a reused
    // connection is not sent again, as it would be after a close with nothing read.
    let backend = Scripted::start(|seen| match (seen.nth, seen.path()) {
        (0, _) => Reply::keep(ok("fine")),
        (_, "/hints-then-close") => Reply::close(
            "HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n".as_bytes(),
        ),
        (_, _) => Reply::close("HTTP/1.1 100 Continue\r\n\r\n".as_bytes()),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for path in ["/hints-then-close", "/continue-then-close"] {
        assert_eq!(call(&levee, "GET", "/warm").await.text(), "fine");
        let answer = call(&levee, "GET", path).await;
        assert_eq!(answer.status, 502, "{path}: {}", answer.text());
        let sent = backend
            .seen()
            .into_iter()
            .filter(|seen| seen.target == path)
            .count();
        assert_eq!(sent, 1, "{path} reached the upstream exactly once");
        logged_502(path, &["after an interim (1xx) answer"]);
    }
    stop(levee).await;
}

#[tokio::test]
async fn a_page_that_sets_a_1xx_status_as_its_own_is_a_502_that_leaves_the_breaker_closed() {
    // `http_response_code(103)` in PHP: the app's nginx sends the page as a 103 head followed
    // by its body, with no final head. One page's doing: it must not cut every page off.
    let backend = Scripted::start(|seen| match seen.path() {
        "/own-103" => Reply::close(
            "HTTP/1.1 103 Early Hints\r\nContent-Type: text/html\r\n\r\n<html>the page</html>"
                .as_bytes(),
        ),
        "/own-101" => Reply::close(
            "HTTP/1.1 101 Switching Protocols\r\nContent-Type: text/html\r\n\r\n<html>the page</html>"
                .as_bytes(),
        ),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    levee_log();
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false\n",
        "response_timeout = \"5s\"\nbreaker = { consecutive_failures = 2, failing_clients = 1 }\n",
    ))
    .await;
    for path in ["/own-103", "/own-101"] {
        for _ in 0..4 {
            let answer = call(&levee, "GET", path).await;
            assert_eq!(answer.status, 502, "{path}: {}", answer.text());
        }
    }
    logged_502(
        "/own-103",
        &["after an interim (1xx) answer", "sets a 1xx status"],
    );
    logged_502(
        "/own-101",
        &["101 Switching Protocols to a request that asked for no upgrade"],
    );
    assert_eq!(
        call(&levee, "GET", "/other").await.text(),
        "fine",
        "the breaker stayed closed"
    );
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// 3. Response framings

#[tokio::test]
async fn every_response_framing_reaches_the_client_intact() {
    let backend = Scripted::start(|seen| match (seen.method.as_str(), seen.path()) {
        (_, "/length") => Reply::keep(ok("hello world")),
        (_, "/empty") => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
        (_, "/chunked") => Reply::keep(
            // Several chunks, an extension, an upper-case size and a trailer.
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;name=value\r\nhello\r\n1\r\n,\r\n6\r\n world\r\nA\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n",
        ),
        (_, "/chunked-pieces") => Reply::pieces(
            &[
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                b"4\r\nab",
                b"cd\r\n",
                b"3\r\nefg\r\n",
                b"0\r\n",
                b"\r\n",
            ],
            Then::Keep,
        ),
        (_, "/until-close") => {
            Reply::close("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nthe body ends when the connection does")
        }
        ("HEAD", "/head") => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"),
        (_, "/no-content") => Reply::keep("HTTP/1.1 204 No Content\r\nX-Kind: none\r\n\r\n"),
        (_, "/not-modified") => {
            Reply::keep("HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\n\r\n")
        }
        _ => Reply::keep("HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found"),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    let cases: [(&str, &str, u16, &str); 8] = [
        ("GET", "/length", 200, "hello world"),
        ("GET", "/chunked", 200, "hello, world0123456789"),
        ("GET", "/chunked-pieces", 200, "abcdefg"),
        ("GET", "/empty", 200, ""),
        ("HEAD", "/head", 200, ""),
        ("GET", "/no-content", 204, ""),
        ("GET", "/not-modified", 304, ""),
        (
            "GET",
            "/until-close",
            200,
            "the body ends when the connection does",
        ),
    ];
    for (method, path, status, body) in cases {
        let answer = call(&levee, method, path).await;
        assert_eq!(answer.status, status, "{method} {path}: {}", answer.text());
        assert_eq!(
            answer.body.as_deref(),
            Ok(body.as_bytes()),
            "{method} {path}"
        );
        match path {
            "/head" => assert_eq!(
                answer.header("content-length"),
                Some("1234"),
                "HEAD keeps the length a GET would get"
            ),
            "/no-content" => assert_eq!(answer.header("x-kind"), Some("none")),
            "/not-modified" => assert_eq!(answer.header("etag"), Some("\"v1\"")),
            _ => {}
        }
        // Whatever the framing, the next request is answered properly.
        let next = call(&levee, "GET", "/length").await;
        assert_eq!(
            (next.status, next.text().as_str()),
            (200, "hello world"),
            "after {method} {path}"
        );
    }
    stop(levee).await;
}

#[tokio::test]
async fn a_pass_through_relays_the_upstream_fields_as_it_sent_them() {
    let fields = "Server: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 10:00:00 GMT\r\n\
                  Content-Type: text/html; charset=UTF-8\r\nContent-Length: 5\r\n\
                  Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n\
                  X-Powered-By: PHP/8.2.7\r\nSet-Cookie: a=1; path=/\r\nSet-Cookie: b=2\r\n\
                  Cache-Control: no-store\r\n";
    let backend = Scripted::start(move |seen| match seen.path() {
        // A line ending in a bare LF: parsed, and sent on with CRLF.
        "/bare-lf" => Reply::keep("HTTP/1.1 200 OK\r\nX-A: 1\nContent-Length: 2\r\n\r\nok"),
        _ => Reply::keep(format!("HTTP/1.1 200 OK\r\n{fields}\r\nhello")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    let raw = raw_exchange(
        levee.public,
        b"GET /page HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        WITHIN,
    )
    .await;
    let (head, body) = raw.split_once("\r\n\r\n").expect("a whole response");
    assert_eq!(body, "hello");
    let lines: Vec<&str> = head.split("\r\n").collect();
    // The upstream's own lines, spelled and ordered as it sent them, and nothing hop-by-hop.
    let kept = [
        "Server: nginx/1.22.1",
        "Date: Tue, 01 Dec 2026 10:00:00 GMT",
        "Content-Type: text/html; charset=UTF-8",
        "X-Powered-By: PHP/8.2.7",
        "Set-Cookie: a=1; path=/",
        "Set-Cookie: b=2",
        "Cache-Control: no-store",
    ];
    let relayed: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|line| kept.contains(line))
        .collect();
    assert_eq!(relayed, kept, "{head}");
    let lower = head.to_ascii_lowercase();
    assert_eq!(lower.matches("\r\ndate:").count(), 1, "{head}");
    assert_eq!(lower.matches("content-length: 5").count(), 1, "{head}");
    assert!(!lower.contains("keep-alive"), "{head}");
    assert!(lower.contains("\r\nconnection: close"), "{head}");

    let raw = raw_exchange(
        levee.public,
        b"GET /bare-lf HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        WITHIN,
    )
    .await;
    assert!(raw.ends_with("\r\n\r\nok"), "{raw}");
    assert!(!raw.replace("\r\n", "").contains('\n'), "{raw}");
    assert!(raw.to_ascii_lowercase().contains("\r\nx-a: 1\r\n"), "{raw}");
    stop(levee).await;
}

#[tokio::test]
async fn framings_that_end_cleanly_keep_the_connection() {
    let backend = Scripted::start(|seen| match seen.path() {
        "/chunked" => Reply::keep(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Trailer: t\r\n\r\n",
        ),
        "/empty" => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
        "/head" => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"),
        "/no-content-length-0" => {
            Reply::keep("HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
        }
        "/not-modified-with-length" => {
            Reply::keep("HTTP/1.1 304 Not Modified\r\nContent-Length: 1234\r\n\r\n")
        }
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for (method, path) in [
        ("GET", "/length"),
        ("GET", "/chunked"),
        ("GET", "/empty"),
        ("HEAD", "/head"),
        ("GET", "/no-content-length-0"),
        ("GET", "/not-modified-with-length"),
    ] {
        let answer = call(&levee, method, path).await;
        assert!(answer.body.is_ok(), "{method} {path}: {}", answer.text());
        let before = backend.last();
        assert_eq!(call(&levee, "GET", "/next").await.text(), "fine");
        let after = backend.last();
        assert_eq!(
            after.conn, before.conn,
            "the connection is reused after {method} {path}"
        );
    }
    assert_eq!(backend.accepts(), 1);
    stop(levee).await;
}

#[tokio::test]
async fn bodiless_answers_without_a_length_keep_the_connection() {
    // RFC 9112 6.3: any answer to HEAD, and a 1xx, 204 or 304 answer, ends with its head;
    // what follows on the connection is the next response. nginx clears Content-Length on
    // 204 and 304, so every such answer from it costs levee a new upstream connection.
    let backend = Scripted::start(|seen| match seen.path() {
        "/no-content" => Reply::keep("HTTP/1.1 204 No Content\r\n\r\n"),
        "/not-modified" => Reply::keep("HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\n\r\n"),
        "/head" => Reply::keep("HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n"),
        "/head-sized" => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n"),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    // A HEAD answer says nothing of the GET body's length unless the upstream said it: no
    // made-up `Content-Length: 0` for a page a GET gets thousands of bytes of (RFC 9110 8.6).
    let answer = call(&levee, "HEAD", "/head").await;
    assert_eq!(
        answer.headers.get("content-length"),
        None,
        "{:?}",
        answer.headers
    );
    let answer = call(&levee, "HEAD", "/head-sized").await;
    assert_eq!(
        answer
            .headers
            .get("content-length")
            .and_then(|v| v.to_str().ok()),
        Some("5000")
    );

    let mut not_reused = Vec::new();
    for (method, path, status) in [
        ("GET", "/no-content", 204),
        ("GET", "/not-modified", 304),
        ("HEAD", "/head", 200),
    ] {
        assert_eq!(call(&levee, "GET", "/warm").await.text(), "fine");
        let answer = call(&levee, method, path).await;
        assert_eq!(
            (answer.status, answer.body.as_deref()),
            (status, Ok(&b""[..]))
        );
        let before = backend.last();
        assert_eq!(call(&levee, "GET", "/next").await.text(), "fine");
        if backend.last().conn != before.conn {
            not_reused.push(format!("{method} {path} ({status})"));
        }
    }
    assert!(
        not_reused.is_empty(),
        "a new upstream connection was opened after: {not_reused:?}"
    );
    stop(levee).await;
}

#[tokio::test]
async fn answers_that_end_their_connection_are_not_reused() {
    // Each of these answers is complete, but the connection must not carry another request.
    // The backend itself would keep every connection open and answer on it.
    let backend = Scripted::start(|seen| match seen.path() {
        "/connection-close" => {
            Reply::keep("HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 4\r\n\r\nbye.")
        }
        "/http-1-0" => Reply::keep("HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nold"),
        // Answers that must have no body, sent with one anyway.
        "/head-with-body" => Reply::keep(ok("a body for HEAD")),
        "/no-content-with-body" => {
            Reply::keep("HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello")
        }
        // A 204 that announces a body it has not sent yet: whatever comes later must not
        // answer the next request.
        "/no-content-with-length" => {
            Reply::keep("HTTP/1.1 204 No Content\r\nContent-Length: 44\r\n\r\n")
        }
        "/no-content-chunked" => {
            Reply::keep("HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n")
        }
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for (method, path, status, body) in [
        ("GET", "/connection-close", 200, "bye."),
        ("GET", "/http-1-0", 200, "old"),
        ("HEAD", "/head-with-body", 200, ""),
        ("GET", "/no-content-with-body", 204, ""),
        ("GET", "/no-content-with-length", 204, ""),
        ("GET", "/no-content-chunked", 204, ""),
    ] {
        assert_eq!(call(&levee, "GET", "/warm").await.text(), "fine");
        let answer = call(&levee, method, path).await;
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (status, body),
            "{method} {path}"
        );
        let before = backend.last();
        for n in 0..3 {
            let next = call(&levee, "GET", &format!("/next/{n}")).await;
            assert_eq!(
                (next.status, next.text().as_str()),
                (200, "fine"),
                "after {method} {path}"
            );
            assert_ne!(
                backend.last().conn,
                before.conn,
                "the connection that answered {method} {path} was reused"
            );
        }
    }
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// 4 and 5. Framing that cannot be trusted

#[tokio::test]
async fn content_length_with_chunked_is_read_as_chunked_and_the_connection_dropped() {
    let backend = Scripted::start(|seen| match seen.path() {
        "/both" => Reply::keep(
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        ),
        "/both-reversed" => Reply::keep(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 100\r\n\r\n4\r\nbody\r\n0\r\n\r\n",
        ),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for (path, body) in [("/both", "hello world"), ("/both-reversed", "body")] {
        assert_eq!(call(&levee, "GET", "/warm").await.text(), "fine");
        let warm = backend.last();
        let answer = call(&levee, "GET", path).await;
        assert_eq!(
            (answer.status, answer.body.as_deref()),
            (200, Ok(body.as_bytes())),
            "{path}: {}",
            answer.text()
        );
        let asked = backend.last();
        assert_eq!(
            asked.conn, warm.conn,
            "{path} went over the pooled connection"
        );
        if let Some(length) = answer.header("content-length") {
            assert_eq!(
                length,
                body.len().to_string(),
                "{path}: the upstream's Content-Length is not passed on"
            );
        }
        assert_eq!(call(&levee, "GET", "/next").await.text(), "fine");
        assert_ne!(
            backend.last().conn,
            asked.conn,
            "{path}: the connection is not trusted after a response with both fields"
        );
    }
    stop(levee).await;
}

#[tokio::test]
async fn bytes_past_the_content_length_are_dropped_with_the_connection() {
    // Bytes that come after the answer is complete, before the connection is used again.
    let late = Later::new(b"LATE");
    let smuggled_late = Later::new(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled");
    let laters = [
        ("/extra-later", late.clone()),
        ("/smuggle-later", smuggled_late.clone()),
    ];
    let backend = Scripted::start(move |seen| match seen.path() {
        // In the same write as the body.
        "/extra" => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloEXTRA BYTES"),
        // A whole second response behind the first one: it must never answer anybody.
        "/smuggle" => Reply::keep(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled",
        ),
        // In a write of their own, once the client has its answer.
        "/extra-later" => Reply {
            writes: vec![b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec()],
            then: Then::Later(late.clone()),
        },
        "/smuggle-later" => Reply {
            writes: vec![b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec()],
            then: Then::Later(smuggled_late.clone()),
        },
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for path in ["/extra", "/smuggle", "/extra-later", "/smuggle-later"] {
        assert_eq!(call(&levee, "GET", "/warm").await.text(), "fine");
        let answer = call(&levee, "GET", path).await;
        assert_eq!(
            (answer.status, answer.body.as_deref()),
            (200, Ok(&b"hello"[..])),
            "{path}: exactly Content-Length bytes"
        );
        let asked = backend.last();
        if let Some((_, later)) = laters.iter().find(|(name, _)| *name == path) {
            later.write_now().await;
        }
        for n in 0..3 {
            let next = call(&levee, "GET", &format!("/next/{n}")).await;
            assert_eq!(
                (next.status, next.text().as_str()),
                (200, "fine"),
                "after {path}: the stray bytes never answer another request"
            );
            assert_ne!(
                backend.last().conn,
                asked.conn,
                "after {path}: the connection with stray bytes was reused"
            );
        }
    }
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// 6. Interim answers

#[tokio::test]
async fn interim_1xx_answers_are_skipped() {
    let backend = Scripted::start(|seen| match seen.path() {
        "/continue" => Reply::keep(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Final: yes\r\n\r\nfinal",
        ),
        "/continue-apart" => Reply::pieces(
            &[
                b"HTTP/1.1 100 Continue\r\n\r\n",
                b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\ncreated",
            ],
            Then::Keep,
        ),
        "/early-hints" => Reply::keep(
            "HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhints\r\n0\r\n\r\n",
        ),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for (method, path, status, body) in [
        ("GET", "/continue", 200, "final"),
        ("POST", "/continue-apart", 201, "created"),
        ("GET", "/early-hints", 200, "hints"),
    ] {
        let answer = fetch(
            Request::builder()
                .method(method)
                .uri(levee.url(path))
                .body(full(if method == "POST" { "data" } else { "" }))
                .expect("request"),
        )
        .await;
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (status, body),
            "{path}"
        );
        if path == "/continue" {
            assert_eq!(answer.header("x-final"), Some("yes"));
        }
        if path == "/early-hints" {
            assert_eq!(
                answer.header("link"),
                None,
                "the interim answer's fields are not the final's"
            );
        }
        let asked = backend.last();
        assert_eq!(call(&levee, "GET", "/next").await.text(), "fine");
        assert_eq!(
            backend.last().conn,
            asked.conn,
            "{path}: the final answer's framing keeps the connection"
        );
    }
    assert_eq!(backend.accepts(), 1);
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// 7. Request bodies

#[tokio::test]
async fn request_bodies_reach_the_upstream_framed_and_complete() {
    let backend =
        Scripted::start(|seen| Reply::keep(ok(&format!("{} bytes", seen.body.len())))).await;
    let levee = levee_for(&backend, "").await;

    // Unknown length: chunk-encoded on the way up, every byte there, properly ended.
    let small = vec![b"hello ".to_vec(), b"world".to_vec()];
    let large = vec![
        vec![b'a'; 5],
        vec![b'b'; 40_000],
        vec![b'c'; 3],
        vec![b'd'; 20_000],
    ];
    for pieces in [small, large] {
        let whole: Vec<u8> = pieces.concat();
        let answer = fetch(
            Request::post(levee.url("/upload"))
                .body(streamed(&pieces))
                .expect("request"),
        )
        .await;
        assert_eq!(answer.text(), format!("{} bytes", whole.len()));
        let seen = backend.last();
        assert_eq!(seen.method, "POST");
        assert_eq!(seen.header("transfer-encoding"), ["chunked"]);
        assert!(
            seen.header("content-length").is_empty(),
            "{:?}",
            seen.headers
        );
        assert!(seen.body == whole, "the chunked body arrived complete");
        assert!(
            seen.raw_body.ends_with(b"0\r\n\r\n"),
            "the body ends with the last chunk"
        );
        assert_eq!(
            decode_chunked(&seen.raw_body),
            Ok(Some((whole.clone(), seen.raw_body.len()))),
            "nothing follows the chunked body"
        );
    }

    // Known length: sent as is, with that length.
    let form = "title=Hello&body=%E4%BD%A0%E5%A5%BD&tags=a,b,c";
    let answer = fetch(
        Request::post(levee.url("/form"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(full(form))
            .expect("request"),
    )
    .await;
    assert_eq!(answer.text(), format!("{} bytes", form.len()));
    let seen = backend.last();
    assert_eq!(seen.header("content-length"), [form.len().to_string()]);
    assert!(seen.header("transfer-encoding").is_empty());
    assert_eq!(seen.body, form.as_bytes());

    let big = vec![b'z'; 100_000];
    let answer = fetch(
        Request::put(levee.url("/big"))
            .body(full(big.clone()))
            .expect("request"),
    )
    .await;
    assert_eq!(answer.text(), "100000 bytes");
    let seen = backend.last();
    assert_eq!(seen.header("content-length"), ["100000"]);
    assert!(seen.body == big);

    // An empty POST says so.
    let answer = fetch(
        Request::post(levee.url("/empty"))
            .body(full(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(answer.text(), "0 bytes");
    let seen = backend.last();
    assert_eq!(seen.header("content-length"), ["0"]);
    assert!(seen.header("transfer-encoding").is_empty());

    // A GET has no body and no framing fields.
    assert_eq!(call(&levee, "GET", "/get").await.text(), "0 bytes");
    let seen = backend.last();
    assert!(seen.header("content-length").is_empty());
    assert!(seen.header("transfer-encoding").is_empty());

    // Every body was framed exactly: all of it went over one connection, in order.
    assert_eq!(backend.accepts(), 1);
    let targets: Vec<String> = backend.seen().into_iter().map(|s| s.target).collect();
    assert_eq!(
        targets,
        ["/upload", "/upload", "/form", "/big", "/empty", "/get"]
    );
    stop(levee).await;
}

/// An upstream that refuses every upload from its head alone with a 413, then does `then`.
async fn refusing_uploads(then: Then) -> Scripted {
    Scripted::start(move |_| Reply {
        writes: vec![
            b"HTTP/1.1 413 Payload Too Large\r\nConnection: close\r\nContent-Length: 8\r\n\r\ntoo big!"
                .to_vec(),
        ],
        then: then.clone(),
    })
    .await
}

/// A 24 MiB upload through `levee`, far larger than the socket buffers: its answer.
async fn upload(levee: &Levee) -> (u16, String) {
    let answer = fetch(
        Request::post(levee.url("/early-upload"))
            .body(full(vec![b'u'; 24 * 1024 * 1024]))
            .expect("request"),
    )
    .await;
    (answer.status, answer.text())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_to_an_upload_the_upstream_drains_is_passed_on() {
    // The upstream refuses the upload from its head alone, then reads and discards the body
    // until levee is done (as nginx does with `client_max_body_size`).
    let backend = refusing_uploads(Then::Drain).await;
    let levee = levee_with(&backend, "max_body = \"64MiB\"", "").await;
    assert_eq!(upload(&levee).await, (413, "too big!".into()));
    stop(levee).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_to_an_upload_the_upstream_stops_reading_is_passed_on() {
    // The upstream refuses the upload from its head alone and reads nothing more, keeping
    // the connection open.
    let backend = refusing_uploads(Then::Hold).await;
    let levee = levee_with(
        &backend,
        "max_body = \"64MiB\"",
        "response_timeout = \"2s\"",
    )
    .await;
    assert_eq!(
        upload(&levee).await,
        (413, "too big!".into()),
        "the upstream's answer, not levee's timeout"
    );
    stop(levee).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_to_an_upload_the_upstream_then_closes_on_is_passed_on() {
    // The upstream refuses the upload from its head alone and closes (or resets) the
    // connection with the body unread, as servers without a lingering close do: the kernel
    // answers levee's next write with a reset. The answer was sent first and reaches the
    // client.
    for then in [Then::Close, Then::Reset] {
        let backend = refusing_uploads(then.clone()).await;
        let levee = levee_with(&backend, "max_body = \"64MiB\"", "").await;
        for _ in 0..3 {
            assert_eq!(upload(&levee).await, (413, "too big!".into()), "{then:?}");
        }
        stop(levee).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_head_sent_during_an_upload_is_a_502_not_a_wait() {
    // The upstream answers from the request head alone, with a head that never ends, while
    // the client is still uploading. The head limit holds then too: levee stops reading at
    // it and answers 502, instead of buffering all of it for as long as the upload lasts.
    let mut endless = b"HTTP/1.1 200 OK\r\nX-Huge: ".to_vec();
    endless.extend(std::iter::repeat_n(b'h', 256 * 1024));
    let endless = Arc::new(endless);
    let backend = Scripted::start(move |_| Reply {
        writes: vec![endless.to_vec()],
        then: Then::Hold,
    })
    .await;
    let levee = levee_for(&backend, "").await;
    // More than levee reads ahead before it connects; the rest of the upload never comes.
    let first: Vec<Result<Frame<Bytes>, BoxError>> =
        vec![Ok(Frame::data(Bytes::from(vec![b'u'; 128 * 1024])))];
    let upload = StreamBody::new(futures_util::StreamExt::chain(
        futures_util::stream::iter(first),
        futures_util::stream::pending(),
    ))
    .boxed_unsync();
    let answer = fetch(
        Request::post(levee.url("/early-endless-head"))
            .body(upload)
            .expect("request"),
    )
    .await;
    assert_eq!(answer.status, 502, "{}", answer.text());
    logged_502("/early-endless-head", &["response head over"]);
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// 8. Malformed response heads

#[tokio::test]
async fn malformed_response_heads_get_a_502_and_the_reason_in_the_log() {
    let mut huge = b"HTTP/1.1 200 OK\r\nX-Huge: ".to_vec();
    huge.extend(std::iter::repeat_n(b'h', 70 * 1024));
    let huge = Arc::new(huge);
    let cases: Vec<(&str, &str)> = vec![
        ("/garbage", "malformed response"),
        ("/bad-status", "malformed response"),
        ("/short-status", "malformed response"),
        ("/long-status", "malformed response"),
        ("/http2", "malformed response"),
        ("/bad-header-name", "malformed response"),
        ("/bad-length", "invalid content-length"),
        ("/signed-length", "invalid content-length"),
        ("/two-lengths", "conflicting content-length"),
        (
            "/cut-head",
            "the connection closed inside the response head",
        ),
        ("/huge-head", "response head over"),
        ("/nothing", "closed the connection before answering"),
    ];
    let backend = Scripted::start(move |seen| match seen.path() {
        "/garbage" => Reply::close("garbage\r\n\r\n"),
        "/bad-status" => Reply::close("HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n"),
        "/short-status" => Reply::close("HTTP/1.1 99 Low\r\nContent-Length: 0\r\n\r\n"),
        "/long-status" => Reply::close("HTTP/1.1 1000 High\r\nContent-Length: 0\r\n\r\n"),
        "/http2" => Reply::close("HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n"),
        "/bad-header-name" => {
            Reply::close("HTTP/1.1 200 OK\r\nBad Name: x\r\nContent-Length: 0\r\n\r\n")
        }
        "/bad-length" => Reply::close("HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n"),
        "/signed-length" => Reply::close("HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello"),
        "/two-lengths" => {
            Reply::close("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!")
        }
        "/cut-head" => Reply::close("HTTP/1.1 200 OK\r\nContent-Le"),
        "/huge-head" => Reply::close(huge.to_vec()),
        "/nothing" => Reply::close(Vec::new()),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for (path, reason) in cases {
        let answer = call(&levee, "GET", path).await;
        assert_eq!(answer.status, 502, "{path}: {}", answer.text());
        let text = answer.text();
        // The visitor reads that the site failed; the log reads how.
        assert_eq!(
            text,
            visitor_page(
                "Bad gateway",
                "The site could not answer this request. Please try again later."
            ),
            "{path}"
        );
        logged_502(path, &["upstream `app` failed: ", reason]);
        assert!(
            !text.contains("garbage") && !text.contains("hhhh"),
            "{path}: the upstream's bytes are not echoed to the client: {text:?}"
        );
        // levee keeps serving, on a connection of its own.
        let next = call(&levee, "GET", "/next").await;
        assert_eq!(
            (next.status, next.text().as_str()),
            (200, "fine"),
            "after {path}"
        );
    }
    stop(levee).await;
}

#[tokio::test]
async fn a_repeated_content_length_reaches_the_client_once() {
    // RFC 9110 8.6: a recipient that accepts the same length sent more than once replaces the
    // repeats with one field before forwarding. Two lines would get the answer refused by a
    // front nginx ("upstream sent duplicate header line") and leave others guessing. The
    // `Connection` token makes levee parse the fields rather than relay them as received.
    let backend = Scripted::start(|seen| match seen.path() {
        "/twice" => Reply::keep(
            "HTTP/1.1 200 OK\r\nConnection: x-extra\r\nX-Extra: 1\r\nContent-Length: 5\r\n\
             Content-Length: 5\r\n\r\nhello",
        ),
        "/spelled-twice" => Reply::keep(
            "HTTP/1.1 200 OK\r\nConnection: x-extra\r\nContent-Length: 5\r\n\
             Content-Length: 005\r\n\r\nhello",
        ),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;
    for path in ["/twice", "/spelled-twice"] {
        let raw = raw_exchange(
            levee.public,
            format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
            WITHIN,
        )
        .await;
        let (head, body) = raw.split_once("\r\n\r\n").expect("a head");
        let lengths: Vec<&str> = head
            .lines()
            .filter(|line| line.to_ascii_lowercase().starts_with("content-length:"))
            .collect();
        assert_eq!(lengths, ["Content-Length: 5"], "{path}: {head}");
        assert_eq!(body, "hello", "{path}");
    }
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// 9. Bodies cut off mid-way

#[tokio::test]
async fn a_body_cut_off_mid_way_aborts_the_response_never_a_clean_short_one() {
    let backend = Scripted::start(|seen| match seen.path() {
        // Closes (FIN, not a reset) after 10 of 100 promised bytes.
        "/short-length" => {
            Reply::close("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        }
        // Closes after one chunk, without the last chunk.
        "/short-chunked" => Reply::close(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        ),
        // Closes inside a chunk.
        "/inside-chunk" => Reply::close(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nonly half",
        ),
        // Broken chunk framing after the head.
        "/bad-chunk" => Reply::keep(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\nnope\r\n0\r\n\r\n",
        ),
        // A chunk size too large for any integer.
        "/huge-chunk" => Reply::keep(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffffffffff\r\nxx\r\n",
        ),
        // A reset after 10 of 100 bytes.
        "/reset-length" => {
            Reply::reset("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        }
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    for path in [
        "/short-length",
        "/short-chunked",
        "/inside-chunk",
        "/bad-chunk",
        "/huge-chunk",
        "/reset-length",
    ] {
        let answer = call(&levee, "GET", path).await;
        assert!(
            answer.body.is_err(),
            "{path}: a cut-off body arrived as a complete response ({:?})",
            answer.body
        );
        // A reset may overtake the head; levee then answers 502, which is honest too.
        if path != "/reset-length" || answer.status != 502 {
            assert_eq!(
                answer.status, 200,
                "{path}: the head had arrived and is passed on"
            );
        }
        if path.ends_with("-length") && answer.status == 200 {
            assert_eq!(
                answer.header("content-length"),
                Some("100"),
                "{path}: the announced length is kept, so the client can tell"
            );
        }
        let next = call(&levee, "GET", "/next").await;
        assert_eq!(
            (next.status, next.text().as_str()),
            (200, "fine"),
            "{path}: levee serves the next request"
        );
    }
    // Each is the upstream's failure in the metrics (and a warn line), not a client that
    // went away: at least the five whose head had passed.
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metric_value(
            &metrics,
            "levee_upstream_errors_total{upstream=\"app\",kind=\"body_cut\"}"
        ) >= 5.0,
        "{metrics}"
    );
    stop(levee).await;
}

// ---------------------------------------------------------------------------------------
// Upgrades: the upstream connection is handed over with what it sent behind the 101

#[tokio::test]
async fn bytes_sent_right_behind_a_101_reach_the_client_first() {
    let backend = Scripted::start(|seen| match seen.path() {
        "/upgrade" => Reply {
            writes: vec![
                b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\nEARLY"
                    .to_vec(),
            ],
            then: Then::Echo,
        },
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;

    let mut stream = TcpStream::connect(levee.public).await.expect("connect");
    stream
        .write_all(
            b"GET /upgrade HTTP/1.1\r\nHost: app\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await
        .expect("write");
    let mut received = Vec::new();
    let read_until = |wanted: &'static [u8]| {
        let wanted = wanted.to_vec();
        move |received: &Vec<u8>| find(received, &wanted).is_some()
    };
    read_into(&mut stream, &mut received, read_until(b"\r\n\r\nEARLY")).await;
    let text = String::from_utf8_lossy(&received).into_owned();
    assert!(text.starts_with("HTTP/1.1 101"), "{text}");
    // The app's field names as it spelled them.
    assert!(text.contains("\r\nUpgrade: websocket\r\n"), "{text}");
    assert!(
        text.contains("\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n"),
        "{text}"
    );
    assert!(text.ends_with("\r\n\r\nEARLY"), "nothing else came: {text}");

    stream.write_all(b"ping").await.expect("write");
    received.clear();
    read_into(&mut stream, &mut received, read_until(b"ping")).await;
    assert_eq!(received, b"ping");

    let upgraded = backend.last();
    assert_eq!(upgraded.header("upgrade"), ["websocket"]);
    drop(stream);
    // The upgraded connection is not pooled: the next request has a connection of its own.
    assert_eq!(call(&levee, "GET", "/next").await.text(), "fine");
    assert_ne!(backend.last().conn, upgraded.conn);
    stop(levee).await;
}

#[tokio::test]
async fn a_101_to_a_request_that_asked_for_no_upgrade_is_a_502() {
    // RFC 9110 15.2.2: a server switches only to a protocol the request's Upgrade names. A 101
    // nobody asked for is a broken answer; passed on, it reached a client that cannot take it
    // (an HTTP/1.0 one may get no 1xx at all, RFC 9110 15.2).
    let backend = Scripted::start(|seen| match seen.path() {
        "/switch" => Reply::keep(
            "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n",
        ),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;
    for version in ["HTTP/1.1", "HTTP/1.0"] {
        let head = format!("GET /switch {version}\r\nHost: app\r\nConnection: close\r\n\r\n");
        refused_with_502(&levee, &head, "asked for no upgrade").await;
    }
    assert_eq!(call(&levee, "GET", "/next").await.text(), "fine");
    stop(levee).await;
}

/// Sends `head` on a connection of its own and checks the answer is a 502 whose log line
/// says `why`.
async fn refused_with_502(levee: &Levee, head: &str, why: &str) {
    let raw = raw_exchange(levee.public, head.as_bytes(), WITHIN).await;
    assert_eq!(status_of(&raw), Some(502), "{head}: {raw}");
    let path = head.split(' ').nth(1).expect("a request line");
    logged_502(path, &[why]);
}

/// Checks that a 502 to a request for `path` was logged, on one line, saying each of `says`
/// (what the client is not told).
fn logged_502(path: &str, says: &[&str]) {
    let lines = levee_log().lines_with(&format!("path={path}"));
    assert!(
        lines
            .iter()
            .any(|line| says.iter().all(|part| line.contains(part))),
        "{path}: no log line says {says:?}: {lines:#?}"
    );
}

#[tokio::test]
async fn a_101_that_names_no_websocket_switch_is_a_502_and_tunnels_nothing() {
    // A page that sets its own status to 101, or switches to some other protocol: levee
    // tunnels only WebSocket, and a tunnel opened on the status alone would carry the client's
    // next requests to the app past every route and limit.
    let backend = Scripted::start(|seen| match seen.path() {
        "/bare" => Reply::keep("HTTP/1.1 101 Switching Protocols\r\n\r\n"),
        "/other" => Reply::keep(
            "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n",
        ),
        _ => Reply::keep(ok("fine")),
    })
    .await;
    let levee = levee_for(&backend, "").await;
    for path in ["/bare", "/other"] {
        let head = format!(
            "GET {path} HTTP/1.1\r\nHost: app\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n\r\n"
        );
        refused_with_502(&levee, &head, "Upgrade: websocket").await;
        // The upgrade was asked for: the app saw it.
        assert_eq!(backend.last().header("upgrade"), ["websocket"], "{path}");
    }
    assert_eq!(call(&levee, "GET", "/next").await.text(), "fine");
    stop(levee).await;
}

/// Reads from `stream` into `received` until `done` says so; a hang fails the test.
async fn read_into(
    stream: &mut TcpStream,
    received: &mut Vec<u8>,
    done: impl Fn(&Vec<u8>) -> bool,
) {
    let reading = async {
        let mut piece = [0u8; 4096];
        while !done(received) {
            let n = stream.read(&mut piece).await.expect("read");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(received));
            received.extend_from_slice(&piece[..n]);
        }
    };
    tokio::time::timeout(WITHIN, reading)
        .await
        .expect("the expected bytes arrived in time");
}
