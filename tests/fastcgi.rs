//! levee speaking FastCGI to a real php-fpm 8.2, with no nginx in between: PHP must see the
//! request as it would behind nginx's `fastcgi_params`, and answer as it would through it.

mod common;

use std::fmt::Write as _;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use sha2::{Digest, Sha256};

/// Every script that echoes starts with `$which = '…';`, so a test knows which one ran.
const ECHO_BODY: &str = r#"
header('Content-Type: application/json');
$input = file_get_contents('php://input');
$server = fn (string $name) => $_SERVER[$name] ?? null;
echo json_encode([
    'which' => $which,
    'remote_addr' => $server('REMOTE_ADDR'),
    'x_real_ip' => $server('HTTP_X_REAL_IP'),
    'x_forwarded_for' => $server('HTTP_X_FORWARDED_FOR'),
    'x_forwarded_proto' => $server('HTTP_X_FORWARDED_PROTO'),
    'http_proxy' => $server('HTTP_PROXY'),
    'host' => $server('HTTP_HOST'),
    'user_agent' => $server('HTTP_USER_AGENT'),
    'method' => $server('REQUEST_METHOD'),
    'uri' => $server('REQUEST_URI'),
    'query_string' => $server('QUERY_STRING'),
    'script_name' => $server('SCRIPT_NAME'),
    'script_filename' => $server('SCRIPT_FILENAME'),
    'document_root' => $server('DOCUMENT_ROOT'),
    'document_uri' => $server('DOCUMENT_URI'),
    'path_info' => $server('PATH_INFO'),
    'https' => $server('HTTPS'),
    'request_scheme' => $server('REQUEST_SCHEME'),
    'server_name' => $server('SERVER_NAME'),
    'server_software' => $server('SERVER_SOFTWARE'),
    'server_protocol' => $server('SERVER_PROTOCOL'),
    'gateway_interface' => $server('GATEWAY_INTERFACE'),
    'content_type' => $server('CONTENT_TYPE'),
    'content_length' => $server('CONTENT_LENGTH'),
    'app_env' => $server('APP_ENV'),
    'cookies' => $_COOKIE,
    'get' => $_GET,
    'post' => $_POST,
    'body' => $input,
]);
"#;

const STATUS_PHP: &str = r#"<?php
http_response_code(404);
header('X-Thing: a');
setcookie('a', '1');
setcookie('b', '2');
echo 'gone';
"#;

const REDIRECT_PHP: &str = r#"<?php
header('Location: /elsewhere');
"#;

const BIG_PHP: &str = r#"<?php
echo str_repeat('x', 2 * 1024 * 1024);
"#;

/// Writes `?early=` bytes of its answer before it reads its input (as an error page or a
/// report that logs its upload may), then says how much input it got; with `&read=no` it
/// never reads it. `&stderr=N` first logs N lines of 1,000 bytes to FastCGI's stderr;
/// `&status=N` answers with that status, and then notes the input's length in applied.log
/// (a 204 or 304 has no body to say it in).
const EARLY_PHP: &str = r#"<?php
for ($line = 0; $line < (int) ($_GET['stderr'] ?? 0); $line++) {
    error_log(str_repeat('w', 1000));
}
if (isset($_GET['status'])) {
    http_response_code((int) $_GET['status']);
}
echo str_repeat('e', (int) $_GET['early']);
if (($_GET['read'] ?? 'yes') === 'no') {
    exit;
}
$input = file_get_contents('php://input');
echo "\n", strlen($input);
if (isset($_GET['status'])) {
    file_put_contents(__DIR__ . '/../applied.log', strlen($input) . "\n", FILE_APPEND | LOCK_EX);
}
"#;

/// A protected download handed to the web server in front, which levee is not.
const ACCEL_PHP: &str = r#"<?php
header('X-Accel-Redirect: /protected/report.pdf');
header('X-Sendfile: /srv/private/report.pdf');
echo 'see the file';
"#;

/// Hints to the vhost's nginx, which levee is not either.
const HINTED_PHP: &str = r#"<?php
header('X-Accel-Buffering: no');
header('X-Accel-Limit-Rate: 1024');
echo 'streamed';
"#;

/// An interim status, which a CGI answer cannot be.
const INTERIM_PHP: &str = r#"<?php
header('Status: 101 Switching Protocols');
echo 'switched?';
"#;

/// A download that says its length, as `readfile()` scripts do.
const DOWNLOAD_PHP: &str = r#"<?php
header('Content-Type: application/octet-stream');
header('Content-Length: 300000');
echo str_repeat('d', 300000);
"#;

/// A length set, then one byte more: the newline after a closing `?>` in a legacy script.
const OVERRUN_PHP: &str = r#"<?php
$size = (int)($_GET['size'] ?? 10);
header('Content-Type: text/csv');
header('Content-Length: ' . $size);
echo str_repeat('c', $size);
?>

"#;

/// A `header()` with a control byte in its value (PHP refuses only CR, LF and NUL).
const CONTROL_PHP: &str = r#"<?php
header("Content-Disposition: attachment; filename=\"report\x01.csv\"");
echo 'csv';
"#;

/// A DELETE (or anything else) answered with a bare 204.
const NO_CONTENT_PHP: &str = r#"<?php
http_response_code(204);
"#;

/// A page the client's cached copy still matches: a 304 to its `If-None-Match`.
const ETAG_PHP: &str = r#"<?php
header('ETag: "v1"');
if (($_SERVER['HTTP_IF_NONE_MATCH'] ?? '') === '"v1"') {
    http_response_code(304);
    exit;
}
echo 'page';
"#;

const SLOW_PHP: &str = r#"<?php
sleep(3);
echo 'late';
"#;

/// A digest rather than the body itself: a megabyte echoed back would say less on failure.
const UPLOAD_PHP: &str = r#"<?php
header('Content-Type: application/json');
$input = file_get_contents('php://input');
echo json_encode([
    'length' => strlen($input),
    'sha256' => hash('sha256', $input),
    'content_length' => $_SERVER['CONTENT_LENGTH'] ?? null,
]);
"#;

/// Applies a queued write: one line per job, with the key and the client PHP was told of.
const NOTIFY_PHP: &str = r#"<?php
$line = ($_SERVER['HTTP_IDEMPOTENCY_KEY'] ?? '-') . ' ' . $_SERVER['REMOTE_ADDR'] . ' ' . file_get_contents('php://input') . "\n";
file_put_contents(__DIR__ . '/../applied.log', $line, FILE_APPEND | LOCK_EX);
echo "ok";
"#;

