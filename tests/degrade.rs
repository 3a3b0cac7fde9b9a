//! Tiered degradation: levels and module switches (state file and Redis), stale copies,
//! collapsed fetches.

mod common;

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, Response};
use hyper::body::Incoming;

const ROUTES: &str = r#"
[[route]]
name = "home"
match = { path = "/" }

[[route]]
name = "notifications"
match = { path_prefix = "/notifications" }
tier = 2
degrade = { action = "reject", status = 503, content_type = "application/json", body = '{"later":true}' }

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

/// ROUTES on `backend` and `redis`, the ranking route's degrade table being `degrade`, and
/// "ranking is resting" (503) answering when it has no copy to serve.
fn ranking_resting_with_redis(backend: &Backend, redis: &RedisServer, degrade: &str) -> String {
    let routes = ROUTES.replace(
        "module = \"ranking\"\ndegrade = { action = \"stale\", max_age = \"10m\" }",
        &format!(
            "module = \"ranking\"\n{degrade}\nfallback = {{ status = 503, body = \"ranking is resting\" }}"
        ),
    );
    assert!(routes.contains(degrade), "{routes}");
    policy_for(
        backend.addr,
        "access_log = false",
        &format!("[redis]\nurl = \"{}\"\n{routes}", redis.url()),
    )
}

/// The site's name, as a front or load balancer sends it to every instance of a fleet: a copy
/// is the page of the `Host` the app was sent, and each instance's own address differs.
const FLEET: &[(&str, &str)] = &[("host", "127.0.0.1")];

/// A backend that names the path it served and a version the test can bump; mode 1 fails,
/// 2 is slow, 3 hangs.
async fn versioned() -> (Backend, Arc<AtomicUsize>, Arc<AtomicU8>) {
    let version = Arc::new(AtomicUsize::new(1));
    let failing = Arc::new(AtomicU8::new(0));
    let (v, f) = (version.clone(), failing.clone());
    let backend = Backend::start(move |request: Request<Incoming>| {
        let body = format!("{} v{}", request.uri().path(), v.load(Ordering::SeqCst));
        let fail = f.load(Ordering::SeqCst);
        async move {
            if fail == 1 {
                return Response::builder()
                    .status(502)
                    .body(full("php-fpm is gone"))
                    .expect("response");
            }
            if fail == 2 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            if fail == 3 {
                // Hangs: a dependency that accepts and never answers.
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            html(body)
        }
    })
    .await;
    (backend, version, failing)
}

async fn set(levee: &Levee, path: &str, value: &str) -> Answer {
    let request = Request::post(levee.admin_url(path))
        .header("x-levee-operator", "alice")
        .body(full(value.to_string()))
        .expect("request");
    send(request).await
}

/// A `text/html` answer with `body`.
fn html(body: impl Into<Bytes>) -> Response<TestBody> {
    Response::builder()
        .header("content-type", "text/html")
        .body(full(body.into()))
        .expect("response")
}

/// levee in front of `backend` with [`ROUTES`], `from` replaced by `to` in them.
async fn levee_with_routes(backend: &Backend, from: &str, to: &str) -> Levee {
    let routes = ROUTES.replace(from, to);
    Levee::start(&policy_for(backend.addr, "access_log = false", &routes)).await
}

/// levee with [`ROUTES`] whose ranking route, when off and without a copy, answers 503
/// "ranking is resting".
async fn levee_resting(backend: &Backend) -> Levee {
    levee_with_routes(
        backend,
        "module = \"ranking\"",
        "module = \"ranking\"\nfallback = { status = 503, body = \"ranking is resting\" }",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levels_and_module_switches_turn_routes_off_by_tier() {
    let (backend, _, _) = versioned().await;
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", ROUTES)).await;
    for path in ["/", "/notifications", "/visitors", "/ranking"] {
        assert_eq!(get(&levee.url(path)).await.status, 200, "{path} at level 0");
    }

    assert_eq!(set(&levee, "/level", "1").await.status, 200);
    assert_eq!(
        get(&levee.url("/")).await.status,
        200,
        "tier 1 is never degraded"
    );
    assert_eq!(
        get(&levee.url("/notifications")).await.status,
        200,
        "tier 2 stays on at level 1"
    );
    let visitors = get(&levee.url("/visitors")).await;
    assert_eq!(visitors.status, 503, "tier 3 is off at level 1");
    assert_eq!(visitors.header("retry-after"), Some("30"));

    assert_eq!(set(&levee, "/level", "2").await.status, 200);
    let notifications = get(&levee.url("/notifications")).await;
    assert_eq!(
        (notifications.status, notifications.text().as_str()),
        (503, "{\"later\":true}")
    );
    assert_eq!(
        notifications.header("content-type"),
        Some("application/json")
    );
    // The operator's own page tells clients when to come back, as the default one does.
    assert_eq!(notifications.header("retry-after"), Some("30"));
    assert_eq!(get(&levee.url("/")).await.status, 200);

    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["level"], 2);
    assert_eq!(status["degrade"]["level_origin"], "runtime");
    // Each route says whether it is off now, and by what.
    let off = |status: &serde_json::Value| -> Vec<(String, serde_json::Value)> {
        status["routes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|route| {
                let name = route["name"].as_str().unwrap_or_default().to_string();
                (name, route["off"].clone())
            })
            .collect()
    };
    assert_eq!(
        off(&status)[..4],
        [
            ("home".to_string(), serde_json::Value::Null),
            ("notifications".to_string(), "tier".into()),
            ("ranking".to_string(), "tier".into()),
            ("visitors".to_string(), "tier".into()),
        ]
    );
    assert!(
        status["degrade"]["level_changed_by"]
            .as_str()
            .unwrap_or("")
            .starts_with("alice"),
        "{status}"
    );

    // Back to the policy's level, then one module off on its own.
    assert_eq!(set(&levee, "/level", "policy").await.status, 200);
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    assert_eq!(get(&levee.url("/visitors")).await.status, 503);
    assert_eq!(get(&levee.url("/notifications")).await.status, 200);
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["modules"]["visitors"]["off"], true);
    assert_eq!(
        status["degrade"]["modules"]["visitors"]["origin"],
        "runtime"
    );
    assert_eq!(status["degrade"]["modules"]["ranking"]["off"], false);
    assert_eq!(
        off(&status)[..4],
        [
            ("home".to_string(), serde_json::Value::Null),
            ("notifications".to_string(), serde_json::Value::Null),
            ("ranking".to_string(), serde_json::Value::Null),
            ("visitors".to_string(), "module".into()),
        ]
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_module_off{module=\"visitors\"}"),
        1.0,
        "{metrics}"
    );
    assert!(
        metric_value(
            &metrics,
            "levee_degraded_responses_total{route=\"notifications\",action=\"reject\"}"
        ) >= 1.0,
        "{metrics}"
    );

    assert_eq!(set(&levee, "/level", "7").await.status, 400);
    assert_eq!(set(&levee, "/modules/nope", "off").await.status, 400);
    assert_eq!(
        set(&levee, "/modules/visitors", "sideways").await.status,
        400
    );

    // Saved = in effect: a new levee on the same directory comes back with the switch.
    let again = levee::start(levee::Options::new(levee.dir.path()))
        .await
        .expect("restart");
    assert_eq!(
        get(&format!("http://{}/visitors", again.public_addr))
            .await
            .status,
        503
    );
}

/// A state file levee cannot write is said at start, where the operator reads the policy's
/// warnings, not first found out in the incident a switch is for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_levee_cannot_write_is_warned_of_at_start() {
    let log = levee_log();
    let backend = echo_backend().await;
    let policy = policy_for(backend.addr, "access_log = false", ROUTES).replacen(
        "[[route]]",
        "[degrade]\nstate_file = \"/proc/levee-state.json\"\n[[route]]",
        1,
    );
    let levee = Levee::start(&policy).await;
    let status = get(&levee.admin_url("/status")).await.json();
    let warnings = status["policy"]["warnings"].to_string();
    assert!(
        warnings.contains("switches cannot be saved: levee cannot write in /proc"),
        "{status}"
    );
    assert_eq!(set(&levee, "/level", "1").await.status, 503);
    // The refusal is in the log too, not only in the operator's answer.
    eventually(Duration::from_secs(2), "the refusal logged", || async {
        log.lines_with("degrade switch refused").iter().any(|line| {
            line.contains("so it is not in effect: cannot write /proc/levee-state.json")
        })
    })
    .await;
    // And by `levee check`, which a unit runs as levee's user before starting it.
    let (valid, _, warned) = levee_check(levee.dir.path());
    assert!(
        valid && warned.contains("switches cannot be saved: levee cannot write in /proc"),
        "{warned}"
    );

    // A directory where the file should be takes no file either (it went unsaid).
    let dir = tempfile::tempdir().expect("dir");
    let taken = dir.path().join("state.json");
    std::fs::create_dir(&taken).expect("a directory");
    std::fs::write(
        dir.path().join("levee.toml"),
        policy_for(backend.addr, "access_log = false", ROUTES).replacen(
            "[[route]]",
            &format!("[degrade]\nstate_file = \"{}\"\n[[route]]", taken.display()),
            1,
        ),
    )
    .expect("write");
    let (valid, _, warned) = levee_check(dir.path());
    assert!(
        valid
            && warned.contains("switches cannot be saved: the state file")
            && warned.contains("is a directory"),
        "{warned}"
    );
}

/// Started while Redis is down and before any switch was ever saved here, levee says it has
/// no copy of the fleet's switches; it named the state file as "the last known copy" though
/// no such file existed.
/// A stale route whose page sets a cookie on every view (`session_start()`) never keeps a
/// copy, and has none to serve when the app fails: counted by why, and said in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_a_stale_route_cannot_keep_are_counted_and_said() {
    let log = levee_log();
    let backend = Backend::start(|_request: Request<Incoming>| async {
        Response::builder()
            .header("set-cookie", "PHPSESSID=abc; path=/")
            .body(full("ranking"))
            .expect("response")
    })
    .await;
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", ROUTES)).await;
    for _ in 0..3 {
        assert_eq!(get(&levee.url("/ranking")).await.status, 200);
    }
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_stale_not_kept_total{route=\"ranking\",reason=\"set_cookie\"}"
        ),
        3.0,
        "{metrics}"
    );
    let said = log.lines_with("was not kept as the route's stale copy");
    assert!(
        said.iter().any(
            |line| line.contains("route=ranking") && line.contains("allow_set_cookie is false")
        ),
        "{said:?}"
    );
}

/// With Redis, the local copy of the switches a full disk kept from being written is written
/// again once it can be, from the switches in effect: left behind, it held a breaker pin the
/// fleet had handed back, which a restart while Redis was away applied (and wrote back into
/// Redis for every instance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_copy_that_could_not_be_written_is_caught_up() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    // A file where the copy's directory should be: every write fails, as on a full disk.
    let blocker = dir.path().join("state");
    std::fs::write(&blocker, "").expect("blocker");
    let state_file = blocker.join("levee.json");
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"50ms\"\nstate_file = \"{}\"\n{ROUTES}",
            redis.url(),
            state_file.display()
        ),
    );
    let levee = Levee::start(&policy).await;
    assert_eq!(set(&levee, "/breakers/app", "open").await.status, 200);
    assert_eq!(set(&levee, "/breakers/app", "auto").await.status, 200);
    std::fs::remove_file(&blocker).expect("space again");
    std::fs::create_dir(&blocker).expect("dir");
    eventually(Duration::from_secs(5), "the copy written again", || async {
        std::fs::read_to_string(&state_file).is_ok_and(|saved| !saved.contains("\"app\""))
    })
    .await;
}

