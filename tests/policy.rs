//! Policy files: `levee check`, hot reload under load, admin reload and status.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::{Request, Response};
use hyper::body::Incoming;

#[test]
fn check_accepts_the_shipped_default_policy() {
    let (ok, stdout, stderr) = levee_check(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/policies"
    )));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("is valid"), "{stdout}");
}

#[test]
fn check_accepts_the_example_policies() {
    let (ok, stdout, stderr) = levee_check(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/forum/policies"
    )));
    assert!(ok, "{stderr}");
    assert!(stdout.contains("11 route(s)"), "{stdout}");
    assert!(!stdout.contains("warning"), "{stdout}");
}

#[test]
fn a_public_listener_on_the_default_admin_address_is_reported_at_its_listen() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("10-upstreams.toml"),
        "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n\n[[route]]\nname = \"all\"\nmatch = { path_prefix = \"/\" }\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("20-server.toml"),
        "[server]\nlisten = \"127.0.0.1:9901\"\n",
    )
    .expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    let expected = format!(
        "{}:2:10: error: the admin listener (127.0.0.1:9901) and the public one (127.0.0.1:9901) use the same port of the same address",
        dir.path().join("20-server.toml").display()
    );
    assert!(
        stderr.contains(&expected),
        "missing `{expected}` in:\n{stderr}"
    );

    // A public listener on every address takes the admin's port on loopback too: `run`
    // could not bind both, so `check` does not pass it.
    std::fs::write(
        dir.path().join("20-server.toml"),
        "[server]\nlisten = \"0.0.0.0:8080\"\n[admin]\nlisten = \"127.0.0.1:8080\"\n",
    )
    .expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    assert!(
        stderr.contains("error: the admin listener (127.0.0.1:8080) and the public one (0.0.0.0:8080) use the same port"),
        "{stderr}"
    );
}

/// Files an operator may take for policy files but levee does not read are named, so their
/// rules are not lost without a word; backups and hidden files are left alone.
#[test]
fn files_that_look_like_policy_but_are_not_read_are_warned_of() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("10-app.toml"),
        "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n",
    )
    .expect("write");
    for name in [
        "20-limits.TOML",
        "21.tml",
        "22.toml.txt",
        "levee.toml.bak",
        ".hidden.toml.swp",
    ] {
        std::fs::write(dir.path().join(name), "[limit.x]\n").expect("write");
    }
    std::fs::create_dir(dir.path().join("conf.d")).expect("mkdir");
    std::fs::write(dir.path().join("conf.d").join("sub.toml"), "").expect("write");
    let (ok, stdout, stderr) = levee_check(dir.path());
    let printed = format!("{stdout}{stderr}");
    assert!(ok, "{printed}");
    for name in ["20-limits.TOML", "21.tml", "22.toml.txt", "conf.d"] {
        assert!(
            printed.contains(&format!("warning: `{name}` is not read")),
            "{name}: {printed}"
        );
    }
    assert!(
        !printed.contains("levee.toml.bak") && !printed.contains(".hidden"),
        "{printed}"
    );
    // Also beside the errors it explains: a route using a limit of `20-limits.TOML`.
    std::fs::write(
        dir.path().join("11-routes.toml"),
        "[[route]]\nname = \"login\"\nmatch = { path = \"/login.php\" }\nlimits = [\"x\"]\n",
    )
    .expect("write");
    let (ok, stdout, stderr) = levee_check(dir.path());
    let printed = format!("{stdout}{stderr}");
    assert!(!ok, "{printed}");
    assert!(
        printed.contains("limit `x` is not defined")
            && printed.contains("warning: `20-limits.TOML` is not read")
            && printed.contains("has 1 error(s)"),
        "{printed}"
    );
    std::fs::remove_file(dir.path().join("11-routes.toml")).expect("remove");

    // A link to a file that moved away is named as such.
    std::os::unix::fs::symlink(
        "/nonexistent/levee/limits.toml",
        dir.path().join("30-limits.toml"),
    )
    .expect("link");
    let (ok, _, stderr) = levee_check(dir.path());
    assert!(!ok);
    assert!(
        stderr.contains("30-limits.toml: error: cannot read: this is a symlink to /nonexistent/levee/limits.toml, which does not exist"),
        "{stderr}"
    );
}

#[test]
fn a_file_that_is_not_utf8_is_reported_where_it_stops_being_utf8() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut text = b"[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n\n[[route]]\nname = \"home\"\nfallback = { status = 503, body = \"caf".to_vec();
    text.extend_from_slice(b"\xe9 ferm\xe9\" }\n");
    std::fs::write(dir.path().join("levee.toml"), text).expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    let expected = format!(
        "{}:6:39: error: byte 0xE9 is not UTF-8",
        dir.path().join("levee.toml").display()
    );
    assert!(
        stderr.contains(&expected),
        "missing `{expected}` in:\n{stderr}"
    );
    assert!(stderr.contains("iconv"), "{stderr}");
}

/// A file that cannot be read does not stop the check of the others: every error of the
/// directory is reported in one run, the unreadable files named at their paths.
#[test]
fn files_that_cannot_be_read_are_named_and_the_others_still_checked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let write =
        |name: &str, text: &[u8]| std::fs::write(dir.path().join(name), text).expect("write");
    write(
        "10-app.toml",
        b"[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n",
    );
    // Its limit is defined in a file saved in Latin-1, its upstream perhaps in the file a
    // link no longer reaches: neither is called undefined.
    write(
        "20-routes.toml",
        b"[[route]]\nname = \"home\"\nmatch = { path = \"/\" }\nlimits = [\"per_ip\"]\nupstream = \"php\"\ntier = 7\n",
    );
    write(
        "30-limits.toml",
        b"[limit.per_ip]\nkey = \"ip\"\nrate = \"10/s\"\nbody_html = \"caf\xe9\"\n",
    );
    std::os::unix::fs::symlink(
        "/nonexistent/levee/php.toml",
        dir.path().join("40-php.toml"),
    )
    .expect("link");
    std::fs::create_dir(dir.path().join("50-conf.toml")).expect("mkdir");
    // Unreadable by its mode, unless the test runs as root (who reads it anyway).
    write(
        "60-secret.toml",
        b"[admin]\ntokens = { ops = \"0123456789abcdef0\" }\n",
    );
    let secret = dir.path().join("60-secret.toml");
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o000))
        .expect("chmod");
    let unreadable_by_mode = std::fs::read(&secret).is_err();

    let (ok, stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "{stdout}{stderr}");
    let file = |name: &str| dir.path().join(name).display().to_string();
    let mut expected = vec![
        format!("{}:4:17: error: byte 0xE9 is not UTF-8", file("30-limits.toml")),
        format!(
            "{}: error: cannot read: this is a symlink to /nonexistent/levee/php.toml, which does not exist",
            file("40-php.toml")
        ),
        format!(
            "{}: error: cannot read: this is a directory, and levee reads only the *.toml files directly in the policy directory",
            file("50-conf.toml")
        ),
        // The readable files are checked too.
        format!("{}:6:8: error: tier 7 does not exist", file("20-routes.toml")),
    ];
    if unreadable_by_mode {
        expected.push(format!(
            "{}: error: cannot read: Permission denied",
            file("60-secret.toml")
        ));
    }
    for expected in &expected {
        assert!(
            stderr.contains(expected.as_str()),
            "missing `{expected}` in:\n{stderr}"
        );
    }
    assert!(!stderr.contains("is not defined"), "{stderr}");
    assert!(
        stderr.contains(&format!("has {} error(s)", expected.len())),
        "{stderr}"
    );
}

