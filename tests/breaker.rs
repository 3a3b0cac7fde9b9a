//! Circuit breakers against controllable backends: opening, fallbacks, probes, isolation,
//! runtime control and reloads.

mod common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;

use common::*;
use http::{Request, Response};
use hyper::body::Incoming;

const OK: u8 = 0;
const FAIL_502: u8 = 1;
const HANG: u8 = 2;
const SLOW: u8 = 3;
/// Slow enough that 100 requests on fresh connections all arrive while it is in flight.
const SLOWER: u8 = 4;
/// The head and the page's first 4 KiB at once, the rest 300 ms later (PHP's output buffer
/// sent before a slow query).
const SLOW_BODY: u8 = 5;
/// 16 MiB at once: more than the sockets between levee and a client hold.
const LARGE: u8 = 6;
/// As SLOW_BODY, as an event stream (`text/event-stream`).
const EVENTS: u8 = 7;

/// A backend whose behaviour the test switches at will.
async fn switchable() -> (Backend, Arc<AtomicU8>) {
    let mode = Arc::new(AtomicU8::new(OK));
    let current = mode.clone();
    let backend = Backend::start(move |_request: Request<Incoming>| {
        let mode = current.load(Ordering::SeqCst);
        async move {
            match mode {
                FAIL_502 => Response::builder()
                    .status(502)
                    .body(full("down"))
                    .expect("response"),
                HANG => {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Response::new(full("late"))
                }
                SLOW => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Response::new(full("slow ok"))
                }
                SLOWER => {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    Response::new(full("slow ok"))
                }
                SLOW_BODY | EVENTS => {
                    let pieces = futures_util::stream::unfold(0, |step| async move {
                        let piece = match step {
                            0 => Bytes::from(vec![b' '; 4096]),
                            1 => {
                                tokio::time::sleep(Duration::from_millis(300)).await;
                                Bytes::from_static(b"slow ok")
                            }
                            _ => return None,
                        };
                        Some((Ok::<_, BoxError>(hyper::body::Frame::data(piece)), step + 1))
                    });
                    let mut response =
                        Response::new(http_body_util::StreamBody::new(pieces).boxed_unsync());
                    if mode == EVENTS {
                        response.headers_mut().insert(
                            "content-type",
                            http::HeaderValue::from_static("text/event-stream"),
                        );
                    }
                    response
                }
                LARGE => Response::new(full(vec![b'x'; 16 << 20])),
                _ => Response::new(full("ok")),
            }
        }
    })
    .await;
    (backend, mode)
}

fn breaker_policy(backend: &Backend, breaker: &str, route_extra: &str) -> String {
    policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "response_timeout = \"200ms\"\nbreaker = {{ {breaker} }}\n[[route]]\nname = \"page\"\nmatch = {{ path_prefix = \"/\" }}\n{route_extra}\n"
        ),
    )
}

const FRIENDLY: &str = "fallback = { status = 503, content_type = \"text/html; charset=utf-8\", body = \"<p>稍后再试</p>\" }";

