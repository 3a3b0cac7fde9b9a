//! Faults under load, with real processes: Redis paused and killed, php-fpm saturated,
//! backends that reset or stall mid-body, levee itself SIGKILLed, and a policy file caught
//! half-written.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::io::AsyncWriteExt;

/// Idempotency keys of every replayed job the backend saw, in order.
type Applied = Arc<Mutex<Vec<String>>>;

/// A backend that records the `Idempotency-Key` of each request and answers `ok`.
async fn recorder() -> (Backend, Applied) {
    let applied: Applied = Arc::new(Mutex::new(Vec::new()));
    let record = applied.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let record = record.clone();
        async move {
            if let Some(key) = request
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
            {
                record.lock().expect("lock").push(key.to_string());
            }
            let _ = request.into_body().collect().await;
            Response::new(full("ok"))
        }
    })
    .await;
    (backend, applied)
}

/// How many times the backend applied each key.
fn counts(applied: &Applied) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for key in applied.lock().expect("lock").iter() {
        *counts.entry(key.clone()).or_insert(0) += 1;
    }
    counts
}

/// Waits until every job in `jobs` has reached the app and the `notify` queue has drained,
/// then checks that each was applied exactly once. Returns the counts of all applied jobs.
async fn each_applied_once(
    applied: &Applied,
    jobs: &[String],
    queues_url: &str,
) -> HashMap<String, usize> {
    eventually(
        Duration::from_secs(20),
        "every accepted job to be applied",
        || async {
            let counts = counts(applied);
            jobs.iter().all(|job| counts.contains_key(job))
        },
    )
    .await;
    eventually(Duration::from_secs(10), "the queue to drain", || async {
        let queues = get(queues_url).await.json();
        queues["notify"]["backlog"] == 0 && queues["notify"]["in_flight"] == 0
    })
    .await;
    let counts = counts(applied);
    for job in jobs {
        assert_eq!(counts[job], 1, "job {job} applied {} times", counts[job]);
    }
    counts
}

/// One answer seen by a load loop: status, job id, when the request started and ended.
#[derive(Clone)]
struct Seen {
    status: u16,
    job: Option<String>,
    started: Instant,
    ended: Instant,
}

/// Runs `request` in a loop until `stop`, recording every answer; a transport error or a
/// body that cannot be read is recorded as status 0.
fn load_loop(
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Seen>>>,
    make: impl Fn(u64) -> Request<TestBody> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = client();
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let started = Instant::now();
            let (status, job) = match client.request(make(n)).await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let job = response
                        .headers()
                        .get("x-levee-job")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    match response.into_body().collect().await {
                        Ok(_) => (status, job),
                        Err(_) => (0, None),
                    }
                }
                Err(_) => (0, None),
            };
            log.lock().expect("lock").push(Seen {
                status,
                job,
                started,
                ended: Instant::now(),
            });
        }
    })
}

fn count_where(log: &Arc<Mutex<Vec<Seen>>>, keep: impl Fn(&Seen) -> bool) -> usize {
    log.lock().expect("lock").iter().filter(|s| keep(s)).count()
}