#[test]
fn check_reports_every_error_with_file_line_col_and_fails() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("10-main.toml"),
        "[server]\nlisten = \"127.0.0.1:8080\"\ndrain = \"5 fortnights\"\n\n[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n\n[[route]]\nname = \"home\"\nmatch = { path = \"/\" }\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("20-extra.toml"),
        "[[route]]\nname = \"home\"\nmatch = { path = \"/index.php\" }\n\n[[route]]\nname = \"ai\"\nupstream = \"ai\"\nmatch = { path_regex = \"[unclosed\" }\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("30-typo.toml"),
        "[upstream.search]\nurl = \"http://127.0.0.1:9\"\ntimeout = \"1s\"\n",
    )
    .expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    let file = |name: &str| dir.path().join(name).display().to_string();
    for expected in [
        format!("{}:3:9: error: unknown duration unit", file("10-main.toml")),
        format!(
            "{}:2:8: error: route `home` is defined twice",
            file("20-extra.toml")
        ),
        format!(
            "{}:7:12: error: upstream `ai` is not defined",
            file("20-extra.toml")
        ),
        format!(
            "{}:3:1: error: unknown field `timeout`",
            file("30-typo.toml")
        ),
    ] {
        assert!(
            stderr.contains(&expected),
            "missing `{expected}` in:\n{stderr}"
        );
    }
    assert!(stderr.contains("hint:"), "{stderr}");
    assert!(stderr.contains("has 5 error(s)"), "{stderr}");
    assert!(
        stderr.contains("20-extra.toml:8:24: error: invalid path_regex"),
        "{stderr}"
    );
}

#[test]
fn check_reports_the_errors_of_every_table_when_some_do_not_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A typo in one limit, a value of the wrong type in one upstream and in one trigger:
    // the value errors of the other tables, in this file and the next, are reported with
    // them, and what the broken tables define is not called undefined.
    std::fs::write(
        dir.path().join("10-app.toml"),
        "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nresponse_timeout = \"10x\"\n\n\
         [upstream.search]\nurl = \"http://127.0.0.1:9200\"\nmax_inflight = \"20\"\n\n\
         [limit.post_per_user]\nkey = \"ip\"\nrate = \"5/min\"\nburts = 5\n\n\
         [degrade]\n[[degrade.trigger]]\nupstream = \"app\"\nwhen = \"latency_p95\"\nabove = 1.5\n\n\
         [[degrade.trigger]]\nupstream = \"search\"\nwhen = \"inflight\"\nabove = 0.9\n\n\
         [[degrade.trigger]]\nupstream = \"app\"\nwhen = \"error_ratio\"\nabove = 0.5\nfor = 30\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("20-routes.toml"),
        "[[route]]\nname = \"post\"\nmatch = { path_prefix = \"/post\" }\nlimits = [\"post_per_user\"]\ntier = 4\n\n\
         [[route]]\nname = \"search\"\nupstream = \"search\"\nmatch = { path = \"/search\" }\nfallback = { status = 99 }\n",
    )
    .expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    let file = |name: &str| dir.path().join(name).display().to_string();
    let expected = [
        format!("{}:3:20: error: unknown duration unit `x`", file("10-app.toml")),
        format!(
            "{}:7:16: error: `max_inflight` must be a whole number\n  hint: write it without quotes: max_inflight = 20",
            file("10-app.toml")
        ),
        format!(
            "{}:12:1: error: unknown field `burts`, expected one of `key`, `rate`, `burst`",
            file("10-app.toml")
        ),
        format!(
            "{}:15:1: error: latency_p95 needs `above` as a duration",
            file("10-app.toml")
        ),
        format!("{}:29:7: error: `for` must be a string in quotes", file("10-app.toml")),
        format!("{}:5:8: error: tier 4 does not exist", file("20-routes.toml")),
        format!("{}:11:23: error: 99 is not a status levee can answer with", file("20-routes.toml")),
    ];
    let mut at = 0;
    for expected in &expected {
        // In file order, each once.
        let found = stderr[at..].find(expected.as_str());
        assert!(
            found.is_some(),
            "missing `{expected}` after byte {at} of:\n{stderr}"
        );
        at += found.unwrap_or_default() + expected.len();
    }
    assert!(
        stderr.contains(&format!("has {} error(s)", expected.len())),
        "{stderr}"
    );
    assert!(!stderr.contains("not defined"), "{stderr}");
    assert!(stderr.contains("hint: did you mean `burst`?"), "{stderr}");
}

#[test]
fn check_reports_every_key_that_does_not_fit_in_one_table() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The parser stops at a table's first error: an inline table's bad value hid the typo
    // under it, and a route's unknown match key hid its quoted tier.
    std::fs::write(
        dir.path().join("10-app.toml"),
        "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nbreaker = { failure_ratio = \"50%\", window = \"10s\" }\nmax_inflite = 10\n\n\
         [[route]]\nname = \"home\"\nupstream = \"app\"\nmatch = { pth = \"/\" }\ntier = \"1\"\n\n\
         [upstream.search]\nhost = 5\n",
    )
    .expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    let file = dir.path().join("10-app.toml").display().to_string();
    for expected in [
        format!("{file}:3:29: error: `failure_ratio` must be a share"),
        format!("{file}:4:1: error: unknown field `max_inflite`"),
        format!("{file}:9:11: error: unknown field `pth`"),
        format!("{file}:10:8: error: `tier` must be a tier"),
        format!("{file}:13:8: error: "),
    ] {
        assert!(stderr.contains(&expected), "{expected} in {stderr}");
    }
    // Each once: the keys taken out to read the rest are not reported again.
    assert!(stderr.contains("has 5 error(s)"), "{stderr}");

    // Without its breaker or its fallback (keys whose absence changes nothing else), the rest
    // of the table is compiled too: its values' errors are said with the breaker's.
    std::fs::write(
        dir.path().join("10-app.toml"),
        "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\nbreaker = { failure_ratio = \"50%\" }\nresponse_timeout = \"10x\"\n\n\
         [[route]]\nname = \"home\"\nfallback = { status = \"503\" }\ntier = 9\n",
    )
    .expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    for expected in [
        format!("{file}:3:29: error: `failure_ratio` must be a share"),
        format!("{file}:4:20: error: unknown duration unit `x`"),
        format!("{file}:8:23: error: "),
        format!("{file}:9:8: error: tier 9 does not exist"),
    ] {
        assert!(stderr.contains(&expected), "{expected} in {stderr}");
    }
    assert!(stderr.contains("has 4 error(s)"), "{stderr}");
}