async fn breaker_state(levee: &Levee, upstream: &str) -> String {
    let status = get(&levee.admin_url("/status")).await.json();
    status["upstreams"]
        .as_array()
        .and_then(|list| list.iter().find(|u| u["name"] == upstream))
        .map(|u| {
            u["breaker"]["state"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_open_the_breaker_fallback_is_served_then_it_recovers() {
    let (backend, mode) = switchable().await;
    let levee = Levee::start(&breaker_policy(
        &backend,
        "consecutive_failures = 3, open_for = \"2s\", half_open_probes = 1",
        FRIENDLY,
    ))
    .await;
    assert_eq!(get(&levee.url("/")).await.text(), "ok");

    mode.store(FAIL_502, Ordering::SeqCst);
    for _ in 0..3 {
        assert_eq!(
            get(&levee.url("/")).await.text(),
            "down",
            "failures pass through until the breaker opens"
        );
    }
    let hits = backend.hits();
    for _ in 0..5 {
        let answer = get(&levee.url("/")).await;
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (503, "<p>稍后再试</p>")
        );
        assert_eq!(
            answer.header("content-type"),
            Some("text/html; charset=utf-8")
        );
    }
    assert_eq!(
        backend.hits(),
        hits,
        "an open breaker does not touch the backend"
    );
    assert_eq!(breaker_state(&levee, "app").await, "open");

    // The backend recovers; after open_for one probe goes through and closes the breaker.
    mode.store(OK, Ordering::SeqCst);
    eventually(
        Duration::from_secs(10),
        "the breaker to let a probe through",
        || async { get(&levee.url("/")).await.text() == "ok" },
    )
    .await;
    assert_eq!(breaker_state(&levee, "app").await, "closed");
    let scraped = get(&levee.admin_url("/metrics")).await;
    // Named as what it is, so Prometheus reads its counters as counters.
    assert_eq!(
        scraped.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let metrics = scraped.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_breaker_transitions_total{upstream=\"app\",to=\"open\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(
            &metrics,
            "levee_breaker_probes_total{upstream=\"app\",result=\"success\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert!(
        metric_value(&metrics, "levee_breaker_rejected_total{upstream=\"app\"}") >= 5.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_or_refusing_dependencies_open_it_and_the_default_fallback_is_503_with_retry_after()
{
    let (backend, mode) = switchable().await;
    let levee = Levee::start(&breaker_policy(
        &backend,
        "consecutive_failures = 2, open_for = \"30s\"",
        "",
    ))
    .await;
    mode.store(HANG, Ordering::SeqCst);
    for _ in 0..2 {
        assert_eq!(get(&levee.url("/")).await.status, 504);
    }
    let started = std::time::Instant::now();
    let answer = get(&levee.url("/")).await;
    assert_eq!(answer.status, 503);
    assert!(
        started.elapsed() < Duration::from_millis(150),
        "the fallback comes at once, not after a timeout"
    );
    let retry_after: u64 = answer
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((28..=30).contains(&retry_after), "{retry_after}");
    // The visitor reads when to come back, as Retry-After says it: not the upstream, nor
    // the wait as Rust prints it (it read "upstream `app` is cut off by its open breaker;
    // retry after 29.99…s").
    assert_eq!(
        answer.text(),
        visitor_page(
            "Service unavailable",
            &format!(
                "The site is having trouble right now. Please try again in {retry_after} seconds."
            )
        )
    );
    let json = get_with(&levee.url("/"), &[("accept", "application/json")]).await;
    assert_eq!(json.status, 503);
    let retry_after = json.header("retry-after").expect("Retry-After");
    assert_eq!(
        json.text(),
        format!("{{\"error\":\"unavailable\",\"retry_after\":{retry_after}}}\n")
    );

    let dead = free_port();
    let refusing = Levee::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.app]\nurl = \"http://127.0.0.1:{dead}\"\nbreaker = {{ consecutive_failures = 2 }}\n"
    ))
    .await;
    assert_eq!(get(&refusing.url("/")).await.status, 502);
    assert_eq!(get(&refusing.url("/")).await.status, 502);
    assert_eq!(get(&refusing.url("/")).await.status, 503);
}

/// A breaker opened by a 502, with `half_open_probes` and `route_extra` on its route, whose
/// `open_for` has passed: the next request probes its backend, which now answers after 2 s.
async fn ready_to_probe(half_open_probes: u32, route_extra: &str) -> (Backend, Levee) {
    let (backend, mode) = switchable().await;
    let policy = breaker_policy(
        &backend,
        &format!(
            "consecutive_failures = 1, open_for = \"300ms\", half_open_probes = {half_open_probes}"
        ),
        route_extra,
    )
    .replace("response_timeout = \"200ms\"", "response_timeout = \"5s\"");
    let levee = Levee::start(&policy).await;
    mode.store(FAIL_502, Ordering::SeqCst);
    assert_eq!(get(&levee.url("/")).await.status, 502);
    assert_eq!(breaker_state(&levee, "app").await, "open");
    mode.store(SLOWER, Ordering::SeqCst);
    eventually(Duration::from_secs(5), "open_for to pass", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["upstreams"][0]["breaker"]["open_for_remaining_ms"].as_u64() == Some(0)
    })
    .await;
    (backend, levee)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_lets_exactly_the_probes_through_under_100_concurrent_requests() {
    // Slow answers keep the probes in flight while the other 97 requests arrive.
    let (backend, levee) = ready_to_probe(3, "").await;
    let before = backend.hits();
    let answers = futures_util::future::join_all((0..100).map(|_| get_owned(levee.url("/")))).await;
    let passed = answers.iter().filter(|a| a.status == 200).count();
    let refused = answers.iter().filter(|a| a.status == 503).count();
    assert_eq!(
        backend.hits() - before,
        3,
        "exactly half_open_probes requests reach the backend"
    );
    assert_eq!((passed, refused), (3, 97));
    assert_eq!(
        breaker_state(&levee, "app").await,
        "closed",
        "three good probes close it"
    );
}

/// Visitors reload a slow page while the app recovers: the probe's client leaves, and its
/// slot stayed free for the next request to probe, a script on the app per reload (the
/// breaker means `half_open_probes` at a time), with the round never decided. The probe
/// runs on to its answer instead, which decides the round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_whose_client_leaves_runs_on_and_its_answer_decides() {
    let (backend, levee) = ready_to_probe(1, FRIENDLY).await;
    let before = backend.hits();
    give_up_after(
        &levee,
        "GET / HTTP/1.1\r\nHost: site\r\n\r\n",
        Duration::from_millis(100),
    )
    .await;
    // levee sees the close a moment later: give it the time to drop the request.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..5 {
        let answer = get(&levee.url("/")).await;
        assert_eq!(answer.status, 503, "the fallback while the probe runs on");
    }
    assert_eq!(backend.hits() - before, 1, "one probe reached the app");
    // Its answer, 2 s after it was sent, closes the breaker without another request.
    eventually(
        Duration::from_secs(5),
        "the probe's answer to close it",
        || async { breaker_state(&levee, "app").await == "closed" },
    )
    .await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_breaker_probes_total{upstream=\"app\",result=\"success\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(get(&levee.url("/")).await.text(), "slow ok");
}

async fn get_owned(url: String) -> Answer {
    get(&url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failing_dependency_leaves_the_others_alone() {
    let (app, _mode) = switchable().await;
    let dead = free_port();
    let policy = policy_for(
        app.addr,
        "access_log = false\ndefault_upstream = \"app\"",
        &format!(
            "[upstream.ai]\nurl = \"http://127.0.0.1:{dead}\"\nbreaker = {{ consecutive_failures = 2 }}\n[[route]]\nname = \"ai\"\nmatch = {{ path_prefix = \"/ai\" }}\nupstream = \"ai\"\nfallback = {{ status = 200, content_type = \"application/json\", body = \"{{\\\"reply\\\":null,\\\"degraded\\\":true}}\" }}\n"
        ),
    );
    let levee = Levee::start(&policy).await;
    for _ in 0..2 {
        assert_eq!(get(&levee.url("/ai/reply")).await.status, 502);
    }
    let fallback = get(&levee.url("/ai/reply")).await;
    assert_eq!(fallback.status, 200);
    assert_eq!(fallback.json()["degraded"], true);
    for _ in 0..10 {
        assert_eq!(get(&levee.url("/thread.php")).await.text(), "ok");
    }
    assert_eq!(breaker_state(&levee, "ai").await, "open");
    assert_eq!(breaker_state(&levee, "app").await, "closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_force_open_takes_effect_at_once_and_auto_returns_control() {
    let (backend, _mode) = switchable().await;
    let levee = Levee::start(&breaker_policy(
        &backend,
        "consecutive_failures = 5",
        FRIENDLY,
    ))
    .await;
    assert_eq!(get(&levee.url("/")).await.text(), "ok");
    let forced = post(&levee.admin_url("/breakers/app"), "open").await;
    assert_eq!(forced.status, 200, "{}", forced.text());
    let hits = backend.hits();
    assert_eq!(get(&levee.url("/")).await.status, 503);
    assert_eq!(backend.hits(), hits);
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["upstreams"][0]["breaker"]["force"], "open");
    assert_eq!(status["upstreams"][0]["breaker"]["forced_by"], "runtime");
    // Pinned is told apart, so an alert on the state can leave out what an operator did.
    assert_eq!(
        breaker_pinned_metric(&levee.admin_url("/metrics")).await,
        1.0
    );

    assert_eq!(
        post(&levee.admin_url("/breakers/app"), "auto").await.status,
        200
    );
    assert_eq!(get(&levee.url("/")).await.text(), "ok");
    assert_eq!(
        breaker_pinned_metric(&levee.admin_url("/metrics")).await,
        0.0
    );
    assert_eq!(
        post(&levee.admin_url("/breakers/app"), "sideways")
            .await
            .status,
        400
    );
    assert_eq!(
        post(&levee.admin_url("/breakers/nope"), "open")
            .await
            .status,
        404
    );

    // The policy can pin it too, and the metric says so as `/status` does.
    let pinned = Levee::start(&breaker_policy(&backend, "force = \"open\"", "")).await;
    assert_eq!(get(&pinned.url("/")).await.status, 503);
    assert_eq!(
        breaker_state_metric(&pinned.admin_url("/metrics")).await,
        1.0
    );
    assert_eq!(
        breaker_pinned_metric(&pinned.admin_url("/metrics")).await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_an_open_breaker_open_unless_its_settings_change() {
    let log = levee_log();
    let (backend, mode) = switchable().await;
    let dir = tempfile::tempdir().expect("dir");
    let write = |breaker: &str, extra: &str| {
        std::fs::write(
            dir.path().join("levee.toml"),
            breaker_policy(&backend, breaker, extra),
        )
        .expect("write");
    };
    write("consecutive_failures = 1, open_for = \"60s\"", "");
    let mut options = levee::Options::new(dir.path());
    options.watch = false;
    let running = levee::start(options).await.expect("start");
    let url = format!("http://{}/", running.public_addr);
    let admin = format!("http://{}", running.admin_addr);
    mode.store(FAIL_502, Ordering::SeqCst);
    assert_eq!(get(&url).await.text(), "down");
    mode.store(OK, Ordering::SeqCst);
    assert_eq!(get(&url).await.status, 503, "open");
    assert_eq!(breaker_state_metric(&format!("{admin}/metrics")).await, 1.0);

    write(
        "consecutive_failures = 1, open_for = \"60s\"",
        "max_body = \"1MiB\"",
    );
    assert_eq!(
        post(&format!("{admin}/reload"), "").await.json()["changed"],
        true
    );
    assert_eq!(
        get(&url).await.status,
        503,
        "still open after a reload that left the breaker alone"
    );

    write(
        "consecutive_failures = 2, open_for = \"60s\"",
        "max_body = \"1MiB\"",
    );
    assert_eq!(
        post(&format!("{admin}/reload"), "").await.json()["changed"],
        true
    );
    assert_eq!(
        get(&url).await.text(),
        "ok",
        "changed settings start the breaker fresh"
    );
    // Said: an alert on its state cleared with no line, the app perhaps still down.
    let said = log.lines_with("breaker starts afresh, closed");
    assert!(
        said.iter().any(|line| line.contains("it was open")),
        "{said:?}"
    );
    // And the metric follows: the breaker that was open is gone.
    assert_eq!(
        breaker_state_metric(&format!("{admin}/metrics")).await,
        0.0,
        "levee_breaker_state of the fresh breaker"
    );
}

/// `levee_breaker_state{upstream="app"}` as `url` (an admin `/metrics`) has it now.
async fn breaker_state_metric(url: &str) -> f64 {
    app_breaker_metric(url, "levee_breaker_state").await
}

/// `levee_breaker_pinned{upstream="app"}` as `url` has it now.
async fn breaker_pinned_metric(url: &str) -> f64 {
    app_breaker_metric(url, "levee_breaker_pinned").await
}

async fn app_breaker_metric(url: &str, family: &str) -> f64 {
    let metrics = get(url).await.text();
    metric_value(&metrics, &format!("{family}{{upstream=\"app\"}}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dependency_that_slows_down_is_cut_off_by_the_slow_call_ratio() {
    let (backend, mode) = switchable().await;
    let policy = breaker_policy(
        &backend,
        "consecutive_failures = 0, slow_call = \"100ms\", slow_ratio = 0.5, min_requests = 4, open_for = \"60s\"",
        FRIENDLY,
    )
    .replace("response_timeout = \"200ms\"", "response_timeout = \"5s\"");
    let levee = Levee::start(&policy).await;
    assert_eq!(get(&levee.url("/")).await.text(), "ok");
    mode.store(SLOW, Ordering::SeqCst);
    for _ in 0..3 {
        assert_eq!(
            get(&levee.url("/")).await.text(),
            "slow ok",
            "slow answers still pass until the ratio trips"
        );
    }
    // 3 slow of 4 calls: the ratio (0.75 ≥ 0.5) opened the breaker.
    assert_eq!(breaker_state(&levee, "app").await, "open");
    let started = std::time::Instant::now();
    let answer = get(&levee.url("/")).await;
    assert_eq!(
        (answer.status, answer.text().as_str()),
        (503, "<p>稍后再试</p>")
    );
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "the fallback does not wait for the slow dependency (300 ms)"
    );
}

/// Sends `head` and `first` at once, the rest of the body after `pause`, and reads the answer.
async fn upload_in_two_parts(
    levee: std::net::SocketAddr,
    head: String,
    first: Vec<u8>,
    rest: Vec<u8>,
    pause: Duration,
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(levee)
        .await
        .expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    let writing = tokio::spawn(async move {
        writer.write_all(head.as_bytes()).await?;
        writer.write_all(&first).await?;
        tokio::time::sleep(pause).await;
        writer.write_all(&rest).await?;
        Ok::<_, std::io::Error>(writer)
    });
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), reader.read_to_end(&mut answer)).await;
    writing.abort();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_is_not_the_upstreams_failure_but_an_upstream_that_stops_reading_is() {
    // The response timeout (200 ms) runs from when the request has gone out whole: clients
    // uploading slower than that (within their own 2 s idle timer) get their answer and
    // leave the breaker closed, and are not slow calls either. Before, each was a 504 and
    // two of them opened it.
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false\nclient_body_timeout = \"2s\"",
        "response_timeout = \"200ms\"\nbreaker = { consecutive_failures = 2, open_for = \"30s\", slow_call = \"100ms\", slow_ratio = 0.5, min_requests = 3 }\n[[route]]\nname = \"page\"\nmatch = { path_prefix = \"/\" }\nmax_body = \"64MiB\"\n",
    ))
    .await;
    let uploads = (0..3).map(|_| {
        upload_in_two_parts(
            levee.public,
            "POST /form HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
                .to_string(),
            b"first".to_vec(),
            b"-last".to_vec(),
            Duration::from_millis(600),
        )
    });
    for answer in futures_util::future::join_all(uploads).await {
        assert_eq!(status_of(&answer), Some(200), "{answer}");
        assert!(answer.contains("\"body\":\"first-last\""), "{answer}");
    }
    assert_eq!(breaker_state(&levee, "app").await, "closed");

    // An upstream that takes the connection but never reads the body is cut off after the
    // response timeout, as one that never answers is, and that counts against it.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let stalled = Levee::start(&policy_for(
        silent_addr,
        "access_log = false\nclient_body_timeout = \"2s\"",
        "response_timeout = \"200ms\"\nbreaker = { consecutive_failures = 1, open_for = \"30s\" }\n[[route]]\nname = \"page\"\nmatch = { path_prefix = \"/\" }\nmax_body = \"64MiB\"\n",
    ))
    .await;
    let size = 48 << 20; // more than the sockets between levee and the upstream buffer
    let started = std::time::Instant::now();
    let answer = upload_in_two_parts(
        stalled.public,
        format!(
            "POST /form HTTP/1.1\r\nHost: a\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
        ),
        vec![b'x'; size],
        Vec::new(),
        Duration::ZERO,
    )
    .await;
    assert_eq!(status_of(&answer), Some(504), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "cut off after the stall, not after the client's timer: {:?}",
        started.elapsed()
    );
    assert_eq!(breaker_state(&stalled, "app").await, "open");
    holding.abort();
}

/// The upstream's recent latency, which a `latency_p95` trigger judges, is shown: in
/// `/metrics` and `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_recent_p95_latency_is_shown() {
    let (backend, mode) = switchable().await;
    let levee = Levee::start(
        &breaker_policy(&backend, "consecutive_failures = 5", "")
            .replace("response_timeout = \"200ms\"", "response_timeout = \"5s\""),
    )
    .await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        !metrics.contains("levee_upstream_latency_p95_seconds{"),
        "no answers yet, no figure: {metrics}"
    );
    mode.store(SLOW, Ordering::SeqCst);
    for _ in 0..3 {
        assert_eq!(get(&levee.url("/")).await.text(), "slow ok");
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    let p95 = metric_value(
        &metrics,
        "levee_upstream_latency_p95_seconds{upstream=\"app\"}",
    );
    assert!(p95 >= 0.1, "the slow answers' latency: {p95}");
    let status = get(&levee.admin_url("/status")).await.json();
    let shown = status["upstreams"][0]["latency_p95_ms"]
        .as_f64()
        .expect("a number");
    assert!(shown >= 100.0, "{shown}");
}

/// levee whose breaker opens on slow calls alone (over 100 ms, half of at least 2), in front
/// of a backend answering as `mode` says (kept alive by the caller).
async fn slow_call_levee(mode: u8) -> (Levee, Backend) {
    let (backend, switch) = switchable().await;
    let policy = breaker_policy(
        &backend,
        "consecutive_failures = 0, slow_call = \"100ms\", slow_ratio = 0.5, min_requests = 2, open_for = \"60s\"",
        FRIENDLY,
    )
    .replace("response_timeout = \"200ms\"", "response_timeout = \"5s\"");
    let levee = Levee::start(&policy).await;
    switch.store(mode, Ordering::SeqCst);
    (levee, backend)
}

/// A page whose head and first bytes come at once and whose rest takes 300 ms (PHP's output
/// buffer flushed before a slow query) is a slow call, and its latency is the 300 ms: timed to
/// the head, it counted as fast, and neither `slow_call` nor `latency_p95` saw the slowness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_slow_in_its_body_is_a_slow_call() {
    let (levee, _backend) = slow_call_levee(SLOW_BODY).await;
    let answer = get(&levee.url("/")).await;
    assert!(answer.text().ends_with("slow ok"));
    assert_eq!(breaker_window(&levee).await, ("closed".to_string(), 1, 1));
    let status = get(&levee.admin_url("/status")).await.json();
    let p95 = status["upstreams"][0]["latency_p95_ms"]
        .as_f64()
        .expect("a number");
    assert!(p95 >= 300.0, "the body's wait counts: {p95} ms");

    assert!(get(&levee.url("/")).await.text().ends_with("slow ok"));
    assert_eq!(breaker_state(&levee, "app").await, "open", "2 slow of 2");
}

