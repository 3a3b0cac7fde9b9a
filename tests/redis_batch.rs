//! The batched rate limiter on a single Redis server (`src/redis_batch.rs`), against real
//! redis-server processes on free loopback ports (or a unix socket) in temp dirs: batches
//! decide exactly as one script call per request would, the URL's password, user, database
//! and socket are honoured, and the worker recovers from a flushed script cache and from a
//! restarted server.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use http::Request;

/// Policy: `[redis]` section, limit rules, one route `/limited` using `rules`; users come from
/// the `x-user` header.
fn limited_policy(backend: &Backend, redis: &str, limits: &str, rules: &str) -> String {
    policy_for(
        backend.addr,
        "access_log = false",
        &format!("{redis}\n[identity]\nuser = [\"header:x-user\"]\n{limits}\n[[route]]\nname = \"limited\"\nmatch = {{ path_prefix = \"/limited\" }}\nlimits = [{rules}]\n"),
    )
}

/// `[redis]` on `url`, with a timeout generous enough for a debug build under load: in these
/// tests a fallback must come from Redis failing, never from a slow test machine.
fn redis_section(url: &str, extra: &str) -> String {
    format!("[redis]\nurl = \"{url}\"\ntimeout = \"2s\"\n{extra}")
}

/// `redis_section` with every decision waiting for Redis's answer (`admit_ahead_above = 1`):
/// sections 1 to 7 test the batched calls themselves, and count decisions made by Redis.
fn waiting_redis_section(url: &str, extra: &str) -> String {
    redis_section(url, &format!("admit_ahead_above = 1\n{extra}"))
}

async fn send_as(levee: &Levee, user: Option<&str>) -> Answer {
    let mut request = Request::get(levee.url("/limited"));
    if let Some(user) = user {
        request = request.header("x-user", user);
    }
    send(request.body(full("")).expect("request")).await
}

/// levee with the `login` rule (three at once) on `/limited`, on the Redis at `url`, every
/// decision waiting for Redis.
async fn login_levee(backend: &Backend, url: &str) -> Levee {
    Levee::start(&limited_policy(
        backend,
        &waiting_redis_section(url, ""),
        THREE_AT_ONCE,
        "\"login\"",
    ))
    .await
}

/// One `levee_ratelimit_decisions_total` series.
async fn decisions(levee: &Levee, rule: &str, result: &str, source: &str) -> f64 {
    let text = get(&levee.admin_url("/metrics")).await.text();
    metric_value(
        &text,
        &format!(
            "levee_ratelimit_decisions_total{{rule=\"{rule}\",result=\"{result}\",source=\"{source}\"}}"
        ),
    )
}

/// Decisions of `rule` from `source`, whatever their result.
async fn decisions_from(levee: &Levee, rule: &str, source: &str) -> f64 {
    let mut total = 0.0;
    for result in ["allowed", "limited", "dry_run_limited"] {
        total += decisions(levee, rule, result, source).await;
    }
    total
}

async fn redis_up(levee: &Levee) -> f64 {
    metric_value(
        &get(&levee.admin_url("/metrics")).await.text(),
        "levee_redis_up",
    )
}

/// Runs redis-cli with `args` (connection options first) and returns its stdout.
fn cli(args: &[&str]) -> String {
    let binary = find_binary(&["redis-cli", "/usr/bin/redis-cli"]);
    let output = Command::new(binary)
        .arg("--no-auth-warning")
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `name:value` from `INFO section` (redis-cli's output, `connection` being its options).
fn info_field(connection: &[&str], section: &str, name: &str) -> Option<String> {
    let mut args = connection.to_vec();
    args.extend(["info", section]);
    cli(&args).lines().find_map(|line| {
        line.trim()
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::to_owned)
    })
}

/// How many times Redis ran `EVALSHA` (all of them levee's rate-limit calls here).
fn evalsha_calls(connection: &[&str]) -> u64 {
    info_field(connection, "commandstats", "cmdstat_evalsha")
        .and_then(|stats| {
            stats
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))
                .and_then(|calls| calls.parse().ok())
        })
        .unwrap_or(0)
}

/// Scripts in Redis's script cache.
fn cached_scripts(connection: &[&str]) -> u64 {
    info_field(connection, "memory", "number_of_cached_scripts")
        .and_then(|count| count.parse().ok())
        .expect("INFO memory has number_of_cached_scripts")
}

/// The rate-limit bucket keys in one database.
fn bucket_keys(connection: &[&str], db: u32) -> Vec<String> {
    let db = db.to_string();
    let mut args = connection.to_vec();
    args.extend(["-n", &db, "--scan", "--pattern", "levee:rl:*"]);
    cli(&args)
        .lines()
        .map(str::to_owned)
        .filter(|key| !key.is_empty())
        .collect()
}

/// A redis-server of the test's own with `extra` settings, files in `dir`, nothing saved.
fn spawn_redis(dir: &Path, extra: &[&str]) -> ChildGuard {
    let binary = find_binary(&["redis-server", "/usr/bin/redis-server"]);
    ChildGuard::spawn(
        "redis-server",
        Command::new(binary)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .arg("--dir")
            .arg(dir)
            .args(["--daemonize", "no"]),
    )
}