#[test]
fn an_upstream_written_without_its_name_is_told_to_take_one_at_its_header() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("10-app.toml"),
        "# the PHP app\n[upstream]\nurl = \"http://127.0.0.1:8081\"\nmax_inflight = 20\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("20-routes.toml"),
        "[[route]]\nname = \"home\"\nupstream = \"php\"\nmatch = { path = \"/\" }\n",
    )
    .expect("write");
    let (ok, _stdout, stderr) = levee_check(dir.path());
    assert!(!ok, "check must fail");
    let expected = format!(
        "{}:2:1: error: `[upstream]` needs a name: write `[upstream.NAME]` (e.g. `[upstream.php]`)\n  hint: ",
        dir.path().join("10-app.toml").display()
    );
    assert!(stderr.starts_with(&expected), "{stderr}");
    // Said once, at the header: not once per key under it, nor the route's `php` undefined.
    assert!(stderr.contains("has 1 error(s)"), "{stderr}");
    assert!(!stderr.contains("is a table"), "{stderr}");
}

#[test]
fn a_route_an_earlier_one_holds_whole_is_a_warning_at_both_places() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("10-shop.toml"),
        "[upstream.app]\nurl = \"http://127.0.0.1:8081\"\n\n[[route]]\nname = \"shop\"\nmatch = { path_prefix = \"/shop\" }\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("20-cart.toml"),
        "[[route]]\nname = \"cart\"\nmatch = { method = \"POST\", path = \"/shop/cart\" }\n",
    )
    .expect("write");
    let (ok, stdout, stderr) = levee_check(dir.path());
    // It loads: the policy does what it says, only not what was most likely meant.
    assert!(ok, "{stderr}");
    assert!(stdout.contains("is valid with 1 warning(s)"), "{stdout}");
    let expected = format!(
        "{}:2:8: warning: route `cart` is never reached: route `shop` before it ({}:5:8) matches every request it matches\n  hint: ",
        dir.path().join("20-cart.toml").display(),
        dir.path().join("10-shop.toml").display()
    );
    assert!(stderr.starts_with(&expected), "{stderr}");
}

