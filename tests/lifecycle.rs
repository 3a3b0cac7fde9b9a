//! Start, drain and stop: in-process and as the real binary with real signals.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use http::{Request, Response};
use hyper::body::Incoming;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_answers_readyz_503_while_traffic_still_flows_then_stops() {
    let backend = Backend::start(|request: Request<Incoming>| async move {
        if request.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        Response::new(full("done"))
    })
    .await;
    let mut levee = Levee::start(&policy_for(
        backend.addr,
        "drain = \"1s\"\nshutdown_timeout = \"5s\"",
        "",
    ))
    .await;
    assert_eq!(get(&levee.url("/readyz")).await.status, 200);

    let in_flight = tokio::spawn(get_owned(levee.url("/slow")));
    eventually(
        Duration::from_secs(5),
        "the slow request to reach the backend",
        || async { backend.hits() >= 1 },
    )
    .await;

    let running = levee.running.take().expect("running");
    running.shutdown();
    let ready = get(&levee.url("/readyz")).await;
    assert_eq!(
        (
            ready.status,
            ready.text().as_str(),
            ready.header("connection")
        ),
        (503, "draining\n", Some("close"))
    );
    assert_eq!(
        get(&levee.url("/livez")).await.status,
        200,
        "draining is not dead"
    );
    let during = get(&levee.url("/new")).await;
    assert_eq!(
        (during.status, during.text().as_str()),
        (200, "done"),
        "new requests are served during drain"
    );
    // ...on connections the front is told not to reuse, so that few are left idle for the
    // drain's end to close under a request being sent.
    assert_eq!(during.header("connection"), Some("close"));

    tokio::time::timeout(Duration::from_secs(10), running.wait())
        .await
        .expect("levee stops after drain");
    let finished = in_flight.await.expect("in-flight task");
    assert_eq!(
        (finished.status, finished.text().as_str()),
        (200, "done"),
        "in-flight request finished"
    );
    assert!(
        tokio::net::TcpStream::connect(levee.public).await.is_err(),
        "no longer accepting"
    );
}

/// The drain's end takes no request a front has written: a connection the kernel accepted
/// that levee had not taken yet (here held in the backlog by `max_connections`), and one
/// opened just before whose request comes a moment after, are both answered (with
/// `Connection: close`), where they were reset or closed and a front's POST failed with 502
/// (nginx does not send a POST again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drains_end_answers_requests_written_on_connections_it_had_not_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend =
        Backend::start(|_request: Request<Incoming>| async move { Response::new(full("applied")) })
            .await;
    let mut levee = Levee::start(&policy_for(
        backend.addr,
        "drain = \"100ms\"\nmax_connections = 1",
        "",
    ))
    .await;
    let request = b"POST /comment HTTP/1.1\r\nHost: site\r\nContent-Length: 2\r\n\r\nhi";
    // Takes the one connection levee holds, and sends nothing yet.
    let mut opened = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    // Accepted by the kernel, left in the backlog by levee, its request written.
    let mut waiting = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    waiting.write_all(request).await.expect("write");
    eventually(
        Duration::from_secs(5),
        "levee to wait at its connection cap",
        || async {
            metric_value(
                &get(&levee.admin_url("/metrics")).await.text(),
                "levee_connection_cap_waits_total",
            ) >= 1.0
        },
    )
    .await;

    let running = levee.running.take().expect("running");
    running.shutdown();
    let read_answer = |mut stream: tokio::net::TcpStream| async move {
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer));
        match read.await {
            Ok(Ok(_)) => String::from_utf8_lossy(&answer).to_lowercase(),
            other => format!("no answer: {other:?}"),
        }
    };
    let answer = read_answer(waiting).await;
    assert!(
        answer.starts_with("http/1.1 200")
            && answer.contains("connection: close")
            && answer.ends_with("applied"),
        "{answer}"
    );
    // levee has stopped accepting by now; the connection opened before gets its request in.
    opened.write_all(request).await.expect("write");
    let answer = read_answer(opened).await;
    assert!(
        answer.starts_with("http/1.1 200") && answer.contains("connection: close"),
        "{answer}"
    );
    tokio::time::timeout(Duration::from_secs(10), running.wait())
        .await
        .expect("levee stops");
    assert_eq!(backend.hits(), 2);
}