/// A deploy that deletes the state file (`rsync --delete` into the policy directory, its
/// default home) while a level is switched on: levee writes it again from the switches in
/// effect, and says so, so a restart still comes up at that level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_a_deploy_deleted_is_written_again() {
    let log = levee_log();
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", ROUTES)).await;
    assert_eq!(set(&levee, "/level", "1").await.status, 200);
    let state_file = levee.dir.path().join(".levee-state.json");
    assert!(state_file.exists());
    std::fs::remove_file(&state_file).expect("deleted");
    eventually(Duration::from_secs(10), "written again", || async {
        std::fs::read_to_string(&state_file).is_ok_and(|saved| saved.contains("\"value\": 1"))
    })
    .await;
    let said = log.lines_with(&state_file.display().to_string());
    assert!(
        said.iter()
            .any(|line| line.contains("the state file was gone")),
        "{said:?}"
    );
    // Overwritten with something else (garbage, an old copy) is lost at a restart too.
    std::fs::write(&state_file, "garbage").expect("overwritten");
    eventually(Duration::from_secs(10), "written again", || async {
        std::fs::read_to_string(&state_file).is_ok_and(|saved| saved.contains("\"value\": 1"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_without_redis_and_without_a_saved_copy_says_so() {
    let log = levee_log();
    let backend = echo_backend().await;
    let policy = policy_for(backend.addr, "access_log = false", ROUTES).replacen(
        "[[route]]",
        &format!(
            "[redis]\nurl = \"redis://127.0.0.1:{}\"\n[[route]]",
            free_port()
        ),
        1,
    );
    let levee = Levee::start(&policy).await;
    let state_file = levee.dir.path().join(".levee-state.json");
    assert!(!state_file.exists());
    let said = log.lines_with(&state_file.display().to_string());
    assert!(
        said.iter()
            .any(|line| line.contains("no local copy has been written yet")),
        "{said:?}"
    );
    assert!(
        !said.iter().any(|line| line.contains("last known copy")),
        "{said:?}"
    );
    assert_eq!(get(&levee.url("/")).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switch_changes_made_at_once_are_all_kept_in_effect_and_in_the_state_file() {
    const MODULES: usize = 32;
    let backend = Backend::start(|_: Request<Incoming>| async { Response::new(full("ok")) }).await;
    let modules: String = (0..MODULES)
        .map(|i| format!("[module.m{i}]\ntier = 3\n"))
        .collect();
    let levee = Levee::start(&policy_for(backend.addr, "", &modules)).await;
    let state_file = levee.dir.path().join(".levee-state.json");
    for (round, value) in ["off", "policy", "off"].into_iter().enumerate() {
        // Every module switched at once, each by its own admin request.
        let changes: Vec<_> = (0..MODULES)
            .map(|i| {
                let url = levee.admin_url(&format!("/modules/m{i}"));
                tokio::spawn(async move { post(&url, value).await.status })
            })
            .collect();
        for change in changes {
            assert_eq!(change.await.expect("change"), 200);
        }
        let status = get(&levee.admin_url("/status")).await.json();
        let saved: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&state_file).expect("state file"))
                .expect("state file json");
        for i in 0..MODULES {
            let module = format!("m{i}");
            let off = value == "off";
            assert_eq!(
                status["degrade"]["modules"][&module]["off"], off,
                "round {round}: {module} in /status"
            );
            assert_eq!(
                saved["modules"][&module]["value"].as_bool(),
                off.then_some(true),
                "round {round}: {module} in the state file: {saved}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ranking_serves_its_last_good_copy_with_a_growing_age_until_max_age() {
    let (backend, version, failing) = versioned().await;
    // Copies of 3 s: this test waits for one to expire.
    let routes = ROUTES
        .replace(
            "module = \"ranking\"",
            "module = \"ranking\"\nfallback = { status = 503, body = \"ranking is resting\" }",
        )
        .replace("max_age = \"10m\"", "max_age = \"3s\"");
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", &routes)).await;
    let fresh = get(&levee.url("/ranking?week=1")).await;
    assert_eq!(fresh.text(), "/ranking v1");
    assert!(fresh.header("x-levee-stale").is_none());
    version.store(2, Ordering::SeqCst);

    // Switched off: the copy answers without touching the backend.
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let hits = backend.hits();
    let stale = get(&levee.url("/ranking?week=1")).await;
    assert_eq!((stale.status, stale.text().as_str()), (200, "/ranking v1"));
    assert_eq!(stale.header("x-levee-stale"), Some("1"));
    assert_eq!(stale.header("content-type"), Some("text/html"));
    assert_eq!(backend.hits(), hits);
    // Another query is another copy: none yet, so the fallback answers.
    let other = get(&levee.url("/ranking?week=2")).await;
    assert_eq!(
        (other.status, other.text().as_str()),
        (503, "ranking is resting")
    );

    // Back on, the backend fails (php-fpm gone behind nginx): stale-if-error.
    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);
    failing.store(1, Ordering::SeqCst);
    let stale_served = || async {
        metric_value(
            &get(&levee.admin_url("/metrics")).await.text(),
            "levee_degraded_responses_total{route=\"ranking\",action=\"stale\"}",
        )
    };
    let before = stale_served().await;
    let if_error = get(&levee.url("/ranking?week=1")).await;
    assert_eq!(
        (if_error.status, if_error.text().as_str()),
        (200, "/ranking v1")
    );
    assert_eq!(if_error.header("x-levee-stale"), Some("1"));
    // A copy served in place of the app's error page is counted like any other.
    assert_eq!(stale_served().await, before + 1.0);

    // Switched off again, the copy says how old it is; after max_age it is too old, and the
    // route's fallback answers instead.
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    eventually(Duration::from_secs(5), "Age to grow", || async {
        get(&levee.url("/ranking?week=1"))
            .await
            .header("age")
            .and_then(|a| a.parse::<u64>().ok())
            .unwrap_or(0)
            >= 1
    })
    .await;

    eventually(Duration::from_secs(10), "the copy to expire", || async {
        get(&levee.url("/ranking?week=1")).await.text() == "ranking is resting"
    })
    .await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metric_value(
            &metrics,
            "levee_degraded_responses_total{route=\"ranking\",action=\"stale\"}"
        ) >= 2.0,
        "{metrics}"
    );
    assert!(
        metric_value(
            &metrics,
            "levee_degraded_responses_total{route=\"ranking\",action=\"stale_missing\"}"
        ) >= 1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_serves_the_copy_too() {
    let log = levee_log();
    let (backend, _, failing) = versioned().await;
    let policy = policy_for(backend.addr, "access_log = true", ROUTES).replace(
        "[[route]]\nname = \"home\"",
        "breaker = { consecutive_failures = 2, open_for = \"60s\" }\n[[route]]\nname = \"home\"",
    );
    let levee = Levee::start(&policy).await;
    assert_eq!(get(&levee.url("/ranking")).await.text(), "/ranking v1");
    failing.store(1, Ordering::SeqCst);
    for _ in 0..2 {
        get(&levee.url("/")).await;
    }
    let hits = backend.hits();
    let answer = get(&levee.url("/ranking")).await;
    assert_eq!(
        (answer.status, answer.header("x-levee-stale")),
        (200, Some("1"))
    );
    assert_eq!(
        backend.hits(),
        hits,
        "breaker open: the backend is not called"
    );
    // The access log says the copy answered, as it says `shed` or `breaker_open`. (Its line
    // is written once the answer's body has gone out, which may be just after the client
    // has it.)
    eventually(
        Duration::from_secs(5),
        "the stale answer's access-log line",
        || async {
            log.lines_with("path=/ranking route=ranking")
                .iter()
                .any(|line| line.contains("status=200") && line.contains("error=\"stale\""))
        },
    )
    .await;
    assert_eq!(
        get(&levee.url("/")).await.status,
        503,
        "a route without a copy gets the breaker's 503"
    );
}

/// An app that stops taking connections behind a stale route is still seen: each failure is
/// counted as any upstream error, and logged (at most once per ten seconds) though the copy
/// answers. It was seen only in `levee_degraded_responses_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_app_behind_a_stale_route_is_logged_and_counted() {
    let log = levee_log();
    let (backend, _, _) = versioned().await;
    let policy = policy_for(backend.addr, "access_log = false", ROUTES);
    let levee = Levee::start(&policy).await;
    assert_eq!(get(&levee.url("/ranking")).await.text(), "/ranking v1");
    // The app goes away: its port refuses connections.
    let gone = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    std::fs::write(
        levee.policy_file(),
        policy.replace(&backend.addr.to_string(), &gone.to_string()),
    )
    .expect("rewrite the policy");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    for _ in 0..2 {
        let answer = get(&levee.url("/ranking")).await;
        assert_eq!(
            (answer.status, answer.header("x-levee-stale")),
            (200, Some("1"))
        );
    }
    let said = log.lines_with(&format!("connect to {gone}"));
    assert!(
        said.len() == 1 && said[0].contains("the last good copy answered instead"),
        "{said:?}"
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(
            &metrics,
            "levee_upstream_errors_total{upstream=\"app\",kind=\"connect\"}"
        ),
        2.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_of_a_copy_do_not_wait_on_a_half_open_breakers_probe() {
    let (backend, _, failing) = versioned().await;
    let routes = ROUTES.replace("max_age = \"10m\"", "max_age = \"60s\"");
    let policy = policy_for(backend.addr, "access_log = false", &routes).replace(
        "[[route]]\nname = \"home\"",
        "breaker = { consecutive_failures = 2, open_for = \"1s\", half_open_probes = 1 }\n[[route]]\nname = \"home\"",
    );
    let levee = Levee::start(&policy).await;
    assert_eq!(get(&levee.url("/ranking")).await.text(), "/ranking v1");
    failing.store(1, Ordering::SeqCst);
    for _ in 0..2 {
        get(&levee.url("/")).await;
    }
    eventually(
        Duration::from_secs(10),
        "the breaker to be ready to probe",
        || async {
            let status = get(&levee.admin_url("/status")).await.json();
            status["upstreams"][0]["breaker"]["state"] == "half_open"
        },
    )
    .await;

    // The first request is the probe, and the dependency now hangs.
    failing.store(3, Ordering::SeqCst);
    let hits = backend.hits();
    let url = levee.url("/ranking");
    let probe = tokio::spawn(async move { get(&url).await });
    eventually(
        Duration::from_secs(10),
        "the probe to reach the backend",
        || async { backend.hits() > hits },
    )
    .await;
    // A reader of the same page gets the copy while the probe is still out, instead of
    // joining the probe's fetch and waiting as long as it hangs.
    let reader = get(&levee.url("/ranking")).await;
    assert_eq!(
        (
            reader.status,
            reader.header("x-levee-stale"),
            reader.text().as_str()
        ),
        (200, Some("1"), "/ranking v1")
    );
    assert!(!probe.is_finished(), "the probe is still out");
    probe.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_collapse_into_one_upstream_request() {
    let (backend, _, slow) = versioned().await;
    slow.store(2, Ordering::SeqCst);
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", ROUTES)).await;
    let url = levee.url("/ranking/top");
    let answers = futures_util::future::join_all((0..20).map(|_| {
        let url = url.clone();
        async move { get(&url).await }
    }))
    .await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == 200 && a.text() == "/ranking/top v1"),
        "every request got the page"
    );
    assert_eq!(
        backend.hits(),
        1,
        "twenty concurrent requests, one upstream fetch"
    );
}

/// Switches and learned cookie names have no expiry, as queued jobs: Redis's eviction policy
/// is read with any `[redis]` (it was read only with a `[queue]`), and read again, so an
/// operator's `CONFIG SET` is seen without a restart; the warning comes when it changes to
/// one that evicts any key, not at every read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_eviction_policy_is_read_and_followed_without_a_queue() {
    let log = levee_log();
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    let (backend, _, _) = versioned().await;
    // Read again every 120 syncs: 1.2 s here.
    let levee = Levee::start(&policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"10ms\"\n{ROUTES}",
            redis.url()
        ),
    ))
    .await;
    let shown = |policy: &'static str| {
        let url = levee.admin_url("/status");
        move || {
            let url = url.clone();
            async move { get(&url).await.json()["redis"]["maxmemory_policy"] == policy }
        }
    };
    eventually(
        Duration::from_secs(5),
        "the policy read",
        shown("noeviction"),
    )
    .await;
    assert!(log.lines_with("redis evicts any key").is_empty());

    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    eventually(
        Duration::from_secs(10),
        "the change seen",
        shown("allkeys-lru"),
    )
    .await;
    eventually(Duration::from_secs(2), "the warning", || async {
        log.lines_with("redis evicts any key").len() == 1
    })
    .await;

    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
    eventually(
        Duration::from_secs(10),
        "the next change",
        shown("volatile-lru"),
    )
    .await;
    assert_eq!(log.lines_with("redis evicts any key").len(), 1, "said once");
}

/// A copy one instance stored is served by another whose wall clock is an hour ahead (an
/// NTP step after a VM migration; the monotonic clock does not move): copies are aged on
/// Redis's clock and a step-free one, not on each machine's wall clock. It refused every copy
/// the others stored, as an hour old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_is_aged_on_the_fleets_clock_not_a_skewed_instances() {
    let Some(faketime) = faketime_preload() else {
        eprintln!(
            "skipped: faketime is not installed (the Debian package faketime; .ci/run installs it)"
        );
        return;
    };
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = Backend::start(|_| async { html("the ranking") }).await;
    let routes = ROUTES.replace(
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"1m\" }",
    );
    let rest = format!(
        "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"50ms\"\n{routes}",
        redis.url()
    );
    let on_time = Levee::start(&policy_for(backend.addr, "access_log = false", &rest)).await;
    // Stored by the instance on time, and switched off before the other starts (it comes up
    // with the fleet's switches, and never fetches the page itself).
    assert_eq!(
        get_with(&on_time.url("/ranking"), FLEET).await.text(),
        "the ranking"
    );
    assert_eq!(set(&on_time, "/modules/ranking", "off").await.status, 200);
    let (public, admin) = (free_port(), free_port());
    let ahead_dir = tempfile::tempdir().expect("dir");
    std::fs::write(
        ahead_dir.path().join("levee.toml"),
        policy_for(backend.addr, "access_log = false", &rest)
            .replacen("127.0.0.1:0", &format!("127.0.0.1:{public}"), 1)
            .replacen("127.0.0.1:0", &format!("127.0.0.1:{admin}"), 1),
    )
    .expect("write policy");
    let _ahead = ChildGuard::spawn(
        "levee an hour ahead",
        std::process::Command::new(env!("CARGO_BIN_EXE_levee"))
            .args(["run", "--no-watch", "--policies"])
            .arg(ahead_dir.path())
            .env("LD_PRELOAD", &faketime)
            .env("FAKETIME", "+1h")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("LEVEE_LOG", "warn"),
    );
    let ahead_url = format!("http://127.0.0.1:{public}/ranking");
    wait_for_port(
        std::net::SocketAddr::from(([127, 0, 0, 1], public)),
        "the instance ahead to listen",
    )
    .await;

    eventually(
        Duration::from_secs(10),
        "the copy served an hour ahead",
        || async {
            let answer = get_with(&ahead_url, FLEET).await;
            answer.status == 200 && answer.header("x-levee-stale") == Some("1")
        },
    )
    .await;
    let answer = get_with(&ahead_url, FLEET).await;
    let age: u64 = answer
        .header("age")
        .and_then(|age| age.parse().ok())
        .expect("an Age");
    assert!(age < 60, "Age: {age}");
    assert_eq!(backend.hits(), 1, "the copy stored by the instance on time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switches_are_shared_through_redis_and_survive_restarts() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _, _) = versioned().await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"200ms\"\n{ROUTES}",
            redis.url()
        ),
    );
    let first = Levee::start(&policy).await;
    let second = Levee::start(&policy).await;
    assert_eq!(get_with(&second.url("/visitors"), FLEET).await.status, 200);

    assert_eq!(set(&first, "/modules/visitors", "off").await.status, 200);
    let flipped = std::time::Instant::now();
    eventually(
        Duration::from_secs(3),
        "the second instance to follow",
        || async { get_with(&second.url("/visitors"), FLEET).await.status == 503 },
    )
    .await;
    assert!(
        // Every 200 ms, with room for a loaded machine.
        flipped.elapsed() < Duration::from_secs(2),
        "followed in {:?}",
        flipped.elapsed()
    );
    let status = get(&second.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["modules"]["visitors"]["origin"],
        "runtime"
    );
    assert_eq!(status["degrade"]["switches_stored_in"], "redis");

    // A third instance started later comes up with the fleet's switches.
    let third = Levee::start(&policy).await;
    assert_eq!(get_with(&third.url("/visitors"), FLEET).await.status, 503);

    // The ranking copy lives in Redis too: a fresh instance serves it while switched off.
    assert_eq!(
        get_with(&first.url("/ranking"), FLEET).await.text(),
        "/ranking v1"
    );
    eventually(
        Duration::from_secs(3),
        "the copy to reach redis",
        || async {
            let mut command = std::process::Command::new("redis-cli");
            command.args([
                "-p",
                &redis.port.to_string(),
                "--scan",
                "--pattern",
                "levee:stale:*",
            ]);
            command
                .output()
                .map(|o| !o.stdout.is_empty())
                .unwrap_or(false)
        },
    )
    .await;
    assert_eq!(set(&first, "/modules/ranking", "off").await.status, 200);
    let fourth = Levee::start(&policy).await;
    let copy = get_with(&fourth.url("/ranking"), FLEET).await;
    assert_eq!(
        (
            copy.status,
            copy.text().as_str(),
            copy.header("x-levee-stale")
        ),
        (200, "/ranking v1", Some("1"))
    );

    // Redis down: saving a switch fails loudly instead of pretending.
    drop(redis);
    let refused = set(&first, "/modules/visitors", "on").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(
        refused.text().contains("not in effect"),
        "{}",
        refused.text()
    );
    assert_eq!(
        get_with(&first.url("/visitors"), FLEET).await.status,
        503,
        "the last saved switch still holds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn level_2_under_load_keeps_tier_1_on_the_backend() {
    let (backend, _, _) = versioned().await;
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", ROUTES)).await;
    assert_eq!(set(&levee, "/level", "2").await.status, 200);
    let mut load = Vec::new();
    for worker in 0..8 {
        let url = levee.url(["/", "/notifications", "/visitors", "/"][worker % 4]);
        load.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..50 {
                statuses.push(get(&url).await.status);
            }
            (url, statuses)
        }));
    }
    for task in load {
        let (url, statuses) = task.await.expect("load task");
        let expected = if url.ends_with(":0/")
            || url.ends_with('/') && !url.contains("/notifications") && !url.contains("/visitors")
        {
            200
        } else {
            503
        };
        assert!(
            statuses.iter().all(|s| *s == expected),
            "{url}: {statuses:?}"
        );
    }
    assert_eq!(
        backend.hits(),
        200,
        "only the tier-1 requests reached the backend"
    );
}