// ---------------------------------------------------------------------------------------
// 1. Redis paused (SIGSTOP) under load

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_under_load_queue_answers_503_never_202_and_every_202_is_applied_once() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, applied) = recorder().await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            r#"
[redis]
url = "{url}"
timeout = "100ms"
failures_to_open = 2
cooldown = "300ms"
[queue]
poll_interval = "50ms"
replay_rate = 2000
claim_after = "1s"
# Wide enough that two tight loops never reach it: the limit is here to call Redis.
[limit.wide]
key = ["ip"]
rate = "100000/s"
burst = 100000
on_redis_error = "local"
[[route]]
name = "notify"
match = {{ method = ["POST"], path = "/notify" }}
tier = 2
always_queue = true
[[route]]
name = "page"
match = {{ path = "/page" }}
limits = ["wide"]
"#,
            url = redis.url()
        ),
    );
    let levee = Levee::start(&policy).await;
    // The XADD bound on the request path, and the limiter's, from the policy and src/queue.
    let (enqueue_timeout, limit_timeout) = (Duration::from_millis(500), Duration::from_millis(100));
    let margin = Duration::from_millis(1500);

    let mut accepted = Vec::new();
    for i in 0..20 {
        let answer = post(&levee.url("/notify"), &format!("before={i}")).await;
        assert_eq!(answer.status, 202, "{}", answer.text());
        accepted.push(answer.header("x-levee-job").expect("job id").to_string());
    }

    let stop = Arc::new(AtomicBool::new(false));
    let posts = Arc::new(Mutex::new(Vec::new()));
    let pages = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for worker in 0..4 {
        let url = levee.url("/notify");
        tasks.push(load_loop(stop.clone(), posts.clone(), move |n| {
            Request::post(url.as_str())
                .body(full(format!("load={worker}-{n}")))
                .expect("request")
        }));
    }
    for _ in 0..2 {
        let url = levee.url("/page");
        tasks.push(load_loop(stop.clone(), pages.clone(), move |_| {
            Request::get(url.as_str()).body(full("")).expect("request")
        }));
    }
    eventually(Duration::from_secs(10), "load to flow", || async {
        count_where(&posts, |s| s.status == 202) >= 20
            && count_where(&pages, |s| s.status == 200) >= 20
    })
    .await;

    redis.pause(true);
    // Read once the signal was sent (`kill` is a process of its own, which a loaded machine
    // starts late).
    let paused_at = Instant::now();
    eventually(
        Duration::from_secs(15),
        "queued posts refused and pages still served while Redis is frozen",
        || async {
            count_where(&posts, |s| s.started > paused_at && s.status == 503) >= 20
                && count_where(&pages, |s| s.started > paused_at + Duration::from_secs(1)) >= 20
        },
    )
    .await;
    let resumed_at = Instant::now();
    redis.pause(false);
    eventually(
        Duration::from_secs(15),
        "queued posts accepted again",
        || async { count_where(&posts, |s| s.started > resumed_at && s.status == 202) >= 20 },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("load task");
    }

    let posts = posts.lock().expect("lock").clone();
    let pages = pages.lock().expect("lock").clone();
    // A 202 needs Redis's confirmation, which a frozen Redis cannot give (a reply already on
    // the wire when it froze may still arrive a moment later).
    let frozen = paused_at + Duration::from_secs(1)..resumed_at;
    for seen in &posts {
        assert!(
            seen.status == 202 || seen.status == 503,
            "a queued post got {}",
            seen.status
        );
        assert!(
            !(seen.status == 202 && frozen.contains(&seen.ended)),
            "202 while Redis was frozen"
        );
        let took = seen.ended - seen.started;
        assert!(
            took <= enqueue_timeout + margin,
            "a queued post waited {took:?}"
        );
        if seen.status == 202 {
            accepted.push(seen.job.clone().expect("202 carries its job id"));
        }
    }
    for seen in &pages {
        assert_eq!(
            seen.status, 200,
            "on_redis_error = local keeps pages flowing"
        );
        let took = seen.ended - seen.started;
        assert!(
            took <= limit_timeout + margin,
            "a limited page waited {took:?} on Redis"
        );
    }
    let refused_while_frozen = posts
        .iter()
        .filter(|s| s.status == 503 && frozen.contains(&s.started))
        .count();
    assert!(refused_while_frozen >= 20);

    // Nothing answered 202 is lost, and each is applied once.
    let counts = each_applied_once(&applied, &accepted, &levee.admin_url("/queues")).await;
    let extra: Vec<_> = counts
        .iter()
        .filter(|(key, _)| !accepted.contains(key))
        .collect();
    assert!(
        extra.is_empty(),
        "jobs answered 503 (not stored) were applied anyway: {extra:?}"
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metric_value(&metrics, "levee_redis_transitions_total{to=\"down\"}") >= 1.0,
        "{metrics}"
    );
}

// ---------------------------------------------------------------------------------------
// 2. Redis killed and restarted

/// A backend that names the path it served with a version the test can bump.
async fn versioned() -> (Backend, Arc<AtomicUsize>) {
    let version = Arc::new(AtomicUsize::new(1));
    let v = version.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let body = format!("{} v{}", request.uri().path(), v.load(Ordering::SeqCst));
        async move {
            Response::builder()
                .header("content-type", "text/html")
                .body(full(body))
                .expect("response")
        }
    })
    .await;
    (backend, version)
}

const DEGRADE_ROUTES: &str = r#"
[[route]]
name = "home"
match = { path = "/" }

[[route]]
name = "ranking"
match = { path_prefix = "/ranking" }
tier = 3
module = "ranking"
degrade = { action = "stale", max_age = "10m" }

[[route]]
name = "visitors"
match = { path_prefix = "/visitors" }
tier = 3
module = "visitors"
"#;

async fn admin_set(admin: &str, path: &str, value: &str) -> Answer {
    let request = Request::post(format!("{admin}{path}"))
        .header("x-levee-operator", "faults-test")
        .body(full(value.to_string()))
        .expect("request");
    send(request).await
}

