//! Accept now, apply later: real redis-server, counting backends, php-fpm, a killed instance.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;

/// Every replayed request the backend saw: (Idempotency-Key, body, X-Real-IP, when).
type Seen = Arc<Mutex<Vec<(String, String, String, Instant)>>>;

/// (Cookie, X-Title) of every replayed request, as bytes.
type HeaderBytes = Arc<Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

/// A recording backend that answers every request at once with success.
async fn recording_always_ok() -> (Backend, Seen) {
    recording(0, Arc::new(AtomicBool::new(false)), Duration::ZERO).await
}

/// A backend that records jobs; `fail_first` failures per key (500), or always with `always_fail`.
async fn recording(
    fail_first: u32,
    always_fail: Arc<AtomicBool>,
    delay: Duration,
) -> (Backend, Seen) {
    let seen: Seen = Arc::new(Mutex::new(Vec::new()));
    let attempts: Arc<Mutex<HashMap<String, u32>>> = Arc::new(Mutex::new(HashMap::new()));
    let (record, tries) = (seen.clone(), attempts.clone());
    let backend = Backend::start(move |request: Request<Incoming>| {
        let (record, tries, always_fail) = (record.clone(), tries.clone(), always_fail.clone());
        async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let ip = request
                .headers()
                .get("x-real-ip")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let body = request
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            tokio::time::sleep(delay).await;
            record.lock().expect("lock").push((
                key.clone(),
                String::from_utf8_lossy(&body).into_owned(),
                ip,
                Instant::now(),
            ));
            let attempt = {
                let mut tries = tries.lock().expect("lock");
                let count = tries.entry(key).or_insert(0);
                *count += 1;
                *count
            };
            if always_fail.load(Ordering::SeqCst) || attempt <= fail_first {
                return Response::builder()
                    .status(500)
                    .body(full("not now"))
                    .expect("response");
            }
            Response::new(full("applied"))
        }
    })
    .await;
    (backend, seen)
}

fn queue_policy(upstream: std::net::SocketAddr, redis: &str, queue: &str) -> String {
    policy_for(
        upstream,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{redis}\"\ntimeout = \"200ms\"\n[degrade]\nsync_interval = \"100ms\"\n[queue]\npoll_interval = \"50ms\"\nreplay_rate = 2000\n{queue}\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\ntier = 2\nmodule = \"notifications\"\ndegrade = {{ action = \"queue\", body_json = '{{\"queued\":\"{{job}}\"}}' }}\n"
        ),
    )
}

async fn post_as(levee: &Levee, body: &str, client: &str) -> Answer {
    let request = Request::post(levee.url("/notify.php?kind=like"))
        .header("x-forwarded-for", client)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(full(body.to_string()))
        .expect("request");
    send(request).await
}

/// A job posted in a task of its own, so the test can act while levee stores it.
fn spawn_post(levee: &Levee, body: String) -> tokio::task::JoinHandle<Answer> {
    let url = levee.url("/notify.php");
    tokio::spawn(async move {
        let request = Request::post(url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(full(body))
            .expect("request");
        send(request).await
    })
}

/// Switches the queue route on and waits for `count` replays; their keys, sorted.
async fn replayed_keys(levee: &Levee, seen: &Seen, count: usize) -> Vec<String> {
    switch(levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the jobs to be replayed",
        || async { seen.lock().expect("lock").len() >= count },
    )
    .await;
    let mut keys: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(key, ..)| key.clone())
        .collect();
    keys.sort();
    keys
}

async fn switch(levee: &Levee, state: &str) {
    assert_eq!(
        post(&levee.admin_url("/modules/notifications"), state)
            .await
            .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switched_off_posts_are_accepted_and_each_applied_exactly_once_later() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    switch(&levee, "off").await;

    let mut jobs = HashMap::new();
    for i in 0..500 {
        let client = format!("203.0.113.{}", i % 250 + 1);
        let answer = post_as(&levee, &format!("like={i}"), &client).await;
        assert_eq!(answer.status, 202, "{}", answer.text());
        let job = answer.header("x-levee-job").expect("job id").to_string();
        assert!(answer.text().contains(&job));
        jobs.insert(job, (format!("like={i}"), client));
    }
    assert_eq!(
        backend.hits(),
        0,
        "nothing is applied while the route is off"
    );
    let queues = get(&levee.admin_url("/queues")).await.json();
    assert_eq!(queues["notify"]["backlog"], 500, "{queues}");

    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(30),
        "every job to be replayed",
        || async { seen.lock().expect("lock").len() >= 500 },
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "the stream to be trimmed",
        || async { get(&levee.admin_url("/queues")).await.json()["notify"]["backlog"] == 0 },
    )
    .await;
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 500, "each job exactly once");
    for (key, body, ip, _) in &seen {
        let (expected_body, expected_ip) =
            jobs.get(key).unwrap_or_else(|| panic!("unknown key {key}"));
        assert_eq!(body, expected_body);
        assert_eq!(ip, expected_ip);
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_queue_enqueued_total{route=\"notify\"}"),
        500.0
    );
    assert_eq!(
        metric_value(
            &metrics,
            "levee_queue_replayed_total{route=\"notify\",result=\"done\"}"
        ),
        500.0
    );
}