#[test]
fn check_refuses_refusing_tier_1_routes_and_unknown_modules() {
    let stderr = check_fails(
        "[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[degrade]\nmodules_off = [\"rankng\"]\n[[route]]\nname = \"login\"\nmatch = { path = \"/login.php\" }\ndegrade = { action = \"reject\" }\n[[route]]\nname = \"view\"\nmodule = \"ranking\"\n",
    );
    assert!(
        stderr.contains("levee.toml:4:15: error: module `rankng` is not defined"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "levee.toml:8:22: error: a tier-1 route cannot be given an action that refuses service"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("levee.toml:11:10: error: a tier-1 route cannot belong to a module"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_is_hidden_like_the_page_and_kept_uncompressed() {
    // The app gzips when asked: a copy kept from a gzip answer would go to clients that never
    // asked for gzip. levee asks for the plain page on a route that keeps copies, keeps it
    // whole, and cuts switched-off modules out of it when it is served, as from the app.
    let failing = Arc::new(AtomicU8::new(0));
    let asked_gzip = Arc::new(AtomicUsize::new(0));
    let (f, asked) = (failing.clone(), asked_gzip.clone());
    let backend = Backend::start(move |request: Request<Incoming>| {
        let gzip = request
            .headers()
            .get("accept-encoding")
            .is_some_and(|value| value.to_str().unwrap_or("").contains("gzip"));
        if gzip {
            asked.fetch_add(1, Ordering::SeqCst);
        }
        let fail = f.load(Ordering::SeqCst);
        async move {
            if fail == 1 {
                return Response::builder()
                    .status(502)
                    .body(full("php-fpm is gone"))
                    .expect("response");
            }
            let builder = Response::builder().header("content-type", "text/html");
            if gzip {
                builder
                    .header("content-encoding", "gzip")
                    .body(full("GZIPPED"))
                    .expect("response")
            } else {
                builder
                    .body(full("<p>home</p><div id=\"visitors\">42 online</div>"))
                    .expect("response")
            }
        }
    })
    .await;
    let levee = levee_with_routes(&backend, "match = { path = \"/\" }", "match = { path = \"/\" }\nhide = { visitors = \"#visitors\" }\ndegrade = { action = \"stale\", max_age = \"1m\" }").await;
    let with_gzip =
        |url: String| async move { get_with(&url, &[("accept-encoding", "gzip")]).await };
    let fresh = with_gzip(levee.url("/")).await;
    assert_eq!(
        fresh.text(),
        "<p>home</p><div id=\"visitors\">42 online</div>"
    );
    assert_eq!(asked_gzip.load(Ordering::SeqCst), 0);

    // The app fails: the copy answers, with the visitors module cut out once it is off.
    failing.store(1, Ordering::SeqCst);
    let copy = get(&levee.url("/")).await;
    assert_eq!(copy.header("x-levee-stale"), Some("1"));
    assert_eq!(copy.header("content-encoding"), None);
    assert_eq!(
        copy.text(),
        "<p>home</p><div id=\"visitors\">42 online</div>"
    );
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let copy = with_gzip(levee.url("/")).await;
    assert_eq!(copy.header("x-levee-stale"), Some("1"));
    assert_eq!(copy.text(), "<p>home</p>");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_copy_aged_serves_the_fresher_copy_another_stored_in_redis() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, version, failing) = versioned().await;
    let policy = ranking_resting_with_redis(
        &backend,
        &redis,
        "degrade = { action = \"stale\", max_age = \"3s\" }",
    );
    let first = Levee::start(&policy).await;
    let second = Levee::start(&policy).await;
    assert_eq!(
        get_with(&first.url("/ranking"), FLEET).await.text(),
        "/ranking v1"
    );

    // The backend fails; once the first instance's copy is past max_age, it has none.
    failing.store(1, Ordering::SeqCst);
    eventually(
        Duration::from_secs(10),
        "the first copy to expire",
        || async { get_with(&first.url("/ranking"), FLEET).await.text() == "ranking is resting" },
    )
    .await;

    // Redis, which had nothing newer, is not asked again on every request meanwhile (once
    // in a tenth of max_age: 300 ms).
    let gets = || redis.calls("get");
    let before = gets();
    for _ in 0..20 {
        assert_eq!(
            get_with(&first.url("/ranking"), FLEET).await.text(),
            "ranking is resting"
        );
    }
    let asked = gets() - before;
    assert!(asked < 10, "Redis was asked {asked} times for 20 requests");

    // For a moment the backend answers the second instance, which keeps a new copy.
    failing.store(0, Ordering::SeqCst);
    version.store(2, Ordering::SeqCst);
    assert_eq!(
        get_with(&second.url("/ranking"), FLEET).await.text(),
        "/ranking v2"
    );
    failing.store(1, Ordering::SeqCst);

    // The first instance's own copy is too old, so it looks in Redis and finds the new one
    // (before that one is max_age old).
    eventually(
        Duration::from_millis(2500),
        "the first instance to serve the copy the second stored",
        || async {
            let answer = get_with(&first.url("/ranking"), FLEET).await;
            answer.status == 200
                && answer.text() == "/ranking v2"
                && answer.header("x-levee-stale") == Some("1")
        },
    )
    .await;
}

/// A page with no copy anywhere, asked for again and again while its route is off (a
/// cache-busting query, a page nobody fetched while the route was healthy), costs a Redis
/// read once in a tenth of max_age, not on every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_with_no_copy_is_not_looked_for_in_redis_on_every_request() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _, _) = versioned().await;
    let policy = ranking_resting_with_redis(
        &backend,
        &redis,
        "degrade = { action = \"stale\", max_age = \"60s\" }",
    );
    let levee = Levee::start(&policy).await;
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let gets = || redis.calls("get");
    let before = gets();
    for _ in 0..20 {
        assert_eq!(
            get(&levee.url("/ranking?week=9")).await.text(),
            "ranking is resting"
        );
    }
    let asked = gets() - before;
    assert!(asked < 10, "Redis was asked {asked} times for 20 requests");
    assert!(asked >= 1, "Redis was looked in first");
}

/// In a Redis Cluster, reads of stale copies follow the health breaker of the node holding
/// each copy: with one node frozen, an instance that never saw the pages still serves the
/// copies the other nodes hold, after the copies on the frozen node failed twice. A route's
/// copies share its hash tag, so the routes here are named to land on different nodes; the
/// store script and its index work on the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_on_the_cluster_nodes_still_up_are_served_while_one_node_is_out() {
    let dir = tempfile::tempdir().expect("dir");
    let cluster = RedisCluster::start(dir.path()).await;
    let (backend, _, _) = versioned().await;
    let key = |route: &str, path: &str, week: u32| {
        levee::degrade::stale::copy_key(
            "levee:",
            route,
            "127.0.0.1",
            path,
            Some(&format!("week={week}")),
            &[],
        )
    };
    let out_node = cluster.owner(&key("ranking", "/ranking", 0).key);
    let other = (1..)
        .map(|n| format!("top{n}"))
        .find(|name| cluster.owner(&key(name, "/top", 0).key) != out_node)
        .expect("a route name on another node");
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!(
            "[redis]\ncluster = [{}]\ntimeout = \"200ms\"\nfailures_to_open = 2\ncooldown = \"1h\"\n[degrade]\nsync_interval = \"100ms\"\n{ROUTES}\n[[route]]\nname = \"{other}\"\nmatch = {{ path_prefix = \"/top\" }}\ntier = 3\nmodule = \"ranking\"\ndegrade = {{ action = \"stale\", max_age = \"10m\" }}\n",
            cluster.toml_list()
        ),
    );
    let (kept, probe) = (1, 2);
    let first = Levee::start(&policy).await;
    for (route, path, week) in [
        ("ranking", "/ranking", 0),
        (other.as_str(), "/top", kept),
        (other.as_str(), "/top", probe),
    ] {
        assert_eq!(
            get_with(&first.url(&format!("{path}?week={week}")), FLEET)
                .await
                .text(),
            format!("{path} v1")
        );
        let key = key(route, path, week);
        eventually(Duration::from_secs(10), "the copy in redis", || async {
            cluster
                .cli(cluster.owner(&key.key), &["EXISTS", &key.key])
                .trim()
                == "1"
        })
        .await;
    }
    let index = key(&other, "/top", 0).index;
    assert_eq!(
        cluster
            .cli(cluster.owner(&index), &["ZCARD", &index])
            .trim(),
        "2",
        "the route's index names its two copies"
    );
    assert_eq!(set(&first, "/modules/ranking", "off").await.status, 200);

    // An instance that has no copy of its own: it reads them from the cluster.
    let second = Levee::start(&policy).await;
    let probe_path = format!("/top?week={probe}");
    eventually(Duration::from_secs(10), "the switch followed", || async {
        get_with(&second.url(&probe_path), FLEET)
            .await
            .header("x-levee-stale")
            == Some("1")
    })
    .await;
    // The first read that counts against a node waited for the slot map: had it gone on
    // without, every key would stand with one stand-in node, and the frozen node's failures
    // below would cut off the copies on the others too.
    let out = format!(
        "levee_redis_node_up{{node=\"127.0.0.1:{}\"}}",
        cluster.ports[out_node]
    );
    let metrics = get(&second.admin_url("/metrics")).await.text();
    assert_eq!(metric_value(&metrics, &out), 1.0, "{metrics}");

    cluster.pause(out_node, true);
    for _ in 0..3 {
        let missing = get_with(&second.url("/ranking?week=0"), FLEET).await;
        assert_eq!(missing.header("x-levee-stale"), None, "{}", missing.text());
    }
    let copy = get_with(&second.url(&format!("/top?week={kept}")), FLEET).await;
    let metrics = get(&second.admin_url("/metrics")).await.text();
    cluster.pause(out_node, false);
    assert_eq!(
        (
            copy.status,
            copy.text().as_str(),
            copy.header("x-levee-stale")
        ),
        (200, "/top v1", Some("1"))
    );
    assert_eq!(metric_value(&metrics, &out), 0.0, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_answers_only_the_host_it_was_fetched_for() {
    // One PHP vhost often serves several sites (a forum per subdomain) under one route: the
    // copy of one site's page must never answer for another.
    let backend = Backend::start(|request: Request<Incoming>| {
        let host = request
            .headers()
            .get("host")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_string();
        async move { html(format!("ranking of {host}")) }
    })
    .await;
    let levee = levee_resting(&backend).await;
    let for_host = |host: &'static str| {
        let url = levee.url("/ranking");
        async move { get_with(&url, &[("host", host)]).await }
    };
    assert_eq!(for_host("a.example").await.text(), "ranking of a.example");

    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let other = for_host("b.example").await;
    assert_eq!(
        (other.status, other.text().as_str()),
        (503, "ranking is resting"),
        "b.example has no copy of its own"
    );
    let own = for_host("a.example").await;
    assert_eq!(
        (own.status, own.text().as_str(), own.header("x-levee-stale")),
        (200, "ranking of a.example", Some("1"))
    );
}

/// Apps behind a trusted front build their links from `X-Forwarded-Host` (and the scheme
/// from `X-Forwarded-Proto`). nginx passes a visitor's own `X-Forwarded-Host` on unless told
/// otherwise: kept for everyone, the page it made would send every visitor's browser to the
/// host that one visitor named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_made_for_another_forwarded_host_or_scheme_answers_only_those() {
    let backend = Backend::start(|request: Request<Incoming>| {
        let said = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .unwrap_or("-")
                .to_string()
        };
        let page = format!(
            "<script src=\"{}://{}/app.js\">",
            said("x-forwarded-proto"),
            said("x-forwarded-host")
        );
        async move { html(page) }
    })
    .await;
    let levee = levee_resting(&backend).await;
    let fetch = |claims: &'static [(&'static str, &'static str)]| {
        let url = levee.url("/ranking");
        async move { get_with(&url, claims).await }
    };
    let evil: &[(&str, &str)] = &[("x-forwarded-host", "evil.example")];
    assert_eq!(
        fetch(evil).await.text(),
        "<script src=\"http://evil.example/app.js\">"
    );
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    for others in [
        &[][..],
        &[("x-forwarded-host", "shop.example")][..],
        &[
            ("x-forwarded-host", "evil.example"),
            ("x-forwarded-proto", "https"),
        ][..],
        &[("forwarded", "host=evil.example")][..],
    ] {
        let answer = fetch(others).await;
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (503, "ranking is resting"),
            "{others:?} has no copy of its own"
        );
    }
    let own = fetch(evil).await;
    assert_eq!(
        (own.status, own.header("x-levee-stale")),
        (200, Some("1")),
        "{}",
        own.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_does_not_carry_the_rate_limit_state_of_the_client_it_was_fetched_for() {
    // The RateLimit fields tell one client what is left of its own quota; a copy served to
    // everyone else must not repeat them.
    let (backend, _, failing) = versioned().await;
    let routes = ROUTES.replace(
        "module = \"ranking\"",
        "module = \"ranking\"\nlimits = [\"per_ip\"]",
    );
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("[limit.per_ip]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 50\nheaders_on_allow = true\n{routes}"),
    );
    let levee = Levee::start(&policy).await;
    let as_client = |ip: &'static str| {
        let url = levee.url("/ranking");
        async move { get_with(&url, &[("x-forwarded-for", ip)]).await }
    };
    let fresh = as_client("203.0.113.1").await;
    assert_eq!(fresh.text(), "/ranking v1");
    assert!(fresh.header("ratelimit").is_some(), "{:?}", fresh.headers);

    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let copy = as_client("203.0.113.2").await;
    assert_eq!(
        (copy.text().as_str(), copy.header("x-levee-stale")),
        ("/ranking v1", Some("1"))
    );
    assert_eq!(
        (copy.header("ratelimit"), copy.header("ratelimit-policy")),
        (None, None),
        "another client's quota in the copy"
    );

    // Served because the app fails, after this client passed the limits: its own quota.
    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);
    failing.store(1, Ordering::SeqCst);
    let if_error = as_client("203.0.113.3").await;
    assert_eq!(
        (if_error.text().as_str(), if_error.header("x-levee-stale")),
        ("/ranking v1", Some("1"))
    );
    assert!(
        if_error
            .header("ratelimit")
            .is_some_and(|state| state.contains(";r=49;")),
        "{:?}",
        if_error.headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_fetched_with_credentials_is_not_kept_for_everyone() {
    // An answer to a request with `Authorization` is that user's (RFC 9111 3.5): a shared
    // copy of it would show one user's page to every client.
    let backend = Backend::start(|request: Request<Incoming>| {
        let user = request
            .headers()
            .get("authorization")
            .map(|_| "alice's ranking")
            .unwrap_or("public ranking");
        async move { html(user) }
    })
    .await;
    let levee = levee_resting(&backend).await;
    let with_credentials = get_with(
        &levee.url("/ranking"),
        &[("authorization", "Basic YWxpY2U6c2VjcmV0")],
    )
    .await;
    assert_eq!(with_credentials.text(), "alice's ranking");

    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let anonymous = get(&levee.url("/ranking")).await;
    assert_eq!(
        (anonymous.status, anonymous.text().as_str()),
        (503, "ranking is resting")
    );
}

/// The pages WordPress makes for a logged-in user (marked `no-cache, must-revalidate,
/// max-age=0`, no more) and for a commenter (its `comment_author_*` cookies fill in the form,
/// with no `Cache-Control` at all), and a custom app's member page marked `no-cache`.
async fn personal_pages() -> Backend {
    Backend::start(|request: Request<Incoming>| {
        let cookies = request
            .headers()
            .get("cookie")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_string();
        async move {
            let (page, cache_control) = if cookies.contains("wordpress_logged_in_") {
                ("Howdy, admin", Some("no-cache, must-revalidate, max-age=0"))
            } else if cookies.contains("comment_author_") {
                ("Eve's comment is awaiting moderation", None)
            } else if cookies.contains("member=") {
                ("member page", Some("no-cache"))
            } else {
                ("public ranking", None)
            };
            // Slow enough for another request to come while it is made.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut response = html(page);
            if let Some(value) = cache_control {
                response
                    .headers_mut()
                    .insert("cache-control", http::HeaderValue::from_static(value));
            }
            response
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logged_in_or_commenters_page_is_never_anyone_elses_copy_nor_shared_fetch() {
    let backend = personal_pages().await;
    let levee = levee_resting(&backend).await;
    // An anonymous visitor (with an analytics cookie, as nearly all have) asks for the page
    // while a commenter's is being made: it gets its own, not the commenter's.
    for private in [
        "comment_author_1e20ea=Eve; _ga=1",
        "wordpress_logged_in_1e20ea=admin%7C123",
    ] {
        let path = format!("/ranking/{}", &private[..8]);
        let url = levee.url(&path);
        let first = tokio::spawn(async move { get_with(&url, &[("cookie", private)]).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let anonymous = get_with(&levee.url(&path), &[("cookie", "_ga=2")]).await;
        assert_eq!(anonymous.text(), "public ranking", "{private}");
        assert_ne!(first.await.expect("task").text(), "public ranking");
    }
    // None of these pages is kept: with the route off, an anonymous visitor gets the
    // fallback, not another's page.
    for (cookie, page) in [
        ("wordpress_logged_in_1e20ea=admin%7C123", "Howdy, admin"),
        (
            "comment_author_email_1e20ea=eve%40example.com",
            "Eve's comment is awaiting moderation",
        ),
        ("member=42; _ga=1", "member page"),
    ] {
        assert_eq!(
            get_with(&levee.url("/ranking/kept"), &[("cookie", cookie)])
                .await
                .text(),
            page
        );
    }
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let anonymous = get(&levee.url("/ranking/kept")).await;
    assert_eq!(
        (anonymous.status, anonymous.text().as_str()),
        (503, "ranking is resting")
    );
    // A logged-in user is not given an anonymous copy either.
    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);
    assert_eq!(
        get(&levee.url("/ranking/public")).await.text(),
        "public ranking"
    );
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let stored = get(&levee.url("/ranking/public")).await;
    assert_eq!(stored.header("x-levee-stale"), Some("1"));
    let logged_in = get_with(
        &levee.url("/ranking/public"),
        &[("cookie", "wordpress_logged_in_1e20ea=admin%7C123")],
    )
    .await;
    assert_eq!(
        (logged_in.status, logged_in.text().as_str()),
        (503, "ranking is resting")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_revalidating_its_cached_page_gets_the_page_as_the_switches_have_it_now() {
    // A browser that cached the page while a module was on asks again with its validator; the
    // app, whose page did not change, says 304 — and the browser would go on showing the block
    // the operator switched off. Likewise a page cached while the module was off would come
    // back without it once on.
    const LAST_MODIFIED: &str = "Mon, 30 Nov 2026 10:00:00 GMT";
    let backend = Backend::start(|request: Request<Incoming>| {
        let conditional = request.headers().contains_key("if-modified-since")
            || request.headers().contains_key("if-none-match");
        async move {
            if conditional {
                return Response::builder()
                    .status(304)
                    .header("last-modified", LAST_MODIFIED)
                    .header("etag", "\"v1\"")
                    .body(full(""))
                    .expect("response");
            }
            Response::builder()
                .header("content-type", "text/html")
                .header("last-modified", LAST_MODIFIED)
                .header("etag", "\"v1\"")
                .header("cache-control", "public, max-age=600")
                .header("expires", "Mon, 30 Nov 2026 10:10:00 GMT")
                .header("x-accel-expires", "600")
                .header("surrogate-control", "max-age=600")
                .header("cdn-cache-control", "max-age=600")
                .header("accept-ranges", "bytes")
                .body(full("<p>home</p><div id=\"visitors\">42 online</div>"))
                .expect("response")
        }
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "match = { path = \"/\" }",
        "match = { path = \"/\" }\nhide = { visitors = \"#visitors\" }",
    )
    .await;
    let revalidate = |url: String| async move {
        get_with(
            &url,
            &[
                ("if-modified-since", LAST_MODIFIED),
                ("if-none-match", "\"v1\""),
            ],
        )
        .await
    };
    let cached = get(&levee.url("/")).await;
    assert_eq!(
        cached.text(),
        "<p>home</p><div id=\"visitors\">42 online</div>"
    );

    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let again = revalidate(levee.url("/")).await;
    assert_eq!(
        (again.status, again.text().as_str()),
        (200, "<p>home</p>"),
        "the module switched off is gone from a revalidated page too"
    );
    assert_eq!(
        (again.header("etag"), again.header("last-modified")),
        (None, None),
        "a page cut by the switches carries no validator of the app's page"
    );
    assert_eq!(
        (again.header("cache-control"), again.header("expires")),
        (Some("no-cache"), None),
        "nor is it kept for the app's page's lifetime"
    );
    // Nor by a front nginx's proxy_cache (`X-Accel-Expires` comes before Cache-Control there)
    // or a CDN; and its bytes are not the app's to take ranges of.
    for name in [
        "x-accel-expires",
        "surrogate-control",
        "cdn-cache-control",
        "accept-ranges",
    ] {
        assert_eq!(again.header(name), None, "{name}");
    }
    assert_eq!(set(&levee, "/modules/visitors", "on").await.status, 200);
    let whole = get(&levee.url("/")).await;
    assert_eq!(
        whole.header("cache-control"),
        Some("public, max-age=600"),
        "the app's page as it sent it"
    );
}

/// A redirect on a route that hides modules keeps the app's fields: WordPress's canonical
/// 301 (text/html, an empty body) came back marked `no-cache` while a module was off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_on_a_route_that_hides_modules_is_passed_as_the_app_sent_it() {
    let backend = Backend::start(|_request: Request<Incoming>| async move {
        Response::builder()
            .status(301)
            .header("content-type", "text/html; charset=UTF-8")
            .header("location", "/2026/12/hello-world/")
            .header("cache-control", "max-age=3600")
            .header("content-length", "0")
            .body(full(""))
            .expect("response")
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "match = { path = \"/\" }",
        "match = { path = \"/\" }\nhide = { visitors = \"#visitors\" }",
    )
    .await;
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let answer = get(&levee.url("/")).await;
    assert_eq!(answer.status, 301);
    assert_eq!(answer.header("cache-control"), Some("max-age=3600"));
    assert_eq!(answer.header("location"), Some("/2026/12/hello-world/"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_a_page_with_modules_hidden_is_never_a_cut_up_piece_of_the_apps_page() {
    // Bytes 11 to 30 of the app's page are not bytes 11 to 30 of the page levee sends once a
    // block is cut out: a client that resumes or splits a download would stitch the two.
    const PAGE: &str = "<p>home</p><div id=\"visitors\">42 online</div><p>end</p>";
    let backend = Backend::start(|request: Request<Incoming>| {
        let ranged = request.headers().contains_key("range");
        async move {
            if ranged {
                return Response::builder()
                    .status(206)
                    .header("content-type", "text/html")
                    .header("content-range", format!("bytes 11-30/{}", PAGE.len()))
                    .body(full(&PAGE[11..=30]))
                    .expect("response");
            }
            html(PAGE)
        }
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "match = { path = \"/\" }",
        "match = { path = \"/\" }\nhide = { visitors = \"#visitors\" }",
    )
    .await;
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let ranged = get_with(&levee.url("/"), &[("range", "bytes=11-30")]).await;
    assert_eq!(
        (ranged.status, ranged.text().as_str()),
        (200, "<p>home</p><p>end</p>"),
        "content-range {:?}",
        ranged.header("content-range")
    );

    // An app that answers a range nobody asked for: its part is passed as it is (scanned,
    // it could lose bytes its Content-Range counts).
    let partial = Backend::start(|_request: Request<Incoming>| async move {
        Response::builder()
            .status(206)
            .header("content-type", "text/html")
            .header("content-range", format!("bytes 11-44/{}", PAGE.len()))
            .body(full(&PAGE[11..=44]))
            .expect("response")
    })
    .await;
    let levee = levee_with_routes(
        &partial,
        "match = { path = \"/\" }",
        "match = { path = \"/\" }\nhide = { visitors = \"#visitors\" }",
    )
    .await;
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let answer = get(&levee.url("/")).await;
    assert_eq!(
        (answer.status, answer.text().as_str()),
        (206, &PAGE[11..=44])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_busting_queries_share_a_copy_and_a_route_keeps_at_most_max_copies() {
    // `?week=N` selects the page; `_=…` and `utm_source` only bust caches. Before, each busted
    // URL stored a copy of its own in Redis (and in memory) for max_age.
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, version, _) = versioned().await;
    let policy = ranking_resting_with_redis(
        &backend,
        &redis,
        "degrade = { action = \"stale\", max_age = \"60s\", query = [\"week\"], max_copies = 3 }",
    );
    let levee = Levee::start(&policy).await;
    let key = |week: u32| {
        levee::degrade::stale::copy_key(
            "levee:",
            "ranking",
            &levee.public.to_string(),
            "/ranking",
            Some(&format!("week={week}")),
            &[],
        )
    };
    for week in 1..=5 {
        for buster in 0..3 {
            let path = format!("/ranking?_={week}{buster}&week={week}&utm_source=x{buster}");
            assert_eq!(get(&levee.url(&path)).await.text(), "/ranking v1");
        }
        // Stored one after the other: the index orders them by store time.
        let key = key(week).key;
        eventually(Duration::from_secs(10), "the copy in redis", || async {
            redis.cli(&["EXISTS", &key]).trim() == "1"
        })
        .await;
    }
    let index = key(1).index;
    assert_eq!(redis.cli(&["ZCARD", &index]).trim(), "3");
    let stored = redis.cli(&["KEYS", "levee:stale:*"]);
    let mut stored: Vec<&str> = stored.lines().filter(|line| !line.is_empty()).collect();
    stored.sort_unstable();
    let mut expected = vec![key(3).key, key(4).key, key(5).key, index.clone()];
    expected.sort_unstable();
    assert_eq!(stored, expected, "three copies and the index, nothing else");

    version.store(2, Ordering::SeqCst);
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    // Another order, another buster: the same copy.
    let copy = get(&levee.url("/ranking?utm_source=y&week=5&_=999")).await;
    assert_eq!(
        (
            copy.status,
            copy.text().as_str(),
            copy.header("x-levee-stale")
        ),
        (200, "/ranking v1", Some("1"))
    );
    // The oldest copies are gone from memory as from Redis.
    for week in [1, 2] {
        let gone = get(&levee.url(&format!("/ranking?week={week}"))).await;
        assert_eq!(
            (gone.status, gone.text().as_str()),
            (503, "ranking is resting"),
            "week {week}"
        );
    }
    assert_eq!(
        get(&levee.url("/ranking?week=3"))
            .await
            .header("x-levee-stale"),
        Some("1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_wait_for_another_fetch_get_their_own_rate_limit_fields() {
    // A request served the copy that another request was fetching passed the limits itself,
    // and is told its own quota, as it would be on a page fetched for it.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = gate.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let held = held.clone();
        async move {
            if request.uri().path() == "/ranking/gated" {
                held.acquire().await.expect("gate").forget();
            }
            html("ranking")
        }
    })
    .await;
    let routes = ROUTES.replace(
        "module = \"ranking\"",
        "module = \"ranking\"\nlimits = [\"per_ip\"]",
    );
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("[limit.per_ip]\nkey = [\"ip\"]\nrate = \"1/min\"\nburst = 50\nheaders_on_allow = true\n{routes}"),
    );
    let levee = Levee::start(&policy).await;
    let as_client = |ip: &'static str, path: &'static str| {
        let url = levee.url(path);
        async move { get_with(&url, &[("x-forwarded-for", ip)]).await }
    };
    // The waiter has used some of its quota already.
    for _ in 0..3 {
        assert_eq!(as_client("203.0.113.2", "/ranking/other").await.status, 200);
    }

    let hits = backend.hits();
    let leader = tokio::spawn(as_client("203.0.113.1", "/ranking/gated"));
    eventually(Duration::from_secs(5), "the leader upstream", || async {
        backend.hits() > hits
    })
    .await;
    let waiter = tokio::spawn(as_client("203.0.113.2", "/ranking/gated"));
    eventually(Duration::from_secs(5), "the waiter in levee", || async {
        let metrics = get(&levee.admin_url("/metrics")).await.text();
        metric_value(&metrics, "levee_inflight_requests") >= 2.0
    })
    .await;
    gate.add_permits(1);
    let (leader, waiter) = (leader.await.expect("leader"), waiter.await.expect("waiter"));
    assert_eq!(
        backend.hits(),
        hits + 1,
        "the waiter was served the leader's fetch"
    );
    assert_eq!(
        (leader.text(), waiter.text()),
        ("ranking".into(), "ranking".into())
    );
    let remaining = |answer: &Answer| {
        answer
            .header("ratelimit")
            .and_then(|state| state.split(';').find_map(|part| part.strip_prefix("r=")))
            .map(str::to_string)
    };
    assert_eq!(
        remaining(&leader).as_deref(),
        Some("49"),
        "{:?}",
        leader.headers
    );
    assert_eq!(
        remaining(&waiter).as_deref(),
        Some("46"),
        "{:?}",
        waiter.headers
    );
    assert_eq!(
        waiter.header("ratelimit-policy"),
        leader.header("ratelimit-policy")
    );
    assert!(waiter.header("ratelimit-policy").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_for_a_copy_do_not_wait_on_a_leader_whose_client_stops_reading() {
    // The copy is complete only once the leading request's client has read the whole page: a
    // client that stops reading a large page held every request waiting for the copy until the
    // upstream's response timeout (30 s here).
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SIZE: usize = 12 << 20;
    let page = Bytes::from(vec![b'x'; SIZE]);
    let backend = Backend::start(move |_request: Request<Incoming>| {
        let page = page.clone();
        async move { html(page) }
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"60s\", max_body = \"16MiB\" }",
    )
    .await;

    // The leader reads the head of the page, then nothing more (and keeps its connection).
    let mut leader = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    leader
        .write_all(b"GET /ranking/big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("write");
    let mut head = Vec::new();
    while !head.windows(4).any(|window| window == b"\r\n\r\n") {
        let mut chunk = [0u8; 1024];
        let read = leader.read(&mut chunk).await.expect("read");
        assert!(read > 0, "levee closed the connection");
        head.extend_from_slice(&chunk[..read]);
    }
    assert_eq!(status_of(&String::from_utf8_lossy(&head)), Some(200));
    assert_eq!(backend.hits(), 1);

    // A request for the same page waits for the copy a moment, then fetches it itself.
    let waiter = tokio::time::timeout(Duration::from_secs(10), get(&levee.url("/ranking/big")))
        .await
        .expect("the waiter is answered long before the leader's fetch ends");
    assert_eq!(
        (
            waiter.status,
            waiter.body.len(),
            waiter.header("x-levee-stale")
        ),
        (200, SIZE, None)
    );
    assert_eq!(backend.hits(), 2, "the waiter fetched the page itself");
    drop(leader);
}

/// A PHP page that flushes its first 4 KiB at once (Debian's php-fpm `output_buffering`) and
/// then runs a slow query. Requests for it meanwhile wait for that one fetch: they went to
/// php-fpm each a second after its head came, taking a worker for as long as the leader's
/// (seen: 46 renders of a home page in 20 s on a pool of 4, tier-1 requests shed). When the
/// page is still coming at their response timeout, they get the last good copy, marked stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_of_a_page_the_app_is_still_writing_wait_for_its_one_fetch() {
    use futures_util::StreamExt;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    // The query takes 1.8 s, or (`gated`) until the test opens the gate.
    let gated = Arc::new(AtomicU8::new(0));
    let (open, gate) = tokio::sync::watch::channel(false);
    let renders = Arc::new(AtomicUsize::new(0));
    let (g, r) = (gated.clone(), renders.clone());
    let backend = Backend::start(move |_request: Request<Incoming>| {
        let render = r.fetch_add(1, Ordering::SeqCst) + 1;
        let (gated, mut gate) = (g.load(Ordering::SeqCst) == 1, gate.clone());
        async move {
            let head = Bytes::from(format!("<html><head>{}</head>", " ".repeat(5000)));
            let rest = async move {
                if gated {
                    let _ = gate.wait_for(|open| *open).await;
                } else {
                    tokio::time::sleep(Duration::from_millis(1800)).await;
                }
                Bytes::from(format!("<body>render {render}</body></html>"))
            };
            let pieces = futures_util::stream::once(async move { head })
                .chain(futures_util::stream::once(rest))
                .map(|bytes| Ok::<_, BoxError>(Frame::data(bytes)));
            Response::builder()
                .header("content-type", "text/html")
                .body(StreamBody::new(pieces).boxed_unsync())
                .expect("response")
        }
    })
    .await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("response_timeout = \"3s\"\n{ROUTES}"),
    );
    let levee = Levee::start(&policy).await;
    let url = levee.url("/ranking");
    let spawn_get = || {
        let url = url.clone();
        tokio::spawn(async move { get(&url).await })
    };

    // No copy yet: the readers get the page the leader's fetch brings, once it is in.
    let leader = spawn_get();
    eventually(
        Duration::from_secs(5),
        "the leader's fetch upstream",
        || async { backend.hits() == 1 },
    )
    .await;
    let readers: Vec<_> = (0..4).map(|_| spawn_get()).collect();
    assert!(leader
        .await
        .expect("leader")
        .text()
        .ends_with("render 1</body></html>"));
    let readers = futures_util::future::join_all(readers).await;
    assert_eq!(
        backend.hits(),
        1,
        "one render for the leader and its readers"
    );
    for reader in readers {
        let reader = reader.expect("reader");
        assert_eq!(
            (
                reader.status,
                reader.header("x-levee-stale"),
                reader.text().ends_with("render 1</body></html>")
            ),
            (200, None, true)
        );
    }

    // The next fetch's page is still coming when the readers' response timeout (3 s) runs
    // out: that timeout bounds the wait for the head, which came, so they go on waiting for
    // the page (they got a 504 while the leader got the page), and still no render of their
    // own.
    gated.store(1, Ordering::SeqCst);
    let leader = spawn_get();
    eventually(
        Duration::from_secs(5),
        "the second fetch upstream",
        || async { backend.hits() == 2 },
    )
    .await;
    let readers: Vec<_> = (0..4).map(|_| spawn_get()).collect();
    // Past the readers' response timeout, on levee's real clock.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(
        readers.iter().all(|reader| !reader.is_finished()),
        "the readers wait for the page still coming"
    );
    assert!(!leader.is_finished(), "the page is still coming");
    open.send_replace(true);
    for reader in readers.into_iter().chain([leader]) {
        let reader = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .expect("answered once the page is in")
            .expect("reader");
        assert_eq!(
            (
                reader.status,
                reader.header("x-levee-stale"),
                reader.text().ends_with("render 2</body></html>")
            ),
            (200, None, true)
        );
    }
    assert_eq!(backend.hits(), 2, "the readers waited for the one fetch");
}

/// A visitor gives up on a slow page midway and reloads (common in a surge): the fetch its
/// request led goes on without it, and the requests waiting for it get the page when the app
/// is done with it. They all went to the app at once when the visitor left, each taking a
/// php-fpm worker, exactly when the app was slow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_of_a_page_still_get_its_one_fetch_when_the_fetching_client_leaves_midway() {
    use futures_util::StreamExt;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The page's head comes at once, its next part at stage 1 and the rest at stage 2, as the
    // test says.
    let (stage, stages) = tokio::sync::watch::channel(0u8);
    let renders = Arc::new(AtomicUsize::new(0));
    let r = renders.clone();
    let backend = Backend::start(move |_request: Request<Incoming>| {
        let render = r.fetch_add(1, Ordering::SeqCst) + 1;
        let (mut first, mut second) = (stages.clone(), stages.clone());
        async move {
            let head = Bytes::from(format!("<html><head>{}</head>", " ".repeat(5000)));
            let body = async move {
                let _ = first.wait_for(|stage| *stage >= 1).await;
                Bytes::from_static(b"<body>")
            };
            let end = async move {
                let _ = second.wait_for(|stage| *stage >= 2).await;
                Bytes::from(format!("render {render}</body></html>"))
            };
            let pieces = futures_util::stream::once(async move { head })
                .chain(futures_util::stream::once(body))
                .chain(futures_util::stream::once(end))
                .map(|bytes| Ok::<_, BoxError>(Frame::data(bytes)));
            Response::builder()
                .header("content-type", "text/html")
                .body(StreamBody::new(pieces).boxed_unsync())
                .expect("response")
        }
    })
    .await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("response_timeout = \"20s\"\n{ROUTES}"),
    );
    let levee = Levee::start(&policy).await;
    let inflight = || async {
        metric_value(
            &get(&levee.admin_url("/metrics")).await.text(),
            "levee_inflight_requests",
        )
    };

    // The leader gets the head and the first bytes of the page.
    let mut leader = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    // With the `Host` the readers send: the same copy.
    let request = format!("GET /ranking HTTP/1.1\r\nHost: {}\r\n\r\n", levee.public);
    leader.write_all(request.as_bytes()).await.expect("write");
    let mut read = Vec::new();
    while !read.windows(12).any(|window| window == b"<html><head>") {
        let mut chunk = [0u8; 4096];
        let got = leader.read(&mut chunk).await.expect("read");
        assert!(got > 0, "levee closed the connection");
        read.extend_from_slice(&chunk[..got]);
    }
    assert_eq!(status_of(&String::from_utf8_lossy(&read)), Some(200));
    let url = levee.url("/ranking");
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { get(&url).await })
        })
        .collect();
    eventually(Duration::from_secs(5), "the readers in levee", || async {
        inflight().await == 5.0
    })
    .await;

    // The leader's visitor leaves (a reset, as a browser that moved on); levee finds out when
    // it passes on the next part of the page.
    leader.set_zero_linger().expect("linger");
    drop(leader);
    stage.send_replace(1);
    eventually(
        Duration::from_secs(5),
        "the leader's request gone from levee",
        || async { inflight().await == 4.0 },
    )
    .await;
    stage.send_replace(2);
    for reader in readers {
        let reader = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .expect("the reader is answered once the page is in")
            .expect("reader");
        let text = reader.text();
        assert_eq!((reader.status, reader.header("x-levee-stale")), (200, None));
        assert!(
            text.ends_with("<body>render 1</body></html>"),
            "{}",
            text.get(text.len().saturating_sub(40)..)
                .unwrap_or_default()
        );
    }
    assert_eq!(
        (renders.load(Ordering::SeqCst), backend.hits()),
        (1, 1),
        "one render for the leader and its readers"
    );
}

/// With a route at `max_copies = 2`, three pages fetched one after the other leave the two
/// newest copies and an index of two in Redis: the store script runs where `redis` points.
async fn keeps_the_newest_copies_in(redis: &str, cli: impl Fn(&str, &[&str]) -> String) {
    let (backend, _, _) = versioned().await;
    let routes = ROUTES.replace(
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"60s\", max_copies = 2 }",
    );
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("{redis}\n{routes}"),
    );
    let levee = Levee::start(&policy).await;
    let key = |week: u32| {
        levee::degrade::stale::copy_key(
            "levee:",
            "ranking",
            &levee.public.to_string(),
            "/ranking",
            Some(&format!("week={week}")),
            &[],
        )
    };
    for week in 1..=3 {
        let path = format!("/ranking?week={week}");
        assert_eq!(get(&levee.url(&path)).await.text(), "/ranking v1");
        let key = key(week).key;
        eventually(Duration::from_secs(5), "the copy in redis", || async {
            cli(&key, &["EXISTS", &key]).trim() == "1"
        })
        .await;
    }
    // Deleted by the script that stored the third copy.
    let first = key(1).key;
    assert_eq!(cli(&first, &["EXISTS", &first]).trim(), "0");
    assert_eq!(cli(&key(2).key, &["EXISTS", &key(2).key]).trim(), "1");
    let index = key(1).index;
    assert_eq!(cli(&index, &["ZCARD", &index]).trim(), "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_oldest_copies_are_deleted_on_a_redis_cluster_and_behind_sentinel() {
    let dir = tempfile::tempdir().expect("dir");
    let cluster = RedisCluster::start(&dir.path().join("cluster")).await;
    keeps_the_newest_copies_in(
        &format!("[redis]\ncluster = [{}]", cluster.toml_list()),
        |key, args| cluster.cli(cluster.owner(key), args),
    )
    .await;

    let group = RedisSentinel::start(&dir.path().join("sentinel")).await;
    keeps_the_newest_copies_in(
        &format!(
            "[redis]\n[redis.sentinel]\nnodes = [\"{}\"]\nmaster = \"{SENTINEL_MASTER}\"",
            group.sentinel_url()
        ),
        |_, args| group.master.cli(args),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookies_that_are_not_utf8_select_copies_of_their_own() {
    // `lang=%E9` and `lang=%E8` are Latin-1 `é` and `è` to PHP. Read as text, both were U+FFFD:
    // one copy, so while the app failed one language's visitors got the other's page.
    let failing = Arc::new(AtomicU8::new(0));
    let fail = failing.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let cookie = request
            .headers()
            .get("cookie")
            .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
            .unwrap_or_default();
        let failed = fail.load(Ordering::SeqCst) == 1;
        async move {
            if failed {
                return Response::builder()
                    .status(502)
                    .body(full("php-fpm is gone"))
                    .expect("response");
            }
            html(format!("page for {cookie}"))
        }
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"60s\", vary = \"cookie:lang\" }",
    )
    .await;
    for lang in ["%E9", "%E8"] {
        let cookie = format!("lang={lang}");
        let page = get_with(&levee.url("/ranking"), &[("cookie", &cookie)]).await;
        assert_eq!(page.text(), format!("page for {cookie}"));
    }
    failing.store(1, Ordering::SeqCst);
    for lang in ["%E9", "%E8"] {
        let cookie = format!("lang={lang}");
        let copy = get_with(&levee.url("/ranking"), &[("cookie", &cookie)]).await;
        assert_eq!(copy.header("x-levee-stale"), Some("1"), "{cookie}");
        assert_eq!(copy.text(), format!("page for {cookie}"));
    }
}

/// A page served again and again refreshes its copy in memory each time, and in Redis about
/// once a second: each answer sent there whole made a busy page as many writes of its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pages_copy_goes_to_redis_about_once_a_second() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _, _) = versioned().await;
    let policy = ranking_resting_with_redis(
        &backend,
        &redis,
        "degrade = { action = \"stale\", max_age = \"60s\" }",
    );
    let levee = Levee::start(&policy).await;
    let evals = || redis.calls("eval");
    for _ in 0..40 {
        assert_eq!(get(&levee.url("/ranking")).await.text(), "/ranking v1");
    }
    eventually(Duration::from_secs(3), "the copy in redis", || async {
        evals() >= 1
    })
    .await;
    // Forty answers in far less than ten seconds, on any machine the tests run on.
    assert!(evals() < 10, "{} stores of one page", evals());
    let keys = redis.cli(&["KEYS", "*ranking*"]);
    assert!(!keys.trim().is_empty(), "{keys}");
}

/// While the Redis health breaker is open, fresh copies are kept in memory only: no store
/// waits out its timeout in the background against a Redis known to be down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_are_not_stored_in_redis_while_its_health_breaker_is_open() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let (backend, _, failing) = versioned().await;
    let redis_url = format!("url = \"{}\"\n", redis.url());
    let policy = ranking_resting_with_redis(
        &backend,
        &redis,
        "degrade = { action = \"stale\", max_age = \"60s\" }",
    )
    .replace(
        &redis_url,
        &format!("{redis_url}timeout = \"200ms\"\nfailures_to_open = 2\ncooldown = \"1h\"\n"),
    );
    let levee = Levee::start(&policy).await;
    let evals = || redis.calls("eval");
    assert_eq!(
        get(&levee.url("/ranking?week=0")).await.text(),
        "/ranking v1"
    );
    eventually(
        Duration::from_secs(3),
        "the first copy in redis",
        || async { evals() == 1 },
    )
    .await;

    // Redis stops answering; two reads of copies that are not in memory open its breaker.
    failing.store(1, Ordering::SeqCst);
    redis.pause(true);
    for week in 1..=2 {
        let answer = get(&levee.url(&format!("/ranking?week={week}"))).await;
        assert_eq!(answer.status, 502, "no copy: the app's own error");
    }
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["redis"]["up"], false, "{status}");
    assert_eq!(status["redis"]["rate_limits"], "fallback", "{status}");

    // The breaker is open (cooldown): the pages levee fetches now are kept in memory and
    // served from there, and none is sent to Redis. One sent would wait in the frozen
    // Redis's socket and run as it thaws, so its count would show it.
    failing.store(0, Ordering::SeqCst);
    for week in 3..=5 {
        let path = format!("/ranking?week={week}");
        assert_eq!(get(&levee.url(&path)).await.text(), "/ranking v1");
    }
    failing.store(1, Ordering::SeqCst);
    let copy = get(&levee.url("/ranking?week=4")).await;
    assert_eq!(
        (copy.text().as_str(), copy.header("x-levee-stale")),
        ("/ranking v1", Some("1"))
    );
    redis.pause(false);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        evals(),
        1,
        "no copy went to redis while its breaker was open"
    );
}

/// An answer that says it differs by the client's cookies (`Vary: Cookie`) is that client's
/// page: requests that arrive together each get their own, and none is kept as a copy for
/// others (RFC 9111 4.1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_varies_by_cookie_is_never_shared() {
    let backend = Backend::start(|request: Request<Incoming>| {
        let cookie = request
            .headers()
            .get("cookie")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_string();
        async move {
            // Slow enough for the three requests to be in flight together.
            tokio::time::sleep(Duration::from_millis(300)).await;
            Response::builder()
                .header("content-type", "text/html")
                .header("vary", "Cookie")
                .body(full(Bytes::from(format!("page for {cookie}"))))
                .expect("response")
        }
    })
    .await;
    let levee = levee_resting(&backend).await;
    let url = levee.url("/ranking");
    let pages = tokio::join!(
        get_with(&url, &[("cookie", "user=alice")]),
        get_with(&url, &[("cookie", "user=bob")]),
        get_with(&url, &[("cookie", "user=carol")]),
    );
    assert_eq!(
        [pages.0.text(), pages.1.text(), pages.2.text()],
        [
            "page for user=alice",
            "page for user=bob",
            "page for user=carol"
        ]
    );
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let anonymous = get(&url).await;
    assert_eq!(
        (anonymous.status, anonymous.text().as_str()),
        (503, "ranking is resting"),
        "no copy was kept"
    );
}

/// `on_status` answers the app's own error (a 500 it sends, which the breaker does not count)
/// with the copy, as nginx's `proxy_cache_use_stale http_500` does, without opening the
/// breaker for every route; a visitor with a private cookie gets the app's answer, as does
/// the route without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_status_serves_the_copy_in_place_of_an_app_error_without_opening_the_breaker() {
    let failing = Arc::new(AtomicU8::new(0));
    let fails = failing.clone();
    let backend = Backend::start(move |request: Request<Incoming>| {
        let path = request.uri().path().to_string();
        let fail = fails.load(Ordering::SeqCst) == 1;
        async move {
            if fail {
                return Response::builder()
                    .status(500)
                    .body(full("database is gone"))
                    .expect("response");
            }
            html(format!("{path} good"))
        }
    })
    .await;
    let routes = ROUTES.replace(
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"10m\", on_status = [500], private_cookies = [\"sid\"] }",
    ) + "\n[[route]]\nname = \"plain\"\nmatch = { path_prefix = \"/plain\" }\ndegrade = { action = \"stale\" }\n";
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", &routes)).await;
    for path in ["/ranking", "/plain"] {
        assert_eq!(get(&levee.url(path)).await.text(), format!("{path} good"));
    }
    failing.store(1, Ordering::SeqCst);
    for _ in 0..12 {
        let answer = get(&levee.url("/ranking")).await;
        assert_eq!(
            (answer.status, answer.header("x-levee-stale"), answer.text()),
            (200, Some("1"), "/ranking good".to_string())
        );
    }
    let private = get_with(&levee.url("/ranking"), &[("cookie", "sid=1")]).await;
    assert_eq!(
        (private.status, private.text().as_str()),
        (500, "database is gone")
    );
    let plain = get(&levee.url("/plain")).await;
    assert_eq!(
        (plain.status, plain.text().as_str()),
        (500, "database is gone")
    );
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["upstreams"][0]["breaker"]["state"], "closed",
        "{status}"
    );
}

/// A HEAD on a route that is off gets the copy's head, as a GET gets the copy, logged as a
/// whole answer (it read `complete=false`, as a cut one); a GET whose client says
/// `Cache-Control: no-store` is answered but not kept (RFC 9111 5.2.1.5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_request_gets_the_copy_and_a_no_store_request_leaves_none() {
    let log = levee_log();
    let backend = Backend::start(|_| async { html("the ranking") }).await;
    let routes = ROUTES.replace(
        "module = \"ranking\"",
        "module = \"ranking\"\nfallback = { status = 503, body = \"ranking is resting\" }",
    );
    let levee = Levee::start(&policy_for(backend.addr, "", &routes)).await;
    let url = levee.url("/ranking");
    let private = get_with(&url, &[("cache-control", "no-store")]).await;
    assert_eq!(private.text(), "the ranking");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    assert_eq!(
        get(&url).await.status,
        503,
        "the no-store answer was not kept"
    );

    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);
    assert_eq!(get(&url).await.text(), "the ranking");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let head = send(
        Request::head(&url)
            .body(full(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(
        (head.status, head.header("x-levee-stale"), head.body.len()),
        (200, Some("1"), 0)
    );
    eventually(Duration::from_secs(2), "the HEAD logged", || async {
        !log.lines_with("method=HEAD").is_empty()
    })
    .await;
    let logged = log.lines_with("method=HEAD");
    assert!(
        logged[0].contains("complete=true") && logged[0].contains("error=\"stale\""),
        "{logged:?}"
    );
    assert_eq!(get(&url).await.text(), "the ranking");
}

/// A request whose key part the app may read otherwise than the key does leaves no copy: a
/// page made for one value would be kept for the readers of another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_app_may_read_otherwise_than_the_key_leaves_no_copy() {
    let backend = Backend::start(|_| async { html("the ranking") }).await;
    let levee = levee_with_routes(
        &backend,
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"10m\", query = [\"week\"], vary = \"cookie:lang\" }\nfallback = { status = 503, body = \"ranking is resting\" }",
    )
    .await;
    // `week` past PHP's first 1000 variables: an app on the default does not see it.
    let padding: Vec<String> = (0..1000).map(|i| format!("a{i}=")).collect();
    let padded = levee.url(&format!("/ranking?{}&week=5", padding.join("&")));
    assert_eq!(get(&padded).await.text(), "the ranking");
    // Two `Cookie` fields: the app gets the last, or both joined, depending on its server.
    let two_cookies = send(
        Request::get(levee.url("/ranking?week=6"))
            .header("cookie", "lang=en")
            .header("cookie", "lang=de")
            .body(full(Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(two_cookies.text(), "the ranking");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    for (path, lang) in [
        ("/ranking?week=5", None),
        ("/ranking?week=6", Some("lang=en")),
    ] {
        let headers: Vec<(&str, &str)> = lang.map(|lang| ("cookie", lang)).into_iter().collect();
        let answer = get_with(&levee.url(path), &headers).await;
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (503, "ranking is resting"),
            "{path}: no copy was kept"
        );
    }
    // A request read the same by both is kept as before.
    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);
    assert_eq!(get(&levee.url("/ranking?week=7")).await.status, 200);
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let kept = get(&levee.url("/ranking?week=7")).await;
    assert_eq!(
        (kept.status, kept.header("x-levee-stale")),
        (200, Some("1"))
    );
}

/// An upstream that does not answer a page within its response timeout does not answer the
/// requests waiting for that fetch either: they are answered with the fetch's own request (the
/// copy, or a 504), not sent upstream to wait as long again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_for_a_fetch_that_timed_out_are_answered_with_it() {
    let backend = Backend::start(|request: Request<Incoming>| async move {
        if request.uri().path() == "/ranking/hang" {
            std::future::pending::<()>().await;
        }
        html("ranking")
    })
    .await;
    let policy = policy_for(
        backend.addr,
        "access_log = false",
        &format!("response_timeout = \"1s\"\n{ROUTES}"),
    );
    let levee = Levee::start(&policy).await;
    let url = levee.url("/ranking/hang");
    let leader = tokio::spawn({
        let url = url.clone();
        async move { get(&url).await }
    });
    eventually(Duration::from_secs(5), "the leader upstream", || async {
        backend.hits() >= 1
    })
    .await;
    let waiter = tokio::spawn(async move { get(&url).await });
    eventually(Duration::from_secs(5), "the waiter in levee", || async {
        let metrics = get(&levee.admin_url("/metrics")).await.text();
        metric_value(&metrics, "levee_inflight_requests") >= 2.0
    })
    .await;
    let (leader, waiter) = (leader.await.expect("leader"), waiter.await.expect("waiter"));
    assert_eq!((leader.status, waiter.status), (504, 504));
    assert_eq!(
        backend.hits(),
        1,
        "the waiter was answered with the fetch, not sent upstream"
    );
}

/// A GET with a body may be read by the app (`php://input`) where the copy's key does not
/// look: its answer is not kept. And its body comes at the client's pace: such a request does
/// not lead the fetch that other readers of the page wait for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_body_neither_leaves_a_copy_nor_holds_the_pages_readers() {
    use tokio::io::AsyncWriteExt;
    let backend = Backend::start(|_| async { html("the ranking") }).await;
    let levee = levee_resting(&backend).await;
    let url = levee.url("/ranking");
    let with_body = send(
        Request::get(&url)
            .body(full(Bytes::from_static(b"week=5")))
            .expect("request"),
    )
    .await;
    assert_eq!(with_body.text(), "the ranking");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    assert_eq!(
        get(&url).await.status,
        503,
        "the answer to a GET with a body was not kept"
    );
    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);

    // One byte of ten, then nothing (within client_body_timeout).
    let mut trickling = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    trickling
        .write_all(b"GET /ranking HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nw")
        .await
        .expect("write");
    eventually(Duration::from_secs(5), "levee reading the body", || async {
        let metrics = get(&levee.admin_url("/metrics")).await.text();
        metric_value(&metrics, "levee_inflight_requests") >= 1.0
    })
    .await;
    // Without the fix this reader waited the upstream's response_timeout (30 s) for a fetch
    // that never went out.
    let reader = tokio::time::timeout(Duration::from_secs(10), get(&url))
        .await
        .expect("the reader is not held by the trickling request");
    assert_eq!(reader.text(), "the ranking");
    drop(trickling);
}

/// A browser revalidating the page (`If-None-Match`) gets the app's 304, which is no copy: it
/// never leads the page's fetch, or every reader waiting on it went upstream when it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revalidating_request_never_leads_the_pages_fetch() {
    let (open, gate) = tokio::sync::watch::channel(false);
    let backend = Backend::start(move |request: Request<Incoming>| {
        let mut gate = gate.clone();
        async move {
            let _ = gate.wait_for(|open| *open).await;
            if request.headers().contains_key("if-none-match") {
                return Response::builder()
                    .status(304)
                    .body(full(Bytes::new()))
                    .expect("response");
            }
            html("the ranking")
        }
    })
    .await;
    let levee = levee_resting(&backend).await;
    let url = levee.url("/ranking");
    let revalidating = {
        let request = Request::get(&url)
            .header("if-none-match", "\"v1\"")
            .body(full(Bytes::new()))
            .expect("request");
        tokio::spawn(send(request))
    };
    eventually(
        Duration::from_secs(5),
        "the revalidation upstream",
        || async { backend.hits() == 1 },
    )
    .await;
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { get(&url).await })
        })
        .collect();
    // One of the readers leads the fetch (the revalidation did not), the others wait for it.
    eventually(
        Duration::from_secs(5),
        "a reader's fetch upstream",
        || async { backend.hits() == 2 },
    )
    .await;
    eventually(Duration::from_secs(5), "every reader at levee", || async {
        let metrics = get(&levee.admin_url("/metrics")).await.text();
        metric_value(&metrics, "levee_inflight_requests") >= 4.0
    })
    .await;
    open.send_replace(true);
    assert_eq!(revalidating.await.expect("join").status, 304);
    for reader in readers {
        assert_eq!(reader.await.expect("join").text(), "the ranking");
    }
    assert_eq!(
        backend.hits(),
        2,
        "the waiting readers were answered with the copy"
    );
}