fn redis_keys(port: u16, pattern: &str) -> String {
    let cli = find_binary(&["redis-cli", "/usr/bin/redis-cli"]);
    Command::new(cli)
        .args(["-p", &port.to_string(), "--scan", "--pattern", pattern])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The site's name, as a front sends it to every instance: a stale copy is the page of the
/// `Host` the app was sent, and each instance's own address differs.
const FLEET: &[(&str, &str)] = &[("host", "127.0.0.1")];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_switches_and_stale_copies_come_back() {
    let dir = tempfile::tempdir().expect("dir");
    let port = free_port();
    let mut redis = RedisServer::start_persistent(dir.path(), port).await;
    let (backend, version) = versioned().await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\ntimeout = \"100ms\"\ncooldown = \"300ms\"\n[degrade]\nsync_interval = \"100ms\"\nstate_file = \"{}\"\n{DEGRADE_ROUTES}",
            redis.url(),
            // Both instances keep their local copy of the fleet's switches in one place, as
            // two restarts of one instance would.
            dir.path().join("fleet-switches.json").display()
        ),
    );
    let a = Levee::start(&policy).await;
    let admin_a = format!("http://{}", a.admin);
    assert_eq!(
        get_with(&a.url("/ranking"), FLEET).await.text(),
        "/ranking v1"
    );
    eventually(
        Duration::from_secs(5),
        "the copy to reach Redis",
        || async { !redis_keys(port, "levee:stale:*").is_empty() },
    )
    .await;
    assert_eq!(
        admin_set(&admin_a, "/modules/visitors", "off").await.status,
        200
    );
    assert_eq!(
        admin_set(&admin_a, "/modules/ranking", "off").await.status,
        200
    );
    assert_eq!(get_with(&a.url("/visitors"), FLEET).await.status, 503);
    version.store(2, Ordering::SeqCst);

    // Load on instance A for the whole outage: tier 1 served, the switches held.
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (path, expected) in [("/", 200u16), ("/visitors", 503), ("/ranking", 200)] {
        let (stop, url) = (stop.clone(), a.url(path));
        tasks.push(tokio::spawn(async move {
            let mut wrong = Vec::new();
            let mut slowest = Duration::ZERO;
            let mut count = 0;
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let answer = get_with(&url, FLEET).await;
                slowest = slowest.max(started.elapsed());
                count += 1;
                let ok = answer.status == expected
                    && (path != "/ranking"
                        || (answer.text() == "/ranking v1"
                            && answer.header("x-levee-stale") == Some("1")));
                if !ok {
                    wrong.push(format!("{path}: {} {}", answer.status, answer.text()));
                }
            }
            (path, wrong, slowest, count)
        }));
    }

    redis.kill();
    // A second instance started while Redis is gone cannot read the fleet's switches from
    // Redis; it starts from the last known copy in its state file instead of the policy's.
    let b = Levee::start(&policy).await;
    let status = get(&b.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["modules"]["visitors"]["off"], true,
        "B applies the last known switches during the outage: {status}"
    );
    assert_eq!(get_with(&b.url("/visitors"), FLEET).await.status, 503);
    let _redis = RedisServer::start_persistent(dir.path(), port).await;

    // Once Redis is back (with its append-only file), B follows the switches saved before the
    // kill and serves the copy kept in Redis, without asking the backend.
    eventually(
        Duration::from_secs(10),
        "B to reach Redis and follow the saved switches",
        || async {
            // (B shows both switches off from the local copy already: what comes from Redis
            // is known once B's own calls answer.)
            let status = get(&b.admin_url("/status")).await.json();
            status["redis"]["up"] == true
                && status["degrade"]["modules"]["visitors"]["off"] == true
                && status["degrade"]["modules"]["ranking"]["off"] == true
        },
    )
    .await;
    let status = get(&b.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["modules"]["visitors"]["origin"], "runtime",
        "{status}"
    );
    assert_eq!(get_with(&b.url("/visitors"), FLEET).await.status, 503);
    // The backend is at v2 by now: v1 can only come from the copy.
    let copy = get_with(&b.url("/ranking"), FLEET).await;
    assert_eq!(
        (
            copy.status,
            copy.text().as_str(),
            copy.header("x-levee-stale")
        ),
        (200, "/ranking v1", Some("1")),
        "the copy kept in Redis answers"
    );
    // A kept its switches through the outage and after it.
    let status = get(&a.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["modules"]["visitors"]["off"], true);
    assert_eq!(
        status["degrade"]["modules"]["visitors"]["changed_by"]
            .as_str()
            .map(|by| by.starts_with("faults-test")),
        Some(true),
        "{status}"
    );

    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let (path, wrong, slowest, count) = task.await.expect("load task");
        assert!(
            wrong.is_empty(),
            "{path}: {} wrong answers of {count}: {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
        assert!(count >= 5, "{path}: too little load ({count})");
        assert!(
            slowest < Duration::from_secs(2),
            "{path} waited {slowest:?} on a dead Redis"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 3. Backend faults: php-fpm saturated and slow; a backend that resets or stalls mid-body

const SLEEP_PHP: &str = r#"<?php
usleep((int)($_GET['ms'] ?? 0) * 1000);
echo "slept";
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_fpm_saturated_or_slow_every_request_is_answered_within_the_timeout() {
    // php-fpm runs 4 workers (pm.max_children = 4 in the harness).
    let site = PhpSite::start(&[("sleep.php", SLEEP_PHP)]).await;
    let response_timeout = Duration::from_millis(700);
    let margin = Duration::from_millis(2500);
    let policy = policy_for(
        site.addr(),
        "access_log = false",
        "response_timeout = \"700ms\"\nmax_inflight = 8\nqueue_wait = \"100ms\"\nbreaker = { consecutive_failures = 5, open_for = \"5s\" }\n[[route]]\nname = \"php\"\nmatch = { path_prefix = \"/\" }\nfallback = { status = 503, body = \"resting\" }\n",
    );
    let levee = Levee::start(&policy).await;
    assert_eq!(get(&levee.url("/sleep.php")).await.text(), "slept");

    // (a) Twelve slow requests at once: 8 pass the bulkhead, 4 of those hold every worker and
    // 4 wait in php-fpm's backlog; all of them are cut off at the response timeout.
    let started = Instant::now();
    let answers = futures_util::future::join_all((0..12).map(|_| {
        let url = levee.url("/sleep.php?ms=1500");
        async move {
            let started = Instant::now();
            let answer = tokio::time::timeout(Duration::from_secs(10), get(&url))
                .await
                .expect("a request hung on a saturated php-fpm");
            (answer.status, answer.text(), started.elapsed())
        }
    }))
    .await;
    for (status, body, took) in &answers {
        assert!(
            *status == 504 || (*status == 503 && body != "slept"),
            "{status} {body}"
        );
        assert!(
            *took <= response_timeout + margin,
            "answered after {took:?}"
        );
    }
    assert!(
        answers.iter().filter(|(s, ..)| *s == 504).count() >= 5,
        "{answers:?}"
    );
    assert!(
        answers.iter().any(|(s, ..)| *s == 503),
        "the bulkhead sheds above max_inflight: {answers:?}"
    );
    assert!(started.elapsed() <= response_timeout + margin);
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metric_value(&metrics, "levee_shed_total{upstream=\"app\",tier=\"1\"}") >= 1.0,
        "{metrics}"
    );
    // Five 504s in a row opened the breaker: the fallback answers at once.
    let fallback = get(&levee.url("/sleep.php")).await;
    assert_eq!(
        (fallback.status, fallback.text().as_str()),
        (503, "resting")
    );

    // (b) Slowed responses: once the workers are free again, a response slower than usual but
    // within the timeout is passed on; one slower than the timeout gets 504, on time.
    eventually(
        Duration::from_secs(20),
        "php-fpm to recover and the breaker to close",
        || async { get(&levee.url("/sleep.php?ms=200")).await.text() == "slept" },
    )
    .await;
    let slow_ok = get(&levee.url("/sleep.php?ms=300")).await;
    assert_eq!((slow_ok.status, slow_ok.text().as_str()), (200, "slept"));
    let started = Instant::now();
    let too_slow = get(&levee.url("/sleep.php?ms=1500")).await;
    assert_eq!(too_slow.status, 504, "{}", too_slow.text());
    assert!(started.elapsed() <= response_timeout + margin);
}

/// A raw HTTP/1.1 backend that misbehaves by path:
/// `/reset` — `Content-Length: 100000`, 1000 bytes, then a TCP reset (`?late`: after 100ms);
/// `/chunked-reset` — a chunked response, one 1000-byte chunk, then a reset;
/// `/stall` — `Content-Length: 100000`, 1000 bytes, then silence with the connection open;
/// anything else — a proper small response.
async fn raw_backend() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let Some(head) = read_request_head(&mut stream).await else {
                    return;
                };
                let text = String::from_utf8_lossy(&head).into_owned();
                let target = text.split_whitespace().nth(1).unwrap_or("/").to_string();
                let path = target.split('?').next().unwrap_or("/").to_string();
                let part = vec![b'x'; 1000];
                match path.as_str() {
                    "/reset" | "/stall" => {
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
                            .await;
                        let _ = stream.write_all(&part).await;
                        let _ = stream.flush().await;
                        if path == "/stall" {
                            tokio::time::sleep(Duration::from_secs(30)).await;
                        }
                    }
                    "/chunked-reset" => {
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n")
                            .await;
                        let _ = stream.write_all(&part).await;
                        let _ = stream.write_all(b"\r\n").await;
                        let _ = stream.flush().await;
                    }
                    _ => {
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nfine")
                            .await;
                        let _ = stream.shutdown().await;
                        return;
                    }
                }
                // Give levee a moment to read what was sent (`?late`: a long one, so the head
                // has surely been passed on), then reset the connection (SO_LINGER 0). A reset
                // that overtakes the head makes levee answer 502, which is honest too.
                let pause = if target.contains("late") { 100 } else { 5 };
                tokio::time::sleep(Duration::from_millis(pause)).await;
                let _ = stream.set_zero_linger();
                drop(stream);
            });
        }
    });
    (addr, task)
}

