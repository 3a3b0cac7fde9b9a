//! Rate limits against a real redis-server (and a real 3-node Redis Cluster) and in-process.

mod common;

use std::time::{Duration, Instant};

use common::*;
use http::Request;

/// Policy: `[redis]` section (or none), limit rules, one route `/limited` using `rules`.
fn limited_policy(
    backend: &Backend,
    server: &str,
    redis: &str,
    limits: &str,
    rules: &str,
) -> String {
    policy_for(
        backend.addr,
        &format!("access_log = false\n{server}"),
        &format!("{redis}\n[identity]\nuser = [\"header:x-user\"]\n{limits}\n[[route]]\nname = \"limited\"\nmatch = {{ path_prefix = \"/limited\" }}\nlimits = [{rules}]\n"),
    )
}

fn redis_section(url: &str, extra: &str) -> String {
    format!("[redis]\nurl = \"{url}\"\ntimeout = \"500ms\"\n{extra}")
}

async fn send_as(levee: &Levee, user: Option<&str>, xff: Option<&str>) -> Answer {
    let mut request = Request::get(levee.url("/limited"));
    if let Some(user) = user {
        request = request.header("x-user", user);
    }
    if let Some(xff) = xff {
        request = request.header("x-forwarded-for", xff);
    }
    send(request.body(full("")).expect("request")).await
}

/// Hammers `/limited` for `seconds` and checks admitted = burst + rate × elapsed, ±1. The
/// decisions fall somewhere inside their requests' round trips, so "elapsed" is bounded by
/// the first answer and the last send (shortest) and by the first send and the last answer
/// (longest): a loaded machine's slow round trips widen the bounds, never fail the check.
async fn check_accuracy(levee: &Levee, rate: f64, burst: f64, seconds: f64) {
    let started = Instant::now();
    let mut admitted = 0u32;
    let mut refused = 0u32;
    let (mut first_done, mut last_sent, mut last_done) = (None, started, started);
    while started.elapsed().as_secs_f64() < seconds {
        last_sent = Instant::now();
        let answer = send_as(levee, None, None).await;
        last_done = Instant::now();
        first_done.get_or_insert(last_done);
        match answer.status {
            200 => admitted += 1,
            429 => refused += 1,
            other => panic!("unexpected status {other}: {}", answer.text()),
        }
    }
    let first_done = first_done.unwrap_or(started);
    let shortest = last_sent
        .saturating_duration_since(first_done)
        .as_secs_f64();
    let longest = (last_done - started).as_secs_f64();
    let (fewest, most) = (burst + rate * shortest, burst + rate * longest);
    assert!(refused > 0, "the traffic was not over the limit");
    let slack = 1.0 + rate * 0.01;
    assert!(
        f64::from(admitted) >= fewest - slack && f64::from(admitted) <= most + slack,
        "admitted {admitted}, expected {fewest:.2}..={most:.2} (burst {burst} + {rate}/s over {shortest:.3}..{longest:.3}s)"
    );
}

const TEN_PER_SECOND: &str = "[limit.steady]\nkey = [\"route\"]\nrate = \"10/s\"\nburst = 5\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accuracy_in_process() {
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        "",
        TEN_PER_SECOND,
        "\"steady\"",
    ))
    .await;
    check_accuracy(&levee, 10.0, 5.0, 1.5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accuracy_on_redis() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        &redis_section(&redis.url(), ""),
        TEN_PER_SECOND,
        "\"steady\"",
    ))
    .await;
    check_accuracy(&levee, 10.0, 5.0, 1.5).await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains(
            "levee_ratelimit_decisions_total{rule=\"steady\",result=\"limited\",source=\"redis\"}"
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accuracy_on_a_redis_cluster() {
    let dir = tempfile::tempdir().expect("dir");
    let cluster = RedisCluster::start(dir.path()).await;
    let nodes = cluster.toml_list();
    let redis = format!("[redis]\ncluster = [{nodes}]\ntimeout = \"500ms\"\n");
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        &redis,
        TEN_PER_SECOND,
        "\"steady\"",
    ))
    .await;
    check_accuracy(&levee, 10.0, 5.0, 1.5).await;

    // Rules keyed by different identities live in different slots; a refusal by one still
    // leaves the other's tokens alone (refunded).
    let two_rules = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 2\n[limit.per_ip]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 5\n";
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        &redis.replace("levee:", "x"),
        two_rules,
        "\"per_user\", \"per_ip\"",
    ))
    .await;
    denied_rule_consumes_nothing_else(&levee, "on a Redis Cluster").await;
}

/// A request whose rules live on two cluster nodes, one of which does not answer (frozen,
/// then gone): the rules on the other node are charged by its script, and given back, since
/// Redis did not admit the request whole (the fallback decided it), also when the client has
/// left meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_that_fails_leaves_the_other_nodes_tokens_alone() {
    let dir = tempfile::tempdir().expect("dir");
    let mut cluster = RedisCluster::start(dir.path()).await;
    let nodes = cluster.toml_list();
    // Redis stays "up" throughout: every call is tried, none is skipped by the health breaker.
    let redis =
        format!("[redis]\ncluster = [{nodes}]\ntimeout = \"300ms\"\nfailures_to_open = 100\n");
    let two_rules = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 50\n[limit.per_ip]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 50\n";
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        &redis,
        two_rules,
        "\"per_user\", \"per_ip\"",
    ))
    .await;
    let ip_key = "levee:rl:{127.0.0.1}:per_ip:127.0.0.1";
    let ip_node = cluster.owner(ip_key);
    let (user, user_key, user_node) = (0..)
        .map(|i| {
            let user = format!("user{i}");
            let key = user_key(&user);
            let node = cluster.owner(&key);
            (user, key, node)
        })
        .find(|(_, _, node)| *node != ip_node)
        .expect("some user's bucket is on another node");

    assert_eq!(send_as(&levee, Some(&user), None).await.status, 200);
    assert_eq!(cluster.cli(user_node, &["EXISTS", &user_key]).trim(), "1");
    let charged = cluster.cli(ip_node, &["GET", ip_key]);
    assert!(!charged.trim().is_empty(), "the IP's bucket is kept");
    let ip_port = cluster.ports[ip_node];
    let ip_bucket = (ip_port, ip_key, charged.as_str());

    // Frozen: the user's group overruns the timeout while the IP's group admits.
    cluster.pause(user_node, true);
    decided_in_process_and_given_back(&levee, &user, ip_bucket, "after a timeout").await;
    // A client that gives up while its decision waits: the decision finishes without it.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(50),
        send_as(&levee, Some(&user), None),
    )
    .await;
    assert!(gave_up.is_err(), "the decision waits for the frozen node");
    given_back(ip_bucket, "after the client left").await;
    cluster.pause(user_node, false);

    // Gone: the user's group fails; the IP's is given back again.
    cluster.kill(user_node);
    decided_in_process_and_given_back(&levee, &user, ip_bucket, "after a failure").await;
    let ip_decisions = |metrics: &str, source: &str| {
        metric_value(
            metrics,
            &format!("levee_ratelimit_decisions_total{{rule=\"per_ip\",result=\"allowed\",source=\"{source}\"}}"),
        )
    };
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        (
            ip_decisions(&metrics, "redis"),
            ip_decisions(&metrics, "fallback")
        ),
        (1.0, 2.0),
        "{metrics}"
    );

    // A node that lost its scripts (restarted, or flushed) while another node is gone: the
    // script goes whole to the node that lacks it, not to every node, and Redis decides.
    redis_cli(ip_port, &["SCRIPT", "FLUSH"]);
    let other = (0..)
        .map(|i| format!("other{i}"))
        .find(|user| cluster.owner(&self::user_key(user)) == ip_node)
        .expect("some user's bucket is on the IP's node");
    assert_eq!(send_as(&levee, Some(&other), None).await.status, 200);
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(ip_decisions(&metrics, "redis"), 2.0, "{metrics}");
}