const NOTIFY_PHP: &str = r#"<?php
$line = ($_SERVER['HTTP_IDEMPOTENCY_KEY'] ?? '-') . ' ' . $_SERVER['REMOTE_ADDR'] . ' ' . file_get_contents('php://input') . "\n";
file_put_contents(__DIR__ . '/../applied.log', $line, FILE_APPEND | LOCK_EX);
echo "ok";
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_applies_queued_work_with_its_idempotency_key() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let site = PhpSite::start(&[("notify.php", NOTIFY_PHP)]).await;
    let log = site.dir.path().join("applied.log");
    std::fs::write(&log, "").expect("log");
    let _ = Command::new("chmod").arg("a+rw").arg(&log).status();
    let levee = Levee::start(&queue_policy(site.addr(), &redis.url(), "")).await;
    switch(&levee, "off").await;
    let mut keys = Vec::new();
    for i in 0..20 {
        let answer = post_as(&levee, &format!("n={i}"), "198.51.100.7").await;
        assert_eq!(answer.status, 202);
        keys.push(answer.header("x-levee-job").expect("job").to_string());
    }
    switch(&levee, "on").await;
    each_job_applied_once(&log, &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_of_a_killed_instance_are_reclaimed_and_none_is_lost() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording(
        0,
        Arc::new(AtomicBool::new(false)),
        Duration::from_millis(100),
    )
    .await;
    let policy = queue_policy(backend.addr, &redis.url(), "claim_after = \"1s\"");
    // Instance A: the real binary, killed with SIGKILL while it replays.
    let a_dir = tempfile::tempdir().expect("dir");
    std::fs::write(a_dir.path().join("levee.toml"), &policy).expect("write");
    let mut a = ChildGuard::spawn(
        "levee",
        Command::new(env!("CARGO_BIN_EXE_levee"))
            .args(["run", "--no-watch", "--policies"])
            .arg(a_dir.path())
            .env("LEVEE_LOG", "warn"),
    );
    let b = Levee::start(&policy).await;
    switch(&b, "off").await;
    let mut jobs = Vec::new();
    for i in 0..40 {
        let answer = post_as(&b, &format!("job={i}"), "192.0.2.1").await;
        assert_eq!(answer.status, 202);
        jobs.push(answer.header("x-levee-job").expect("job").to_string());
    }
    switch(&b, "on").await;
    eventually(Duration::from_secs(10), "replay to start", || async {
        seen.lock().expect("lock").len() >= 4
    })
    .await;
    let _ = Command::new("kill")
        .arg("-KILL")
        .arg(a.pid().to_string())
        .status();
    let _ = a.child.wait();

    eventually(
        Duration::from_secs(30),
        "every job to be applied",
        || async {
            let seen = seen.lock().expect("lock");
            jobs.iter()
                .all(|job| seen.iter().any(|(key, _, _, _)| key == job))
        },
    )
    .await;
    eventually(Duration::from_secs(10), "nothing left pending", || async {
        let queues = get(&b.admin_url("/queues")).await.json();
        queues["notify"]["backlog"] == 0 && queues["notify"]["in_flight"] == 0
    })
    .await;
    // Any job delivered twice (its first worker died before acknowledging) kept its key.
    let seen = seen.lock().expect("lock");
    for (key, body, _, _) in seen.iter() {
        let index = jobs.iter().position(|job| job == key).expect("a known key");
        assert_eq!(body, &format!("job={index}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_replayed_after_the_stream_disappeared_from_redis() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    let applied = |job: String| {
        let seen = seen.clone();
        move || {
            let (seen, job) = (seen.clone(), job.clone());
            async move {
                seen.lock()
                    .expect("lock")
                    .iter()
                    .any(|(key, ..)| *key == job)
            }
        }
    };
    switch(&levee, "off").await;
    let first = post_as(&levee, "before", "192.0.2.1").await;
    assert_eq!(first.status, 202);
    switch(&levee, "on").await;
    let first = first.header("x-levee-job").expect("job").to_string();
    eventually(Duration::from_secs(10), "the first job", applied(first)).await;

    // The stream goes, with its consumer group (as in a Redis restarted without persistence);
    // the next job's XADD makes the stream again, without the group.
    let stream = "levee:queue:{notify}:jobs";
    assert_eq!(redis.cli(&["DEL", stream]).trim(), "1");
    switch(&levee, "off").await;
    let second = post_as(&levee, "after", "192.0.2.1").await;
    assert_eq!(second.status, 202);
    switch(&levee, "on").await;
    let second = second.header("x-levee-job").expect("job").to_string();
    eventually(
        Duration::from_secs(10),
        "the job stored after the stream was gone",
        applied(second),
    )
    .await;
    assert_eq!(seen.lock().expect("lock").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_stored_before_a_reload_that_stops_the_route_queueing_are_still_applied() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let policy = queue_policy(backend.addr, &redis.url(), "");
    let levee = Levee::start(&policy).await;
    let jobs = store_jobs(&levee, 3, 0).await;
    // Let a replay pass see the route queueing (paused: it is off).
    eventually(
        Duration::from_secs(5),
        "the backlog to be counted",
        || async {
            get(&levee.admin_url("/metrics"))
                .await
                .text()
                .contains("levee_queue_backlog{route=\"notify\"} 3")
        },
    )
    .await;

    // The operator changes the route to refuse while off, and switches it back on.
    let queue_action = "degrade = { action = \"queue\", body_json = '{\"queued\":\"{job}\"}' }";
    assert!(policy.contains(queue_action), "{policy}");
    std::fs::write(
        levee.policy_file(),
        policy.replace(queue_action, "degrade = { action = \"reject\" }"),
    )
    .expect("rewrite the policy");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    switch(&levee, "on").await;

    eventually(
        Duration::from_secs(10),
        "the three jobs to be applied",
        || async { seen.lock().expect("lock").len() >= 3 },
    )
    .await;
    let applied: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(key, ..)| key.clone())
        .collect();
    assert_eq!(applied, jobs, "each job once, in order");
    // Listed while it drains, then forgotten once empty.
    eventually(
        Duration::from_secs(5),
        "the former queue to be forgotten",
        || async { get(&levee.admin_url("/queues")).await.json()["notify"].is_null() },
    )
    .await;
    // Its gauges with it.
    let page = get(&levee.admin_url("/metrics")).await.text();
    assert!(!page.contains("levee_queue_backlog{"), "{page}");
}

/// A reload that takes `[redis]` out leaves stored jobs in Redis, unreplayed: the operator is
/// warned with how many there were, and not at all when the queue was empty (the warning
/// sent operators looking for jobs that did not exist).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taking_redis_out_warns_of_the_jobs_left_there_only_when_there_are_some() {
    let log = levee_log();
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    for (prefix, stored) in [("empty-queue:", 0), ("two-jobs:", 2)] {
        let policy = queue_policy(backend.addr, &redis.url(), "").replace(
            "timeout = \"200ms\"\n",
            &format!("timeout = \"200ms\"\nkey_prefix = \"{prefix}\"\n"),
        );
        let levee = Levee::start(&policy).await;
        store_jobs(&levee, stored, 0).await;
        backlog_counted(&levee, stored).await;

        let without_redis = policy_for(
            backend.addr,
            "access_log = false",
            "[[route]]\nname = \"notify\"\nmatch = { method = [\"POST\"], path_prefix = \"/notify\" }\ntier = 2\nmodule = \"notifications\"\ndegrade = { action = \"reject\" }\n",
        );
        std::fs::write(levee.policy_file(), without_redis).expect("rewrite the policy");
        let reloaded = post(&levee.admin_url("/reload"), "").await;
        assert_eq!(reloaded.status, 200, "{}", reloaded.text());
        // The pass that saw the route stop queueing takes the gauges out after its word.
        eventually(
            Duration::from_secs(5),
            "the gauges to be taken out",
            || async {
                !get(&levee.admin_url("/metrics"))
                    .await
                    .text()
                    .contains("levee_queue_backlog{")
            },
        )
        .await;
        let warned = log.lines_with(&format!("stream={prefix}queue:"));
        if stored == 0 {
            assert!(warned.is_empty(), "{warned:?}");
        } else {
            assert_eq!(warned.len(), 1, "{warned:?}");
            assert!(
                warned[0].contains("WARN")
                    && warned[0].contains("the policy no longer has [redis]: the 2 jobs stored in this route's queue when levee last counted"),
                "{warned:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pointing_redis_elsewhere_says_the_jobs_stay_behind_and_queues_on_the_new_one() {
    let log = levee_log();
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("former")).expect("dir");
    std::fs::create_dir_all(dir.path().join("next")).expect("dir");
    let former = RedisServer::start(&dir.path().join("former")).await;
    let next = RedisServer::start(&dir.path().join("next")).await;
    let (backend, seen) = recording_always_ok().await;
    let prefix = "moving-redis:";
    let policy = |redis: &str| {
        queue_policy(backend.addr, redis, "").replace(
            "timeout = \"200ms\"\n",
            &format!("timeout = \"200ms\"\nkey_prefix = \"{prefix}\"\n"),
        )
    };
    let levee = Levee::start(&policy(&former.url())).await;
    store_jobs(&levee, 2, 0).await;
    backlog_counted(&levee, 2).await;

    std::fs::write(levee.policy_file(), policy(&next.url())).expect("rewrite the policy");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    let stream = format!("stream={prefix}queue:");
    eventually(
        Duration::from_secs(5),
        "the jobs left behind to be said",
        || async { !log.lines_with("[redis] now names other servers").is_empty() },
    )
    .await;
    let warned = log.lines_with("[redis] now names other servers");
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].contains("WARN")
            && warned[0].contains(&stream)
            && warned[0].contains("the 2 jobs stored in this queue at the former ones"),
        "{warned:?}"
    );

    // The new servers' queue works: a job stored there is applied, the former two are not.
    let jobs = store_jobs(&levee, 1, 2).await;
    switch(&levee, "on").await;
    applied_in_order(&seen, &jobs).await;
    let gone: Vec<String> = log
        .lines_with("consumer group is gone")
        .into_iter()
        .filter(|line| line.contains(&stream))
        .collect();
    assert!(
        gone.is_empty(),
        "the former servers' group is not the new ones' loss: {gone:?}"
    );
    let left = former.cli(&["XLEN", &format!("{prefix}queue:{{notify}}:jobs")]);
    assert_eq!(left.trim(), "2", "the jobs stay where they were stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_gauges_are_taken_out_while_redis_cannot_be_read() {
    // Left at their last figures, they said "2 jobs, fresh" for as long as Redis was down.
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    store_jobs(&levee, 2, 0).await;
    let metrics = || async { get(&levee.admin_url("/metrics")).await.text() };
    eventually(
        Duration::from_secs(5),
        "the backlog to be counted",
        || async {
            metrics()
                .await
                .contains("levee_queue_backlog{route=\"notify\"} 2")
        },
    )
    .await;
    drop(redis);
    eventually(
        Duration::from_secs(10),
        "the gauges to be taken out",
        || async {
            let page = metrics().await;
            !page.contains("levee_queue_backlog{")
                && !page.contains("levee_queue_oldest_job_age_seconds{")
        },
    )
    .await;
    assert_eq!(get(&levee.admin_url("/queues")).await.status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_queue_of_a_route_whose_key_prefix_changed_stays_in_reach() {
    // The route keeps its name and queues under new keys: the old queue was listed under the
    // same name, hidden behind the new one, and its dead letters were out of the API's reach.
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = Backend::start(|_request: Request<Incoming>| async {
        Response::builder()
            .status(422)
            .body(full("refused"))
            .expect("response")
    })
    .await;
    let policy = queue_policy(backend.addr, &redis.url(), "");
    let levee = Levee::start(&policy).await;
    store_jobs(&levee, 2, 0).await;
    // A replay pass has seen the route queue under the first keys.
    backlog_counted(&levee, 2).await;
    let moved = policy.replace("[redis]\n", "[redis]\nkey_prefix = \"site2:\"\n");
    assert_ne!(moved, policy);
    std::fs::write(levee.policy_file(), &moved).expect("rewrite the policy");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    // The switch in effect is carried to the new prefix, which held none; handed back, the
    // module is on, and the old jobs are replayed, refused (422) and dead-lettered in the
    // old queue.
    eventually(Duration::from_secs(5), "the switch carried", || async {
        redis
            .cli(&["HEXISTS", "site2:switches", "module:notifications"])
            .trim()
            == "1"
    })
    .await;
    switch(&levee, "policy").await;
    let old = "levee:queue:{notify}:jobs";
    eventually(
        Duration::from_secs(10),
        "the old queue's dead letters to be listed apart",
        || async {
            let queues = get(&levee.admin_url("/queues")).await.json();
            queues[old]["dead_letters"] == 2 && queues["notify"]["dead_letters"] == 0
        },
    )
    .await;
    let queues = get(&levee.admin_url("/queues")).await.json();
    assert_eq!(queues[old]["stopped_queueing"], true, "{queues}");
    assert_eq!(queues[old]["stream"], old, "{queues}");
    let path = format!(
        "/queues/{}/dead",
        old.replace('{', "%7B").replace('}', "%7D")
    );
    let dead = get(&levee.admin_url(&path)).await;
    assert_eq!(dead.status, 200, "{}", dead.text());
    assert_eq!(
        dead.json().as_array().map(Vec::len),
        Some(2),
        "{}",
        dead.text()
    );
    assert_eq!(
        get(&levee.admin_url("/queues/notify/dead")).await.json(),
        serde_json::json!([]),
        "the new queue has none"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_job_keeps_the_content_length_its_request_had() {
    // A DELETE with `Content-Length: 0` reached the app without the field (PHP: CONTENT_LENGTH
    // empty rather than "0"); one that came chunked gets levee's own length.
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    // Each replay's method and Content-Length.
    type Lengths = Arc<Mutex<Vec<(String, Option<String>)>>>;
    let lengths: Lengths = Arc::new(Mutex::new(Vec::new()));
    let record = lengths.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let record = record.clone();
        async move {
            let length = request
                .headers()
                .get("content-length")
                .and_then(|value| value.to_str().ok())
                .map(str::to_string);
            record
                .lock()
                .expect("lock")
                .push((request.method().to_string(), length));
            Response::new(full("ok"))
        }
    })
    .await;
    let policy = queue_policy(backend.addr, &redis.url(), "")
        .replace("method = [\"POST\"]", "method = [\"POST\", \"DELETE\"]");
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let delete = Request::delete(levee.url("/notify.php?id=7"))
        .header("content-length", "0")
        .body(full(""))
        .expect("request");
    assert_eq!(send(delete).await.status, 202);
    let post = Request::post(levee.url("/notify.php"))
        .body(chunked(vec![
            bytes::Bytes::from_static(b"like"),
            bytes::Bytes::from_static(b"=1"),
        ]))
        .expect("request");
    assert_eq!(send(post).await.status, 202);
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "both jobs to be applied",
        || async { lengths.lock().expect("lock").len() >= 2 },
    )
    .await;
    assert_eq!(
        *lengths.lock().expect("lock"),
        vec![
            ("DELETE".to_string(), Some("0".to_string())),
            ("POST".to_string(), Some("6".to_string())),
        ]
    );
}

/// Waits until a replay pass has counted `jobs` in the notify route's queue.
async fn backlog_counted(levee: &Levee, jobs: usize) {
    let counted = format!("levee_queue_backlog{{route=\"notify\"}} {jobs}");
    eventually(
        Duration::from_secs(5),
        "the backlog to be counted",
        || async {
            get(&levee.admin_url("/metrics"))
                .await
                .text()
                .contains(&counted)
        },
    )
    .await;
}

/// Stores `count` jobs through `levee` (its route switched off) and stops it.
async fn store_jobs_then_stop(levee: Levee, count: usize, first: usize) -> Vec<String> {
    let jobs = store_jobs(&levee, count, first).await;
    stop(levee).await;
    jobs
}

/// Switches `levee`'s route off and stores `count` jobs (`like=first`, …) through it; their
/// ids.
async fn store_jobs(levee: &Levee, count: usize, first: usize) -> Vec<String> {
    switch(levee, "off").await;
    let mut jobs = Vec::new();
    for i in first..first + count {
        let answer = post_as(levee, &format!("like={i}"), "192.0.2.7").await;
        assert_eq!(answer.status, 202, "{}", answer.text());
        jobs.push(answer.header("x-levee-job").expect("job").to_string());
    }
    jobs
}

async fn stop(mut levee: Levee) {
    let running = levee.running.take().expect("running");
    running.shutdown();
    running.wait().await;
}

async fn applied_in_order(seen: &Seen, jobs: &[String]) {
    eventually(
        Duration::from_secs(10),
        "the jobs to be applied",
        || async { seen.lock().expect("lock").len() >= jobs.len() },
    )
    .await;
    let applied: Vec<String> = seen
        .lock()
        .expect("lock")
        .drain(..)
        .map(|(key, ..)| key)
        .collect();
    assert_eq!(applied, jobs, "each job once, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_left_by_a_route_that_stopped_queueing_while_levee_was_down_are_applied() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let policy = queue_policy(backend.addr, &redis.url(), "")
        .replace("access_log = false", "access_log = false\ndrain = \"0s\"");
    let queue_action = "degrade = { action = \"queue\", body_json = '{\"queued\":\"{job}\"}' }";
    assert!(policy.contains(queue_action), "{policy}");
    let not_queueing = policy.replace(queue_action, "degrade = { action = \"reject\" }");
    let route_at = policy
        .find("[[route]]\nname = \"notify\"")
        .expect("the route");

    // Started again without a route of that name: the jobs are kept and listed, not lost.
    // The instance that stores the jobs stops before its first replay pass: storing a job is
    // what lists the route for the next instance.
    let no_pass = policy.replace("poll_interval = \"50ms\"", "poll_interval = \"1h\"");
    assert_ne!(no_pass, policy);
    let jobs = store_jobs_then_stop(Levee::start(&no_pass).await, 3, 0).await;
    let levee = Levee::start(&policy[..route_at]).await;
    eventually(
        Duration::from_secs(5),
        "the queue to be listed without its route",
        || async {
            let queues = get(&levee.admin_url("/queues")).await.json();
            queues["notify"]["route_missing"] == true && queues["notify"]["backlog"] == 3
        },
    )
    .await;
    assert_eq!(
        get(&levee.admin_url("/queues/notify/dead")).await.status,
        200
    );
    assert!(
        seen.lock().expect("lock").is_empty(),
        "nowhere to replay them"
    );
    // A reload brings the route back, not queueing: the jobs go through it.
    std::fs::write(levee.policy_file(), &not_queueing).expect("rewrite the policy");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    switch(&levee, "on").await;
    applied_in_order(&seen, &jobs).await;
    eventually(
        Duration::from_secs(5),
        "the emptied queue to be forgotten, in levee and in redis",
        || async {
            get(&levee.admin_url("/queues")).await.json()["notify"].is_null()
                && !redis
                    .cli(&["SMEMBERS", "levee:queue:routes"])
                    .contains("notify")
        },
    )
    .await;
    stop(levee).await;

    // Started again with the route there but no longer queueing: replayed through it.
    let jobs = store_jobs_then_stop(Levee::start(&no_pass).await, 2, 10).await;
    let levee = Levee::start(&not_queueing).await;
    switch(&levee, "on").await;
    applied_in_order(&seen, &jobs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_values_beyond_ascii_are_replayed_byte_for_byte() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let received: HeaderBytes = Arc::new(Mutex::new(Vec::new()));
    let record = received.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let record = record.clone();
        async move {
            let bytes = |name: &str| {
                request
                    .headers()
                    .get(name)
                    .map(|value| value.as_bytes().to_vec())
                    .unwrap_or_default()
            };
            let seen = (bytes("cookie"), bytes("x-title"));
            record.lock().expect("lock").push(seen);
            Response::new(full("applied"))
        }
    })
    .await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    switch(&levee, "off").await;
    // A cookie a script set with raw UTF-8 next to the session, and a value that is not UTF-8.
    let cookie = b"PHPSESSID=s1; name=\xe8\xae\xba".to_vec();
    let title = b"\xe8\xae\xba \xff".to_vec();
    let mut request = b"POST /notify.php HTTP/1.1\r\nHost: a\r\nCookie: ".to_vec();
    request.extend_from_slice(&cookie);
    request.extend_from_slice(b"\r\nX-Title: ");
    request.extend_from_slice(&title);
    request.extend_from_slice(b"\r\nContent-Length: 6\r\nConnection: close\r\n\r\nlike=1");
    let answer = raw_exchange(levee.public, &request, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the job to be replayed",
        || async { !received.lock().expect("lock").is_empty() },
    )
    .await;
    let received = received.lock().expect("lock").clone();
    assert_eq!(received, vec![(cookie, title)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_worker_keeps_its_jobs_while_a_slow_app_replays_them() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    // Every replay takes longer than claim_after, and a batch of four takes four times that.
    let (backend, seen) = recording(
        0,
        Arc::new(AtomicBool::new(false)),
        Duration::from_millis(1200),
    )
    .await;
    let policy = queue_policy(backend.addr, &redis.url(), "claim_after = \"1s\"");
    let first = Levee::start(&policy).await;
    let second = Levee::start(&policy).await;
    switch(&first, "off").await;
    let mut jobs = Vec::new();
    for i in 0..4 {
        let answer = post_as(&first, &format!("job={i}"), "192.0.2.1").await;
        assert_eq!(answer.status, 202);
        jobs.push(answer.header("x-levee-job").expect("job").to_string());
    }
    // Both instances follow the switch; whichever reads the jobs first holds all four.
    switch(&first, "on").await;
    eventually(
        Duration::from_secs(20),
        "every job to be applied",
        || async {
            let seen = seen.lock().expect("lock");
            jobs.iter()
                .all(|job| seen.iter().any(|(key, ..)| key == job))
        },
    )
    .await;
    eventually(Duration::from_secs(5), "nothing left pending", || async {
        let queues = get(&second.admin_url("/queues")).await.json();
        queues["notify"]["backlog"] == 0 && queues["notify"]["in_flight"] == 0
    })
    .await;
    // A replay the backend has begun but not recorded yet would be a second one.
    eventually(Duration::from_secs(5), "the backend to be idle", || async {
        backend.hits() == seen.lock().expect("lock").len()
    })
    .await;
    let seen = seen.lock().expect("lock");
    for job in &jobs {
        let times = seen.iter().filter(|(key, ..)| key == job).count();
        assert_eq!(times, 1, "job {job} replayed {times} times");
    }
    assert_eq!(backend.hits(), 4);
}

#[test]
fn check_refuses_a_claim_after_below_a_second() {
    let stderr = check_fails("[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[redis]\nurl = \"redis://127.0.0.1:9/0\"\n[queue]\nclaim_after = \"100ms\"\n");
    assert!(
        stderr.contains("levee.toml:6:15: error: claim_after must be at least 1s"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_on_a_queue_route_gets_408_and_nothing_is_stored() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _) = recording_always_ok().await;
    let policy = queue_policy(backend.addr, &redis.url(), "").replace(
        "access_log = false",
        "access_log = false\nclient_body_timeout = \"300ms\"",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    // Ten bytes of the thousand announced, then nothing.
    let answer = raw_exchange(
        levee.public,
        b"POST /notify.php HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\nfirst ten.",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert_eq!(
        get(&levee.admin_url("/queues")).await.json()["notify"]["backlog"],
        0,
        "nothing stored"
    );
    // Still queueing.
    assert_eq!(post_as(&levee, "like=1", "192.0.2.1").await.status, 202);
}

/// The dead letters list each job's target with the values of the query parameters
/// `[identity]` reads API keys from as `***`, as log lines show them: the listing goes to
/// dashboards and operators' terminals, and a client's key is a credential.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_with_query_api_keys_hidden() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = Backend::start(|_request: Request<Incoming>| async {
        Response::builder()
            .status(422)
            .body(full("refused"))
            .expect("response")
    })
    .await;
    let policy = queue_policy(
        backend.addr,
        &redis.url(),
        "[identity]\napi_key = \"query:api_key\"",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let secret = "SECRETQUERYKEY";
    let request = Request::post(levee.url(&format!("/notify.php?kind=like&api_key={secret}")))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(full("like=1"))
        .expect("request");
    let answer = send(request).await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    switch(&levee, "on").await;
    eventually(Duration::from_secs(10), "a dead letter", || async {
        get(&levee.admin_url("/queues")).await.json()["notify"]["dead_letters"] == 1
    })
    .await;

    let dead = get(&levee.admin_url("/queues/notify/dead")).await;
    assert_eq!(dead.status, 200, "{}", dead.text());
    assert_eq!(
        dead.json()[0]["target"],
        "/notify.php?kind=like&api_key=***",
        "{}",
        dead.text()
    );
    assert!(!dead.text().contains(secret), "{}", dead.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_with_back_off_then_dead_lettered_and_retryable() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let never = Arc::new(AtomicBool::new(false));
    let (backend, seen) = recording(2, never.clone(), Duration::ZERO).await;
    let policy = queue_policy(
        backend.addr,
        &redis.url(),
        // Long enough that "a retry waiting" below is seen between attempts on a loaded
        // machine.
        "backoff_base = \"1s\"\nmax_attempts = 3",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let job = post_as(&levee, "flaky", "192.0.2.9")
        .await
        .header("x-levee-job")
        .expect("job")
        .to_string();
    switch(&levee, "on").await;
    eventually(Duration::from_secs(10), "the third attempt", || async {
        seen.lock().expect("lock").len() >= 3
    })
    .await;
    let times: Vec<Instant> = seen
        .lock()
        .expect("lock")
        .iter()
        .filter(|(k, ..)| *k == job)
        .map(|(.., at)| *at)
        .collect();
    assert_eq!(
        times.len(),
        3,
        "succeeded on the third attempt, and only once"
    );
    let (first_gap, second_gap) = (times[1] - times[0], times[2] - times[1]);
    assert!(first_gap >= Duration::from_millis(750), "{first_gap:?}");
    assert!(
        second_gap >= Duration::from_millis(1500),
        "back-off doubles: {second_gap:?}"
    );

    // A job that always fails ends in the dead letters after max_attempts.
    never.store(true, Ordering::SeqCst);
    switch(&levee, "off").await;
    let doomed = post_as(&levee, "doomed", "192.0.2.9")
        .await
        .header("x-levee-job")
        .expect("job")
        .to_string();
    switch(&levee, "on").await;
    // While it waits for a retry it is still work to do: counted in the backlog, as in
    // `levee_queue_backlog`, and shown apart as delayed.
    eventually(Duration::from_secs(10), "a retry waiting", || async {
        let queues = get(&levee.admin_url("/queues")).await.json();
        queues["notify"]["delayed"] == 1 && queues["notify"]["backlog"] == 1
    })
    .await;
    eventually(Duration::from_secs(10), "a dead letter", || async {
        get(&levee.admin_url("/queues")).await.json()["notify"]["dead_letters"] == 1
    })
    .await;
    let dead = get(&levee.admin_url("/queues/notify/dead")).await.json();
    assert_eq!(dead[0]["idempotency_key"], doomed.as_str());
    assert_eq!(dead[0]["attempts"], 3);
    // The version its replay keeps (the test client's).
    assert_eq!(dead[0]["version"], "HTTP/1.1", "{dead}");
    assert!(
        dead[0]["error"].as_str().unwrap_or("").contains("500"),
        "{dead}"
    );

    // Retried from the admin API once the app is fixed: applied with the same key.
    never.store(false, Ordering::SeqCst);
    let id = dead[0]["id"].as_str().expect("id").to_string();
    // A GET cannot retry it, nor a POST list the letters: each is told the method it needs.
    let wrong = get(&levee.admin_url(&format!("/queues/notify/dead/{id}/retry"))).await;
    assert_eq!((wrong.status, wrong.header("allow")), (405, Some("POST")));
    let wrong = post(&levee.admin_url("/queues/notify/dead"), "").await;
    assert_eq!((wrong.status, wrong.header("allow")), (405, Some("GET")));
    assert_eq!(
        post(
            &levee.admin_url(&format!("/queues/notify/dead/{id}/retry")),
            ""
        )
        .await
        .status,
        200
    );
    // A second retry of the same dead letter (another operator, a double click) finds
    // nothing to retry: the job is queued once.
    assert_eq!(
        post(
            &levee.admin_url(&format!("/queues/notify/dead/{id}/retry")),
            ""
        )
        .await
        .status,
        404
    );
    // An id that is not one (a typo, a bare time, Redis's range words) is the operator's
    // mistake, said as such: not a 503 as if Redis were down, nor an entry nobody named.
    for typo in ["not-an-id", "1700000000000", "-", "+", "1-x", "+1-0"] {
        for action in ["retry", "drop"] {
            let answer = post(
                &levee.admin_url(&format!("/queues/notify/dead/{typo}/{action}")),
                "",
            )
            .await;
            assert_eq!(answer.status, 400, "{typo} {action}: {}", answer.text());
        }
    }
    eventually(
        Duration::from_secs(10),
        "the retried job to be applied",
        || async {
            let seen = seen.lock().expect("lock");
            seen.iter().filter(|(k, ..)| *k == doomed).count() == 4
        },
    )
    .await;
    assert_eq!(
        get(&levee.admin_url("/queues")).await.json()["notify"]["dead_letters"],
        0
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_queue_dead_lettered_total{route=\"notify\"}"
        ),
        1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_the_queue_and_its_figures_answer_503_and_big_bodies_413() {
    let dir = tempfile::tempdir().expect("dir");
    let mut redis = RedisServer::start(dir.path()).await;
    let (backend, _) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(
        backend.addr,
        &redis.url(),
        "max_body = \"1KiB\"",
    ))
    .await;
    switch(&levee, "off").await;

    let too_big = post_as(&levee, &"x".repeat(2000), "192.0.2.1").await;
    assert_eq!(too_big.status, 413);
    // Announced over the limit with `Expect: 100-continue`: refused at once, no `100
    // Continue` asking the client to upload what would be refused.
    let expecting = raw_exchange(
        levee.public,
        b"POST /notify.php HTTP/1.1\r\nHost: a\r\nContent-Length: 5000\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(expecting.starts_with("HTTP/1.1 413"), "{expecting}");
    assert_eq!(
        get(&levee.admin_url("/queues")).await.json()["notify"]["backlog"],
        0,
        "nothing stored"
    );

    redis.guard.stop();
    let attempts = AtomicU32::new(0);
    for _ in 0..5 {
        let answer = post_as(&levee, "like=1", "192.0.2.1").await;
        attempts.fetch_add(1, Ordering::SeqCst);
        assert_eq!(
            answer.status,
            503,
            "never a 202 for work that was not stored: {}",
            answer.text()
        );
        assert!(answer.header("retry-after").is_some());
    }
    assert_eq!(backend.hits(), 0);
    // Those failures opened Redis's health breaker: a client that waits for `100 Continue`
    // is answered at once, not asked to upload a body that cannot be stored.
    eventually(Duration::from_secs(5), "redis known down", || async {
        get(&levee.admin_url("/status")).await.json()["redis"]["up"] == false
    })
    .await;
    let expecting = raw_exchange(
        levee.public,
        b"POST /notify.php HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(expecting.starts_with("HTTP/1.1 503"), "{expecting}");
    // The queues' figures are in Redis: none are made up while it is down.
    let figures = get(&levee.admin_url("/queues")).await;
    assert_eq!(figures.status, 503, "{}", figures.text());
    assert!(
        figures.text().contains("queue figures are unreadable"),
        "{}",
        figures.text()
    );
    // Why: Redis refuses connections (a timeout alone read as a Redis too slow to answer).
    assert!(
        figures.text().contains("Connection refused"),
        "{}",
        figures.text()
    );
}

/// A write to a queue route meets its upstream's open breaker while the route is on: it is
/// queued (202), not refused, and applied once the breaker lets requests through again. With
/// Redis down too, nothing can be stored: 503, and nothing reaches the app.
/// levee before an app that answers 500 (in `failure_statuses`) while `failing` holds, its
/// breaker opened by three visitors' failed writes (open 100 ms), with `queue` in `[queue]`.
async fn failing_app_behind_an_open_breaker(
    redis: &RedisServer,
    queue: &str,
) -> (Levee, Backend, Seen, Arc<AtomicBool>) {
    let failing = Arc::new(AtomicBool::new(true));
    let (backend, seen) = recording(0, failing.clone(), Duration::ZERO).await;
    let upstream = format!("url = \"http://{}\"\n", backend.addr);
    let policy = queue_policy(backend.addr, &redis.url(), queue).replace(
        &upstream,
        &format!("{upstream}breaker = {{ consecutive_failures = 3, failure_statuses = [500], open_for = \"100ms\", max_open_for = \"100ms\" }}\n"),
    );
    let levee = Levee::start(&policy).await;
    for client in ["10.1.0.1", "10.2.0.1", "10.3.0.1"] {
        assert_eq!(post_as(&levee, "like=0", client).await.status, 500);
    }
    (levee, backend, seen, failing)
}

/// Jobs replayed as a half-open breaker's probes while the app still fails (its database is
/// down: PHP answers 500) spend no attempt: they wait for the app, and none reaches the dead
/// letters however long the outage, where they all did within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_replayed_as_probes_of_a_failing_app_spend_no_attempt() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (levee, _backend, seen, failing) = failing_app_behind_an_open_breaker(
        &redis,
        "max_attempts = 2\nbackoff_base = \"20ms\"\nbackoff_max = \"50ms\"\n",
    )
    .await;
    let mut jobs = Vec::new();
    for i in 1..=2 {
        let answer = post_as(&levee, &format!("like={i}"), "192.0.2.7").await;
        assert_eq!(answer.status, 202, "{}", answer.text());
        jobs.push(answer.header("x-levee-job").expect("job").to_string());
    }
    // Far more tries than the jobs' attempts (2 each) allow.
    eventually(
        Duration::from_secs(10),
        "the jobs to be tried again and again",
        || async { seen.lock().expect("lock").len() >= 3 + 12 },
    )
    .await;
    let queues = get(&levee.admin_url("/queues")).await.json();
    assert_eq!(queues["notify"]["dead_letters"], 0, "{queues}");

    failing.store(false, Ordering::SeqCst);
    eventually(
        Duration::from_secs(10),
        "the jobs to be applied once the app is back",
        || async { get(&levee.admin_url("/queues")).await.json()["notify"]["backlog"] == 0 },
    )
    .await;
    let queues = get(&levee.admin_url("/queues")).await.json();
    assert_eq!(queues["notify"]["dead_letters"], 0, "{queues}");
    let tried: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(key, ..)| key.clone())
        .collect();
    for job in &jobs {
        assert!(tried.contains(job), "{job} reached the app: {tried:?}");
    }
}

/// A visitor's write that would be a half-open breaker's probe is queued instead: sent to an
/// app still down, it got the app's error page and was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_queued_rather_than_spent_as_a_half_open_breakers_probe() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (levee, _backend, seen, failing) = failing_app_behind_an_open_breaker(&redis, "").await;
    eventually(
        Duration::from_secs(5),
        "the breaker to be ready to probe",
        || async {
            get(&levee.admin_url("/status")).await.json()["upstreams"][0]["breaker"]
                ["open_for_remaining_ms"]
                .as_u64()
                == Some(0)
        },
    )
    .await;
    let answer = post_as(&levee, "like=1", "10.4.0.1").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    let job = answer.header("x-levee-job").expect("job").to_string();
    // A body longer than the 64 KiB read ahead (a long comment) is queued too.
    let long = format!("comment={}", "x".repeat(70 * 1024));
    let answer = post_as(&levee, &long, "10.5.0.1").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    let long_job = answer.header("x-levee-job").expect("job").to_string();
    // So is one that asked `Expect: 100-continue` (not read ahead).
    let request = Request::post(levee.url("/notify.php?kind=like"))
        .header("x-forwarded-for", "10.6.0.1")
        .header("expect", "100-continue")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(full("like=2".to_string()))
        .expect("request");
    let answer = send(request).await;
    assert_eq!(answer.status, 202, "{}", answer.text());

    failing.store(false, Ordering::SeqCst);
    eventually(
        Duration::from_secs(10),
        "the writes to be applied once the app is back",
        || async {
            let seen = seen.lock().expect("lock");
            seen.iter()
                .any(|(key, body, ..)| *key == job && body == "like=1")
                && seen
                    .iter()
                    .any(|(key, body, ..)| *key == long_job && *body == long)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_meets_an_open_breaker_is_queued_and_applied_later() {
    let dir = tempfile::tempdir().expect("dir");
    let mut redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    let pinned = post(&levee.admin_url("/breakers/app"), "open").await;
    assert_eq!(pinned.status, 200, "{}", pinned.text());

    let answer = post_as(&levee, "like=1", "192.0.2.7").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    let job = answer.header("x-levee-job").expect("job id").to_string();
    assert!(answer.text().contains(&job), "{}", answer.text());
    assert_eq!(
        backend.hits(),
        0,
        "the breaker is open: nothing reaches the app"
    );
    assert_eq!(
        get(&levee.admin_url("/queues")).await.json()["notify"]["backlog"],
        1
    );

    let released = post(&levee.admin_url("/breakers/app"), "auto").await;
    assert_eq!(released.status, 200, "{}", released.text());
    eventually(
        Duration::from_secs(10),
        "the queued write to be applied",
        || async { !seen.lock().expect("lock").is_empty() },
    )
    .await;
    let applied = seen.lock().expect("lock").clone();
    assert_eq!(applied.len(), 1);
    assert_eq!(
        (
            applied[0].0.as_str(),
            applied[0].1.as_str(),
            applied[0].2.as_str()
        ),
        (job.as_str(), "like=1", "192.0.2.7"),
        "applied once, with its body and the client's address"
    );

    // Too large for the queue (its max_body, 1 MiB by default): the breaker's own answer,
    // not a 413 that tells the client never to send it again.
    assert_eq!(
        post(&levee.admin_url("/breakers/app"), "open").await.status,
        200
    );
    let large = post_as(&levee, &"x".repeat(2 * 1024 * 1024), "192.0.2.7").await;
    assert_eq!(large.status, 503, "{}", large.text());
    assert!(large.header("retry-after").is_some());

    // Breaker open and Redis gone: the write can be neither sent nor stored, and gets the
    // breaker's answer.
    redis.guard.stop();
    let answer = post_as(&levee, "like=2", "192.0.2.7").await;
    assert_eq!(answer.status, 503, "{}", answer.text());
    assert!(answer.header("retry-after").is_some());
    assert_eq!(backend.hits(), 1, "only the replayed job reached the app");
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_queue_enqueued_total{route=\"notify\"}"),
        1.0,
        "nothing more was stored: {metrics}"
    );
    assert!(
        metric_value(&metrics, "levee_breaker_rejected_total{upstream=\"app\"}") >= 3.0,
        "each answered by the open breaker: {metrics}"
    );
}

/// With the app down (nothing listens), a write to a queue route is never sent: it is queued
/// (202) instead of answered 502, and applied once the app is back. A body too large to be
/// read whole first (over 64 KiB) streams to the upstream as it comes, so it gets the 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_reaches_no_upstream_is_queued_and_applied_once_it_is_back() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let down: std::net::SocketAddr = format!("127.0.0.1:{}", free_port())
        .parse()
        .expect("address");
    let policy = |upstream| queue_policy(upstream, &redis.url(), "max_body = \"1MiB\"");
    let levee = Levee::start(&policy(down)).await;

    let answer = post_as(&levee, "like=1", "192.0.2.9").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    let job = answer.header("x-levee-job").expect("job id").to_string();
    // A write with no body at all is queued as well.
    let empty = post_as(&levee, "", "192.0.2.9").await;
    assert_eq!(empty.status, 202, "{}", empty.text());
    let big = post_as(&levee, &"x".repeat(100 * 1024), "192.0.2.9").await;
    assert_eq!(big.status, 502, "{}", big.text());
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_upstream_errors_total{upstream=\"app\",kind=\"connect\"}"
        ),
        3.0,
        "all count as the app's failures: {metrics}"
    );
    assert_eq!(
        get(&levee.admin_url("/queues")).await.json()["notify"]["backlog"],
        2
    );

    // The app is back (here: at another address, by a reload).
    let (backend, seen) = recording_always_ok().await;
    std::fs::write(levee.policy_file(), policy(backend.addr)).expect("rewrite the policy");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    eventually(
        Duration::from_secs(10),
        "the queued writes to be applied",
        || async { seen.lock().expect("lock").len() >= 2 },
    )
    .await;
    let applied = seen.lock().expect("lock").clone();
    assert_eq!(applied.len(), 2);
    assert_eq!(applied[1].1, "", "the empty write, empty");
    assert_eq!(
        (
            applied[0].0.as_str(),
            applied[0].1.as_str(),
            applied[0].2.as_str()
        ),
        (job.as_str(), "like=1", "192.0.2.9")
    );
}

/// A write to a queue route that its upstream's bulkhead sheds (every slot taken) is queued
/// and applied once a slot is free, instead of refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_the_bulkhead_sheds_is_queued_and_applied_later() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) =
        recording(0, Arc::new(AtomicBool::new(false)), Duration::from_secs(1)).await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "").replace(
        "[redis]",
        "max_inflight = 1\nqueue_wait = \"10ms\"\n[redis]",
    ))
    .await;
    // The first write takes the only slot, and holds it for a second.
    let first = spawn_post(&levee, "like=1".into());
    eventually(
        Duration::from_secs(5),
        "the first write to hold the slot",
        || async { backend.hits() == 1 },
    )
    .await;
    let answer = post_as(&levee, "like=2", "192.0.2.8").await;
    assert_eq!(answer.status, 202, "shed, then queued: {}", answer.text());
    let job = answer.header("x-levee-job").expect("job id").to_string();
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_shed_total{upstream=\"app\",tier=\"2\"}"),
        1.0,
        "{metrics}"
    );
    assert_eq!(first.await.expect("first write").status, 200);
    eventually(
        Duration::from_secs(10),
        "both writes to be applied",
        || async { seen.lock().expect("lock").len() >= 2 },
    )
    .await;
    let applied = seen.lock().expect("lock").clone();
    assert_eq!(applied.len(), 2, "each once");
    let (first_done, replayed) = (&applied[0], &applied[1]);
    assert_eq!(
        (replayed.0.as_str(), replayed.1.as_str()),
        (job.as_str(), "like=2"),
        "{applied:?}"
    );
    // The replay took the slot after the first write gave it back (each is answered after a
    // second): it never ran beside it, past max_inflight.
    assert!(
        replayed.3 >= first_done.3 + Duration::from_millis(900),
        "replayed {:?} after the first write was answered",
        replayed.3.saturating_duration_since(first_done.3)
    );
}

/// Redis runs a write in time but its answer is slow to come back: levee settles the write
/// with Redis before it answers the client. Not yet read by a worker: withdrawn, 503, never
/// applied. Read by a worker meanwhile: it stands, 202.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_answer_is_late_is_settled_before_the_client_is_answered() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let relay = SlowAnswers::start(std::net::SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let (backend, seen) = recording_always_ok().await;
    // levee's own worker looks for work once, at start: the stream is the test's to read.
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"redis://{}\"\ntimeout = \"500ms\"\n[queue]\npoll_interval = \"1h\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\nalways_queue = true\n",
            relay.addr
        ),
    ))
    .await;
    let stream = "levee:queue:{notify}:jobs";
    // The write carries its record's key; the answers after it come 800 ms late, after
    // levee's 500 ms.
    let write = ":{notify}:write:";
    let stored = || redis.cli(&["XLEN", stream]).trim().to_string();
    // The workers' consumer group, as levee makes it when it first finds the stream.
    let group = redis.cli(&["XGROUP", "CREATE", stream, "levee", "0", "MKSTREAM"]);
    assert_eq!(group.trim(), "OK");

    relay.arm(write, Duration::from_millis(800));
    let answer = post_as(&levee, "like=1", "192.0.2.1").await;
    assert_eq!(answer.status, 503, "{}", answer.text());
    assert_eq!(stored(), "0", "the job was withdrawn");

    // A worker reads the job while its answer is held back: it stands, and the client is told.
    relay.arm(write, Duration::from_millis(800));
    let post = tokio::spawn({
        let url = levee.url("/notify.php?kind=like");
        async move {
            let request = Request::post(url)
                .header("x-forwarded-for", "192.0.2.2")
                .body(full("like=2"))
                .expect("request");
            send(request).await
        }
    });
    eventually(Duration::from_secs(2), "the job stored", || async {
        stored() == "1"
    })
    .await;
    let read = redis.cli(&[
        "XREADGROUP",
        "GROUP",
        "levee",
        "thief",
        "COUNT",
        "1",
        "STREAMS",
        stream,
        ">",
    ]);
    assert!(read.contains("like=2"), "{read}");
    let answer = post.await.expect("post");
    assert_eq!(answer.status, 202, "{}", answer.text());
    let job = answer.header("x-levee-job").unwrap_or_default().to_string();
    assert!(
        read.contains(&job),
        "the job the worker read: {job} in {read}"
    );
    assert_eq!(stored(), "1", "the job stands");
    assert!(seen.lock().expect("lock").is_empty());
}