/// An event stream for twenty seconds, a line every 200 ms; says in applied.log at which line
/// it ended (PHP stops it at a write once its client has gone, `ignore_user_abort` being off,
/// PHP's default).
const EVENTS_PHP: &str = r#"<?php
ignore_user_abort(false);
$i = 0;
register_shutdown_function(function () use (&$i) {
    file_put_contents(__DIR__ . '/../applied.log', "events ended at $i\n", FILE_APPEND | LOCK_EX);
});
header('Content-Type: text/event-stream');
for (; $i < 100; $i++) {
    // (A comment line of 8 KiB with each event: PHP-FPM writes its buffer out, and so finds
    // a closed connection, when it fills; a small flush may not.)
    echo ': ' . str_repeat('x', 8192) . "\ndata: $i\n\n";
    flush();
    usleep(200000);
}
"#;

fn echo_script(which: &str) -> String {
    ["<?php\n$which = '", which, "';\n", ECHO_BODY].concat()
}

/// php-fpm alone serving a temp docroot; levee is the only thing in front of it.
struct Site {
    _dir: tempfile::TempDir,
    /// The docroot as levee is told it (resolved, so it is also the path PHP opens).
    docroot: String,
    php: Option<PhpFpm>,
}

impl Site {
    async fn start() -> Site {
        let dir = tempfile::tempdir().expect("temp dir");
        let www = dir.path().join("www");
        std::fs::create_dir_all(www.join("sub")).expect("docroot");
        let scripts = [
            ("echo.php", echo_script("echo")),
            ("index.php", echo_script("index")),
            ("sub/index.php", echo_script("sub")),
            ("status.php", STATUS_PHP.to_string()),
            ("redirect.php", REDIRECT_PHP.to_string()),
            ("big.php", BIG_PHP.to_string()),
            ("download.php", DOWNLOAD_PHP.to_string()),
            ("overrun.php", OVERRUN_PHP.to_string()),
            ("early.php", EARLY_PHP.to_string()),
            ("interim.php", INTERIM_PHP.to_string()),
            ("accel.php", ACCEL_PHP.to_string()),
            ("hinted.php", HINTED_PHP.to_string()),
            ("slow.php", SLOW_PHP.to_string()),
            ("control.php", CONTROL_PHP.to_string()),
            ("upload.php", UPLOAD_PHP.to_string()),
            ("notify.php", NOTIFY_PHP.to_string()),
            ("no-content.php", NO_CONTENT_PHP.to_string()),
            ("etag.php", ETAG_PHP.to_string()),
            ("events.php", EVENTS_PHP.to_string()),
            ("robots.txt", "User-agent: *\n".to_string()),
        ];
        for (name, code) in scripts {
            std::fs::write(www.join(name), code).expect("script");
        }
        // php-fpm's www-data workers (when the tests run as root) must reach every script.
        open_up(&www.join("sub"));
        let _ = Command::new("chmod")
            .arg("-R")
            .arg("a+r")
            .arg(&www)
            .status();
        let php = PhpFpm::start(dir.path()).await;
        let docroot = std::fs::canonicalize(&www)
            .expect("docroot path")
            .display()
            .to_string();
        let log = dir.path().join("applied.log");
        std::fs::write(&log, "").expect("log");
        let _ = Command::new("chmod").arg("a+rw").arg(&log).status();
        Site {
            _dir: dir,
            docroot,
            php: Some(php),
        }
    }

    /// A policy whose `app` upstream is this php-fpm; `fastcgi` goes inside the
    /// `fastcgi = { root = … }` table (starting with a comma), `upstream` under the table.
    fn policy(&self, fastcgi: &str, upstream: &str) -> String {
        let port = self.php.as_ref().expect("php-fpm running").port;
        let root = &self.docroot;
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[upstream.app]\nurl = \"fastcgi://127.0.0.1:{port}\"\nfastcgi = {{ root = \"{root}\"{fastcgi} }}\n{upstream}\n"
        )
    }

    async fn levee(&self, fastcgi: &str, upstream: &str) -> Levee {
        Levee::start(&self.policy(fastcgi, upstream)).await
    }

    /// Where a script at `path` (from the docroot, starting with `/`) is on disk.
    fn file(&self, path: &str) -> String {
        format!("{}{path}", self.docroot)
    }
}

fn empty() -> TestBody {
    full(Bytes::new())
}

/// Sends `request` and returns the JSON the script printed, after checking it was a 200.
async fn php_json(request: Request<TestBody>) -> serde_json::Value {
    let answer = send(request).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    answer.json()
}

async fn get_json(levee: &Levee, path: &str) -> serde_json::Value {
    php_json(
        Request::get(levee.url(path))
            .body(empty())
            .expect("request"),
    )
    .await
}