/// Redis over TLS (`rediss://`) with a CA of its own, asking for a client certificate (Redis's
/// default): limits are shared through it, and follow their fallback when it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_shared_through_a_redis_that_speaks_tls() {
    let dir = tempfile::tempdir().expect("dir");
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).expect("certs dir");
    make_certificates(&certs);
    let mut redis = RedisServer::start_tls(dir.path(), &certs).await;
    let file = |name: &str| certs.join(name).display().to_string();
    let section = format!(
        "[redis]\nurl = \"rediss://127.0.0.1:{}/0\"\ntimeout = \"500ms\"\nca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        redis.port,
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let per_user = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 8\n";
    let backend = echo_backend().await;
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        &section,
        per_user,
        "\"per_user\"",
    ))
    .await;
    let mut statuses = Vec::new();
    for _ in 0..10 {
        statuses.push(send_as(&levee, Some("alice"), None).await.status);
    }
    assert_eq!(statuses, [[200; 8].as_slice(), &[429, 429]].concat());
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    let decided = |result: &str, source: &str| {
        metric_value(
            &metrics,
            &format!("levee_ratelimit_decisions_total{{rule=\"per_user\",result=\"{result}\",source=\"{source}\"}}"),
        )
    };
    // Far from the limit, requests are admitted ahead of Redis's answer: levee's own batched
    // connection speaks TLS too.
    let ahead = decided("allowed", "ahead");
    assert!(ahead >= 1.0, "{metrics}");
    assert_eq!(decided("allowed", "redis") + ahead, 8.0, "{metrics}");
    // A refusal Redis gave is remembered for the next request on the bucket (`cache`).
    let limited = decided("limited", "redis") + decided("limited", "cache");
    assert_eq!(limited, 2.0, "{metrics}");

    // Redis gone: the rule follows its on_redis_error (`local` by default), as over a plain
    // connection.
    redis.kill();
    for _ in 0..3 {
        assert_eq!(send_as(&levee, Some("bob"), None).await.status, 200);
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    let fallback = metric_value(
        &metrics,
        "levee_ratelimit_decisions_total{rule=\"per_user\",result=\"allowed\",source=\"fallback\"}",
    );
    assert_eq!(fallback, 3.0, "{metrics}");
}

/// Renewed certificates, same paths, same policy text: the reload is a change, and makes a new
/// Redis connection with the new files.
#[test]
fn redis_tls_files_renewed_in_place_are_a_change_for_reload() {
    let (first, second) = (
        tempfile::tempdir().expect("dir"),
        tempfile::tempdir().expect("dir"),
    );
    make_certificates(first.path());
    make_certificates(second.path());
    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::write(
        policy_dir.path().join("levee.toml"),
        "[redis]\nurl = \"rediss://127.0.0.1:6379\"\nca_file = \"ca.pem\"\ncert_file = \"client.pem\"\nkey_file = \"client.key\"\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[[route]]\nname = \"a\"\nupstream = \"app\"\n",
    )
    .expect("policy");
    let install = |from: &std::path::Path| {
        for name in ["ca.pem", "client.pem", "client.key"] {
            std::fs::copy(from.join(name), policy_dir.path().join(name)).expect("copy");
        }
    };
    install(first.path());
    let running = levee::config::load_dir(policy_dir.path(), None).expect("compiles");
    install(second.path());
    let reloaded = levee::config::load_dir(policy_dir.path(), Some(&running)).expect("compiles");
    assert_ne!(
        running.hash, reloaded.hash,
        "the reload is not skipped as unchanged"
    );
    let store = |policy: &levee::config::Policy| policy.redis.clone().expect("redis");
    assert!(
        !std::sync::Arc::ptr_eq(&store(&running), &store(&reloaded)),
        "a new connection with the new files"
    );
}

#[test]
fn check_explains_what_redis_sentinel_needs() {
    let policy = |redis: &str| {
        format!("{redis}\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[[route]]\nname = \"a\"\nupstream = \"app\"\n")
    };
    let stderr = check_fails(&policy(
        "[redis]\ntimeout = \"50ms\"\n[redis.sentinel]\nnodes = [\"redis+unix:///run/sentinel.sock\"]\nusername = \"levee\"\ndb = -1",
    ));
    for expected in [
        "levee.toml:4:9: error: sentinel `redis+unix:///run/sentinel.sock` is not a redis:// or rediss:// URL",
        "levee.toml:3:1: error: [redis.sentinel] needs master",
        "levee.toml:5:12: error: username without password",
        "levee.toml:6:6: error: db must be 0 or more",
    ] {
        assert!(stderr.contains(expected), "{expected} in {stderr}");
    }
    let stderr = check_fails(&policy(
        "[redis]\nurl = \"redis://127.0.0.1:6379\"\n[redis.sentinel]\nnodes = [\"redis://10.0.0.5:26379\"]\nmaster = \"mymaster\"",
    ));
    assert!(
        stderr.contains("error: [redis] names more than one of url, cluster and [redis.sentinel]"),
        "{stderr}"
    );
    let stderr = check_fails(&policy(
        "[redis]\n[redis.sentinel]\nnodes = [\"redis://10.0.0.5:26379/2\"]\nmaster = \"mymaster\"",
    ));
    assert!(
        stderr.contains(
            "levee.toml:3:9: error: sentinel `redis://10.0.0.5:26379/2` names a database"
        ),
        "{stderr}"
    );
    let stderr = check_fails(&policy(
        "[redis]\n[redis.sentinel]\nnodes = [\"rediss://10.0.0.5:26379/#insecure\"]\nmaster = \"mymaster\"",
    ));
    assert!(
        stderr.contains("asks for TLS without checking certificates"),
        "{stderr}"
    );
    let stderr = check_fails(&policy(
        "[redis]\nca_file = \"ca.pem\"\n[redis.sentinel]\nnodes = [\"redis://10.0.0.5:26379\"]\nmaster = \"mymaster\"",
    ));
    assert!(
        stderr.contains(
            "levee.toml:2:11: error: ca_file, cert_file and key_file are for Redis over TLS"
        ),
        "{stderr}"
    );
    let stderr = check_fails(&policy(
        "[redis]\n[redis.sentinel]\nnodes = [\"rediss://10.0.0.5:26379\", \"redis://10.0.0.6:26379\"]\nmaster = \"mymaster\"",
    ));
    assert!(
        stderr
            .contains("levee.toml:3:9: error: some sentinels are rediss:// (TLS) and some are not"),
        "{stderr}"
    );
}

