//! The proxy path against in-process backends: fidelity, limits, timeouts, upgrades.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};

#[tokio::test]
async fn requests_reach_the_app_as_the_client_sent_them() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;

    for method in ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"] {
        let request = Request::builder()
            .method(method)
            .uri(levee.url("/forum/view.php?id=7&sort=new&q=%E4%B8%AD"))
            .header("host", "forum.example.com")
            .header("cookie", "PHPSESSID=abc; lang=zh")
            .header("user-agent", "Mozilla/5.0 (levee test)")
            .header("accept", "text/html")
            .header("accept-language", "zh-CN,zh;q=0.9")
            .header("x-custom", "one")
            .header("x-custom", "two")
            .body(full(format!("body of {method}")))
            .expect("request");
        let answer = send(request).await;
        assert_eq!(answer.status, 200);
        let echo = answer.json();
        assert_eq!(echo["method"], method);
        assert_eq!(echo["target"], "/forum/view.php?id=7&sort=new&q=%E4%B8%AD");
        assert_eq!(echoed_header(&echo, "host"), ["forum.example.com"]);
        assert_eq!(echoed_header(&echo, "cookie"), ["PHPSESSID=abc; lang=zh"]);
        assert_eq!(
            echoed_header(&echo, "user-agent"),
            ["Mozilla/5.0 (levee test)"]
        );
        assert_eq!(echoed_header(&echo, "accept-language"), ["zh-CN,zh;q=0.9"]);
        assert_eq!(echoed_header(&echo, "x-custom"), ["one", "two"]);
        assert_eq!(echo["body"], format!("body of {method}"));
        assert_eq!(echoed_header(&echo, "x-real-ip"), ["127.0.0.1"]);
        assert_eq!(echoed_header(&echo, "x-forwarded-for"), ["127.0.0.1"]);
        assert_eq!(echoed_header(&echo, "x-forwarded-proto"), ["http"]);
    }
    assert_eq!(backend.hits(), 6);
}

#[tokio::test]
async fn chunked_request_bodies_stream_through() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    let chunks = vec![
        Ok::<_, BoxError>(Frame::data(Bytes::from("hello "))),
        Ok(Frame::data(Bytes::from("world"))),
    ];
    let body = StreamBody::new(futures_util::stream::iter(chunks)).boxed_unsync();
    let answer = send(
        Request::post(levee.url("/chunked"))
            .body(body)
            .expect("request"),
    )
    .await;
    let echo = answer.json();
    assert_eq!(echo["body"], "hello world");
    assert_eq!(echoed_header(&echo, "transfer-encoding"), ["chunked"]);
    assert!(echoed_header(&echo, "content-length").is_empty());
}

#[tokio::test]
async fn responses_come_back_unchanged() {
    let backend = Backend::start(|request: Request<Incoming>| async move {
        let path = request.uri().path().to_string();
        let mut builder = Response::builder();
        let body = match path.as_str() {
            "/login" => {
                builder = builder
                    .status(302)
                    .header("location", "http://forum.example.com/home.php")
                    .header("set-cookie", "PHPSESSID=s1; path=/; HttpOnly")
                    .header("set-cookie", "remember=1; Secure")
                    .header("cache-control", "private, max-age=0")
                    .header("etag", "\"v1\"");
                ""
            }
            "/empty" => {
                builder = builder.status(204);
                ""
            }
            "/cached" => {
                builder = builder.status(304).header("etag", "\"v1\"");
                ""
            }
            _ => "plain",
        };
        builder.body(full(body)).expect("response")
    })
    .await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;

    let login = get(&levee.url("/login")).await;
    assert_eq!(login.status, 302);
    assert_eq!(
        login.header("location"),
        Some("http://forum.example.com/home.php")
    );
    let cookies: Vec<_> = login
        .headers
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().expect("ascii"))
        .collect();
    assert_eq!(
        cookies,
        ["PHPSESSID=s1; path=/; HttpOnly", "remember=1; Secure"]
    );
    assert_eq!(login.header("cache-control"), Some("private, max-age=0"));
    assert_eq!(login.header("etag"), Some("\"v1\""));

    let empty = get(&levee.url("/empty")).await;
    assert_eq!(empty.status, 204);
    assert!(empty.body.is_empty());
    let cached = get(&levee.url("/cached")).await;
    assert_eq!(cached.status, 304);
    assert!(cached.body.is_empty());
    assert_eq!(cached.header("etag"), Some("\"v1\""));
}