/// A page whose end is where the upstream closed the connection (no length, no chunks) may be
/// a page cut short: it is passed on, never kept as the copy every reader gets while the
/// route is off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_ends_with_the_connection_is_not_kept() {
    let app = raw_backend(|_| {
        b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: close\r\n\r\nthe ranking, or part of it"
            .to_vec()
    })
    .await;
    let routes = ROUTES.replace(
        "module = \"ranking\"",
        "module = \"ranking\"\nfallback = { status = 503, body = \"ranking is resting\" }",
    );
    let levee = Levee::start(&policy_for(app, "access_log = false", &routes)).await;
    let url = levee.url("/ranking");
    assert_eq!(get(&url).await.text(), "the ranking, or part of it");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let off = get(&url).await;
    assert_eq!(
        (off.status, off.text().as_str()),
        (503, "ranking is resting")
    );
}

/// A copy keeps the app's `Date` (when the page was made) and counts the age the answer came
/// with (its `Age`, from a cache in front of the app) into its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_keeps_the_apps_date_and_the_age_it_came_with() {
    const MADE: &str = "Tue, 01 Dec 2026 10:00:00 GMT";
    let backend = Backend::start(|_| async {
        Response::builder()
            .header("content-type", "text/html")
            .header("date", MADE)
            .header("age", "1")
            .body(full(Bytes::from_static(b"the ranking")))
            .expect("response")
    })
    .await;
    let levee = levee_with_routes(&backend, "max_age = \"10m\"", "max_age = \"60s\"").await;
    assert_eq!(get(&levee.url("/ranking")).await.text(), "the ranking");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let copy = get(&levee.url("/ranking")).await;
    assert_eq!(copy.header("x-levee-stale"), Some("1"));
    assert_eq!(copy.header("date"), Some(MADE));
    let age: u64 = copy
        .header("age")
        .and_then(|age| age.parse().ok())
        .expect("an Age");
    assert!((1..60).contains(&age), "{age}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_left_for_a_module_the_policy_dropped_can_be_handed_back() {
    let backend = echo_backend().await;
    let policy = policy_for(backend.addr, "access_log = false", ROUTES);
    let levee = Levee::start(&policy).await;
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let metrics = || async { get(&levee.admin_url("/metrics")).await.text() };
    assert!(metrics()
        .await
        .contains("levee_module_off{module=\"visitors\"} 1"));
    assert_eq!(set(&levee, "/level", "1").await.status, 200);
    // /status names the switches set, whatever is in effect: the dashboard marks them.
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["modules"]["visitors"]["switch"], "off",
        "{status}"
    );
    assert_eq!(status["degrade"]["runtime_level"], 1, "{status}");
    assert_eq!(set(&levee, "/level", "policy").await.status, 200);
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["runtime_level"],
        serde_json::Value::Null,
        "{status}"
    );
    // The route (and so the module) leaves the policy; its switch stays saved.
    let without = policy.replace("module = \"visitors\"", "");
    assert_ne!(without, policy);
    std::fs::write(levee.policy_file(), &without).expect("rewrite the policy");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    // /status says it is saved though the policy does not have it.
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["saved_not_in_policy"]["modules"]["visitors"]["off"], true,
        "{status}"
    );
    // Nor is it off in the metrics any more (it said 1 until a restart).
    eventually(
        Duration::from_secs(10),
        "the module to leave the metrics",
        || async { !metrics().await.contains("module=\"visitors\"") },
    )
    .await;
    // Switching it on or off is refused (no such module), handing it back is not.
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 400);
    assert_eq!(set(&levee, "/modules/visitors", "policy").await.status, 200);
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["saved_not_in_policy"]["modules"],
        serde_json::json!({}),
        "{status}"
    );
    // Back in the policy, the module is on: nothing was left to hide it again.
    std::fs::write(levee.policy_file(), &policy).expect("rewrite the policy");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    assert_eq!(get(&levee.url("/visitors")).await.status, 200);
}