#[test]
fn check_explains_what_redis_over_tls_needs() {
    let policy = |redis: &str| {
        format!("{redis}\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[[route]]\nname = \"a\"\nupstream = \"app\"\n")
    };
    let stderr = check_fails(&policy(
        "[redis]\nurl = \"redis://127.0.0.1:6379\"\nca_file = \"ca.pem\"",
    ));
    assert!(
        stderr.contains(
            "levee.toml:3:11: error: ca_file, cert_file and key_file are for Redis over TLS"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("rediss://"), "{stderr}");
    let stderr = check_fails(&policy("[redis]\nurl = \"rediss://127.0.0.1:6379\"\nca_file = \"missing.pem\"\ncert_file = \"client.pem\""));
    assert!(
        stderr.contains("levee.toml:3:11: error: cannot read CA file"),
        "{stderr}"
    );
    assert!(stderr.contains("missing.pem"), "{stderr}");
    assert!(
        stderr.contains("levee.toml:4:13: error: cannot read certificate file"),
        "{stderr}"
    );
    assert!(
        stderr.contains("cert_file and key_file go together"),
        "{stderr}"
    );

    // An X.509 version 1 certificate (no extensions), which TLS refuses.
    let dir = tempfile::tempdir().expect("dir");
    make_certificates(dir.path());
    sign_certificate(dir.path(), "client.csr", "v1.pem", None);
    let file = |name: &str| dir.path().join(name).display().to_string();
    let stderr = check_fails(&policy(&format!(
        "[redis]\nurl = \"rediss://127.0.0.1:6379\"\ncert_file = \"{}\"\nkey_file = \"{}\"",
        file("v1.pem"),
        file("client.key")
    )));
    assert!(
        stderr.contains("levee.toml:3:13: error: certificate file")
            && stderr.contains("is an X.509 version 1 certificate"),
        "{stderr}"
    );

    // A certificate and the key of another: each reads well, and the pair failed only when
    // levee connected.
    let stderr = check_fails(&policy(&format!(
        "[redis]\nurl = \"rediss://127.0.0.1:6379\"\ncert_file = \"{}\"\nkey_file = \"{}\"",
        file("client.pem"),
        file("server.key")
    )));
    assert!(
        stderr.contains("levee.toml:3:13: error: cert_file and key_file:"),
        "{stderr}"
    );

    // A CA file cut short in a rotation: still PEM, no certificate TLS can use.
    let ca = std::fs::read_to_string(dir.path().join("ca.pem")).expect("ca");
    let mut lines: Vec<&str> = ca.lines().collect();
    lines.remove(3);
    std::fs::write(dir.path().join("cut.pem"), lines.join("\n") + "\n").expect("write");
    let stderr = check_fails(&policy(&format!(
        "[redis]\nurl = \"rediss://127.0.0.1:6379\"\nca_file = \"{}\"",
        file("cut.pem")
    )));
    assert!(
        stderr.contains("holds a certificate (number 1) TLS cannot use"),
        "{stderr}"
    );
    // And as an https upstream's CA.
    let stderr = check_fails(&format!(
        "[upstream.app]\nurl = \"https://127.0.0.1:9\"\nca_files = [\"{}\"]\n[[route]]\nname = \"a\"\nupstream = \"app\"\n",
        file("cut.pem")
    ));
    assert!(
        stderr.contains("holds a certificate (number 1) TLS cannot use"),
        "{stderr}"
    );

    // CA files on an upstream reached without TLS do nothing: said, not refused.
    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::write(
        policy_dir.path().join("levee.toml"),
        format!(
            "[upstream.app]\nurl = \"http://127.0.0.1:9\"\nca_files = [\"{}\"]\n",
            file("ca.pem")
        ),
    )
    .expect("policy");
    let (ok, stdout, stderr) = levee_check(policy_dir.path());
    assert!(ok, "{stdout}{stderr}");
    assert!(
        format!("{stdout}{stderr}")
            .contains("levee.toml:3:12: warning: ca_files does nothing here"),
        "{stdout}{stderr}"
    );
}

/// levee with one rule per user (`per_user`) on `cluster`, whose nodes' breakers open at two
/// failures and stay open an hour.
async fn per_user_levee_on(cluster: &RedisCluster, backend: &Backend) -> Levee {
    let nodes = cluster.toml_list();
    let redis = format!(
        "[redis]\ncluster = [{nodes}]\ntimeout = \"200ms\"\nfailures_to_open = 2\ncooldown = \"1h\"\n"
    );
    per_user_levee(backend, &redis).await
}

/// One rule per user (`per_user`, 50 requests, then one a minute) on the `/limited` route,
/// with `redis` as the policy's Redis sections.
async fn per_user_levee(backend: &Backend, redis: &str) -> Levee {
    let per_user = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 50\n";
    Levee::start(&limited_policy(
        backend,
        "",
        redis,
        per_user,
        "\"per_user\"",
    ))
    .await
}

/// `[redis]` with `settings`, then `[redis.sentinel]` for `group`'s master with `login`,
/// then `rest`. A second sentinel listed is down (nothing listens on port 9): levee follows
/// the one that answers.
fn sentinel_redis(group: &RedisSentinel, settings: &str, login: &str, rest: &str) -> String {
    format!(
        "[redis]\n{settings}[redis.sentinel]\nnodes = [\"{}\", \"redis://127.0.0.1:9\"]\nmaster = \"{SENTINEL_MASTER}\"\n{login}{rest}",
        group.sentinel_url()
    )
}

/// Sends as `user` (each answered 200) until `server` holds the user's bucket: a decision
/// that reached that server.
async fn decided_on(levee: &Levee, server: &RedisServer, user: &str) {
    let what = format!(
        "a decision for {user} by the server on port {}",
        server.port
    );
    eventually(Duration::from_secs(10), &what, || async {
        assert_eq!(send_as(levee, Some(user), None).await.status, 200);
        server.cli(&["EXISTS", &user_key(user)]).trim() == "1"
    })
    .await;
}

/// A queue route `notify` (POST /notify…) that always queues, and workers that wait an
/// hour: the jobs stay in the stream for the test to see.
const NOTIFY_QUEUE: &str = "[queue]\npoll_interval = \"1h\"\n[[route]]\nname = \"notify\"\nmatch = { method = [\"POST\"], path_prefix = \"/notify\" }\nalways_queue = true\n";

/// Waits until levee has read the cluster's slot map (read once the first decision has
/// connected): /status then lists the three masters.
async fn slot_map_read(levee: &Levee) {
    eventually(Duration::from_secs(5), "the slot map read", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["redis"]["nodes"].as_array().map(Vec::len) == Some(3)
    })
    .await;
}

/// `per_user`'s requests allowed, decided by `source`.
fn per_user_allowed(metrics: &str, source: &str) -> f64 {
    metric_value(
        metrics,
        &format!("levee_ratelimit_decisions_total{{rule=\"per_user\",result=\"allowed\",source=\"{source}\"}}"),
    )
}

/// The bucket of `per_user` for `user`: the value hashed, as a credential's is (`#` and the
/// first 12 bytes of its SHA-256, in hex).
fn user_key(user: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(user.as_bytes());
    let hex: String = digest[..12]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    format!("levee:rl:{{#{hex}}}:per_user:#{hex}")
}

/// One node out opens that node's health breaker only: rules whose buckets it holds follow
/// `on_redis_error` (without waiting once it is open), and the other nodes go on deciding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_that_fails_opens_only_its_own_breaker() {
    let dir = tempfile::tempdir().expect("dir");
    let cluster = RedisCluster::start(dir.path()).await;
    let backend = echo_backend().await;
    let levee = per_user_levee_on(&cluster, &backend).await;
    let out = "alice";
    let out_node = cluster.owner(&user_key(out));
    let fine = (0..)
        .map(|i| format!("bob{i}"))
        .find(|user| cluster.owner(&user_key(user)) != out_node)
        .expect("some user's bucket is on another node");
    assert_eq!(send_as(&levee, Some(out), None).await.status, 200);
    slot_map_read(&levee).await;

    cluster.pause(out_node, true);
    for _ in 0..3 {
        let answer = send_as(&levee, Some(out), None).await;
        assert_eq!(
            answer.status, 200,
            "decided in-process (on_redis_error = local)"
        );
    }
    for _ in 0..3 {
        assert_eq!(send_as(&levee, Some(&fine), None).await.status, 200);
    }
    cluster.pause(out_node, false);

    let metrics = get(&levee.admin_url("/metrics")).await.text();
    // The first request and `fine`'s three by Redis; `out`'s three in-process: two timed
    // out, which opened its node's breaker, and the third did not call Redis.
    assert_eq!(
        (
            per_user_allowed(&metrics, "redis"),
            per_user_allowed(&metrics, "fallback")
        ),
        (4.0, 3.0),
        "{metrics}"
    );
    let calls = metric_value(&metrics, "levee_redis_latency_seconds_count");
    assert_eq!(
        calls, 6.0,
        "the third request of `out` did not call Redis: {metrics}"
    );
    let node_up = |node: usize| {
        metric_value(
            &metrics,
            &format!(
                "levee_redis_node_up{{node=\"127.0.0.1:{}\"}}",
                cluster.ports[node]
            ),
        )
    };
    assert_eq!(node_up(out_node), 0.0, "{metrics}");
    assert_eq!(node_up(cluster.owner(&user_key(&fine))), 1.0, "{metrics}");
    // Redis as a whole is not up while a master node is out (status says "PARTLY DOWN").
    assert_eq!(metric_value(&metrics, "levee_redis_up"), 0.0, "{metrics}");
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["redis"]["up"], false, "{status}");
    let down: Vec<&serde_json::Value> = status["redis"]["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|node| node["up"] == false)
        .collect();
    assert_eq!(down.len(), 1, "{status}");
    assert_eq!(
        down[0]["node"],
        format!("127.0.0.1:{}", cluster.ports[out_node])
    );
}