async fn get_owned(url: String) -> Answer {
    get(&url).await
}

fn binary_policy(
    dir: &std::path::Path,
    public: u16,
    admin: u16,
    upstream: std::net::SocketAddr,
    route_path: &str,
) {
    std::fs::write(
        dir.join("levee.toml"),
        format!(
            "[server]\nlisten = \"127.0.0.1:{public}\"\ndrain = \"200ms\"\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n[upstream.app]\nurl = \"http://{upstream}\"\n[[route]]\nname = \"r\"\nmatch = {{ path = \"{route_path}\" }}\n"
        ),
    )
    .expect("write policy");
}

/// The binary on `binary_policy` (route `/page`) and `extra` policy text, its log (the default
/// filter) in `dir`'s levee.log; returned listening, with the log's path and its public port.
async fn start_logging(
    dir: &std::path::Path,
    upstream: std::net::SocketAddr,
    extra: &str,
) -> (ChildGuard, std::path::PathBuf, u16) {
    let (public, admin) = (free_port(), free_port());
    binary_policy(dir, public, admin, upstream, "/page");
    let policy = dir.join("levee.toml");
    let text = std::fs::read_to_string(&policy).expect("read");
    std::fs::write(&policy, format!("{text}{extra}")).expect("write");
    let (levee, log_path) = spawn_logging(dir, public).await;
    (levee, log_path, public)
}

/// The binary on the policy in `dir`, its log to `dir/levee.log`, once it listens on `public`.
async fn spawn_logging(dir: &std::path::Path, public: u16) -> (ChildGuard, std::path::PathBuf) {
    let log_path = dir.join("levee.log");
    let log = std::fs::File::create(&log_path).expect("log");
    let levee = ChildGuard::spawn(
        "levee",
        Command::new(env!("CARGO_BIN_EXE_levee"))
            .arg("run")
            .arg("--policies")
            .arg(dir)
            .arg("--no-watch")
            .env_remove("LEVEE_LOG")
            .stderr(log),
    );
    wait_for_port(
        std::net::SocketAddr::from(([127, 0, 0, 1], public)),
        "levee to listen",
    )
    .await;
    (levee, log_path)
}

/// The binary on the policy in `dir` with the open-file limit `soft:hard`, once it listens on
/// `public`.
async fn start_with_open_files(dir: &std::path::Path, public: u16, limit: &str) -> ChildGuard {
    let levee = ChildGuard::spawn(
        "levee under prlimit",
        Command::new("prlimit")
            .arg(format!("--nofile={limit}"))
            .arg("--")
            .arg(env!("CARGO_BIN_EXE_levee"))
            .arg("run")
            .arg("--policies")
            .arg(dir)
            .arg("--no-watch")
            .env("LEVEE_LOG", "warn"),
    );
    wait_for_port(
        std::net::SocketAddr::from(([127, 0, 0, 1], public)),
        "levee to listen",
    )
    .await;
    levee
}

/// SIGHUP, then waits for `/status` (at `status_url`) to show policy `generation`.
async fn reload_by_sighup(levee: &ChildGuard, status_url: &str, generation: u64) {
    signal(levee.pid(), "HUP");
    eventually(
        Duration::from_secs(10),
        "SIGHUP to reload the policy",
        || async { get(status_url).await.json()["policy"]["generation"] == generation },
    )
    .await;
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_reloads_on_sighup_and_exits_0_on_sigterm() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let (public, admin) = (free_port(), free_port());
    binary_policy(dir.path(), public, admin, backend.addr, "/first");
    let mut levee = ChildGuard::spawn(
        "levee",
        Command::new(env!("CARGO_BIN_EXE_levee"))
            .arg("run")
            .arg("--policies")
            .arg(dir.path())
            .arg("--no-watch")
            .arg("--log-format")
            .arg("json")
            .env("LEVEE_LOG", "warn"),
    );
    let public_addr = std::net::SocketAddr::from(([127, 0, 0, 1], public));
    wait_for_port(public_addr, "levee to listen").await;
    let status_url = format!("http://127.0.0.1:{admin}/status");
    assert_eq!(get(&status_url).await.json()["policy"]["generation"], 1);
    assert_eq!(get(&format!("http://{public_addr}/x")).await.status, 200);

    binary_policy(dir.path(), public, admin, backend.addr, "/second");
    reload_by_sighup(&levee, &status_url, 2).await;
    assert_eq!(
        get(&status_url).await.json()["routes"][0]["match"]["path"],
        "/second"
    );

    signal(levee.pid(), "TERM");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(status) = levee.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "levee did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(exit.success(), "exit status {exit:?}");
}