/// In a Redis Cluster, each queue's writes follow the health breaker of the node holding its
/// stream: a node out makes only the routes it holds answer 503 (once its breaker is open,
/// without waiting on it), while the others go on storing work, which is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_out_stops_only_the_queues_it_holds() {
    let dir = tempfile::tempdir().expect("dir");
    let cluster = RedisCluster::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let stream = |route: &str| format!("levee:queue:{{{route}}}:jobs");
    let out_node = cluster.owner(&stream("notify"));
    let other = (0..)
        .map(|i| format!("mail{i}"))
        .find(|route| cluster.owner(&stream(route)) != out_node)
        .expect("some route's stream is on another node");
    let route = |name: &str| {
        format!("[[route]]\nname = \"{name}\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/{name}\" }}\nalways_queue = true\n")
    };
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\ncluster = [{}]\ntimeout = \"200ms\"\nfailures_to_open = 2\ncooldown = \"1h\"\n[queue]\npoll_interval = \"50ms\"\n{}{}",
            cluster.toml_list(),
            route("notify"),
            route(&other)
        ),
    ))
    .await;
    let post_to = |route: &str, body: &str| {
        let request = Request::post(levee.url(&format!("/{route}.php")))
            .header("x-forwarded-for", "192.0.2.1")
            .body(full(body.to_string()))
            .expect("request");
        send(request)
    };
    let applied = |body: &'static str| {
        let seen = seen.clone();
        move || {
            let seen = seen.clone();
            async move { seen.lock().expect("lock").iter().any(|job| job.1 == body) }
        }
    };
    assert_eq!(post_to("notify", "first=1").await.status, 202);
    assert_eq!(post_to(&other, "first=2").await.status, 202);
    eventually(Duration::from_secs(5), "the first jobs applied", || async {
        seen.lock().expect("lock").len() == 2
    })
    .await;
    eventually(Duration::from_secs(5), "the slot map read", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["redis"]["nodes"].as_array().map(Vec::len) == Some(3)
    })
    .await;

    cluster.pause(out_node, true);
    for attempt in 0..2 {
        let answer = post_to("notify", "lost=1").await;
        assert_eq!(answer.status, 503, "attempt {attempt}: {}", answer.text());
    }
    // Two failures opened the node's breaker: the third post is refused without a call.
    let node_up = |metrics: &str, node: usize| {
        metric_value(
            metrics,
            &format!(
                "levee_redis_node_up{{node=\"127.0.0.1:{}\"}}",
                cluster.ports[node]
            ),
        )
    };
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(node_up(&metrics, out_node), 0.0, "{metrics}");
    // Rate limits on the node out are on their fallbacks, and /status says so (it said
    // "redis" whatever a cluster's nodes did).
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["redis"]["rate_limits"], "partly fallback",
        "{status}"
    );
    let answer = post_to("notify", "lost=1").await;
    assert_eq!(answer.status, 503, "{}", answer.text());
    let answer = post_to(&other, "second=2").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    eventually(
        Duration::from_secs(5),
        "the other route's job applied while the node is out",
        applied("second=2"),
    )
    .await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    // /queues shows the queue on the node still up, and the other's reason.
    let queues = get(&levee.admin_url("/queues")).await;
    cluster.pause(out_node, false);
    assert_eq!(queues.status, 200, "{}", queues.text());
    let queues = queues.json();
    assert!(queues["notify"]["error"].is_string(), "{queues}");
    assert!(queues[other.as_str()]["backlog"].is_i64(), "{queues}");

    assert_eq!(node_up(&metrics, out_node), 0.0, "{metrics}");
    assert_eq!(
        node_up(&metrics, cluster.owner(&stream(&other))),
        1.0,
        "{metrics}"
    );
    // Redis as a whole is not up while a master node is out.
    assert_eq!(metric_value(&metrics, "levee_redis_up"), 0.0, "{metrics}");
    // The posts that timed out never sent their write (their clock read went unanswered),
    // and the third did not call the node at all: after the thaw, the stream holds nothing
    // (the first job was applied and deleted).
    assert_eq!(
        cluster.cli(out_node, &["XLEN", &stream("notify")]).trim(),
        "0"
    );
    assert!(!seen
        .lock()
        .expect("lock")
        .iter()
        .any(|job| job.1 == "lost=1"));
}