#[tokio::test]
async fn hop_by_hop_headers_are_removed_both_ways() {
    let backend = Backend::start(|request: Request<Incoming>| async move {
        let seen: Vec<String> = request.headers().keys().map(|k| k.to_string()).collect();
        Response::builder()
            .header("connection", "x-upstream-secret")
            .header("x-upstream-secret", "1")
            .header("keep-alive", "timeout=5")
            .header("x-seen", seen.join(","))
            .body(full("ok"))
            .expect("response")
    })
    .await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    let raw = raw_exchange(
        levee.public,
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close, x-client-secret\r\nX-Client-Secret: 1\r\nKeep-Alive: 300\r\nTE: trailers\r\nProxy-Connection: keep-alive\r\nX-Kept: yes\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    let lower = raw.to_ascii_lowercase();
    let seen = lower
        .lines()
        .find(|l| l.starts_with("x-seen:"))
        .expect("x-seen header")
        .to_string();
    for gone in ["x-client-secret", "keep-alive", "te", "proxy-connection"] {
        assert!(
            !seen.split([':', ',', ' ']).any(|h| h == gone),
            "{gone} was forwarded: {seen}"
        );
    }
    assert!(seen.contains("x-kept"), "{seen}");
    assert!(!lower.contains("x-upstream-secret"), "{raw}");
    assert!(!lower.contains("keep-alive: timeout"), "{raw}");
}

#[tokio::test]
async fn spoofed_forwarded_headers_from_untrusted_peers_are_ignored() {
    let backend = echo_backend().await;
    // Nobody is trusted: the test client on loopback is an ordinary client here.
    let levee = Levee::start(&policy_for(backend.addr, "trusted_proxies = []", "")).await;
    let request = Request::get(levee.url("/"))
        .header("x-forwarded-for", "6.6.6.6")
        .header("x-real-ip", "6.6.6.6")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "evil.example")
        .header("forwarded", "for=6.6.6.6;host=evil.example;proto=https")
        .header("x-forwarded-ssl", "on")
        .body(full(""))
        .expect("request");
    let echo = send(request).await.json();
    assert_eq!(echoed_header(&echo, "x-real-ip"), ["127.0.0.1"]);
    assert_eq!(echoed_header(&echo, "x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(echoed_header(&echo, "x-forwarded-proto"), ["http"]);
    // Nor does the app hear from it which host or scheme the visitor used.
    for claim in ["x-forwarded-host", "forwarded", "x-forwarded-ssl"] {
        assert!(echoed_header(&echo, claim).is_empty(), "{claim}: {echo}");
    }

    // From a trusted front, the chain is believed and passed on as it came (its last entry
    // stays the client the front saw, as the app saw it without levee).
    let trusted = Levee::start(&policy_for(backend.addr, "", "")).await;
    let request = Request::get(trusted.url("/"))
        .header("x-forwarded-for", "203.0.113.7")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "shop.example")
        .body(full(""))
        .expect("request");
    let echo = send(request).await.json();
    assert_eq!(echoed_header(&echo, "x-real-ip"), ["203.0.113.7"]);
    assert_eq!(echoed_header(&echo, "x-forwarded-for"), ["203.0.113.7"]);
    assert_eq!(echoed_header(&echo, "x-forwarded-proto"), ["https"]);
    assert_eq!(echoed_header(&echo, "x-forwarded-host"), ["shop.example"]);
}

#[tokio::test]
async fn upstream_host_override_replaces_the_client_host() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "host = \"internal.example\"")).await;
    let echo = get(&levee.url("/")).await.json();
    assert_eq!(echoed_header(&echo, "host"), ["internal.example"]);
}

#[tokio::test]
async fn oversized_headers_get_431() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "max_header_bytes = \"2KiB\"", "")).await;
    let request = Request::get(levee.url("/"))
        .header("x-big", "a".repeat(3000))
        .body(full(""))
        .expect("request");
    let answer = send(request).await;
    assert_eq!(answer.status, 431);
    assert!(
        answer.text().contains("over the limit of 2048"),
        "{}",
        answer.text()
    );
    // Far over hyper's own buffer: refused while parsing, never reaches the app.
    let huge = format!(
        "GET / HTTP/1.1\r\nHost: a\r\nX-Huge: {}\r\n\r\n",
        "b".repeat(200_000)
    );
    let raw = raw_exchange(levee.public, huge.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        raw.starts_with("HTTP/1.1 431"),
        "{}",
        &raw[..raw.len().min(200)]
    );
    assert_eq!(backend.hits(), 0);
}

#[tokio::test]
async fn bodies_over_the_route_limit_get_413() {
    let backend = echo_backend().await;
    let routes = "[[route]]\nname = \"upload\"\nmatch = { path = \"/upload\" }\nmax_body = 1000\n";
    let levee = Levee::start(&policy_for(backend.addr, "", routes)).await;

    let answer = post(&levee.url("/upload"), &"x".repeat(1001)).await;
    assert_eq!(answer.status, 413);
    assert!(answer.text().contains("1000 bytes"), "{}", answer.text());
    assert_eq!(
        backend.hits(),
        0,
        "a body with a too-large Content-Length is refused before forwarding"
    );

    // Chunked: the size is only known while streaming.
    let chunks: Vec<Result<Frame<Bytes>, BoxError>> = (0..20)
        .map(|_| Ok(Frame::data(Bytes::from(vec![b'y'; 100]))))
        .collect();
    let body = StreamBody::new(futures_util::stream::iter(chunks)).boxed_unsync();
    let answer = send(
        Request::post(levee.url("/upload"))
            .body(body)
            .expect("request"),
    )
    .await;
    assert_eq!(answer.status, 413);

    let fits = post(&levee.url("/upload"), &"x".repeat(1000)).await;
    assert_eq!(fits.status, 200);
    // Other routes keep the server default.
    assert_eq!(
        post(&levee.url("/other"), &"x".repeat(5000)).await.status,
        200
    );
}