/// A redis-server on a free port that wants a password: `secret` for the default user,
/// `p@ss:w/rd` for the ACL user `levee` (in a URL: `levee:p%40ss%3Aw%2Frd`).
async fn redis_with_passwords(dir: &Path) -> (ChildGuard, u16) {
    let port = free_port();
    let guard = spawn_redis(
        dir,
        &[
            "--port",
            &port.to_string(),
            "--requirepass",
            "secret",
            "--user",
            "levee",
            "on",
            ">p@ss:w/rd",
            "~*",
            "&*",
            "+@all",
        ],
    );
    wait_for_port(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        "redis-server to listen",
    )
    .await;
    (guard, port)
}

// ---------------------------------------------------------------------------------------
// 1. Batches decide exactly like one call each

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_concurrent_requests_is_decided_in_shared_script_calls_exactly() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    let rule = "[limit.burst]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 50\n";
    let levee = Levee::start(&limited_policy(
        &backend,
        &waiting_redis_section(&redis.url(), ""),
        rule,
        "\"burst\"",
    ))
    .await;

    const REQUESTS: usize = 200;
    let answers =
        futures_util::future::join_all((0..REQUESTS).map(|_| send_as(&levee, None))).await;
    let admitted = answers.iter().filter(|a| a.status == 200).count();
    let refused = answers.iter().filter(|a| a.status == 429).count();
    assert_eq!(
        admitted + refused,
        REQUESTS,
        "only 200 and 429: {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    assert_eq!(admitted, 50, "exactly the burst is admitted");
    assert_eq!(refused, REQUESTS - 50);
    assert_eq!(backend.hits(), 50);

    // Every admission was Redis's; refusals are Redis's or, once Redis refused the key, the
    // deny cache's (no Redis call). Nothing fell back.
    let allowed = decisions(&levee, "burst", "allowed", "redis").await;
    let limited_redis = decisions(&levee, "burst", "limited", "redis").await;
    let limited_cache = decisions(&levee, "burst", "limited", "cache").await;
    assert_eq!(allowed, 50.0);
    assert!(limited_redis >= 1.0, "Redis refused the 51st request");
    assert_eq!(limited_redis + limited_cache, (REQUESTS - 50) as f64);
    assert_eq!(decisions_from(&levee, "burst", "fallback").await, 0.0);
    assert_eq!(decisions_from(&levee, "burst", "local").await, 0.0);

    let at_redis = (allowed + limited_redis) as u64;
    let calls = evalsha_calls(&connection);
    println!(
        "{REQUESTS} requests: {at_redis} decisions made in Redis ({limited_cache} refused by the deny cache) in {calls} EVALSHA calls"
    );
    assert!(calls >= 1, "the decisions were made by EVALSHA");
    assert!(
        calls < at_redis,
        "{at_redis} decisions in {calls} script calls: no batch held more than one"
    );
}

// ---------------------------------------------------------------------------------------
// 2. Within a batch, each request's rules are all or nothing

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_refused_in_a_batch_consumes_no_tokens_of_its_other_rules() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    let rules = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 2\n[limit.per_ip]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 6\n";
    let levee = Levee::start(&limited_policy(
        &backend,
        &waiting_redis_section(&redis.url(), ""),
        rules,
        "\"per_user\", \"per_ip\"",
    ))
    .await;

    // Alice and Bob, interleaved, all at once (one IP): each user gets their 2, and every
    // refusal is per_user's, in whatever order the batches put them.
    let users: Vec<&str> = (0..20)
        .map(|i| if i % 2 == 0 { "alice" } else { "bob" })
        .collect();
    let answers =
        futures_util::future::join_all(users.iter().map(|user| send_as(&levee, Some(user)))).await;
    for name in ["alice", "bob"] {
        let admitted = users
            .iter()
            .zip(&answers)
            .filter(|(user, answer)| **user == name && answer.status == 200)
            .count();
        assert_eq!(admitted, 2, "{name}'s burst");
    }
    for answer in answers.iter().filter(|a| a.status != 200) {
        assert_eq!(answer.status, 429);
        assert!(
            answer
                .header("ratelimit")
                .is_some_and(|v| v.starts_with("\"per_user\"")),
            "refused by per_user: {:?}",
            answer.headers
        );
    }
    let at_redis = decisions_from(&levee, "per_user", "redis").await as u64;
    println!(
        "{} requests: {at_redis} decided in Redis in {} EVALSHA calls",
        users.len(),
        evalsha_calls(&connection)
    );

    // The IP spent exactly the 4 admitted requests' tokens of its 6: the 16 refusals took
    // none. Carol gets the last 2, then the IP's rule refuses Dave (who has tokens of his own).
    let mut later = Vec::new();
    for user in ["carol", "carol", "dave"] {
        later.push(send_as(&levee, Some(user)).await);
    }
    assert_eq!(
        later.iter().map(|a| a.status).collect::<Vec<_>>(),
        [200, 200, 429]
    );
    assert!(
        later[2]
            .header("ratelimit")
            .is_some_and(|v| v.starts_with("\"per_ip\"")),
        "{:?}",
        later[2].headers
    );
    assert_eq!(decisions_from(&levee, "per_user", "fallback").await, 0.0);
    assert_eq!(decisions_from(&levee, "per_ip", "fallback").await, 0.0);
    assert_eq!(backend.hits(), 6);
}

// ---------------------------------------------------------------------------------------
// 3. Password, user and database from the URL

const THREE_AT_ONCE: &str = "[limit.login]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 3\n";