#[test]
fn check_refuses_queues_without_redis() {
    let stderr = check_fails("[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[[route]]\nname = \"notify\"\ntier = 2\ndegrade = { action = \"queue\" }\n");
    assert!(
        stderr.contains("levee.toml:6:22: error: action `queue` needs [redis]"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_carries_the_forwarded_proto_levee_believes_not_the_clients() {
    // The app sees a replayed job as it would have seen the request forwarded at once: a
    // client levee does not trust cannot claim `https` (an app that marks cookies secure or
    // skips its https redirect on that word would believe it).
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let protos: Arc<Mutex<Vec<Option<String>>>> = Arc::new(Mutex::new(Vec::new()));
    let record = protos.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let claims = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        // An untrusted client's `Forwarded` is gone too, and anyone's
        // `X-Levee-Modules-Off` (levee's word alone, also in a replay).
        let proto = claims("x-forwarded-proto")
            .filter(|_| claims("forwarded").is_none() && claims("x-levee-modules-off").is_none());
        record.lock().expect("lock").push(proto);
        async move { Response::new(full("applied")) }
    })
    .await;
    let policy = queue_policy(backend.addr, &redis.url(), "").replace(
        "access_log = false",
        "access_log = false\ntrusted_proxies = []",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let request = Request::post(levee.url("/notify.php"))
        .header("x-forwarded-proto", "https")
        .header("forwarded", "proto=https")
        .header("x-levee-modules-off", "ranking")
        .body(full("like=1"))
        .expect("request");
    assert_eq!(send(request).await.status, 202);
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the job to be replayed",
        || async { !protos.lock().expect("lock").is_empty() },
    )
    .await;
    assert_eq!(
        protos.lock().expect("lock").clone(),
        vec![Some("http".to_string())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_idempotency_key_reaches_the_app_with_its_job() {
    // A client told 503 that retries, or an API client that always sends a key, sends the
    // same `Idempotency-Key` with each try: the app can tell the tries are one only if it sees
    // that key, not a job id that differs from try to try.
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    switch(&levee, "off").await;
    for _ in 0..2 {
        let request = Request::post(levee.url("/notify.php"))
            .header("idempotency-key", "order-7f3a")
            .body(full("pay=1"))
            .expect("request");
        assert_eq!(send(request).await.status, 202);
    }
    let plain = post_as(&levee, "like=1", "198.51.100.7").await;
    let job = plain.header("x-levee-job").expect("job id").to_string();
    // A blank key names no operation: the job id stands in for it.
    let blank = Request::post(levee.url("/notify.php"))
        .header("idempotency-key", " ")
        .body(full("pay=2"))
        .expect("request");
    let blank = send(blank).await;
    assert_eq!(blank.status, 202);
    let blank_job = blank.header("x-levee-job").expect("job id").to_string();
    let keys = replayed_keys(&levee, &seen, 4).await;
    let mut expected = vec![
        job,
        blank_job,
        "order-7f3a".to_string(),
        "order-7f3a".to_string(),
    ];
    expected.sort();
    assert_eq!(keys, expected);
}

/// A replay that got no answer may have been applied, and its retry may apply it twice: a
/// warning, naming the key the app saw (the client's own here), not only the job's id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_no_answer_is_warned_of_with_the_key_the_app_saw() {
    let log = levee_log();
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let backend = Backend::start(move |_request: Request<Incoming>| {
        let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Response::new(full("applied"))
        }
    })
    .await;
    let policy = queue_policy(backend.addr, &redis.url(), "backoff_base = \"50ms\"")
        .replace("[redis]", "response_timeout = \"300ms\"\n[redis]");
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let request = Request::post(levee.url("/notify.php"))
        .header("idempotency-key", "order-unanswered-9")
        .body(full("pay=1"))
        .expect("request");
    let stored = send(request).await;
    assert_eq!(stored.status, 202);
    let job = stored.header("x-levee-job").expect("job id").to_string();
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the retry to be applied",
        || async { calls.load(Ordering::SeqCst) >= 2 },
    )
    .await;
    let warned = log.lines_with("key=order-unanswered-9");
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].contains("WARN")
            && warned[0].contains(
                "replay failed, to be tried again: no answer within 300ms (the app may have run it"
            )
            && warned[0].contains(&format!("job={job}")),
        "{warned:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_applied_while_redis_restarts_is_finished_once_redis_is_back_not_applied_again() {
    // The app applied the job, and Redis went away before the worker could mark it done. It
    // comes back (with its data) well within claim_after: the worker finishes the job then,
    // rather than leaving it to be taken over and sent to the app a second time.
    let dir = tempfile::tempdir().expect("dir");
    let port = free_port();
    let redis = Arc::new(Mutex::new(Some(
        RedisServer::start_persistent(dir.path(), port).await,
    )));
    let applied: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let (record, to_kill) = (applied.clone(), redis.clone());
    let backend = Backend::start(move |request: Request<Incoming>| {
        let key = request
            .headers()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        record.lock().expect("lock").push(key);
        if let Some(mut server) = to_kill.lock().expect("lock").take() {
            server.kill();
        }
        async move { Response::new(full("applied")) }
    })
    .await;
    let url = format!("redis://127.0.0.1:{port}/0");
    let levee = Levee::start(&queue_policy(backend.addr, &url, "claim_after = \"30s\"")).await;
    switch(&levee, "off").await;
    assert_eq!(post_as(&levee, "like=1", "198.51.100.7").await.status, 202);
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the app to apply the job",
        || async { !applied.lock().expect("lock").is_empty() },
    )
    .await;
    let _back = RedisServer::start_persistent(dir.path(), port).await;
    eventually(Duration::from_secs(20), "the queue to be empty", || async {
        get(&levee.admin_url("/queues")).await.json()["notify"]["backlog"] == 0
    })
    .await;
    assert_eq!(applied.lock().expect("lock").len(), 1, "applied once");
}

/// A full Redis under `noeviction` refuses new jobs: the write is answered 503 and nothing is
/// stored. (The write removed earlier writes' records before storing the job, and Redis lets a
/// script that has written go on writing when full: every job was taken, past `maxmemory`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_refuses_new_jobs_with_503() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let url = format!("redis://127.0.0.1:{}/0", redis.port);
    let levee = Levee::start(&queue_policy(backend.addr, &url, "")).await;
    switch(&levee, "off").await;
    let stream = "levee:queue:{notify}:jobs";
    // Each answered write leaves its record for the next write to remove.
    assert_eq!(post_as(&levee, "n=1", "198.51.100.7").await.status, 202);
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&[
        "EVAL",
        "for i = 1, 3000 do redis.call('SET', 'fill:' .. i, string.rep('x', 1000)) end",
        "0",
    ]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1mb"]);
    let refused = post_as(&levee, "n=2", "198.51.100.7").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    // A full Redis answers: it is not taken for down (its health breaker flapped, and logged
    // both ways, on every refused write while the worker's reads were answered).
    let writes = (0..40).map(|_| post_as(&levee, "n=2", "198.51.100.7"));
    for refused in futures_util::future::join_all(writes).await {
        assert_eq!(refused.status, 503, "{}", refused.text());
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_redis_transitions_total{to=\"down\"}"),
        0.0,
        "{metrics}"
    );
    // Redis's refusal is an answer: the client is told nothing was stored, not that it may be.
    assert!(
        refused.text().contains("nothing was stored"),
        "{}",
        refused.text()
    );
    assert_eq!(
        redis.cli(&["XLEN", stream]).trim(),
        "1",
        "nothing more stored"
    );
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    eventually(
        Duration::from_secs(10),
        "jobs to be taken again",
        || async { post_as(&levee, "n=3", "198.51.100.7").await.status == 202 },
    )
    .await;
}

/// A Redis that has turned replica (a failover levee has not followed) refuses the write
/// before running any of it, as a cluster moving the stream's slot does (`TRYAGAIN`,
/// `MOVED`): the client is told nothing was stored, not that it may be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_redis_refused_without_running_it_was_not_stored() {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("a")).expect("dir");
    std::fs::create_dir_all(dir.path().join("b")).expect("dir");
    let redis = RedisServer::start(&dir.path().join("a")).await;
    let master = RedisServer::start(&dir.path().join("b")).await;
    let (backend, _seen) = recording_always_ok().await;
    let url = format!("redis://127.0.0.1:{}/0", redis.port);
    let levee = Levee::start(&queue_policy(backend.addr, &url, "")).await;
    switch(&levee, "off").await;
    assert_eq!(post_as(&levee, "n=1", "198.51.100.7").await.status, 202);
    redis.cli(&["REPLICAOF", "127.0.0.1", &master.port.to_string()]);
    let refused = post_as(&levee, "n=2", "198.51.100.7").await;
    redis.cli(&["REPLICAOF", "NO", "ONE"]);
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(
        refused.text().contains("nothing was stored"),
        "{}",
        refused.text()
    );
}

/// A site whose routes have no rate limits still finds Redis back after an outage: the queue
/// write is let through as the health breaker's probe once its cool-down is over. (It had
/// been refused 503 for as long as no rate-limited request came to close the breaker.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_writes_find_redis_back_without_rate_limited_traffic() {
    let dir = tempfile::tempdir().expect("dir");
    let port = free_port();
    let mut redis = RedisServer::start_persistent(dir.path(), port).await;
    let (backend, _seen) = recording_always_ok().await;
    let url = format!("redis://127.0.0.1:{port}/0");
    let levee = Levee::start(&queue_policy(backend.addr, &url, "")).await;
    switch(&levee, "off").await;
    assert_eq!(post_as(&levee, "n=1", "198.51.100.7").await.status, 202);

    redis.kill();
    eventually(
        Duration::from_secs(10),
        "the health breaker to open on failed queue writes",
        || async {
            let refused = post_as(&levee, "n=2", "198.51.100.7").await.status == 503;
            refused
                && get(&levee.admin_url("/status")).await.json()["redis"]["rate_limits"]
                    == "fallback"
        },
    )
    .await;

    let _back = RedisServer::start_persistent(dir.path(), port).await;
    eventually(
        Duration::from_secs(10),
        "a queue write to be stored again",
        || async { post_as(&levee, "n=3", "198.51.100.7").await.status == 202 },
    )
    .await;
    assert_eq!(
        get(&levee.admin_url("/status")).await.json()["redis"]["rate_limits"],
        "redis",
        "the write was the probe that closed the health breaker"
    );
}

/// Two routes' jobs never meet under one `Idempotency-Key`: stream entry ids are unique only
/// within one route's stream (and a clock reading a client could guess), so an app that drops
/// duplicates by key had thrown away the second of two jobs stored in the same millisecond.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_of_two_routes_reach_the_app_under_keys_of_their_own() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let policy = queue_policy(backend.addr, &redis.url(), "")
        + "[[route]]\nname = \"comment\"\nmatch = { method = [\"POST\"], path_prefix = \"/comment\" }\ntier = 2\nmodule = \"notifications\"\ndegrade = { action = \"queue\" }\n";
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let mut answered = Vec::new();
    for round in 0..20 {
        let posts = ["/notify.php", "/comment.php"].map(|path| {
            send(
                Request::post(levee.url(path))
                    .body(full(format!("n={round}")))
                    .expect("request"),
            )
        });
        for answer in futures_util::future::join_all(posts).await {
            assert_eq!(answer.status, 202, "{}", answer.text());
            answered.push(answer.header("x-levee-job").expect("job").to_string());
        }
    }
    let mut keys = replayed_keys(&levee, &seen, 40).await;
    assert!(
        keys.iter()
            .all(|key| key.len() == 32 && key.bytes().all(|b| b.is_ascii_hexdigit())),
        "{keys:?}"
    );
    keys.dedup();
    assert_eq!(keys.len(), 40, "every job under a key of its own");
    answered.sort();
    assert_eq!(keys, answered, "the client was told the key the app sees");
}

/// During a rolling deploy an instance of the new policy, where the route no longer queues,
/// runs beside an old one that still stores jobs for it. When the old one stops, the new one
/// finds its queue in the registry, read again while it runs, not only at its start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_an_instance_of_the_old_policy_left_during_a_rolling_deploy_are_applied() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let old_policy = queue_policy(backend.addr, &redis.url(), "");
    let queueing = "degrade = { action = \"queue\", body_json = '{\"queued\":\"{job}\"}' }";
    assert!(old_policy.contains(queueing), "{old_policy}");
    let new = Levee::start(&old_policy.replace(queueing, "")).await;
    // The new instance has read the registry (empty) by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let old = Levee::start(&old_policy).await;
    let jobs = store_jobs_then_stop(old, 3, 0).await;
    switch(&new, "on").await;
    applied_in_order(&seen, &jobs).await;
}

/// A job waiting for its retry still counts as the oldest waiting job: it had left the stream
/// (and comes back under a new entry id), and the age read 0 while it kept failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waiting_for_its_retry_keeps_its_age() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording(0, Arc::new(AtomicBool::new(true)), Duration::ZERO).await;
    let policy = queue_policy(
        backend.addr,
        &redis.url(),
        "backoff_base = \"5s\"\nmax_attempts = 5",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    assert_eq!(post_as(&levee, "flaky", "192.0.2.9").await.status, 202);
    // Stored more than a second before its first attempt.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    switch(&levee, "on").await;
    eventually(Duration::from_secs(10), "the first attempt", || async {
        !seen.lock().expect("lock").is_empty()
    })
    .await;
    let queue = get(&levee.admin_url("/queues")).await.json();
    assert_eq!(
        (&queue["notify"]["backlog"], &queue["notify"]["delayed"]),
        (&serde_json::json!(1), &serde_json::json!(1)),
        "still to do, waiting for its retry: {queue}"
    );
    assert!(
        queue["notify"]["oldest_job_age_seconds"].as_u64() >= Some(1),
        "{queue}"
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metric_value(
            &metrics,
            "levee_queue_oldest_job_age_seconds{route=\"notify\"}"
        ) >= 1.0,
        "{metrics}"
    );
}

/// A Redis that keeps nothing on disk loses every queued job when it restarts: said once
/// with the eviction policy; one with an append-only file is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_keeps_nothing_on_disk_is_warned_of() {
    let log = levee_log();
    let dir = tempfile::tempdir().expect("dir");
    for name in ["bare", "kept"] {
        std::fs::create_dir(dir.path().join(name)).expect("dir");
    }
    let bare = RedisServer::start(&dir.path().join("bare")).await;
    let kept = RedisServer::start_persistent(&dir.path().join("kept"), free_port()).await;
    let (backend, _) = recording_always_ok().await;
    let mut running = Vec::new();
    for redis in [&bare, &kept] {
        let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
        eventually(Duration::from_secs(5), "the settings read", || async {
            get(&levee.admin_url("/status")).await.json()["redis"]["maxmemory_policy"].is_string()
        })
        .await;
        running.push(levee);
    }
    let warned_of = |redis: &RedisServer| {
        log.lines_with("redis keeps nothing on disk")
            .iter()
            .any(|line| line.contains(&redis.url()))
    };
    eventually(Duration::from_secs(5), "the warning", || async {
        warned_of(&bare)
    })
    .await;
    assert!(!warned_of(&kept));
}

/// A Redis that evicts any key when full may drop jobs already answered 202: levee reads its
/// policy, warns, and shows it in `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_queued_jobs_is_named_in_status() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    let (backend, _) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    eventually(Duration::from_secs(5), "the policy to be read", || async {
        get(&levee.admin_url("/status")).await.json()["redis"]["maxmemory_policy"] == "allkeys-lru"
    })
    .await;

    // In a cluster every node answers (a map of node to text, which failed to read as one
    // text: a "redis calls fail" every pass and no check): one node that evicts any key is
    // named.
    let cluster = RedisCluster::start(&dir.path().join("cluster")).await;
    cluster.cli(1, &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    let levee = Levee::start(&policy_for(
        backend.addr,
        "",
        &format!(
            "[redis]\ncluster = [{}]\n[queue]\npoll_interval = \"50ms\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\nalways_queue = true\n",
            cluster.toml_list(),
        ),
    ))
    .await;
    eventually(
        Duration::from_secs(5),
        "the cluster's policy to be read",
        || async {
            get(&levee.admin_url("/status")).await.json()["redis"]["maxmemory_policy"]
                == "allkeys-lru"
        },
    )
    .await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert!(status["redis"]["last_error"].is_null(), "{status}");
}

/// Every levee process joins each queue's consumer group under a name of its own, so each
/// restart left a consumer behind in Redis for good. Those idle over the bound and holding no
/// job are removed. One holding a job is kept (its removal would drop the job from the group's
/// pending list, and no worker could take it over) until another worker has taken its job
/// over; a live one and the worker's own are kept too. On one server, and in a cluster, where
/// the node holding the stream runs the script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_consumers_holding_no_job_are_removed_from_a_queues_group() {
    use levee::redis_store::RedisTarget;
    let dir = tempfile::tempdir().expect("dir");
    let keys = levee::queue::QueueKeys::new("levee:", "notify");
    let redis = RedisServer::start(dir.path()).await;
    let single = redis_store_for(RedisTarget::Single(redis.url()));
    remove_idle_consumers_of(&single, &keys, |args| redis.cli(args)).await;

    let cluster = RedisCluster::start(&dir.path().join("cluster")).await;
    let node = cluster.owner(&keys.stream);
    let clustered = redis_store_for(RedisTarget::Cluster(cluster.urls()));
    remove_idle_consumers_of(&clustered, &keys, |args| cluster.cli(node, args)).await;
}

fn redis_store_for(target: levee::redis_store::RedisTarget) -> levee::redis_store::RedisStore {
    levee::redis_store::RedisStore::new(levee::redis_store::RedisSettings {
        target,
        timeout: Duration::from_millis(500),
        failures_to_open: 3,
        cooldown: Duration::from_secs(1),
        key_prefix: "levee:".into(),
        instances: 1,
        admit_ahead_above: 1.0,
        tls: None,
    })
}

/// The scenario of `idle_consumers_holding_no_job_are_removed_from_a_queues_group` against one
/// Redis; `cli` runs redis-cli on the server that holds the queue's stream.
async fn remove_idle_consumers_of(
    redis: &levee::redis_store::RedisStore,
    keys: &levee::queue::QueueKeys,
    cli: impl Fn(&[&str]) -> String,
) {
    use levee::queue::worker::{remove_consumers_if_idle, remove_idle_consumers};
    let stream = keys.stream.as_str();
    let names = || -> Vec<String> {
        let listed = cli(&["XINFO", "CONSUMERS", stream, "levee"]);
        let lines: Vec<&str> = listed.lines().collect();
        let mut names: Vec<String> = lines
            .windows(2)
            .filter(|pair| pair[0] == "name")
            .map(|pair| pair[1].to_string())
            .collect();
        names.sort();
        names
    };
    cli(&["XGROUP", "CREATE", stream, "levee", "0", "MKSTREAM"]);
    cli(&["XADD", stream, "*", "body", "like=1"]);
    // An instance that stopped holding nothing, one that died holding a job, this worker.
    cli(&["XGROUP", "CREATECONSUMER", stream, "levee", "stopped"]);
    let read = cli(&[
        "XREADGROUP",
        "GROUP",
        "levee",
        "died-holding-a-job",
        "COUNT",
        "1",
        "STREAMS",
        stream,
        ">",
    ]);
    assert!(read.contains("like=1"), "{read}");
    cli(&["XGROUP", "CREATECONSUMER", stream, "levee", "this-worker"]);
    // Idle time cannot be faked: the bound is short instead, and these pass it.
    let bound = Duration::from_millis(300);
    tokio::time::sleep(bound * 2).await;
    cli(&["XGROUP", "CREATECONSUMER", stream, "levee", "live"]);

    // Whatever names it is given, the script removes no consumer holding a job or not idle
    // over the bound, and counts none that is not there.
    let not_to_remove = ["died-holding-a-job", "live", "removed-already"].map(String::from);
    let removed = remove_consumers_if_idle(redis, keys, "levee", &not_to_remove, bound)
        .await
        .expect("redis answers");
    assert_eq!(removed, 0);

    let removed = remove_idle_consumers(redis, keys, "levee", "this-worker", bound)
        .await
        .expect("redis answers");
    assert_eq!(removed, 1);
    assert_eq!(names(), ["died-holding-a-job", "live", "this-worker"]);
    assert_eq!(
        cli(&["XPENDING", stream, "levee"]).lines().next(),
        Some("1")
    );

    // Once another worker has taken its job over, the dead one holds nothing and goes too.
    let claimed = cli(&[
        "XAUTOCLAIM",
        stream,
        "levee",
        "this-worker",
        "0",
        "0-0",
        "JUSTID",
    ]);
    assert!(claimed.lines().count() >= 2, "{claimed}");
    let removed = remove_idle_consumers(redis, keys, "levee", "this-worker", bound)
        .await
        .expect("redis answers");
    assert_eq!(removed, 1);
    assert_eq!(names(), ["live", "this-worker"]);
    let held = cli(&["XPENDING", stream, "levee", "-", "+", "10", "this-worker"]);
    assert_eq!(
        held.lines().count(),
        4,
        "the job, held by this worker: {held}"
    );
}

