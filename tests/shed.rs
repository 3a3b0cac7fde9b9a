//! Shedding by tier at max_inflight, and automatic degrade triggers with hysteresis.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use http::{Request, Response};
use hyper::body::Incoming;

/// `/slow…` takes a second; everything else answers at once; `failing` turns on 502s (what
/// the app's nginx answers with php-fpm down).
async fn backend(failing: Arc<AtomicBool>) -> Backend {
    Backend::start(move |request: Request<Incoming>| {
        let slow = request.uri().path().starts_with("/slow");
        let fail = failing.load(Ordering::SeqCst);
        async move {
            if fail {
                return Response::builder()
                    .status(502)
                    .body(full("overloaded"))
                    .expect("response");
            }
            if slow {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Response::new(full("ok"))
        }
    })
    .await
}

const ROUTES: &str = r#"
[[route]]
name = "slow_stats"
match = { path_prefix = "/slow/stats" }
tier = 3
[[route]]
name = "slow_view"
match = { path_prefix = "/slow/view" }
[[route]]
name = "stats"
match = { path_prefix = "/stats" }
tier = 3
module = "stats"
[[route]]
name = "view"
match = { path_prefix = "/" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_sheds_tier_3_first_and_keeps_tier_1_going() {
    let backend = backend(Arc::new(AtomicBool::new(false))).await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("max_inflight = 5\nshed_reserve = 0.2\nqueue_wait = \"50ms\"\n{ROUTES}"),
    );
    let levee = Levee::start(&policy).await;
    // Three slow tier-3 requests fill tier 3's share (5 × 0.6).
    let slow: Vec<_> = (0..3)
        .map(|_| tokio::spawn(get_owned(levee.url("/slow/stats"))))
        .collect();
    eventually(
        Duration::from_secs(5),
        "three requests in flight",
        || async { backend.hits() >= 3 },
    )
    .await;

    let started = Instant::now();
    let shed = get(&levee.url("/stats")).await;
    assert_eq!(shed.status, 503, "{}", shed.text());
    assert_eq!(shed.header("retry-after"), Some("1"));
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "tier 3 is shed without waiting"
    );
    // The visitor reads that the site is busy and when to come back; not the upstream, its
    // bound or the tier (it read "upstream `app` is at max_inflight; tier 3 is shed").
    assert_eq!(
        shed.text(),
        visitor_page(
            "Busy",
            "The site is busy right now. Please try again in 1 second."
        )
    );
    let shed = get_with(
        &levee.url("/stats"),
        &[("accept", "text/html;q=0.5, application/json")],
    )
    .await;
    assert_eq!(
        (shed.status, shed.text().as_str()),
        (503, "{\"error\":\"busy\",\"retry_after\":1}\n")
    );

    // Tier 1 still gets through on its reserve, even with a slow one of its own in flight.
    let slow_view = tokio::spawn(get_owned(levee.url("/slow/view")));
    eventually(
        Duration::from_secs(5),
        "four requests in flight",
        || async { backend.hits() >= 4 },
    )
    .await;
    let view = get(&levee.url("/thread.php")).await;
    assert_eq!((view.status, view.text().as_str()), (200, "ok"));
    // The slots taken show: four of five (the answered request's slot is given back as its
    // body ends, which may come a moment after the client read it).
    eventually(
        Duration::from_secs(5),
        "the answered request's slot back",
        || async { get(&levee.admin_url("/status")).await.json()["upstreams"][0]["inflight"] == 4 },
    )
    .await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        (
            &status["upstreams"][0]["inflight"],
            &status["upstreams"][0]["max_inflight"]
        ),
        (&serde_json::json!(4), &serde_json::json!(5)),
        "{status}"
    );
    // And the two tier-3 requests shed above.
    assert_eq!(
        status["upstreams"][0]["shed"],
        serde_json::json!({"1": 0, "2": 0, "3": 2}),
        "{status}"
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_upstream_inflight{upstream=\"app\"}"),
        4.0
    );

    for task in slow {
        assert_eq!(task.await.expect("task").status, 200);
    }
    assert_eq!(slow_view.await.expect("task").status, 200);
    // Slots are freed when responses finish: tier 3 fits again.
    assert_eq!(get(&levee.url("/stats")).await.status, 200);
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_shed_total{upstream=\"app\",tier=\"3\"}"),
        2.0,
        "the page and the JSON refusal: {metrics}"
    );
}