async fn statuses(levee: &Levee, count: usize) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..count {
        out.push(send_as(levee, None).await.status);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_user_and_database_of_the_url_are_used() {
    let dir = tempfile::tempdir().expect("dir");
    let (_redis, port) = redis_with_passwords(dir.path()).await;
    let port_text = port.to_string();
    let admin = ["-p", port_text.as_str(), "-a", "secret"];
    let backend = echo_backend().await;

    // The default user's password, database 3.
    let levee = login_levee(&backend, &format!("redis://:secret@127.0.0.1:{port}/3")).await;
    assert_eq!(statuses(&levee, 4).await, [200, 200, 200, 429]);
    assert_eq!(decisions(&levee, "login", "allowed", "redis").await, 3.0);
    assert_eq!(decisions(&levee, "login", "limited", "redis").await, 1.0);
    assert_eq!(decisions_from(&levee, "login", "fallback").await, 0.0);
    let in_db3 = bucket_keys(&admin, 3);
    assert_eq!(in_db3.len(), 1, "the bucket is in database 3: {in_db3:?}");
    assert!(bucket_keys(&admin, 0).is_empty(), "nothing in database 0");

    // An ACL user with its own password (percent-encoded in the URL), database 5.
    let levee = login_levee(
        &backend,
        &format!("redis://levee:p%40ss%3Aw%2Frd@127.0.0.1:{port}/5"),
    )
    .await;
    assert_eq!(statuses(&levee, 4).await, [200, 200, 200, 429]);
    assert_eq!(decisions(&levee, "login", "allowed", "redis").await, 3.0);
    assert_eq!(decisions_from(&levee, "login", "fallback").await, 0.0);
    assert_eq!(
        bucket_keys(&admin, 5).len(),
        1,
        "the bucket is in database 5"
    );
    assert!(bucket_keys(&admin, 0).is_empty(), "nothing in database 0");
    assert_eq!(bucket_keys(&admin, 3).len(), 1, "database 3 untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_falls_back_and_every_request_is_answered() {
    let dir = tempfile::tempdir().expect("dir");
    let (_redis, port) = redis_with_passwords(dir.path()).await;
    let port_text = port.to_string();
    let admin = ["-p", port_text.as_str(), "-a", "secret"];
    let backend = echo_backend().await;
    let levee = login_levee(&backend, &format!("redis://:wrong@127.0.0.1:{port}/3")).await;
    // on_redis_error = "local" (the default): the burst in-process, then 429; never a 5xx.
    assert_eq!(statuses(&levee, 6).await, [200, 200, 200, 429, 429, 429]);
    assert_eq!(decisions(&levee, "login", "allowed", "fallback").await, 3.0);
    assert_eq!(decisions(&levee, "login", "limited", "fallback").await, 3.0);
    assert_eq!(decisions_from(&levee, "login", "redis").await, 0.0);
    assert_eq!(redis_up(&levee).await, 0.0, "the health breaker opened");
    assert!(bucket_keys(&admin, 3).is_empty());
    assert!(bucket_keys(&admin, 0).is_empty());

    // A user whose password is right but whose name is wrong fares no better.
    let levee = login_levee(
        &backend,
        &format!("redis://nobody:p%40ss%3Aw%2Frd@127.0.0.1:{port}/3"),
    )
    .await;
    assert_eq!(statuses(&levee, 4).await, [200, 200, 200, 429]);
    assert_eq!(decisions_from(&levee, "login", "fallback").await, 4.0);
    assert_eq!(decisions_from(&levee, "login", "redis").await, 0.0);

    // The other fallbacks do what they say: `allow` admits all, `deny` refuses all with a
    // Retry-After (a 429, not a 5xx).
    for (on_error, expected) in [("allow", 200), ("deny", 429)] {
        let rule = format!("{THREE_AT_ONCE}on_redis_error = \"{on_error}\"\n");
        let levee = Levee::start(&limited_policy(
            &backend,
            &waiting_redis_section(&format!("redis://:wrong@127.0.0.1:{port}/3"), ""),
            &rule,
            "\"login\"",
        ))
        .await;
        for _ in 0..5 {
            let answer = send_as(&levee, None).await;
            assert_eq!(answer.status, expected, "on_redis_error = {on_error}");
            if expected == 429 {
                assert!(answer.header("retry-after").is_some());
            }
        }
        assert_eq!(
            decisions_from(&levee, "login", "fallback").await,
            5.0,
            "on_redis_error = {on_error}"
        );
    }
    assert!(bucket_keys(&admin, 3).is_empty());
}

// ---------------------------------------------------------------------------------------
// 4. Unix socket

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_url_is_used() {
    let dir = tempfile::tempdir().expect("dir");
    let socket = dir.path().join("redis.sock");
    let socket_text = socket.to_str().expect("utf-8 path").to_owned();
    let _redis = spawn_redis(
        dir.path(),
        &[
            "--port",
            "0",
            "--unixsocket",
            &socket_text,
            "--unixsocketperm",
            "700",
        ],
    );
    eventually(
        Duration::from_secs(10),
        "redis-server to listen on its socket",
        || {
            let socket = socket.clone();
            async move { tokio::net::UnixStream::connect(&socket).await.is_ok() }
        },
    )
    .await;
    let connection = ["-s", socket_text.as_str()];
    let backend = echo_backend().await;

    for (url, db) in [
        (format!("redis+unix://{socket_text}"), 0),
        (format!("unix://{socket_text}?db=2"), 2),
    ] {
        let levee = login_levee(&backend, &url).await;
        let keys_before = bucket_keys(&connection, db).len();
        assert_eq!(statuses(&levee, 4).await, [200, 200, 200, 429], "{url}");
        assert_eq!(
            decisions(&levee, "login", "allowed", "redis").await,
            3.0,
            "{url}"
        );
        assert_eq!(
            decisions(&levee, "login", "limited", "redis").await,
            1.0,
            "{url}"
        );
        assert_eq!(
            decisions_from(&levee, "login", "fallback").await,
            0.0,
            "{url}"
        );
        assert_eq!(
            (keys_before, bucket_keys(&connection, db).len()),
            (0, 1),
            "{url}: the bucket is in database {db}"
        );
        // Each levee uses its own database here, so the second starts with a full bucket.
    }
}

// ---------------------------------------------------------------------------------------
// 5. SCRIPT FLUSH

/// A rule that never refuses in these tests: every decision is counted as `allowed`. (A slow
/// rate, so the bucket's key stays in Redis for a minute after each request.)
const GENEROUS: &str = "[limit.wide]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 100000\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_script_cache_is_loaded_again() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        &waiting_redis_section(&redis.url(), "cooldown = \"200ms\"\n"),
        GENEROUS,
        "\"wide\"",
    ))
    .await;
    assert_eq!(send_as(&levee, None).await.status, 200);
    assert_eq!(decisions(&levee, "wide", "allowed", "redis").await, 1.0);
    assert_eq!(cached_scripts(&connection), 1, "levee loaded its script");

    assert_eq!(cli(&["-p", &port, "script", "flush"]).trim(), "OK");
    assert_eq!(cached_scripts(&connection), 0, "the script cache is empty");

    // The next call meets NOSCRIPT: levee loads the script again on the same connection and
    // sends the batch again, so no decision falls back and Redis stays marked up.
    for _ in 0..3 {
        assert_eq!(send_as(&levee, None).await.status, 200);
    }
    assert_eq!(decisions(&levee, "wide", "allowed", "redis").await, 4.0);
    assert_eq!(decisions_from(&levee, "wide", "fallback").await, 0.0);
    assert_eq!(
        cached_scripts(&connection),
        1,
        "levee loaded its script again"
    );
    assert_eq!(redis_up(&levee).await, 1.0);
}