/// An event stream is settled at its head: open-ended by design, timed to its end a healthy
/// stream counted as a slow call (the breaker opened on an app with `slow_call`) and as
/// latency (a `latency_p95` trigger raised the level).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_is_no_slow_call() {
    let (levee, _backend) = slow_call_levee(EVENTS).await;
    for _ in 0..3 {
        let answer = get(&levee.url("/")).await;
        assert!(
            answer.text().ends_with("slow ok"),
            "{} {}",
            answer.status,
            answer.text()
        );
    }
    assert_eq!(breaker_window(&levee).await, ("closed".to_string(), 3, 0));
    let status = get(&levee.admin_url("/status")).await.json();
    let p95 = status["upstreams"][0]["latency_p95_ms"]
        .as_f64()
        .expect("a number");
    assert!(p95 < 300.0, "timed to the head: {p95} ms");
}

/// A client that reads a large page slowly (a phone on a bad line) holds levee back, not the
/// upstream: the time levee waits to write to it is not the upstream's, and the call is not
/// slow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reading_slowly_does_not_make_the_call_slow() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (backend, mode) = switchable().await;
    let policy = breaker_policy(
        &backend,
        "consecutive_failures = 0, slow_call = \"1s\", slow_ratio = 0.5, min_requests = 1, open_for = \"60s\"",
        "",
    )
    .replace("response_timeout = \"200ms\"", "response_timeout = \"5s\"");
    let levee = Levee::start(&policy).await;
    mode.store(LARGE, Ordering::SeqCst);
    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: site\r\nConnection: close\r\n\r\n")
        .await
        .expect("request sent");
    let mut first = [0u8; 1024];
    let _ = stream.read(&mut first).await.expect("the head");
    // The client stops reading; levee's writes wait on it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.expect("the rest");
    assert!(rest.len() > 15 << 20, "{}", rest.len());
    eventually(Duration::from_secs(5), "the call recorded", || async {
        breaker_window(&levee).await.1 == 1
    })
    .await;
    assert_eq!(breaker_window(&levee).await, ("closed".to_string(), 1, 0));
}