#[tokio::test]
async fn refused_upstream_is_502_and_slow_upstream_is_504() {
    let dead = free_port();
    let policy = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.dead]\nurl = \"http://[::1]:{dead}\"\n[upstream.slow]\nurl = \"http://SLOW\"\nresponse_timeout = \"300ms\"\n[[route]]\nname = \"slow\"\nmatch = {{ path_prefix = \"/slow\" }}\nupstream = \"slow\"\n[[route]]\nname = \"dead\"\nmatch = {{ path_prefix = \"/\" }}\nupstream = \"dead\"\n"
    );
    let slow = Backend::start(|_request: Request<Incoming>| async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Response::new(full("too late"))
    })
    .await;
    let levee = Levee::start(&policy.replace("SLOW", &slow.addr.to_string())).await;

    let log = levee_log();
    let refused = get(&levee.url("/anything")).await;
    assert_eq!(refused.status, 502);
    // The visitor reads what happened, not where: no upstream name, no address, no
    // library's words (it read "upstream `dead` could not be reached: connect to …").
    assert_eq!(
        refused.text(),
        visitor_page(
            "Bad gateway",
            "The site could not answer this request. Please try again later."
        )
    );
    assert_eq!(refused.header("retry-after"), None);
    // The operator reads it all in the log. An IPv6 address is named as in a URL (it read
    // `::1:PORT`).
    let reason = format!("connect to [::1]:{dead}");
    assert!(
        log.lines_with(&reason)
            .iter()
            .any(|line| line.contains("upstream `dead` could not be reached")),
        "no log line says {reason:?}"
    );

    let started = std::time::Instant::now();
    let slow_answer = get_with(&levee.url("/slow"), &[("accept", "application/json")]).await;
    assert_eq!(slow_answer.status, 504);
    assert_eq!(slow_answer.text(), "{\"error\":\"gateway_timeout\"}\n");
    assert!(
        !log.lines_with("upstream `slow`: no answer within 300ms")
            .is_empty(),
        "the log names the upstream and its timeout"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the client was held past the timeout"
    );

    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains("levee_upstream_errors_total{upstream=\"dead\",kind=\"connect\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("levee_upstream_errors_total{upstream=\"slow\",kind=\"timeout\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("levee_requests_total{route=\"dead\",status=\"502\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_client_that_hangs_up_early_is_counted_as_499_and_leaves_nothing_in_flight() {
    let slow = Backend::start(|_request: Request<Incoming>| async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Response::new(full("too late"))
    })
    .await;
    let levee = Levee::start(&policy_for(slow.addr, "", "")).await;
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    stream
        .write_all(b"GET /report HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("write");
    eventually(
        Duration::from_secs(5),
        "the request to reach the app",
        || async { slow.hits() == 1 },
    )
    .await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_inflight_requests"),
        1.0,
        "{metrics}"
    );
    drop(stream);
    eventually(
        Duration::from_secs(5),
        "the cancelled request to be counted",
        || async {
            let metrics = get(&levee.admin_url("/metrics")).await.text();
            metric_value(&metrics, "levee_inflight_requests") == 0.0
                && metric_value(
                    &metrics,
                    "levee_requests_total{route=\"default\",status=\"499\"}",
                ) == 1.0
        },
    )
    .await;
}

#[tokio::test]
async fn slowloris_clients_are_cut_off_by_the_header_timeout() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "header_read_timeout = \"300ms\"",
        "",
    ))
    .await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        .await
        .expect("write");
    let started = std::time::Instant::now();
    let mut buffer = Vec::new();
    // The server must close the connection on its own, well before this deadline.
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buffer)).await;
    assert!(read.is_ok(), "levee kept a slowloris connection open");
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert_eq!(backend.hits(), 0);
}

#[tokio::test]
async fn health_endpoints_are_answered_by_levee_itself() {
    let dead = free_port();
    let levee = Levee::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nreadyz_path = \"/-/ready\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.app]\nurl = \"http://127.0.0.1:{dead}\"\n"
    ))
    .await;
    let live = get(&levee.url("/livez")).await;
    assert_eq!((live.status, live.text().as_str()), (200, "ok\n"));
    let ready = get(&levee.url("/-/ready")).await;
    assert_eq!((ready.status, ready.text().as_str()), (200, "ready\n"));
    // The old default path is now an ordinary (proxied, here failing) path.
    assert_eq!(get(&levee.url("/readyz")).await.status, 502);
}

#[tokio::test]
async fn bad_paths_get_400_and_dodges_land_on_the_same_route() {
    let backend = echo_backend().await;
    let other = echo_backend().await;
    let routes = format!(
        "[upstream.other]\nurl = \"http://{}\"\n[[route]]\nname = \"ranking\"\nmatch = {{ path_prefix = \"/ranking\" }}\nupstream = \"other\"\n[server2]",
        other.addr
    )
    .replace("[server2]", "");
    let policy = policy_for(backend.addr, "default_upstream = \"app\"", &routes);
    let levee = Levee::start(&policy).await;
    for dodge in [
        "/ranking",
        "/./ranking",
        "//ranking",
        "/%72anking",
        "/x/../ranking",
    ] {
        let answer = get(&levee.url(dodge)).await;
        assert_eq!(answer.status, 200, "{dodge}");
        // The app still gets the target exactly as sent.
        assert_eq!(answer.json()["target"], dodge);
    }
    assert_eq!(other.hits(), 5);
    assert_eq!(backend.hits(), 0);
    let raw = raw_exchange(
        levee.public,
        b"GET /a%zz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    assert!(raw.contains("invalid percent-encoding"), "{raw}");
}

#[tokio::test]
async fn websocket_echo_passes_through() {
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
                    if message.is_text() || message.is_binary() {
                        let _ = socket.send(message).await;
                    }
                }
            });
        }
    });
    let levee = Levee::start(&policy_for(ws_addr, "", "")).await;
    let (mut socket, response) =
        tokio_tungstenite::connect_async(format!("ws://{}/chat", levee.public))
            .await
            .expect("websocket handshake through levee");
    assert_eq!(response.status(), 101);
    for text in ["hello", "你好", "third"] {
        socket
            .send(tokio_tungstenite::tungstenite::Message::text(text))
            .await
            .expect("send");
        let echoed = socket.next().await.expect("a message").expect("no error");
        assert_eq!(echoed.into_text().expect("text").as_str(), text);
    }
    // The tunnel counts as a connection towards max_connections while it lives.
    let open = || async {
        metric_value(
            &get(&levee.admin_url("/metrics")).await.text(),
            "levee_connections_open",
        )
    };
    assert_eq!(open().await, 1.0);
    socket.close(None).await.expect("close");
    drop(socket);
    eventually(
        Duration::from_secs(10),
        "the tunnel to be let go",
        || async { open().await == 0.0 },
    )
    .await;
}