// ---------------------------------------------------------------------------------------
// 6. Redis killed and restarted on the same port

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restarted_on_the_same_port_is_used_again() {
    let dir = tempfile::tempdir().expect("dir");
    let mut redis = RedisServer::start(dir.path()).await;
    let port = redis.port;
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        &waiting_redis_section(&redis.url(), "failures_to_open = 2\ncooldown = \"200ms\"\n"),
        GENEROUS,
        "\"wide\"",
    ))
    .await;
    assert_eq!(send_as(&levee, None).await.status, 200);
    assert_eq!(decisions(&levee, "wide", "allowed", "redis").await, 1.0);

    redis.kill();
    for _ in 0..10 {
        assert_eq!(
            send_as(&levee, None).await.status,
            200,
            "answered while Redis is gone"
        );
    }
    assert_eq!(
        decisions(&levee, "wide", "allowed", "fallback").await,
        10.0,
        "every decision fell back while Redis was gone"
    );
    assert_eq!(decisions(&levee, "wide", "allowed", "redis").await, 1.0);
    assert_eq!(redis_up(&levee).await, 0.0, "the health breaker opened");

    let redis = RedisServer::start_on(dir.path(), port).await;
    let port_text = redis.port.to_string();
    let connection = ["-p", port_text.as_str()];
    eventually(
        Duration::from_secs(10),
        "decisions to come from the restarted Redis",
        || async {
            assert_eq!(send_as(&levee, None).await.status, 200);
            decisions(&levee, "wide", "allowed", "redis").await > 1.0
        },
    )
    .await;
    assert_eq!(redis_up(&levee).await, 1.0);
    assert_eq!(
        cached_scripts(&connection),
        1,
        "the script was loaded again"
    );
    assert_eq!(bucket_keys(&connection, 0).len(), 1, "the bucket is back");
    assert!(evalsha_calls(&connection) >= 1);
}

/// Redis closed levee's connection while it sat idle (a restart between two requests, a
/// `timeout` in redis.conf): the next decision opens another and is made by Redis, with no
/// fallback and no health-breaker alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_redis_closed_while_idle_is_replaced_before_the_next_call() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port_text = redis.port.to_string();
    let connection = ["-p", port_text.as_str()];
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        &waiting_redis_section(&redis.url(), "failures_to_open = 1\ncooldown = \"1h\"\n"),
        GENEROUS,
        "\"wide\"",
    ))
    .await;
    for round in 1..=3 {
        assert_eq!(send_as(&levee, None).await.status, 200);
        assert_eq!(
            decisions(&levee, "wide", "allowed", "redis").await,
            f64::from(round)
        );
        // Every client but redis-cli itself: levee's connections are closed under it.
        cli(&[&connection[..], &["CLIENT", "KILL", "TYPE", "normal"]].concat());
        // The close reaches levee's socket.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(decisions_from(&levee, "wide", "fallback").await, 0.0);
    assert_eq!(redis_up(&levee).await, 1.0);
}

