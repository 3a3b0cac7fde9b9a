//! levee in front of a real PHP site: nginx vhost + php-fpm 8.2, as in production.

mod common;

use std::time::Duration;

use common::*;
use http::Request;

const ECHO_PHP: &str = r#"<?php
header('Content-Type: application/json');
echo json_encode([
    'remote_addr' => $_SERVER['REMOTE_ADDR'],
    'x_real_ip' => $_SERVER['HTTP_X_REAL_IP'] ?? null,
    'x_forwarded_for' => $_SERVER['HTTP_X_FORWARDED_FOR'] ?? null,
    'x_forwarded_proto' => $_SERVER['HTTP_X_FORWARDED_PROTO'] ?? null,
    'host' => $_SERVER['HTTP_HOST'] ?? null,
    'method' => $_SERVER['REQUEST_METHOD'],
    'uri' => $_SERVER['REQUEST_URI'],
    'user_agent' => $_SERVER['HTTP_USER_AGENT'] ?? null,
    'accept_language' => $_SERVER['HTTP_ACCEPT_LANGUAGE'] ?? null,
    'cookies' => $_COOKIE,
    'get' => $_GET,
    'post' => $_POST,
    'body' => file_get_contents('php://input'),
]);
"#;

/// A legacy login: the redirect is built from Host, the cookie is Secure only behind https.
const LOGIN_PHP: &str = r#"<?php
$secure = ($_SERVER['HTTP_X_FORWARDED_PROTO'] ?? 'http') === 'https';
setcookie('PHPSESSID', 'sess-' . md5($_SERVER['REMOTE_ADDR']), ['path' => '/', 'secure' => $secure, 'httponly' => true]);
setcookie('seen', '1');
header('Location: http://' . $_SERVER['HTTP_HOST'] . '/home.php');
http_response_code(302);
"#;

/// A `header()` with a control byte in its value (PHP refuses only CR, LF and NUL), and the
/// visitor's own field read back.
const CONTROL_PHP: &str = r#"<?php
header("Content-Disposition: attachment; filename=\"report\x01.csv\"");
echo json_encode(['user_agent' => $_SERVER['HTTP_USER_AGENT'] ?? null]);
"#;

async fn php_site() -> PhpSite {
    PhpSite::start(&[("echo.php", ECHO_PHP), ("login.php", LOGIN_PHP)]).await
}