/// levee as its own process (the real binary), so its memory can be read from /proc.
struct LeveeProcess {
    guard: ChildGuard,
    public: SocketAddr,
    admin: SocketAddr,
}

impl LeveeProcess {
    /// Runs the binary on `dir`, whose policy listens on `public` and `admin`.
    async fn start(dir: &Path, public: u16, admin: u16) -> LeveeProcess {
        let guard = ChildGuard::spawn(
            "levee",
            Command::new(env!("CARGO_BIN_EXE_levee"))
                .args(["run", "--no-watch", "--policies"])
                .arg(dir)
                .env("LEVEE_LOG", "error"),
        );
        let public = SocketAddr::from(([127, 0, 0, 1], public));
        let admin = SocketAddr::from(([127, 0, 0, 1], admin));
        wait_for_port(public, "levee to listen").await;
        wait_for_port(admin, "levee's admin listener").await;
        LeveeProcess {
            guard,
            public,
            admin,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.public)
    }

    fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// SIGKILL: no drain, no chance to save anything.
    fn kill(&mut self) {
        let _ = self.guard.child.kill();
        let _ = self.guard.child.wait();
    }

    fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.guard.pid()))
            .ok()
            .and_then(|status| {
                status
                    .lines()
                    .find(|line| line.starts_with("VmRSS:"))
                    .and_then(|line| line.split_whitespace().nth(1))
                    .and_then(|kib| kib.parse().ok())
            })
            .expect("VmRSS of levee")
    }
}