#[test]
fn check_fails_on_a_missing_or_empty_directory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (ok, _, stderr) = levee_check(dir.path());
    assert!(!ok);
    // About the directory as a whole: no line and column to print (no `:0:0`).
    assert!(
        stderr.starts_with(&format!(
            "{}: error: no *.toml policy files in this directory\n",
            dir.path().display()
        )),
        "{stderr}"
    );
    let missing = dir.path().join("missing");
    let (ok, _, stderr) = levee_check(&missing);
    assert!(!ok);
    assert!(
        stderr.starts_with(&format!(
            "{}: error: the policy directory does not exist\n",
            missing.display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("does not compile"), "{stderr}");
}

/// A backend that answers with its own name, so a test can see where a route points.
async fn named_backend(name: &'static str) -> Backend {
    Backend::start(move |_request: Request<Incoming>| async move { Response::new(full(name)) })
        .await
}

fn two_upstream_policy(a: &Backend, b: &Backend, target: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\naccess_log = false\ndefault_upstream = \"a\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.a]\nurl = \"http://{}\"\n[upstream.b]\nurl = \"http://{}\"\n[[route]]\nname = \"switching\"\nmatch = {{ path_prefix = \"/\" }}\nupstream = \"{target}\"\n",
        a.addr, b.addr
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_loses_no_request() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a")).await;
    let file = levee.policy_file();

    // Clients hammer levee for the whole test; every answer must be a 200 from a backend.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (stop, sent, url) = (stop.clone(), sent.clone(), levee.url("/page"));
        clients.push(tokio::spawn(async move {
            let client = client();
            let mut failures = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let request = Request::get(url.as_str()).body(full("")).expect("request");
                match client.request(request).await {
                    Ok(response) if response.status() == 200 => {}
                    Ok(response) => failures.push(format!("status {}", response.status())),
                    Err(error) => failures.push(format!("error {error}")),
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
            failures
        }));
    }

    let broken_versions = [
        "[server\nlisten = ".to_string(), // syntax error
        two_upstream_policy(&a, &b, "a").replace(
            "name = \"switching\"",
            "name = \"switching\"\nname = \"twice\"",
        ), // duplicate key
        two_upstream_policy(&a, &b, "nowhere"), // unknown upstream
    ];
    let mut good_changes = 0;
    let mut bad_changes = 0;
    for change in 0..20 {
        let generation = levee.generation();
        let failures_before = metric(&levee, "levee_policy_reload_failures_total").await;
        if change % 3 == 2 {
            let broken = &broken_versions[(change / 3) % broken_versions.len()];
            std::fs::write(&file, broken).expect("write broken policy");
            eventually(
                Duration::from_secs(10),
                "the broken policy to be refused",
                || async {
                    metric(&levee, "levee_policy_reload_failures_total").await > failures_before
                },
            )
            .await;
            assert_eq!(
                levee.generation(),
                generation,
                "a broken policy must not be swapped in"
            );
            let status = get(&levee.admin_url("/status")).await.json();
            let location = status["policy"]["last_reload_error"]["errors"][0]["file"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            assert!(location.ends_with("levee.toml"), "{status}");
            assert!(
                status["policy"]["last_reload_error"]["errors"][0]["line"]
                    .as_u64()
                    .unwrap_or(0)
                    >= 1,
                "{status}"
            );
            bad_changes += 1;
        } else {
            let target = if change % 2 == 0 { "b" } else { "a" };
            let text = two_upstream_policy(&a, &b, target) + &format!("# change {change}\n");
            if change % 2 == 0 {
                // Editors often write a temp file and rename it over the original.
                let temp = file.with_extension("toml.tmp");
                std::fs::write(&temp, &text).expect("write temp");
                std::fs::rename(&temp, &file).expect("rename");
            } else {
                std::fs::write(&file, &text).expect("write policy");
            }
            eventually(
                Duration::from_secs(10),
                "the good policy to take effect",
                || async {
                    levee.generation() > generation
                        && get(&levee.url("/check")).await.text() == target
                },
            )
            .await;
            good_changes += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for client in clients {
        failures.extend(client.await.expect("client task"));
    }
    assert!(
        failures.is_empty(),
        "{} failed requests: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        sent.load(Ordering::Relaxed) > 100,
        "the load was too light to prove anything"
    );
    assert_eq!((good_changes, bad_changes), (14, 6));
    assert!(metric(&levee, "levee_policy_reload_failures_total").await >= 6.0);
}

async fn metric(levee: &Levee, name: &str) -> f64 {
    let text = get(&levee.admin_url("/metrics")).await.text();
    text.lines()
        .find(|line| line.starts_with(name) && line[name.len()..].starts_with(' '))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn admin_reload_answers_with_the_errors_or_the_new_generation() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("levee.toml"),
        two_upstream_policy(&a, &b, "a"),
    )
    .expect("write");
    let mut options = levee::Options::new(dir.path());
    options.watch = false;
    let running = levee::start(options).await.expect("start");
    let admin = format!("http://{}", running.admin_addr);
    let public = format!("http://{}", running.public_addr);

    // Unchanged files: nothing swapped.
    let same = post(&format!("{admin}/reload"), "").await;
    assert_eq!(same.status, 200);
    assert_eq!(same.json()["changed"], false);

    std::fs::write(
        dir.path().join("levee.toml"),
        two_upstream_policy(&a, &b, "missing"),
    )
    .expect("write");
    let refused = post(&format!("{admin}/reload"), "").await;
    assert_eq!(refused.status, 422);
    let body = refused.json();
    assert_eq!(body["active_generation"], 1);
    assert!(
        body["errors"][0]["location"]
            .as_str()
            .unwrap_or_default()
            .ends_with("levee.toml:14:12"),
        "{body}"
    );
    assert_eq!(
        get(&format!("{public}/")).await.text(),
        "a",
        "the old policy keeps serving"
    );

    std::fs::write(
        dir.path().join("levee.toml"),
        two_upstream_policy(&a, &b, "b"),
    )
    .expect("write");
    let accepted = post(&format!("{admin}/reload"), "").await;
    assert_eq!(accepted.status, 200);
    assert_eq!(accepted.json()["generation"], 2);
    assert_eq!(get(&format!("{public}/")).await.text(), "b");

    let status = get(&format!("{admin}/status")).await.json();
    assert_eq!(status["policy"]["generation"], 2);
    assert!(status["policy"]["last_reload_error"].is_null(), "{status}");
    assert_eq!(status["policy"]["hash"].as_str().map(str::len), Some(16));
    // Each file's own hash, by name: what instances with a file of their own still share.
    assert_eq!(
        status["policy"]["file_hashes"]["levee.toml"]
            .as_str()
            .map(str::len),
        Some(16),
        "{status}"
    );
    assert_eq!(status["routes"][0]["name"], "switching");
    assert_eq!(status["routes"][0]["upstream"], "b");
    let wrong_method = get(&format!("{admin}/reload")).await;
    assert_eq!(
        (wrong_method.status, wrong_method.header("allow")),
        (405, Some("POST"))
    );
    for (method, path, allow) in [
        ("POST", "/status", "GET"),
        ("DELETE", "/queues", "GET"),
        ("GET", "/level", "POST"),
        ("GET", "/modules/ranking", "POST"),
        ("GET", "/breakers/b", "POST"),
    ] {
        let request = http::Request::builder()
            .method(method)
            .uri(format!("{admin}{path}"))
            .body(full(""))
            .expect("request");
        let answer = send(request).await;
        assert_eq!(
            (answer.status, answer.header("allow")),
            (405, Some(allow)),
            "{method} {path}: {}",
            answer.text()
        );
    }
    let head = send(
        http::Request::builder()
            .method("HEAD")
            .uri(format!("{admin}/status"))
            .body(full(""))
            .expect("request"),
    )
    .await;
    assert_eq!((head.status, head.text().as_str()), (200, ""));
    assert_eq!(get(&format!("{admin}/nope")).await.status, 404);
    // The admin API is not reachable through the public listener.
    assert_eq!(get(&format!("{public}/status")).await.text(), "b");

    // A new listen address is accepted but not moved to: the reload says so, and /status
    // keeps saying so, where the operator who changed it looks.
    std::fs::write(
        dir.path().join("levee.toml"),
        two_upstream_policy(&a, &b, "b").replacen("127.0.0.1:0", "127.0.0.1:1", 1),
    )
    .expect("write");
    let moved = post(&format!("{admin}/reload"), "").await;
    assert_eq!(moved.status, 200);
    assert!(
        moved.json()["warnings"]
            .to_string()
            .contains("take effect only after a restart"),
        "{}",
        moved.text()
    );
    let status = get(&format!("{admin}/status")).await.json();
    assert!(
        status["policy"]["warnings"]
            .to_string()
            .contains("take effect only after a restart"),
        "{status}"
    );
    assert_eq!(get(&format!("{public}/")).await.text(), "b");
}

/// The ```toml blocks of the document at `path` (from the repository's root), each as a
/// policy file named by its place.
fn toml_blocks(path: &str) -> Vec<levee::config::SourceFile> {
    let text = std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|error| panic!("{path}: {error}"));
    text.split("```toml\n")
        .skip(1)
        .enumerate()
        .map(|(index, block)| levee::config::SourceFile {
            path: format!("{path} block {index}").into(),
            text: block.split("```").next().unwrap_or_default().to_string(),
        })
        .collect()
}

#[test]
fn every_toml_example_in_the_policy_reference_uses_real_keys() {
    let mut blocks = 0;
    for (index, file) in toml_blocks("docs/policy.md")
        .into_iter()
        .chain(toml_blocks("docs/operations.md"))
        .enumerate()
    {
        let text = file.text.clone();
        // Examples are fragments (a route may name an upstream shown elsewhere), so only
        // syntax and key names are checked here, not cross-references.
        if let Err(diagnostics) = levee::config::compile(&[file], None) {
            for diagnostic in &diagnostics.0 {
                let hint = diagnostic.hint.as_deref().unwrap_or("");
                assert!(
                    !hint.starts_with("check the spelling")
                        && !hint.starts_with("this is not valid TOML"),
                    "docs example {index} is wrong: {diagnostic}\n{text}"
                );
            }
        }
        blocks += 1;
    }
    assert!(blocks >= 10, "found only {blocks} examples");
}

/// The guide for operators coming from nginx shows whole policies: each must pass as written.
#[test]
fn every_policy_in_the_nginx_guide_is_valid() {
    let mut blocks = 0;
    for (index, file) in toml_blocks("docs/from-nginx.md").into_iter().enumerate() {
        let text = file.text.clone();
        if let Err(diagnostics) = levee::config::compile(&[file], None) {
            panic!("docs/from-nginx.md example {index} is refused:\n{diagnostics}\n{text}");
        }
        blocks += 1;
    }
    assert!(blocks >= 3, "found only {blocks} examples");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_directory_replaced_whole_is_watched_again_and_loaded() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a")).await;
    assert_eq!(get(&levee.url("/page")).await.text(), "a");
    // The operator swaps in a new directory: `mv policies policies.old; mv new policies`.
    let dir = levee.dir.path().to_path_buf();
    let old = dir.with_extension("old");
    let new = dir.with_extension("new");
    std::fs::create_dir(&new).expect("new dir");
    std::fs::write(new.join("levee.toml"), two_upstream_policy(&a, &b, "b")).expect("write");
    std::fs::rename(&dir, &old).expect("move the old one away");
    std::fs::rename(&new, &dir).expect("move the new one in");
    eventually(
        Duration::from_secs(10),
        "the new directory's policy",
        || async { get(&levee.url("/page")).await.text() == "b" },
    )
    .await;
    // Later edits in the new directory are seen too.
    std::fs::write(dir.join("levee.toml"), two_upstream_policy(&a, &b, "a")).expect("write");
    eventually(
        Duration::from_secs(10),
        "an edit in the new directory",
        || async { get(&levee.url("/page")).await.text() == "a" },
    )
    .await;
    let _ = std::fs::remove_dir_all(&old);
}

/// A file saved beside the policy with a name levee does not read (`limits.TOML`) is said at
/// once, where the operator looks; it was said only by the next reload of a real change, and
/// its rules were missing without a word until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_saved_under_a_name_levee_does_not_read_is_said_at_once() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a")).await;
    std::fs::write(
        levee.dir.path().join("limits.TOML"),
        "[limit.login]\nkey = \"ip\"\nrate = \"5/min\"\n",
    )
    .expect("write");
    eventually(
        Duration::from_secs(10),
        "the warning in /status",
        || async {
            get(&levee.admin_url("/status")).await.json()["policy"]["warnings"]
                .to_string()
                .contains("`limits.TOML` is not read")
        },
    )
    .await;
    assert_eq!(get(&levee.url("/page")).await.text(), "a");
}

/// A directory swapped in while a file in it is still being written (a copy under way) is read
/// once its writer is done, never half: the half may compile, without the routes written after
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_swapped_in_while_its_file_is_written_is_read_once_whole() {
    use std::io::Write;
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a")).await;
    let generation =
        || async { get(&levee.admin_url("/status")).await.json()["policy"]["generation"].as_u64() };
    let before = generation().await;
    // Whole, it sends /page to `a` as before; its first half, without the route, to `b`.
    let whole = two_upstream_policy(&a, &b, "a")
        .replace("default_upstream = \"a\"", "default_upstream = \"b\"");
    let (half, rest) = whole.split_at(whole.find("[[route]]").expect("a route"));
    let dir = levee.dir.path().to_path_buf();
    let (old, new) = (dir.with_extension("old"), dir.with_extension("new"));
    std::fs::create_dir(&new).expect("new dir");
    let mut file = std::fs::File::create(new.join("levee.toml")).expect("create");
    file.write_all(half.as_bytes()).expect("write");
    std::fs::rename(&dir, &old).expect("move the old one away");
    std::fs::rename(&new, &dir).expect("move the new one in");
    // The copy goes on for longer than the watcher takes to see the new directory (a second).
    for line in 0..30 {
        file.write_all(format!("# line {line}\n").as_bytes())
            .expect("write");
        assert_eq!(
            get(&levee.url("/page")).await.text(),
            "a",
            "the half-written file was loaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    file.write_all(rest.as_bytes()).expect("write");
    drop(file);
    eventually(Duration::from_secs(10), "the whole file loaded", || async {
        generation().await != before
    })
    .await;
    assert_eq!(get(&levee.url("/page")).await.text(), "a");
    let _ = std::fs::remove_dir_all(&old);
}

/// A policy file that is a symlink to a file kept elsewhere (config management) is reloaded
/// when that file is edited or replaced, though the directory itself sees no change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linked_policy_files_target_is_followed() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a")).await;
    let elsewhere = tempfile::tempdir().expect("dir");
    let target = elsewhere.path().join("levee.toml");
    // A comment more: the link is a change of the policy's text, loaded as a generation.
    let linked = format!("{}# kept elsewhere\n", two_upstream_policy(&a, &b, "a"));
    std::fs::write(&target, linked).expect("write");
    let generation =
        || async { get(&levee.admin_url("/status")).await.json()["policy"]["generation"].as_u64() };
    let before = generation().await;
    let file = levee.policy_file();
    std::fs::remove_file(&file).expect("remove");
    std::os::unix::fs::symlink(&target, &file).expect("link");
    eventually(Duration::from_secs(10), "the link loaded", || async {
        generation().await != before
    })
    .await;
    assert_eq!(get(&levee.url("/page")).await.text(), "a");
    // Replaced as editors and config management do: written aside, renamed over.
    let aside = elsewhere.path().join("levee.toml.new");
    std::fs::write(&aside, two_upstream_policy(&a, &b, "b")).expect("write");
    std::fs::rename(&aside, &target).expect("rename");
    eventually(
        Duration::from_secs(10),
        "the target's change loaded",
        || async { get(&levee.url("/page")).await.text() == "b" },
    )
    .await;
    // Written in place.
    std::fs::write(&target, two_upstream_policy(&a, &b, "a")).expect("write");
    eventually(
        Duration::from_secs(10),
        "the target's edit loaded",
        || async { get(&levee.url("/page")).await.text() == "a" },
    )
    .await;
}

/// A reload asked on the admin listener runs to its end even when the client that asked goes
/// away meanwhile (`curl --max-time`, a dropped SSH tunnel): the outcome is recorded and a
/// good policy swapped in, as if the client had stayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_reload_runs_to_its_end_when_its_client_goes_away() {
    use tokio::io::AsyncWriteExt;

    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let policy = dir.path().join("levee.toml");
    std::fs::write(&policy, two_upstream_policy(&a, &b, "a")).expect("write");
    let mut options = levee::Options::new(dir.path());
    options.watch = false;
    let running = levee::start(options).await.expect("start");
    let admin = format!("http://{}", running.admin_addr);

    // The next policy trusts a CA file that is a pipe: its compile waits until the test
    // writes into it, long after the client is gone.
    let fifo = dir.path().join("ca.pem");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    std::fs::write(
        &policy,
        format!(
            "{}[upstream.pinned]\nurl = \"https://127.0.0.1:9\"\nca_files = [\"ca.pem\"]\n",
            two_upstream_policy(&a, &b, "b")
        ),
    )
    .expect("write");
    let (opened, reading) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        // Opening a pipe for writing waits for its reader: the compile.
        let mut pipe = std::fs::OpenOptions::new()
            .write(true)
            .open(&fifo)
            .expect("open the pipe");
        let _ = opened.send(());
        let _ = released.recv();
        pipe.write_all(b"not a certificate\n")
            .expect("write the pipe");
    });

    let mut client = tokio::net::TcpStream::connect(running.admin_addr)
        .await
        .expect("connect");
    client
        .write_all(b"POST /reload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")
        .await
        .expect("send");
    tokio::task::spawn_blocking(move || reading.recv_timeout(Duration::from_secs(10)))
        .await
        .expect("join")
        .expect("the reload reads the CA file");
    // The client goes away while the compile waits.
    drop(client);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = release.send(());
    writer.join().expect("writer");

    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = get(&format!("{admin}/status")).await.json();
        let error = &status["policy"]["last_reload_error"];
        if !error.is_null() {
            assert_eq!(error["trigger"], "admin", "{status}");
            assert_eq!(status["policy"]["generation"], 1, "the old policy stays");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the reload whose client left was never finished: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every key has its default and an example: a table row alone leaves an operator guessing how
/// the value is written (a duration in quotes with a unit, a list, an inline table).
///
/// Keys are the backticked names in the first column of table rows (rows that start with
/// "| `"; a row may name several keys, as `status`, `content_type`, `body` does). A table's
/// heading row is skipped even when it starts so (`[redis.sentinel]` key), as it names no key.
/// A plain name must be written as a key at any depth of some ```toml block (`window` inside
/// `breaker = { … }` counts). A name in brackets (`[redis.sentinel]`, `[[route]]`) is a table:
/// its whole path must be written from the top, as a header or inline. A segment in capitals
/// (`NAME` in `[upstream.NAME]`) is a placeholder and stands for any name. A key is looked for
/// by name, not in its own section: `max_body` in `[server]` also counts for `[queue]`.
#[test]
fn every_key_in_the_policy_reference_tables_has_an_example() {
    fn written_paths(value: &toml::Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match value {
            toml::Value::Table(table) => {
                for (key, value) in table {
                    path.push(key.clone());
                    out.push(path.clone());
                    written_paths(value, path, out);
                    path.pop();
                }
            }
            // An array of tables (`[[route]]`) adds no segment: `route.match.path`.
            toml::Value::Array(items) => {
                for item in items {
                    written_paths(item, path, out);
                }
            }
            _ => {}
        }
    }
    fn segment_matches(pattern: &str, written: &str) -> bool {
        let placeholder = !pattern.is_empty() && pattern.chars().all(|c| c.is_ascii_uppercase());
        placeholder || pattern == written
    }

    let reference = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/policy.md"))
        .expect("docs/policy.md");
    let mut written = Vec::new();
    for (index, block) in reference.split("```toml\n").skip(1).enumerate() {
        let text = block.split("```").next().unwrap_or_default();
        let table: toml::Table = text.parse().unwrap_or_else(|error| {
            panic!("docs/policy.md example {index} is not valid TOML: {error}\n{text}")
        });
        written_paths(&toml::Value::Table(table), &mut Vec::new(), &mut written);
    }

    let lines: Vec<&str> = reference.lines().collect();
    let mut keys = 0;
    let mut missing = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        let heading = lines
            .get(index + 1)
            .is_some_and(|next| next.starts_with("|---"));
        if !line.starts_with("| `") || heading {
            continue;
        }
        let first_column = line.split('|').nth(1).unwrap_or_default();
        for name in first_column.split('`').skip(1).step_by(2) {
            keys += 1;
            let table = name.starts_with('[');
            let pattern: Vec<&str> = name.trim_matches(['[', ']']).split('.').collect();
            let found = written.iter().any(|path| {
                let tail = if table {
                    path.len() == pattern.len()
                } else {
                    path.len() >= pattern.len()
                };
                tail && pattern
                    .iter()
                    .rev()
                    .zip(path.iter().rev())
                    .all(|(pattern, written)| segment_matches(pattern, written))
            });
            if !found {
                missing.push(format!("docs/policy.md:{}: `{name}`", index + 1));
            }
        }
    }
    // A change to the tables' layout must not leave this test checking nothing.
    assert!(keys >= 50, "found only {keys} keys in the reference tables");
    assert!(
        missing.is_empty(),
        "{} key(s) with a table row appear in no ```toml example:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

/// A file written in place (`cp`, `scp`, `rsync --inplace`, `cat >`) is empty, then holds part
/// of the policy, until the writer closes it. What is left may still compile: read then, it
/// would drop the routes and limits of the missing part until the writer is done. It is read
/// once closed; an empty file is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_file_written_in_place_is_read_once_it_is_closed() {
    use std::io::Write as _;
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "b")).await;
    assert_eq!(get(&levee.url("/page")).await.text(), "b");
    let generation = levee.generation();

    let next = two_upstream_policy(&a, &b, "b").replace("\"switching\"", "\"switched\"");
    let (head, routes) = next.split_at(next.find("[[route]]").expect("routes"));
    let mut file = std::fs::File::create(levee.policy_file()).expect("open");
    file.write_all(head.as_bytes()).expect("write");
    file.flush().expect("flush");
    // The writer pauses (a slow link) for longer than the watch's debounce: what is there so
    // far compiles (no routes: every page to `a`), and must not be loaded.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(levee.generation(), generation, "half a file was loaded");
    assert_eq!(get(&levee.url("/page")).await.text(), "b");
    file.write_all(routes.as_bytes()).expect("write");
    drop(file);
    eventually(Duration::from_secs(10), "the whole file", || async {
        levee.generation() > generation
    })
    .await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["routes"][0]["name"], "switched", "{status}");
    assert_eq!(
        levee.generation(),
        generation + 1,
        "one reload, of the whole file"
    );

    // An empty placeholder (an empty ConfigMap key) sets nothing and loses nothing: loaded.
    std::fs::write(levee.dir.path().join("overrides.toml"), "").expect("placeholder");
    eventually(
        Duration::from_secs(10),
        "the placeholder loaded",
        || async { levee.generation() == generation + 2 },
    )
    .await;
    // A file that held the policy, emptied and closed: refused, the policy serves on.
    std::fs::write(levee.policy_file(), "").expect("empty");
    eventually(
        Duration::from_secs(10),
        "the empty file refused",
        || async {
            get(&levee.admin_url("/status")).await.json()["policy"]["last_reload_error"]["errors"]
                [0]["message"]
                .as_str()
                .is_some_and(|error| error.contains("the file is empty"))
        },
    )
    .await;
    assert_eq!(get(&levee.url("/page")).await.text(), "b");
}