/// A body cut off midway (the upstream's connection broken after its head and part of the
/// body: a PHP worker that died) is the upstream's failure, as one that never answered is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_off_midway_counts_against_the_upstream() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request).await;
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\npart of it")
                    .await;
                // Dropped: the connection closes 990 bytes short.
            });
        }
    });
    let levee = Levee::start(&policy_for(
        addr,
        "access_log = false",
        "breaker = { consecutive_failures = 2, open_for = \"60s\" }\n[[route]]\nname = \"page\"\nmatch = { path_prefix = \"/\" }\n",
    ))
    .await;
    for _ in 0..2 {
        let answer = client()
            .request(
                Request::get(levee.url("/"))
                    .body(full(""))
                    .expect("request"),
            )
            .await
            .expect("head");
        assert_eq!(answer.status(), 200);
        assert!(
            answer.into_body().collect().await.is_err(),
            "the client sees the answer cut off"
        );
    }
    eventually(Duration::from_secs(5), "the breaker open", || async {
        breaker_state(&levee, "app").await == "open"
    })
    .await;
}

/// The upstream's breaker as `/status` has it: (force, forced_by, who pinned it).
async fn pin_of(levee: &Levee) -> (String, String, String) {
    let status = get(&levee.admin_url("/status")).await.json();
    let upstream = &status["upstreams"][0];
    let text = |value: &serde_json::Value| value.as_str().unwrap_or_default().to_string();
    (
        text(&upstream["breaker"]["force"]),
        text(&upstream["breaker"]["forced_by"]),
        text(&upstream["pinned"]["by"]),
    )
}