/// An entry the worker cannot read as a job (written by hand, or by a broken tool) goes to
/// the dead letters, where an operator sees it, and is counted as a dead letter once Redis
/// has recorded the move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_job_is_dead_lettered_and_counted() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    // One job stored and applied first makes the stream and its group.
    switch(&levee, "off").await;
    assert_eq!(post_as(&levee, "like=1", "192.0.2.1").await.status, 202);
    switch(&levee, "on").await;
    replayed_keys(&levee, &seen, 1).await;

    let stream = "levee:queue:{notify}:jobs";
    redis.cli(&["XADD", stream, "*", "body", "no method, no target"]);
    // Whole but for its headers: kept among the dead letters with everything readable.
    redis.cli(&[
        "XADD",
        stream,
        "*",
        "route",
        "notify",
        "method",
        "POST",
        "target",
        "/notify.php?x=1",
        "header_lines",
        "no colon and no line end",
        "body",
        "like=2",
    ]);
    let dead_lettered = "levee_queue_dead_lettered_total{route=\"notify\"}";
    eventually(
        Duration::from_secs(10),
        "the unreadable entries dead-lettered",
        || async {
            let metrics = get(&levee.admin_url("/metrics")).await.text();
            metrics.contains(dead_lettered) && metric_value(&metrics, dead_lettered) == 2.0
        },
    )
    .await;
    let dead = get(&levee.admin_url("/queues/notify/dead")).await.json();
    assert_eq!(dead.as_array().map(Vec::len), Some(2), "{dead}");
    let text = dead.to_string();
    assert!(
        text.contains("unreadable job: no `route` field, no `method` field, no `target` field"),
        "{dead}"
    );
    assert!(
        text.contains("unreadable job: its headers cannot be read"),
        "{dead}"
    );
    assert!(
        text.contains("/notify.php?x=1"),
        "what could be read is kept: {dead}"
    );
    assert_eq!(redis.cli(&["XLEN", stream]).trim(), "0");
    assert_eq!(seen.lock().expect("lock").len(), 1, "never sent to the app");

    // Queued again, it would come straight back: refused with the reason; dropped, it goes.
    let id = dead[0]["id"].as_str().expect("id").to_string();
    let retried = post(
        &levee.admin_url(&format!("/queues/notify/dead/{id}/retry")),
        "",
    )
    .await;
    assert_eq!(retried.status, 409, "{}", retried.text());
    assert!(
        retried.text().contains("not a whole job"),
        "{}",
        retried.text()
    );
    let dropped = post(
        &levee.admin_url(&format!("/queues/notify/dead/{id}/drop")),
        "",
    )
    .await;
    assert_eq!(dropped.status, 200, "{}", dropped.text());
}

/// A queued request passed the route's limits as a forwarded one does, and its 202 carries
/// the same `RateLimit` fields (`headers_on_allow`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_answer_carries_the_rate_limit_fields() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _) = recording_always_ok().await;
    let policy = queue_policy(
        backend.addr,
        &redis.url(),
        "[limit.posts]\nkey = [\"ip\"]\nrate = \"10/min\"\nburst = 5\nheaders_on_allow = true\n",
    )
    .replace(
        "module = \"notifications\"\n",
        "module = \"notifications\"\nlimits = [\"posts\"]\n",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let accepted = post_as(&levee, "like=1", "192.0.2.1").await;
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    assert!(
        accepted.header("ratelimit-policy").is_some(),
        "{:?}",
        accepted.headers
    );
    assert!(
        accepted
            .header("ratelimit")
            .is_some_and(|state| state.contains("r=4")),
        "{:?}",
        accepted.headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_finishes_the_replay_in_flight_and_starts_no_other() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    // The app takes 700 ms per job: a shutdown comes while one is being applied.
    let (backend, seen) = recording(
        0,
        Arc::new(AtomicBool::new(false)),
        Duration::from_millis(700),
    )
    .await;
    let policy = queue_policy(backend.addr, &redis.url(), "")
        .replace("access_log = false", "access_log = false\ndrain = \"0s\"");
    let levee = Levee::start(&policy).await;
    store_jobs(&levee, 3, 0).await;
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "a replay to reach the app",
        || async { backend.hits() >= 1 },
    )
    .await;
    stop(levee).await;
    // Stopped only once the job in flight was applied and acknowledged; none begun after.
    assert_eq!(
        seen.lock().expect("lock").len(),
        1,
        "the job in flight was finished"
    );
    let stream = "levee:queue:{notify}:jobs";
    assert_eq!(backend.hits(), 1, "no other job was begun");
    // The finished job is gone from the stream; the two read with it but not begun wait
    // there (held by this worker until claim_after, when any other takes them).
    assert_eq!(
        redis.cli(&["XLEN", stream]).trim(),
        "2",
        "the rest wait in redis"
    );
    let pending = redis.cli(&["XPENDING", stream, "levee"]);
    assert!(pending.starts_with('2'), "{pending}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_drains_at_replay_rate_without_waiting_between_batches() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    // Batches are 20 jobs. A pass that replayed a whole batch is followed at once, not after
    // poll_interval; jobs start 1 / replay_rate apart.
    let policy = queue_policy(backend.addr, &redis.url(), "")
        .replace("poll_interval = \"50ms\"", "poll_interval = \"5s\"")
        .replace("replay_rate = 2000", "replay_rate = 20");
    let levee = Levee::start(&policy).await;
    store_jobs(&levee, 45, 0).await;
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(20),
        "the backlog to be applied",
        || async { seen.lock().expect("lock").len() >= 45 },
    )
    .await;
    let times: Vec<Instant> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|seen| seen.3)
        .collect();
    let gaps: Vec<Duration> = times.windows(2).map(|pair| pair[1] - pair[0]).collect();
    // Started 50 ms apart at 20/s: the 45 take at least 44 intervals from the first to the
    // last, less what the backend's clock can move one of them by on a busy machine. (Gap by
    // gap, one job seen late and the next close behind it made a short gap.)
    let span = times[times.len() - 1] - times[0];
    assert!(
        span + Duration::from_millis(200) >= Duration::from_millis(50 * 44),
        "45 jobs at 20/s came within {span:?}"
    );
    for batch_end in [19, 39] {
        assert!(
            gaps[batch_end] < Duration::from_millis(2500),
            "the next batch waited {:?} (poll_interval is 5 s)",
            gaps[batch_end]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_job_carries_the_forwarded_fields_a_forwarded_request_does() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    type Fields = Arc<Mutex<Vec<(String, String)>>>;
    let fields: Fields = Arc::new(Mutex::new(Vec::new()));
    let record = fields.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let record = record.clone();
        async move {
            let field = |name: &str| {
                request
                    .headers()
                    .get_all(name)
                    .iter()
                    .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
                    .collect::<Vec<_>>()
                    .join(" | ")
            };
            let seen = (field("x-forwarded-for"), field("x-real-ip"));
            record.lock().expect("lock").push(seen);
            Response::new(full("applied"))
        }
    })
    .await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    let send_through_front = |chain: &'static str| {
        let request = Request::post(levee.url("/notify.php"))
            .header("x-forwarded-for", chain)
            .body(full("like=1"))
            .expect("request");
        send(request)
    };
    for chain in ["10.0.0.5, 203.0.113.9", "203.0.113.9"] {
        assert_eq!(send_through_front(chain).await.status, 200);
        switch(&levee, "off").await;
        assert_eq!(send_through_front(chain).await.status, 202);
        switch(&levee, "on").await;
        eventually(
            Duration::from_secs(10),
            "the job to be replayed",
            || async { fields.lock().expect("lock").len().is_multiple_of(2) },
        )
        .await;
        let seen = fields.lock().expect("lock").clone();
        let (forwarded, replayed) = (&seen[seen.len() - 2], &seen[seen.len() - 1]);
        assert_eq!(replayed, forwarded, "the chain {chain}");
        assert_eq!(replayed.0, chain);
        assert_eq!(replayed.1, "203.0.113.9");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_views_on_a_queue_route_are_never_queued() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let policy = queue_policy(backend.addr, &redis.url(), "").replace("method = [\"POST\"], ", "");
    assert!(!policy.contains("method ="), "{policy}");
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    for method in ["GET", "HEAD", "OPTIONS"] {
        let request = Request::builder()
            .method(method)
            .uri(levee.url("/notify.php"))
            .body(full(""))
            .expect("request");
        let answer = send(request).await;
        assert_eq!(answer.status, 503, "{method}: {}", answer.text());
    }
    // No job stored. (The stream may be there: the worker's first pass makes it, empty, with
    // its consumer group; under load that pass came before this look.)
    assert_eq!(
        redis.cli(&["XLEN", "levee:queue:{notify}:jobs"]).trim(),
        "0"
    );
    // Work is: a DELETE is queued like a POST.
    let request = Request::delete(levee.url("/notify.php?id=1"))
        .body(full(""))
        .expect("request");
    assert_eq!(send(request).await.status, 202);
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the DELETE to be applied",
        || async { seen.lock().expect("lock").len() == 1 },
    )
    .await;
    assert_eq!(backend.hits(), 1, "no page view reached the app while off");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_page_by_page() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    let dead = "levee:queue:{notify}:dead";
    for id in 1..=5 {
        redis.cli(&["XADD", dead, &format!("{id}-0"), "error", "x"]);
    }
    let page = |query: &str| {
        let url = levee.admin_url(&format!("/queues/notify/dead{query}"));
        async move { get(&url).await }
    };
    let ids = |answer: &Answer| -> Vec<String> {
        answer
            .json()
            .as_array()
            .expect("list")
            .iter()
            .map(|letter| letter["id"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let first = page("?limit=2").await;
    assert_eq!(ids(&first), ["5-0", "4-0"]);
    let next = first.header("link").expect("a next page").to_string();
    assert_eq!(
        next,
        "</queues/notify/dead?limit=2&before=4-0>; rel=\"next\""
    );
    let second = page("?limit=2&before=4-0").await;
    assert_eq!(ids(&second), ["3-0", "2-0"]);
    let last = page("?limit=2&before=2-0").await;
    assert_eq!(ids(&last), ["1-0"]);
    assert_eq!(
        last.header("link"),
        None,
        "the oldest letter is on this page"
    );
    assert_eq!(ids(&page("").await).len(), 5);
    for bad in ["?limit=0", "?limit=1001", "?before=x", "?page=2"] {
        let answer = page(bad).await;
        assert_eq!(answer.status, 400, "{bad}: {}", answer.text());
    }
}

/// Where tokens are set, dead letters (other clients' queries: reset links, tokens) need one
/// even on a loopback listener, which the PHP app on the same machine reaches too (a page
/// that fetches a URL a visitor names would hand them over). The rest of the reads stay open
/// on loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_need_a_token_wherever_tokens_are_set() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let token = "0123456789abcdef0123";
    let policy = queue_policy(backend.addr, &redis.url(), "").replacen(
        "[admin]\n",
        &format!("[admin]\ntokens = {{ ops = \"{token}\" }}\n"),
        1,
    );
    let levee = Levee::start(&policy).await;
    let dead = levee.admin_url("/queues/notify/dead");
    assert_eq!(get(&dead).await.status, 401);
    // However the path spells it: the handler decodes each segment.
    for spelled in [
        "/queues/notify/%64ead",
        "/queues/notify/dea%64",
        "/queues/%6Eotify/dead",
    ] {
        assert_eq!(
            get(&levee.admin_url(spelled)).await.status,
            401,
            "{spelled}"
        );
    }
    let with_token = Request::get(&dead)
        .header("authorization", format!("Bearer {token}"))
        .body(full(""))
        .expect("request");
    assert_eq!(send(with_token).await.status, 200);
    for open in ["/status", "/metrics", "/queues"] {
        assert_eq!(get(&levee.admin_url(open)).await.status, 200, "{open}");
    }
}

/// A page of dead letters stops after a few MiB of their bodies (1 MiB each by default): a
/// page of a thousand was a gigabyte in one reply, on the connection rate-limit calls share.
/// The rest is on the next page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_dead_letters_stops_after_a_few_mib_of_bodies() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    let dead = "levee:queue:{notify}:dead";
    redis.cli(&[
        "EVAL",
        "for i = 1, 60 do redis.call('XADD', KEYS[1], i .. '-0', 'error', 'x', 'body', string.rep('b', 100000)) end",
        "1",
        dead,
    ]);
    let first = get(&levee.admin_url("/queues/notify/dead?limit=100")).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let listed = first.json().as_array().map_or(0, Vec::len);
    assert!(
        (40..60).contains(&listed),
        "{listed} letters on the first page"
    );
    let next = first.header("link").expect("a next page").to_string();
    let before = next
        .split("before=")
        .nth(1)
        .and_then(|rest| rest.split('>').next())
        .expect("before")
        .to_string();
    let rest =
        get(&levee.admin_url(&format!("/queues/notify/dead?limit=100&before={before}"))).await;
    assert_eq!(rest.json().as_array().map_or(0, Vec::len), 60 - listed);
    assert_eq!(rest.header("link"), None);
}

/// A dead letter keeps its whole body until an operator retries or drops it: a client sending
/// work the app refuses must not fill Redis with them, which would stop every queue, switch
/// and shared limit. The oldest go beyond `max_dead_letters`, counted and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_beyond_max_dead_letters_drop_the_oldest() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording(0, Arc::new(AtomicBool::new(true)), Duration::ZERO).await;
    let policy = queue_policy(
        backend.addr,
        &redis.url(),
        "max_attempts = 1\nmax_dead_letters = 2",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let mut jobs = Vec::new();
    for i in 0..3 {
        let answer = post_as(&levee, &format!("refused={i}"), "192.0.2.9").await;
        jobs.push(answer.header("x-levee-job").expect("job").to_string());
    }
    switch(&levee, "on").await;
    eventually(Duration::from_secs(10), "three refusals", || async {
        seen.lock().expect("lock").len() >= 3
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "the oldest letter dropped",
        || async {
            let metrics = get(&levee.admin_url("/metrics")).await.text();
            metric_value(
                &metrics,
                "levee_queue_dead_letters_dropped_total{route=\"notify\"}",
            ) == 1.0
        },
    )
    .await;
    let dead = get(&levee.admin_url("/queues/notify/dead")).await.json();
    let kept: Vec<&str> = dead
        .as_array()
        .expect("letters")
        .iter()
        .filter_map(|letter| letter["idempotency_key"].as_str())
        .collect();
    // Replayed in order, dead-lettered in order: the newest two are kept, newest first.
    assert_eq!(kept, [jobs[2].as_str(), jobs[1].as_str()], "{dead}");
}

/// A replayed job names its fields as the client spelled them, as the request forwarded
/// straight away does (PHP's `getallheaders()` under Apache's mod_php keys by that spelling).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_job_spells_its_field_names_as_the_client_did() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    // Each request head the app got, as text.
    let heads: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let app = listener.local_addr().expect("addr");
    let record = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let Some(head) = read_request_head(&mut stream).await else {
                    return;
                };
                let text = String::from_utf8_lossy(&head).into_owned();
                // The body too (6 bytes), so the answer is not cut off by a reset.
                let end = text.find("\r\n\r\n").map_or(0, |at| at + 4);
                let mut body = head.len() - end;
                let mut buf = [0u8; 64];
                while body < 6 {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => body += n,
                    }
                }
                record.lock().expect("lock").push(text);
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\napplied",
                    )
                    .await;
            });
        }
    });
    let levee = Levee::start(&queue_policy(app, &redis.url(), "")).await;
    let request = b"POST /notify.php HTTP/1.1\r\nHost: forum.example\r\nX-Requested-With: XMLHttpRequest\r\nX-API-Key: k1\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 6\r\nConnection: close\r\n\r\nlike=1";
    let answer = raw_exchange(levee.public, request, Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    switch(&levee, "off").await;
    let answer = raw_exchange(levee.public, request, Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), Some(202), "{answer}");
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the job to be replayed",
        || async { heads.lock().expect("lock").len() == 2 },
    )
    .await;
    let heads = heads.lock().expect("lock").clone();
    for head in &heads {
        for line in [
            "\r\nHost: forum.example\r\n",
            "\r\nX-Requested-With: XMLHttpRequest\r\n",
            "\r\nX-API-Key: k1\r\n",
            "\r\nContent-Type: application/x-www-form-urlencoded\r\n",
            "\r\nX-Real-IP: 127.0.0.1\r\n",
        ] {
            assert!(head.contains(line), "{line:?} in {head}");
        }
    }
    assert!(heads[1].contains("\r\nIdempotency-Key: "), "{}", heads[1]);
}

/// A master and a replica of it, in sync.
async fn master_and_replica(dir: &std::path::Path) -> (RedisServer, RedisServer) {
    let own_dir = |name: &str| {
        let path = dir.join(name);
        std::fs::create_dir_all(&path).expect("dir");
        path
    };
    let master = RedisServer::start(&own_dir("master")).await;
    let replica = RedisServer::start(&own_dir("replica")).await;
    replica.cli(&["REPLICAOF", "127.0.0.1", &master.port.to_string()]);
    eventually(Duration::from_secs(10), "the replica in sync", || async {
        replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
    })
    .await;
    (master, replica)
}

const STREAM: &str = "levee:queue:{notify}:jobs";

/// Each write leaves a record of what became of it, read only when its answer is lost; the
/// next write removes the records of writes that were answered, so jobs posted one after
/// another leave one record behind, not one each for Redis to expire later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_writes_leave_no_records_behind() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    switch(&levee, "off").await;
    for n in 0..30 {
        let answer = post_as(&levee, &format!("like={n}"), "192.0.2.1").await;
        assert_eq!(answer.status, 202, "{}", answer.text());
    }
    let records = redis.cli(&["--scan", "--pattern", "levee:queue:{notify}:write:*"]);
    assert_eq!(records.lines().count(), 1, "{records}");
    assert_eq!(redis.cli(&["XLEN", STREAM]).trim(), "30");
}