/// A master that dies and whose replica takes over: levee finds the new master in the
/// cluster's slot map and decides in Redis again, without waiting out the old master's
/// cool-down (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_is_followed_without_waiting_out_the_cooldown() {
    let dir = tempfile::tempdir().expect("dir");
    let mut cluster = RedisCluster::start_with_replicas(dir.path()).await;
    let backend = echo_backend().await;
    let levee = per_user_levee_on(&cluster, &backend).await;
    let key = user_key("alice");
    let master = cluster.owner(&key);
    let replica = cluster
        .replica_of(master)
        .expect("the master has a replica");
    assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
    slot_map_read(&levee).await;

    cluster.kill(master);
    for _ in 0..2 {
        let answer = send_as(&levee, Some("alice"), None).await;
        assert_eq!(
            answer.status, 200,
            "decided in-process (on_redis_error = local)"
        );
    }
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["redis"]["up"], false, "{status}");
    assert_eq!(
        cluster
            .cli(replica, &["CLUSTER", "FAILOVER", "TAKEOVER"])
            .trim(),
        "OK"
    );
    // Until the nodes agree, calls to the new master may fail too (and open its breaker for
    // the hour of `cooldown` here): what is tested is how levee finds the new master after.
    cluster.agreed_master(replica, &[master]).await;

    eventually(
        Duration::from_secs(20),
        "alice decided by Redis again",
        || async {
            let from_redis = || async {
                per_user_allowed(&get(&levee.admin_url("/metrics")).await.text(), "redis")
            };
            let before = from_redis().await;
            // In-process meanwhile: its share of the rate may run out (429), which is fine.
            send_as(&levee, Some("alice"), None).await;
            from_redis().await > before
        },
    )
    .await;
    assert_eq!(
        cluster.cli(replica, &["EXISTS", &key]).trim(),
        "1",
        "charged on the new master"
    );
    let status = get(&levee.admin_url("/status")).await.json();
    let new_master = serde_json::json!({
        "node": format!("127.0.0.1:{}", cluster.ports[replica]),
        "up": true,
    });
    let listed = status["redis"]["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(listed.contains(&new_master), "{status}");
    assert_eq!(
        status["redis"]["up"], true,
        "the dead master is no longer listed: {status}"
    );
}

/// A node that answers `CLUSTERDOWN` (here: its slot unassigned, as while a cluster's nodes
/// agree on a failover) is asked once more within the call's `timeout`, not after redis-rs's
/// own wait of over a second: the request falls back with Redis's reason for the operator to
/// read (it timed out before, and `/status` said "did not answer"), and such answers count
/// against the node as any failure does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_that_answers_clusterdown_is_reported_with_its_reason() {
    let dir = tempfile::tempdir().expect("dir");
    let cluster = RedisCluster::start(dir.path()).await;
    let backend = echo_backend().await;
    let levee = per_user_levee_on(&cluster, &backend).await;
    let key = user_key("alice");
    let owner = cluster.owner(&key);
    assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
    slot_map_read(&levee).await;
    let slot = cluster.cli(owner, &["CLUSTER", "KEYSLOT", &key]);

    assert_eq!(
        cluster
            .cli(owner, &["CLUSTER", "DELSLOTS", slot.trim()])
            .trim(),
        "OK"
    );
    let answer = send_as(&levee, Some("alice"), None).await;
    assert_eq!(
        answer.status, 200,
        "decided in-process (on_redis_error = local)"
    );
    let status = get(&levee.admin_url("/status")).await.json();
    let last_error = status["redis"]["last_error"].as_str().unwrap_or_default();
    assert!(last_error.contains("ClusterDown"), "{status}");

    assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(per_user_allowed(&metrics, "fallback"), 2.0, "{metrics}");
    let owner_up = format!(
        "levee_redis_node_up{{node=\"127.0.0.1:{}\"}}",
        cluster.ports[owner]
    );
    assert_eq!(
        metric_value(&metrics, &owner_up),
        0.0,
        "two failures open the node's breaker: {metrics}"
    );
}

/// Sends one request as `user`, whose bucket's node is out: it is decided in-process, and
/// the IP's bucket, on a node that answered and charged it, is given back.
async fn decided_in_process_and_given_back(
    levee: &Levee,
    user: &str,
    ip_bucket: (u16, &str, &str),
    what: &str,
) {
    let answer = send_as(levee, Some(user), None).await;
    assert_eq!(
        answer.status, 200,
        "decided in-process (on_redis_error = local), {what}"
    );
    given_back(ip_bucket, what).await;
}

/// Waits until the IP's bucket `(port, key)` holds `charged` again.
async fn given_back((port, key, charged): (u16, &str, &str), what: &str) {
    eventually(
        Duration::from_secs(5),
        &format!("the IP's token given back {what}"),
        || async move { redis_cli(port, &["GET", key]) == charged },
    )
    .await;
}

async fn denied_rule_consumes_nothing_else(levee: &Levee, store: &str) {
    let statuses: Vec<u16> =
        futures_util::future::join_all((0..2).map(|_| send_as(levee, Some("alice"), None)))
            .await
            .iter()
            .map(|a| a.status)
            .collect();
    assert_eq!(statuses, [200, 200], "the burst of 2, {store}");
    for _ in 0..8 {
        let answer = send_as(levee, Some("alice"), None).await;
        assert_eq!(answer.status, 429);
        assert!(
            answer
                .header("ratelimit")
                .is_some_and(|v| v.starts_with("\"per_user\"")),
            "{:?}",
            answer.headers
        );
        // `t=` is when the bucket is full again (two minutes out), not when the next request
        // may pass (one minute), on refusals Redis gave and on those remembered from it alike.
        let full_in: u64 = answer
            .header("ratelimit")
            .and_then(|v| v.rsplit("t=").next())
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        assert!(full_in > 90, "{:?}, {store}", answer.headers);
    }
    // The IP used 2 of its 5 tokens (alice's refusals took none): bob and carol get 3 more.
    let mut others = Vec::new();
    for user in ["bob", "bob", "carol", "carol"] {
        let answer = send_as(levee, Some(user), None).await;
        others.push((
            answer.status,
            answer
                .header("ratelimit")
                .unwrap_or("")
                .split(';')
                .next()
                .unwrap_or("")
                .to_string(),
        ));
    }
    let statuses: Vec<u16> = others.iter().map(|(status, _)| *status).collect();
    assert_eq!(statuses, [200, 200, 200, 429], "{store}");
    assert_eq!(
        others[3].1, "\"per_ip\"",
        "the last refusal is the IP's, {store}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_by_one_rule_consumes_no_tokens_of_the_others() {
    let two_rules = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 2\n[limit.per_ip]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 5\n";
    let backend = echo_backend().await;
    let in_process = Levee::start(&limited_policy(
        &backend,
        "",
        "",
        two_rules,
        "\"per_user\", \"per_ip\"",
    ))
    .await;
    denied_rule_consumes_nothing_else(&in_process, "in-process").await;

    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let on_redis = Levee::start(&limited_policy(
        &backend,
        "",
        &redis_section(&redis.url(), ""),
        two_rules,
        "\"per_user\", \"per_ip\"",
    ))
    .await;
    denied_rule_consumes_nothing_else(&on_redis, "on Redis").await;
}

/// Both rules of a route refuse: every refusal names the one that refuses longest, also
/// when it comes from the refusals levee remembers rather than from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_by_two_rules_name_the_longer_wait() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let rules = "[limit.quick]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 1\n[limit.slow]\nkey = [\"ip\"]\nrate = \"1/hour\"\nburst = 1\n";
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        &redis_section(&redis.url(), ""),
        rules,
        "\"quick\", \"slow\"",
    ))
    .await;
    assert_eq!(send_as(&levee, None, None).await.status, 200);
    for attempt in ["decided by Redis", "remembered", "remembered again"] {
        let refused = send_as(&levee, None, None).await;
        assert_eq!(refused.status, 429, "{attempt}");
        let wait: u64 = refused
            .header("retry-after")
            .and_then(|value| value.parse().ok())
            .expect("retry-after");
        assert!(wait > 3500, "{attempt}: retry-after {wait}");
        assert!(
            refused
                .header("ratelimit")
                .is_some_and(|field| field.starts_with("\"slow\"")),
            "{attempt}: {:?}",
            refused.header("ratelimit")
        );
    }
    assert_eq!(backend.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_limit_through_redis() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let rule = "[limit.shared]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 10\n";
    let policy = limited_policy(
        &backend,
        "",
        &redis_section(&redis.url(), ""),
        rule,
        "\"shared\"",
    );
    let first = Levee::start(&policy).await;
    let second = Levee::start(&policy).await;
    let mut admitted = 0;
    for i in 0..30 {
        let levee = if i % 2 == 0 { &first } else { &second };
        if send_as(levee, None, None).await.status == 200 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10, "two instances must share one bucket of 10");
    assert_eq!(backend.hits(), 10);
}