fn process_policy(public: u16, admin: u16, rest: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:{public}\"\naccess_log = false\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n{rest}\n"
    )
}

/// Fetches `url` and reads the whole body; `Ok(len)` only if the body ended cleanly.
async fn fetch_body(url: &str) -> (u16, Option<String>, Result<usize, String>) {
    let request = Request::get(url).body(full("")).expect("request");
    let response = match client().request(request).await {
        Ok(response) => response,
        Err(error) => return (0, None, Err(format!("request: {error}"))),
    };
    let status = response.status().as_u16();
    let length = response
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = response.into_body().collect().await;
    (
        status,
        length,
        body.map(|b| b.to_bytes().len())
            .map_err(|error| format!("body: {error}")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_resets_or_stalls_mid_body_aborts_the_response_never_a_clean_short_one() {
    let (backend, backend_task) = raw_backend().await;
    let dir = tempfile::tempdir().expect("dir");
    let (public, admin) = (free_port(), free_port());
    std::fs::write(
        dir.path().join("levee.toml"),
        process_policy(
            public,
            admin,
            // Every answer of this backend breaks off, which would open its breaker (a body
            // cut off is the upstream's failure): what is tested is each reset's answer.
            &format!("[upstream.app]\nurl = \"http://{backend}\"\nidle_body_timeout = \"500ms\"\nbreaker = {{ consecutive_failures = 0, min_requests = 1000000 }}\n"),
        ),
    )
    .expect("policy");
    let levee = LeveeProcess::start(dir.path(), public, admin).await;
    let within = Duration::from_secs(10);

    // Each shape once, looked at closely.
    for path in ["/reset", "/chunked-reset", "/stall"] {
        let started = Instant::now();
        let (status, length, body) =
            tokio::time::timeout(within, fetch_body(&levee.url(&format!("{path}?late"))))
                .await
                .unwrap_or_else(|_| panic!("{path}: the client hung"));
        assert!(
            body.is_err(),
            "{path}: a cut-off body arrived as a complete response ({body:?})"
        );
        assert_eq!(status, 200, "{path}: the head had arrived and is passed on");
        if path != "/chunked-reset" {
            assert_eq!(
                length.as_deref(),
                Some("100000"),
                "{path}: the announced length is kept, so the client can tell"
            );
        }
        if path == "/stall" {
            assert!(
                started.elapsed() <= Duration::from_millis(500) + Duration::from_secs(3),
                "the idle body timeout cut it off late: {:?}",
                started.elapsed()
            );
        }
        let next = fetch_body(&levee.url("/ok")).await;
        assert_eq!(
            (next.0, next.2),
            (200, Ok(4)),
            "{path}: levee serves the next request"
        );
    }

    // An HTTP/1.0 client gets a body of unknown length delimited by the connection's end:
    // only a reset, never a FIN, tells it the body was cut short.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut client = tokio::net::TcpStream::connect(levee.public)
            .await
            .expect("connect");
        client
            .write_all(b"GET /chunked-reset?late HTTP/1.0\r\nHost: a\r\n\r\n")
            .await
            .expect("request");
        let mut received = Vec::new();
        let read = tokio::time::timeout(within, client.read_to_end(&mut received))
            .await
            .expect("the HTTP/1.0 client hung");
        let head = String::from_utf8_lossy(&received);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            read.as_ref()
                .is_err_and(|error| error.kind() == std::io::ErrorKind::ConnectionReset),
            "a cut-off close-delimited body ended with {read:?}, as if whole"
        );
    }

    // Many resets: every one aborted, levee keeps serving, its memory stays flat.
    let burst = |count: usize| {
        let url = levee.url("/reset");
        async move {
            let results = futures_util::future::join_all((0..8).map(|_| {
                let url = url.clone();
                async move {
                    let (mut complete, mut aborted) = (0, 0);
                    for _ in 0..count / 8 {
                        let (status, _, body) = tokio::time::timeout(within, fetch_body(&url))
                            .await
                            .expect("a client hung on a reset backend");
                        match (status, body) {
                            (200, Ok(_)) => complete += 1,
                            (200, Err(_)) => aborted += 1,
                            _ => {}
                        }
                    }
                    (complete, aborted)
                }
            }))
            .await;
            results
                .into_iter()
                .fold((0, 0), |(c, a), (complete, aborted)| {
                    (c + complete, a + aborted)
                })
        }
    };
    let (complete, aborted) = burst(200).await;
    assert_eq!(complete, 0, "no reset response looked complete");
    assert!(aborted >= 100, "most resets came after the head: {aborted}");
    let warm = levee.rss_kib();
    let (complete, aborted) = burst(1600).await;
    assert_eq!(complete, 0, "no reset response looked complete");
    assert!(aborted >= 800, "most resets came after the head: {aborted}");
    let after = levee.rss_kib();
    assert!(
        after <= warm + 16 * 1024,
        "RSS grew from {warm} KiB to {after} KiB over 1600 resets"
    );
    let next = fetch_body(&levee.url("/ok")).await;
    assert_eq!((next.0, next.2), (200, Ok(4)));
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metric_value(&metrics, "levee_inflight_requests") <= 0.0,
        "aborted responses are no longer counted in flight: {metrics}"
    );
    backend_task.abort();
}