/// A queue write waits for Redis longer than a rate-limit check does: with `[redis] timeout`
/// at 25 ms, a Redis that stalls for 150 ms (an expiry cycle, a slow command) still stores
/// the job, and the client gets 202, not 503. The shared connection's own response timeout
/// used to be `timeout`, which cut the write at 25 ms whatever its own bound said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waits_out_a_redis_stall_longer_than_the_limit_timeout() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let policy = queue_policy(backend.addr, &redis.url(), "")
        .replace("timeout = \"200ms\"", "timeout = \"25ms\"");
    assert!(policy.contains("timeout = \"25ms\""), "{policy}");
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    assert_eq!(post_as(&levee, "like=0", "192.0.2.1").await.status, 202);

    for n in 1..=3 {
        redis.pause(true);
        let post = spawn_post(&levee, format!("like={n}"));
        // The stall: longer than `timeout`, well within the write's 500 ms.
        tokio::time::sleep(Duration::from_millis(150)).await;
        redis.pause(false);
        let answer = post.await.expect("post");
        assert_eq!(answer.status, 202, "stall {n}: {}", answer.text());
    }
    assert_eq!(redis.cli(&["XLEN", STREAM]).trim(), "4");
}

/// With `wait_replicas`, a 202 means the replica holds the job: it is there the moment the
/// client hears. Jobs that come together wait for the replicas together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_answered_202_only_once_a_replica_holds_it() {
    let dir = tempfile::tempdir().expect("dir");
    let (master, replica) = master_and_replica(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let levee = Levee::start(&queue_policy(
        backend.addr,
        &master.url(),
        "wait_replicas = 1\nwait_timeout = \"2s\"",
    ))
    .await;
    switch(&levee, "off").await;

    let answer = post_as(&levee, "like=1", "192.0.2.1").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    assert_eq!(replica.cli(&["XLEN", STREAM]).trim(), "1");

    let posts: Vec<_> = (0..40)
        .map(|n| spawn_post(&levee, format!("like={n}")))
        .collect();
    for post in posts {
        assert_eq!(post.await.expect("post").status, 202);
    }
    assert_eq!(replica.cli(&["XLEN", STREAM]).trim(), "41");
    let waits = master.calls("wait");
    eprintln!("41 jobs, 40 of them at once, confirmed by {waits} WAIT calls");
    assert!((1..=41).contains(&waits), "{waits}");

    let keys = replayed_keys(&levee, &seen, 41).await;
    assert_eq!(keys.len(), 41);
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_queue_unconfirmed_total{route=\"notify\",result=\"withdrawn\"}"
        ),
        0.0
    );
}

/// A replica that does not confirm a job in time (frozen here): by default the job is
/// withdrawn and the client told 503 — nothing stored, never applied; with
/// `when_unconfirmed = "accept"` it is answered 202 all the same, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_no_replica_confirms_is_withdrawn_unless_the_policy_accepts_it() {
    let dir = tempfile::tempdir().expect("dir");
    let (mut master, replica) = master_and_replica(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let refusing = Levee::start(&queue_policy(
        backend.addr,
        &master.url(),
        "wait_replicas = 1\nwait_timeout = \"100ms\"",
    ))
    .await;
    let accepting = Levee::start(&queue_policy(
        backend.addr,
        &master.url(),
        "wait_replicas = 1\nwait_timeout = \"100ms\"\nwhen_unconfirmed = \"accept\"",
    ))
    .await;
    switch(&refusing, "off").await;

    replica.pause(true);
    let refused = post_as(&refusing, "like=1", "192.0.2.1").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.header("retry-after").is_some());
    assert_eq!(master.cli(&["XLEN", STREAM]).trim(), "0", "withdrawn");
    let metrics = get(&refusing.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_queue_unconfirmed_total{route=\"notify\",result=\"withdrawn\"}"
        ),
        1.0
    );

    let accepted = post_as(&accepting, "like=2", "192.0.2.1").await;
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    assert_eq!(master.cli(&["XLEN", STREAM]).trim(), "1");
    let metrics = get(&accepting.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_queue_unconfirmed_total{route=\"notify\",result=\"accepted\"}"
        ),
        1.0
    );

    // Back: jobs are confirmed again, and only those answered 202 are applied.
    replica.pause(false);
    let answer = post_as(&refusing, "like=3", "192.0.2.1").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    replayed_keys(&refusing, &seen, 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let bodies: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(_, body, ..)| body.clone())
        .collect();
    assert_eq!(bodies.len(), 2, "{bodies:?}");
    assert!(!bodies.contains(&"like=1".to_string()), "{bodies:?}");

    // The master gone: nothing can be stored, and the client is told so.
    switch(&refusing, "off").await;
    master.kill();
    let answer = post_as(&refusing, "like=4", "192.0.2.1").await;
    assert_eq!(answer.status, 503, "{}", answer.text());
    assert!(answer.header("retry-after").is_some());
}

/// With Redis Sentinel, the writes that wait for replicas go to the master the sentinel
/// names, over a connection of their own, and follow a failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waits_for_the_replica_of_the_master_redis_sentinel_names() {
    let dir = tempfile::tempdir().expect("dir");
    let group = RedisSentinel::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let policy = queue_policy(backend.addr, "redis://127.0.0.1:9", "wait_replicas = 1").replace(
        "[redis]\nurl = \"redis://127.0.0.1:9\"",
        &format!(
            "[redis.sentinel]\nnodes = [\"{}\"]\nmaster = \"{SENTINEL_MASTER}\"\n[redis]",
            group.sentinel_url()
        ),
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let answer = post_as(&levee, "like=1", "192.0.2.1").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    assert_eq!(group.replica.cli(&["XLEN", STREAM]).trim(), "1");

    group.replica.pause(true);
    let answer = post_as(&levee, "like=2", "192.0.2.1").await;
    assert_eq!(answer.status, 503, "{}", answer.text());
    assert_eq!(group.master.cli(&["XLEN", STREAM]).trim(), "1", "withdrawn");
    group.replica.pause(false);

    // A failover: the writes go to the promoted replica. (The old master, its replica now,
    // takes a full copy first, which takes seconds: meanwhile jobs are accepted unconfirmed.)
    let generation = levee.generation();
    std::fs::write(
        levee.policy_file(),
        policy.replace(
            "wait_replicas = 1",
            "wait_replicas = 1\nwhen_unconfirmed = \"accept\"",
        ),
    )
    .expect("policy");
    eventually(Duration::from_secs(10), "the policy reloaded", || async {
        levee.generation() > generation
    })
    .await;
    group.fail_over().await;
    eventually(
        Duration::from_secs(15),
        "a job stored on the new master",
        || async {
            post_as(&levee, "like=3", "192.0.2.1").await.status == 202
                && group.replica.cli(&["XLEN", STREAM]).trim() == "2"
        },
    )
    .await;
    assert!(group.replica.cli(&["ROLE"]).starts_with("master"));
}

#[test]
fn check_refuses_wait_settings_it_cannot_keep() {
    let policy = |queue: &str| {
        format!(
            "[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[redis]\nurl = \"redis://127.0.0.1:6390\"\n[queue]\n{queue}\n"
        )
    };
    let stderr = check_fails(&policy("wait_replicas = 1\nwhen_unconfirmed = \"maybe\""));
    assert!(
        stderr.contains("levee.toml:7:20: error: when_unconfirmed = `maybe` is not known"),
        "{stderr}"
    );
    let stderr = check_fails(&policy("wait_timeout = \"0s\""));
    assert!(
        stderr.contains("levee.toml:6:16: error: `wait_timeout` must be more than 0"),
        "{stderr}"
    );
    let stderr = check_fails(&policy("wait_timeout = \"30s\""));
    assert!(
        stderr.contains("levee.toml:6:16: error: wait_timeout must be at most 10s"),
        "{stderr}"
    );
}

/// In a Redis Cluster, a job waits for the replica of the master node holding its route's
/// stream, and for no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_a_job_waits_for_the_replica_of_the_node_holding_its_stream() {
    let dir = tempfile::tempdir().expect("dir");
    let cluster = RedisCluster::start_with_replicas(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let owner = cluster.owner(STREAM);
    let replica = cluster.replica_of(owner).expect("the owner's replica");
    let other_replica = (0..cluster.ports.len())
        .filter(|&node| node != owner && node != replica)
        .find_map(|node| cluster.replica_of(node))
        .expect("another master's replica");
    for node in [replica, other_replica] {
        cluster.replica_in_sync(node).await;
    }
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            // A replica's acknowledgement is given a second: the default 100 ms was seen
            // running out under the whole test suite's load on 2 cores (a 503 for a job the
            // replica was about to hold).
            "[redis]\ncluster = [{}]\ntimeout = \"200ms\"\n[queue]\npoll_interval = \"50ms\"\nwait_replicas = 1\nwait_timeout = \"1s\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\nalways_queue = true\n",
            cluster.toml_list()
        ),
    ))
    .await;
    let post_body = |body: &'static str| {
        let request = Request::post(levee.url("/notify.php"))
            .body(full(body))
            .expect("request");
        send(request)
    };
    let first = post_body("first=1").await;
    assert_eq!(first.status, 202, "{}", first.text());
    cluster.pause(other_replica, true);
    assert_eq!(post_body("second=1").await.status, 202);
    cluster.pause(other_replica, false);
    cluster.pause(replica, true);
    let refused = post_body("refused=1").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    cluster.pause(replica, false);
    assert_eq!(post_body("third=1").await.status, 202);
    eventually(
        Duration::from_secs(10),
        "the jobs answered 202 applied",
        || async { seen.lock().expect("lock").len() >= 3 },
    )
    .await;
    // Jobs are replayed in order: the withdrawn one, stored before the third, would be in.
    let bodies: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(_, body, ..)| body.clone())
        .collect();
    assert_eq!(bodies, ["first=1", "second=1", "third=1"]);
}

/// The enqueue script run twice for one write (a client library that sends it again after a
/// dropped connection) stores the job once and answers the same id both times, even past the
/// write's deadline; a write settled away (its record a tombstone) stays barred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_sent_twice_stores_its_job_once() {
    use levee::queue::ENQUEUE_BEFORE;
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let stream = "t:queue:{r}:jobs";
    let enqueue = |record: &str, deadline: &str| {
        redis
            .cli(&[
                "EVAL",
                ENQUEUE_BEFORE,
                "2",
                stream,
                record,
                deadline,
                "60000",
                "",
                "body",
                "x",
            ])
            .trim()
            .to_string()
    };
    let (ahead, past) = ("9000000000000000", "0");
    let first = enqueue("t:queue:{r}:write:a", ahead);
    assert!(first.contains('-'), "a stream id: {first}");
    assert_eq!(enqueue("t:queue:{r}:write:a", ahead), first);
    assert_eq!(
        enqueue("t:queue:{r}:write:a", past),
        first,
        "past its deadline too"
    );
    assert_eq!(redis.cli(&["XLEN", stream]).trim(), "1");
    // A worker marked it decided: still the same id.
    redis.cli(&[
        "SET",
        "t:queue:{r}:write:a",
        &format!("decided:{first}"),
        "XX",
        "KEEPTTL",
    ]);
    assert_eq!(enqueue("t:queue:{r}:write:a", ahead), first);
    // A tombstone bars the write; a late one is refused by the clock.
    redis.cli(&["SET", "t:queue:{r}:write:b", "", "PX", "60000"]);
    assert_eq!(enqueue("t:queue:{r}:write:b", ahead), "");
    assert_eq!(enqueue("t:queue:{r}:write:c", past), "");
    assert_eq!(redis.cli(&["XLEN", stream]).trim(), "1");
}

/// Outside a cluster the enqueue script lists the route in the registry in the step that
/// stores its job, and only then: a write refused by the clock lists nothing, and the records
/// of answered writes still follow the registry's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_write_that_stores_a_job_lists_its_route() {
    use levee::queue::ENQUEUE_BEFORE;
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (stream, registry) = ("t:queue:{r}:jobs", "t:queue:routes");
    let enqueue = |record: &str, deadline: &str, answered: &[&str]| {
        let keys = (3 + answered.len()).to_string();
        let mut args = vec![
            "EVAL",
            ENQUEUE_BEFORE,
            keys.as_str(),
            stream,
            record,
            registry,
        ];
        args.extend_from_slice(answered);
        args.extend_from_slice(&[deadline, "60000", "r", "body", "x"]);
        redis.cli(&args).trim().to_string()
    };
    let (ahead, past) = ("9000000000000000", "0");
    assert_eq!(enqueue("t:queue:{r}:write:a", past, &[]), "");
    assert_eq!(redis.cli(&["SMEMBERS", registry]).trim(), "");
    let stored = enqueue("t:queue:{r}:write:b", ahead, &[]);
    assert!(stored.contains('-'), "a stream id: {stored}");
    assert_eq!(redis.cli(&["SMEMBERS", registry]).trim(), "r");
    // The next write removes the answered record it is given, not the registry.
    let next = enqueue("t:queue:{r}:write:c", ahead, &["t:queue:{r}:write:b"]);
    assert!(next.contains('-'), "a stream id: {next}");
    assert_eq!(redis.cli(&["EXISTS", "t:queue:{r}:write:b"]).trim(), "0");
    assert_eq!(redis.cli(&["SMEMBERS", registry]).trim(), "r");
    let fields = redis.cli(&["XRANGE", stream, &next, &next]);
    assert!(
        fields.contains("body") && !fields.contains("60000"),
        "the job's own fields only: {fields}"
    );
}

/// Withdrawing a job that waits for replicas (its writer's `SETTLE_WRITE`) and a worker's
/// go-ahead to replay it (`HOLD_WHEN_DECIDED`) exclude each other, whichever comes first —
/// also when Redis's clock says the job is still undecided (a clock stepped back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawal_and_a_replay_of_one_job_exclude_each_other() {
    use levee::queue::worker::HOLD_WHEN_DECIDED;
    use levee::queue::SETTLE_WRITE;
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (stream, group) = ("t:queue:{r}:jobs", "g");
    redis.cli(&["XGROUP", "CREATE", stream, group, "$", "MKSTREAM"]);
    // A `confirm_by` far ahead of Redis's clock, and one long past.
    let (ahead, past) = ("9000000000000000", "0");
    let stored = |record: &str| {
        let id = redis
            .cli(&["XADD", stream, "*", "body", "x"])
            .trim()
            .to_string();
        redis.cli(&["SET", record, &id, "PX", "60000"]);
        redis.cli(&[
            "XREADGROUP",
            "GROUP",
            group,
            "c",
            "COUNT",
            "1",
            "STREAMS",
            stream,
            ">",
        ]);
        id
    };
    let hold = |record: &str, id: &str, confirm_by: &str| {
        let args = [
            "EVAL",
            HOLD_WHEN_DECIDED,
            "2",
            stream,
            record,
            group,
            "c",
            id,
            confirm_by,
        ];
        redis.cli(&args).trim().to_string()
    };
    let settle = |record: &str| {
        redis.cli(&[
            "EVAL",
            SETTLE_WRITE,
            "2",
            stream,
            record,
            group,
            "60000",
            ahead,
        ])
    };

    // Replayed first: the withdrawal that follows finds it decided, and it stands.
    let replayed = stored("t:queue:{r}:write:1");
    let left: i64 = hold("t:queue:{r}:write:1", &replayed, ahead)
        .parse()
        .expect("µs left");
    assert!(left > 0, "{left}");
    assert_eq!(hold("t:queue:{r}:write:1", &replayed, past), "0");
    let settled = settle("t:queue:{r}:write:1");
    assert_eq!(
        settled.split_whitespace().collect::<Vec<_>>(),
        ["stands", &replayed]
    );
    assert_eq!(redis.cli(&["XLEN", stream]).trim(), "1");

    // Withdrawn first: gone from the stream and from the worker's pending jobs; the worker
    // then finds nothing to replay.
    let withdrawn = stored("t:queue:{r}:write:2");
    assert_eq!(settle("t:queue:{r}:write:2").trim(), "absent");
    assert_eq!(redis.cli(&["XLEN", stream]).trim(), "1");
    assert_eq!(hold("t:queue:{r}:write:2", &withdrawn, past), "-2");
}

/// A replay the breaker holds back (its one half-open probe is out) hands its batch back:
/// the jobs are replayed as soon as the probe has closed the breaker, not after
/// `claim_after` (30 s here), which they would otherwise wait out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_held_back_by_the_breaker_are_replayed_once_it_closes_not_after_claim_after() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let applied: Arc<Mutex<Vec<Instant>>> = Arc::new(Mutex::new(Vec::new()));
    let record = applied.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let record = record.clone();
        async move {
            match request.uri().path() {
                "/fail" => Response::builder()
                    .status(502)
                    .body(full("down"))
                    .expect("response"),
                "/slow" => {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    Response::new(full("slow but fine"))
                }
                _ => {
                    record.lock().expect("lock").push(Instant::now());
                    Response::new(full("applied"))
                }
            }
        }
    })
    .await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "breaker = {{ consecutive_failures = 1, open_for = \"1s\", half_open_probes = 1 }}\n[redis]\nurl = \"{redis}\"\ntimeout = \"200ms\"\n[degrade]\nsync_interval = \"100ms\"\n[queue]\npoll_interval = \"50ms\"\nclaim_after = \"30s\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\ntier = 2\nmodule = \"notifications\"\ndegrade = {{ action = \"queue\" }}\n",
            redis = redis.url()
        ),
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    for i in 0..3 {
        assert_eq!(
            post_as(&levee, &format!("n={i}"), "192.0.2.9").await.status,
            202
        );
    }

    // The breaker opens, then lets one probe through, which takes two seconds.
    assert_eq!(get(&levee.url("/fail")).await.status, 502);
    let state = |levee: &Levee| {
        let url = levee.admin_url("/status");
        async move { get(&url).await.json()["upstreams"][0]["breaker"]["state"].clone() }
    };
    // Refused (503 at once) until `open_for` has passed; then one is let through as the
    // probe, and keeps the backend busy for two seconds.
    let give_up = Instant::now() + Duration::from_secs(5);
    let probe = loop {
        assert!(Instant::now() < give_up, "no probe let through");
        let url = levee.url("/slow");
        let mut attempt = tokio::spawn(async move { get(&url).await.status });
        match tokio::time::timeout(Duration::from_millis(300), &mut attempt).await {
            Ok(answered) => assert_eq!(answered.expect("request"), 503),
            Err(_still_out) => break attempt,
        }
    };

    // The queue is switched on while the probe is out: its replays are held back.
    switch(&levee, "on").await;
    assert_eq!(probe.await.expect("probe"), 200);
    eventually(
        Duration::from_secs(5),
        "the probe to close the breaker",
        || async { state(&levee).await == "closed" },
    )
    .await;
    let closed_at = Instant::now();
    eventually(
        Duration::from_secs(10),
        "the jobs to be replayed after the probe",
        || async { applied.lock().expect("lock").len() >= 3 },
    )
    .await;
    let last = *applied.lock().expect("lock").iter().max().expect("applied");
    assert!(
        last.saturating_duration_since(closed_at) < Duration::from_secs(5),
        "replayed {:?} after the breaker closed",
        last.saturating_duration_since(closed_at)
    );
    assert_eq!(
        applied.lock().expect("lock").len(),
        3,
        "each job applied once"
    );
    // While the probe was out the route's replays paused: no batch was read only to be
    // refused by the breaker, pass after pass.
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_queue_replayed_total{route=\"notify\",result=\"held\"}"
        ),
        0.0,
        "{metrics}"
    );
}