/// The test routes with switches kept in `redis`, synced every `sync_interval`.
fn synced_policy(
    backend: std::net::SocketAddr,
    redis: &RedisServer,
    sync_interval: &str,
) -> String {
    policy_for(
        backend,
        "access_log = false",
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"{sync_interval}\"\n{ROUTES}",
            redis.url()
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_level_redis_holds_that_does_not_exist_is_not_followed() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let policy = synced_policy(backend.addr, &redis, "100ms");
    let levee = Levee::start(&policy).await;
    // Written by hand (or another program): a level that does not exist, next to a module
    // switch that does, which shows when the sync has read them.
    redis.cli(&[
        "HSET",
        "levee:switches",
        "level",
        "{\"value\":9,\"by\":\"script\",\"at_unix\":1}",
        "module:visitors",
        "{\"value\":true,\"by\":\"script\",\"at_unix\":1}",
    ]);
    eventually(
        Duration::from_secs(5),
        "the sync to read the switches",
        || async { get(&levee.url("/visitors")).await.status != 200 },
    )
    .await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert_eq!(
        metric_value(&metrics, "levee_degrade_level"),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        get(&levee.url("/notifications")).await.status,
        200,
        "tier 2 stays on"
    );
}

/// An operator hands the last switch back through one instance: the others follow with an
/// info line naming who did it, not the warning kept for a Redis that lost its data (which
/// leaves no word of who handed anything back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_back_elsewhere_in_the_fleet_is_no_warning() {
    let log = levee_log();
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let policy = synced_policy(backend.addr, &redis, "100ms")
        .replace("[redis]\n", "[redis]\nkey_prefix = \"handback:\"\n");
    let through = Levee::start(&policy).await;
    let other = Levee::start(&policy).await;
    let level_of = |levee: &Levee| {
        let url = levee.admin_url("/status");
        async move { get(&url).await.json()["degrade"]["level"].clone() }
    };
    assert_eq!(set(&through, "/level", "1").await.status, 200);
    eventually(Duration::from_secs(5), "the other to follow", || async {
        level_of(&other).await == 1
    })
    .await;
    assert_eq!(set(&through, "/level", "policy").await.status, 200);
    eventually(
        Duration::from_secs(5),
        "the other to follow back",
        || async { level_of(&other).await == 0 },
    )
    .await;
    let stored = redis.cli(&["HGETALL", "handback:switches"]);
    assert!(stored.starts_with("handed_back_by\nalice ("), "{stored}");
    let warned = log.lines_with("key=handback:switches");
    assert!(warned.is_empty(), "{warned:?}");

    // The same Redis losing its data while a switch is in effect is warned of, and the
    // switch is written back rather than lost.
    assert_eq!(set(&through, "/level", "1").await.status, 200);
    eventually(Duration::from_secs(5), "the other to follow", || async {
        level_of(&other).await == 1
    })
    .await;
    redis.cli(&["DEL", "handback:switches"]);
    eventually(Duration::from_secs(5), "the warning", || async {
        log.lines_with("key=handback:switches")
            .iter()
            .any(|line| line.contains("WARN") && line.contains("it lost its data"))
    })
    .await;
    assert_eq!(
        redis.cli(&["HEXISTS", "handback:switches", "level"]).trim(),
        "1"
    );
    assert_eq!(level_of(&through).await, 1);
    assert_eq!(level_of(&other).await, 1);
}