fn sha256_hex(data: &[u8]) -> String {
    let mut hex = String::with_capacity(64);
    for byte in Sha256::digest(data).iter() {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_sees_the_request_as_it_would_behind_nginx() {
    let site = Site::start().await;
    let levee = site
        .levee(", params = { APP_ENV = \"production\" }", "")
        .await;

    // From loopback, a trusted front by default: its forwarding fields are believed.
    let request = Request::get(levee.url("/echo.php?a=1&b=%E4%B8%AD"))
        .header("host", "forum.example.com")
        // The front appended the visitor to what the visitor wrote itself.
        .header("x-forwarded-for", "6.6.6.6, 203.0.113.7")
        .header("x-forwarded-proto", "https")
        .header("user-agent", "LegacyBrowser/1.0")
        .header("cookie", "PHPSESSID=abc; lang=zh")
        .body(empty())
        .expect("request");
    let php = php_json(request).await;
    assert_eq!(php["which"], "echo");
    assert_eq!(php["remote_addr"], "203.0.113.7", "{php}");
    assert_eq!(php["x_real_ip"], "203.0.113.7", "{php}");
    // The visitor alone: with the chain, an app trusting whoever REMOTE_ADDR is as its proxy
    // (Laravel's and Symfony's `'*'`) dropped the visitor and took `6.6.6.6`.
    assert_eq!(php["x_forwarded_for"], "203.0.113.7", "{php}");
    assert_eq!(php["x_forwarded_proto"], "https");
    assert_eq!(php["host"], "forum.example.com");
    assert_eq!(php["user_agent"], "LegacyBrowser/1.0");
    assert_eq!(php["method"], "GET");
    assert_eq!(php["uri"], "/echo.php?a=1&b=%E4%B8%AD");
    assert_eq!(php["query_string"], "a=1&b=%E4%B8%AD");
    assert_eq!(php["get"]["a"], "1");
    assert_eq!(php["get"]["b"], "中");
    assert_eq!(php["cookies"]["PHPSESSID"], "abc");
    assert_eq!(php["cookies"]["lang"], "zh");
    assert_eq!(php["script_name"], "/echo.php");
    assert_eq!(php["script_filename"], site.file("/echo.php"));
    assert_eq!(php["document_root"], site.docroot.as_str());
    assert_eq!(php["document_uri"], "/echo.php");
    assert_eq!(php["https"], "on");
    assert_eq!(php["request_scheme"], "https");
    assert_eq!(php["server_name"], "forum.example.com");
    assert_eq!(php["server_protocol"], "HTTP/1.1");
    assert!(
        php["gateway_interface"]
            .as_str()
            .is_some_and(|gateway| gateway.starts_with("CGI/1.")),
        "{php}"
    );
    assert!(
        php["server_software"]
            .as_str()
            // WordPress reads "nginx" in it as a server that rewrites URLs.
            .is_some_and(|software| software.starts_with("levee/") && software.contains("nginx")),
        "{php}"
    );
    assert_eq!(php["app_env"], "production");
    // An HTTP/1.0 client's version reaches PHP, as nginx passes it: a script that answers
    // `$_SERVER['SERVER_PROTOCOL'] . ' 404 Not Found'` answers in the client's version.
    let old_client = php_json(
        Request::get(levee.url("/echo.php"))
            .version(http::Version::HTTP_10)
            .body(empty())
            .expect("request"),
    )
    .await;
    assert_eq!(old_client["server_protocol"], "HTTP/1.0", "{old_client}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_reach_php_whole_with_a_content_length() {
    let site = Site::start().await;
    let levee = site.levee("", "").await;

    let form_body = "title=hello&text=%E4%BD%A0%E5%A5%BD";
    let form = Request::post(levee.url("/echo.php"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(full(form_body))
        .expect("request");
    let php = php_json(form).await;
    assert_eq!(php["method"], "POST");
    assert_eq!(php["content_type"], "application/x-www-form-urlencoded");
    assert_eq!(php["content_length"], form_body.len().to_string());
    assert_eq!(php["post"]["title"], "hello");
    assert_eq!(php["post"]["text"], "你好");
    assert_eq!(php["body"], form_body);

    // PHP reads exactly CONTENT_LENGTH bytes, so a body of unknown length must get one.
    let pieces = ["first=1&", "second=two&", "third=", "drei"];
    let whole = pieces.concat();
    let request = Request::post(levee.url("/echo.php"))
        .header("content-type", "text/plain")
        .body(chunked(pieces.into_iter().map(Bytes::from).collect()))
        .expect("request");
    let php = php_json(request).await;
    assert_eq!(php["body"], whole.as_str());
    assert_eq!(php["content_length"], whole.len().to_string());
    // So must one levee keeps to send again (a PUT, a DELETE: idempotent): it reached PHP
    // with CONTENT_LENGTH empty, and the script read no body.
    for method in ["PUT", "DELETE", "PATCH"] {
        let request = Request::builder()
            .method(method)
            .uri(levee.url("/echo.php"))
            .header("content-type", "text/plain")
            .body(chunked(pieces.into_iter().map(Bytes::from).collect()))
            .expect("request");
        let php = php_json(request).await;
        assert_eq!(php["method"], method);
        assert_eq!(php["body"], whole.as_str(), "{method}");
        assert_eq!(php["content_length"], whole.len().to_string(), "{method}");
    }

    let megabyte: Vec<u8> = b"abcdefghijklmnopqrstuvwxyz"
        .iter()
        .copied()
        .cycle()
        .take(1024 * 1024)
        .collect();
    let digest = sha256_hex(&megabyte);
    let request = Request::post(levee.url("/upload.php"))
        .header("content-type", "application/octet-stream")
        .body(full(megabyte.clone()))
        .expect("request");
    let php = php_json(request).await;
    assert_eq!(php["length"], megabyte.len());
    assert_eq!(php["sha256"], digest.as_str());
    assert_eq!(php["content_length"], megabyte.len().to_string());

    // The same megabyte with no length, in pieces bigger than one FastCGI record.
    let pieces: Vec<Bytes> = megabyte
        .chunks(100_000)
        .map(Bytes::copy_from_slice)
        .collect();
    let request = Request::post(levee.url("/upload.php"))
        .header("content-type", "application/octet-stream")
        .body(chunked(pieces))
        .expect("request");
    let php = php_json(request).await;
    assert_eq!(php["length"], megabyte.len());
    assert_eq!(php["sha256"], digest.as_str());
    assert_eq!(php["content_length"], megabyte.len().to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_info_directory_indexes_and_traversal_stay_under_the_root() {
    let site = Site::start().await;
    let levee = site.levee("", "").await;

    let php = get_json(&levee, "/echo.php/extra/path").await;
    assert_eq!(php["which"], "echo");
    assert_eq!(php["script_name"], "/echo.php");
    assert_eq!(php["script_filename"], site.file("/echo.php"));
    assert_eq!(php["path_info"], "/extra/path");
    // The script, as Debian's fastcgi-php.conf (`try_files $fastcgi_script_name`) leaves it.
    assert_eq!(php["document_uri"], "/echo.php");
    assert_eq!(php["uri"], "/echo.php/extra/path");

    let php = get_json(&levee, "/sub/").await;
    assert_eq!(php["which"], "sub");
    assert_eq!(php["script_name"], "/sub/index.php");
    assert_eq!(php["script_filename"], site.file("/sub/index.php"));
    // Named without its slash, the directory moves to the path with it (as nginx answers),
    // query and all: its page's relative links resolve, and its routes hold.
    let moved = get(&levee.url("/sub?page=2")).await;
    assert_eq!(moved.status, 301, "{}", moved.text());
    assert_eq!(moved.header("location"), Some("/sub/?page=2"));
    // To the path as resolved: sent back as written, `//evil.example/../sub/` is a Location a
    // browser reads as another site.
    let moved = raw_exchange(
        levee.public,
        b"GET //evil.example/../sub HTTP/1.1\r\nHost: forum.example\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(moved.starts_with("HTTP/1.1 301"), "{moved}");
    assert!(moved.contains("\r\nLocation: /sub/\r\n"), "{moved}");

    // http::Uri keeps dot segments as written, so the second target goes out raw.
    for target in ["/sub/..%2F..%2F..%2Fecho.php", "/../../echo.php"] {
        let php = get_json(&levee, target).await;
        assert_eq!(php["which"], "echo", "{target}: {php}");
        assert_eq!(php["script_name"], "/echo.php", "{target}");
        let filename = php["script_filename"].as_str().unwrap_or_default();
        assert!(
            filename.starts_with(&format!("{}/", site.docroot)),
            "{target} ran {filename}, outside the root"
        );
        assert_eq!(filename, site.file("/echo.php"), "{target}");
    }

    // No script named and no front controller: nginx's `location ~ \.php$` would not have
    // passed it to php-fpm, and levee does not either.
    let log = levee_log();
    for path in ["/about", "/uploads/avatar.jpg"] {
        let answer = get(&levee.url(path)).await;
        assert_eq!(answer.status, 404, "{}", answer.text());
        assert_eq!(
            answer.text(),
            visitor_page("Not found", "There is no page at this address.")
        );
        assert!(
            !log.lines_with(&format!("`{path}` names no PHP script"))
                .is_empty(),
            "the log says why {path} is not found"
        );
    }

    // A decoded line break is not said back to the client, and said escaped in the log,
    // where it would forge a line.
    let answer =
        get(&levee.url("/x%0A2026-12-06T09:00:00.000000Z%20%20INFO%20levee::access:%20forged"))
            .await;
    assert_eq!(answer.status, 404, "{}", answer.text());
    assert!(!answer.text().contains("forged"), "{}", answer.text());
    assert_eq!(answer.header("x-content-type-options"), Some("nosniff"));
    let forged = log.lines_with("forged");
    assert!(
        !forged.is_empty()
            && forged.iter().all(|line| {
                !line.starts_with("2026-12-06T09:00:00")
                    && (line.contains("names no PHP script")
                        || line.contains("levee::access: client="))
            }),
        "a line was forged in the log: {forged:?}"
    );

    // A NUL would cut SCRIPT_FILENAME short (`echo.php%00.txt` running echo.php): refused.
    let answer = get(&levee.url("/echo.php%00.txt")).await;
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert!(answer.text().contains("NUL"), "{}", answer.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_controller_runs_every_path_that_names_no_script() {
    let site = Site::start().await;
    let levee = site.levee(", front_controller = \"/index.php\"", "").await;

    let php = get_json(&levee, "/pretty/url?x=1").await;
    assert_eq!(php["which"], "index");
    assert_eq!(php["uri"], "/pretty/url?x=1");
    assert_eq!(php["script_name"], "/index.php");
    assert_eq!(php["script_filename"], site.file("/index.php"));
    assert_eq!(php["get"]["x"], "1");

    // A directory whose index exists runs it (WordPress's /wp-admin/); one that does not
    // exists only in the app's routes (a permalink), and runs the front controller.
    let php = get_json(&levee, "/sub/").await;
    assert_eq!(php["which"], "sub");
    assert_eq!(get(&levee.url("/sub")).await.status, 301);
    let php = get_json(&levee, "/2026/12/hello/").await;
    assert_eq!(php["which"], "index");
    assert_eq!(php["uri"], "/2026/12/hello/");

    let php = get_json(&levee, "/echo.php").await;
    assert_eq!(php["which"], "echo");
    assert_eq!(php["script_name"], "/echo.php");

    // A file that is there is no page of the app's: nginx served it from disk, and levee,
    // which serves no files, says so (the front controller answered its own page in its place).
    let log = levee_log();
    let file = get(&levee.url("/robots.txt")).await;
    assert_eq!(file.status, 404);
    assert!(
        !log.lines_with(
            "`/robots.txt` is a file, which levee does not serve; the front nginx serves"
        )
        .is_empty(),
        "said at warn, for the operator"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_status_headers_and_body_come_back_as_the_script_wrote_them() {
    let log = levee_log();
    let site = Site::start().await;
    // Connections kept, so that the checks below also show them still good after each answer.
    let levee = site.levee("", "pool_max_idle = 4").await;

    let answer = get(&levee.url("/status.php")).await;
    assert_eq!(answer.status, 404, "{}", answer.text());
    assert_eq!(answer.header("x-thing"), Some("a"));
    let cookies: Vec<&str> = answer
        .headers
        .get_all("set-cookie")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .collect();
    assert_eq!(cookies.len(), 2, "{cookies:?}");
    assert!(cookies[0].starts_with("a=1"), "{cookies:?}");
    assert!(cookies[1].starts_with("b=2"), "{cookies:?}");
    assert_eq!(answer.text(), "gone");

    // No Status line from PHP, only a Location: CGI makes that a 302.
    let answer = get(&levee.url("/redirect.php")).await;
    assert_eq!(answer.status, 302, "{}", answer.text());
    assert_eq!(answer.header("location"), Some("/elsewhere"));

    let answer = get(&levee.url("/big.php")).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body.len(), 2 * 1024 * 1024);
    assert!(answer.body.iter().all(|byte| *byte == b'x'));

    // A file handed to the web server in front: levee serves none, and a front nginx must
    // not act on the field in its own locations. A 502, not the placeholder body as a 200
    // (a download saved empty, with no error anywhere); the page's doing, not php-fpm's.
    let answer = get(&levee.url("/accel.php")).await;
    assert_eq!(answer.status, 502, "{}", answer.text());
    assert_eq!(answer.header("x-accel-redirect"), None);
    assert_eq!(answer.header("x-sendfile"), None);
    assert!(!answer.text().contains("see the file"), "{}", answer.text());
    // The vhost's hints are its own: dropped, and the answer passes.
    let answer = get(&levee.url("/hinted.php")).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.header("x-accel-buffering"), None);
    assert_eq!(answer.text(), "streamed");

    // The length the script gave reaches the client (a download's progress bar).
    let answer = get(&levee.url("/download.php")).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-length"), Some("300000"));
    assert_eq!(answer.body.len(), 300_000);
    // One byte past the length (the newline after `?>`): the length is sent whole, the rest
    // dropped, as nginx does; a small file had come back empty, a larger one cut short.
    for size in [10, 5000, 8191, 65535, 100_000] {
        let answer = get(&levee.url(&format!("/overrun.php?size={size}"))).await;
        assert_eq!(answer.status, 200, "size {size}");
        assert_eq!(answer.body.len(), size, "size {size}");
        assert!(answer.body.iter().all(|byte| *byte == b'c'), "size {size}");
    }

    // A control byte in a field's value passes as a space, as under nginx (as itself there):
    // it was a 502 for the whole page.
    let answer = get(&levee.url("/control.php")).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        answer.header("content-disposition"),
        Some("attachment; filename=\"report .csv\"")
    );
    assert_eq!(answer.text(), "csv");

    let head = send(
        Request::head(levee.url("/echo.php"))
            .body(empty())
            .expect("request"),
    )
    .await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty(), "{}", head.text());

    let missing = get(&levee.url("/nope.php")).await;
    assert_eq!(missing.status, 404, "{}", missing.text());
    // php-fpm's "Primary script unknown" for it is no warning (scanners ask for such paths
    // all day, and the line a second left for PHP's own warnings went to them).
    let warned = log.lines_with("Primary script unknown");
    assert!(warned.is_empty(), "{warned:?}");

    // The connection a HEAD or a 404 used is still good for a full answer.
    assert_eq!(get_json(&levee, "/echo.php").await["which"], "echo");
}

/// An answer without a body (a DELETE's 204, a 304 to `If-None-Match`) goes out whole, and
/// its access log line says `complete=true`, as over HTTP: `complete=false` is the alarm
/// for an answer cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodiless_answers_are_logged_complete() {
    let log = levee_log();
    let site = Site::start().await;
    let policy = site
        .policy("", "pool_max_idle = 4")
        .replace("[server]\n", "[server]\naccess_log = true\n");
    let levee = Levee::start(&policy).await;

    let deleted = send(
        Request::delete(levee.url("/no-content.php"))
            .body(empty())
            .expect("request"),
    )
    .await;
    assert_eq!(deleted.status, 204, "{}", deleted.text());
    assert!(deleted.body.is_empty());
    let cached = send(
        Request::get(levee.url("/etag.php"))
            .header("if-none-match", "\"v1\"")
            .body(empty())
            .expect("request"),
    )
    .await;
    assert_eq!(cached.status, 304, "{}", cached.text());
    assert_eq!(cached.header("etag"), Some("\"v1\""));
    assert!(cached.body.is_empty());

    let host = format!("host={} ", levee.public);
    let logged = |path: &str, status: u16| {
        log.lines_with(&host)
            .into_iter()
            .filter(|line| {
                line.contains(&format!(" path={path} "))
                    && line.contains(&format!(" status={status} "))
            })
            .collect::<Vec<_>>()
    };
    eventually(Duration::from_secs(5), "both access log lines", || async {
        !logged("/no-content.php", 204).is_empty() && !logged("/etag.php", 304).is_empty()
    })
    .await;
    for (path, status) in [("/no-content.php", 204), ("/etag.php", 304)] {
        let lines = logged(path, status);
        assert!(
            lines.iter().all(|line| line.contains(" complete=true")),
            "{lines:?}"
        );
    }

    // Whether or not the connection was kept, the next answer is whole and its own.
    assert_eq!(get_json(&levee, "/echo.php").await["which"], "echo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_names_php_could_mistake_for_levee_s_own_are_dropped() {
    let site = Site::start().await;
    let levee = site.levee("", "").await;

    let request = Request::get(levee.url("/echo.php"))
        .header("x_real_ip", "6.6.6.6")
        .header("x.forwarded.proto", "https")
        .header("x-forwarded.for", "6.6.6.6")
        .header("proxy", "http://evil.example")
        .body(empty())
        .expect("request");
    let php = php_json(request).await;
    assert_ne!(php["x_real_ip"], "6.6.6.6", "{php}");
    assert_eq!(php["x_real_ip"], "127.0.0.1", "{php}");
    assert_eq!(php["x_real_ip"], php["remote_addr"], "{php}");
    // PHP reads `.` as `_` too: dotted names would pass for levee's own fields.
    assert_eq!(php["x_forwarded_proto"], "http", "{php}");
    assert_eq!(php["x_forwarded_for"], "127.0.0.1", "{php}");
    assert_ne!(php["https"], "on", "{php}");
    assert_ne!(php["http_proxy"], "http://evil.example", "{php}");
    // php-fpm (clear_env = no) passes its own environment into $_SERVER, and it inherits
    // ours: only without an HTTP_PROXY here must PHP have none at all.
    if std::env::var_os("HTTP_PROXY").is_none() {
        assert!(php["http_proxy"].is_null(), "{php}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_fpm_down_is_a_502_not_a_hang() {
    let mut site = Site::start().await;
    // Short enough that a hang shows as a 504 before the test's own limit.
    let levee = site.levee("", "response_timeout = \"5s\"").await;
    assert_eq!(get_json(&levee, "/echo.php").await["which"], "echo");

    // Its guard stops the master, which takes its workers (and their sockets) down.
    drop(site.php.take());
    let answer = tokio::time::timeout(Duration::from_secs(15), get(&levee.url("/echo.php")))
        .await
        .expect("answered in time");
    assert_eq!(answer.status, 502, "{}", answer.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_slower_than_the_response_timeout_is_a_504() {
    let site = Site::start().await;
    let levee = site
        .levee("", "response_timeout = \"500ms\"\npool_max_idle = 4")
        .await;

    let answer = tokio::time::timeout(Duration::from_secs(10), get(&levee.url("/slow.php")))
        .await
        .expect("answered in time");
    assert_eq!(answer.status, 504, "{}", answer.text());

    // The connection given up on is not handed to the next request.
    assert_eq!(get_json(&levee, "/echo.php").await["which"], "echo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_a_row_reuse_php_fpm_connections() {
    let site = Site::start().await;
    let port = site.php.as_ref().expect("php-fpm").port;

    // By default none is kept: an idle one would hold a php-fpm child from everyone else.
    let levee = site.levee("", "").await;
    requests_in_a_row(&levee).await;
    eventually(
        Duration::from_secs(5),
        "no connection left open",
        || async { connections_to(port) == 0 },
    )
    .await;
    drop(levee);

    // With room in the pool, one connection carries them all.
    let levee = site.levee("", "pool_max_idle = 4").await;
    requests_in_a_row(&levee).await;
    assert_eq!(connections_to(port), 1);
}

/// Established TCP connections to `port` on loopback, counted at the connecting end.
fn connections_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let columns: Vec<&str> = line.split_whitespace().collect();
            columns.get(2) == Some(&remote.as_str()) && columns.get(3) == Some(&"01")
        })
        .count()
}

/// 50 GETs with a POST after every tenth, each answered by the right script.
async fn requests_in_a_row(levee: &Levee) {
    for i in 0..50 {
        let php = get_json(levee, &format!("/echo.php?i={i}")).await;
        assert_eq!(php["get"]["i"], i.to_string(), "request {i}: {php}");
        if i % 10 == 5 {
            let answer = post(&levee.url("/echo.php"), &format!("n={i}")).await;
            assert_eq!(answer.status, 200, "post {i}: {}", answer.text());
            let php = answer.json();
            assert_eq!(php["method"], "POST");
            assert_eq!(php["body"], format!("n={i}"), "post {i}");
        }
    }
}

/// `stderr` has a `levee.toml:LINE:COL: error:` line, and `word` (lower case) in what the
/// errors say.
fn refused_at_a_line(stderr: &str, word: &str) {
    let positioned = stderr.lines().any(|line| {
        line.split_once("levee.toml:").is_some_and(|(_, position)| {
            position.starts_with(|c: char| c.is_ascii_digit()) && position.contains(": error: ")
        })
    });
    assert!(positioned, "no levee.toml:LINE:COL position in:\n{stderr}");
    let said = stderr
        .split_once("error:")
        .is_some_and(|(_, message)| message.to_ascii_lowercase().contains(word));
    assert!(said, "`{word}` not in:\n{stderr}");
}

#[test]
fn check_refuses_a_fastcgi_upstream_without_an_absolute_root() {
    let stderr = check_fails("[upstream.app]\nurl = \"fastcgi://127.0.0.1:9000\"\n");
    refused_at_a_line(&stderr, "root");

    let stderr = check_fails(
        "[upstream.app]\nurl = \"fastcgi://127.0.0.1:9000\"\nfastcgi = { root = \"srv/public\" }\n",
    );
    refused_at_a_line(&stderr, "absolute");

    let stderr =
        check_fails("[upstream.app]\nurl = \"http://127.0.0.1:9\"\nfastcgi = { root = \"/x\" }\n");
    refused_at_a_line(&stderr, "fastcgi");
}

/// Writes queued while the route was switched off are replayed over FastCGI later: each
/// applied once, with its idempotency key and the client's address PHP would have seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_writes_are_applied_through_php_fpm_with_the_client_they_came_from() {
    let site = Site::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let rest = format!(
        "[redis]\nurl = \"{redis}\"\n[degrade]\nsync_interval = \"100ms\"\n[queue]\npoll_interval = \"50ms\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\ntier = 2\nmodule = \"notifications\"\ndegrade = {{ action = \"queue\" }}\n",
        redis = redis.url()
    );
    let levee = site.levee("", &rest).await;
    let switch = |state: &'static str| {
        let url = levee.admin_url("/modules/notifications");
        async move { assert_eq!(post(&url, state).await.status, 200) }
    };
    switch("off").await;
    let mut keys = Vec::new();
    for i in 0..5 {
        let request = Request::post(levee.url("/notify.php"))
            .header("x-forwarded-for", "198.51.100.7")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(full(format!("n={i}")))
            .expect("request");
        let answer = send(request).await;
        assert_eq!(answer.status, 202, "{}", answer.text());
        keys.push(answer.header("x-levee-job").expect("job").to_string());
    }
    let log = std::path::Path::new(&site.docroot).join("../applied.log");
    assert_eq!(std::fs::read_to_string(&log).expect("log"), "");
    switch("on").await;
    each_job_applied_once(&log, &keys).await;
}

/// php-fpm's usual Debian setup: a unix socket, not a TCP port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_fpm_on_a_unix_socket_is_reached_through_it() {
    let site = Site::start().await;
    let dir = tempfile::tempdir().expect("dir");
    open_up(dir.path());
    let socket = dir.path().join("php-fpm.sock");
    let php = PhpFpm::start_on_socket(dir.path(), &socket).await;
    let policy = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[upstream.app]\nurl = \"fastcgi://localhost\"\nsocket = \"{socket}\"\nfastcgi = {{ root = \"{root}\" }}\n",
        socket = socket.display(),
        root = site.docroot,
    );
    let levee = Levee::start(&policy).await;
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["upstreams"][0]["socket"],
        socket.display().to_string(),
        "{status}"
    );
    for _ in 0..3 {
        let php = get_json(&levee, "/echo.php?via=socket").await;
        assert_eq!(php["which"], "echo", "{php}");
        assert_eq!(php["query_string"], "via=socket", "{php}");
    }

    // The socket gone: a 502 whose log line names it.
    drop(php);
    let log = levee_log();
    let answer = get(&levee.url("/echo.php")).await;
    assert_eq!(answer.status, 502, "{}", answer.text());
    assert!(
        !answer.text().contains(&socket.display().to_string()),
        "{}",
        answer.text()
    );
    assert!(
        !log.lines_with(&format!("unix:{}", socket.display()))
            .is_empty(),
        "the log names the socket"
    );
}

#[test]
fn check_refuses_a_relative_socket() {
    let printed = check_fails(
        "[server]\ndefault_upstream = \"app\"\n[upstream.app]\nurl = \"fastcgi://localhost\"\nsocket = \"php.sock\"\nfastcgi = { root = \"/srv/www\" }\n",
    );
    assert!(
        printed.contains("levee.toml:5:10: error: socket `php.sock` is not an absolute path"),
        "{printed}"
    );
}

/// Parameters over one record's 64 KiB are split between whole pairs (php-fpm drops the
/// connection on a pair cut in two, which any visitor could have used to open the breaker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_parameters_fill_several_records_is_answered() {
    let site = Site::start().await;
    let levee = site.levee("", "").await;
    let query = format!("q={}", "a".repeat(30_000));
    for _ in 0..6 {
        let request = Request::get(levee.url(&format!("/echo.php?{query}")))
            .header("x-padding", "p".repeat(20_000))
            .body(empty())
            .expect("request");
        let php = php_json(request).await;
        assert_eq!(php["query_string"], query.as_str());
    }
}

/// A script that writes before it reads its input gets its input, however large and however
/// much it writes first: levee reads php-fpm's output while the body is still going out, and
/// past 1 MiB of it streams the answer to the client and sends the rest of the body as
/// php-fpm reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_that_answers_before_reading_a_large_body_gets_it_all() {
    let site = Site::start().await;
    let levee = with_large_bodies(&site, "response_timeout = \"5s\"\npool_max_idle = 4").await;
    // More than php-fpm's output, levee's 1 MiB and the loopback's socket buffers hold.
    let body = vec![b'b'; 32 * 1024 * 1024];
    for early in [700_000, 16 * 1024 * 1024] {
        let answer = put_early(&levee, &format!("early={early}"), body.clone()).await;
        assert_eq!(answer.status, 200, "{early}: {}", answer.text());
        assert_eq!(answer.body.len(), early + 1 + "33554432".len(), "{early}");
        assert!(answer.text().ends_with("\n33554432"), "{early}");
    }
    // A script that answers at length and never reads its input: the answer is whole, the
    // rest of the body is not sent, and the connection is not kept for the next request.
    let early = 16 * 1024 * 1024;
    let answer = put_early(&levee, &format!("early={early}&read=no"), body).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body.len(), early);
    requests_in_a_row(&levee).await;
}

/// levee in front of `site` with these `upstream` settings, and a route for every request
/// with room for the large bodies these tests send.
async fn with_large_bodies(site: &Site, upstream: &str) -> Levee {
    let route = "\n\n[[route]]\nname = \"all\"\nmax_body = \"40MiB\"";
    site.levee("", &[upstream, route].concat()).await
}

/// `body` PUT to `early.php` with `query`.
async fn put_early(levee: &Levee, query: &str, body: Vec<u8>) -> Answer {
    let request = Request::put(levee.url(&format!("/early.php?{query}")))
        .body(full(body))
        .expect("request");
    send(request).await
}

/// The same with a script that logs 3 MB to stderr before any output (the input goes on
/// while levee waits for the CGI head), and with an upload slower than the upstream's
/// `idle_body_timeout` and `response_timeout` in all (php-fpm, busy reading it, says nothing
/// meanwhile, and is not taken for stalled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_gets_its_input_after_much_stderr_and_at_a_slow_pace() {
    let site = Site::start().await;
    let levee = with_large_bodies(
        &site,
        "response_timeout = \"2s\"\nidle_body_timeout = \"1s\"",
    )
    .await;
    let answer = put_early(&levee, "early=10&stderr=3000", vec![b'b'; 8 * 1024 * 1024]).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.text(), format!("{}\n8388608", "e".repeat(10)));

    // A bodiless answer (here a 204) after 2 MiB of output: the script still gets all of its
    // input, before the client is answered.
    let answer = put_early(
        &levee,
        "early=2097152&status=204",
        vec![b'b'; 8 * 1024 * 1024],
    )
    .await;
    assert_eq!(answer.status, 204);
    assert!(answer.body.is_empty());
    let log = std::path::Path::new(&site.docroot).join("../applied.log");
    assert_eq!(std::fs::read_to_string(&log).expect("log"), "8388608\n");

    // Eight pieces of 512 KiB, 400 ms apart: 3 s without a byte from php-fpm.
    let answer = send(slow_upload(&levee, "early=2097152")).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body.len(), 2 * 1024 * 1024 + 1 + "4194304".len());
    assert!(answer.text().ends_with("\n4194304"));
    // The same to a bodiless answer, which levee reads to its end first: longer than
    // `response_timeout` in all, but the upload's time is the client's, not php-fpm's.
    let answer = send(slow_upload(&levee, "early=2097152&status=204")).await;
    assert_eq!(answer.status, 204, "{}", answer.text());
    assert_eq!(
        std::fs::read_to_string(&log).expect("log"),
        "8388608\n4194304\n"
    );
}