/// Sends one keep-alive GET on `stream` and reads until its (small) answer is whole.
async fn get_on(stream: &mut tokio::net::TcpStream, path: &str) -> String {
    use tokio::io::AsyncWriteExt;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n").as_bytes())
        .await
        .expect("write");
    read_answer(stream).await
}

/// Reads one answer with a `Content-Length` from `stream`.
async fn read_answer(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&seen).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|line| {
                    line.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_string)
                })
                .and_then(|value| value.trim().parse::<usize>().ok());
            if length.is_some_and(|length| body.len() >= length) {
                return text;
            }
        }
        let read = stream.read(&mut chunk).await.expect("read");
        assert!(read > 0, "closed before the answer was whole: {text}");
        seen.extend_from_slice(&chunk[..read]);
    }
}

/// At `max_connections`, a new connection waits in the listen backlog, its request
/// unanswered, until one of the open ones closes; then it is served. The admin listener is
/// not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_a_new_connection_waits_until_one_closes() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false\nmax_connections = 2",
        "",
    ))
    .await;
    let connect = || async {
        tokio::net::TcpStream::connect(levee.public)
            .await
            .expect("connect")
    };
    let mut first = connect().await;
    let mut second = connect().await;
    assert!(get_on(&mut first, "/one").await.starts_with("HTTP/1.1 200"));
    assert!(get_on(&mut second, "/two")
        .await
        .starts_with("HTTP/1.1 200"));
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_connections_open"),
        2.0,
        "{metrics}"
    );
    eventually(
        Duration::from_secs(5),
        "the listener to stop accepting",
        || async {
            let metrics = get(&levee.admin_url("/metrics")).await.text();
            metric_value(&metrics, "levee_connection_cap_waits_total") == 1.0
        },
    )
    .await;

    let mut third = connect().await;
    let waiting = {
        use tokio::io::AsyncWriteExt;
        third
            .write_all(b"GET /three HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .expect("write");
        tokio::time::timeout(Duration::from_millis(300), read_answer(&mut third)).await
    };
    assert!(waiting.is_err(), "answered past the cap: {waiting:?}");
    assert_eq!(get(&levee.admin_url("/status")).await.status, 200);

    drop(first);
    let answer = tokio::time::timeout(Duration::from_secs(10), read_answer(&mut third))
        .await
        .expect("the waiting connection is served once one closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(get_on(&mut second, "/two-again")
        .await
        .starts_with("HTTP/1.1 200"));
}

/// Resident memory of this test process, in bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("proc status");
    let kb: u64 = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|kb| kb.parse().ok())
        .expect("VmRSS");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_body_streams_both_ways_in_flat_memory() {
    const TOTAL: usize = 100 * 1024 * 1024;
    const CHUNK: usize = 64 * 1024;
    // The backend counts the upload without keeping it, then streams 100 MB back.
    let backend = Backend::start(|request: Request<Incoming>| async move {
        let mut body = request.into_body();
        let mut received = 0usize;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.expect("upload frame").into_data() {
                received += data.len();
            }
        }
        let chunks = (0..TOTAL / CHUNK)
            .map(|_| Ok::<_, BoxError>(Frame::data(Bytes::from(vec![b'd'; CHUNK]))));
        Response::builder()
            .header("x-received", received.to_string())
            .header("content-length", TOTAL.to_string())
            .body(StreamBody::new(futures_util::stream::iter(chunks)).boxed_unsync())
            .expect("response")
    })
    .await;
    let levee = Levee::start(&policy_for(backend.addr, "max_body = \"200MiB\"", "")).await;
    let baseline = rss_bytes();
    let upload =
        (0..TOTAL / CHUNK).map(|_| Ok::<_, BoxError>(Frame::data(Bytes::from(vec![b'u'; CHUNK]))));
    let request = Request::post(levee.url("/upload"))
        .header("content-length", TOTAL.to_string())
        .body(StreamBody::new(futures_util::stream::iter(upload)).boxed_unsync())
        .expect("request");
    let response = client().request(request).await.expect("response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-received"], TOTAL.to_string().as_str());
    let mut body = response.into_body();
    let mut downloaded = 0usize;
    let mut peak = baseline;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("download frame").into_data() {
            downloaded += data.len();
        }
        peak = peak.max(rss_bytes());
    }
    assert_eq!(downloaded, TOTAL);
    let growth = peak.saturating_sub(baseline);
    assert!(
        growth < 40 * 1024 * 1024,
        "memory grew by {} MiB while streaming 100 MiB",
        growth / (1024 * 1024)
    );
}