/// The instance answering shows itself in the fleet view as it is now: right after a level
/// was switched through it, its own line read the level of its last sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answering_instance_shows_its_level_of_now_in_the_fleet_view() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    // Synced once at the start, then not for an hour.
    let policy = synced_policy(backend.addr, &redis, "1h");
    let levee = Levee::start(&policy).await;
    eventually(Duration::from_secs(5), "its line in the view", || async {
        get(&levee.admin_url("/status")).await.json()["fleet"]["instances"]
            .as_array()
            .is_some_and(|instances| !instances.is_empty())
    })
    .await;
    assert_eq!(set(&levee, "/level", "1").await.status, 200);
    let fleet = get(&levee.admin_url("/status")).await.json()["fleet"].clone();
    assert_eq!(fleet["highest_level"], 1, "{fleet}");
    assert_eq!(fleet["instances"][0]["level"], 1, "{fleet}");
    // When it wrote its line, as for every other instance (it read 0).
    assert!(
        fleet["instances"][0]["at_unix_ms"]
            .as_u64()
            .is_some_and(|at| at > 1_700_000_000_000),
        "{fleet}"
    );
}

/// The automatic level and the breakers are each instance's own: `/status` on any instance
/// shows every instance's line (with Redis), so one that sheds while the others do not is
/// seen from anywhere; one that stops cleanly leaves the view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instance_s_level_and_breakers_show_in_the_fleet_view() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let healthy =
        Backend::start(|_request: Request<Incoming>| async { Response::new(full("ok")) }).await;
    let shared = |upstream: std::net::SocketAddr| {
        policy_for(
            upstream,
            "access_log = false\ndrain = \"0s\"",
            &format!(
                "breaker = {{ consecutive_failures = 2, open_for = \"30s\" }}\n[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"100ms\"\ncool_down = \"30s\"\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"breaker_open\"\nfor = \"0s\"\nlevel = 1\n",
                redis.url()
            ),
        )
    };
    let calm = Levee::start(&shared(healthy.addr)).await;
    // The other instance's app refuses connections: its breaker opens, and its trigger
    // raises its own level.
    let refused = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut shedding = Levee::start(&shared(refused)).await;
    for _ in 0..3 {
        get(&shedding.url("/")).await;
    }

    eventually(
        Duration::from_secs(5),
        "both instances in the view",
        || async {
            let fleet = &get(&calm.admin_url("/status")).await.json()["fleet"];
            fleet["highest_level"] == 1
                && fleet["instances"]
                    .as_array()
                    .is_some_and(|all| all.len() == 2)
        },
    )
    .await;
    let status = get(&calm.admin_url("/status")).await.json();
    let instances = status["fleet"]["instances"]
        .as_array()
        .expect("instances")
        .clone();
    let this = instances
        .iter()
        .find(|i| i["this"] == true)
        .expect("this instance");
    assert_eq!(this["instance"], status["instance"]);
    assert_eq!(this["level"], 0);
    assert_eq!(this["silent"], false);
    let other = instances
        .iter()
        .find(|i| i["this"] == false)
        .expect("the other");
    assert_eq!(other["level"], 1, "{other}");
    assert_eq!(other["automatic_level"], 1, "{other}");
    assert_eq!(other["breakers"]["app"], "open", "{other}");
    // This instance's own level is untouched: the automatic level is not the fleet's.
    assert_eq!(status["degrade"]["level"], 0);

    let running = shedding.running.take().expect("running");
    running.shutdown();
    running.wait().await;
    eventually(
        Duration::from_secs(5),
        "the stopped instance to leave",
        || async {
            let fleet = &get(&calm.admin_url("/status")).await.json()["fleet"];
            fleet["instances"]
                .as_array()
                .is_some_and(|all| all.len() == 1)
        },
    )
    .await;
}