#[test]
fn the_binary_refuses_to_start_on_a_broken_policy() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("levee.toml"), "[server]\nlisten = 8080\n").expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_levee"))
        .arg("run")
        .arg("--policies")
        .arg(dir.path())
        .output()
        .expect("run levee");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("levee.toml:2:10"), "{stderr}");

    // With JSON logs into a collector (not a terminal), one JSON object per line, the error
    // among them: the plain text written after them broke a line-based collector.
    let output = Command::new(env!("CARGO_BIN_EXE_levee"))
        .arg("run")
        .arg("--policies")
        .arg(dir.path())
        .arg("--log-format")
        .arg("json")
        .output()
        .expect("run levee");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("levee.toml:2:10"), "{stderr}");
    for line in stderr.lines() {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "not JSON: {line:?} in {stderr}"
        );
    }
}

/// A site whose limited routes are quiet still hears of a Redis outage: the switch sync fails
/// and says so once, not once per attempt, and says when Redis answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_is_logged_once_without_any_traffic() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let redis_dir = tempfile::tempdir().expect("redis dir");
    let mut redis = RedisServer::start(redis_dir.path()).await;
    let extra = format!(
        "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"100ms\"\n",
        redis.url()
    );
    let (_levee, log_path, _) = start_logging(dir.path(), backend.addr, &extra).await;
    let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    redis.guard.stop();
    eventually(Duration::from_secs(10), "the outage in the log", || async {
        read_log().contains("redis calls fail")
    })
    .await;
    // Ten syncs later, still one line.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        read_log().matches("redis calls fail").count(),
        1,
        "{}",
        read_log()
    );

    let _back = RedisServer::start_on(redis_dir.path(), redis.port).await;
    eventually(
        Duration::from_secs(10),
        "the recovery in the log",
        || async { read_log().contains("redis calls answer again") },
    )
    .await;
}

/// Started with a soft open-file limit of 1024 under a higher hard one (as systemd starts
/// services), levee raises its soft limit to the hard one; a `max_connections` that needs
/// more still is a policy warning, at start and after a reload, gone once the cap fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_file_limit_is_raised_to_the_hard_one_and_a_cap_beyond_it_is_warned_of() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let (public, admin) = (free_port(), free_port());
    let with_cap = |max_connections: u32| {
        binary_policy(dir.path(), public, admin, backend.addr, "/page");
        let policy = dir.path().join("levee.toml");
        let text = std::fs::read_to_string(&policy).expect("read");
        let text = text.replacen(
            "[server]\n",
            &format!("[server]\nmax_connections = {max_connections}\n"),
            1,
        );
        std::fs::write(&policy, text).expect("write");
    };
    // 3000 connections need 6256 files; the hard limit is 4096.
    with_cap(3000);
    let levee = start_with_open_files(dir.path(), public, "1024:4096").await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", levee.pid()))
        .expect("read the process's limits");
    let open_files = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .expect("an open-files line");
    assert_eq!(
        open_files.split_whitespace().collect::<Vec<_>>()[3..5],
        ["4096", "4096"],
        "{open_files}"
    );
    let status_url = format!("http://127.0.0.1:{admin}/status");
    let warnings = |status: &serde_json::Value| status["policy"]["warnings"].to_string();
    let status = get(&status_url).await.json();
    assert!(
        warnings(&status).contains(
            "max_connections = 3000 needs about 6256 open files, but levee may open only 4096"
        ),
        "{status}"
    );

    with_cap(1000);
    reload_by_sighup(&levee, &status_url, 2).await;
    let status = get(&status_url).await.json();
    assert!(!warnings(&status).contains("open files"), "{status}");
    assert_eq!(status["connections"]["max"], 1000);
}