// ---------------------------------------------------------------------------------------
// 7. A reload that changes `[redis]`

fn connected_clients(connection: &[&str]) -> u64 {
    info_field(connection, "clients", "connected_clients")
        .and_then(|count| count.trim().parse().ok())
        .expect("INFO clients has connected_clients")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_another_redis_moves_decisions_and_closes_the_old_connection() {
    let old_dir = tempfile::tempdir().expect("dir");
    let old = RedisServer::start(old_dir.path()).await;
    let new_dir = tempfile::tempdir().expect("dir");
    let new = RedisServer::start(new_dir.path()).await;
    let old_port = old.port.to_string();
    let new_port = new.port.to_string();
    let old_connection = ["-p", old_port.as_str()];
    let new_connection = ["-p", new_port.as_str()];
    let backend = echo_backend().await;
    let policy = |url: &str| {
        limited_policy(
            &backend,
            &waiting_redis_section(url, ""),
            GENEROUS,
            "\"wide\"",
        )
    };
    let levee = Levee::start(&policy(&old.url())).await;
    for _ in 0..3 {
        assert_eq!(send_as(&levee, None).await.status, 200);
    }
    assert_eq!(evalsha_calls(&old_connection), 3);
    assert!(
        connected_clients(&old_connection) >= 2,
        "levee's worker is connected (besides redis-cli)"
    );

    std::fs::write(levee.policy_file(), policy(&new.url())).expect("write policy");
    // (The file watcher may apply it first; either way it is in effect once this returns.)
    let reload = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reload.json()["ok"], true, "{}", reload.text());
    assert!(levee.generation() >= 2);
    for _ in 0..3 {
        assert_eq!(send_as(&levee, None).await.status, 200);
    }
    assert_eq!(
        evalsha_calls(&new_connection),
        3,
        "decided on the new Redis"
    );
    assert_eq!(
        evalsha_calls(&old_connection),
        3,
        "and no longer on the old one"
    );
    assert_eq!(bucket_keys(&new_connection, 0).len(), 1);
    assert_eq!(decisions_from(&levee, "wide", "redis").await, 6.0);
    assert_eq!(decisions_from(&levee, "wide", "fallback").await, 0.0);
    // The old policy's worker stops and closes its connection: only redis-cli is left.
    eventually(
        Duration::from_secs(10),
        "the old Redis to have no levee connection left",
        || async { connected_clients(&old_connection) == 1 },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// 8. Admitting ahead of Redis (`[redis] admit_ahead_above`)

/// Policy: `[redis]` section, limit rules, route `/limited` using `rules`, and route `/flush`
/// with the rule `flush`, keyed by user (from `x-user`), that no other request touches.
fn ahead_policy(backend: &Backend, redis: &str, limits: &str, rules: &str) -> String {
    policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "{redis}\n[identity]\nuser = [\"header:x-user\"]\n{limits}\n[limit.flush]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 5\n[[route]]\nname = \"limited\"\nmatch = {{ path_prefix = \"/limited\" }}\nlimits = [{rules}]\n[[route]]\nname = \"flush\"\nmatch = {{ path_prefix = \"/flush\" }}\nlimits = [\"flush\"]\n"
        ),
    )
}

/// Waits until every charge `levee` queued so far has been answered by Redis: a request of a
/// user never seen before has no known headroom, so its decision waits, and it is queued
/// behind every charge already waiting (the worker keeps their order and takes in a batch's
/// answers, overruns counted, before it hands the decision its answer).
async fn settle(levee: &Levee, user: &str) {
    let before = decisions(levee, "flush", "allowed", "redis").await;
    let request = Request::get(levee.url("/flush"))
        .header("x-user", user)
        .body(full(""))
        .expect("request");
    assert_eq!(send(request).await.status, 200, "flush request of {user}");
    assert_eq!(
        decisions(levee, "flush", "allowed", "redis").await,
        before + 1.0,
        "{user}'s decision waited for Redis"
    );
}

async fn ahead_overruns(levee: &Levee) -> f64 {
    metric_value(
        &get(&levee.admin_url("/metrics")).await.text(),
        "levee_ratelimit_ahead_overruns_total",
    )
}

/// The one bucket key of rule `rule` in database 0.
fn bucket_of(connection: &[&str], rule: &str) -> String {
    let keys: Vec<String> = bucket_keys(connection, 0)
        .into_iter()
        .filter(|key| key.contains(&format!(":{rule}:")))
        .collect();
    assert_eq!(keys.len(), 1, "one bucket of {rule}: {keys:?}");
    keys.into_iter().next().expect("one key")
}

/// `PTTL key` in milliseconds.
fn pttl(connection: &[&str], key: &str) -> i64 {
    let mut args = connection.to_vec();
    args.extend(["pttl", key]);
    let text = cli(&args);
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("PTTL {key}: {text:?}"))
}

/// A minute: the interval of the "1/min" rules below, in ms. A bucket charged k times from
/// full holds a TAT k minutes ahead, so its key's PTTL is k minutes less the time since the
/// first charge (well under the 10 s allowed here).
const MINUTE_MS: i64 = 60_000;