/// An IPv6 home line holds a /56 (or a /48) of /64s and its router can send from any of
/// them: keyed by /64, a login rule gave it 256 buckets. `ipv6_prefix = 56` holds it to one,
/// while the default keeps each /64 its own client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_keys_ipv6_clients_by_the_network_it_names() {
    let backend = echo_backend().await;
    let admitted = |bits: &'static str| {
        let backend = &backend;
        async move {
            let rule =
                format!("[limit.login]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 3\n{bits}");
            let levee = Levee::start(&limited_policy(backend, "", "", &rule, "\"login\"")).await;
            let mut admitted = 0;
            // Ten /64s of one /56, one address each (through the trusted front on loopback).
            for subnet in 0..10 {
                let client = format!("2001:db8:1:2{subnet:02x}::{}", subnet + 1);
                if send_as(&levee, None, Some(&client)).await.status == 200 {
                    admitted += 1;
                }
            }
            admitted
        }
    };
    assert_eq!(admitted("").await, 10, "each /64 its own bucket by default");
    assert_eq!(
        admitted("ipv6_prefix = 56\n").await,
        3,
        "the /56 one bucket of 3"
    );
}

/// Latin-1 user names, as a legacy app's header carries them (not UTF-8): two users, two
/// buckets, through levee's own HTTP parser.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_ids_that_are_not_utf8_are_each_their_own_bucket() {
    let backend = echo_backend().await;
    let rules = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 1\n";
    let levee = Levee::start(&limited_policy(&backend, "", "", rules, "\"per_user\"")).await;
    let as_user = |user: &'static [u8]| {
        let request = Request::get(levee.url("/limited"))
            .header(
                "x-user",
                http::HeaderValue::from_bytes(user).expect("value"),
            )
            .body(full(""))
            .expect("request");
        send(request)
    };
    assert_eq!(as_user(b"jos\xe9").await.status, 200);
    assert_eq!(as_user(b"jos\xe9").await.status, 429, "the same user again");
    assert_eq!(as_user(b"jos\xe8").await.status, 200, "another user");
}

/// Rule names are the operator's own words: quoted and escaped in the structured fields,
/// escaped in a JSON body, and fields left out for a name no structured field can carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_names_with_quotes_or_beyond_ascii_keep_fields_and_bodies_well_formed() {
    let backend = echo_backend().await;
    let rules = "[limit.'say \"hi\"']\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 1\n[limit.\"发帖\"]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 1\n";
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!("{rules}[[route]]\nname = \"quoted\"\nmatch = {{ path = \"/quoted\" }}\nlimits = ['say \"hi\"']\n[[route]]\nname = \"post\"\nmatch = {{ path = \"/post\" }}\nlimits = [\"发帖\"]\n"),
    ))
    .await;
    let refuse = |path: &'static str| {
        let request = Request::get(levee.url(path))
            .header("accept", "application/json")
            .body(full(""))
            .expect("request");
        send(request)
    };
    assert_eq!(refuse("/quoted").await.status, 200);
    let quoted = refuse("/quoted").await;
    assert_eq!(quoted.status, 429);
    assert_eq!(
        quoted.header("ratelimit-policy"),
        Some("\"say \\\"hi\\\"\";q=1;w=60")
    );
    assert_eq!(quoted.json()["rule"], "say \"hi\"");

    assert_eq!(refuse("/post").await.status, 200);
    let post = refuse("/post").await;
    assert_eq!(post.status, 429);
    assert_eq!(post.header("ratelimit-policy"), None);
    assert_eq!(post.header("ratelimit"), None);
    assert!(post.header("retry-after").is_some());
    assert_eq!(post.json()["rule"], "发帖");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_retry_after_and_ietf_ratelimit_fields() {
    let backend = echo_backend().await;
    let rules = "[limit.login]\nkey = [\"ip\"]\nrate = \"0.2/s\"\nburst = 2\nheaders_on_allow = true\nbody_html = \"<p>请稍候 {retry_after} 秒</p>\"\n";
    let levee = Levee::start(&limited_policy(&backend, "", "", rules, "\"login\"")).await;
    let first = send_as(&levee, None, None).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("ratelimit-policy"), Some("\"login\";q=2;w=10"));
    assert_eq!(first.header("ratelimit"), Some("\"login\";r=1;t=5"));
    assert_eq!(send_as(&levee, None, None).await.status, 200);

    let html = send_as(&levee, None, None).await;
    assert_eq!(html.status, 429);
    assert_eq!(html.header("retry-after"), Some("5"));
    assert_eq!(html.header("ratelimit-policy"), Some("\"login\";q=2;w=10"));
    assert_eq!(html.header("ratelimit"), Some("\"login\";r=0;t=10"));
    assert_eq!(
        html.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(html.text(), "<p>请稍候 5 秒</p>");

    let request = Request::get(levee.url("/limited"))
        .header("accept", "application/json")
        .body(full(""))
        .expect("request");
    let json = send(request).await;
    assert_eq!(json.status, 429);
    assert_eq!(json.json()["rule"], "login");
    assert_eq!(json.json()["retry_after"], 5);
    assert_eq!(backend.hits(), 2);
}

/// levee's own 429 page says the wait as its other pages do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_429_page_says_when_to_come_back_in_words() {
    let backend = echo_backend().await;
    let rules = "[limit.login]\nkey = [\"ip\"]\nrate = \"0.2/s\"\nburst = 1\n";
    let levee = Levee::start(&limited_policy(&backend, "", "", rules, "\"login\"")).await;
    assert_eq!(send_as(&levee, None, None).await.status, 200);
    let refused = send_as(&levee, None, None).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("5"));
    assert_eq!(refused.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(
        refused.text(),
        visitor_page("Too many requests", "Please try again in 5 seconds.")
    );
}