// ---------------------------------------------------------------------------------------
// 4. levee SIGKILLed and restarted

const QUEUE_ROUTES: &str = r#"
[[route]]
name = "notify"
match = { method = ["POST"], path = "/notify" }
tier = 2
module = "notifications"
degrade = { action = "queue" }

[[route]]
name = "visitors"
match = { path_prefix = "/visitors" }
tier = 3
module = "visitors"

[[route]]
name = "home"
match = { path = "/" }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levee_sigkilled_and_restarted_keeps_redis_switches_and_applies_every_job_once() {
    let redis_dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(redis_dir.path()).await;
    let (backend, applied) = recorder().await;
    let dir = tempfile::tempdir().expect("dir");
    let (public, admin) = (free_port(), free_port());
    std::fs::write(
        dir.path().join("levee.toml"),
        process_policy(
            public,
            admin,
            &format!(
                "[upstream.app]\nurl = \"http://{}\"\n[redis]\nurl = \"{}\"\ntimeout = \"200ms\"\n[degrade]\nsync_interval = \"100ms\"\n[queue]\npoll_interval = \"50ms\"\nreplay_rate = 2000\nclaim_after = \"1s\"\n{QUEUE_ROUTES}",
                backend.addr,
                redis.url()
            ),
        ),
    )
    .expect("policy");
    let mut first = LeveeProcess::start(dir.path(), public, admin).await;
    let admin_url = format!("http://{}", first.admin);
    assert_eq!(admin_set(&admin_url, "/level", "1").await.status, 200);
    assert_eq!(
        admin_set(&admin_url, "/modules/notifications", "off")
            .await
            .status,
        200
    );
    let mut jobs = Vec::new();
    for i in 0..30 {
        let answer = post(&first.url("/notify"), &format!("job={i}")).await;
        assert_eq!(answer.status, 202, "{}", answer.text());
        jobs.push(answer.header("x-levee-job").expect("job").to_string());
    }
    assert_eq!(backend.hits(), 0, "switched off: nothing applied yet");

    first.kill();
    let second = LeveeProcess::start(dir.path(), public, admin).await;
    let status = get(&second.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["level"], 1, "{status}");
    assert_eq!(status["degrade"]["level_origin"], "runtime", "{status}");
    assert_eq!(status["degrade"]["modules"]["notifications"]["off"], true);
    assert_eq!(
        status["degrade"]["modules"]["notifications"]["origin"],
        "runtime"
    );
    assert_eq!(get(&second.url("/visitors")).await.status, 503, "level 1");
    assert_eq!(get(&second.url("/")).await.status, 200);
    let late = post(&second.url("/notify"), "job=late").await;
    assert_eq!(late.status, 202, "still switched off: still queued");
    jobs.push(late.header("x-levee-job").expect("job").to_string());
    assert_eq!(backend.hits(), 1, "only the page reached the backend");

    assert_eq!(
        admin_set(
            &format!("http://{}", second.admin),
            "/modules/notifications",
            "on"
        )
        .await
        .status,
        200
    );
    let counts = each_applied_once(&applied, &jobs, &second.admin_url("/queues")).await;
    assert_eq!(counts.len(), jobs.len(), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levee_sigkilled_and_restarted_keeps_state_file_switches() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("dir");
    let (public, admin) = (free_port(), free_port());
    std::fs::write(
        dir.path().join("levee.toml"),
        process_policy(
            public,
            admin,
            &format!(
                "[upstream.app]\nurl = \"http://{}\"\n{}",
                backend.addr,
                QUEUE_ROUTES.replace("degrade = { action = \"queue\" }\n", "")
            ),
        ),
    )
    .expect("policy");
    let mut first = LeveeProcess::start(dir.path(), public, admin).await;
    let admin_url = format!("http://{}", first.admin);
    assert_eq!(
        admin_set(&admin_url, "/modules/notifications", "off")
            .await
            .status,
        200
    );
    assert_eq!(admin_set(&admin_url, "/level", "1").await.status, 200);
    assert_eq!(post(&first.url("/notify"), "x").await.status, 503);

    first.kill();
    let second = LeveeProcess::start(dir.path(), public, admin).await;
    let status = get(&second.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["level"], 1, "{status}");
    assert_eq!(status["degrade"]["modules"]["notifications"]["off"], true);
    assert_eq!(
        status["degrade"]["modules"]["notifications"]["origin"],
        "runtime"
    );
    assert!(
        status["degrade"]["switches_stored_in"]
            .as_str()
            .is_some_and(|path| path.ends_with(".levee-state.json")),
        "{status}"
    );
    assert_eq!(post(&second.url("/notify"), "x").await.status, 503);
    assert_eq!(get(&second.url("/visitors")).await.status, 503);
    assert_eq!(get(&second.url("/")).await.status, 200);
}

// ---------------------------------------------------------------------------------------
// 5. Policy file caught half-written under load

async fn named_backend(name: &'static str) -> Backend {
    Backend::start(move |_request: Request<Incoming>| async move { Response::new(full(name)) })
        .await
}

fn two_upstream_policy(a: &Backend, b: &Backend, target: &str, route: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\naccess_log = false\ndefault_upstream = \"a\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.a]\nurl = \"http://{}\"\n[upstream.b]\nurl = \"http://{}\"\n[[route]]\nname = \"{route}\"\nmatch = {{ path_prefix = \"/\" }}\nupstream = \"{target}\"\n",
        a.addr, b.addr
    )
}