fn site_addr(site: &PhpSite) -> std::net::SocketAddr {
    site.addr()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_sees_the_real_client_ip_from_a_trusted_front_only() {
    let site = php_site().await;

    // Loopback (the front nginx) is trusted by default.
    let levee = Levee::start(&policy_for(site_addr(&site), "", "")).await;
    let request = Request::get(levee.url("/echo.php?a=1&b=%E4%B8%AD"))
        .header("host", "forum.example.com")
        .header("x-forwarded-for", "203.0.113.7")
        .header("x-forwarded-proto", "https")
        .header("user-agent", "LegacyBrowser/1.0")
        .header("accept-language", "zh-CN")
        .header("cookie", "PHPSESSID=abc; lang=zh")
        .body(full(""))
        .expect("request");
    let answer = send(request).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let php = answer.json();
    assert_eq!(php["remote_addr"], "203.0.113.7");
    assert_eq!(php["x_real_ip"], "203.0.113.7");
    // The front's chain as it came: an app that takes its last entry sees the client.
    assert_eq!(php["x_forwarded_for"], "203.0.113.7");
    assert_eq!(php["x_forwarded_proto"], "https");
    assert_eq!(php["host"], "forum.example.com");
    assert_eq!(php["uri"], "/echo.php?a=1&b=%E4%B8%AD");
    assert_eq!(php["get"]["b"], "中");
    assert_eq!(php["user_agent"], "LegacyBrowser/1.0");
    assert_eq!(php["accept_language"], "zh-CN");
    assert_eq!(php["cookies"]["PHPSESSID"], "abc");

    // The same headers from a peer that is not trusted are not believed.
    let untrusted = Levee::start(&policy_for(
        site_addr(&site),
        "trusted_proxies = [\"10.0.0.0/8\"]",
        "",
    ))
    .await;
    let request = Request::get(untrusted.url("/echo.php"))
        .header("x-forwarded-for", "203.0.113.7")
        .header("x-real-ip", "203.0.113.7")
        .header("x-forwarded-proto", "https")
        .body(full(""))
        .expect("request");
    let php = send(request).await.json();
    assert_eq!(php["remote_addr"], "127.0.0.1");
    assert_eq!(php["x_real_ip"], "127.0.0.1");
    assert_eq!(php["x_forwarded_for"], "127.0.0.1");
    assert_eq!(php["x_forwarded_proto"], "http");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_forms_logins_and_redirects_work_through_levee() {
    let site = php_site().await;
    let levee = Levee::start(&policy_for(site_addr(&site), "", "")).await;

    let form = Request::post(levee.url("/echo.php"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(full("title=hello&text=%E4%BD%A0%E5%A5%BD"))
        .expect("request");
    let php = send(form).await.json();
    assert_eq!(php["method"], "POST");
    assert_eq!(php["post"]["title"], "hello");
    assert_eq!(php["post"]["text"], "你好");

    // The app must answer exactly as it would without levee: same redirect, same cookies.
    let login = |base: String| {
        Request::post(format!("{base}/login.php"))
            .header("host", "forum.example.com:8443")
            .header("x-forwarded-proto", "https")
            .header("x-real-ip", "203.0.113.7")
            .body(full("user=a&pass=b"))
            .expect("request")
    };
    let direct = send(login(format!("http://{}", site_addr(&site)))).await;
    let through = send(login(levee.url(""))).await;
    assert_eq!(through.status, 302);
    assert_eq!(through.status, direct.status);
    assert_eq!(through.header("location"), direct.header("location"));
    assert!(through
        .header("location")
        .is_some_and(|l| l.starts_with("http://forum.example.com")));
    let cookies = |answer: &Answer| -> Vec<String> {
        answer
            .headers
            .get_all("set-cookie")
            .iter()
            .map(|v| v.to_str().expect("ascii").to_string())
            .collect()
    };
    assert_eq!(cookies(&through), cookies(&direct));
    assert_eq!(cookies(&through).len(), 2);
    let session = &cookies(&through)[0];
    assert!(
        session.starts_with("PHPSESSID=sess-")
            && session.contains("secure")
            && session.contains("HttpOnly"),
        "{session}"
    );

    // With the backend gone, the client gets a clear 502 instead of hanging.
    drop(site);
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        get(&levee.url("/echo.php")).await
    })
    .await
    .expect("answered in time");
    assert_eq!(answer.status, 502, "{}", answer.text());
}

/// nginx passes control bytes in field values both ways, so a page whose header carries one
/// worked before levee: it must after, with a space in the byte's place (the parsers of both
/// sides refuse the byte itself). Was a 502 for the page and a 400 for the visitor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_bytes_nginx_passes_in_field_values_break_no_page() {
    let site = PhpSite::start(&[("control.php", CONTROL_PHP)]).await;
    let levee = Levee::start(&policy_for(site_addr(&site), "", "")).await;
    let request = b"GET /control.php HTTP/1.1\r\nHost: a\r\nUser-Agent: bot\x01/1\r\nConnection: close\r\n\r\n";
    let direct = raw_exchange(site_addr(&site), request, Duration::from_secs(5)).await;
    assert!(direct.starts_with("HTTP/1.1 200"), "{direct}");
    assert!(direct.contains("filename=\"report\x01.csv\""), "{direct}");
    assert!(direct.contains(r#""bot\u0001\/1""#), "{direct}");
    let through = raw_exchange(levee.public, request, Duration::from_secs(5)).await;
    assert!(through.starts_with("HTTP/1.1 200"), "{through}");
    assert!(through.contains("filename=\"report .csv\""), "{through}");
    assert!(through.contains(r#""bot \/1""#), "{through}");
}