/// A route may list several rules: the access line of a refusal names the one that refused
/// (it said `error="rate_limited"` alone, where nginx's log names the zone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_of_a_refusal_names_its_rule() {
    let log = levee_log();
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "",
        "[limit.pages]\nkey = \"ip\"\nrate = \"1/min\"\nburst = 5\n[limit.api]\nkey = \"ip\"\nrate = \"1/min\"\nburst = 1\n[[route]]\nname = \"limited\"\nmatch = { path_prefix = \"/limited\" }\nlimits = [\"pages\", \"api\"]\n",
    ))
    .await;
    assert_eq!(send_as(&levee, None, None).await.status, 200);
    assert_eq!(send_as(&levee, None, None).await.status, 429);
    eventually(Duration::from_secs(2), "the refusal logged", || async {
        !log.lines_with("status=429").is_empty()
    })
    .await;
    let refused = log.lines_with("status=429");
    assert!(
        refused[0].contains("error=\"rate_limited\" rule=\"api\""),
        "{refused:?}"
    );
    let admitted = log.lines_with("status=200");
    assert!(
        !admitted.is_empty() && !admitted[0].contains("rule="),
        "{admitted:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_rules_never_block_but_are_counted() {
    let backend = echo_backend().await;
    let rules = "[limit.trial]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 1\ndry_run = true\n";
    let levee = Levee::start(&limited_policy(&backend, "", "", rules, "\"trial\"")).await;
    for _ in 0..5 {
        assert_eq!(send_as(&levee, None, None).await.status, 200);
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(metrics.contains("levee_ratelimit_decisions_total{rule=\"trial\",result=\"dry_run_limited\",source=\"local\"} 4"), "{metrics}");
    assert!(
        metrics.contains(
            "levee_ratelimit_decisions_total{rule=\"trial\",result=\"allowed\",source=\"local\"} 1"
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_client_ips_cannot_dodge_a_per_ip_limit() {
    let backend = echo_backend().await;
    let rules = "[limit.per_ip]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 3\n";
    let levee = Levee::start(&limited_policy(
        &backend,
        "trusted_proxies = []",
        "",
        rules,
        "\"per_ip\"",
    ))
    .await;
    let mut statuses = Vec::new();
    for i in 0..6 {
        statuses.push(
            send_as(&levee, None, Some(&format!("198.51.100.{i}")))
                .await
                .status,
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_key_part_skip_the_rule_or_use_the_ip() {
    let backend = echo_backend().await;
    let rules = "[limit.skip]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 1\n[limit.by_ip]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 2\nmissing = \"ip\"\n";
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        "",
        rules,
        "\"skip\", \"by_ip\"",
    ))
    .await;
    // No user: `skip` does not apply, `by_ip` keys by IP (2 allowed).
    let anonymous: Vec<u16> = [(); 3].iter().map(|_| 0).collect();
    let mut statuses = Vec::new();
    for _ in anonymous {
        statuses.push(send_as(&levee, None, None).await.status);
    }
    assert_eq!(statuses, [200, 200, 429]);
    // A user id spelled like the client's IP is that user's bucket, not the IP's.
    let spelled_like_the_ip = send_as(&levee, Some("127.0.0.1"), None).await;
    assert_eq!(spelled_like_the_ip.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_then_back_local_fallback_never_waits_past_the_timeout() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    // Fleet of 2: while Redis is away each instance admits half of the burst (5 of 10). Every
    // decision waits for Redis (admit_ahead_above = 1), so the first two pay the timeout.
    let section = format!("[redis]\nurl = \"{}\"\ntimeout = \"300ms\"\nfailures_to_open = 2\ncooldown = \"5s\"\ninstances = 2\nadmit_ahead_above = 1\n", redis.url());
    let rule = "[limit.shared]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 10\n";
    let levee = Levee::start(&limited_policy(&backend, "", &section, rule, "\"shared\"")).await;
    assert_eq!(
        send_as(&levee, None, None).await.status,
        200,
        "warm up the connection"
    );

    redis.pause(true);
    let mut admitted = 0;
    let mut slow = Vec::new();
    let mut refused_quota = None;
    for i in 0..20 {
        let started = Instant::now();
        let answer = send_as(&levee, None, None).await;
        let took = started.elapsed();
        if answer.status == 200 {
            admitted += 1;
        } else {
            refused_quota = answer.header("ratelimit-policy").map(str::to_string);
        }
        // The first two calls pay the timeout and open the health breaker; none after that
        // (the cool-down outlasts the loop, so no probe meets the frozen Redis either).
        if i >= 2 && took >= Duration::from_millis(300) {
            slow.push((i, took));
        }
    }
    // Read while Redis is still frozen: once it thaws, the switch sync finds it back.
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    redis.pause(false);
    assert!(
        slow.is_empty(),
        "requests waited on a known-down Redis: {slow:?}"
    );
    assert_eq!(admitted, 5, "the local share is rate / instances");
    // The refusal tells the quota this instance applied, not the shared one (10 a 10 min).
    assert_eq!(refused_quota.as_deref(), Some("\"shared\";q=5;w=600"));
    assert_eq!(metric_value(&metrics, "levee_redis_up"), 0.0, "{metrics}");
    assert_eq!(
        metric_value(&metrics, "levee_redis_transitions_total{to=\"down\"}"),
        1.0,
        "{metrics}"
    );

    // Redis is back: a probe succeeds (after the cool-down, or sooner once the switch sync
    // found Redis answering) and decisions are shared again.
    eventually(
        Duration::from_secs(15),
        "levee to return to Redis",
        || async {
            send_as(&levee, None, None).await;
            metric_value(
                &get(&levee.admin_url("/metrics")).await.text(),
                "levee_redis_transitions_total{to=\"up\"}",
            ) == 1.0
        },
    )
    .await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(metric_value(&metrics, "levee_redis_up"), 1.0, "{metrics}");
    let from_redis = metric_value(
        &metrics,
        "levee_ratelimit_decisions_total{rule=\"shared\",result=\"allowed\",source=\"redis\"}",
    ) + metric_value(
        &metrics,
        "levee_ratelimit_decisions_total{rule=\"shared\",result=\"limited\",source=\"redis\"}",
    );
    assert!(
        from_redis >= 2.0,
        "decisions are made in Redis again: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_redis_was_refusing_gets_no_fresh_burst_when_redis_stalls() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    // 20 saved up, refilled at 4/s: empty, the bucket is full again 5 s later.
    let section = format!("[redis]\nurl = \"{}\"\ntimeout = \"100ms\"\nfailures_to_open = 1\ncooldown = \"30s\"\nadmit_ahead_above = 1\n", redis.url());
    let rule = "[limit.shared]\nkey = [\"route\"]\nrate = \"4/s\"\nburst = 20\n";
    let levee = Levee::start(&limited_policy(&backend, "", &section, rule, "\"shared\"")).await;
    let mut from_redis = 0;
    while send_as(&levee, None, None).await.status == 200 {
        from_redis += 1;
    }
    assert!(from_redis >= 20, "the burst first: {from_redis}");

    // Redis stalls while the client keeps flooding. Its refusal ends a quarter second later;
    // then the fallback decides, from a bucket as empty as Redis's: about 4 in the second,
    // where a fresh local bucket gave the whole burst of 20 at once.
    redis.pause(true);
    let started = Instant::now();
    let mut admitted = 0;
    while started.elapsed() < Duration::from_secs(1) {
        if send_as(&levee, None, None).await.status == 200 {
            admitted += 1;
        }
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    redis.pause(false);
    let from_fallback = metric_value(
        &metrics,
        "levee_ratelimit_decisions_total{rule=\"shared\",result=\"allowed\",source=\"fallback\"}",
    );
    assert!(from_fallback >= 1.0, "the fallback decided: {metrics}");
    assert!(
        admitted <= 8,
        "a stall gave the refused client {admitted} in a second at 4/s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_app_may_read_otherwise_is_refused_not_guessed() {
    let backend = echo_backend().await;
    let rule = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/min\"\nburst = 1\n";
    let levee = Levee::start(&limited_policy(&backend, "", "", rule, "\"per_user\"")).await;
    let as_user = |users: &[&str]| {
        let mut request = Request::get(levee.url("/limited"));
        for user in users {
            request = request.header("x-user", *user);
        }
        send(request.body(full("")).expect("request"))
    };
    assert_eq!(as_user(&["alice"]).await.status, 200);
    assert_eq!(as_user(&["alice"]).await.status, 429);
    // A decoy field before the real one: the app's server may pass either (or both joined).
    let answer = as_user(&["decoy-1", "alice"]).await;
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert!(
        answer.text().contains("two `x-user` fields"),
        "{}",
        answer.text()
    );
    assert_eq!(backend.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_allow_and_deny_rules_behave_as_named() {
    let dir = tempfile::tempdir().expect("dir");
    let mut redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let port = redis.port;
    let rules = "[limit.open]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 1\non_redis_error = \"allow\"\nheaders_on_allow = true\n[limit.closed]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 100\non_redis_error = \"deny\"\n[limit.kept]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 3\non_redis_error = \"local\"\n";
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\ntimeout = \"100ms\"\ncooldown = \"5s\"\n{rules}\n[[route]]\nname = \"open\"\nmatch = {{ path = \"/open\" }}\nlimits = [\"open\"]\n[[route]]\nname = \"closed\"\nmatch = {{ path = \"/closed\" }}\nlimits = [\"closed\"]\n[[route]]\nname = \"both\"\nmatch = {{ path = \"/both\" }}\nlimits = [\"kept\", \"closed\"]\n[[route]]\nname = \"kept\"\nmatch = {{ path = \"/kept\" }}\nlimits = [\"kept\"]\n",
            redis.url()
        ),
    );
    let levee = Levee::start(&policy).await;
    assert_eq!(
        get(&levee.url("/open")).await.status,
        200,
        "burst 1: the next one would be refused by Redis"
    );
    assert_eq!(get(&levee.url("/closed")).await.status, 200);

    redis.guard.stop();
    for _ in 0..5 {
        let open = get(&levee.url("/open")).await;
        assert_eq!(open.status, 200, "allow: open while Redis is down");
        // Nothing is known of the bucket: no made-up `r=0;t=0` ("none left") on an answer
        // that was let through.
        assert_eq!(open.header("ratelimit"), None);
        assert_eq!(open.header("ratelimit-policy"), None);
        let closed = get(&levee.url("/closed")).await;
        assert_eq!(closed.status, 429, "deny: closed while Redis is down");
        assert!(closed.header("retry-after").is_some());
        // Refused by the `deny` rule, the request uses up none of its `local` rule's tokens.
        assert_eq!(get(&levee.url("/both")).await.status, 429);
    }
    for _ in 0..3 {
        assert_eq!(
            get(&levee.url("/kept")).await.status,
            200,
            "the local rule's burst is whole"
        );
    }
    assert_eq!(get(&levee.url("/kept")).await.status, 429);

    // Restarted on the same port: shared limits come back.
    let _redis = RedisServer::start_on(dir.path(), port).await;
    eventually(
        Duration::from_secs(15),
        "limits to be shared again",
        || async { get(&levee.url("/closed")).await.status == 200 },
    )
    .await;
}

#[tokio::test]
async fn levees_ratelimit_fields_replace_the_upstreams_own() {
    // An app that limits by itself and says so: levee's fields take their place, never
    // beside them.
    let backend = Backend::start(|_request| async {
        http::Response::builder()
            .header("ratelimit-policy", "\"app\";q=100;w=60")
            .header("ratelimit", "\"app\";r=99;t=60")
            .header("x-app", "1")
            .body(full("ok"))
            .expect("response")
    })
    .await;
    let rules =
        "[limit.login]\nkey = [\"ip\"]\nrate = \"0.2/s\"\nburst = 2\nheaders_on_allow = true\n";
    let levee = Levee::start(&limited_policy(&backend, "", "", rules, "\"login\"")).await;
    let raw = raw_exchange(
        levee.public,
        b"GET /limited HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await
    .to_ascii_lowercase();
    assert!(raw.starts_with("http/1.1 200"), "{raw}");
    assert_eq!(raw.matches("\r\nratelimit-policy:").count(), 1, "{raw}");
    assert_eq!(raw.matches("\r\nratelimit:").count(), 1, "{raw}");
    assert!(
        raw.contains("\r\nratelimit: \"login\";r=1;t=5\r\n"),
        "{raw}"
    );
    assert!(raw.contains("\r\nx-app: 1\r\n"), "{raw}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loosening_a_limit_lets_a_refused_client_in_at_once() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let strict = "[limit.per_user]\nkey = [\"user\"]\nrate = \"1/h\"\nburst = 1\n";
    for (store, redis) in [
        ("in-process", String::new()),
        ("on Redis", redis_section(&redis.url(), "")),
    ] {
        let policy = limited_policy(&backend, "", &redis, strict, "\"per_user\"");
        let levee = Levee::start(&policy).await;
        assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
        let refused = send_as(&levee, Some("alice"), None).await;
        assert_eq!(refused.status, 429, "{store}");
        // Refused twice: on Redis the second is answered from what levee remembers.
        assert_eq!(send_as(&levee, Some("alice"), None).await.status, 429);

        let generation = levee.generation();
        std::fs::write(
            levee.policy_file(),
            policy.replace("rate = \"1/h\"\nburst = 1", "rate = \"100/s\"\nburst = 5"),
        )
        .expect("rewrite the policy");
        let reloaded = post(&levee.admin_url("/reload"), "").await;
        assert_eq!(reloaded.status, 200, "{}", reloaded.text());
        assert!(levee.generation() > generation);
        // Her bucket was emptied by the stricter rule; under the new one it is empty, not an
        // hour in debt: she waits one interval (10 ms) at most.
        eventually(Duration::from_secs(5), "alice to be let in", || async {
            send_as(&levee, Some("alice"), None).await.status == 200
        })
        .await;
    }
}

/// Redis Sentinel: levee asks the sentinel which server is master, shares limits and stores
/// queued work there, follows a failover to the promoted replica, keeps using the master it
/// found while the sentinel is gone, and falls back when that master is gone too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_queued_work_follow_the_master_that_redis_sentinel_names() {
    let dir = tempfile::tempdir().expect("dir");
    let mut group = RedisSentinel::start(dir.path()).await;
    let backend = echo_backend().await;
    let redis = sentinel_redis(
        &group,
        "timeout = \"200ms\"\ncooldown = \"100ms\"\n",
        "",
        NOTIFY_QUEUE,
    );
    let levee = per_user_levee(&backend, &redis).await;
    let post_job = || {
        let request = Request::post(levee.url("/notify.php"))
            .body(full("like=1"))
            .expect("request");
        send(request)
    };
    let stream = "levee:queue:{notify}:jobs";
    let master_named = || async {
        get(&levee.admin_url("/status")).await.json()["redis"]["master"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };

    assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
    assert_eq!(
        group.master.cli(&["EXISTS", &user_key("alice")]).trim(),
        "1"
    );
    assert_eq!(post_job().await.status, 202);
    assert_eq!(group.master.cli(&["XLEN", stream]).trim(), "1");
    assert_eq!(
        master_named().await,
        format!("127.0.0.1:{}", group.master.port)
    );

    group.fail_over().await;
    // A write that reached the old master before it turned replica is gone with its data:
    // what the new master holds was written there.
    decided_on(&levee, &group.replica, "bob").await;
    eventually(
        Duration::from_secs(10),
        "a job stored on the new master",
        || async {
            post_job().await.status == 202
                && group
                    .replica
                    .cli(&["XLEN", stream])
                    .trim()
                    .parse::<u32>()
                    .unwrap_or(0)
                    >= 2
        },
    )
    .await;
    assert_eq!(
        master_named().await,
        format!("127.0.0.1:{}", group.replica.port)
    );

    // Without the sentinel, the master found before is used on, also by connections made
    // anew (the master dropped levee's).
    group.stop_sentinel();
    assert_eq!(send_as(&levee, Some("carol"), None).await.status, 200);
    assert_eq!(
        group.replica.cli(&["EXISTS", &user_key("carol")]).trim(),
        "1"
    );
    group.replica.cli(&["CLIENT", "KILL", "TYPE", "normal"]);
    decided_on(&levee, &group.replica, "erin").await;
    eventually(
        Duration::from_secs(5),
        "a job stored on a new connection",
        || async { post_job().await.status == 202 },
    )
    .await;

    // Without any Redis: the rule falls back (in-process), queued work is refused.
    group.replica.kill();
    group.master.kill();
    let before = per_user_allowed(&get(&levee.admin_url("/metrics")).await.text(), "fallback");
    for _ in 0..3 {
        assert_eq!(send_as(&levee, Some("dave"), None).await.status, 200);
        assert_eq!(post_job().await.status, 503);
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        per_user_allowed(&metrics, "fallback") - before,
        3.0,
        "{metrics}"
    );
}

/// Redis Sentinel with passwords everywhere: the sentinel's own (in its URL) and the
/// servers' (`password`, on the batched rate-limit connection and the shared one alike).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_and_its_master_that_ask_for_passwords() {
    let dir = tempfile::tempdir().expect("dir");
    let group =
        RedisSentinel::start_with_passwords(dir.path(), Some(("server-secret", "sentinel-secret")))
            .await;
    let backend = echo_backend().await;
    let redis = sentinel_redis(
        &group,
        "timeout = \"200ms\"\n",
        "password = \"server-secret\"\ndb = 2\n",
        NOTIFY_QUEUE,
    );
    let levee = per_user_levee(&backend, &redis).await;
    assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
    let request = Request::post(levee.url("/notify.php"))
        .body(full("like=1"))
        .expect("request");
    assert_eq!(send(request).await.status, 202);
    let in_db_2 = |args: &[&str]| {
        let mut command = vec!["-n", "2"];
        command.extend_from_slice(args);
        group.master.cli(&command).trim().to_string()
    };
    assert_eq!(in_db_2(&["EXISTS", &user_key("alice")]), "1");
    assert_eq!(in_db_2(&["XLEN", "levee:queue:{notify}:jobs"]), "1");
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(per_user_allowed(&metrics, "redis"), 1.0, "{metrics}");

    // A reload that changes another [redis] setting makes a new connection, which starts
    // from the master in use (shown at once, before any request).
    let policy = std::fs::read_to_string(levee.policy_file()).expect("policy");
    let changed = policy.replacen("timeout = \"200ms\"", "timeout = \"300ms\"", 1);
    assert_ne!(policy, changed);
    std::fs::write(levee.policy_file(), changed).expect("policy");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["redis"]["master"],
        format!("127.0.0.1:{}", group.master.port),
        "{status}"
    );
}

/// The master dies and its health breaker opens for an hour; once the sentinels promote the
/// replica, the next request probes the new master instead of waiting out the hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_the_sentinels_announce_ends_the_cooldown() {
    let dir = tempfile::tempdir().expect("dir");
    let mut group = RedisSentinel::start(dir.path()).await;
    let backend = echo_backend().await;
    let redis = sentinel_redis(
        &group,
        "timeout = \"200ms\"\nfailures_to_open = 2\ncooldown = \"1h\"\n",
        "",
        "",
    );
    let levee = per_user_levee(&backend, &redis).await;
    assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);

    group.master.kill();
    for _ in 0..3 {
        assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(metric_value(&metrics, "levee_redis_up"), 0.0, "{metrics}");
    // The first may be admitted ahead (far from the limit), its charge failing later; none
    // was decided by Redis.
    assert_eq!(per_user_allowed(&metrics, "redis"), 1.0, "{metrics}");

    group.fail_over().await;
    decided_on(&levee, &group.replica, "bob").await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(metric_value(&metrics, "levee_redis_up"), 1.0, "{metrics}");
}

/// Sentinels and master over TLS (`rediss://` sentinels, with the policy's CA and client
/// certificate for both): limits are decided by the master, queued work is stored there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_and_its_master_that_speak_tls() {
    let dir = tempfile::tempdir().expect("dir");
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).expect("certs dir");
    make_certificates(&certs);
    let master = RedisServer::start_tls(dir.path(), &certs).await;
    let (_sentinel, sentinel_port) =
        start_tls_sentinel(&dir.path().join("sentinel"), &certs, master.port).await;
    let file = |name: &str| certs.join(name).display().to_string();
    let redis = format!(
        "[redis]\ntimeout = \"500ms\"\nca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n[redis.sentinel]\nnodes = [\"rediss://127.0.0.1:{sentinel_port}\"]\nmaster = \"{SENTINEL_MASTER}\"\n{NOTIFY_QUEUE}",
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let backend = echo_backend().await;
    let levee = per_user_levee(&backend, &redis).await;
    for _ in 0..3 {
        assert_eq!(send_as(&levee, Some("alice"), None).await.status, 200);
    }
    let request = Request::post(levee.url("/notify.php"))
        .body(full("like=1"))
        .expect("request");
    let queued = send(request).await;
    assert_eq!(queued.status, 202, "{}", queued.text());
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(per_user_allowed(&metrics, "redis") >= 1.0, "{metrics}");
    assert_eq!(per_user_allowed(&metrics, "fallback"), 0.0, "{metrics}");
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["redis"]["master"],
        format!("127.0.0.1:{}", master.port),
        "{status}"
    );
}

/// A fixed `url` whose server answers `READONLY` (a replica, or a master demoted behind a name
/// that still points at it) is a failing Redis: its health breaker opens as for any other
/// failure, instead of every request reconnecting and falling back for as long as it lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_url_answering_readonly_opens_the_health_breaker() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    // A replica of a master that is not there: it refuses every write with READONLY.
    redis.cli(&["REPLICAOF", "127.0.0.1", &free_port().to_string()]);
    let backend = echo_backend().await;
    let rules = "[limit.per_ip]\nkey = [\"ip\"]\nrate = \"100/s\"\nburst = 100\n";
    let redis_config = redis_section(&redis.url(), "failures_to_open = 2\ncooldown = \"1m\"\n");
    let levee = Levee::start(&limited_policy(
        &backend,
        "",
        &redis_config,
        rules,
        "\"per_ip\"",
    ))
    .await;
    for _ in 0..4 {
        assert_eq!(
            send_as(&levee, None, None).await.status,
            200,
            "the fallback decides"
        );
    }
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["redis"]["up"], false, "{status}");
    assert_eq!(status["redis"]["rate_limits"], "fallback", "{status}");
}

/// docs/from-nginx.md translates nginx's `burst=N nodelay` into `burst = N + 1`: measured
/// here against nginx's own `limit_req`, the same requests at once through each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_n_plus_one_admits_what_nginx_burst_n_nodelay_admits() {
    let dir = tempfile::tempdir().expect("dir");
    let www = dir.path().join("www");
    std::fs::create_dir(&www).expect("www");
    std::fs::write(www.join("index.html"), "ok").expect("page");
    open_up(&www);
    // One request a second: the 15 below come well within one interval.
    let nginx = Nginx::start(
        dir.path(),
        &format!(
            "limit_req_zone $binary_remote_addr zone=pages:1m rate=1r/s;\n  server {{ listen 127.0.0.1:{{port}}; location / {{ limit_req zone=pages burst=10 nodelay; root {}; }} }}",
            www.display()
        ),
    )
    .await;
    let backend = Backend::start(|_request| async { http::Response::new(full("ok")) }).await;
    let rules = "[limit.pages]\nkey = \"ip\"\nrate = \"1/s\"\nburst = 11\n";
    let levee = Levee::start(&limited_policy(&backend, "", "", rules, "\"pages\"")).await;

    let admitted = |urls: Vec<String>| async move {
        let answers = futures_util::future::join_all(urls.iter().map(|url| get(url))).await;
        answers.iter().filter(|answer| answer.status == 200).count()
    };
    let through_nginx = admitted(vec![format!("http://127.0.0.1:{}/", nginx.port); 15]).await;
    let through_levee = admitted(vec![levee.url("/limited"); 15]).await;
    assert_eq!((through_nginx, through_levee), (11, 11));
}

/// A full Redis (`OOM` under `noeviction`) answers: rate limits fall back call by call, and
/// its health breaker stays closed. Taken for a failure, it opened, and every answered call
/// closed it again: "redis is failing" and "redis answers again" by turns, every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_is_no_redis_down_for_rate_limits_which_fall_back_call_by_call() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let section = format!(
        "[redis]\nurl = \"{}\"\ntimeout = \"300ms\"\nfailures_to_open = 2\ncooldown = \"5s\"\nadmit_ahead_above = 1\n",
        redis.url()
    );
    let rule = "[limit.shared]\nkey = [\"route\"]\nrate = \"1/min\"\nburst = 3\n";
    let levee = Levee::start(&limited_policy(&backend, "", &section, rule, "\"shared\"")).await;
    assert_eq!(send_as(&levee, None, None).await.status, 200);
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&[
        "EVAL",
        "for i = 1, 3000 do redis.call('SET', 'fill:' .. i, string.rep('x', 1000)) end",
        "0",
    ]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1mb"]);
    let mut admitted = 0;
    for _ in 0..10 {
        if send_as(&levee, None, None).await.status == 200 {
            admitted += 1;
        }
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    // `/status` tells a full Redis apart, whichever call came last: reads it still answers
    // (the switch sync's) made `up` and `last_error` flip call by call.
    let mut seen = std::collections::HashSet::new();
    for _ in 0..5 {
        let status = get(&levee.admin_url("/status")).await.json();
        let redis_status = &status["redis"];
        seen.insert((
            redis_status["up"].clone(),
            redis_status["last_error"].clone(),
            redis_status["rate_limits"].clone(),
            redis_status["full"]["error"]
                .as_str()
                .map(|error| error.contains("OOM")),
        ));
        send_as(&levee, None, None).await;
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        vec![(
            serde_json::json!(true),
            serde_json::Value::Null,
            serde_json::json!("fallback (redis is full)"),
            Some(true)
        )]
    );
    let scraped = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(metric_value(&scraped, "levee_redis_full"), 1.0, "{scraped}");
    assert_eq!(metric_value(&scraped, "levee_redis_up"), 1.0, "{scraped}");
    let shown = levee::admin::client::summarize(&get(&levee.admin_url("/status")).await.json());
    assert!(shown.contains("FULL: refused a write"), "{shown}");
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    assert_eq!(
        metric_value(&metrics, "levee_redis_transitions_total{to=\"down\"}"),
        0.0,
        "{metrics}"
    );
    let fallback = metric_value(
        &metrics,
        "levee_ratelimit_decisions_total{rule=\"shared\",result=\"allowed\",source=\"fallback\"}",
    ) + metric_value(
        &metrics,
        "levee_ratelimit_decisions_total{rule=\"shared\",result=\"limited\",source=\"fallback\"}",
    );
    assert!(fallback >= 10.0, "each decided in-process: {metrics}");
    assert!(
        admitted <= 3,
        "the limit still holds, in-process: {admitted}"
    );
}