/// A job whose app cannot be reached (php-fpm down, connections refused) spends no attempt
/// however long that lasts: with `max_attempts = 2` it was dead-lettered within a second. Once
/// the app answers, a 503 asking for two seconds (a maintenance mode) is waited out, not
/// retried after the 100 ms back-off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_wait_out_an_app_that_cannot_be_reached_and_heed_its_retry_after() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    // Nothing listens there yet.
    let app = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let policy = queue_policy(
        app,
        &redis.url(),
        "max_attempts = 2\nbackoff_base = \"100ms\"",
    )
    .replace(
        "[redis]",
        "breaker = { consecutive_failures = 3, open_for = \"200ms\", max_open_for = \"200ms\" }\n[redis]",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    let job = post_as(&levee, "kept", "192.0.2.9")
        .await
        .header("x-levee-job")
        .expect("job")
        .to_string();
    switch(&levee, "on").await;
    // Refused pass after pass, and through breaker probes (each waiting its back-off): the
    // job stays, with no attempt.
    eventually(Duration::from_secs(10), "refused replays", || async {
        let metrics = get(&levee.admin_url("/metrics")).await.text();
        let counted = |result: &str| {
            metric_value(
                &metrics,
                &format!("levee_queue_replayed_total{{route=\"notify\",result=\"{result}\"}}"),
            )
        };
        counted("held") + counted("probe_failed") >= 4.0 && counted("probe_failed") >= 1.0
    })
    .await;
    let queues = get(&levee.admin_url("/queues")).await.json();
    assert_eq!(
        (
            &queues["notify"]["dead_letters"],
            &queues["notify"]["backlog"]
        ),
        (&serde_json::json!(0), &serde_json::json!(1)),
        "{queues}"
    );

    // The app comes up in maintenance: one 503 with `Retry-After: 2`, then it applies the job.
    let answers: Arc<Mutex<Vec<Instant>>> = Arc::new(Mutex::new(Vec::new()));
    let record = answers.clone();
    let _backend = Backend::start_on(app, move |_request: Request<Incoming>| {
        let record = record.clone();
        async move {
            let mut seen = record.lock().expect("lock");
            seen.push(Instant::now());
            let status = if seen.len() == 1 { 503 } else { 200 };
            Response::builder()
                .status(status)
                .header("retry-after", "2")
                .body(full("maintenance"))
                .expect("response")
        }
    })
    .await;
    eventually(Duration::from_secs(15), "the job applied", || async {
        answers.lock().expect("lock").len() >= 2
    })
    .await;
    let times = answers.lock().expect("lock").clone();
    assert!(
        times[1] - times[0] >= Duration::from_millis(1900),
        "retried {:?} after the 503 asking for 2 s",
        times[1] - times[0]
    );
    eventually(Duration::from_secs(5), "the job finished", || async {
        let queues = get(&levee.admin_url("/queues")).await.json();
        queues["notify"]["backlog"] == 0 && queues["notify"]["dead_letters"] == 0
    })
    .await;
    assert_eq!(answers.lock().expect("lock").len(), 2, "{job} applied once");
}

/// Each queue is replayed on its own: one whose upstream takes the request and never
/// answers (every job waiting out `response_timeout`, 30 s here) does not hold another
/// route's jobs behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_whose_upstream_hangs_does_not_hold_the_others() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let hanging = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let hanging_addr = hanging.local_addr().expect("addr");
    let (taken_tx, mut taken) = tokio::sync::mpsc::unbounded_channel();
    let _hanging = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = hanging.accept().await {
            held.push(stream);
            let _ = taken_tx.send(());
        }
    });
    let route = |name: &str, upstream: &str| {
        format!("[[route]]\nname = \"{name}\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/{name}\" }}\nupstream = \"{upstream}\"\nalways_queue = true\n")
    };
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false\ndefault_upstream = \"app\"",
        &format!(
            "[upstream.mailer]\nurl = \"http://{hanging_addr}\"\n[redis]\nurl = \"{}\"\n[queue]\npoll_interval = \"50ms\"\n{}{}",
            redis.url(),
            route("mail", "mailer"),
            route("notify", "app"),
        ),
    ))
    .await;
    let post_to = |route: &str, body: &str| {
        let request = Request::post(levee.url(&format!("/{route}.php")))
            .body(full(body.to_string()))
            .expect("request");
        send(request)
    };
    assert_eq!(post_to("mail", "to=a").await.status, 202);
    tokio::time::timeout(Duration::from_secs(10), taken.recv())
        .await
        .expect("the mail job sent to its upstream");
    assert_eq!(post_to("notify", "like=1").await.status, 202);
    eventually(
        Duration::from_secs(5),
        "the notify job applied while the mail job waits",
        || async {
            seen.lock()
                .expect("lock")
                .iter()
                .any(|job| job.1 == "like=1")
        },
    )
    .await;
}

/// An instance stopped in the middle of a batch hands the jobs it has not begun back: another
/// instance takes them up at once, not after `claim_after` (30 s here), and each job is
/// applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_instance_hands_back_the_jobs_it_had_not_begun() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let policy = |rate: &str| {
        queue_policy(backend.addr, &redis.url(), "claim_after = \"30s\"")
            .replace("replay_rate = 2000", rate)
            .replace("access_log = false", "access_log = false\ndrain = \"0s\"")
    };
    // One job a second: the first instance reads all five, and is stopped after the first.
    let slow = Levee::start(&policy("replay_rate = 1")).await;
    switch(&slow, "off").await;
    for i in 0..5 {
        assert_eq!(
            post_as(&slow, &format!("n={i}"), "192.0.2.5").await.status,
            202
        );
    }
    switch(&slow, "on").await;
    eventually(Duration::from_secs(5), "the first replay", || async {
        !seen.lock().expect("lock").is_empty()
    })
    .await;
    stop(slow).await;
    let after_stop = seen.lock().expect("lock").len();
    assert!(
        after_stop < 5,
        "the stop came too late to leave jobs: {after_stop}"
    );

    let other = Levee::start(&policy("replay_rate = 1000")).await;
    eventually(
        Duration::from_secs(10),
        "the jobs handed back to be applied by the other instance",
        || async { seen.lock().expect("lock").len() >= 5 },
    )
    .await;
    let mut keys: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(key, ..)| key.clone())
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 5, "each job once: {keys:?}");
    // Handed back unsent: taken up, but not counted as taken over from a silent worker.
    let metrics = get(&other.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_queue_taken_over_total{route=\"notify\"}"),
        0.0,
        "{metrics}"
    );
    drop(other);
}

/// A route that always queues takes its 202 bodies from `degrade` without `action = "queue"`
/// (it was read as `reject`, and refused on a tier-1 route).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_always_queue_route_takes_its_202_bodies_without_naming_the_action() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\n[queue]\npoll_interval = \"1h\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\nalways_queue = true\ndegrade = {{ body_json = '{{\"queued\":\"{{job}}\"}}' }}\n",
            redis.url()
        ),
    ))
    .await;
    let request = Request::post(levee.url("/notify.php"))
        .header("accept", "application/json")
        .body(full("like=1"))
        .expect("request");
    let answer = send(request).await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    let body = answer.json();
    let job = body["queued"].as_str().unwrap_or_default();
    assert!(!job.is_empty() && job != "{job}", "{body}");
}

/// The 202 of a queued write is in the route's `answer_format`: JSON for an app's client that
/// sends no `Accept`, a page on a route of forms even to a client that asks for JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_writes_202_follows_the_routes_answer_format() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\n[queue]\npoll_interval = \"1h\"\n[[route]]\nname = \"api\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/api\" }}\nalways_queue = true\nanswer_format = \"json\"\n[[route]]\nname = \"forms\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/forms\" }}\nalways_queue = true\nanswer_format = \"html\"\n",
            redis.url()
        ),
    ))
    .await;
    let api = post(&levee.url("/api/likes"), "like=1").await;
    assert_eq!(api.status, 202, "{}", api.text());
    let content_type = api.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("application/json"),
        "{content_type}"
    );
    let body = api.json();
    assert_eq!(body["status"], "accepted", "{body}");
    assert_eq!(
        body["job"].as_str(),
        api.header("x-levee-job"),
        "the job the header names"
    );

    let request = Request::post(levee.url("/forms/comment.php"))
        .header("accept", "application/json")
        .body(full("text=hi"))
        .expect("request");
    let form = send(request).await;
    assert_eq!(form.status, 202, "{}", form.text());
    let content_type = form.header("content-type").unwrap_or_default();
    assert!(content_type.starts_with("text/html"), "{content_type}");
    // The page leads back to the one the form was on (a commenter's post).
    assert!(form.text().contains("history.back()"), "{}", form.text());
}

/// A cluster master dies and its replica takes its slots over while nothing asks for them:
/// levee reads the slot map again on its own (it did only on calls to those slots), so
/// `/status` stops naming the dead node down, and the node's outage never silenced this
/// instance's fleet line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_is_followed_without_traffic_on_the_slots_moved() {
    let dir = tempfile::tempdir().expect("dir");
    let mut cluster = RedisCluster::start_with_replicas(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let owner = cluster.owner(STREAM);
    let replica = cluster.replica_of(owner).expect("the owner's replica");
    cluster.replica_in_sync(replica).await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\ncluster = [{}]\ntimeout = \"200ms\"\nfailures_to_open = 1\ncooldown = \"1h\"\n[degrade]\nsync_interval = \"100ms\"\n[queue]\npoll_interval = \"50ms\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\nalways_queue = true\n",
            cluster.toml_list()
        ),
    ))
    .await;
    let post = || {
        let request = Request::post(levee.url("/notify.php"))
            .body(full("n=1"))
            .expect("request");
        send(request)
    };
    assert_eq!(post().await.status, 202);
    let dead = format!("127.0.0.1:{}", cluster.ports[owner]);
    cluster.kill(owner);
    assert_eq!(post().await.status, 503);
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["redis"]["up"], false, "{status}");
    cluster.cli(replica, &["CLUSTER", "FAILOVER", "TAKEOVER"]);
    // No more requests: only levee's own background work may find the new master.
    eventually(
        Duration::from_secs(10),
        "the dead node gone from the slot map levee follows",
        || async {
            let status = get(&levee.admin_url("/status")).await.json();
            let nodes = status["redis"]["nodes"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            status["redis"]["up"] == true && !nodes.iter().any(|node| node["node"] == dead.as_str())
        },
    )
    .await;
    eventually(Duration::from_secs(5), "the fleet read again", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["fleet"]["instances"]
            .as_array()
            .is_some_and(|instances| !instances.is_empty())
    })
    .await;
    assert_eq!(post().await.status, 202);
}

/// A wrong password: every call is refused, and `/status` says why. The connection retries its
/// login until the call's time is out, and the timeout had replaced the refusal there ("did
/// not answer within 500ms" for WRONGPASS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_redis_password_is_what_status_says() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start_with_password(dir.path(), "right").await;
    let (backend, _seen) = recording_always_ok().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"redis://:wrong@127.0.0.1:{}/0\"\n[queue]\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\nalways_queue = true\n",
            redis.port
        ),
    ))
    .await;
    for _ in 0..3 {
        let refused = post_as(&levee, "n=1", "198.51.100.7").await;
        assert_eq!(refused.status, 503, "{}", refused.text());
    }
    eventually(Duration::from_secs(5), "the refusal in /status", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["redis"]["last_error"].as_str().is_some_and(|error| {
            error
                .to_lowercase()
                .contains("password authentication failed")
        })
    })
    .await;
    // Writes that run out of time on the retried login do not hide the refusal again.
    for _ in 0..3 {
        assert_eq!(post_as(&levee, "n=2", "198.51.100.7").await.status, 503);
        let status = get(&levee.admin_url("/status")).await.json();
        assert!(
            status["redis"]["last_error"]
                .as_str()
                .is_some_and(|error| error
                    .to_lowercase()
                    .contains("password authentication failed")),
            "{status}"
        );
        assert!(
            !status.to_string().contains("wrong@"),
            "the password is never shown: {status}"
        );
    }
}

/// levee's own binary, its log (the default filter) in a file: for what only the log says.
struct LoggedLevee {
    _guard: ChildGuard,
    log: std::path::PathBuf,
    public: std::net::SocketAddr,
    admin: std::net::SocketAddr,
}

impl LoggedLevee {
    /// Runs `policy`, whose two `listen = "127.0.0.1:0"` (public, then admin) are given free
    /// ports, from `dir`, and waits until both listen.
    async fn start(dir: &std::path::Path, policy: &str) -> LoggedLevee {
        let (public, admin) = (free_port(), free_port());
        let policy = policy
            .replacen(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"127.0.0.1:{public}\""),
                1,
            )
            .replacen(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"127.0.0.1:{admin}\""),
                1,
            );
        std::fs::write(dir.join("levee.toml"), policy).expect("write policy");
        let log = dir.join("levee.log");
        let guard = ChildGuard::spawn(
            "levee",
            Command::new(env!("CARGO_BIN_EXE_levee"))
                .args(["run", "--no-watch", "--policies"])
                .arg(dir)
                .env_remove("LEVEE_LOG")
                .stderr(std::fs::File::create(&log).expect("log")),
        );
        let (public, admin) = (
            std::net::SocketAddr::from(([127, 0, 0, 1], public)),
            std::net::SocketAddr::from(([127, 0, 0, 1], admin)),
        );
        wait_for_port(public, "levee to listen").await;
        wait_for_port(admin, "levee's admin listener").await;
        LoggedLevee {
            _guard: guard,
            log,
            public,
            admin,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    async fn switch(&self, state: &str) {
        let answer = post(&self.admin_url("/modules/notifications"), state).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
    }

    /// A job posted to the queue route; its key (`X-Levee-Job`).
    async fn queue(&self, body: &str) -> String {
        let request = Request::post(format!("http://{}/notify.php", self.public))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(full(body.to_string()))
            .expect("request");
        let answer = send(request).await;
        assert_eq!(answer.status, 202, "{}", answer.text());
        answer.header("x-levee-job").expect("job").to_string()
    }
}

/// Jobs a worker read and then held without renewing its hold (its instance died in the
/// middle of a batch) are taken over after `claim_after`; the instance that takes them says
/// so once for the batch, with how many and from whom, and that the app may see one twice,
/// and counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_taken_over_from_a_silent_worker_are_logged_once_and_counted() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let stream = "levee:queue:{notify}:jobs";
    // Made beforehand, for the test's own consumer to read from.
    redis.cli(&["XGROUP", "CREATE", stream, "levee", "0", "MKSTREAM"]);
    let levee_dir = tempfile::tempdir().expect("dir");
    let levee = LoggedLevee::start(
        levee_dir.path(),
        &queue_policy(backend.addr, &redis.url(), "claim_after = \"1s\""),
    )
    .await;
    levee.switch("off").await;
    let mut jobs = Vec::new();
    for i in 0..3 {
        jobs.push(levee.queue(&format!("n={i}")).await);
    }
    // The worker of an instance that then died reads them, and sends none.
    let read = redis.cli(&[
        "XREADGROUP",
        "GROUP",
        "levee",
        "gone-instance",
        "COUNT",
        "10",
        "STREAMS",
        stream,
        ">",
    ]);
    assert_eq!(
        redis.cli(&["XPENDING", stream, "levee"]).lines().next(),
        Some("3"),
        "{read}"
    );
    levee.switch("on").await;
    eventually(
        Duration::from_secs(10),
        "the jobs to be taken over and applied",
        || async { seen.lock().expect("lock").len() >= 3 },
    )
    .await;
    let mut applied: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(key, ..)| key.clone())
        .collect();
    applied.sort();
    jobs.sort();
    assert_eq!(applied, jobs, "each job once");

    let told = "took over 3 queued jobs from gone-instance (3 jobs)";
    eventually(
        Duration::from_secs(5),
        "the takeover in the log",
        || async { levee.log().contains(told) },
    )
    .await;
    let log = levee.log();
    assert_eq!(log.matches("took over").count(), 1, "once: {log}");
    assert!(
        log.contains("a second time, with the same Idempotency-Key"),
        "{log}"
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_queue_taken_over_total{route=\"notify\"}"),
        3.0,
        "{metrics}"
    );
}

/// A Redis that restarts without its data takes the queue's jobs with it: levee says how many
/// it had counted there, not only that jobs were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_lost_with_redis_is_logged_with_how_many_jobs_went() {
    let dir = tempfile::tempdir().expect("dir");
    let port = free_port();
    let mut redis = RedisServer::start_on(dir.path(), port).await;
    let (backend, _) = recording_always_ok().await;
    let levee_dir = tempfile::tempdir().expect("dir");
    let levee = LoggedLevee::start(
        levee_dir.path(),
        &queue_policy(backend.addr, &redis.url(), ""),
    )
    .await;
    levee.switch("off").await;
    for i in 0..3 {
        levee.queue(&format!("n={i}")).await;
    }
    eventually(
        Duration::from_secs(10),
        "a worker to count the jobs",
        || async {
            let metrics = get(&levee.admin_url("/metrics")).await.text();
            metric_value(&metrics, "levee_queue_backlog{route=\"notify\"}") == 3.0
        },
    )
    .await;

    redis.kill();
    let _empty = RedisServer::start_on(dir.path(), port).await;
    let told = "about 3 jobs lost with it: its stream held 3 (0 of them read by a worker)";
    eventually(
        Duration::from_secs(20),
        "the loss in the log, with its count",
        || async { levee.log().contains(told) },
    )
    .await;
    let log = levee.log();
    assert_eq!(
        log.matches("consumer group is gone from redis").count(),
        1,
        "once: {log}"
    );
}

