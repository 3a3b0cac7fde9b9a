//! Egress: the PHP app calls an external HTTPS API through levee (real nginx with TLS as the
//! "external" API, a CA made for the test).

mod common;

use common::*;
use http::Request;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_reaches_an_https_api_through_an_egress_route_with_its_own_ca() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = make_certificates(dir.path());
    open_up(dir.path());
    let block = format!(
        "server {{\n listen 127.0.0.1:{{port}} ssl;\n ssl_certificate {d}/server.pem;\n ssl_certificate_key {d}/server.key;\n location / {{ default_type application/json; return 200 '{{\"api\":\"ok\",\"host\":\"$host\",\"http_host\":\"$http_host\",\"uri\":\"$request_uri\"}}'; }}\n}}",
        d = dir.path().display()
    );
    let api = Nginx::start(dir.path(), &block).await;
    let app = echo_backend().await;

    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::copy(&ca, policy_dir.path().join("api-ca.pem")).expect("copy ca");
    let policy = |ca_line: &str| {
        policy_for(
            app.addr,
            "default_upstream = \"app\"",
            &format!(
                "[upstream.ai]\nurl = \"https://localhost:{port}\"\n{ca_line}\nbreaker = {{ consecutive_failures = 3 }}\n[[route]]\nname = \"ai_egress\"\nmatch = {{ host = \"ai.egress\" }}\nupstream = \"ai\"\n",
                port = api.port
            ),
        )
    };
    std::fs::write(
        policy_dir.path().join("levee.toml"),
        policy("ca_files = [\"api-ca.pem\"]"),
    )
    .expect("write");
    let running = levee::start(levee::Options::new(policy_dir.path()))
        .await
        .expect("start");
    let base = format!("http://{}", running.public_addr);

    // What the PHP code does: call levee on loopback, naming the API by its egress host.
    let request = Request::get(format!("{base}/v1/reply?q=hi"))
        .header("host", "ai.egress")
        .body(full(""))
        .expect("request");
    let answer = send(request).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let json = answer.json();
    assert_eq!(json["api"], "ok");
    assert_eq!(
        json["host"], "localhost",
        "the API sees its own name, not the egress alias"
    );
    // With its port, which is not 443 (RFC 9110 7.2): a vhost on that port, or a signature
    // over the Host, knows the name so.
    assert_eq!(json["http_host"], format!("localhost:{}", api.port));
    assert_eq!(json["uri"], "/v1/reply?q=hi");
    // Other hosts still reach the app.
    assert_eq!(
        get(&format!("{base}/index.php")).await.json()["target"],
        "/index.php"
    );

    // Without the CA the certificate is not trusted: a 502 (and the reason in the log), never
    // a silent downgrade.
    let untrusting = Levee::start(&policy("")).await;
    let request = Request::get(untrusting.url("/v1/reply"))
        .header("host", "ai.egress")
        .body(full(""))
        .expect("request");
    let log = levee_log();
    let refused = send(request).await;
    assert_eq!(refused.status, 502, "{}", refused.text());
    assert!(!refused.text().contains("`ai`"), "{}", refused.text());
    // The certificate's refusal is the operator's to read.
    assert!(
        log.lines_with("upstream `ai` failed")
            .iter()
            .chain(&log.lines_with("upstream `ai` could not be reached"))
            .any(|line| line.contains("certificate")),
        "no log line says the certificate was not trusted"
    );
}

#[test]
fn check_reports_a_missing_or_broken_ca_file() {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("bad.pem"), "not a certificate").expect("write");
    std::fs::write(
        dir.path().join("cut.pem"),
        "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("levee.toml"),
        "[upstream.ai]\nurl = \"https://api.example.com\"\nca_files = [\"missing.pem\", \"bad.pem\", \"cut.pem\"]\n",
    )
    .expect("write");
    let (ok, _, stderr) = levee_check(dir.path());
    assert!(!ok);
    // Each error points at its own file's name in the list.
    assert!(
        stderr.contains("levee.toml:3:13: error: cannot read CA file"),
        "{stderr}"
    );
    assert!(
        stderr.contains("levee.toml:3:28: error: CA file")
            && stderr.contains("holds no certificate"),
        "{stderr}"
    );
    // In words, not the marker's bytes.
    assert!(
        stderr.contains("levee.toml:3:39: error: CA file")
            && stderr.contains("has no `-----END CERTIFICATE-----` line"),
        "{stderr}"
    );
}

#[test]
fn a_ca_file_rewritten_in_place_is_a_change_for_reload() {
    let first = tempfile::tempdir().expect("dir");
    let second = tempfile::tempdir().expect("dir");
    let first_ca = make_certificates(first.path());
    let second_ca = make_certificates(second.path());
    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::write(
        policy_dir.path().join("levee.toml"),
        "[upstream.ai]\nurl = \"https://localhost:9\"\nca_files = [\"ca.pem\"]\n",
    )
    .expect("policy");
    std::fs::copy(&first_ca, policy_dir.path().join("ca.pem")).expect("ca");
    let running = levee::config::load_dir(policy_dir.path(), None).expect("compiles");
    // The CA is rotated in place: same path, same policy text.
    std::fs::copy(&second_ca, policy_dir.path().join("ca.pem")).expect("ca");
    let reloaded = levee::config::load_dir(policy_dir.path(), Some(&running)).expect("compiles");
    assert_ne!(
        running.hash, reloaded.hash,
        "the reload is not skipped as unchanged"
    );
    assert!(
        !std::sync::Arc::ptr_eq(&running.upstreams["ai"], &reloaded.upstreams["ai"]),
        "the upstream is rebuilt with the new CA"
    );
}