/// A PHP page may set a couple of hundred cookies (nginx counts no fields): every one
/// reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_hundreds_of_cookies_passes_whole() {
    let backend = Backend::start(|_request: Request<Incoming>| async move {
        let mut response = Response::builder().status(200);
        for n in 0..300 {
            response = response.header("set-cookie", format!("c{n}=v{n}; path=/"));
        }
        response.body(full("ok")).expect("response")
    })
    .await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    // Read raw: the test's own HTTP client stops at 100 fields.
    let answer = raw_exchange(
        levee.public,
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(
        answer.to_ascii_lowercase().matches("set-cookie: c").count(),
        300
    );
}

/// A PHP page's own reason phrase (`header("HTTP/1.1 404 Not Here")`) reaches the client as
/// written, as through nginx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_lines_own_wording_is_passed_on() {
    let backend = raw_backend(|head| {
        let line = if head.starts_with(b"GET /teapot") {
            "HTTP/1.1 418 I am a teapot"
        } else if head.starts_with(b"GET /custom") {
            "HTTP/1.1 299 Custom Reason"
        } else if head.starts_with(b"GET /plain") {
            "HTTP/1.1 200 OK"
        } else {
            "HTTP/1.1 404 Not Here"
        };
        format!("{line}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok").into_bytes()
    })
    .await;
    let levee = Levee::start(&policy_for(backend, "", "")).await;
    for (path, line) in [
        ("/teapot", "HTTP/1.1 418 I am a teapot\r\n"),
        ("/custom", "HTTP/1.1 299 Custom Reason\r\n"),
        ("/plain", "HTTP/1.1 200 OK\r\n"),
        ("/missing.php", "HTTP/1.1 404 Not Here\r\n"),
    ] {
        let request = format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
        let answer = raw_exchange(levee.public, request.as_bytes(), Duration::from_secs(5)).await;
        assert!(answer.starts_with(line), "{path}: {answer}");
    }
}

/// Answers that levee reads before passing them on (a stale route's pages, a page with a
/// module hidden) and a stale copy served later name the app's fields as the app spelled
/// them too, and levee's own fields in their usual capitalisation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn field_names_keep_their_spelling_on_pages_levee_reads_and_on_stale_copies() {
    let backend = raw_backend(|_head| {
        let page = "<html><body><p>top</p><!-- levee:module ads --><aside>ad</aside><!-- /levee:module ads --></body></html>";
        format!(
            "HTTP/1.1 200 OK\r\nX-Page-Cache: MISS\r\nContent-Type: text/html\r\nx-lower: 1\r\nETag: \"v1\"\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
            page.len()
        )
        .into_bytes()
    })
    .await;
    let routes = r#"
[[route]]
name = "home"
match = { path = "/home.php" }
hide = { ads = "marker" }