/// levee in front of `backend` with [`ROUTES`] and one bulkhead slot, no tier's reserve.
async fn one_slot_levee(backend: &Backend) -> Levee {
    Levee::start(&policy_for(
        backend.addr,
        "",
        &format!("max_inflight = 1\nshed_reserve = 0.0\nqueue_wait = \"50ms\"\n{ROUTES}"),
    ))
    .await
}

/// A connection to levee that has sent `request`.
async fn asked(levee: &Levee, request: &[u8]) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    stream.write_all(request).await.expect("write");
    stream
}

async fn get_owned(url: String) -> Answer {
    get(&url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_raises_the_level_and_lowers_it_after_the_cool_down() {
    let failing = Arc::new(AtomicBool::new(false));
    let backend = backend(failing.clone()).await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "breaker = {{ consecutive_failures = 2, open_for = \"1s\", half_open_probes = 1 }}\n[degrade]\ncool_down = \"2s\"\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"breaker_open\"\nfor = \"200ms\"\nlevel = 1\n{ROUTES}"
        ),
    );
    let levee = Levee::start(&policy).await;
    assert_eq!(get(&levee.url("/stats")).await.status, 200);

    failing.store(true, Ordering::SeqCst);
    for _ in 0..2 {
        assert_eq!(get(&levee.url("/")).await.status, 502);
    }
    eventually(
        Duration::from_secs(5),
        "the trigger to raise the level",
        || async { get(&levee.admin_url("/status")).await.json()["degrade"]["level"] == 1 },
    )
    .await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["level_origin"], "automatic");
    assert_eq!(status["degrade"]["modules"]["stats"]["off"], true);

    // The backend recovers; a probe closes the breaker; after the cool-down the level drops.
    failing.store(false, Ordering::SeqCst);
    eventually(Duration::from_secs(5), "the breaker to close", || async {
        get(&levee.url("/")).await.status == 200
    })
    .await;
    let healthy_at = Instant::now();
    assert_eq!(
        get(&levee.url("/stats")).await.status,
        503,
        "still degraded right after recovery (hysteresis)"
    );
    eventually(
        Duration::from_secs(10),
        "the level to come back down",
        || async { get(&levee.admin_url("/status")).await.json()["degrade"]["level"] == 0 },
    )
    .await;
    assert!(
        // 2 s after the breaker closed, which this test saw a moment later.
        healthy_at.elapsed() >= Duration::from_millis(1500),
        "lowered after {:?}, before the cool-down",
        healthy_at.elapsed()
    );
    assert_eq!(get(&levee.url("/stats")).await.status, 200);
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_degrade_level_changes_total{direction=\"up\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(
            &metrics,
            "levee_degrade_level_changes_total{direction=\"down\"}"
        ),
        1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_level_that_switched_off_every_route_of_a_broken_upstream_comes_down_to_let_it_probe() {
    let app = backend(Arc::new(AtomicBool::new(false))).await;
    let failing = Arc::new(AtomicBool::new(true));
    let ai = backend(failing.clone()).await;
    let policy = policy_for(
        app.addr,
        "access_log = false\ndefault_upstream = \"app\"",
        &format!(
            "[upstream.ai]\nurl = \"http://{}\"\nbreaker = {{ consecutive_failures = 2, open_for = \"1s\" }}\n[degrade]\ncool_down = \"1s\"\n[[degrade.trigger]]\nupstream = \"ai\"\nwhen = \"breaker_open\"\nfor = \"200ms\"\nlevel = 1\n[[route]]\nname = \"ai\"\nmatch = {{ path_prefix = \"/ai\" }}\nupstream = \"ai\"\ntier = 3\n{ROUTES}",
            ai.addr
        ),
    );
    let levee = Levee::start(&policy).await;
    for _ in 0..2 {
        assert_eq!(get(&levee.url("/ai")).await.status, 502);
    }
    eventually(
        Duration::from_secs(5),
        "the trigger to raise the level",
        || async { get(&levee.admin_url("/status")).await.json()["degrade"]["level"] == 1 },
    )
    .await;
    // Level 1 switches off /ai, the only route to `ai`: no request can probe its breaker.
    // Once it is ready to probe and none came for the trigger's `for`, the trigger lets go,
    // and after the cool-down the level comes down.
    eventually(
        Duration::from_secs(10),
        "the level to come back down",
        || async { get(&levee.admin_url("/status")).await.json()["degrade"]["level"] == 0 },
    )
    .await;
    // The next request probes; still failing, the breaker opens again and the level follows.
    assert_eq!(get(&levee.url("/ai")).await.status, 502);
    eventually(
        Duration::from_secs(5),
        "the level to rise again",
        || async { get(&levee.admin_url("/status")).await.json()["degrade"]["level"] == 1 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_for_a_copy_being_fetched_hold_no_slot() {
    let backend = backend(Arc::new(AtomicBool::new(false))).await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("max_inflight = 2\nshed_reserve = 0.0\nqueue_wait = \"50ms\"\n[[route]]\nname = \"rank\"\nmatch = {{ path_prefix = \"/slow/rank\" }}\ntier = 3\ndegrade = {{ action = \"stale\" }}\n{ROUTES}"),
    );
    let levee = Arc::new(Levee::start(&policy).await);
    // Four readers of the same slow page: one fetches it, three wait for its copy.
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let levee = levee.clone();
            tokio::spawn(async move { get(&levee.url("/slow/rank")).await })
        })
        .collect();
    eventually(
        Duration::from_secs(5),
        "the fetch to reach the app",
        || async { backend.hits() >= 1 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The waiters hold no slot of the two: a tier-1 page still gets one.
    assert_eq!(get(&levee.url("/view")).await.status, 200);
    for reader in readers {
        let answer = reader.await.expect("reader");
        assert_eq!((answer.status, answer.text().as_str()), (200, "ok"));
    }
    assert_eq!(
        backend.hits(),
        2,
        "one fetch for the four readers, one for the page"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_trickling_small_forms_hold_no_slot() {
    use tokio::io::AsyncWriteExt;
    // The app reads a form whole before it answers, as PHP does.
    let backend = echo_backend().await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("max_inflight = 2\nshed_reserve = 0.0\nqueue_wait = \"50ms\"\n{ROUTES}"),
    );
    let levee = Levee::start(&policy).await;
    // Three clients send the head of a small form and a few bytes of it, then stall (each
    // within client_body_timeout).
    let mut stalled = Vec::new();
    for _ in 0..3 {
        let mut stream = tokio::net::TcpStream::connect(levee.public)
            .await
            .expect("connect");
        stream
            .write_all(b"POST /form HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nname=a")
            .await
            .expect("write");
        stalled.push(stream);
    }
    // Give levee the time to take them up.
    tokio::time::sleep(Duration::from_millis(100)).await;
    // They hold none of the two slots: the page is served.
    assert_eq!(get(&levee.url("/view")).await.status, 200);
    assert_eq!(
        backend.hits(),
        1,
        "the stalled forms have not reached the app"
    );
    drop(stalled);
}

/// php-fpm runs a script to its end whether or not the client still waits for it: a client
/// that asks and hangs up must not free the slot while the app is still busy with its request,
/// or a few such clients put any number of scripts on a pool that `max_inflight` bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_leaves_its_slot_taken_until_the_app_answers() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let backend = {
        let gate = gate.clone();
        Backend::start(move |request: Request<Incoming>| {
            let gate = gate.clone();
            async move {
                if request.uri().path() == "/busy.php" {
                    let _opened = gate.acquire().await;
                }
                Response::new(full("ok"))
            }
        })
        .await
    };
    let levee = one_slot_levee(&backend).await;
    let stream = asked(&levee, b"GET /busy.php HTTP/1.1\r\nHost: a\r\n\r\n").await;
    eventually(
        Duration::from_secs(5),
        "the request to reach the app",
        || async { backend.hits() == 1 },
    )
    .await;
    drop(stream);
    eventually(
        Duration::from_secs(5),
        "levee to see the client go",
        || async {
            let metrics = get(&levee.admin_url("/metrics")).await.text();
            metric_value(
                &metrics,
                "levee_requests_total{route=\"view\",status=\"499\"}",
            ) == 1.0
        },
    )
    .await;
    // The app is still running the script: its slot is taken.
    let shed = get(&levee.url("/stats")).await;
    assert_eq!(shed.status, 503, "{}", shed.text());
    assert_eq!(backend.hits(), 1, "the shed request never reached the app");

    // The script ends: the slot is free again.
    gate.add_permits(1);
    eventually(
        Duration::from_secs(5),
        "the slot to be freed once the app answered",
        || async { get(&levee.url("/stats")).await.status == 200 },
    )
    .await;
}

/// A client that goes away before its request is sent whole cuts the call off: the app never
/// gets a request the client did not finish. (A chunked body used to end cleanly when its
/// connection went: the app got 30 complete, empty POSTs here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_whose_client_vanishes_never_reaches_the_app_as_complete() {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    let outcomes: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let record = outcomes.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let record = record.clone();
        async move {
            let seen = match request.into_body().collect().await {
                Ok(collected) => format!("complete, {} bytes", collected.to_bytes().len()),
                Err(error) => format!("broken: {error}"),
            };
            record.lock().expect("lock").push(seen);
            Response::new(full("ok"))
        }
    })
    .await;
    let policy = policy_for(
        backend.addr,
        "",
        &format!("max_inflight = 4\nshed_reserve = 0.0\nqueue_wait = \"50ms\"\n{ROUTES}"),
    );
    let levee = Levee::start(&policy).await;
    for head in [
        &b"POST /form.php HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
        b"POST /form.php HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nname=",
        b"POST /form.php HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nname=",
    ] {
        for _ in 0..5 {
            let mut stream = tokio::net::TcpStream::connect(levee.public)
                .await
                .expect("connect");
            stream.write_all(head).await.expect("write");
            // Reset, not closed: as a client that vanished (a zero linger does not block).
            #[allow(deprecated)]
            stream.set_linger(Some(Duration::ZERO)).expect("linger");
            drop(stream);
        }
    }
    // Every one of them gone, and counted.
    eventually(
        Duration::from_secs(10),
        "the clients to be seen going",
        || async {
            let metrics = get(&levee.admin_url("/metrics")).await.text();
            let counted: f64 = ["400", "499"]
                .iter()
                .map(|status| {
                    metric_value(
                        &metrics,
                        &format!("levee_requests_total{{route=\"view\",status=\"{status}\"}}"),
                    )
                })
                .sum();
            counted >= 15.0 && metric_value(&metrics, "levee_inflight_requests") == 0.0
        },
    )
    .await;
    // Whatever reached the app meanwhile reached it broken.
    let seen = outcomes.lock().expect("lock").clone();
    assert!(
        !seen.iter().any(|outcome| outcome.starts_with("complete")),
        "{seen:#?}"
    );
    // And the slots are all free.
    assert_eq!(get(&levee.url("/stats")).await.status, 200);
}