fn assert_charged(connection: &[&str], key: &str, charges: i64) {
    let ttl = pttl(connection, key);
    println!(
        "{key}: PTTL {ttl} ms, {charges} charges expected ({} ms)",
        charges * MINUTE_MS
    );
    assert!(
        (charges * MINUTE_MS - 10_000..=charges * MINUTE_MS).contains(&ttl),
        "PTTL {ttl} ms is not {charges} charges of a minute (one more or less is {} or {})",
        (charges + 1) * MINUTE_MS,
        (charges - 1) * MINUTE_MS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_request_admitted_ahead_is_charged_in_redis() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    let levee = Levee::start(&ahead_policy(
        &backend,
        &redis_section(&redis.url(), ""),
        GENEROUS,
        "\"wide\"",
    ))
    .await;

    // One after the other: the first waits for Redis (nothing is known of the bucket); its
    // answer (99999 of 100000 left) is known before the second arrives, and from then on
    // every request is admitted at once.
    const SEQUENTIAL: usize = 40;
    for i in 0..SEQUENTIAL {
        assert_eq!(send_as(&levee, None).await.status, 200, "request {i}");
    }
    // (Counted at the end: reading the metrics here would be a pause in which the bucket's
    // last answer can grow too old to admit ahead on, on a loaded machine.)

    // All at once: every one admitted ahead.
    const CONCURRENT: usize = 40;
    let answers =
        futures_util::future::join_all((0..CONCURRENT).map(|_| send_as(&levee, None))).await;
    assert!(
        answers.iter().all(|a| a.status == 200),
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    let ahead = decisions(&levee, "wide", "allowed", "ahead").await;
    let at_redis = decisions(&levee, "wide", "allowed", "redis").await;
    println!(
        "{SEQUENTIAL} + {CONCURRENT} requests: {ahead} admitted ahead, {at_redis} waited for Redis"
    );
    assert_eq!(at_redis, 1.0, "only the first request waited");
    assert_eq!(ahead, (SEQUENTIAL + CONCURRENT - 1) as f64);
    assert_eq!(decisions_from(&levee, "wide", "fallback").await, 0.0);
    assert_eq!(backend.hits(), SEQUENTIAL + CONCURRENT);

    // Once the charges are in, the bucket holds exactly one charge per request.
    settle(&levee, "flush-1").await;
    let key = bucket_of(&connection, "wide");
    assert_charged(&connection, &key, (SEQUENTIAL + CONCURRENT) as i64);
    assert_eq!(ahead_overruns(&levee).await, 0.0);
    let calls = evalsha_calls(&connection);
    println!("{calls} EVALSHA calls in all");
    assert!(
        calls < (SEQUENTIAL + CONCURRENT) as u64,
        "charges were merged into fewer script calls than requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn near_the_limit_every_decision_waits_and_the_burst_is_exact() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    // admit_ahead_above 0.5 (the default), 0, 0.75, and the default for a fleet (1: off):
    // ahead while more than half the burst (5 of 10) is left, while any token is, while
    // more than 7.5 are (9 and 8 left: 2 requests), or never.
    for (setting, expected_ahead) in [
        ("", 4.0),
        ("admit_ahead_above = 0\n", 9.0),
        ("admit_ahead_above = 0.75\n", 2.0),
        ("instances = 4\n", 0.0),
    ] {
        cli(&["-p", &port, "flushall"]);
        let hits_before = backend.hits();
        let rule = "[limit.ten]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 10\n";
        let levee = Levee::start(&ahead_policy(
            &backend,
            &redis_section(&redis.url(), setting),
            rule,
            "\"ten\"",
        ))
        .await;
        let statuses = statuses(&levee, 30).await;
        let mut expected = vec![200; 10];
        expected.extend([429; 20]);
        assert_eq!(statuses, expected, "{setting:?}");

        // The first request waits (nothing known); then Redis said 9 left: with 0.5, ahead
        // while more than 5 are left less those admitted since (9, 8, 7, 6: 4 requests),
        // then each waits; with 0, ahead down to the last token (9 requests).
        let ahead = decisions(&levee, "ten", "allowed", "ahead").await;
        let allowed_redis = decisions(&levee, "ten", "allowed", "redis").await;
        let limited = decisions(&levee, "ten", "limited", "redis").await
            + decisions(&levee, "ten", "limited", "cache").await;
        println!(
            "{setting:?}: {ahead} ahead, {allowed_redis} admitted by Redis, {limited} refused"
        );
        assert_eq!(ahead, expected_ahead, "{setting:?}");
        assert_eq!(allowed_redis, 10.0 - expected_ahead, "{setting:?}");
        assert_eq!(limited, 20.0, "{setting:?}");
        assert_eq!(decisions(&levee, "ten", "limited", "ahead").await, 0.0);
        assert_eq!(decisions_from(&levee, "ten", "fallback").await, 0.0);

        settle(&levee, "flush-1").await;
        assert_eq!(ahead_overruns(&levee).await, 0.0, "{setting:?}");
        // Ten charges, the refusals none.
        assert_charged(&connection, &bucket_of(&connection, "ten"), 10);
        assert_eq!(
            backend.hits() - hits_before,
            10 + 1,
            "the burst and the flush"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dry_run_rule_with_nothing_left_does_not_make_requests_wait() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    let rule = "[limit.trial]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 3\ndry_run = true\n";
    let levee = Levee::start(&ahead_policy(
        &backend,
        &redis_section(&redis.url(), ""),
        rule,
        "\"trial\"",
    ))
    .await;
    const REQUESTS: usize = 20;
    let statuses = statuses(&levee, REQUESTS).await;
    assert_eq!(statuses, vec![200; REQUESTS], "a dry run refuses nothing");

    // The first request waits (nothing is known of the bucket); Redis says 2 left, and from
    // then on every verdict is given at once: the last two tokens, then "would be refused".
    let allowed_ahead = decisions(&levee, "trial", "allowed", "ahead").await;
    let refused_ahead = decisions(&levee, "trial", "dry_run_limited", "ahead").await;
    println!("{allowed_ahead} allowed and {refused_ahead} would-be refusals ahead");
    assert_eq!(decisions_from(&levee, "trial", "redis").await, 1.0);
    assert_eq!((allowed_ahead, refused_ahead), (2.0, (REQUESTS - 3) as f64));
    assert_eq!(decisions_from(&levee, "trial", "fallback").await, 0.0);

    // Charged in Redis all the same, never past a full bucket, and nothing counted as an
    // overrun: a dry run's excess is not one.
    settle(&levee, "flush-1").await;
    assert_charged(&connection, &bucket_of(&connection, "trial"), 3);
    assert_eq!(ahead_overruns(&levee).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_instance_never_admits_ahead_past_the_burst_even_in_a_rush() {
    // A rush on a bucket nobody asked about yet: the first decisions wait for Redis, and the
    // requests behind them count as taken, so nothing is admitted ahead on the strength of an
    // answer that the queued decisions are about to use up.
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let rule = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 10\n";
    let levee = Levee::start(&ahead_policy(
        &backend,
        &redis_section(&redis.url(), ""),
        rule,
        "\"per_user\"",
    ))
    .await;
    for round in 0..5 {
        let user = format!("rush-{round}");
        let answers =
            futures_util::future::join_all((0..40).map(|_| send_as(&levee, Some(&user)))).await;
        let admitted = answers.iter().filter(|answer| answer.status == 200).count();
        let refused = answers.iter().filter(|answer| answer.status == 429).count();
        if (admitted, refused) != (10, 30) {
            let mut by_source = Vec::new();
            for source in ["ahead", "redis", "cache", "fallback", "local"] {
                for result in ["allowed", "limited"] {
                    let count = decisions(&levee, "per_user", result, source).await;
                    by_source.push(format!("{result} by {source}: {count}"));
                }
            }
            panic!("round {round}: {admitted} admitted, {refused} refused; so far {by_source:?}");
        }
    }
    settle(&levee, "flush-rush").await;
    assert_eq!(ahead_overruns(&levee).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admit_ahead_above_1_makes_every_decision_wait_for_redis() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    for setting in ["admit_ahead_above = 1\n", "admit_ahead_above = 1.0\n"] {
        cli(&["-p", &port, "flushall"]);
        let levee = Levee::start(&ahead_policy(
            &backend,
            &redis_section(&redis.url(), setting),
            GENEROUS,
            "\"wide\"",
        ))
        .await;
        assert_eq!(statuses(&levee, 20).await, [200; 20], "{setting:?}");
        let answers = futures_util::future::join_all((0..20).map(|_| send_as(&levee, None))).await;
        assert!(answers.iter().all(|a| a.status == 200), "{setting:?}");
        assert_eq!(
            decisions(&levee, "wide", "allowed", "redis").await,
            40.0,
            "{setting:?}"
        );
        assert_eq!(
            decisions_from(&levee, "wide", "ahead").await,
            0.0,
            "{setting:?}"
        );
        assert_eq!(decisions_from(&levee, "wide", "fallback").await, 0.0);
        assert_eq!(ahead_overruns(&levee).await, 0.0);
        assert_charged(&connection, &bucket_of(&connection, "wide"), 40);
    }
}

#[test]
fn check_refuses_admit_ahead_above_outside_0_to_1() {
    let policy = |value: &str| {
        format!(
            "[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[redis]\nurl = \"redis://127.0.0.1:9/0\"\nadmit_ahead_above = {value}\n"
        )
    };
    for bad in ["1.5", "-0.1", "2", "nan", "inf"] {
        let stderr = check_fails(&policy(bad));
        assert!(
            stderr.contains("levee.toml:5:21: error: admit_ahead_above must be from 0 to 1"),
            "admit_ahead_above = {bad}:\n{stderr}"
        );
        assert!(stderr.contains("hint:"), "{stderr}");
    }
    for good in ["0", "0.0", "0.5", "1", "1.0"] {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("levee.toml"), policy(good)).expect("write policy");
        let (ok, _, stderr) = levee_check(dir.path());
        assert!(ok, "admit_ahead_above = {good} refused:\n{stderr}");
    }
}

/// Sends `count` requests to `levee` at once; how many were admitted (the rest must be 429).
async fn admitted_of(levee: &Levee, count: usize) -> usize {
    let answers = futures_util::future::join_all((0..count).map(|_| send_as(levee, None))).await;
    for answer in &answers {
        assert!(matches!(answer.status, 200 | 429), "{}", answer.status);
    }
    answers.iter().filter(|a| a.status == 200).count()
}

/// The admissions of rule `shared` counted by `levees`, ahead of Redis and by Redis.
async fn shared_admissions(levees: &[&Levee]) -> (f64, f64) {
    let (mut ahead, mut at_redis) = (0.0, 0.0);
    for levee in levees {
        ahead += decisions(levee, "shared", "allowed", "ahead").await;
        at_redis += decisions(levee, "shared", "allowed", "redis").await;
    }
    (ahead, at_redis)
}

const SHARED_TWENTY: &str = "[limit.shared]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 20\n";

/// Two instances on one bucket (burst 20, a token a minute, so none comes back during the
/// test): every token is admitted once, and every admission past them is an overrun that
/// the instance which admitted it counts. Exactly: a charge that does not fit is capped at a
/// full bucket and each request of it that did not fit is one overrun, so the admissions are
/// the burst plus the overruns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instance_that_admits_ahead_of_another_draining_the_bucket_counts_its_overruns() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    let policy = ahead_policy(
        &backend,
        &redis_section(&redis.url(), ""),
        SHARED_TWENTY,
        "\"shared\"",
    );
    let one = Levee::start(&policy).await;
    let two = Levee::start(&policy).await;

    // `one` learns that 19 of 20 are left; `two` then uses up the rest, one request after
    // the other, usually before `one`'s knowledge is 250 ms old (the freshness an answer
    // keeps for admitting ahead).
    assert_eq!(send_as(&one, None).await.status, 200);
    let learned = std::time::Instant::now();
    let drained = statuses(&two, 22).await;
    assert_eq!(
        drained.iter().filter(|s| **s == 200).count(),
        19,
        "{drained:?}"
    );
    assert_eq!(drained[19..], [429, 429, 429], "{drained:?}");

    // `one` still believes more than half the burst is left: it admits at once, and Redis
    // finds no token for any of those. After the first answer it knows and waits.
    let since = learned.elapsed();
    let burst = admitted_of(&one, 15).await;
    settle(&one, "flush-1").await;
    settle(&two, "flush-2").await;
    let overruns_one = ahead_overruns(&one).await as usize;
    let overruns_two = ahead_overruns(&two).await as usize;
    let (ahead, at_redis) = shared_admissions(&[&one, &two]).await;
    let admitted = 1 + 19 + burst;
    println!(
        "`one` admitted {burst} of 15 {since:?} after it learned the bucket; {ahead} admissions ahead, {at_redis} by Redis; overruns: one {overruns_one}, two {overruns_two}"
    );
    assert_eq!(
        (ahead + at_redis) as usize,
        admitted,
        "every admission counted"
    );
    assert_eq!(
        overruns_two, 0,
        "`two` was alone while it drained the bucket"
    );
    assert_eq!(
        burst, overruns_one,
        "each of `one`'s admissions was an overrun"
    );
    assert_eq!(admitted, 20 + overruns_one);
    // What `one` knew allows 9 admissions ahead (19 less those since, while more than 10).
    assert!(overruns_one <= 9, "{overruns_one}");
    // Knowledge older than 250 ms is not admitted ahead on; the margin covers the time from
    // here to `one`'s first request.
    if since < Duration::from_millis(150) {
        assert!(overruns_one >= 1, "`one` admitted ahead on what it knew");
    } else {
        println!("(`one`'s knowledge may have gone stale: the draining took {since:?})");
    }
    assert_charged(&connection, &bucket_of(&connection, "shared"), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_sharing_a_bucket_admit_the_burst_plus_counted_overruns() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let port = redis.port.to_string();
    let connection = ["-p", port.as_str()];
    let backend = echo_backend().await;
    for setting in ["", "admit_ahead_above = 0\n", "admit_ahead_above = 1\n"] {
        cli(&["-p", &port, "flushall"]);
        let policy = ahead_policy(
            &backend,
            &redis_section(&redis.url(), setting),
            SHARED_TWENTY,
            "\"shared\"",
        );
        let one = Levee::start(&policy).await;
        let two = Levee::start(&policy).await;
        let hits_before = backend.hits();

        // One request each (each learns the bucket's headroom), then rounds of requests at
        // both at once until both refuse.
        let mut admitted = admitted_of(&one, 1).await + admitted_of(&two, 1).await;
        let mut rounds = 0;
        loop {
            rounds += 1;
            let (a, b) = tokio::join!(admitted_of(&one, 15), admitted_of(&two, 15));
            admitted += a + b;
            if a + b == 0 || rounds == 10 {
                break;
            }
        }
        settle(&one, "flush-1").await;
        settle(&two, "flush-2").await;

        let overruns = (ahead_overruns(&one).await + ahead_overruns(&two).await) as usize;
        let (ahead, at_redis) = shared_admissions(&[&one, &two]).await;
        println!(
            "{setting:?}: {admitted} admitted by two instances in {rounds} rounds ({ahead} ahead, {at_redis} by Redis), {overruns} overruns"
        );
        assert_eq!(
            (ahead + at_redis) as usize,
            admitted,
            "every admission counted"
        );
        assert_eq!(
            backend.hits() - hits_before,
            admitted + 2,
            "and the flushes"
        );
        assert_eq!(
            decisions_from(&one, "shared", "fallback").await
                + decisions_from(&two, "shared", "fallback").await,
            0.0
        );
        assert_eq!(
            admitted,
            20 + overruns,
            "{setting:?}: the burst, and past it only counted overruns"
        );
        if setting.contains("= 1") {
            assert_eq!((ahead, overruns), (0.0, 0), "nothing ahead, nothing over");
        }
        // Every token is spent: the bucket is full in Redis.
        assert_charged(&connection, &bucket_of(&connection, "shared"), 20);
    }
}