[[route]]
name = "ranking"
match = { path = "/ranking.php" }
tier = 3
module = "ranking"
degrade = { action = "stale", max_age = "10m" }
"#;
    let levee = Levee::start(&policy_for(backend, "", routes)).await;
    let get = |path: &str| {
        format!("GET {path} HTTP/1.1\r\nHost: shop.example\r\nConnection: close\r\n\r\n")
    };
    let app_fields = [
        "\r\nX-Page-Cache: MISS\r\n",
        "\r\nContent-Type: text/html\r\n",
        "\r\nx-lower: 1\r\n",
        "\r\nETag: \"v1\"\r\n",
    ];
    let fresh = raw_exchange(
        levee.public,
        get("/ranking.php").as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    for off in ["ranking", "ads"] {
        let switched = post(&levee.admin_url(&format!("/modules/{off}")), "off").await;
        assert_eq!(switched.status, 200, "{}", switched.text());
    }
    let copy = raw_exchange(
        levee.public,
        get("/ranking.php").as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    let hidden = raw_exchange(
        levee.public,
        get("/home.php").as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert!(
        copy.contains("\r\nX-Levee-Stale: 1\r\n") && copy.contains("\r\nAge: "),
        "{copy}"
    );
    assert!(!hidden.contains("<aside>"), "{hidden}");
    for (what, answer) in [("fresh", &fresh), ("copy", &copy), ("hidden", &hidden)] {
        assert!(
            answer.starts_with("HTTP/1.1 200 OK\r\n"),
            "{what}: {answer}"
        );
        for line in app_fields {
            // A rewritten page is another entity: its ETag is dropped.
            let dropped = what == "hidden" && line.contains("ETag");
            assert_eq!(
                answer.contains(line),
                !dropped,
                "{what}: {line:?} in {answer}"
            );
        }
    }
}

/// The app gets each field named as the client spelled it (PHP's `getallheaders()` under
/// Apache's mod_php keys its array by that spelling), levee's own forwarding fields in their
/// usual capitalisation, and a 304 goes back with the app's spelling too, as through nginx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn field_names_keep_their_spelling_both_ways() {
    let backend = raw_backend(|head| {
        if head.starts_with(b"GET /cached") {
            return b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nX-Page-Cache: HIT\r\n\r\n".to_vec();
        }
        // The request head, as the app got it, in the body.
        let mut answer = format!(
            "HTTP/1.1 200 OK\r\nX-Page-Cache: MISS\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            head.len()
        )
        .into_bytes();
        answer.extend_from_slice(head);
        answer
    })
    .await;
    let levee = Levee::start(&policy_for(backend, "", "")).await;
    let request = b"GET /form.php HTTP/1.1\r\nHost: shop.example\r\nX-Requested-With:XMLHttpRequest\r\nX-API-Key:  k1\r\nauthorization: Basic eA==\r\nDNT: 1\r\nX-Empty:\r\nAccept: */*\r\nAccept: text/html\r\nConnection: close\r\n\r\n";
    let answer = raw_exchange(levee.public, request, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("\r\nX-Page-Cache: MISS\r\n"), "{answer}");
    let (_, seen) = answer.split_once("\r\n\r\n").expect("a body");
    for line in [
        "\r\nHost: shop.example\r\n",
        "\r\nX-Requested-With: XMLHttpRequest\r\n",
        "\r\nX-API-Key: k1\r\n",
        "\r\nauthorization: Basic eA==\r\n",
        "\r\nDNT: 1\r\n",
        "\r\nX-Empty: \r\n",
        "\r\nAccept: */*\r\n",
        "\r\nAccept: text/html\r\n",
        "\r\nX-Forwarded-For: 127.0.0.1\r\n",
        "\r\nX-Real-IP: 127.0.0.1\r\n",
        "\r\nX-Forwarded-Proto: http\r\n",
    ] {
        assert!(seen.contains(line), "{line:?} in {seen}");
    }

    let request = b"GET /cached HTTP/1.1\r\nHost: shop.example\r\nIf-None-Match: \"v1\"\r\nConnection: close\r\n\r\n";
    let answer = raw_exchange(levee.public, request, Duration::from_secs(5)).await;
    assert!(
        answer.starts_with("HTTP/1.1 304 Not Modified\r\n"),
        "{answer}"
    );
    assert!(answer.contains("\r\nETag: \"v1\"\r\n"), "{answer}");
    assert!(answer.contains("\r\nX-Page-Cache: HIT\r\n"), "{answer}");
}

/// An app whose nginx vhost listens on a unix socket is reached through it, keep-alive kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_on_a_unix_socket_is_reached_through_it() {
    let dir = tempfile::tempdir().expect("dir");
    open_up(dir.path());
    let socket = dir.path().join("app.sock");
    let block = format!(
        "server {{\n listen 127.0.0.1:{{port}};\n listen unix:{socket};\n location / {{ return 200 \"via socket $request_uri $http_x_real_ip $http_host\"; }}\n}}",
        socket = socket.display()
    );
    let _nginx = Nginx::start(dir.path(), &block).await;
    let policy = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[upstream.app]\nurl = \"http://app.internal\"\nsocket = \"{socket}\"\n",
        socket = socket.display()
    );
    let levee = Levee::start(&policy).await;
    for i in 0..3 {
        let request = Request::get(levee.url(&format!("/page?{i}")))
            .header("host", "forum.example.com")
            .body(full(""))
            .expect("request");
        let answer = send(request).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(
            answer.text(),
            format!("via socket /page?{i} 127.0.0.1 forum.example.com")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_a_byte_per_chunk_arrives_whole() {
    // Small chunks are joined as they are decoded (and as bodies are kept): across reads,
    // inside the read-ahead of a PUT, and past it.
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", "")).await;
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    for (method, count) in [("PUT", 50_000), ("POST", 300_000)] {
        let body: Vec<u8> = (0..count).map(|i| LETTERS[i % 26]).collect();
        // Made as they are sent: this process's memory is measured by another test.
        let pieces = (0..count).map(|i| {
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(
                &LETTERS[i % 26..i % 26 + 1],
            )))
        });
        let request = Request::builder()
            .method(method)
            .uri(levee.url("/tiny"))
            .body(StreamBody::new(futures_util::stream::iter(pieces)).boxed_unsync())
            .expect("request");
        let echo = send(request).await.json();
        assert_eq!(echo["body_len"], count, "{method}");
        assert!(
            echo["body"].as_str() == Some(std::str::from_utf8(&body).expect("ascii")),
            "{method}: the body arrives as sent"
        );
    }
}

/// The query parameters the policy reads API keys and users from are credentials: log lines
/// show their values as `***` (Redis keys hash them; the log had them in clear).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_in_the_query_are_hidden_in_log_lines() {
    let log = levee_log();
    let backend = echo_backend().await;
    let secret = format!("S3CRET{}", free_port());
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = true",
        "[identity]\napi_key = \"query:api_key\"\n",
    ))
    .await;
    let answer = get(&levee.url(&format!("/api/items?page=2&api_key={secret}"))).await;
    assert_eq!(answer.status, 200);
    eventually(Duration::from_secs(5), "the access log line", || async {
        !log.lines_with("path=/api/items?page=2&api_key=***")
            .is_empty()
    })
    .await;
    // With the host it was routed by: one levee before several sites tells them apart.
    let host = format!("host={} path=/api/items?page=2", levee.public);
    assert!(!log.lines_with(&host).is_empty(), "{host}");
    assert!(
        log.lines_with(&secret).is_empty(),
        "{:?}",
        log.lines_with(&secret)
    );
}

/// A request head levee refuses before any route (a Host with `@`, HTTP/1.1 without Host) is
/// said in the log as other refusals are: a site whose visitors report 400s found no trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_refused_before_routing_is_said_in_the_log() {
    let log = levee_log();
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", "")).await;
    let answer = raw_exchange(
        levee.public,
        b"GET /refused-head HTTP/1.1\r\nHost: a@b.example\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    eventually(Duration::from_secs(5), "the refusal's line", || async {
        !log.lines_with("request head refused: invalid Host field")
            .is_empty()
    })
    .await;
}

/// The CORS fields levee sets on its own answers, when any is there.
fn cors_fields(answer: &Answer) -> Vec<String> {
    answer
        .headers
        .keys()
        .map(|name| name.as_str().to_string())
        .filter(|name| name.starts_with("access-control-"))
        .collect()
}