/// Without Redis there is no fleet to show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_the_fleet_view_is_null() {
    let backend =
        Backend::start(|_request: Request<Incoming>| async { Response::new(full("ok")) }).await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert!(status["fleet"].is_null(), "{status}");
    assert!(status["instance"].is_string(), "{status}");
}

/// With Redis gone the fleet view says so (and `/status` still answers at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_view_says_when_redis_cannot_be_read() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend =
        Backend::start(|_request: Request<Incoming>| async { Response::new(full("ok")) }).await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "",
        &format!(
            "[redis]\nurl = \"{}\"\n[degrade]\nsync_interval = \"100ms\"\n",
            redis.url()
        ),
    ))
    .await;
    eventually(
        Duration::from_secs(5),
        "this instance in the view",
        || async {
            get(&levee.admin_url("/status")).await.json()["fleet"]["instances"]
                .as_array()
                .is_some_and(|all| all.len() == 1)
        },
    )
    .await;
    drop(redis);
    eventually(
        Duration::from_secs(10),
        "the view to say redis is unreadable",
        || async {
            let started = std::time::Instant::now();
            let status = get(&levee.admin_url("/status")).await.json();
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "/status waited on redis"
            );
            status["fleet"]["error"].is_string()
        },
    )
    .await;
}

/// A levee whose fleet view is under `key_prefix = "one:"` and which syncs every `sync_interval`,
/// once its line is there; its policy for another prefix; and its instance name.
async fn in_a_prefixed_fleet_view(
    redis: &RedisServer,
    backend: &Backend,
    sync_interval: &str,
) -> (Levee, impl Fn(&str) -> String, String) {
    let url = redis.url();
    let addr = backend.addr;
    let interval = sync_interval.to_string();
    let with_prefix = move |prefix: &str| {
        policy_for(
            addr,
            "drain = \"0s\"",
            &format!(
                "[redis]\nurl = \"{url}\"\nkey_prefix = \"{prefix}\"\n[degrade]\nsync_interval = \"{interval}\"\n"
            ),
        )
    };
    let levee = Levee::start(&with_prefix("one:")).await;
    let instance = get(&levee.admin_url("/status")).await.json()["instance"]
        .as_str()
        .expect("instance")
        .to_string();
    eventually(Duration::from_secs(5), "a line under one:", || async {
        redis.cli(&["HKEYS", "one:fleet"]).contains(&instance)
    })
    .await;
    (levee, with_prefix, instance)
}

/// A reload that moves levee to another key prefix, or drops `[redis]`, takes this instance's
/// line out of the old fleet view at the next sync: left there, it would be shown as a silent
/// instance for an hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_away_from_a_fleet_view_takes_this_instance_s_line_out_of_it() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend =
        Backend::start(|_request: Request<Incoming>| async { Response::new(full("ok")) }).await;
    let (levee, with_prefix, instance) = in_a_prefixed_fleet_view(&redis, &backend, "100ms").await;
    let lines = |key: &str| redis.cli(&["HKEYS", key]);

    std::fs::write(levee.policy_file(), with_prefix("two:")).expect("rewrite the policy");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    eventually(
        Duration::from_secs(5),
        "the line moved from one: to two:",
        || async {
            !lines("one:fleet").contains(&instance) && lines("two:fleet").contains(&instance)
        },
    )
    .await;

    std::fs::write(levee.policy_file(), policy_for(backend.addr, "", "")).expect("rewrite");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    eventually(
        Duration::from_secs(5),
        "the line gone with [redis]",
        || async { !lines("two:fleet").contains(&instance) },
    )
    .await;
    assert!(get(&levee.admin_url("/status")).await.json()["fleet"].is_null());
}