/// PHP's `SERVER_PROTOCOL` and the body of each request, a line each, in `protocols.log`.
const PROTOCOL_PHP: &str = r#"<?php
$line = $_SERVER['SERVER_PROTOCOL'] . ' ' . file_get_contents('php://input') . "\n";
file_put_contents(__DIR__ . '/../protocols.log', $line, FILE_APPEND | LOCK_EX);
echo "ok";
"#;

/// A POST to the queue route as raw bytes in HTTP `version`, on a connection of its own; the
/// answer's status.
async fn post_raw(levee: &Levee, version: &str, body: &str) -> Option<u16> {
    let request = format!(
        "POST /notify.php {version}\r\nHost: levee.test\r\nConnection: close\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    status_of(&raw_exchange(levee.public, request.as_bytes(), Duration::from_secs(5)).await)
}

/// PHP behind a `fastcgi://` upstream sees a queued request in the HTTP version its client
/// spoke, as it sees a request forwarded at once: `SERVER_PROTOCOL` is `HTTP/1.0` for an
/// HTTP/1.0 client (a replay said `HTTP/1.1`). A job stored before the version was kept
/// (without the field) is replayed as HTTP/1.1, as it was before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_http_1_0_request_reaches_php_as_http_1_0() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let site = tempfile::tempdir().expect("site");
    let www = site.path().join("www");
    std::fs::create_dir_all(&www).expect("docroot");
    std::fs::write(www.join("notify.php"), PROTOCOL_PHP).expect("script");
    let log = site.path().join("protocols.log");
    std::fs::write(&log, "").expect("log");
    // php-fpm's www-data workers (when the tests run as root) read the script, write the log.
    open_up(&www);
    let _ = Command::new("chmod")
        .arg("a+r")
        .arg(www.join("notify.php"))
        .status();
    let _ = Command::new("chmod").arg("a+rw").arg(&log).status();
    let php = PhpFpm::start(site.path()).await;
    let docroot = std::fs::canonicalize(&www).expect("docroot");
    let http_url = format!("url = \"http://127.0.0.1:{}\"", php.port);
    let policy = queue_policy(
        std::net::SocketAddr::from(([127, 0, 0, 1], php.port)),
        &redis.url(),
        "",
    )
    .replace(
        &http_url,
        &format!(
            "url = \"fastcgi://127.0.0.1:{}\"\nfastcgi = {{ root = \"{}\" }}",
            php.port,
            docroot.display()
        ),
    );
    assert!(policy.contains("fastcgi://"), "{policy}");
    let levee = Levee::start(&policy).await;

    assert_eq!(post_raw(&levee, "HTTP/1.0", "v=forwarded").await, Some(200));
    switch(&levee, "off").await;
    assert_eq!(
        post_raw(&levee, "HTTP/1.0", "v=queued-1.0").await,
        Some(202)
    );
    assert_eq!(
        post_raw(&levee, "HTTP/1.1", "v=queued-1.1").await,
        Some(202)
    );
    // As an earlier levee stored a job: no `version` field.
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        .to_string();
    redis.cli(&[
        "XADD",
        "levee:queue:{notify}:jobs",
        "*",
        "route",
        "notify",
        "method",
        "POST",
        "target",
        "/notify.php",
        "header_lines",
        "content-type: application/x-www-form-urlencoded\r\ncontent-length: 11\r\n",
        "body",
        "v=older-job",
        "client",
        "192.0.2.9",
        "at",
        &at,
        "attempts",
        "0",
        "key",
        "older-job",
    ]);
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "every request in PHP's log",
        || async { std::fs::read_to_string(&log).is_ok_and(|text| text.lines().count() >= 4) },
    )
    .await;
    let text = std::fs::read_to_string(&log).expect("log");
    let mut seen: Vec<&str> = text.lines().collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            "HTTP/1.0 v=forwarded",
            "HTTP/1.0 v=queued-1.0",
            "HTTP/1.1 v=older-job",
            "HTTP/1.1 v=queued-1.1",
        ]
    );
}

/// An `http://` upstream is sent HTTP/1.1 for a request forwarded at once, whatever its client
/// spoke (see `client::encode_request_head`), and so for its replay too: the app sees a
/// queued HTTP/1.0 request as it sees a forwarded one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_http_1_0_request_reaches_an_http_upstream_as_a_forwarded_one_does() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let versions: Arc<Mutex<Vec<http::Version>>> = Arc::new(Mutex::new(Vec::new()));
    let record = versions.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        record.lock().expect("lock").push(request.version());
        async move { Response::new(full("ok")) }
    })
    .await;
    let levee = Levee::start(&queue_policy(backend.addr, &redis.url(), "")).await;
    assert_eq!(post_raw(&levee, "HTTP/1.0", "v=forwarded").await, Some(200));
    switch(&levee, "off").await;
    assert_eq!(post_raw(&levee, "HTTP/1.0", "v=queued").await, Some(202));
    switch(&levee, "on").await;
    eventually(Duration::from_secs(10), "the replay", || async {
        versions.lock().expect("lock").len() >= 2
    })
    .await;
    let versions = versions.lock().expect("lock").clone();
    assert_eq!(versions, [http::Version::HTTP_11, http::Version::HTTP_11]);
}

/// Where [`reply_cutter`] cuts the connection to Redis.
#[derive(Clone, Copy)]
enum Cut {
    /// In place of relaying a reply that holds this to a read of the queue (`XREADGROUP`):
    /// Redis has given the job to levee's worker, which never hears of it, as when the answer
    /// is lost in a stall.
    ReadAnswerWith(&'static [u8]),
    /// In place of relaying a command that holds this: Redis never runs it.
    CommandWith(&'static [u8]),
}

/// A relay to Redis that, once `armed`, cuts the connection once, as `cut` says.
async fn reply_cutter(redis_port: u16, cut_at: Cut, armed: Arc<AtomicBool>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", redis_port)).await else {
                continue;
            };
            let armed = armed.clone();
            let (mut from_client, mut to_client) = client.into_split();
            let (mut from_server, mut to_server) = server.into_split();
            let reading = Arc::new(AtomicBool::new(false));
            let cut = Arc::new(AtomicBool::new(false));
            let (reading_up, cut_up, armed_up) = (reading.clone(), cut.clone(), armed.clone());
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 64 * 1024];
                while let Ok(read) = from_client.read(&mut buffer).await {
                    if read == 0 || cut_up.load(Ordering::SeqCst) {
                        return;
                    }
                    let chunk = &buffer[..read];
                    if let Cut::CommandWith(marker) = cut_at {
                        if armed_up.load(Ordering::SeqCst)
                            && chunk.windows(marker.len()).any(|w| w == marker)
                        {
                            armed_up.store(false, Ordering::SeqCst);
                            cut_up.store(true, Ordering::SeqCst);
                            return;
                        }
                    }
                    reading_up.store(
                        chunk.windows(10).any(|w| w == b"XREADGROUP"),
                        Ordering::SeqCst,
                    );
                    if to_server.write_all(chunk).await.is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 64 * 1024];
                while let Ok(read) = from_server.read(&mut buffer).await {
                    if read == 0 {
                        return;
                    }
                    let chunk = &buffer[..read];
                    if cut.load(Ordering::SeqCst) {
                        return;
                    }
                    let Cut::ReadAnswerWith(marker) = cut_at else {
                        if to_client.write_all(chunk).await.is_err() {
                            return;
                        }
                        continue;
                    };
                    if armed.load(Ordering::SeqCst)
                        && reading.load(Ordering::SeqCst)
                        && chunk.windows(marker.len()).any(|w| w == marker)
                    {
                        armed.store(false, Ordering::SeqCst);
                        cut.store(true, Ordering::SeqCst);
                        // Dropped halves close the client's connection.
                        return;
                    }
                    if to_client.write_all(chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A queue route whose Redis is reached through a [`reply_cutter`] armed to cut as `cut`
/// says once `bodies` are stored (with the route off) and the route is switched on; waits
/// until each was applied, well within `claim_after`, once, and none was said taken over.
async fn jobs_applied_at_once_after_a_cut(cut: Cut, bodies: &[&str]) {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, seen) = recording_always_ok().await;
    let armed = Arc::new(AtomicBool::new(false));
    let port = reply_cutter(redis.port, cut, armed.clone()).await;
    let policy = queue_policy(
        backend.addr,
        &format!("redis://127.0.0.1:{port}"),
        "claim_after = \"30s\"",
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;
    for body in bodies {
        assert_eq!(post_as(&levee, body, "192.0.2.7").await.status, 202);
    }
    armed.store(true, Ordering::SeqCst);
    switch(&levee, "on").await;
    eventually(
        Duration::from_secs(10),
        "the jobs to be applied, well within claim_after",
        || async { seen.lock().expect("lock").len() >= bodies.len() },
    )
    .await;
    assert!(
        !armed.load(Ordering::SeqCst),
        "the connection was never cut"
    );
    let mut keys: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(key, ..)| key.clone())
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), bodies.len(), "each once");
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_queue_taken_over_total{route=\"notify\"}"),
        0.0,
        "{metrics}"
    );
}

/// A job Redis gave the worker in a read whose answer was lost (a stall, a cut connection)
/// is handed back on the next pass and applied at once: it waited out `claim_after` in the
/// worker's own pending list, then was said perhaps sent twice when it never was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_read_got_no_answer_is_applied_at_once_not_after_claim_after() {
    jobs_applied_at_once_after_a_cut(Cut::ReadAnswerWith(b"lost-answer-7"), &["lost-answer-7"])
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_a_page_of_an_allowed_origin_can_send_a_write_to_a_switched_off_route_and_read_its_202(
) {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _seen) = recording_always_ok().await;
    let policy = policy_for(
        backend.addr,
        "access_log = false\ncors_origins = [\"https://app.example\"]",
        &format!(
            "[redis]\nurl = \"{}\"\ntimeout = \"200ms\"\n[degrade]\nsync_interval = \"100ms\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\", \"OPTIONS\"], path_prefix = \"/notify\" }}\ntier = 2\nmodule = \"notifications\"\ndegrade = {{ action = \"queue\" }}\n",
            redis.url()
        ),
    );
    let levee = Levee::start(&policy).await;
    switch(&levee, "off").await;

    let preflight = send(
        Request::options(levee.url("/notify.php"))
            .header("origin", "https://app.example")
            .header("access-control-request-method", "POST")
            .body(full(""))
            .expect("request"),
    )
    .await;
    assert_eq!(preflight.status, 204, "{}", preflight.text());
    assert_eq!(
        preflight.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert_eq!(
        preflight.header("access-control-allow-methods"),
        Some("POST")
    );
    assert_eq!(preflight.header("access-control-allow-headers"), None);

    let queued = send(
        Request::post(levee.url("/notify.php"))
            .header("origin", "https://app.example")
            .header("accept", "application/json")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(full("like=1"))
            .expect("request"),
    )
    .await;
    assert_eq!(queued.status, 202, "{}", queued.text());
    assert!(queued.header("x-levee-job").is_some());
    assert_eq!(
        queued.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    assert_eq!(
        queued.header("access-control-expose-headers"),
        Some("Retry-After, RateLimit, RateLimit-Policy, X-Levee-Job")
    );
    assert_eq!(backend.hits(), 0, "nothing reached the app while it is off");
}

/// Redis failing in the middle of a batch, before a job was sent (its hold could not be
/// renewed): that job and those behind it are handed back once Redis answers, and applied
/// at once, not after claim_after with a warning that they may reach the app twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_of_a_batch_cut_short_before_their_replay_are_applied_at_once() {
    // The hold renewed right before each replay (see `RENEW_HOLD` in the worker).
    jobs_applied_at_once_after_a_cut(
        Cut::CommandWith(b"held[#held + 1]"),
        &["cut-batch=0", "cut-batch=1", "cut-batch=2"],
    )
    .await;
}

/// Redis's clock (`TIME`), in unix ms.
fn redis_now_ms(redis: &RedisServer) -> i64 {
    let time = redis.cli(&["TIME"]);
    let mut parts = time
        .lines()
        .map(|part| part.trim().parse::<i64>().expect("TIME"));
    let (seconds, micros) = (parts.next().expect("seconds"), parts.next().expect("µs"));
    seconds * 1000 + micros / 1000
}

/// An instance whose wall clock is 5 minutes ahead (as after a wrong NTP step) times the queue
/// by Redis's clock, as the other instances do: the job it stores is stamped with Redis's time,
/// the retry it parks for the app's `Retry-After: 60` is due a minute after Redis's now, another
/// instance's retry due in a minute is left waiting, and the oldest job's age it reports is
/// the job's true age. By its own clock it had parked retries 6 minutes out, moved every other
/// instance's retries at once, and read a fresh job as 300 s old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_clock_is_ahead_times_the_queue_by_redis() {
    let Some(preload) = faketime_preload() else {
        eprintln!(
            "skipped: faketime is not installed (the Debian package faketime; .ci/run installs it)"
        );
        return;
    };
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    // The app is in maintenance: every request is answered 503 with `Retry-After: 60`.
    let seen_keys: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let record = seen_keys.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let record = record.clone();
        async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            record.lock().expect("lock").push(key);
            Response::builder()
                .status(503)
                .header("retry-after", "60")
                .body(full("maintenance"))
                .expect("response")
        }
    })
    .await;
    let (public, admin) = (free_port(), free_port());
    let policy = queue_policy(backend.addr, &redis.url(), "")
        .replacen("127.0.0.1:0", &format!("127.0.0.1:{public}"), 1)
        .replacen("127.0.0.1:0", &format!("127.0.0.1:{admin}"), 1);
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies).expect("policies dir");
    std::fs::write(policies.join("levee.toml"), policy).expect("write policy");
    let log = std::fs::File::create(dir.path().join("levee.log")).expect("log");
    // Only the wall clock moves, as an NTP step moves it; timers keep the monotonic clock.
    let _levee = ChildGuard::spawn(
        "levee with its clock 5 minutes ahead (libfaketime)",
        Command::new(env!("CARGO_BIN_EXE_levee"))
            .arg("run")
            .arg("--policies")
            .arg(&policies)
            .arg("--no-watch")
            .env("LD_PRELOAD", &preload)
            .env("FAKETIME", "+5m")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("LEVEE_LOG", "warn")
            .stderr(log),
    );
    wait_for_port(
        std::net::SocketAddr::from(([127, 0, 0, 1], public)),
        "levee to listen",
    )
    .await;
    let url = |path: &str| format!("http://127.0.0.1:{public}{path}");
    let admin_url = |path: &str| format!("http://127.0.0.1:{admin}{path}");
    let switched = post(&admin_url("/modules/notifications"), "off").await;
    assert_eq!(switched.status, 200, "{}", switched.text());

    let answer = post(&url("/notify.php"), "like=1").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    // The clock levee answers by is the skewed one: else this test shows nothing.
    let date = answer.header("date").expect("a Date header");
    let levee_clock = httpdate::parse_http_date(date).expect("an HTTP date");
    let levee_ms = levee_clock
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64;
    let skew_ms = levee_ms - redis_now_ms(&redis);
    assert!(
        (290_000..=310_000).contains(&skew_ms),
        "levee's clock should run 5 minutes ahead of Redis's, it is {skew_ms} ms off"
    );

    // Another instance's retry (an instance on the right clock), due a minute from now.
    let delayed = "levee:queue:{notify}:delayed";
    let other = format!("{delayed}:other-instance-retry");
    let stored_ms = redis_now_ms(&redis);
    let other_due = stored_ms + 60_000;
    redis.cli(&[
        "HSET",
        &other,
        "route",
        "notify",
        "method",
        "POST",
        "target",
        "/notify.php",
        "header_lines",
        "content-type: application/x-www-form-urlencoded\r\n",
        "body",
        "like=2",
        "client",
        "203.0.113.2",
        "at",
        &stored_ms.to_string(),
        "attempts",
        "1",
        "key",
        "other-instance-retry",
    ]);
    redis.cli(&["ZADD", delayed, &other_due.to_string(), &other]);

    // Replayed once, answered 503, parked until Redis's now + 60 s.
    let switched = post(&admin_url("/modules/notifications"), "on").await;
    assert_eq!(switched.status, 200, "{}", switched.text());
    let parked = || {
        redis
            .cli(&["ZRANGE", delayed, "0", "-1", "WITHSCORES"])
            .lines()
            .collect::<Vec<_>>()
            .chunks(2)
            .filter(|pair| pair.len() == 2 && pair[0] != other)
            .map(|pair| (pair[0].to_string(), pair[1].parse::<i64>().expect("score")))
            .next()
    };
    eventually(
        Duration::from_secs(10),
        "the job to be parked for its retry",
        || async { parked().is_some() },
    )
    .await;
    // This instance has begun a pass (each moves what is due first) since the other
    // instance's retry was parked, and left it waiting: it is due in a minute.
    let score = redis.cli(&["ZSCORE", delayed, &other]);
    assert_eq!(
        score.trim(),
        other_due.to_string(),
        "another instance's retry is due in a minute and stays parked"
    );
    let keys = seen_keys.lock().expect("lock").clone();
    assert!(
        !keys.iter().any(|key| key == "other-instance-retry"),
        "another instance's retry was replayed early: {keys:?}"
    );

    let now = redis_now_ms(&redis);
    let (job_key, due) = parked().expect("parked");
    assert!(
        (now + 50_000..=now + 60_000).contains(&due),
        "the retry asked for in 60 s is due {} ms after Redis's now",
        due - now
    );
    let at: i64 = redis
        .cli(&["HGET", &job_key, "at"])
        .trim()
        .parse()
        .expect("the parked job, with its `at`, still in Redis (not moved back early)");
    assert!(
        (now - 10_000..=now).contains(&at),
        "the job is stamped {} ms off Redis's now",
        at - now
    );

    // The oldest job (the other instance's, stored a few seconds ago) reads its true age.
    let queues = get(&admin_url("/queues")).await.json();
    let age = queues["notify"]["oldest_job_age_seconds"]
        .as_u64()
        .expect("an age");
    assert!(
        age < 60,
        "a job stored seconds ago reads {age} s old: {queues}"
    );
    let scraped = Mutex::new(String::new());
    let scraped = &scraped;
    let metrics_url = admin_url("/metrics");
    let metrics_url = &metrics_url;
    eventually(
        Duration::from_secs(10),
        "the backlog metric to count both jobs",
        || async move {
            let text = get(metrics_url).await.text();
            let counted = metric_value(&text, "levee_queue_backlog{route=\"notify\"}") == 2.0;
            *scraped.lock().expect("lock") = text;
            counted
        },
    )
    .await;
    let metrics = scraped.lock().expect("lock").clone();
    let age = metric_value(
        &metrics,
        "levee_queue_oldest_job_age_seconds{route=\"notify\"}",
    );
    assert!(age < 60.0, "levee_queue_oldest_job_age_seconds reads {age}");
}