/// A policy whose page route is held to one request a minute per client, with `server` in
/// `[server]`.
fn cors_limited_policy(backend: &Backend, server: &str) -> String {
    policy_for(
        backend.addr,
        &format!("access_log = false\n{server}"),
        "[limit.page]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 1\n[[route]]\nname = \"page\"\nmatch = { path_prefix = \"/api\" }\nlimits = [\"page\"]\n",
    )
}

#[tokio::test]
async fn cors_a_429_can_be_read_by_a_page_of_an_allowed_origin_only() {
    let backend = echo_backend().await;
    let levee = Levee::start(&cors_limited_policy(
        &backend,
        "cors_origins = [\"https://App.example/\"]",
    ))
    .await;
    let url = levee.url("/api/items");
    let from = |origin: &'static str| {
        let url = url.clone();
        async move { get_with(&url, &[("origin", origin), ("accept", "application/json")]).await }
    };
    let admitted = from("https://app.example").await;
    assert_eq!(admitted.status, 200);
    assert!(
        cors_fields(&admitted).is_empty(),
        "the app's answer is the app's: {:?}",
        admitted.headers
    );

    let refused = from("https://app.example").await;
    assert_eq!(refused.status, 429);
    assert_eq!(
        refused.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert_eq!(
        refused.header("access-control-allow-credentials"),
        Some("true")
    );
    assert_eq!(
        refused.header("access-control-expose-headers"),
        Some("Retry-After, RateLimit, RateLimit-Policy, X-Levee-Job")
    );
    assert!(
        refused
            .headers
            .get_all("vary")
            .iter()
            .any(|vary| vary.as_bytes().eq_ignore_ascii_case(b"origin")),
        "{:?}",
        refused.headers
    );
    assert!(refused.header("retry-after").is_some());

    let other_site = from("https://evil.example").await;
    assert_eq!(other_site.status, 429);
    assert!(
        cors_fields(&other_site).is_empty(),
        "{:?}",
        other_site.headers
    );
    assert!(other_site.header("vary").is_none());
}

/// A policy whose only upstream has a breaker, with `server` in `[server]`.
fn cors_breaker_policy(backend: &Backend, server: &str) -> String {
    policy_for(
        backend.addr,
        &format!("access_log = false\n{server}"),
        "breaker = { consecutive_failures = 5 }\n",
    )
}

/// `OPTIONS /api/items` as a browser sends it before a `PUT` with its own fields.
async fn preflight(levee: &Levee, origin: &str) -> Answer {
    send(
        Request::options(levee.url("/api/items"))
            .header("origin", origin)
            .header("access-control-request-method", "PUT")
            .header(
                "access-control-request-headers",
                "content-type,x-csrf-token",
            )
            .body(full(""))
            .expect("request"),
    )
    .await
}

#[tokio::test]
async fn cors_a_preflight_levee_would_refuse_is_answered_by_levee() {
    let backend = echo_backend().await;
    let levee = Levee::start(&cors_breaker_policy(
        &backend,
        "cors_origins = [\"https://app.example\"]",
    ))
    .await;

    // The app answers its own preflights while it can.
    let hits = backend.hits();
    let by_app = preflight(&levee, "https://app.example").await;
    assert_eq!(by_app.status, 200);
    assert_eq!(by_app.json()["method"], "OPTIONS");
    assert_eq!(backend.hits(), hits + 1);
    assert!(cors_fields(&by_app).is_empty(), "{:?}", by_app.headers);

    let pinned = post(&levee.admin_url("/breakers/app"), "open").await;
    assert_eq!(pinned.status, 200, "{}", pinned.text());

    let answered = preflight(&levee, "https://app.example").await;
    assert_eq!(answered.status, 204, "{}", answered.text());
    assert_eq!(
        answered.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert_eq!(
        answered.header("access-control-allow-credentials"),
        Some("true")
    );
    assert_eq!(answered.header("access-control-allow-methods"), Some("PUT"));
    assert_eq!(
        answered.header("access-control-allow-headers"),
        Some("content-type,x-csrf-token")
    );
    assert_eq!(answered.header("access-control-max-age"), Some("60"));
    assert!(answered.body.is_empty());
    assert_eq!(backend.hits(), hits + 1, "the app was not called");

    let refused = get_with(
        &levee.url("/api/items"),
        &[("origin", "https://app.example")],
    )
    .await;
    assert_eq!(refused.status, 503);
    assert_eq!(
        refused.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert!(refused.header("retry-after").is_some());

    // A page of a site not listed is refused as before.
    let other_site = preflight(&levee, "https://evil.example").await;
    assert_eq!(other_site.status, 503);
    assert!(
        cors_fields(&other_site).is_empty(),
        "{:?}",
        other_site.headers
    );
}

#[tokio::test]
async fn cors_without_cors_origins_levee_answers_carry_no_cors_field() {
    let backend = echo_backend().await;
    let levee = Levee::start(&cors_breaker_policy(&backend, "")).await;
    let pinned = post(&levee.admin_url("/breakers/app"), "open").await;
    assert_eq!(pinned.status, 200, "{}", pinned.text());

    let refused = get_with(
        &levee.url("/api/items"),
        &[("origin", "https://app.example")],
    )
    .await;
    assert_eq!(refused.status, 503);
    assert!(cors_fields(&refused).is_empty(), "{:?}", refused.headers);
    assert!(refused.header("vary").is_none());
    let preflight = preflight(&levee, "https://app.example").await;
    assert_eq!(preflight.status, 503);
    assert!(
        cors_fields(&preflight).is_empty(),
        "{:?}",
        preflight.headers
    );
}

// ---------------------------------------------------------------------------------------
// answer_format: the form of levee's own answers, whatever the client's `Accept`

/// levee's own answer `answer` is JSON: its content type says so and its body parses.
fn assert_json_answer(answer: &Answer, what: &str) -> serde_json::Value {
    let content_type = answer.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("application/json"),
        "{what}: {content_type} {}",
        answer.text()
    );
    serde_json::from_slice(&answer.body)
        .unwrap_or_else(|error| panic!("{what}: not JSON ({error}): {}", answer.text()))
}

fn assert_html_answer(answer: &Answer, what: &str) {
    let content_type = answer.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("text/html"),
        "{what}: {content_type} {}",
        answer.text()
    );
}