/// A reload asked for while a policy file is being written in place (a `kill -HUP` racing an
/// editor's save or a slow `scp`) waits for the writer to close it, as the watcher does: read
/// at once, what was left of the file compiled (a route cut before its `match` took every
/// request after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_asked_for_while_a_file_is_written_waits_for_it() {
    use std::io::Write as _;
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "b")).await;
    let generation = levee.generation();
    let next = two_upstream_policy(&a, &b, "b").replace("\"switching\"", "\"switched\"");
    let (head, rest) = next.split_at(next.find("match =").expect("match"));
    let mut file = std::fs::File::create(levee.policy_file()).expect("open");
    file.write_all(head.as_bytes()).expect("write");
    file.flush().expect("flush");
    eventually(Duration::from_secs(10), "the write seen", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["policy"]["being_written"]
            .as_array()
            .is_some_and(|files| files.len() == 1)
    })
    .await;
    let mut reload = tokio::spawn(post_owned(levee.admin_url("/reload")));
    // Still waiting half a second on (the writer pauses, as a slow link does): nothing read.
    let waited = tokio::time::timeout(Duration::from_millis(500), &mut reload).await;
    if let Ok(answered) = waited {
        let text = answered.map(|answer| answer.text()).unwrap_or_default();
        panic!("the reload did not wait for the writer: {text}");
    }
    assert_eq!(levee.generation(), generation);
    file.write_all(rest.as_bytes()).expect("write");
    drop(file);
    let answer = reload.await.expect("reload");
    assert_eq!(answer.status, 200, "{}", answer.text());
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["routes"][0]["name"], "switched", "{status}");
    assert_eq!(status["routes"][0]["match"]["path_prefix"], "/", "{status}");
    assert_eq!(get(&levee.url("/page")).await.text(), "b");
}

