//! The repository's nginx.conf, run for real (ports and paths substituted): traffic flows
//! through levee, and when levee is down the site still answers through the backup server.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;

const INDEX_PHP: &str = r#"<?php
header('Content-Type: application/json');
echo json_encode([
    'remote_addr' => $_SERVER['REMOTE_ADDR'],
    'x_forwarded_for' => $_SERVER['HTTP_X_FORWARDED_FOR'] ?? null,
    'x_forwarded_host' => $_SERVER['HTTP_X_FORWARDED_HOST'] ?? null,
    'host' => $_SERVER['HTTP_HOST'] ?? null,
    'http_proxy' => $_SERVER['HTTP_PROXY'] ?? null,
    'method' => $_SERVER['REQUEST_METHOD'],
    'body' => file_get_contents('php://input'),
]);
"#;

/// A page of a few KiB that says which `Accept-Encoding` reached PHP.
const PAGE_PHP: &str = r#"<?php
header('Content-Type: text/html; charset=utf-8');
echo '<p>accept-encoding: ' . ($_SERVER['HTTP_ACCEPT_ENCODING'] ?? 'none') . '</p>';
echo str_repeat('<p>The ranking of the week.</p>', 200);
"#;

/// A response head longer than the front's `proxy_buffer_size`, as a page that repeats its
/// input into a header gives.
const LONG_HEAD_PHP: &str = r#"<?php
header('X-Echo: ' . str_repeat('a', (int)($_GET['n'] ?? 40000)));
echo 'long';
"#;