/// A large upload to an `https://` upstream arrives whole: a TLS session keeps the records of
/// a write the socket had no room for until it is flushed, and the request's last ones must
/// not stay there while levee waits for the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_upload_to_an_https_upstream_arrives_whole() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = make_certificates(dir.path());
    open_up(dir.path());
    let app = echo_backend().await;
    // nginx takes the upload over TLS, to a file, and passes it on to the echoing app.
    let block = format!(
        "server {{\n listen 127.0.0.1:{{port}} ssl;\n ssl_certificate {d}/server.pem;\n ssl_certificate_key {d}/server.key;\n client_max_body_size 64m;\n location / {{ proxy_pass http://{app}; }}\n}}",
        d = dir.path().display(),
        app = app.addr
    );
    let api = Nginx::start(dir.path(), &block).await;
    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::copy(&ca, policy_dir.path().join("api-ca.pem")).expect("copy ca");
    let policy = policy_for(
        app.addr,
        "default_upstream = \"app\"",
        &format!(
            "[upstream.api]\nurl = \"https://localhost:{port}\"\nca_files = [\"api-ca.pem\"]\n[[route]]\nname = \"api_egress\"\nmatch = {{ host = \"api.egress\" }}\nupstream = \"api\"\nmax_body = \"64MiB\"\n",
            port = api.port
        ),
    );
    std::fs::write(policy_dir.path().join("levee.toml"), policy).expect("write");
    let running = levee::start(levee::Options::new(policy_dir.path()))
        .await
        .expect("start");
    let base = format!("http://{}", running.public_addr);
    for size in [3 * 1024 * 1024 + 17, 16 * 1024 * 1024 + 1] {
        let request = Request::post(format!("{base}/upload"))
            .header("host", "api.egress")
            .body(full(vec![b'x'; size]))
            .expect("request");
        let answer = tokio::time::timeout(std::time::Duration::from_secs(60), send(request))
            .await
            .expect("an answer");
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(answer.json()["body_len"], size, "{size} bytes");
    }
}

/// A listener that takes the connection and never speaks TLS: a 504 whose log line says it was
/// the handshake (it said "did not answer", as of a slow page), within `connect_timeout` for
/// the connection and the handshake together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_handshake_that_never_ends_is_a_504_that_says_so() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            kept.push(stream);
        }
    });
    let app = echo_backend().await;
    let levee = Levee::start(&policy_for(
        app.addr,
        "default_upstream = \"app\"",
        &format!(
            "[upstream.api]\nurl = \"https://localhost:{port}\"\nconnect_timeout = \"300ms\"\n[[route]]\nname = \"api\"\nmatch = {{ host = \"api.egress\" }}\nupstream = \"api\"\n"
        ),
    ))
    .await;
    let request = Request::get(levee.url("/v1"))
        .header("host", "api.egress")
        .body(full(""))
        .expect("request");
    let log = levee_log();
    let answer = send(request).await;
    assert_eq!(answer.status, 504, "{}", answer.text());
    assert!(
        !log.lines_with("upstream `api`: no TLS handshake within 300ms")
            .is_empty(),
        "the log says which wait ran out"
    );
    held.abort();
}

/// A server certificate made with `openssl req -x509` is a CA certificate: trusted as a CA in
/// `ca_files`, refused by TLS as the server's own. The log line of the 502 says what to do, not
/// only rustls's "CaUsedAsEndEntity".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_certificate_serving_as_the_server_s_own_is_explained() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = make_certificates(dir.path());
    open_up(dir.path());
    let block = format!(
        "server {{\n listen 127.0.0.1:{{port}} ssl;\n ssl_certificate {d}/ca.pem;\n ssl_certificate_key {d}/ca.key;\n location / {{ return 200 'ok'; }}\n}}",
        d = dir.path().display()
    );
    let api = Nginx::start(dir.path(), &block).await;
    let app = echo_backend().await;
    let policy_dir = tempfile::tempdir().expect("dir");
    std::fs::copy(&ca, policy_dir.path().join("self.pem")).expect("copy ca");
    std::fs::write(
        policy_dir.path().join("levee.toml"),
        policy_for(
            app.addr,
            "default_upstream = \"app\"",
            &format!(
                "[upstream.api]\nurl = \"https://localhost:{}\"\nca_files = [\"self.pem\"]\n[[route]]\nname = \"api\"\nmatch = {{ host = \"api.egress\" }}\nupstream = \"api\"\n",
                api.port
            ),
        ),
    )
    .expect("write");
    let running = levee::start(levee::Options::new(policy_dir.path()))
        .await
        .expect("start");
    let request = Request::get(format!("http://{}/v1", running.public_addr))
        .header("host", "api.egress")
        .body(full(""))
        .expect("request");
    let log = levee_log();
    let answer = send(request).await;
    assert_eq!(answer.status, 502, "{}", answer.text());
    assert!(
        !log.lines_with("basicConstraints=CA:FALSE").is_empty(),
        "the log says what to do about the certificate"
    );
}