/// A policy directory that goes away (moved, deleted by a deploy) is said once and shown in
/// `/status` and `levee status` while it lasts; when it is back, it is watched and read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_directory_gone_is_shown_until_it_is_back() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a")).await;
    let dir = levee.dir.path().to_path_buf();
    let away = dir.with_extension("away");
    std::fs::rename(&dir, &away).expect("move away");
    eventually(Duration::from_secs(10), "the watch error shown", || async {
        let status = get(&levee.admin_url("/status")).await.json();
        status["policy"]["watch_error"]
            .as_str()
            .is_some_and(|error| error.starts_with("cannot watch the policy directory"))
    })
    .await;
    let summary = levee::admin::client::summarize(&get(&levee.admin_url("/status")).await.json());
    assert!(
        summary.contains("NOT WATCHED: cannot watch the policy directory (it does not exist now): edits are not read"),
        "{summary}"
    );
    std::fs::write(away.join("levee.toml"), two_upstream_policy(&a, &b, "b")).expect("edit");
    std::fs::rename(&away, &dir).expect("move back");
    eventually(
        Duration::from_secs(10),
        "watched and read again",
        || async {
            get(&levee.admin_url("/status")).await.json()["policy"]["watch_error"].is_null()
                && get(&levee.url("/page")).await.text() == "b"
        },
    )
    .await;
}