/// PHP (php-fpm) and the shipped nginx.conf (front server + PHP vhost) on free ports; levee is
/// expected on `levee_port`. Returns (temp dir, php-fpm, nginx, front port, vhost port).
async fn front_stack(levee_port: u16) -> (tempfile::TempDir, PhpFpm, ChildGuard, u16, u16) {
    let dir = tempfile::tempdir().expect("dir");
    let docroot = dir.path().join("www");
    std::fs::create_dir_all(&docroot).expect("docroot");
    std::fs::write(docroot.join("index.php"), INDEX_PHP).expect("index.php");
    std::fs::write(docroot.join("page.php"), PAGE_PHP).expect("page.php");
    std::fs::create_dir_all(docroot.join("forum")).expect("a directory");
    std::fs::write(docroot.join("forum/index.php"), INDEX_PHP).expect("forum/index.php");
    std::fs::write(docroot.join("long-head.php"), LONG_HEAD_PHP).expect("long-head.php");
    open_up(dir.path());
    let _ = std::process::Command::new("chmod")
        .arg("-R")
        .arg("a+r")
        .arg(&docroot)
        .status();
    let php = PhpFpm::start(dir.path()).await;
    let (front, backend) = (free_port(), free_port());

    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/nginx.conf"))
        .expect("nginx.conf");
    let d = dir.path().display();
    let config = format!("pid {d}/front.pid;\nerror_log {d}/front-error.log warn;\n")
        + &shipped
            .replace("listen 80;", &format!("listen 127.0.0.1:{front};"))
            // (Loopback IPv4 is what the tests reach; a machine may have no IPv6 at all.)
            .replace("listen [::]:80;", "")
            .replace("127.0.0.1:8080", &format!("127.0.0.1:{levee_port}"))
            .replace("127.0.0.1:8081", &format!("127.0.0.1:{backend}"))
            .replace("127.0.0.1:9000", &format!("127.0.0.1:{}", php.port))
            .replace("/var/www/forum", &docroot.display().to_string())
            .replace(
                "http {\n",
                &format!("http {{\n    access_log {d}/front-access.log;\n    client_body_temp_path {d}/cb;\n    proxy_temp_path {d}/px;\n    fastcgi_temp_path {d}/fc;\n    uwsgi_temp_path {d}/uw;\n    scgi_temp_path {d}/sc;\n"),
            );
    assert!(
        !config.contains(":8080") && !config.contains("listen 80") && !config.contains(":80;"),
        "every port was substituted"
    );
    std::fs::write(dir.path().join("front.conf"), config).expect("write config");
    let nginx = ChildGuard::spawn(
        "nginx",
        std::process::Command::new(find_binary(&["nginx", "/usr/sbin/nginx"]))
            .arg("-c")
            .arg(dir.path().join("front.conf"))
            .arg("-p")
            .arg(dir.path())
            .arg("-e")
            .arg(dir.path().join("front-error.log"))
            .arg("-g")
            .arg("daemon off;"),
    );
    wait_for_port(
        std::net::SocketAddr::from(([127, 0, 0, 1], front)),
        "front nginx",
    )
    .await;

    (dir, php, nginx, front, backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_config_sends_traffic_through_levee_and_fails_open_without_it() {
    let levee_port = free_port();
    let (_dir, _php, nginx, front, backend) = front_stack(levee_port).await;
    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::write(
        policy_dir.path().join("levee.toml"),
        format!("[server]\nlisten = \"127.0.0.1:{levee_port}\"\ndrain = \"0s\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.app]\nurl = \"http://127.0.0.1:{backend}\"\n[[route]]\nname = \"page\"\nmatch = {{ path = \"/page.php\" }}\ndegrade = {{ action = \"stale\" }}\n"),
    )
    .expect("policy");
    let running = levee::start(levee::Options::new(policy_dir.path()))
        .await
        .expect("levee");
    let metrics_url = format!("http://{}/metrics", running.admin_addr);
    let site = format!("http://127.0.0.1:{front}/index.php");

    // Through levee: the PHP app answers, levee counts the request, PHP sees the client.
    let answer = post(&site, "hello=1").await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.json()["method"], "POST");
    assert_eq!(answer.json()["body"], "hello=1");
    assert_eq!(answer.json()["remote_addr"], "127.0.0.1");
    // The request is counted when levee has sent the body's end, which can come just after
    // the client has read it.
    eventually(
        Duration::from_secs(5),
        "the request to be counted by levee",
        || async {
            metric_value(
                &get(&metrics_url).await.text(),
                "levee_requests_total{route=\"default\",status=\"200\"}",
            ) == 1.0
        },
    )
    .await;
    // A visitor's own X-Forwarded-Host never reaches the app: the front sets the real one.
    let claimed = get_with(&site, &[("x-forwarded-host", "evil.example")]).await;
    assert_eq!(
        claimed.json()["x_forwarded_host"],
        "127.0.0.1",
        "{}",
        claimed.text()
    );

    // A `stale` route's page is fetched uncompressed (its copy answers every client): the
    // front compresses it for the clients that ask.
    let page = format!("http://127.0.0.1:{front}/page.php");
    let gzipped = get_with(&page, &[("accept-encoding", "gzip")]).await;
    assert_eq!(gzipped.status, 200);
    assert_eq!(
        gzipped
            .headers
            .get("content-encoding")
            .map(|v| v.as_bytes()),
        Some(&b"gzip"[..]),
        "{:?}",
        gzipped.headers
    );
    assert!(gzipped.body.len() < 1024, "{} bytes", gzipped.body.len());
    let plain = get(&page).await;
    assert!(plain.headers.get("content-encoding").is_none());
    assert!(
        plain.text().starts_with("<p>accept-encoding: none</p>"),
        "{}",
        plain.text()
    );

    // `Proxy` would be CGI's HTTP_PROXY, read as an outgoing proxy ("httpoxy"): the front
    // and levee drop it (PHP 8.2 ignores it too, so this guards the stack as a whole; the
    // unit test in src/proxy/header.rs is levee's own).
    let direct = format!("http://127.0.0.1:{levee_port}/index.php");
    for url in [&site, &direct] {
        let answer = get_with(url, &[("proxy", "http://evil.example:3128")]).await;
        assert_eq!(
            answer.json()["http_proxy"],
            serde_json::Value::Null,
            "{url}: {}",
            answer.text()
        );
    }

    // In an absolute-form request the request line's host wins over the Host field (RFC
    // 9112), in both headers alike: levee routes by Host, an app may read X-Forwarded-Host.
    // (Debian's fastcgi_params give PHP `HTTP_HOST` as the vhost's `$host`: lower case, no
    // port.)
    let front_addr = SocketAddr::from(([127, 0, 0, 1], front));
    for (head, host) in [
        (
            "GET /index.php HTTP/1.1\r\nHost: Shop.Example:8443\r\n",
            "shop.example",
        ),
        (
            "GET /index.php HTTP/1.1\r\nHost: shop.example.\r\n",
            "shop.example",
        ),
        (
            "GET http://admin.example/index.php HTTP/1.1\r\nHost: www.example\r\n",
            "admin.example",
        ),
        (
            "GET http://www.example:8443/index.php HTTP/1.1\r\nHost: WWW.example:8443\r\n",
            "www.example",
        ),
    ] {
        let raw = raw_exchange(
            front_addr,
            format!("{head}Connection: close\r\n\r\n").as_bytes(),
            Duration::from_secs(5),
        )
        .await;
        assert!(raw.starts_with("HTTP/1.1 200"), "{head}: {raw}");
        let json = raw
            .find('{')
            .zip(raw.rfind('}'))
            .and_then(|(start, end)| raw.get(start..=end))
            .unwrap_or_default();
        let app: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
        assert_eq!(app["host"], host, "{head}: {raw}");
        assert_eq!(app["x_forwarded_host"], host, "{head}: {raw}");
    }

    // A client that sends no Host (HTTP/1.0 allows it) still gets the page: nginx gives levee
    // one, which levee needs on the HTTP/1.1 it receives.
    let raw = raw_exchange(
        SocketAddr::from(([127, 0, 0, 1], front)),
        b"GET /index.php HTTP/1.0\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");

    // levee stops: the site keeps answering through the backup server (fail open).
    running.shutdown();
    tokio::time::timeout(Duration::from_secs(10), running.wait())
        .await
        .expect("levee stopped");
    for _ in 0..3 {
        let answer = get(&site).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(answer.json()["method"], "GET");
    }
    drop(nginx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levee_killed_under_load_costs_at_most_the_requests_in_flight() {
    let levee_port = free_port();
    let (_dir, _php, _nginx, front, backend) = front_stack(levee_port).await;
    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::write(
        policy_dir.path().join("levee.toml"),
        format!("[server]\nlisten = \"127.0.0.1:{levee_port}\"\naccess_log = false\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.app]\nurl = \"http://127.0.0.1:{backend}\"\n"),
    )
    .expect("policy");
    let mut levee = ChildGuard::spawn(
        "levee",
        std::process::Command::new(env!("CARGO_BIN_EXE_levee"))
            .args(["run", "--no-watch", "--policies"])
            .arg(policy_dir.path())
            .env("LEVEE_LOG", "warn"),
    );
    wait_for_port(
        std::net::SocketAddr::from(([127, 0, 0, 1], levee_port)),
        "levee",
    )
    .await;

    const CLIENTS: usize = 4;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut loops = Vec::new();
    for _ in 0..CLIENTS {
        let (stop, answered, url) = (
            stop.clone(),
            answered.clone(),
            format!("http://127.0.0.1:{front}/index.php"),
        );
        loops.push(tokio::spawn(async move {
            let mut failed = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let request = http::Request::get(url.as_str())
                    .body(full(""))
                    .expect("request");
                match client().request(request).await {
                    Ok(response) if response.status() == 200 => {
                        answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    _ => failed += 1,
                }
            }
            failed
        }));
    }
    let count = || answered.load(std::sync::atomic::Ordering::Relaxed);
    eventually(Duration::from_secs(10), "load through levee", || async {
        count() >= 50
    })
    .await;
    let _ = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(levee.pid().to_string())
        .status();
    let _ = levee.child.wait();
    let at_kill = count();
    eventually(
        Duration::from_secs(10),
        "load through the backup path",
        || async { count() >= at_kill + 100 },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut failed = 0;
    for task in loops {
        failed += task.await.expect("client");
    }
    assert!(
        failed <= CLIENTS,
        "{failed} failed requests; at most the {CLIENTS} in flight may fail"
    );
    let after = get(&format!("http://127.0.0.1:{front}/index.php")).await;
    assert_eq!(after.status, 200, "the backup path answers with levee gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_too_long_for_the_front_does_not_send_the_site_around_levee() {
    // A page whose head is longer than the front's proxy_buffer_size is that request's 502,
    // and only that request's: nginx counts such an answer as a failure of the server, and
    // with max_fails=1 could mark levee down and send the next requests to the backup, past
    // every limit, for fail_timeout (max_fails=0 now).
    // The front is set up for levee's port before levee binds it: a port another test's
    // connection took meanwhile (free_port gives it back to the system) is tried again with
    // a stack of its own.
    let mut tries = 0;
    let (_dir, _php, _nginx, front, backend, _policy_dir, running) = loop {
        tries += 1;
        let levee_port = free_port();
        let (dir, php, nginx, front, backend) = front_stack(levee_port).await;
        let docroot = std::fs::canonicalize(dir.path().join("www")).expect("docroot");
        let policy_dir = tempfile::tempdir().expect("dir");
        std::fs::write(
            policy_dir.path().join("levee.toml"),
            format!(
                "[server]\nlisten = \"127.0.0.1:{levee_port}\"\ndrain = \"0s\"\naccess_log = false\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream.app]\nurl = \"fastcgi://127.0.0.1:{}\"\nfastcgi = {{ root = \"{}\" }}\n",
                php.port,
                docroot.display()
            ),
        )
        .expect("policy");
        match levee::start(levee::Options::new(policy_dir.path())).await {
            Ok(running) => break (dir, php, nginx, front, backend, policy_dir, running),
            Err(levee::StartError::Listen { .. }) if tries < 3 => continue,
            Err(error) => panic!("levee: {error}"),
        }
    };
    let metrics_url = format!("http://{}/metrics", running.admin_addr);
    let counted = || async {
        metric_value(
            &get(&metrics_url).await.text(),
            "levee_requests_total{route=\"default\",status=\"200\"}",
        )
    };
    let long = format!("http://127.0.0.1:{front}/long-head.php?n=40000");
    assert_eq!(get(&long).await.status, 502);
    let site = format!("http://127.0.0.1:{front}/index.php");
    for _ in 0..3 {
        let answer = get(&site).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
    }
    // (The long page itself may be counted too: levee sent it whole.)
    eventually(
        Duration::from_secs(5),
        "3 requests through levee",
        || async { counted().await >= 3.0 },
    )
    .await;
    // levee's own redirect of a directory to its slash keeps the query: as long as the
    // longest request line the front takes, it fits the front's buffer (with nginx's default
    // of one 4 KiB page, a 6,000-byte query was a 502).
    let answer = get(&format!(
        "http://127.0.0.1:{front}/forum?q={}",
        "a".repeat(7_000)
    ))
    .await;
    assert_eq!(answer.status, 301, "{}", answer.text());
    // The vhost's own redirect of a directory (WordPress's `/wp-admin`) names no port of
    // its own, which visitors of the front cannot reach (`absolute_redirect off`).
    let answer = get(&format!("http://127.0.0.1:{backend}/forum")).await;
    assert_eq!(answer.status, 301, "{}", answer.text());
    assert_eq!(answer.header("location"), Some("/forum/"));
    running.shutdown();
}