/// Under a limit that cannot hold the default 10000 connections, the default comes down to
/// what the limit holds, without a warning: only a cap the policy sets is warned of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_connection_cap_fits_the_open_file_limit() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    // (1024 - 256) / 2. A small box's limit of 256 keeps a quarter for the rest: 96
    // connections, where a fixed reserve of 256 left one (the load balancer's /readyz waited
    // behind a client and took levee out). Of 128: 48, too few to go unsaid.
    for (limit, cap, warned) in [
        ("1024:1024", 384, None),
        ("256:256", 96, None),
        (
            "128:128",
            48,
            Some("lets levee hold only 48 client connections"),
        ),
    ] {
        let (public, admin) = (free_port(), free_port());
        binary_policy(dir.path(), public, admin, backend.addr, "/page");
        let _levee = start_with_open_files(dir.path(), public, limit).await;
        let status = get(&format!("http://127.0.0.1:{admin}/status"))
            .await
            .json();
        assert_eq!(status["connections"]["max"], cap, "{limit}: {status}");
        let warnings = &status["policy"]["warnings"];
        match warned {
            None => assert_eq!(*warnings, serde_json::json!([]), "{limit}: {status}"),
            Some(words) => assert!(warnings.to_string().contains(words), "{limit}: {status}"),
        }
    }
}

/// Out of open files (a cap set above the limit), the public listener's failed accepts are
/// counted in `levee_accept_failures_total`: a warn line every 10 s was all there was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_accepts_are_counted() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let (public, admin) = (free_port(), free_port());
    binary_policy(dir.path(), public, admin, backend.addr, "/page");
    let policy = dir.path().join("levee.toml");
    let text = std::fs::read_to_string(&policy).expect("read");
    std::fs::write(
        &policy,
        text.replacen("[server]\n", "[server]\nmax_connections = 500\n", 1),
    )
    .expect("write");
    let levee = start_with_open_files(dir.path(), public, "64:64").await;
    let failures = || async {
        let metrics = get(&format!("http://127.0.0.1:{admin}/metrics"))
            .await
            .text();
        metrics
            .lines()
            .find_map(|line| line.strip_prefix("levee_accept_failures_total "))
            .and_then(|value| value.trim().parse::<u64>().ok())
    };
    assert_eq!(failures().await, Some(0));
    // More idle connections than levee has files: the kernel completes them all, levee runs
    // out while taking them.
    let mut held = Vec::new();
    for _ in 0..80 {
        held.push(
            tokio::net::TcpStream::connect(("127.0.0.1", public))
                .await
                .expect("connect"),
        );
    }
    let fds = format!("/proc/{}/fd", levee.pid());
    eventually(Duration::from_secs(10), "levee out of files", || async {
        std::fs::read_dir(&fds).map_or(0, |entries| entries.count()) >= 64
    })
    .await;
    drop(held);
    eventually(
        Duration::from_secs(10),
        "failed accepts counted",
        || async { failures().await.is_some_and(|count| count > 0) },
    )
    .await;
}