async fn post_owned(url: String) -> Answer {
    post(&url, "").await
}

/// A policy file emptied and left so is meant to be empty once it has been for longer than a
/// writer may pause: refused at first (caught between a save's truncation and its write?),
/// loaded then, as `levee check` loads it; it no longer holds every later edit back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_left_empty_is_loaded_once_it_has_been_for_a_while() {
    let log = levee_log();
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let levee = Levee::start(&two_upstream_policy(&a, &b, "a")).await;
    let extra = levee.dir.path().join("extra.toml");
    let route = "[[route]]\nname = \"extra\"\nmatch = { path = \"/extra\" }\nupstream = \"b\"\n";
    std::fs::write(&extra, route).expect("extra");
    eventually(Duration::from_secs(10), "the extra route", || async {
        get(&levee.url("/extra")).await.text() == "b"
    })
    .await;
    std::fs::write(&extra, "").expect("empty");
    eventually(
        Duration::from_secs(10),
        "the emptied file refused",
        || async {
            get(&levee.admin_url("/status")).await.json()["policy"]["last_reload_error"]["errors"]
                [0]["message"]
                .as_str()
                .is_some_and(|error| error.contains("the file is empty now"))
        },
    )
    .await;
    assert_eq!(get(&levee.url("/extra")).await.text(), "b");
    // A minute later (its time set back rather than waited for).
    let emptied = std::fs::File::options()
        .write(true)
        .open(&extra)
        .expect("open");
    emptied
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(60))
        .expect("time");
    drop(emptied);
    let answer = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(get(&levee.url("/extra")).await.text(), "a");
    // Said above info: a truncation by a full disk looks the same.
    let said = log.lines_with("a policy file that held settings is empty now");
    assert!(
        said.iter()
            .any(|line| line.contains(&extra.display().to_string())),
        "{said:?}"
    );
}

/// A policy directory reached through a symlink that a deploy switches to another target: the
/// new target is loaded, and edits in it are seen from then on (not the old target's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_symlink_switched_to_another_directory_is_followed() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let root = tempfile::tempdir().expect("dir");
    let (first, second) = (root.path().join("v1"), root.path().join("v2"));
    for (dir, target) in [(&first, "a"), (&second, "b")] {
        std::fs::create_dir(dir).expect("dir");
        std::fs::write(dir.join("levee.toml"), two_upstream_policy(&a, &b, target)).expect("write");
    }
    let current = root.path().join("current");
    std::os::unix::fs::symlink(&first, &current).expect("link");
    let running = levee::start(levee::Options::new(&current))
        .await
        .expect("start");
    let url = format!("http://{}/page", running.public_addr);
    assert_eq!(get(&url).await.text(), "a");

    // `ln -s v2 next && mv -T next current`
    let next = root.path().join("next");
    std::os::unix::fs::symlink(&second, &next).expect("link");
    std::fs::rename(&next, &current).expect("switch");
    eventually(Duration::from_secs(10), "the new target", || async {
        get(&url).await.text() == "b"
    })
    .await;
    std::fs::write(second.join("levee.toml"), two_upstream_policy(&a, &b, "a")).expect("edit");
    eventually(
        Duration::from_secs(10),
        "an edit in the new target",
        || async { get(&url).await.text() == "a" },
    )
    .await;
}

/// `/status` shows every condition a route matches on, keyed as `match` writes them: a route
/// for one host or for the machine's own clients showed `"match": null`, which the dashboard
/// read as "any", a catch-all. Only a route that takes every request shows `{}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_every_condition_a_route_matches_on() {
    // Every key of a route's `match` table: one added there must be shown, and listed here.
    let levee::config::spec::MatchSpec {
        host: _,
        client: _,
        method: _,
        path: _,
        path_prefix: _,
        path_regex: _,
    } = levee::config::spec::MatchSpec::default();
    let backend = echo_backend().await;
    let routes = r#"
[[route]]
name = "admin_site"
match = { host = ["Admin.Example", "*.admin.example."] }
[[route]]
name = "local"
match = { client = ["127.0.0.1/32", "::1"] }
[[route]]
name = "api_writes"
match = { method = ["POST", "put"], path_prefix = "/api/", host = "api.example" }
[[route]]
name = "login"
match = { path = "/wp-login.php", client = "10.0.0.0/8", method = "POST" }
[[route]]
name = "feeds"
match = { path_regex = "^/feed/[0-9]+$" }
[[route]]
name = "everything"
"#;
    let levee = Levee::start(&policy_for(backend.addr, "", routes)).await;
    let status = get(&levee.admin_url("/status")).await.json();
    let shown: Vec<_> = status["routes"]
        .as_array()
        .expect("routes")
        .iter()
        .map(|route| {
            (
                route["name"].as_str().unwrap_or("?"),
                route["match"].clone(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        vec![
            (
                "admin_site",
                serde_json::json!({ "host": ["admin.example", "*.admin.example"] })
            ),
            (
                "local",
                serde_json::json!({ "client": ["127.0.0.1/32", "::1/128"] })
            ),
            (
                "api_writes",
                serde_json::json!({
                    "host": ["api.example"],
                    "method": ["POST", "PUT"],
                    "path_prefix": "/api/"
                })
            ),
            (
                "login",
                serde_json::json!({
                    "client": ["10.0.0.0/8"],
                    "method": ["POST"],
                    "path": "/wp-login.php"
                })
            ),
            (
                "feeds",
                serde_json::json!({ "path_regex": "^/feed/[0-9]+$" })
            ),
            ("everything", serde_json::json!({})),
            // The default upstream's route, for requests no route takes.
            ("default", serde_json::json!({})),
        ],
        "{status}"
    );
}

/// A site's file moved away (`.disabled`) takes its routes with it, and its hosts then reach
/// the catch-all: the reload says which hosts no route names any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_leaves_hosts_without_a_route_says_which() {
    let log = levee_log();
    let backend =
        Backend::start(|_request: Request<Incoming>| async move { Response::new(full("ok")) })
            .await;
    let levee = Levee::start(&policy_for(backend.addr, "access_log = false", "")).await;
    let site = levee.policy_file().with_file_name("20-gone-blog.toml");
    std::fs::write(
        &site,
        "[[route]]\nname = \"gone_blog\"\nmatch = { host = [\"gone-blog.example\", \"www.gone-blog.example\"] }\n",
    )
    .expect("site file");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    // Hosts a wildcard route still matches are not gone.
    std::fs::write(
        &site,
        "[[route]]\nname = \"gone_blog\"\nmatch = { host = [\"*.gone-blog.example\", \"gone-blog.example\"] }\n",
    )
    .expect("site file");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert!(
        !reloaded.text().contains("no route names"),
        "{}",
        reloaded.text()
    );
    std::fs::rename(&site, site.with_extension("toml.disabled")).expect("disable");
    let reloaded = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    // Said where `levee reload` and `/status` show warnings, and in the log.
    assert!(
        reloaded.text().contains(
            "no route names these hosts any more: *.gone-blog.example, gone-blog.example"
        ),
        "{}",
        reloaded.text()
    );
    let said = log.lines_with("no route names these hosts any more");
    assert!(
        said.iter().any(
            |line| line.contains("*.gone-blog.example, gone-blog.example")
                && line.contains("-20-gone-blog.toml")
        ),
        "{said:?}"
    );
}

/// A warning the policy in effect had already is not logged again at each reload (an alert on
/// warnings fired at every deploy); one the reload brings is, though its line moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_logs_only_the_warnings_it_brings() {
    let log = levee_log();
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let catch_all = "[[route]]\nname = \"switching\"";
    let shadowed = "[[route]]\nname = \"wide\"\nmatch = { path_prefix = \"/warned\" }\n[[route]]\nname = \"warnedonce\"\nmatch = { path = \"/warnedonce\" }\n";
    let policy =
        two_upstream_policy(&a, &b, "a").replace(catch_all, &format!("{shadowed}{catch_all}"));
    let levee = Levee::start(&policy).await;
    let warned = || log.lines_with("route `warnedonce` is never reached").len();
    assert_eq!(warned(), 1);
    // An edit above it (the warning's line moves), and a second shadowed route.
    let added = "[[route]]\nname = \"warnednew\"\nmatch = { path = \"/warnednew\" }\n";
    let edited = policy.replace(shadowed, &format!("# edited\n{shadowed}{added}"));
    std::fs::write(levee.policy_file(), edited).expect("rewrite");
    let answer = post(&levee.admin_url("/reload"), "").await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    // The reload's answer (`levee reload`) still lists both.
    assert!(answer.text().contains("warnedonce"), "{}", answer.text());
    assert_eq!(
        log.lines_with("route `warnednew` is never reached").len(),
        1
    );
    assert_eq!(warned(), 1, "said once, at the start");
}