/// PHP sends its page's head at its first flush, long before the script ends: a client that
/// hangs up while the page streams gets its upstream connection closed, as nginx in front of
/// php-fpm closes it (PHP then stops the script at its next write), and the slot freed. Read
/// on to its end, an event stream or an export held its worker and slot for up to
/// `response_timeout` after its visitor left, and a few abandoned pages shed the site.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_the_page_streams_has_the_upstream_connection_closed() {
    use tokio::io::AsyncReadExt;
    /// Set when the backend's page is dropped: its connection was closed.
    struct Closed(Arc<AtomicBool>);
    impl Drop for Closed {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let closed = Arc::new(AtomicBool::new(false));
    let backend = {
        let closed = closed.clone();
        Backend::start(move |request: Request<Incoming>| {
            let closed = closed.clone();
            async move {
                if request.uri().path() != "/streaming.php" {
                    return Response::new(full("ok"));
                }
                // The head and a first piece now, then a piece a second for a minute.
                let guard = Arc::new(Closed(closed));
                let pieces = futures_util::stream::unfold(0, move |step| {
                    let _held = guard.clone();
                    async move {
                        if step > 0 {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        let frame = hyper::body::Frame::data(bytes::Bytes::from_static(b"event\n"));
                        (step < 60).then_some((Ok::<_, BoxError>(frame), step + 1))
                    }
                });
                let body = http_body_util::StreamBody::new(pieces);
                Response::new(http_body_util::BodyExt::boxed_unsync(body))
            }
        })
        .await
    };
    let levee = one_slot_levee(&backend).await;
    let mut stream = asked(&levee, b"GET /streaming.php HTTP/1.1\r\nHost: a\r\n\r\n").await;
    let mut head = vec![0u8; 1024];
    let read = stream.read(&mut head).await.expect("read");
    assert!(
        head[..read].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        &head[..read]
    );
    assert_eq!(
        get(&levee.url("/stats")).await.status,
        503,
        "the page streams: its slot is taken"
    );
    drop(stream);
    eventually(
        Duration::from_secs(10),
        "the upstream connection closed",
        || async { closed.load(Ordering::SeqCst) },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the slot freed while the page would still stream",
        || async { get(&levee.url("/stats")).await.status == 200 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_ratio_trigger_waits_for_min_calls() {
    // One failed request on an idle site was an error ratio of 1: it turned tier 3 off for
    // everyone (a visitor who can provoke one 502 could do it again and again).
    let failing = Arc::new(AtomicBool::new(false));
    let backend = backend(failing.clone()).await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "breaker = {{ consecutive_failures = 0, failure_ratio = 1.0 }}\n[degrade]\ncool_down = \"1s\"\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"error_ratio\"\nabove = 0.5\nfor = \"200ms\"\nmin_calls = 6\nlevel = 1\n{ROUTES}"
        ),
    );
    let levee = Levee::start(&policy).await;
    failing.store(true, Ordering::SeqCst);
    assert_eq!(get(&levee.url("/")).await.status, 502);
    // Well past `for` and a few of the trigger's looks (every 200 ms).
    tokio::time::sleep(Duration::from_millis(900)).await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["level"], 0,
        "one call is no ratio: {status}"
    );
    for _ in 0..5 {
        assert_eq!(get(&levee.url("/")).await.status, 502);
    }
    eventually(
        Duration::from_secs(5),
        "six failed calls to raise the level",
        || async { get(&levee.admin_url("/status")).await.json()["degrade"]["level"] == 1 },
    )
    .await;
}

/// An `inflight` trigger raises the level while the pool is full, judged on a second of
/// readings: the level comes down again only after `cool_down` once the calls have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_raises_the_level_by_its_inflight_trigger() {
    let (release, gate) = tokio::sync::watch::channel(false);
    let backend = Backend::start(move |_request: Request<Incoming>| {
        let mut gate = gate.clone();
        async move {
            let _ = gate.wait_for(|open| *open).await;
            Response::new(full("done"))
        }
    })
    .await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "max_inflight = 2\n[degrade]\ncool_down = \"1s\"\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"inflight\"\nabove = 0.9\nfor = \"200ms\"\nlevel = 1\n{ROUTES}"
        ),
    );
    let levee = Levee::start(&policy).await;
    let level =
        || async { get(&levee.admin_url("/status")).await.json()["degrade"]["level"].clone() };
    let calls: Vec<_> = (0..2)
        .map(|_| {
            let url = levee.url("/");
            tokio::spawn(async move { get(&url).await.status })
        })
        .collect();
    eventually(
        Duration::from_secs(5),
        "the full pool to raise the level",
        || async { level().await == 1 },
    )
    .await;
    // Why, in `/status` and `levee status`: the trigger that raised it, holding still.
    let status = get(&levee.admin_url("/status")).await.json();
    let automatic = &status["degrade"]["automatic"];
    assert_eq!(
        automatic["raised_by"][0], "app inflight above 0.9",
        "{automatic}"
    );
    assert_eq!(
        automatic["holding"][0]["trigger"], "app inflight above 0.9",
        "{automatic}"
    );
    assert!(automatic["changed_at_unix"].is_u64(), "{automatic}");
    let summary = levee::admin::client::summarize(&status);
    assert!(
        summary.contains("automatic level 1, changed ")
            && summary.contains("raised by app inflight above 0.9\n")
            && summary.contains("triggers holding: app inflight above 0.9 (level 1, "),
        "{summary}"
    );
    release.send_replace(true);
    for call in calls {
        assert_eq!(call.await.expect("call"), 200);
    }
    // No trigger holds: the cool-down is counting down.
    eventually(Duration::from_secs(5), "the cool-down shown", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["degrade"]["automatic"]["lowers_in_ms"].is_u64()
            && levee::admin::client::summarize(&status).contains("triggers holding: none\n")
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "the level to come down",
        || async { level().await == 0 },
    )
    .await;
    let automatic = get(&levee.admin_url("/status")).await.json()["degrade"]["automatic"].clone();
    assert!(automatic["lowers_in_ms"].is_null(), "{automatic}");
    assert_eq!(automatic["raised_by"], serde_json::json!([]), "{automatic}");
}