/// A breaker pinned on one instance is pinned on every instance sharing the Redis, and on
/// one started later; handed back on any of them, it is handed back everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breaker_pinned_on_one_instance_is_pinned_fleet_wide() {
    let dir = tempfile::tempdir().expect("dir");
    let mut redis = RedisServer::start(dir.path()).await;
    let (backend, _mode) = switchable().await;
    let policy = breaker_policy(&backend, "consecutive_failures = 5", "").replace(
        "[[route]]",
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"100ms\"\n[[route]]",
            redis.url()
        ),
    );
    let first = Levee::start(&policy).await;
    let second = Levee::start(&policy).await;
    assert_eq!(get(&second.url("/")).await.text(), "ok");

    let pinned = post(&first.admin_url("/breakers/app"), "open").await;
    assert_eq!(pinned.status, 200, "{}", pinned.text());
    assert_eq!(pinned.json()["pinned"]["force"], "open");
    eventually(
        Duration::from_secs(5),
        "the second instance to follow the pin",
        || async { pin_of(&second).await.0 == "open" },
    )
    .await;
    let (_, forced_by, by) = pin_of(&second).await;
    assert_eq!(forced_by, "runtime");
    assert!(!by.is_empty(), "who pinned it is shown");
    let hits = backend.hits();
    assert_eq!(get(&second.url("/")).await.status, 503);
    assert_eq!(backend.hits(), hits, "cut off on the second instance too");

    // An instance started later comes up pinned, before its first sync.
    let third = Levee::start(&policy).await;
    assert_eq!(get(&third.url("/")).await.status, 503);
    assert_eq!(backend.hits(), hits);

    // Handed back on the second: the first follows, and its breaker starts afresh.
    assert_eq!(
        post(&second.admin_url("/breakers/app"), "auto")
            .await
            .status,
        200
    );
    eventually(
        Duration::from_secs(5),
        "the first instance to follow the hand-back",
        || async { pin_of(&first).await.0 == "auto" },
    )
    .await;
    assert_eq!(get(&first.url("/")).await.text(), "ok");

    // A pin that cannot be saved is not in effect: Redis down, 503 and the reason.
    redis.guard.stop();
    let refused = post(&first.admin_url("/breakers/app"), "open").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.text().contains("not saved"), "{}", refused.text());
    assert_eq!(get(&first.url("/")).await.text(), "ok");
}