/// A PUT of 4 MiB to `early.php` with `query`, in eight pieces 400 ms apart.
fn slow_upload(levee: &Levee, query: &str) -> Request<TestBody> {
    let pieces = futures_util::stream::unfold(0, |sent| async move {
        if sent == 8 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        let piece: Result<Frame<Bytes>, BoxError> =
            Ok(Frame::data(Bytes::from(vec![b's'; 512 * 1024])));
        Some((piece, sent + 1))
    });
    Request::put(levee.url(&format!("/early.php?{query}")))
        .header("content-length", (4 * 1024 * 1024).to_string())
        .body(StreamBody::new(pieces).boxed_unsync())
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interim_cgi_status_is_refused_without_opening_the_breaker() {
    let site = Site::start().await;
    let levee = site
        .levee("", "breaker = { consecutive_failures = 2 }")
        .await;
    let log = levee_log();
    for _ in 0..4 {
        let answer = get(&levee.url("/interim.php")).await;
        assert_eq!(answer.status, 502, "{}", answer.text());
    }
    assert_eq!(
        log.lines_with("not a final HTTP status")
            .iter()
            .filter(|line| line.contains("method=GET path=/interim.php"))
            .count(),
        4,
        "each 502's log line says why"
    );
    // The page's own doing: php-fpm is still served.
    assert_eq!(get_json(&levee, "/echo.php").await["which"], "echo");
}

/// php-fpm not listening: a write to a queue route is stored (202) instead of the 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_queued_while_php_fpm_is_down() {
    let mut site = Site::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let rest = format!(
        "[redis]\nurl = \"{redis}\"\n[[route]]\nname = \"notify\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/notify\" }}\ntier = 2\ndegrade = {{ action = \"queue\" }}\n",
        redis = redis.url()
    );
    let levee = site.levee("", &rest).await;
    site.php = None;
    let answer = post(&levee.url("/notify.php"), "n=1").await;
    assert_eq!(answer.status, 202, "{}", answer.text());
    assert!(answer.header("x-levee-job").is_some());
    // A read has no queue to go to.
    assert_eq!(get(&levee.url("/echo.php")).await.status, 502);
}