/// stderr given by a service manager may be a pipe nobody reads or a full disk: levee serves on
/// (its log lines are dropped and counted), and stops on SIGTERM. Written in place, a pipe
/// nobody read stopped every worker thread after ~300 requests (no answer, `/livez` silent),
/// and a failed write panicked the task that logged (a connection dropped after its answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_or_full_stderr_never_stops_levee_serving() {
    let backend = echo_backend().await;
    let dev_full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full")
    };
    for (case, stderr) in [
        ("a pipe nobody reads", std::process::Stdio::piped()),
        ("a full disk", std::process::Stdio::from(dev_full())),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let (public, admin) = (free_port(), free_port());
        binary_policy(dir.path(), public, admin, backend.addr, "/page");
        let mut levee = ChildGuard::spawn(
            "levee",
            Command::new(env!("CARGO_BIN_EXE_levee"))
                .arg("run")
                .arg("--policies")
                .arg(dir.path())
                .arg("--no-watch")
                .env("LEVEE_LOG", "info")
                .stderr(stderr),
        );
        wait_for_port(
            std::net::SocketAddr::from(([127, 0, 0, 1], public)),
            "levee to listen",
        )
        .await;
        // An access line each: far more than a pipe's 64 KiB.
        for _ in 0..2000 {
            let answer = tokio::time::timeout(
                Duration::from_secs(5),
                get(&format!("http://127.0.0.1:{public}/page")),
            )
            .await
            .unwrap_or_else(|_| panic!("{case}: a request went unanswered"));
            assert_eq!(answer.status, 200, "{case}");
        }
        signal(levee.pid(), "TERM");
        eventually(Duration::from_secs(20), "levee to stop", || {
            let exited = levee.child.try_wait().ok().flatten();
            async move { exited.is_some_and(|status| status.success()) }
        })
        .await;
    }
}

/// The shipped systemd unit is one systemd accepts as written (pointed at this build's
/// binary), and gives the drain time to finish before systemd kills levee.
#[test]
fn the_shipped_systemd_unit_verifies_and_outlasts_the_default_drain() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/systemd/levee.service"
    ))
    .expect("read examples/systemd/levee.service");
    let stop_timeout: u64 = unit
        .lines()
        .find_map(|line| line.strip_prefix("TimeoutStopSec="))
        .and_then(|seconds| seconds.trim().parse().ok())
        .expect("TimeoutStopSec= in seconds");
    // [server] drain 5 s + shutdown_timeout 30 s, their defaults.
    assert!(stop_timeout > 35, "TimeoutStopSec={stop_timeout}");
    assert!(unit.contains("\nLimitNOFILE="), "{unit}");
    // Read-only but for the state directory, which the comment names as the state_file's.
    assert!(
        unit.contains("\nProtectSystem=strict\nStateDirectory=levee\n"),
        "{unit}"
    );
    assert!(
        unit.contains("state_file = \"/var/lib/levee/state.json\""),
        "{unit}"
    );
    // A reload through the admin listener, whose exit status says when the policy was
    // refused (a SIGHUP's `systemctl reload` said success either way).
    assert!(
        unit.contains("\nExecReload=/usr/local/bin/levee reload\n")
            && unit.contains("\nEnvironment=LEVEE_POLICIES="),
        "{unit}"
    );

    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("levee.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/levee", env!("CARGO_BIN_EXE_levee")),
    )
    .expect("write the unit");
    let output = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("run systemd-analyze (package systemd; see .ci/run)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    // A key systemd cannot parse is only a warning, with the file's name in it.
    assert!(!stderr.contains("levee.service"), "{stderr}");
}

/// A levee that starts where its queue's consumer group exists already (every start but the
/// first) hears Redis refuse to make it again: an answer, not an outage to warn of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_group_made_before_is_no_redis_outage_in_the_log() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let redis_dir = tempfile::tempdir().expect("redis dir");
    let redis = RedisServer::start(redis_dir.path()).await;
    let stream = "levee:queue:{notify}:jobs";
    redis.cli(&["XGROUP", "CREATE", stream, "levee", "0", "MKSTREAM"]);
    let extra = format!(
        "[redis]\nurl = \"{}\"\n[queue]\npoll_interval = \"50ms\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\nalways_queue = true\n",
        redis.url()
    );
    let (_levee, log_path, public) = start_logging(dir.path(), backend.addr, &extra).await;
    // A job stored and applied: the worker has made (tried to make) its group by then.
    let job = post(&format!("http://127.0.0.1:{public}/notify"), "like=1").await;
    assert_eq!(job.status, 202, "{}", job.text());
    eventually(Duration::from_secs(10), "the job to be applied", || async {
        backend.hits() >= 1
    })
    .await;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(!log.contains("redis calls fail"), "{log}");
}