async fn reload_failures(levee: &Levee) -> f64 {
    metric_value(
        &get(&levee.admin_url("/metrics")).await.text(),
        "levee_policy_reload_failures_total",
    )
}

/// Waits until the refused reload is counted, then checks it is reported with file:line
/// and that the active policy did not change.
async fn expect_refused(levee: &Levee, failures_before: f64, generation: u64, served_by: &str) {
    eventually(
        Duration::from_secs(10),
        "the bad file to be refused",
        || async { reload_failures(levee).await > failures_before },
    )
    .await;
    assert_eq!(levee.generation(), generation, "a bad file was swapped in");
    let status = get(&levee.admin_url("/status")).await.json();
    let error = &status["policy"]["last_reload_error"]["errors"][0];
    assert!(
        error["file"]
            .as_str()
            .is_some_and(|file| file.ends_with("levee.toml")),
        "{status}"
    );
    assert!(error["line"].as_u64().unwrap_or(0) >= 1, "{status}");
    assert_eq!(status["policy"]["generation"], generation);
    assert_eq!(get(&levee.url("/check")).await.text(), served_by);
}

async fn expect_active(levee: &Levee, generation: u64, served_by: &str) {
    eventually(
        Duration::from_secs(10),
        "the good file to take effect",
        || async {
            levee.generation() > generation && get(&levee.url("/check")).await.text() == served_by
        },
    )
    .await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert!(status["policy"]["last_reload_error"].is_null(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_caught_half_written_is_refused_and_the_finished_one_applied_under_load() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a", "all")).await;
    let file = levee.policy_file();

    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let url = levee.url("/page");
        clients.push(load_loop(stop.clone(), log.clone(), move |_| {
            Request::get(url.as_str()).body(full("")).expect("request")
        }));
    }

    // An editor (or a deploy script) writes the new version in two pieces with a pause in
    // between longer than the watcher's debounce: the first piece ends inside a string.
    let new = two_upstream_policy(&a, &b, "b", "all");
    let cut = new.find("url = \"http://").expect("an upstream url") + 12;
    let (first_half, second_half) = new.split_at(cut);
    let generation = levee.generation();
    let before = reload_failures(&levee).await;
    std::fs::write(&file, first_half).expect("write first half");
    expect_refused(&levee, before, generation, "a").await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["policy"]["last_reload_error"]["errors"][0]["line"],
        first_half.lines().count(),
        "the error points at the cut: {status}"
    );
    {
        let mut open = std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .expect("open for the rest");
        std::io::Write::write_all(&mut open, second_half.as_bytes()).expect("write the rest");
    }
    expect_active(&levee, generation, "b").await;

    // A rename-replace that brings a duplicate route name is refused as a whole...
    let generation = levee.generation();
    let before = reload_failures(&levee).await;
    let duplicate = two_upstream_policy(&a, &b, "a", "all")
        + "[[route]]\nname = \"all\"\nmatch = { path = \"/other\" }\nupstream = \"a\"\n";
    let temp = file.with_extension("toml.tmp");
    std::fs::write(&temp, &duplicate).expect("write temp");
    std::fs::rename(&temp, &file).expect("rename");
    expect_refused(&levee, before, generation, "b").await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert!(
        status["policy"]["last_reload_error"]["errors"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("defined twice")),
        "{status}"
    );
    // ... and the next good rename-replace is applied.
    std::fs::write(&temp, two_upstream_policy(&a, &b, "a", "all")).expect("write temp");
    std::fs::rename(&temp, &file).expect("rename");
    expect_active(&levee, generation, "a").await;

    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.expect("client");
    }
    let log = log.lock().expect("lock").clone();
    let failed: Vec<u16> = log
        .iter()
        .filter(|s| s.status != 200)
        .map(|s| s.status)
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        log.len(),
        &failed[..failed.len().min(10)]
    );
    assert!(log.len() > 100, "the load was too light ({})", log.len());
    assert!(reload_failures(&levee).await >= 2.0);
}