/// Without Redis, a pin is kept in the state file: a restart comes back pinned, and a reload
/// that starts the breaker afresh (its settings changed) keeps the pin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_breaker_stays_pinned_across_a_reload_and_a_restart() {
    let (backend, _mode) = switchable().await;
    // A sync long after the test: the pins below hold without it.
    let policy = |breaker| {
        breaker_policy(&backend, breaker, "")
            .replace("[[route]]", "[degrade]\nsync_interval = \"10m\"\n[[route]]")
    };
    let levee = Levee::start(&policy("consecutive_failures = 5")).await;
    assert_eq!(
        post(&levee.admin_url("/breakers/app"), "open").await.status,
        200
    );
    std::fs::write(levee.policy_file(), policy("consecutive_failures = 7"))
        .expect("rewrite the policy");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    assert_eq!(pin_of(&levee).await.0, "open", "kept across the reload");
    assert_eq!(get(&levee.url("/")).await.status, 503);

    let again = levee::start(levee::Options::new(levee.dir.path()))
        .await
        .expect("restart");
    let hits = backend.hits();
    assert_eq!(
        get(&format!("http://{}/", again.public_addr)).await.status,
        503,
        "a restart comes back pinned"
    );
    assert_eq!(backend.hits(), hits);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_expects_100_continue_is_refused_before_it_sends_its_body() {
    let (backend, _mode) = switchable().await;
    let levee = Levee::start(&breaker_policy(&backend, "consecutive_failures = 5", "")).await;
    assert_eq!(
        post(&levee.admin_url("/breakers/app"), "open").await.status,
        200
    );
    // The client waits for 100 Continue before sending its body: an open breaker refuses
    // without asking for it.
    let raw = raw_exchange(
        levee.public,
        b"POST /upload HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(!raw.contains("100 Continue"), "{raw}");
    assert_eq!(status_of(&raw), Some(503), "{raw}");
}

/// Sends `request` on a connection of its own and closes it after `patience` with no answer,
/// as a front proxy whose read timeout ran out does.
async fn give_up_after(levee: &Levee, request: &str, patience: Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("request sent");
    let mut first = [0u8; 1];
    let read = tokio::time::timeout(patience, stream.read(&mut first)).await;
    assert!(read.is_err(), "no answer from a hung dependency");
}

async fn breaker_window(levee: &Levee) -> (String, u64, u64) {
    let status = get(&levee.admin_url("/status")).await.json();
    let breaker = &status["upstreams"][0]["breaker"];
    (
        breaker["state"].as_str().unwrap_or_default().to_string(),
        breaker["window_calls"].as_u64().unwrap_or_default(),
        breaker["window_slow"].as_u64().unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_given_up_on_after_slow_call_count_as_slow_and_open_the_breaker() {
    let (backend, mode) = switchable().await;
    // The front proxy gives up long before levee's own response_timeout would make a 504.
    let policy = breaker_policy(
        &backend,
        "consecutive_failures = 0, slow_call = \"100ms\", slow_ratio = 0.5, min_requests = 2, open_for = \"60s\"",
        FRIENDLY,
    )
    .replace("response_timeout = \"200ms\"", "response_timeout = \"20s\"");
    let levee = Levee::start(&policy).await;
    mode.store(HANG, Ordering::SeqCst);
    let get_request = "GET / HTTP/1.1\r\nHost: site\r\n\r\n";

    // Given up before slow_call: no verdict on the dependency.
    give_up_after(&levee, get_request, Duration::from_millis(20)).await;
    // With a body, the wait cannot be told from the client's own upload: no verdict either.
    give_up_after(
        &levee,
        "POST / HTTP/1.1\r\nHost: site\r\nContent-Length: 1\r\n\r\nx",
        Duration::from_millis(300),
    )
    .await;
    // levee sees the close a moment later: give it the time to drop both.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(breaker_window(&levee).await, ("closed".to_string(), 0, 0));

    // Two GETs given up on after 300 ms: two slow calls of two, the ratio opens it.
    for _ in 0..2 {
        give_up_after(&levee, get_request, Duration::from_millis(300)).await;
    }
    let mut state = breaker_window(&levee).await;
    for _ in 0..20 {
        if state.0 == "open" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        state = breaker_window(&levee).await;
    }
    assert_eq!(state, ("open".to_string(), 2, 2));
    let answer = get(&levee.url("/")).await;
    assert_eq!(
        (answer.status, answer.text().as_str()),
        (503, "<p>稍后再试</p>"),
        "the fallback, at once"
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_breaker_transitions_total{upstream=\"app\",to=\"open\"}"
        ),
        1.0
    );
}

/// A PHP app answers 503 on purpose (maintenance mode, a security plugin's block): by
/// default that is the app's answer, passed on, not a failure of the dependency. Counted,
/// one visitor asking for such a page a few times would cut every page off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_own_503s_do_not_open_the_breaker_by_default() {
    let backend = Backend::start(|request: Request<Incoming>| async move {
        if request.uri().path() == "/maintenance.php" {
            Response::builder()
                .status(503)
                .body(full("back soon"))
                .expect("response")
        } else {
            Response::new(full("ok"))
        }
    })
    .await;
    let levee = Levee::start(&breaker_policy(&backend, "consecutive_failures = 3", "")).await;
    for _ in 0..10 {
        let answer = get(&levee.url("/maintenance.php")).await;
        assert_eq!((answer.status, answer.text().as_str()), (503, "back soon"));
    }
    assert_eq!(breaker_state(&levee, "app").await, "closed");
    assert_eq!(get(&levee.url("/forum.php")).await.status, 200);
}

/// A visitor who finds a page that fails (a redirect whose `Location` carries a long query
/// string past the app's nginx's `fastcgi_buffer_size`: 502 in 2 ms) cannot open the breaker
/// for every page by asking for it again and again; failures from three clients do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_visitor_whose_page_fails_cannot_open_the_breaker_for_everyone() {
    let backend = Backend::start(|request: Request<Incoming>| async move {
        if request.uri().path() == "/redirect.php" {
            Response::builder()
                .status(502)
                .body(full("upstream sent too big header"))
                .expect("response")
        } else {
            Response::new(full("ok"))
        }
    })
    .await;
    let log = levee_log();
    let levee = Levee::start(&breaker_policy(&backend, "consecutive_failures = 3", "")).await;
    let from = |ip: &'static str| [("X-Real-IP", ip)];
    const VISITORS: [&str; 3] = ["203.0.113.1", "198.51.100.2", "192.0.2.3"];
    for visitor in VISITORS {
        assert_eq!(get_with(&levee.url("/"), &from(visitor)).await.status, 200);
    }
    // Other addresses of one network (a server's /24) are one client.
    for _ in 0..6 {
        for address in ["100.64.0.9", "100.64.0.10"] {
            let answer = get_with(&levee.url("/redirect.php"), &from(address)).await;
            assert_eq!(answer.status, 502);
        }
    }
    assert_eq!(breaker_state(&levee, "app").await, "closed");
    let said = log.lines_with("breaker kept closed");
    assert!(
        said.iter().any(|line| line
            .contains("its failures came from 1 client network, and failing_clients asks for 3")),
        "{said:?}"
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metric_value(
            &metrics,
            "levee_breaker_held_closed_total{upstream=\"app\"}"
        ) >= 1.0,
        "{metrics}"
    );
    // `/status` says it too, and `levee status` shows it under the upstream.
    let status = get(&levee.admin_url("/status")).await.json();
    let held = &status["upstreams"][0]["breaker"]["held_closed"];
    assert_eq!(
        (held["failing_clients"].as_u64(), held["needed"].as_u64()),
        (Some(1), Some(3)),
        "{status}"
    );
    assert!(held["ago_ms"].as_u64().is_some(), "{status}");
    let summary = levee::admin::client::summarize(&status);
    assert!(
        summary.contains("kept closed 0s ago: its failures came from 1 client network(s), and failing_clients asks for 3"),
        "{summary}"
    );
    assert_eq!(
        get_with(&levee.url("/forum.php"), &from("203.0.113.1"))
            .await
            .status,
        200
    );
    // Nor do the /64s of one IPv6 home's /48 make it three.
    for address in ["2001:db8:1:1::1", "2001:db8:1:2::1", "2001:db8:1:3::1"] {
        assert_eq!(
            get_with(&levee.url("/redirect.php"), &from(address))
                .await
                .status,
            502
        );
    }
    assert_eq!(breaker_state(&levee, "app").await, "closed");
    // The app failing for three visitors is the app failing.
    for visitor in VISITORS {
        get_with(&levee.url("/redirect.php"), &from(visitor)).await;
    }
    assert_eq!(breaker_state(&levee, "app").await, "open");
}

/// A page that reflects a visitor's input into a header (a NUL byte in `Location`) gets a
/// 502, as levee cannot pass the field on; but the app did answer, so it is not a failure of
/// the upstream, and asking for it again and again leaves every other page served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_a_field_levee_cannot_pass_on_is_not_held_against_the_upstream() {
    let addr = raw_backend(|head| {
        if head.starts_with(b"GET /redirect.php") {
            b"HTTP/1.1 302 Found\r\nLocation: /next.php?q=a\x00b\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()
        } else {
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok".to_vec()
        }
    })
    .await;
    let policy = policy_for(
        addr,
        "access_log = false",
        "breaker = { consecutive_failures = 3 }\n",
    );
    let levee = Levee::start(&policy).await;
    for _ in 0..10 {
        assert_eq!(get(&levee.url("/redirect.php")).await.status, 502);
    }
    assert_eq!(breaker_state(&levee, "app").await, "closed");
    assert_eq!(get(&levee.url("/forum.php")).await.status, 200);
}