/// A request an `on_redis_error = "deny"` rule refuses because Redis is out reads as any 429 to
/// its client and in the access log: the log says why, once for many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_a_deny_rule_refuses_while_redis_is_out_are_said_to_be_so_in_the_log() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    // Nothing listens there.
    let extra = format!(
        "[redis]\nurl = \"redis://127.0.0.1:{}/0\"\ntimeout = \"50ms\"\n[limit.strict]\nkey = [\"ip\"]\nrate = \"100/s\"\non_redis_error = \"deny\"\n[[route]]\nname = \"limited\"\nmatch = {{ path = \"/limited\" }}\nlimits = [\"strict\"]\n",
        free_port()
    );
    let (_levee, log_path, public) = start_logging(dir.path(), backend.addr, &extra).await;
    for _ in 0..5 {
        let refused = get(&format!("http://127.0.0.1:{public}/limited")).await;
        assert_eq!(refused.status, 429, "{}", refused.text());
    }
    eventually(Duration::from_secs(5), "the log to say why", || async {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        log.contains("requests refused because redis cannot be used") && log.contains("strict")
    })
    .await;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert_eq!(
        log.matches("requests refused because redis cannot be used")
            .count(),
        1,
        "once for the five: {log}"
    );
}

/// A levee process stopped by SIGTERM takes its line out of the fleet view before it exits:
/// the other instances then show it gone, not silent for an hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_leaves_the_fleet_view_when_it_stops() {
    let backend = echo_backend().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let redis = RedisServer::start(dir.path()).await;
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).expect("policies dir");
    let (mut levee, _log, _public) = start_logging(
        &policies,
        backend.addr,
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"100ms\"\n",
            redis.url()
        ),
    )
    .await;
    let lines = || redis.cli(&["HLEN", "levee:fleet"]);
    eventually(
        Duration::from_secs(5),
        "its line in the fleet view",
        || async { lines().trim() == "1" },
    )
    .await;

    signal(levee.pid(), "TERM");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while levee.child.try_wait().expect("wait").is_none() {
        assert!(std::time::Instant::now() < deadline, "levee did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(lines().trim(), "0", "the line outlived the process");
}

/// A stream still going when `shutdown_timeout` runs out is cut by levee's stop, and its
/// access line says so: it read `complete=false error=-`, as a client's going does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_at_shutdown_is_logged_as_such() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let backend = Backend::start(|_request: Request<Incoming>| async {
        let events = futures_util::stream::unfold(0u32, |step| async move {
            if step > 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let frame = hyper::body::Frame::data(bytes::Bytes::from(format!("data: {step}\n\n")));
            Some((Ok::<_, BoxError>(frame), step + 1))
        });
        Response::new(http_body_util::BodyExt::boxed_unsync(
            http_body_util::StreamBody::new(events),
        ))
    })
    .await;
    let dir = tempfile::tempdir().expect("temp dir");
    let (public, admin) = (free_port(), free_port());
    binary_policy(dir.path(), public, admin, backend.addr, "/events");
    let policy = dir.path().join("levee.toml");
    let text = std::fs::read_to_string(&policy).expect("read");
    std::fs::write(
        &policy,
        text.replace(
            "drain = \"200ms\"",
            "drain = \"0s\"\nshutdown_timeout = \"300ms\"",
        ),
    )
    .expect("write");
    let (mut levee, log_path) = spawn_logging(dir.path(), public).await;
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], public));
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    stream
        .write_all(b"GET /events HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .expect("ask");
    let mut head = vec![0u8; 1024];
    let read = stream.read(&mut head).await.expect("read");
    assert!(head[..read].starts_with(b"HTTP/1.1 200"));
    signal(levee.pid(), "TERM");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !matches!(levee.child.try_wait(), Ok(Some(_))) {
        assert!(std::time::Instant::now() < deadline, "levee did not stop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let logged = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        logged.lines().any(|line| line.contains("path=/events")
            && line.contains("complete=false")
            && line.contains("error=\"cut_off_at_shutdown\"")),
        "{logged}"
    );
    assert!(logged.contains("in_flight=1"), "{logged}");
}