/// `/status` `redis.up` and `levee_redis_up` follow every call to Redis, not only rate-limit
/// calls: with no limited route at all, a frozen Redis shows as down (the switch sync finds
/// it so), and as up again as soon as it answers, with no request needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_up_follows_every_call_even_without_limited_traffic() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let policy = switches_on_redis(backend.addr, &redis.url());
    let levee = Levee::start(&policy).await;
    let redis_view = || async {
        let status = get(&levee.admin_url("/status")).await.json();
        let metrics = get(&levee.admin_url("/metrics")).await.text();
        (
            status["redis"].clone(),
            metric_value(&metrics, "levee_redis_up"),
        )
    };
    let (view, up) = redis_view().await;
    assert_eq!(
        (view["up"].clone(), up),
        (serde_json::json!(true), 1.0),
        "{view}"
    );

    redis.pause(true);
    eventually(Duration::from_secs(10), "redis seen down", || async {
        let (view, up) = redis_view().await;
        view["up"] == false && up == 0.0 && view["last_error"].is_string()
    })
    .await;

    redis.pause(false);
    eventually(Duration::from_secs(10), "redis seen up again", || async {
        let (view, up) = redis_view().await;
        view["up"] == true && up == 1.0 && view["last_error"].is_null()
    })
    .await;
    assert_eq!(backend.hits(), 0, "no request was needed to see either");

    // Seen down, then taken out of the policy: nothing is down any more, and an alert on
    // `levee_redis_up == 0` clears.
    redis.pause(true);
    eventually(Duration::from_secs(10), "redis seen down again", || async {
        redis_view().await.1 == 0.0
    })
    .await;
    std::fs::write(levee.policy_file(), policy_for(backend.addr, "", "")).expect("write");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    assert_eq!(redis_view().await.1, 1.0, "no [redis], nothing down");
    redis.pause(false);
}

/// Started with a Redis that nobody listens on, levee says so at once, not "up".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_at_start_shows_as_down() {
    let backend = echo_backend().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let policy = policy_for(
        backend.addr,
        "",
        &format!("[redis]\nurl = \"redis://127.0.0.1:{port}\"\ntimeout = \"100ms\"\n[degrade]\nsync_interval = \"100ms\"\n"),
    );
    let levee = Levee::start(&policy).await;
    eventually(Duration::from_secs(10), "redis seen down", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["redis"]["up"] == false
            && status["redis"]["last_error"]
                .as_str()
                .is_some_and(|error| !error.is_empty())
    })
    .await;
}

/// A switch refused because Redis did not answer (frozen: SIGSTOP) is not saved later when
/// Redis wakes: the operator was told it is not in effect, and no instance of the fleet
/// follows it afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_refused_while_redis_is_frozen_never_lands_later() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let policy = switches_on_redis(backend.addr, &redis.url());
    let levee = Levee::start(&policy).await;
    let admin = levee.admin_url("");
    redis.pause(true);
    let refused = admin_set(&admin, "/level", "2").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.text().contains("not"), "{}", refused.text());
    redis.pause(false);
    eventually(Duration::from_secs(10), "redis seen up again", || async {
        get(&levee.admin_url("/status")).await.json()["redis"]["up"] == true
    })
    .await;
    // Whatever waited on levee's connections has run by now (a call after it was answered).
    assert_eq!(
        redis_cli(redis.port, &["HGET", "levee:switches", "level"]).trim(),
        ""
    );
    assert_eq!(
        get(&levee.admin_url("/status")).await.json()["degrade"]["level"],
        0
    );
    // And a switch saved with Redis awake is in effect at once.
    assert_eq!(admin_set(&admin, "/level", "1").await.status, 200);
    assert!(redis_cli(redis.port, &["HGET", "levee:switches", "level"]).contains("\"value\":1"));
}