/// A route switched off (tier 3 at level 1) and one whose upstream's breaker the policy pins
/// open, on `backend`; `server` and `route_extra` (for the switched-off route) added.
fn off_and_pinned_policy(backend: &Backend, server: &str, route_extra: &str) -> String {
    policy_for(
        backend.addr,
        &format!("access_log = false\ndefault_upstream = \"app\"\n{server}"),
        &format!(
            "[upstream.pinned]\nurl = \"http://{}\"\nbreaker = {{ force = \"open\" }}\n[degrade]\nlevel = 1\n[[route]]\nname = \"off\"\nmatch = {{ path_prefix = \"/off\" }}\nupstream = \"app\"\ntier = 3\n{route_extra}\n[[route]]\nname = \"pinned\"\nmatch = {{ path_prefix = \"/pinned\" }}\nupstream = \"pinned\"\n",
            backend.addr
        ),
    )
}

/// An API client without `Accept` (OkHttp) or with `*/*` (curl) reads levee's 503s as JSON
/// on a site whose `[server] answer_format` is "json", as its head refused as unreadable.
#[tokio::test]
async fn answer_format_json_gives_json_503s_to_clients_without_accept() {
    let backend = echo_backend().await;
    let levee = Levee::start(&off_and_pinned_policy(
        &backend,
        "answer_format = \"json\"",
        "",
    ))
    .await;
    for path in ["/off/items", "/pinned/items"] {
        let bare = get(&levee.url(path)).await;
        assert_eq!(bare.status, 503, "{path}: {}", bare.text());
        let body = assert_json_answer(&bare, path);
        assert_eq!(body["error"], "unavailable", "{path}: {body}");
        assert!(bare.header("retry-after").is_some(), "{path}");
        let any = get_with(&levee.url(path), &[("accept", "*/*")]).await;
        assert_eq!(any.status, 503);
        assert_json_answer(&any, path);
    }
    assert_eq!(backend.hits(), 0);

    let unreadable = raw_exchange(
        levee.public,
        b"GET /off HTTP/1.1\r\nHost: a\r\nno colon here\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status_of(&unreadable), Some(400), "{unreadable}");
    assert!(
        unreadable
            .to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{unreadable}"
    );
}

/// An API route on a site of pages: its 429 to a client without `Accept` is JSON, while the
/// pages' route, left at the server's default, still answers with a page.
#[tokio::test]
async fn a_routes_answer_format_json_gives_its_429_as_json_while_other_routes_stay_html() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        "[limit.per_route]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 1\n[[route]]\nname = \"api\"\nmatch = { path_prefix = \"/api\" }\nlimits = [\"per_route\"]\nanswer_format = \"json\"\n[[route]]\nname = \"pages\"\nmatch = { path_prefix = \"/\" }\nlimits = [\"per_route\"]\n",
    ))
    .await;
    assert_eq!(get(&levee.url("/api/items")).await.status, 200);
    let api = get(&levee.url("/api/items")).await;
    assert_eq!(api.status, 429, "{}", api.text());
    let body = assert_json_answer(&api, "api");
    assert_eq!(body["rule"], "per_route", "{body}");

    assert_eq!(get(&levee.url("/forum.php")).await.status, 200);
    let page = get(&levee.url("/forum.php")).await;
    assert_eq!(page.status, 429, "{}", page.text());
    assert_html_answer(&page, "pages");
    // `by_accept` is still the client's choice there.
    let asked = get_with(&levee.url("/forum.php"), &[("accept", "application/json")]).await;
    assert_eq!(asked.status, 429);
    assert_json_answer(&asked, "pages asked for JSON");
}

/// "html" answers a page even to a client that asks for JSON; a route's own format wins over
/// the server's either way.
#[tokio::test]
async fn answer_format_html_gives_pages_even_to_clients_asking_for_json() {
    let backend = echo_backend().await;
    let levee = Levee::start(&off_and_pinned_policy(
        &backend,
        "answer_format = \"html\"",
        "",
    ))
    .await;
    for path in ["/off/items", "/pinned/items"] {
        let answer = get_with(&levee.url(path), &[("accept", "application/json")]).await;
        assert_eq!(answer.status, 503, "{path}");
        assert_html_answer(&answer, path);
    }

    let levee = Levee::start(&off_and_pinned_policy(
        &backend,
        "answer_format = \"json\"",
        "answer_format = \"html\"",
    ))
    .await;
    let off = get_with(&levee.url("/off/items"), &[("accept", "application/json")]).await;
    assert_eq!(off.status, 503);
    assert_html_answer(&off, "the route's html over the server's json");
    let pinned = get_with(&levee.url("/pinned/items"), &[("accept", "text/html")]).await;
    assert_eq!(pinned.status, 503);
    assert_json_answer(&pinned, "the server's json");
}