#[test]
fn check_refuses_tls_over_a_unix_socket() {
    let printed = check_fails(
        "[server]\ndefault_upstream = \"app\"\n[upstream.app]\nurl = \"https://app.internal\"\nsocket = \"/run/app.sock\"\n",
    );
    assert!(
        printed.contains("levee.toml:5:10: error: levee speaks no TLS over a unix socket"),
        "{printed}"
    );
}

/// Writes whose replay could never run: one naming no script is refused now (404), not
/// accepted for a job bound to fail; one whose answer levee cannot read (the app has run it)
/// goes to the dead letters at once, not retried, and the breaker does not count it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_writes_php_fpm_cannot_take_are_refused_or_dead_lettered() {
    let site = Site::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let redis = RedisServer::start(dir.path()).await;
    let rest = format!(
        "breaker = {{ consecutive_failures = 1 }}\n[redis]\nurl = \"{redis}\"\n[degrade]\nsync_interval = \"100ms\"\n[queue]\npoll_interval = \"50ms\"\n[[route]]\nname = \"writes\"\nmatch = {{ method = [\"POST\"], path_prefix = \"/\" }}\ntier = 2\nmodule = \"writes\"\ndegrade = {{ action = \"queue\" }}\n",
        redis = redis.url()
    );
    let levee = site.levee("", &rest).await;
    let switch = |state: &'static str| {
        let url = levee.admin_url("/modules/writes");
        async move { assert_eq!(post(&url, state).await.status, 200) }
    };
    switch("off").await;
    let log = levee_log();
    let answer = post(&levee.url("/about"), "n=1").await;
    assert_eq!(answer.status, 404, "{}", answer.text());
    assert!(
        log.lines_with("`/about` names no PHP script")
            .iter()
            .any(|line| line.contains("POST")),
        "the log says why"
    );
    let answer = post(&levee.url("/interim.php"), "n=2").await;
    assert_eq!(answer.status, 202, "{}", answer.text());

    switch("on").await;
    eventually(
        Duration::from_secs(10),
        "the job in the dead letters",
        || async { get(&levee.admin_url("/queues")).await.json()["writes"]["dead_letters"] == 1 },
    )
    .await;
    // The letter says the app ran it: a retry would run it twice.
    let dead = get(&levee.admin_url("/queues/writes/dead")).await.json();
    assert!(
        dead[0]["error"]
            .as_str()
            .is_some_and(|error| error.contains("the app ran the job")),
        "{dead}"
    );
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["upstreams"][0]["breaker"]["state"], "closed",
        "{status}"
    );
    assert_eq!(get_json(&levee, "/echo.php").await["which"], "echo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_its_client_leaves_unfinished_never_runs_the_script() {
    // PHP runs the script on whatever input it got: a body streamed to php-fpm and cut off by
    // its client was applied as a short one. Bodies are read whole first, as nginx does.
    let site = Site::start().await;
    let spool = tempfile::tempdir().expect("temp_dir");
    let levee = site
        .levee(&format!(", temp_dir = \"{}\"", spool.path().display()), "")
        .await;
    let log = std::path::Path::new(&site.docroot).join("../applied.log");
    // levee runs in this process: the body's file (without a name) is among its descriptors.
    let spooling = || {
        std::fs::read_dir("/proc/self/fd")
            .map(|fds| {
                fds.filter_map(Result::ok)
                    .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                    .any(|target| target.starts_with(spool.path()))
            })
            .unwrap_or(false)
    };
    let mut stream = tokio::net::TcpStream::connect(levee.public)
        .await
        .expect("connect");
    use tokio::io::AsyncWriteExt;
    stream
        .write_all(b"POST /notify.php HTTP/1.1\r\nHost: forum.example\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 3000000\r\n\r\n")
        .await
        .expect("head");
    // Past the 64 KiB read before the request is let through, and past the 1 MiB kept in
    // memory: the rest of it waits in a file.
    stream
        .write_all(&vec![b'a'; 1_500_000])
        .await
        .expect("part of the body");
    // (Before, php-fpm had the request and the bytes so far by now.)
    eventually(
        Duration::from_secs(10),
        "the body read past 1 MiB",
        || async { spooling() },
    )
    .await;
    drop(stream);
    eventually(Duration::from_secs(10), "the cut body given up", || async {
        !spooling()
    })
    .await;
    let answer = post(&levee.url("/notify.php"), "whole=1").await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let applied = std::fs::read_to_string(&log).expect("log");
    assert_eq!(applied, "- 127.0.0.1 whole=1\n");

    // A body past 1 MiB that comes whole reaches PHP whole.
    let large = vec![b'b'; 3_000_000];
    let answer = send(
        Request::post(levee.url("/upload.php"))
            .body(full(large.clone()))
            .expect("request"),
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.json()["length"], 3_000_000);
    assert_eq!(answer.json()["sha256"], sha256_hex(&large));
}

