//! The operator CLI against a running levee, and admin tokens.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const TOKEN: &str = "0123456789abcdef-ops-token";

fn levee_cli(
    args: &[&str],
    admin: std::net::SocketAddr,
    token: Option<&str>,
) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_levee"));
    command
        .args(args)
        .arg("--admin")
        .arg(admin.to_string())
        .env_remove("LEVEE_ADMIN_TOKEN");
    if let Some(token) = token {
        command.env("LEVEE_ADMIN_TOKEN", token);
    }
    let output = command.output().expect("run levee");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A script guessing admin tokens wrote a warn line per guess (5 MB a second, on the disk the
/// log is on): one line every 10 s, naming the client, with the count held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_admin_tokens_are_logged_at_most_every_ten_seconds() {
    let log = levee_log();
    let backend = echo_backend().await;
    let policy = policy_for(backend.addr, "", "").replace(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        &format!("[admin]\nlisten = \"127.0.0.1:0\"\ntokens = {{ ops = \"{TOKEN}\" }}"),
    );
    let levee = Levee::start(&policy).await;
    for _ in 0..20 {
        let refused = send(
            http::Request::post(levee.admin_url("/level"))
                .header("authorization", "Bearer wrong-token-wrong-token")
                .body(full("1"))
                .expect("request"),
        )
        .await;
        assert_eq!(refused.status, 401);
    }
    let lines = log.lines_with("admin request refused");
    assert!(lines.len() <= 1, "{lines:?}");
    assert!(
        lines.iter().all(|line| line.contains("client=127.0.0.1")),
        "{lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_level_module_breaker_and_reload_from_the_command_line() {
    let backend = echo_backend().await;
    let policy = policy_for(
        backend.addr,
        "",
        "[[route]]\nname = \"ranking\"\nmatch = { path_prefix = \"/ranking\" }\ntier = 3\nmodule = \"ranking\"\n",
    )
    .replace("[admin]\nlisten = \"127.0.0.1:0\"", &format!("[admin]\nlisten = \"127.0.0.1:0\"\ntokens = {{ ops = \"{TOKEN}\" }}"));
    let levee = Levee::start(&policy).await;
    let admin = levee.admin;

    let cli = move |args: Vec<String>, token: Option<&'static str>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            levee_cli(&args, admin, token)
        })
    };
    let run = |args: &[&str], token| cli(args.iter().map(|a| a.to_string()).collect(), token);

    let (ok, out, err) = run(&["status"], None).await.expect("cli");
    assert!(ok, "{err}");
    assert!(out.contains("policy   generation 1"), "{out}");
    // When the running generation was loaded: a reload that changed nothing does not move it.
    assert!(out.contains("s ago\n"), "{out}");
    assert!(
        out.contains("module ranking") && out.contains("on"),
        "{out}"
    );
    assert!(out.contains("upstream app"), "{out}");

    // Changing state needs the token, and the refusal says how to give it (once, not
    // `401: 401`).
    let (ok, _, err) = run(&["module", "ranking", "off"], None).await.expect("cli");
    assert!(!ok);
    assert!(
        err.starts_with("levee: 401 this admin action needs a token"),
        "{err}"
    );
    assert!(err.contains("--token or LEVEE_ADMIN_TOKEN"), "{err}");
    let (ok, out, err) = run(&["module", "ranking", "off"], Some(TOKEN))
        .await
        .expect("cli");
    assert!(ok, "{err}");
    // What is in effect now, and on whose word.
    assert!(
        out.starts_with("module ranking OFF (runtime, by ops"),
        "{out}"
    );
    assert_eq!(get(&levee.url("/ranking")).await.status, 503);
    let status = get(&levee.admin_url("/status")).await.json();
    assert!(
        status["degrade"]["modules"]["ranking"]["changed_by"]
            .as_str()
            .unwrap_or("")
            .starts_with("ops"),
        "{status}"
    );

    let (ok, out, err) = run(&["level", "2"], Some(TOKEN)).await.expect("cli");
    assert!(ok, "{err}");
    assert_eq!(out, "level 2 in effect (runtime)\n");
    let (ok, _, err) = run(&["level", "9"], Some(TOKEN)).await.expect("cli");
    assert!(!ok && err.contains("400"), "{err}");
    let (ok, out, err) = run(&["breaker", "app", "open"], Some(TOKEN))
        .await
        .expect("cli");
    assert!(ok, "{err}");
    assert_eq!(out, "breaker app open (pinned open at runtime)\n");
    assert_eq!(get(&levee.url("/anything")).await.status, 503);
    let (ok, out, _) = run(&["status"], None).await.expect("cli");
    assert!(
        ok && out.contains("level 2 (runtime)") && out.contains("forced by runtime"),
        "{out}"
    );
    let (ok, out, err) = run(&["reload"], Some(TOKEN)).await.expect("cli");
    assert!(ok, "{err}");
    assert_eq!(
        out,
        "levee: policy unchanged: the files are those of generation 1, which keeps running\n"
    );

    // A wrong token is refused like none, and told apart from none.
    let (ok, _, err) = run(&["breaker", "app", "auto"], Some("wrong-token-wrong-token"))
        .await
        .expect("cli");
    assert!(
        !ok && err.contains("401 the token was not accepted"),
        "{err}"
    );

    // Pointed at the public listener by mistake, the CLI's POST reaches the site, which
    // answers 200: that is not taken for levee's answer.
    let public = levee.public;
    let (ok, out, err) =
        tokio::task::spawn_blocking(move || levee_cli(&["level", "1"], public, Some(TOKEN)))
            .await
            .expect("cli");
    assert!(!ok, "{out}");
    assert!(
        err.contains("did not come from levee's admin listener, so nothing was changed"),
        "{err}"
    );
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["level"], 2, "{status}");
}