/// The series of a route, an upstream and a limit rule a reload removed leave the page:
/// each name ever loaded kept its lines, and a soak of reloads grew the page without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_drops_the_series_of_what_it_removed() {
    let a = named_backend("a").await;
    // `/held` waits for `release` once it has said it `arrived`: the first request of its
    // route, in flight across the reload that removes the route.
    let arrived = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let b = {
        let (arrived, release) = (arrived.clone(), release.clone());
        Backend::start(move |request: Request<Incoming>| {
            let held = request.uri().path() == "/held";
            let (arrived, release) = (arrived.clone(), release.clone());
            async move {
                if held {
                    arrived.notify_one();
                    release.notified().await;
                }
                Response::new(full("b"))
            }
        })
        .await
    };
    let with_extra = two_upstream_policy(&a, &b, "a").replace(
        "[[route]]\nname = \"switching\"",
        "[limit.per_ip]\nkey = \"ip\"\nrate = \"100/s\"\nburst = 100\n[[route]]\nname = \"extra\"\nmatch = { path_prefix = \"/extra\" }\nupstream = \"b\"\nlimits = [\"per_ip\"]\n[[route]]\nname = \"held\"\nmatch = { path = \"/held\" }\nupstream = \"b\"\n[[route]]\nname = \"switching\"",
    );
    let levee = Levee::start(&with_extra).await;
    assert_eq!(get(&levee.url("/extra/1")).await.status, 200);
    assert_eq!(get(&levee.url("/page")).await.status, 200);
    let before = get(&levee.admin_url("/metrics")).await.text();
    for series in [
        "levee_requests_total{route=\"extra\",status=\"200\"} 1",
        "levee_request_duration_seconds_count{route=\"extra\"} 1",
        "levee_upstream_errors_total{upstream=\"b\",kind=\"connect\"} 0",
        "levee_ratelimit_decisions_total{rule=\"per_ip\",result=\"allowed\",source=\"local\"} 1",
    ] {
        assert!(before.contains(series), "{series} in {before}");
    }

    let without =
        two_upstream_policy(&a, &b, "a").replace("[upstream.b]\nurl", "[upstream.gone]\nurl");
    let url = levee.url("/held");
    let held = tokio::spawn(async move { get(&url).await });
    arrived.notified().await;
    std::fs::write(levee.policy_file(), &without).expect("write");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    // The request in flight ends after the reload: it counts nowhere, or its series came
    // back for good.
    release.notify_one();
    assert_eq!(held.await.expect("task").status, 200);
    let after = get(&levee.admin_url("/metrics")).await.text();
    for gone in [
        "route=\"extra\"",
        "route=\"held\"",
        "upstream=\"b\"",
        "rule=\"per_ip\"",
    ] {
        assert!(!after.contains(gone), "{gone} in {after}");
    }
    assert!(
        after.contains("levee_requests_total{route=\"switching\",status=\"200\"} 1"),
        "a route still there keeps its count: {after}"
    );
}

/// An alert on a counter's increase needs a sample before the first event: the series an
/// upstream or a queue route may count exist at zero from the start (the first jobs
/// dead-lettered after a start were never alerted on). Files refused on disk show as a gauge
/// until a reload loads them (a counter's increase cleared by itself while the file stayed
/// broken), and the build and the process's start, memory and open files are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_alerts_read_exist_at_zero_and_a_refused_policy_shows_until_fixed() {
    let a = named_backend("a").await;
    let b = named_backend("b").await;
    let policy = two_upstream_policy(&a, &b, "a")
        .replace("[upstream.b]", "max_inflight = 4\n[upstream.b]")
        .replace(
            "[[route]]\nname = \"switching\"",
            "[[route]]\nname = \"notify\"\nmatch = { method = \"POST\", path = \"/notify\" }\nalways_queue = true\n[[route]]\nname = \"switching\"",
        )
        + "[redis]\nurl = \"redis://127.0.0.1:1\"\n";
    let levee = Levee::start(&policy).await;
    let metrics = get(&levee.admin_url("/metrics")).await.text();
    for series in [
        "levee_upstream_errors_total{upstream=\"a\",kind=\"connect\"} 0",
        "levee_breaker_transitions_total{upstream=\"a\",to=\"open\"} 0",
        "levee_breaker_rejected_total{upstream=\"b\"} 0",
        "levee_shed_total{upstream=\"a\",tier=\"3\"} 0",
        "levee_policy_refused 0",
        "levee_queue_dead_lettered_total{route=\"notify\"} 0",
        "levee_redis_transitions_total{to=\"down\"} 0",
    ] {
        assert!(metrics.contains(series), "{series} in {metrics}");
    }
    assert!(
        metrics.contains(&format!(
            "levee_build_info{{version=\"{}\",commit=\"",
            env!("CARGO_PKG_VERSION")
        )),
        "{metrics}"
    );
    for gauge in [
        "levee_process_start_time_seconds",
        "levee_process_resident_memory_bytes",
        "levee_process_open_fds",
    ] {
        assert!(metric_value(&metrics, gauge) > 0.0, "{gauge} in {metrics}");
    }

    std::fs::write(levee.policy_file(), format!("{policy}bogus = [\n")).expect("break");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 422);
    assert_eq!(metric(&levee, "levee_policy_refused").await, 1.0);
    std::fs::write(levee.policy_file(), &policy).expect("fix");
    assert_eq!(post(&levee.admin_url("/reload"), "").await.status, 200);
    assert_eq!(metric(&levee, "levee_policy_refused").await, 0.0);
}