/// A visitor who leaves an event stream (or an export, a progress page) stops the script at
/// its next write, as behind nginx (`fastcgi_ignore_client_abort off`), and frees its slot:
/// read on, it held a php-fpm worker and a `max_inflight` slot for `response_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_visitor_leaving_a_stream_stops_the_script_as_behind_nginx() {
    let site = Site::start().await;
    let levee = site
        .levee("", "max_inflight = 1\nresponse_timeout = \"60s\"")
        .await;
    let (stream, _) = streamed_until(
        levee.public,
        b"GET /events.php HTTP/1.1\r\nHost: a\r\n\r\n",
        "data: 1\n",
    )
    .await;
    drop(stream);
    let log = std::path::Path::new(&site.docroot).join("../applied.log");
    eventually(Duration::from_secs(10), "the script to stop", || async {
        std::fs::read_to_string(&log).is_ok_and(|text| text.contains("events ended at "))
    })
    .await;
    let ended = std::fs::read_to_string(&log).unwrap_or_default();
    let at: u32 = ended
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|at| at.parse().ok())
        .unwrap_or(100);
    assert!(at < 50, "stopped early, not run to its end: {ended}");
    eventually(Duration::from_secs(10), "the slot freed", || async {
        get(&levee.url("/echo.php")).await.status == 200
    })
    .await;
}