/// A levee that stops after a reload moved it to another key prefix, before its next sync,
/// leaves neither view holding its line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_levee_stopping_right_after_such_a_reload_leaves_the_old_view_too() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend =
        Backend::start(|_request: Request<Incoming>| async { Response::new(full("ok")) }).await;
    // Syncs far apart: the stop comes before the sync that would move the line.
    let (mut levee, with_prefix, instance) = in_a_prefixed_fleet_view(&redis, &backend, "1h").await;
    let lines = |key: &str| redis.cli(&["HKEYS", key]);
    std::fs::write(levee.policy_file(), with_prefix("two:")).expect("rewrite the policy");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);

    let running = levee.running.take().expect("running");
    running.shutdown();
    running.wait().await;
    assert!(!lines("one:fleet").contains(&instance), "left in one:");
    assert!(!lines("two:fleet").contains(&instance), "left in two:");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_past_the_64th_of_a_routes_hide_table_is_hidden_too() {
    // A route keeps the plan of each set of modules off under one bit per module: one with
    // more modules than bits makes its plan for every page, and hides its 65th as its first.
    let backend = Backend::start(|_request: Request<Incoming>| async move {
        Response::builder()
            .header("content-type", "text/html")
            .body(full(
                "<p>home</p><div id=\"m64\">last</div><div id=\"m00\">first</div>",
            ))
            .expect("response")
    })
    .await;
    // Two digits: the 65th in the policy is the 65th whether the table keeps its order or
    // sorts its keys.
    let hide: Vec<String> = (0..65).map(|i| format!("m{i:02} = \"#m{i:02}\"")).collect();
    let levee = levee_with_routes(
        &backend,
        "match = { path = \"/\" }",
        &format!(
            "match = {{ path = \"/\" }}\nhide = {{ {} }}",
            hide.join(", ")
        ),
    )
    .await;
    assert_eq!(set(&levee, "/modules/m64", "off").await.status, 200);
    assert_eq!(
        get(&levee.url("/")).await.text(),
        "<p>home</p><div id=\"m00\">first</div>"
    );
    assert_eq!(set(&levee, "/modules/m00", "off").await.status, 200);
    assert_eq!(get(&levee.url("/")).await.text(), "<p>home</p>");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_sent_as_a_page_keeps_its_fields_while_a_module_is_off() {
    // A PHP AJAX endpoint that never calls header() sends its JSON as text/html. Its body
    // passed untouched, but its validators and lifetimes were taken as a cut page's.
    const JSON: &str = "\u{feff} \n{\"html\":\"<div id='visitors'>42<\\/div>\"}";
    let backend = Backend::start(|_request: Request<Incoming>| async {
        Response::builder()
            .header("content-type", "text/html; charset=UTF-8")
            .header("etag", "\"j1\"")
            .header("last-modified", "Mon, 30 Nov 2026 10:00:00 GMT")
            .header("cache-control", "public, max-age=60")
            .header("content-length", JSON.len().to_string())
            .body(full(JSON))
            .expect("response")
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "match = { path = \"/\" }",
        "match = { path = \"/\" }\nhide = { visitors = \"#visitors\" }",
    )
    .await;
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let answer = get(&levee.url("/")).await;
    assert_eq!((answer.status, answer.text().as_str()), (200, JSON));
    for (name, value) in [
        ("etag", "\"j1\""),
        ("last-modified", "Mon, 30 Nov 2026 10:00:00 GMT"),
        ("cache-control", "public, max-age=60"),
        ("content-length", &JSON.len().to_string()),
    ] {
        assert_eq!(answer.header(name), Some(value), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_cut_off_before_its_first_tag_is_not_sent_as_whole_while_a_module_is_off() {
    // The body's first bytes are read before the head goes out (JSON or a page?): an
    // upstream that breaks off there must still show as broken off, not as a page that ended.
    let app = raw_backend(|_| {
        b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 100\r\n\r\n  \n".to_vec()
    })
    .await;
    let levee = Levee::start(&policy_for(
        app,
        "access_log = false",
        "[[route]]\nname = \"home\"\nmatch = { path = \"/\" }\nhide = { visitors = \"#visitors\" }\n",
    ))
    .await;
    assert_eq!(set(&levee, "/modules/visitors", "off").await.status, 200);
    let answer = raw_exchange(
        levee.public,
        b"GET / HTTP/1.1\r\nHost: forum.example\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
            && !answer.ends_with("0\r\n\r\n"),
        "a body broken off is not ended as whole: {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_flushes_its_head_early_gets_it_to_the_client_while_a_module_is_off() {
    // A PHP page that flushes its head before a slow query: while `ranking` is hidden, the
    // head reaches the client at once (it waited behind the 4 KiB the scan keeps back).
    use futures_util::StreamExt;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let query_done = Arc::new(tokio::sync::Notify::new());
    let done = query_done.clone();
    let backend = Backend::start(move |_request: Request<Incoming>| {
        let done = done.clone();
        async move {
            let head = "<html><head><link rel=\"stylesheet\" href=\"/site.css\"></head>\n";
            let rest = "<body><div id=\"ranking\">top ten</div><p>posts</p></body></html>";
            let pieces =
                futures_util::stream::iter([Some(head), None, Some(rest)]).then(move |piece| {
                    let done = done.clone();
                    async move {
                        match piece {
                            Some(text) => Bytes::from_static(text.as_bytes()),
                            None => {
                                done.notified().await;
                                Bytes::new()
                            }
                        }
                    }
                });
            let body = StreamBody::new(pieces.map(|bytes| Ok::<_, BoxError>(Frame::data(bytes))));
            Response::builder()
                .header("content-type", "text/html")
                .body(body.boxed_unsync())
                .expect("response")
        }
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "match = { path = \"/\" }",
        "match = { path = \"/\" }\nhide = { ranking = \"#ranking\" }",
    )
    .await;
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: forum.example\r\nConnection: close\r\n\r\n")
        .await
        .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let head_arrived = tokio::time::timeout(Duration::from_secs(10), async {
        while !String::from_utf8_lossy(&seen).contains("href=\"/site.css\">") {
            let n = stream.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    query_done.notify_one();
    assert!(
        head_arrived.is_ok(),
        "the head waited for the rest of the page: {}",
        String::from_utf8_lossy(&seen)
    );
    stream.read_to_end(&mut seen).await.expect("read");
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("<p>posts</p>"), "{text}");
    assert!(!text.contains("top ten"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_spelled_otherwise_than_its_normal_form_leaves_no_copy() {
    // The app prints the target as the client spelled it; the copy is keyed by the normal
    // path. An answer to `//evil.example/../ranking` kept as `/ranking`'s copy would give every
    // visitor the attacker's link (or script).
    let (backend, _version, _failing) = versioned().await;
    let levee = levee_resting(&backend).await;
    let planted = get(&levee.url("//evil.example/../ranking?week=1")).await;
    assert_eq!(planted.text(), "//evil.example/../ranking v1");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let answer = get(&levee.url("/ranking?week=1")).await;
    assert_eq!(
        (answer.status, answer.text().as_str()),
        (503, "ranking is resting")
    );
    // The page as it is spelled is kept, and answers the odd spelling too.
    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);
    assert_eq!(
        get(&levee.url("/ranking?week=1")).await.text(),
        "/ranking v1"
    );
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    for path in ["/ranking?week=1", "/x/../ranking?week=1"] {
        let answer = get(&levee.url(path)).await;
        assert_eq!(
            (answer.status, answer.text().as_str()),
            (200, "/ranking v1"),
            "{path}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_spelled_with_a_port_or_dot_makes_a_copy_of_its_own() {
    // An app that builds its links from HTTP_HOST prints the client's port and dot: kept as
    // the copy of the bare host, `Host: example.com:6666` sent every visitor to port 6666.
    let backend = Backend::start(|request: Request<Incoming>| async move {
        let host = request
            .headers()
            .get("host")
            .and_then(|host| host.to_str().ok())
            .unwrap_or("-")
            .to_string();
        html(format!("<a href=\"http://{host}/next\">next</a>"))
    })
    .await;
    let levee = levee_resting(&backend).await;
    let as_host = |host: &'static str| {
        let url = levee.url("/ranking?week=1");
        async move { get_with(&url, &[("host", host)]).await }
    };
    let planted = as_host("Example.COM.:6666").await;
    assert_eq!(
        planted.text(),
        "<a href=\"http://Example.COM.:6666/next\">next</a>"
    );
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let answer = as_host("example.com").await;
    assert_eq!(
        (answer.status, answer.text().as_str()),
        (503, "ranking is resting")
    );
    assert_eq!(set(&levee, "/modules/ranking", "on").await.status, 200);
    assert_eq!(
        as_host("example.com").await.text(),
        "<a href=\"http://example.com/next\">next</a>"
    );
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    // Only the case is the client's whim: one copy for every spelling of it.
    let answer = as_host("EXAMPLE.com").await;
    assert_eq!(
        (answer.status, answer.text().as_str()),
        (200, "<a href=\"http://example.com/next\">next</a>")
    );
}

/// A shop whose session cookie has a name of its own and whose pages say nothing of caching:
/// once the app has set the cookie, a customer carrying it gets the app's own page, never
/// another customer's through a shared fetch, and such a page is never kept as a copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cookie_the_app_sets_without_marking_its_page_private_keeps_its_carriers_pages_their_own()
{
    let backend = Backend::start(|request: Request<Incoming>| {
        let cookies = request
            .headers()
            .get("cookie")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_string();
        let path = request.uri().path().to_string();
        async move {
            if path == "/cart.php" {
                let mut response = html("cart");
                response.headers_mut().insert(
                    "set-cookie",
                    http::HeaderValue::from_static("shopsid=new; path=/"),
                );
                return response;
            }
            let cart = cookies
                .split(';')
                .find_map(|pair| pair.trim().strip_prefix("shopsid="))
                .map_or_else(|| "empty cart".to_string(), |id| format!("cart of {id}"));
            tokio::time::sleep(Duration::from_millis(300)).await;
            html(format!("product page, {cart}"))
        }
    })
    .await;
    let levee = levee_resting(&backend).await;
    assert_eq!(get(&levee.url("/cart.php")).await.text(), "cart");
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["learned_private_cookies"][0], "shopsid", "{status}");

    let url = levee.url("/ranking/product");
    let alice = tokio::spawn(async move { get_with(&url, &[("cookie", "shopsid=alice")]).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let bob = get_with(
        &levee.url("/ranking/product"),
        &[("cookie", "_ga=1; shopsid=bob")],
    )
    .await;
    assert_eq!(bob.text(), "product page, cart of bob");
    assert_eq!(
        alice.await.expect("task").text(),
        "product page, cart of alice"
    );
    // Neither was kept: with the route off, a visitor gets the fallback.
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let anonymous = get(&levee.url("/ranking/product")).await;
    assert_eq!(
        (anonymous.status, anonymous.text().as_str()),
        (503, "ranking is resting")
    );
}

/// The cookie names one instance learned are the fleet's, through Redis: an instance started
/// later (or restarted) knows them before the app sets them again there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cookies_one_instance_learned_are_known_to_the_fleet() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = Backend::start(|_request: Request<Incoming>| async {
        let mut response = html("cart");
        response.headers_mut().insert(
            "set-cookie",
            http::HeaderValue::from_static("shopsid=new; path=/"),
        );
        response
    })
    .await;
    let policy = synced_policy(backend.addr, &redis, "100ms");
    let first = Levee::start(&policy).await;
    assert_eq!(get(&first.url("/cart.php")).await.text(), "cart");
    eventually(Duration::from_secs(5), "the name in redis", || async {
        redis.cli(&["SMEMBERS", "levee:app_cookies"]).trim() == "shopsid"
    })
    .await;
    let later = Levee::start(&policy).await;
    eventually(
        Duration::from_secs(5),
        "the instance started later to know it",
        || async {
            get(&later.admin_url("/status")).await.json()["learned_private_cookies"][0] == "shopsid"
        },
    )
    .await;

    // Redis loses its data (restarted without persistence, flushed): the instances write the
    // names they know back, or one started after that would not know them until the app set
    // them again, and would share its copies with logged-in visitors meanwhile.
    redis.cli(&["FLUSHALL"]);
    eventually(Duration::from_secs(5), "the name written back", || async {
        redis.cli(&["SMEMBERS", "levee:app_cookies"]).trim() == "shopsid"
    })
    .await;
}

/// Switches in effect where `[redis]` is added are carried into it, at a reload and at the
/// first start with it (from the local copy): they were given up for a place holding none,
/// with no more than an info line, and the state file emptied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switches_in_effect_are_carried_into_a_redis_added_later() {
    let log = levee_log();
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let backend = echo_backend().await;
    let state = dir.path().join("state.json");
    let without_redis = policy_for(
        backend.addr,
        "access_log = false",
        &format!("[degrade]\nstate_file = \"{}\"\n{ROUTES}", state.display()),
    );
    let with_redis = |prefix: &str| {
        policy_for(
            backend.addr,
            "access_log = false",
            &format!(
                "[redis]\nurl = \"{}\"\nkey_prefix = \"{prefix}\"\n[degrade]\nsync_interval = \"100ms\"\nstate_file = \"{}\"\n{ROUTES}",
                redis.url(),
                state.display()
            ),
        )
    };
    let level_of = |levee: &Levee| {
        let url = levee.admin_url("/status");
        async move { get(&url).await.json()["degrade"]["level"].clone() }
    };

    // A reload adding `[redis]`.
    let levee = Levee::start(&without_redis).await;
    assert_eq!(set(&levee, "/level", "1").await.status, 200);
    std::fs::write(levee.policy_file(), with_redis("reloaded:")).expect("rewrite the policy");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    eventually(Duration::from_secs(5), "the level carried", || async {
        redis.cli(&["HEXISTS", "reloaded:switches", "level"]).trim() == "1"
    })
    .await;
    assert_eq!(level_of(&levee).await, 1);
    let carried = log.lines_with("key=reloaded:switches");
    assert!(
        carried
            .iter()
            .any(|line| line.contains("WARN")
                && line.contains("carried the switches in effect here")),
        "{carried:?}"
    );
    drop(levee);

    // The first start with `[redis]`, after running without it: the local copy's switches.
    let levee = Levee::start(&without_redis).await;
    assert_eq!(level_of(&levee).await, 1, "kept in the state file");
    drop(levee);
    let levee = Levee::start(&with_redis("started:")).await;
    assert_eq!(level_of(&levee).await, 1);
    assert_eq!(
        redis.cli(&["HEXISTS", "started:switches", "level"]).trim(),
        "1"
    );
    let saved = std::fs::read_to_string(&state).expect("state file");
    assert!(saved.contains("\"level\": {"), "{saved}");
    let carried = log.lines_with("key=started:switches");
    assert!(
        carried
            .iter()
            .any(|line| line.contains("WARN") && line.contains("carried those of its local copy")),
        "{carried:?}"
    );
}

/// An event stream on a `stale` route is each client's own: never shared by a second
/// visitor's request (who waited for the first one's whole stream and got its events in one
/// lump) nor kept as the route's copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_on_a_stale_route_is_never_shared_nor_kept() {
    let asked = Arc::new(AtomicUsize::new(0));
    let backend = {
        let asked = asked.clone();
        Backend::start(move |_request: Request<Incoming>| {
            let number = asked.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                // Its own events, one now and then one every 300 ms, for three seconds.
                let events = futures_util::stream::unfold(0, move |step| async move {
                    if step > 0 {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    let event = format!("data: stream {number} event {step}\n\n");
                    let frame = hyper::body::Frame::data(bytes::Bytes::from(event));
                    (step < 10).then_some((Ok::<_, BoxError>(frame), step + 1))
                });
                let mut response = Response::new(http_body_util::BodyExt::boxed_unsync(
                    http_body_util::StreamBody::new(events),
                ));
                response.headers_mut().insert(
                    "content-type",
                    http::HeaderValue::from_static("text/event-stream"),
                );
                response
            }
        })
        .await
    };
    let levee = levee_with_routes(
        &backend,
        "match = { path_prefix = \"/ranking\" }",
        "match = { path_prefix = \"/ranking\" }",
    )
    .await;
    let ask = b"GET /ranking/events HTTP/1.1\r\nHost: a\r\n\r\n";
    let (_first, seen) = streamed_until(levee.public, ask, "event 0").await;
    assert!(seen.contains("data: stream 1 event 0"), "{seen}");
    // While the first stream runs: the second visitor's own stream, from its first event.
    let (_second, seen) = streamed_until(levee.public, ask, "event 0").await;
    assert!(seen.contains("data: stream 2 event 0"), "{seen}");
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains("levee_stale_not_kept_total{route=\"ranking\",reason=\"event_stream\"}"),
        "{metrics}"
    );
}

/// A framework that sets its session cookie on every page (Laravel), on a route that keeps
/// such pages (`allow_set_cookie`): with the app healthy, a visitor never gets another's page
/// through a shared fetch (it got the first visitor's CSRF token and no session of its own, and
/// a logged-in user a guest's page); the copy kept from a guest's page still answers everyone,
/// the session's carriers too, when the app fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_that_set_a_session_cookie_are_never_shared_with_waiting_visitors() {
    let asked = Arc::new(AtomicUsize::new(0));
    let backend = {
        let asked = asked.clone();
        Backend::start(move |request: Request<Incoming>| {
            let number = asked.fetch_add(1, Ordering::SeqCst) + 1;
            let who = request
                .headers()
                .get("cookie")
                .and_then(|value| value.to_str().ok())
                .and_then(|cookies| {
                    cookies
                        .split(';')
                        .find_map(|pair| pair.trim().strip_prefix("app_session="))
                })
                .map_or_else(|| "guest".to_string(), |id| format!("user {id}"));
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let mut response = html(format!("page {number} for {who}, token {number}"));
                response.headers_mut().insert(
                    "set-cookie",
                    http::HeaderValue::from_str(&format!("app_session=s{number}; path=/"))
                        .expect("value"),
                );
                response
            }
        })
        .await
    };
    let levee = levee_with_routes(
        &backend,
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"10m\", allow_set_cookie = true }\nfallback = { status = 503, body = \"ranking is resting\" }",
    )
    .await;
    let url = levee.url("/ranking/product");
    // Two guests at once: each gets a page and a session of its own.
    let first = tokio::spawn({
        let url = url.clone();
        async move { get(&url).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = get(&url).await;
    let first = first.await.expect("task");
    assert_ne!(first.text(), second.text());
    assert!(second.header("set-cookie").is_some(), "its own session");
    // A logged-in user (the app's session cookie, learned) while a guest's fetch is out.
    let guest = tokio::spawn({
        let url = url.clone();
        async move { get(&url).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let user = get_with(&url, &[("cookie", "app_session=alice")]).await;
    assert!(user.text().contains("for user alice"), "{}", user.text());
    let _ = guest.await;
    // The route off: the guest's page kept, without its cookie, answers the user too.
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let copy = get_with(&url, &[("cookie", "app_session=alice")]).await;
    assert_eq!(copy.header("x-levee-stale"), Some("1"), "{}", copy.text());
    assert!(copy.text().contains("for guest"), "{}", copy.text());
    assert_eq!(copy.header("set-cookie"), None);
}

/// Before levee has seen the app set its session cookie (a new deployment), a logged-in
/// user's page that the app marks public, and renews the session on, is not kept: it was, and
/// served to a stranger in the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_renews_the_visitors_own_cookie_is_never_kept() {
    let backend = Backend::start(|request: Request<Incoming>| async move {
        let user = request
            .headers()
            .get("cookie")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("guest")
            .to_string();
        let mut response = html(format!("page for {user}"));
        let headers = response.headers_mut();
        headers.insert(
            "cache-control",
            http::HeaderValue::from_static("public, max-age=60"),
        );
        headers.insert(
            "set-cookie",
            http::HeaderValue::from_static("app_session=renewed; path=/"),
        );
        response
    })
    .await;
    let levee = levee_with_routes(
        &backend,
        "degrade = { action = \"stale\", max_age = \"10m\" }",
        "degrade = { action = \"stale\", max_age = \"10m\", allow_set_cookie = true }\nfallback = { status = 503, body = \"ranking is resting\" }",
    )
    .await;
    let url = levee.url("/ranking/product");
    let alice = get_with(&url, &[("cookie", "app_session=alice")]).await;
    assert_eq!(alice.text(), "page for app_session=alice");
    assert_eq!(set(&levee, "/modules/ranking", "off").await.status, 200);
    let stranger = get(&url).await;
    assert_eq!(
        (stranger.status, stranger.text().as_str()),
        (503, "ranking is resting")
    );
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    assert!(
        metrics.contains("levee_stale_not_kept_total{route=\"ranking\",reason=\"own_cookie\"} 1"),
        "{metrics}"
    );
}