#[test]
fn an_admin_listener_beyond_loopback_needs_a_token() {
    let stderr = check_fails(
        "[admin]\nlisten = \"0.0.0.0:9901\"\n[upstream.app]\nurl = \"http://127.0.0.1:9\"\n",
    );
    assert!(stderr.contains("levee.toml:2:10: error: the admin listener on 0.0.0.0:9901 is reachable beyond this machine but has no token"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_whose_name_resolves_to_loopback_gets_nothing_from_the_admin_listener() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    // DNS rebinding: the page's own name now points at 127.0.0.1, so its Origin matches Host.
    for request in [
        "GET /status HTTP/1.1\r\nHost: rebind.example:9901\r\nConnection: close\r\n\r\n",
        "POST /level HTTP/1.1\r\nHost: rebind.example:9901\r\nOrigin: http://rebind.example:9901\r\nContent-Length: 1\r\nConnection: close\r\n\r\n2",
    ] {
        let raw = raw_exchange(levee.admin, request.as_bytes(), Duration::from_secs(5)).await;
        assert_eq!(status_of(&raw), Some(403), "{request}\n=> {raw}");
    }
    assert_eq!(
        get(&levee.admin_url("/status")).await.json()["degrade"]["level"],
        0,
        "the level is unchanged"
    );
    // The operator's own names for the listener still work.
    for host in [
        "localhost:9901",
        "localhost.:9901",
        "127.0.0.1",
        "[::1]:9901",
        "[::ffff:127.0.0.1]:9901",
    ] {
        let request = format!("GET /status HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let raw = raw_exchange(levee.admin, request.as_bytes(), Duration::from_secs(5)).await;
        assert_eq!(status_of(&raw), Some(200), "{host}\n=> {raw}");
    }
    // Tokens protect changes; reading needs none, so the guard stays with them.
    let tokened = Levee::start(&policy_for(backend.addr, "", "").replacen(
        "[admin]\n",
        "[admin]\ntokens = { ops = \"0123456789abcdef\" }\n",
        1,
    ))
    .await;
    let raw = raw_exchange(
        tokened.admin,
        b"GET /status HTTP/1.1\r\nHost: rebind.example:9901\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status_of(&raw), Some(403), "{raw}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_sites_cannot_drive_the_admin_api_from_a_browser() {
    let backend = echo_backend().await;
    let policy = policy_for(backend.addr, "", "[[route]]\nname = \"ranking\"\nmatch = { path_prefix = \"/ranking\" }\ntier = 3\nmodule = \"ranking\"\n");
    let levee = Levee::start(&policy).await;
    let cross_site = http::Request::post(levee.admin_url("/modules/ranking"))
        .header("origin", "http://evil.example")
        .body(full("off"))
        .expect("request");
    assert_eq!(send(cross_site).await.status, 403);
    // A second `Origin` is checked too, and a cross-site fetch that names no origin is
    // refused.
    let two_origins = http::Request::post(levee.admin_url("/modules/ranking"))
        .header("origin", format!("http://{}", levee.admin))
        .header("origin", "http://evil.example")
        .body(full("off"))
        .expect("request");
    assert_eq!(send(two_origins).await.status, 403);
    let no_origin = http::Request::post(levee.admin_url("/modules/ranking"))
        .header("sec-fetch-site", "cross-site")
        .body(full("off"))
        .expect("request");
    let refused = send(no_origin).await;
    assert_eq!(
        (refused.status, refused.header("x-content-type-options")),
        (403, Some("nosniff"))
    );
    assert_eq!(
        get(&levee.url("/ranking")).await.status,
        200,
        "nothing changed"
    );
    // The dashboard's own page posts with its own origin.
    let same_site = http::Request::post(levee.admin_url("/modules/ranking"))
        .header("origin", format!("http://{}", levee.admin))
        .body(full("off"))
        .expect("request");
    assert_eq!(send(same_site).await.status, 200);
    // Behind a proxy the dashboard's origin is the proxy's: refused unless let in.
    let proxied = || {
        http::Request::post(levee.admin_url("/modules/ranking"))
            .header("origin", "https://ops.example")
            .body(full("on"))
            .expect("request")
    };
    assert_eq!(send(proxied()).await.status, 403);
    let let_in = Levee::start(&policy.replacen(
        "[admin]\n",
        "[admin]\norigins = [\"HTTPS://Ops.Example/\"]\n",
        1,
    ))
    .await;
    let proxied = http::Request::post(let_in.admin_url("/modules/ranking"))
        .header("origin", "https://ops.example")
        .body(full("off"))
        .expect("request");
    assert_eq!(send(proxied).await.status, 200);
    let other = http::Request::post(let_in.admin_url("/modules/ranking"))
        .header("origin", "http://ops.example")
        .body(full("on"))
        .expect("request");
    assert_eq!(
        send(other).await.status,
        403,
        "another scheme is another origin"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_beyond_ascii_are_switched_through_encoded_admin_paths() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(
        backend.addr,
        "",
        "[[route]]\nname = \"bell\"\nmatch = { path_prefix = \"/bell\" }\ntier = 3\nmodule = \"通知\"\n",
    ))
    .await;
    let segment = levee::admin::client::path_segment("通知");
    assert_eq!(segment, "%E9%80%9A%E7%9F%A5");
    let answer = post(&levee.admin_url(&format!("/modules/{segment}")), "off").await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(status["degrade"]["modules"]["通知"]["off"], true);
    assert_ne!(get(&levee.url("/bell")).await.status, 200);
}

/// Beyond loopback, reading needs a token as changing state does: `/status` maps the site's
/// dependencies and dead letters show clients' addresses. The dashboard page holds no data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_listener_beyond_loopback_answers_reads_only_with_a_token() {
    let backend = echo_backend().await;
    let policy = policy_for(backend.addr, "", "").replace(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        &format!("[admin]\nlisten = \"0.0.0.0:0\"\ntokens = {{ ops = \"{TOKEN}\" }}"),
    );
    let levee = Levee::start(&policy).await;
    let url = |path: &str| format!("http://127.0.0.1:{}{path}", levee.admin.port());
    let bearer = format!("Bearer {TOKEN}");
    for path in ["/status", "/metrics", "/queues"] {
        let refused = get(&url(path)).await;
        assert_eq!(
            (refused.status, refused.header("www-authenticate")),
            (401, Some("Bearer")),
            "{path}"
        );
        let wrong = get_with(
            &url(path),
            &[("authorization", "Bearer not-the-token-at-all")],
        )
        .await;
        assert_eq!(wrong.status, 401, "{path}");
        let read = get_with(&url(path), &[("authorization", &bearer)]).await;
        assert_eq!(read.status, 200, "{path}");
    }
    assert_eq!(get(&url("/dashboard")).await.status, 200);

    // The CLI sends its token on reads too.
    let admin: std::net::SocketAddr = ([127, 0, 0, 1], levee.admin.port()).into();
    let (ok, out, err) =
        tokio::task::spawn_blocking(move || levee_cli(&["status"], admin, Some(TOKEN)))
            .await
            .expect("cli");
    assert!(ok && out.contains("policy   generation 1"), "{out}{err}");
    let (ok, _, err) = tokio::task::spawn_blocking(move || levee_cli(&["status"], admin, None))
        .await
        .expect("cli");
    assert!(!ok && err.contains("401"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reload_prints_its_errors_as_check_does() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    std::fs::write(
        levee.policy_file(),
        policy_for(backend.addr, "", "").replace("[upstream.app]", "[upstream.app]\nretries = 3"),
    )
    .expect("write");
    let admin = levee.admin;
    let (ok, _, err) = tokio::task::spawn_blocking(move || levee_cli(&["reload"], admin, None))
        .await
        .expect("cli");
    assert!(!ok);
    assert!(
        err.starts_with("levee: 422: the policy was refused; generation 1 keeps running\n"),
        "{err}"
    );
    assert!(
        err.contains("levee.toml:8:1: error: unknown field `retries`"),
        "{err}"
    );
    assert!(err.contains("\n  hint: "), "{err}");

    // `levee status` shows the refusal as `levee check` prints it: hints, and a file not read
    // as the warning it is.
    let dir = levee.policy_file().parent().expect("dir").to_path_buf();
    std::fs::write(dir.join("limits.TOML"), "").expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_levee"))
        .arg("check")
        .arg(&dir)
        .output()
        .expect("run levee check");
    let checked = String::from_utf8_lossy(&output.stderr).into_owned();
    let (ok, _, err) = tokio::task::spawn_blocking(move || levee_cli(&["reload"], admin, None))
        .await
        .expect("cli");
    assert!(!ok);
    assert!(
        err.contains(": warning: `limits.TOML` is not read"),
        "{err}"
    );
    let (ok, out, err) = tokio::task::spawn_blocking(move || levee_cli(&["status"], admin, None))
        .await
        .expect("cli");
    assert!(ok, "{err}");
    let as_checked: String = checked
        .lines()
        .filter(|line| !line.starts_with("levee: policy in"))
        .map(|line| format!("           {line}\n"))
        .collect();
    assert!(
        out.contains(&format!("LAST RELOAD REFUSED (1 error(s)):\n{as_checked}")),
        "{out}\nnot as check prints:\n{checked}"
    );
    assert!(out.contains("\n             hint: "), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_policy_defines_and_nothing_uses_is_a_warning_in_check_reload_and_status() {
    let backend = echo_backend().await;
    let levee = Levee::start(&policy_for(backend.addr, "", "")).await;
    let unused = format!(
        "{}[limit.login]\nkey = [\"ip\"]\nrate = \"10/min\"\n",
        policy_for(backend.addr, "", "")
    );
    std::fs::write(levee.policy_file(), &unused).expect("write");
    let warning = "levee.toml:";
    let expected = "warning: limit `login` is used by no route: it limits nothing";

    // check: valid (exit 0), the warning with its place and hint.
    let dir = levee.policy_file().parent().expect("dir").to_path_buf();
    let output = Command::new(env!("CARGO_BIN_EXE_levee"))
        .args(["check", "--policies"])
        .arg(&dir)
        .output()
        .expect("run levee check");
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{err}");
    assert!(out.contains("is valid with 1 warning(s)"), "{out}");
    assert!(err.contains(warning) && err.contains(expected), "{err}");
    assert!(
        err.contains("hint: list it in a route's limits = [\"login\"]"),
        "{err}"
    );
    // The directory may also be given as it is, `nginx -t`'s habit.
    let output = Command::new(env!("CARGO_BIN_EXE_levee"))
        .arg("check")
        .arg(&dir)
        .output()
        .expect("run levee check DIR");
    assert!(
        output.status.success()
            && String::from_utf8_lossy(&output.stdout).contains("is valid with 1 warning(s)"),
        "{output:?}"
    );

    // reload: loaded (by the file watcher already, or by this), and the warning printed.
    let admin = levee.admin;
    let (ok, out, err) = tokio::task::spawn_blocking(move || levee_cli(&["reload"], admin, None))
        .await
        .expect("cli");
    assert!(ok, "{err}");
    assert!(
        out.starts_with("levee: policy reloaded: generation 2")
            || out.starts_with("levee: policy unchanged: the files are those of generation 2"),
        "{out}"
    );
    assert!(out.contains(expected), "{out}");

    // status: listed with the running policy.
    let status = get(&levee.admin_url("/status")).await.json();
    let listed = status["policy"]["warnings"][0]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(listed.contains(expected), "{status}");
}

#[test]
fn a_listen_address_levee_cannot_take_is_named_with_its_file_and_line() {
    // Held by another process (here the test): levee says where the address is written and
    // what to look at, then exits 1.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("levee.toml"),
        format!("[upstream.app]\nurl = \"http://127.0.0.1:9\"\n[server]\nlisten = \"127.0.0.1:{port}\"\n[admin]\nlisten = \"127.0.0.1:0\"\n"),
    )
    .expect("write policy");
    let output = Command::new(env!("CARGO_BIN_EXE_levee"))
        .args(["run", "--no-watch", "--policies"])
        .arg(dir.path())
        .output()
        .expect("run levee");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot listen on 127.0.0.1:{port} ({}: [server] listen): ",
            dir.path().join("levee.toml:4:10").display()
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("port {port} is in use")),
        "{stderr}"
    );
}

/// `levee --version` names the commit built, so an operator upgrading a fleet tells an old
/// binary from a new one (both said "0.1.0").
#[test]
fn the_version_names_the_commit_built() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_levee"))
        .arg("--version")
        .output()
        .expect("run levee --version");
    let said = String::from_utf8_lossy(&output.stdout).trim().to_string();
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=9", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown commit".into());
    assert_eq!(
        said,
        format!("levee {} ({commit})", env!("CARGO_PKG_VERSION"))
    );
}
