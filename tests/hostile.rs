//! Hostile input: every one is answered with a clear 4xx or a closed connection, and the
//! backend never sees an ambiguous request.

mod common;

use std::time::Duration;

use common::*;

async fn exchange(levee: &Levee, raw: &[u8]) -> String {
    raw_exchange(levee.public, raw, Duration::from_secs(5)).await
}

/// `GET target` as sent, byte for byte (a client library would re-encode it).
async fn get_target(levee: &Levee, target: &str) -> String {
    exchange(
        levee,
        format!("GET {target} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
}

/// levee in front of two echo backends: `app`, the default upstream, and `second`, for the
/// requests `route_match` (a route's `match` table) matches, on a route named `route`.
async fn levee_with_a_second_route(route: &str, route_match: &str) -> (Levee, Backend, Backend) {
    let app = echo_backend().await;
    let second = echo_backend().await;
    let rest = format!(
        "[upstream.second]\nurl = \"http://{}\"\n[[route]]\nname = \"{route}\"\nmatch = {route_match}\nupstream = \"second\"\n",
        second.addr
    );
    let levee = Levee::start(&policy_for(app.addr, "default_upstream = \"app\"", &rest)).await;
    (levee, app, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_attempts_are_refused_never_forwarded_ambiguously() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;

    // Content-Length and Transfer-Encoding together: the HTTP parser keeps only the chunked
    // framing (RFC 9112 6.1) and closes the connection after answering, so the request hidden
    // behind the body is never read, and the backend gets one unambiguous chunked request.
    let answer = exchange(
        &levee,
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    assert_eq!(
        answer.matches("HTTP/1.1 ").count(),
        1,
        "exactly one answer: {answer}"
    );
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(
        !answer.contains("\"content-length\""),
        "no Content-Length forwarded next to chunked: {answer}"
    );
    assert!(!answer.contains("/smuggled"), "{answer}");
    assert_eq!(backend.hits(), 1);

    let refused: [&[u8]; 3] = [
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ];
    for raw in refused {
        let answer = exchange(&levee, raw).await;
        assert!(
            matches!(status_of(&answer), Some(400..=499) | None),
            "{}\n=> {answer}",
            String::from_utf8_lossy(raw)
        );
    }
    assert_eq!(
        backend.hits(),
        1,
        "no ambiguous request reached the backend"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_400_and_levee_keeps_serving() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    let garbage: [&[u8]; 5] = [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n",
        b"GET /\x01\x02 HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nX: \xff\xfe\r\n\r\n",
    ];
    for raw in garbage {
        let answer = exchange(&levee, raw).await;
        let status = status_of(&answer);
        assert!(
            matches!(status, Some(400..=499) | Some(505) | None) || answer.contains("200 OK"),
            "{}\n=> {answer}",
            String::from_utf8_lossy(raw)
        );
    }
    // A flood of headers is refused as a whole.
    let mut flood = b"GET / HTTP/1.1\r\nHost: a\r\n".to_vec();
    for i in 0..500 {
        flood.extend_from_slice(format!("X-Flood-{i}: y\r\n").as_bytes());
    }
    flood.extend_from_slice(b"\r\n");
    let answer = exchange(&levee, &flood).await;
    assert!(
        matches!(status_of(&answer), Some(431) | Some(400) | None),
        "{answer}"
    );
    // Still healthy.
    assert_eq!(get(&levee.url("/ok")).await.status, 200);
}

/// A client sending nothing but bad requests cannot make the log as large as its requests:
/// the reasons are said for the first few each second, then counted into the next line, and a
/// long target is cut in the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_bad_requests_is_said_a_few_times_a_second_with_short_targets() {
    let log = levee_log();
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    let flood = format!("/flood-{}", free_port());
    for _ in 0..100 {
        let raw = format!(
            "POST {flood} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nZZ\r\n"
        );
        let answer = exchange(&levee, raw.as_bytes()).await;
        assert_eq!(status_of(&answer), Some(400), "{answer}");
    }
    let said: Vec<String> = log
        .lines_with(&format!("path={flood}"))
        .into_iter()
        .filter(|line| line.contains("refused: "))
        .collect();
    assert!(
        !said.is_empty() && said.len() <= 2 * levee::proxy::REFUSALS_SAID_PER_SECOND as usize,
        "{} lines for 100 refusals",
        said.len()
    );
    let long = format!("{flood}/{}", "x".repeat(30_000));
    let raw = format!(
        "POST {long} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nZZ\r\n"
    );
    exchange(&levee, raw.as_bytes()).await;
    eventually(
        Duration::from_secs(3),
        "the long target said, cut",
        || async {
            // A second later a line is due again.
            let raw = raw.clone();
            exchange(&levee, raw.as_bytes()).await;
            log.lines_with(&format!("path={flood}/xxx"))
                .iter()
                .any(|line| {
                    line.contains("refused: ") && line.len() < 2_000 && line.contains("… (")
                })
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_host_is_refused_with_400() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    // RFC 9112 3.2: a Host that is not `host[:port]` gets a 400. A PHP app building links
    // from it would send its users to evil.example.
    for host in ["a@evil.example", "evil.example/reset", "a b"] {
        let answer = exchange(
            &levee,
            format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(status_of(&answer), Some(400), "{host:?} => {answer}");
        assert!(answer.contains("invalid Host field"), "{answer}");
    }
    // RFC 9110 9.3.2: refused as its head is read, a HEAD request still gets no body.
    let answer = exchange(
        &levee,
        b"HEAD / HTTP/1.1\r\nHost: a b\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(400), "{answer}");
    assert!(
        answer.ends_with("\r\n\r\n"),
        "no body after the head: {answer:?}"
    );
    assert_eq!(backend.hits(), 0, "no invalid Host reached the backend");
    let answer = exchange(
        &levee,
        b"GET / HTTP/1.1\r\nHost: shop.example:8080\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_is_routed_and_forwarded_by_its_own_host() {
    let (levee, backend, admin) =
        levee_with_a_second_route("admin", "{ host = \"admin.example\" }").await;
    // RFC 9112 3.2.2: the request is for the target's host; Host is ignored. The route and
    // the app both go by admin.example.
    let answer = exchange(
        &levee,
        b"GET http://admin.example/panel HTTP/1.1\r\nHost: www.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    let (_, body) = answer.split_once("\r\n\r\n").expect("head and body");
    let echo: serde_json::Value = serde_json::from_str(body).expect("echo json");
    assert_eq!(echoed_header(&echo, "host"), ["admin.example"]);
    assert_eq!(echo["target"], "/panel");
    assert_eq!((admin.hits(), backend.hits()), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_target_gets_414_and_over_large_fields_431() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    // RFC 9112 3: a target longer than the server will parse gets 414, with a reason that
    // says so; too many header bytes stay a 431.
    let long_target = format!(
        "GET /{} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        "a".repeat(100 * 1024)
    );
    let answer = exchange(&levee, long_target.as_bytes()).await;
    assert_eq!(
        status_of(&answer),
        Some(414),
        "{}",
        &answer[..answer.len().min(300)]
    );
    // The limit named is the operator's (`max_header_bytes`, 32 KiB by default), not the
    // parser's own bound.
    assert!(
        answer.contains("request line is over the limit of 32768 bytes"),
        "{answer}"
    );
    // Over the operator's limit but within what the parser reads: refused all the same.
    let target_over_the_limit = format!(
        "GET /{} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        "a".repeat(40 * 1024)
    );
    let answer = exchange(&levee, target_over_the_limit.as_bytes()).await;
    assert_eq!(
        status_of(&answer),
        Some(414),
        "{}",
        &answer[..answer.len().min(300)]
    );
    assert!(
        answer.contains("request line is over the limit of 32768 bytes"),
        "{answer}"
    );
    let large_fields = format!(
        "GET / HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "b".repeat(100 * 1024)
    );
    let answer = exchange(&levee, large_fields.as_bytes()).await;
    assert_eq!(
        status_of(&answer),
        Some(431),
        "{}",
        &answer[..answer.len().min(300)]
    );
    assert!(answer.contains("over the limit of 32768"), "{answer}");
    assert_eq!(backend.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_dodging_by_spelling_and_case_lands_where_the_backend_would() {
    let (levee, backend, limited) =
        levee_with_a_second_route("ranking", "{ path_prefix = \"/ranking\" }").await;
    for path in [
        "/ranking",
        "/./ranking",
        "//ranking",
        "/%72anking",
        "/x/../ranking",
        "/ranking/../ranking",
    ] {
        assert_eq!(get(&levee.url(path)).await.status, 200, "{path}");
    }
    assert_eq!(
        limited.hits(),
        6,
        "every spelling reached the ranking route"
    );
    // Matching is case-sensitive, like the backend's file system: /Ranking is another path.
    assert_eq!(get(&levee.url("/Ranking")).await.status, 200);
    assert_eq!(limited.hits(), 6);
    assert_eq!(backend.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_breaking_bytes_are_refused_or_passed_on_encoded_never_raw() {
    let backend = echo_backend().await;
    let rest = "[identity]\nuser = \"header:X-User\"\n[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 1\n[[route]]\nname = \"all\"\nmatch = { path_prefix = \"/\" }\nupstream = \"app\"\nlimits = [\"per_user\"]\n";
    let levee = Levee::start(&policy_for(backend.addr, "", rest)).await;

    // A CR or NUL inside a header value makes the request unreadable, as under nginx.
    let broken: [&[u8]; 2] = [
        b"GET / HTTP/1.1\r\nHost: a\r\nX-User: a\rSet-Cookie: evil=1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nX-User: a\x00b\r\n\r\n",
    ];
    for raw in broken {
        let answer = exchange(&levee, raw).await;
        assert!(
            matches!(status_of(&answer), Some(400) | None),
            "{:?}\n=> {answer}",
            String::from_utf8_lossy(raw)
        );
        assert!(
            !answer.to_ascii_lowercase().contains("set-cookie"),
            "{answer}"
        );
    }
    assert_eq!(backend.hits(), 0, "nothing unparseable was forwarded");

    // Other control bytes (which nginx passes as they are) reach the app as spaces, and the
    // user's bucket is the one of the value the app reads.
    let answer = exchange(
        &levee,
        b"GET / HTTP/1.1\r\nHost: a\r\nX-User: a\x0bb\x7f\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    let (_, body) = answer.split_once("\r\n\r\n").expect("head and body");
    let echo: serde_json::Value = serde_json::from_str(body).expect("echo json");
    let user = echo["headers"]
        .as_array()
        .and_then(|fields| fields.iter().find(|field| field[0] == "x-user"))
        .map(|field| field[1].clone());
    assert_eq!(user, Some(serde_json::json!("a b")), "{echo}");
    let again = exchange(
        &levee,
        b"GET / HTTP/1.1\r\nHost: a\r\nX-User: a b\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&again), Some(429), "{again}");

    // Encoded CR/LF in the target stays encoded: the app gets the target byte for byte, and
    // nothing of it turns into a response header.
    let target = "/a%0d%0aSet-Cookie:%20evil=1";
    let answer = raw_exchange(
        levee.public,
        format!("GET {target} HTTP/1.1\r\nHost: a\r\nX-User: u1\r\nConnection: close\r\n\r\n")
            .as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    let (head, body) = answer.split_once("\r\n\r\n").expect("head and body");
    assert!(!head.to_ascii_lowercase().contains("set-cookie"), "{head}");
    let echo: serde_json::Value = serde_json::from_str(body).expect("echo json");
    assert_eq!(echo["target"], target);

    // What the client sent never reaches a refusal: the 429 body and its RateLimit fields
    // carry numbers and the rule's name only.
    let hostile_user = "<script>alert(1)</script>%0d%0aX-Evil: 1";
    let mut last = String::new();
    for _ in 0..2 {
        last = raw_exchange(
            levee.public,
            format!(
                "GET / HTTP/1.1\r\nHost: a\r\nX-User: {hostile_user}\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
            Duration::from_secs(5),
        )
        .await;
    }
    assert_eq!(status_of(&last), Some(429), "{last}");
    assert!(!last.contains("<script>"), "{last}");
    assert!(!last.to_ascii_lowercase().contains("x-evil"), "{last}");
    assert!(
        last.contains("\"per_user\""),
        "the RateLimit fields name the rule: {last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8_and_percent_encoding_in_paths_get_400_or_pass_unchanged() {
    let (levee, backend, ranking) =
        levee_with_a_second_route("ranking", "{ path_prefix = \"/ranking\" }").await;

    // Raw UTF-8 in the target is not valid HTTP, but nginx and PHP take it, so levee passes it
    // on byte for byte rather than break a site that has such links; bytes that are not
    // UTF-8 at all (Latin-1, as old clients of a Latin-1 site send) are percent-encoded, which
    // the app decodes to the same bytes.
    let answer = exchange(
        &levee,
        b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    assert!(answer.contains("\"target\":\"/caf\u{e9}\""), "{answer}");
    let answer = exchange(
        &levee,
        b"GET /\xff\xfe?q=caf\xe9 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    assert!(
        answer.contains("\"target\":\"/%FF%FE?q=caf%E9\""),
        "{answer}"
    );
    // Broken escapes are refused with the reason.
    for target in ["/a%", "/a%4", "/a%zz", "/%%41"] {
        let answer = get_target(&levee, target).await;
        assert_eq!(status_of(&answer), Some(400), "{target}: {answer}");
        assert!(
            answer.contains("invalid percent-encoding"),
            "{target}: {answer}"
        );
    }
    assert_eq!(backend.hits() + ranking.hits(), 2);

    // Escapes of bytes that are not UTF-8 (or overlong slashes) are not decoded into
    // anything: they pass to the app as sent and cannot climb or switch routes.
    for target in ["/%ff%fe", "/%c0%af..%c0%af/ranking", "/ranking/a%2Fb"] {
        let answer = get_target(&levee, target).await;
        assert_eq!(status_of(&answer), Some(200), "{target}: {answer}");
        let (_, body) = answer.split_once("\r\n\r\n").expect("head and body");
        let echo: serde_json::Value = serde_json::from_str(body).expect("echo json");
        assert_eq!(echo["target"], target);
    }
    // `/ranking/a%2Fb` is the ranking route's however the app reads the `%2F`.
    assert_eq!((backend.hits(), ranking.hits()), (4, 1));
    // An encoded slash that moves the request to another route depending on whether the app
    // decodes it (nginx does: `/%2Franking` is `/ranking` to it) is refused, with the reason.
    for target in [
        "/%2Franking",
        "/%2franking/x",
        "/ranking%2f..%2fadmin",
        "/x/..%2Franking",
    ] {
        let answer = get_target(&levee, target).await;
        assert_eq!(status_of(&answer), Some(400), "{target}: {answer}");
        assert!(answer.contains("encoded slash"), "{target}: {answer}");
    }
    assert_eq!((backend.hits(), ranking.hits()), (4, 1));
    // Encoded dots are dots: `/x/%2e%2e/ranking` is `/ranking`, as the app resolves it.
    assert_eq!(get(&levee.url("/x/%2e%2e/ranking")).await.status, 200);
    assert_eq!(ranking.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_request_bodies_are_cut_off_with_408() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "client_body_timeout = \"300ms\"",
        "",
    ))
    .await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for head in [
        &b"POST /form HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nfirst ten."[..],
        &b"POST /form HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\na\r\nfirst ten.\r\n"
            [..],
    ] {
        let mut stream = tokio::net::TcpStream::connect(levee.public)
            .await
            .expect("connect");
        stream.write_all(head).await.expect("write");
        // Then nothing more: the body stalls.
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "levee kept a stalled body open");
        let answer = String::from_utf8_lossy(&out);
        assert!(
            matches!(status_of(&answer), Some(408)),
            "{}\n=> {answer}",
            String::from_utf8_lossy(head)
        );
    }
    // Still serving.
    assert_eq!(post(&levee.url("/form"), "complete").await.status, 200);
}

/// Flips its flag when dropped: tells the test that levee let go of the upstream's answer.
struct DroppedFlag(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for DroppedFlag {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_its_upstream_answer_let_go() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use bytes::Bytes;
    use futures_util::StreamExt;
    use http::Response;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let dropped = Arc::new(AtomicBool::new(false));
    let flag = dropped.clone();
    // An answer far larger than any socket buffer, made as it is read.
    let backend = Backend::start(move |_request| {
        let guard = DroppedFlag(flag.clone());
        async move {
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let chunks = futures_util::stream::iter(0..16_384).map(move |_| {
                let _held = &guard;
                Ok::<_, BoxError>(Frame::data(chunk.clone()))
            });
            Response::new(StreamBody::new(chunks).boxed_unsync())
        }
    })
    .await;
    let levee = Levee::start(&policy_for(backend.addr, "send_timeout = \"1s\"", "")).await;

    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    stream
        .write_all(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    // The client reads nothing from here on.
    eventually(
        Duration::from_secs(20),
        "levee gives up on the client and lets go of the upstream's answer",
        || async { dropped.load(Ordering::SeqCst) },
    )
    .await;
    // What reached the client is a cut answer (then the close), not the whole of it.
    let mut received = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut received)).await;
    assert!(
        received.len() < 1024 * 1024 * 1024,
        "the whole answer went out: {}",
        received.len()
    );
    // levee goes on serving.
    let answer = get(&levee.url("/small")).await;
    assert_eq!(answer.status, 200);
}

/// The admin listener holds at most 64 connections (past them a new one is closed at once),
/// and one whose client sends requests and never reads their answers is closed after
/// `send_timeout`, as the public listener's are: neither can use up the file descriptors
/// the public listener needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_caps_its_connections_and_drops_clients_that_never_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "send_timeout = \"1s\"\nheader_read_timeout = \"60s\"",
        "",
    ))
    .await;
    // A client that asks for the dashboard over and over and reads nothing.
    let mut writer = tokio::net::TcpStream::connect(levee.admin)
        .await
        .expect("connect");
    let ask = b"GET /dashboard HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(64);
    // (The stream is given back, not dropped: a client that closes is not one that stalls.)
    let stalled = tokio::spawn(async move {
        for _ in 0..1000 {
            if writer.write_all(&ask).await.is_err() {
                break;
            }
        }
        writer
    });
    // 63 more that send nothing: the listener is full.
    let mut idle = Vec::new();
    for _ in 0..63 {
        idle.push(
            tokio::net::TcpStream::connect(levee.admin)
                .await
                .expect("connect"),
        );
    }
    // Closed at once while the 64 are open: the connect, the write or the read sees it.
    let refused = async {
        let Ok(mut extra) = tokio::net::TcpStream::connect(levee.admin).await else {
            return true;
        };
        if extra
            .write_all(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await
            .is_err()
        {
            return true;
        }
        let mut answer = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(5), extra.read_to_end(&mut answer)).await;
        matches!(read, Ok(Ok(0)) | Ok(Err(_)))
    };
    let first = refused.await;
    // Once the writer that never reads is dropped, a new connection is served.
    eventually(
        Duration::from_secs(20),
        "the connection that never reads to be closed, and its slot taken by another",
        || async {
            let Ok(mut stream) = tokio::net::TcpStream::connect(levee.admin).await else {
                return false;
            };
            let request = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
            if stream.write_all(request).await.is_err() {
                return false;
            }
            let mut answer = Vec::new();
            let _ =
                tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut answer)).await;
            answer.starts_with(b"HTTP/1.1 200")
        },
    )
    .await;
    assert!(first, "a 65th connection was served");
    let _ = tokio::time::timeout(Duration::from_secs(10), stalled).await;
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_asked_in_http_1_0_is_not_passed_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    // A backend that switches protocols whenever it is asked to, and answers 200 otherwise.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let backend_addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut piece = [0u8; 1024];
                while !head.windows(4).any(|end| end == b"\r\n\r\n") {
                    match stream.read(&mut piece).await {
                        Ok(0) | Err(_) => return,
                        Ok(read) => head.extend_from_slice(&piece[..read]),
                    }
                }
                let answer: &[u8] = if String::from_utf8_lossy(&head)
                    .to_ascii_lowercase()
                    .contains("\r\nupgrade:")
                {
                    b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                };
                let _ = stream.write_all(answer).await;
            });
        }
    });
    let levee = Levee::start(&policy_for(backend_addr, "", "")).await;
    // RFC 9110 7.8: Upgrade in an HTTP/1.0 request is ignored; and no 1xx may be sent to an
    // HTTP/1.0 client (15.2). The request is served as a plain one.
    let answer = exchange(
        &levee,
        b"GET /chat HTTP/1.0\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    assert!(answer.ends_with("\r\n\r\nok"), "{answer}");

    // Only WebSocket is passed on: a switch to h2c would carry the requests that follow past
    // levee's routes and limits. The request is served as a plain one here too.
    for offered in ["h2c", "websocket, h2c"] {
        let raw = format!("GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: {offered}\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n");
        let answer = exchange(&levee, raw.as_bytes()).await;
        assert_eq!(status_of(&answer), Some(200), "{offered}: {answer}");
        assert!(answer.ends_with("\r\n\r\nok"), "{offered}: {answer}");
    }
}

#[tokio::test]
async fn an_idle_websocket_tunnel_is_closed_after_tunnel_idle_timeout() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let ws_addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut socket) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                while let Some(Ok(message)) = socket.next().await {
                    if message.is_text() {
                        let _ = socket.send(message).await;
                    }
                }
            });
        }
    });
    let levee = Levee::start(&policy_for(ws_addr, "tunnel_idle_timeout = \"1s\"", "")).await;
    let (mut socket, _) = tokio_tungstenite::connect_async(format!("ws://{}/chat", levee.public))
        .await
        .expect("websocket handshake through levee");
    // Traffic more often than the timeout keeps the tunnel open past it.
    for round in 0..6 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        socket
            .send(Message::text(format!("ping {round}")))
            .await
            .expect("send while busy");
        let echoed = socket.next().await.expect("a message").expect("no error");
        assert_eq!(
            echoed.into_text().expect("text").as_str(),
            format!("ping {round}")
        );
    }
    // Then silence: levee closes the tunnel.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match socket.next().await {
                None | Some(Err(_)) => return,
                Some(Ok(Message::Close(_))) => return,
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "levee kept an idle tunnel open");
}

#[test]
fn a_zero_send_or_tunnel_timeout_is_refused_with_its_line() {
    let stderr = check_fails(
        "[server]\nsend_timeout = \"0s\"\ntunnel_idle_timeout = \"0ms\"\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\n",
    );
    assert!(
        stderr.contains("levee.toml:2:16: error: `send_timeout` must be more than 0"),
        "{stderr}"
    );
    assert!(
        stderr.contains("levee.toml:3:23: error: `tunnel_idle_timeout` must be more than 0"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_header_naming_host_or_forwarding_fields_takes_none_of_them_away() {
    let (levee, _, admin) =
        levee_with_a_second_route("admin", "{ host = \"admin.example\" }").await;
    let answer = exchange(
        &levee,
        b"GET /panel HTTP/1.1\r\nHost: admin.example\r\nX-Forwarded-For: 203.0.113.9\r\nConnection: Host, X-Forwarded-For, X-Real-IP, close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    assert_eq!(admin.hits(), 1, "routed by its host");
    let (_, body) = answer.split_once("\r\n\r\n").expect("head and body");
    let echo: serde_json::Value = serde_json::from_str(body).expect("echo json");
    // The app gets the host the request was routed by, and a chain that agrees with
    // X-Real-IP (the loopback peer is a trusted proxy by default).
    assert_eq!(echoed_header(&echo, "host"), ["admin.example"]);
    assert_eq!(echoed_header(&echo, "x-forwarded-for"), ["203.0.113.9"]);
    assert_eq!(echoed_header(&echo, "x-real-ip"), ["203.0.113.9"]);
}

/// `OPTIONS *` and `CONNECT host:port` name no path: refused with 400 as a front nginx
/// refuses them, with a reason that says so, and never forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_without_a_path_are_refused_with_the_reason() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    for raw in [
        &b"OPTIONS * HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"[..],
        &b"CONNECT db.internal:3306 HTTP/1.1\r\nHost: db.internal:3306\r\nConnection: close\r\n\r\n"[..],
    ] {
        let answer = exchange(&levee, raw).await;
        assert_eq!(status_of(&answer), Some(400), "{answer}");
        assert!(answer.contains("names no path"), "{answer}");
    }
    assert_eq!(backend.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_that_run_a_routes_php_script_stay_on_its_route() {
    let (levee, app, login) = levee_with_a_second_route(
        "login",
        "{ method = [\"GET\"], path = \"/wp-login.php\", host = \"admin.example\" }",
    )
    .await;
    let send = |target: &str, method: &str, host: &str| {
        let raw =
            format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let levee = &levee;
        async move { exchange(levee, raw.as_bytes()).await }
    };
    // PATH_INFO runs the script in the usual PHP-FPM setup: the route holds for it.
    for target in ["/wp-login.php", "/wp-login.php/", "/wp-login.php/x/y"] {
        let answer = send(target, "GET", "admin.example").await;
        assert_eq!(status_of(&answer), Some(200), "{target}: {answer}");
    }
    assert_eq!((login.hits(), app.hits()), (3, 0));
    // HEAD is a GET without the body: PHP runs the whole script for it.
    let answer = send("/wp-login.php", "HEAD", "admin.example").await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    assert_eq!((login.hits(), app.hits()), (4, 0));
    // An encoded slash that the app reads as PATH_INFO: the route differs by reading, 400.
    let answer = send("/wp-login.php%2fx", "GET", "admin.example").await;
    assert_eq!(status_of(&answer), Some(400), "{answer}");
    // nginx ends the host at the first colon, so these reach admin.example's site: refused.
    for host in ["admin.example:1:2", "admin.example:80:", "admin.example:x"] {
        let answer = send("/wp-login.php", "GET", host).await;
        assert_eq!(status_of(&answer), Some(400), "{host}: {answer}");
    }
    // Not the script: another route.
    for target in ["/wp-login.phpx", "/wp-login.php.bak"] {
        let answer = send(target, "GET", "admin.example").await;
        assert_eq!(status_of(&answer), Some(200), "{target}: {answer}");
    }
    assert_eq!((login.hits(), app.hits()), (4, 2));
}

/// A front controller runs `/index.php/admin/users` as `/admin/users` (Symfony's and
/// Laravel's path info, WordPress's `index.php` permalinks). When that reading falls on a
/// route of another upstream than the path as written, neither is sure to be where the app
/// runs it: refused with the reason, not sent past the admin route's policy. (Readings on
/// the same upstream take the reading's route: the unit test in `config::compile`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_a_front_controller_reads_as_another_upstreams_route_are_refused() {
    let (levee, app, admin) =
        levee_with_a_second_route("admin", "{ path_prefix = \"/admin/\" }").await;
    let get = |target: &str| {
        let raw = format!("GET {target} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
        let levee = &levee;
        async move { exchange(levee, raw.as_bytes()).await }
    };
    let log = levee_log();
    for target in ["/index.php/admin/users", "/index.php/admin/"] {
        let answer = get(target).await;
        assert_eq!(status_of(&answer), Some(400), "{target}: {answer}");
        let reading = target.trim_start_matches("/index.php");
        // The client reads what its path means; the routes' names are the log's.
        assert!(
            answer.contains(&format!("a front controller reads this path as {reading}"))
                && !answer.contains("route `"),
            "{answer}"
        );
        assert!(
            log.lines_with(&format!("path={target}"))
                .iter()
                .any(|line| line.contains("route `admin` of another upstream")),
            "the log names the routes"
        );
    }
    for target in ["/admin/users", "/admin/index.php"] {
        let answer = get(target).await;
        assert_eq!(status_of(&answer), Some(200), "{target}: {answer}");
    }
    // Other scripts, and look-alikes of the index, are read as written.
    for target in [
        "/app.php/admin/users",
        "/index.phpx/admin/users",
        "/index.php",
    ] {
        let answer = get(target).await;
        assert_eq!(status_of(&answer), Some(200), "{target}: {answer}");
    }
    assert_eq!((admin.hits(), app.hits()), (2, 3));
}

/// Laravel, Symfony and most PHP frameworks run `POST` with `X-HTTP-Method-Override:
/// DELETE` (or `?_method=DELETE`) as a DELETE, a plain script as the POST it is: a request
/// whose two readings fall on different routes is refused with the reason, so neither
/// route's limits can be dodged by the override.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_override_that_changes_the_route_is_refused() {
    let (levee, app, deletes) = levee_with_a_second_route(
        "deletes",
        "{ method = [\"DELETE\"], path_prefix = \"/api/\" }",
    )
    .await;
    let send = |method: &str, target: &str, extra: &str| {
        let raw = format!(
            "{method} {target} HTTP/1.1\r\nHost: a\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let levee = &levee;
        async move { exchange(levee, raw.as_bytes()).await }
    };
    let log = levee_log();
    for (target, extra, named_by) in [
        (
            "/api/items/7",
            "X-HTTP-Method-Override: delete\r\n",
            "X-HTTP-Method-Override (DELETE)",
        ),
        (
            "/api/items/7?_method=DELETE",
            "",
            "the _method parameter (DELETE)",
        ),
    ] {
        let answer = send("POST", target, extra).await;
        assert_eq!(status_of(&answer), Some(400), "{target}: {answer}");
        assert!(
            answer.contains(&format!("{named_by} changes which part of the site this POST is for: send the request as DELETE itself")),
            "{answer}"
        );
        assert!(!answer.contains("deletes"), "no route is named: {answer}");
        assert!(
            log.lines_with(&format!("path={target}"))
                .iter()
                .any(|line| line.contains(&format!(
                    "{named_by} changes which route applies to this POST: "
                )) && line.contains("`deletes` as DELETE")),
            "the log names the routes"
        );
    }
    assert_eq!((deletes.hits(), app.hits()), (0, 0));
    // The same route either way, or no override: forwarded as it came.
    for (method, target, extra) in [
        ("POST", "/other", "X-HTTP-Method-Override: DELETE\r\n"),
        ("POST", "/api/items/7", "X-HTTP-Method-Override: PATCH\r\n"),
        ("POST", "/api/items/7", "X-HTTP-Method-Override: POST\r\n"),
        ("GET", "/api/items/7", "X-HTTP-Method-Override: DELETE\r\n"),
    ] {
        let answer = send(method, target, extra).await;
        assert_eq!(status_of(&answer), Some(200), "{method} {target}: {answer}");
    }
    let answer = send("DELETE", "/api/items/7", "").await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    assert_eq!((deletes.hits(), app.hits()), (1, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_egress_route_for_the_app_alone_is_not_reachable_through_the_front() {
    let (levee, app, egress) = levee_with_a_second_route(
        "ai_egress",
        "{ host = \"ai.egress\", client = [\"127.0.0.1/32\", \"::1/128\"] }",
    )
    .await;
    let send = |forwarded_for: Option<&str>| {
        let mut raw = String::from("GET /v1/secret HTTP/1.1\r\nHost: ai.egress\r\n");
        if let Some(chain) = forwarded_for {
            raw.push_str(&format!("X-Forwarded-For: {chain}\r\n"));
        }
        raw.push_str("Connection: close\r\n\r\n");
        let levee = &levee;
        async move { exchange(levee, raw.as_bytes()).await }
    };
    // The PHP app on this machine calls levee itself: the route is its.
    assert_eq!(status_of(&send(None).await), Some(200));
    assert_eq!((egress.hits(), app.hits()), (1, 0));
    // A visitor through the front nginx (which names the visitor in X-Forwarded-For) with
    // the same Host is not: the request goes where any other would.
    for chain in ["203.0.113.9", "127.0.0.1, 203.0.113.9"] {
        assert_eq!(status_of(&send(Some(chain)).await), Some(200));
    }
    assert_eq!((egress.hits(), app.hits()), (1, 2));
}