/// A Redis that lost its data (restarted without persistence, flushed) holds no switches, not
/// even who handed the last one back: the instances write theirs back rather than follow it,
/// and an operator's pin ("keep traffic off the app while the database is repaired") holds.
/// A hand-back afterwards is followed as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_outlives_a_redis_that_lost_its_data() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _mode) = switchable().await;
    let policy = breaker_policy(&backend, "consecutive_failures = 5", "").replace(
        "[[route]]",
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"100ms\"\n[[route]]",
            redis.url()
        ),
    );
    let first = Levee::start(&policy).await;
    let second = Levee::start(&policy).await;
    let pinned = post(&first.admin_url("/breakers/app"), "open").await;
    assert_eq!(pinned.status, 200, "{}", pinned.text());
    eventually(
        Duration::from_secs(5),
        "the second instance to follow the pin",
        || async { pin_of(&second).await.0 == "open" },
    )
    .await;

    redis.cli(&["FLUSHALL"]);
    eventually(
        Duration::from_secs(5),
        "the pin to be written back to redis",
        || async {
            redis
                .cli(&["HEXISTS", "levee:switches", "breaker:app"])
                .trim()
                == "1"
        },
    )
    .await;
    // Ten syncs later, both still pinned.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(pin_of(&first).await.0, "open");
    assert_eq!(pin_of(&second).await.0, "open");
    assert_eq!(get(&second.url("/")).await.status, 503);

    assert_eq!(
        post(&second.admin_url("/breakers/app"), "auto")
            .await
            .status,
        200
    );
    eventually(
        Duration::from_secs(5),
        "the first instance to follow the hand-back",
        || async { pin_of(&first).await.0 == "auto" },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(pin_of(&first).await.0, "auto", "a hand-back is not undone");
}
