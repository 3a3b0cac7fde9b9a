//! Test harness: levee in-process, counting in-process backends, and real nginx / php-fpm
//! processes on free loopback ports inside a temp dir, stopped by their own pid.
#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type TestBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body sent as `pieces`, with no length: hyper frames it chunked.
pub fn chunked(pieces: Vec<Bytes>) -> TestBody {
    let frames: Vec<Result<hyper::body::Frame<Bytes>, BoxError>> = pieces
        .into_iter()
        .map(|piece| Ok(hyper::body::Frame::data(piece)))
        .collect();
    http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
}

pub fn full(body: impl Into<Bytes>) -> TestBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A port that was free a moment ago (bound then released).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

/// Polls `check` until it is true or `within` has passed.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The page levee answers a browser with when it refuses or fails a request itself (an API
/// client gets `{"error":…}`): `title` as its heading, `words` as its one paragraph.
pub fn visitor_page(title: &str, words: &str) -> String {
    format!("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\n<body><h1>{title}</h1><p>{words}</p></body></html>\n")
}

/// levee's log as an operator reads it: the lines of `levee::proxy` at `info` and above (a
/// failed upstream call's warning, a refused request's reason), the access log of a levee
/// whose policy keeps it on, and any warning. One capture per test binary, shared by its tests, from the first call on: look
/// for what only your test's requests can write (its upstream's address, its path).
pub fn levee_log() -> &'static LogCapture {
    static CAPTURE: std::sync::OnceLock<LogCapture> = std::sync::OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture = LogCapture::default();
        let written = capture.written.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "warn,levee::proxy=info,levee::access=info",
            ))
            .with_ansi(false)
            .with_writer(move || LogWriter(written.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other test of this binary sets a log subscriber");
        capture
    })
}

#[derive(Default)]
pub struct LogCapture {
    written: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl LogCapture {
    /// The lines written so far that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        let written = self.written.lock().expect("log buffer");
        String::from_utf8_lossy(&written)
            .lines()
            .filter(|line| line.contains(needle))
            .map(str::to_string)
            .collect()
    }
}

struct LogWriter(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits until something accepts TCP connections on `addr`.
pub async fn wait_for_port(addr: SocketAddr, what: &str) {
    eventually(Duration::from_secs(10), what, || async move {
        tokio::net::TcpStream::connect(addr).await.is_ok()
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// levee in-process

pub struct Levee {
    pub dir: tempfile::TempDir,
    pub running: Option<levee::Running>,
    pub public: SocketAddr,
    pub admin: SocketAddr,
}

impl Levee {
    /// Starts levee on a policy text; `listen` and admin `listen` should be `127.0.0.1:0`.
    pub async fn start(policy: &str) -> Levee {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("levee.toml"), policy).expect("write policy");
        let running = levee::start(levee::Options::new(dir.path()))
            .await
            .expect("levee starts");
        Levee {
            public: running.public_addr,
            admin: running.admin_addr,
            running: Some(running),
            dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.public, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    pub fn policy_file(&self) -> PathBuf {
        self.dir.path().join("levee.toml")
    }

    pub fn generation(&self) -> u64 {
        self.running
            .as_ref()
            .expect("running")
            .store()
            .load()
            .generation
    }
}

/// Minimal policy: public and admin on free ports, one upstream `app`.
pub fn policy_for(upstream: SocketAddr, extra_server: &str, rest: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n{extra_server}\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[upstream.app]\nurl = \"http://{upstream}\"\n{rest}\n"
    )
}

// ---------------------------------------------------------------------------------------
// HTTP client

pub fn client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("json body ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub async fn send(request: Request<TestBody>) -> Answer {
    let response = client().request(request).await.expect("request sent");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body read").to_bytes();
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

pub async fn get(url: &str) -> Answer {
    send(Request::get(url).body(full(Bytes::new())).expect("request")).await
}

/// `GET url` with these header fields.
pub async fn get_with(url: &str, headers: &[(&str, &str)]) -> Answer {
    let mut request = Request::get(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    send(request.body(full(Bytes::new())).expect("request")).await
}

pub async fn post(url: &str, body: &str) -> Answer {
    send(
        Request::post(url)
            .body(full(body.to_string()))
            .expect("request"),
    )
    .await
}

/// Sends raw bytes and reads until the peer closes or `within` passes.
/// The status code of a raw HTTP/1.1 answer.
pub fn status_of(raw: &str) -> Option<u16> {
    raw.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
}

/// Reads a request head (up to its blank line) off `stream`; `None` if it closes first.
pub async fn read_request_head(stream: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(head)
}

/// A backend that writes raw bytes (what a hyper backend cannot send: odd status lines,
/// fields no library allows): for each request head, `answer(head)`, then it closes the
/// connection.
pub async fn raw_backend(answer: fn(&[u8]) -> Vec<u8>) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Some(head) = read_request_head(&mut stream).await {
                    let _ = stream.write_all(&answer(&head)).await;
                }
            });
        }
    });
    addr
}

/// A policy with Redis at `url` (100 ms timeout) and switches synced every 100 ms, for an
/// app at `backend`.
pub fn switches_on_redis(backend: SocketAddr, url: &str) -> String {
    policy_for(
        backend,
        "",
        &format!(
            "[redis]\nurl = \"{url}\"\ntimeout = \"100ms\"\n[degrade]\nsync_interval = \"100ms\"\n"
        ),
    )
}

pub async fn raw_exchange(addr: SocketAddr, request: &[u8], within: Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(within, stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `request` on a new connection to `addr` and reads until what came holds `until`
/// (a stream's first event, say); the connection stays open for the test to drop.
pub async fn streamed_until(
    addr: SocketAddr,
    request: &[u8],
    until: &str,
) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("write");
    let mut seen = Vec::new();
    let mut buffer = vec![0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(until) {
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer))
            .await
            .expect("read in time")
            .expect("read");
        assert!(
            read > 0,
            "closed before {until:?}: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buffer[..read]);
    }
    (stream, String::from_utf8_lossy(&seen).into_owned())
}

// ---------------------------------------------------------------------------------------
// In-process backends

/// An in-process HTTP/1.1 backend that counts the requests it gets.
pub struct Backend {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Backend {
    pub async fn start<H, F>(handler: H) -> Backend
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<TestBody>> + Send + 'static,
    {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), handler).await
    }

    /// On `addr`: an app that comes up where levee was told it is.
    pub async fn start_on<H, F>(addr: SocketAddr, handler: H) -> Backend
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<TestBody>> + Send + 'static,
    {
        let listener = TcpListener::bind(addr).await.expect("bind backend");
        let addr = listener.local_addr().expect("addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let handler = handler.clone();
                let counter = counter.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        counter.fetch_add(1, Ordering::SeqCst);
                        let response = handler(request);
                        async move { Ok::<_, Infallible>(response.await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Backend { addr, hits, task }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A backend that answers every request with a JSON echo of what it received:
/// method, target, version, headers (in order, repeated ones kept) and the body.
pub async fn echo_backend() -> Backend {
    Backend::start(|request: Request<Incoming>| async move {
        let (parts, body) = request.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let headers: Vec<(String, String)> = parts
            .headers
            .iter()
            .map(|(name, value)| {
                (
                    name.to_string(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect();
        let echo = serde_json::json!({
            "method": parts.method.as_str(),
            "target": parts.uri.to_string(),
            "headers": headers,
            "body": String::from_utf8_lossy(&body),
            "body_len": body.len(),
        });
        Response::builder()
            .header("content-type", "application/json")
            .body(full(echo.to_string()))
            .expect("response")
    })
    .await
}

/// The log PHP's queue test page keeps (a line per applied job: its key, the client address
/// and the body) holds the `i`-th job of `keys` exactly once, from 198.51.100.7 with body
/// `n=i`, when `log` holds `keys.len()` lines.
pub async fn each_job_applied_once(log: &Path, keys: &[String]) {
    eventually(Duration::from_secs(20), "php to apply all jobs", || async {
        std::fs::read_to_string(log).is_ok_and(|text| text.lines().count() >= keys.len())
    })
    .await;
    let applied = std::fs::read_to_string(log).expect("log");
    for (i, key) in keys.iter().enumerate() {
        let line = format!("{key} 198.51.100.7 n={i}");
        assert_eq!(
            applied.lines().filter(|l| *l == line).count(),
            1,
            "{line} in:\n{applied}"
        );
    }
}

/// All values of header `name` in an echo, in order.
pub fn echoed_header(echo: &serde_json::Value, name: &str) -> Vec<String> {
    echo["headers"]
        .as_array()
        .expect("headers")
        .iter()
        .filter(|pair| pair[0].as_str() == Some(name))
        .map(|pair| pair[1].as_str().unwrap_or_default().to_string())
        .collect()
}

// ---------------------------------------------------------------------------------------
// Real processes

/// A child process killed (by its own pid) and reaped when dropped.
pub struct ChildGuard {
    pub child: Child,
    pub name: &'static str,
}

impl ChildGuard {
    pub fn spawn(name: &'static str, command: &mut Command) -> ChildGuard {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e} (is it installed? see .ci/run)"));
        ChildGuard { child, name }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl ChildGuard {
    /// SIGTERM first so nginx and php-fpm masters take their workers down with them
    /// (SIGKILL would orphan the workers), then SIGKILL if it has not exited in 5 s.
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn find_binary(candidates: &[&str]) -> String {
    for candidate in candidates {
        if Path::new(candidate).exists() {
            return (*candidate).to_string();
        }
        if let Ok(output) = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {candidate}"))
            .output()
        {
            let found = String::from_utf8_lossy(&output.stdout).trim().to_string();
            if !found.is_empty() {
                return found;
            }
        }
    }
    panic!("none of {candidates:?} is installed; run .ci/run or install the Debian packages");
}

/// php-fpm (PHP 8.2) serving `docroot`, on a free loopback port.
pub struct PhpFpm {
    pub port: u16,
    pub guard: ChildGuard,
}

impl PhpFpm {
    pub async fn start(dir: &Path) -> PhpFpm {
        let port = free_port();
        let mut php = PhpFpm::spawn(dir, &format!("127.0.0.1:{port}"));
        php.port = port;
        wait_for_port(
            SocketAddr::from(([127, 0, 0, 1], port)),
            "php-fpm to listen",
        )
        .await;
        php
    }

    /// php-fpm listening on the unix socket `socket` (its `port` is 0).
    pub async fn start_on_socket(dir: &Path, socket: &Path) -> PhpFpm {
        let php = PhpFpm::spawn(dir, &format!("{}\nlisten.mode = 0666", socket.display()));
        eventually(Duration::from_secs(10), "php-fpm to listen", || async {
            tokio::net::UnixStream::connect(socket).await.is_ok()
        })
        .await;
        php
    }

    /// Starts php-fpm with `listen = {listen}`, without waiting for it.
    fn spawn(dir: &Path, listen: &str) -> PhpFpm {
        let config = dir.join("php-fpm.conf");
        let is_root = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout.starts_with(b"0"))
            .unwrap_or(false);
        let user = if is_root {
            "user = www-data\ngroup = www-data\n"
        } else {
            ""
        };
        // PHP's temporary files (uploads, large request bodies) in a directory of the test's
        // own that the pool's user can write, whatever the machine's /tmp allows.
        let php_tmp = dir.join("php-tmp");
        std::fs::create_dir_all(&php_tmp).expect("php-tmp");
        let _ = Command::new("chmod").arg("1777").arg(&php_tmp).status();
        std::fs::write(
            &config,
            format!(
                "[global]\npid = {dir}/php-fpm.pid\nerror_log = {dir}/php-fpm.log\ndaemonize = no\n\n[app]\n{user}listen = {listen}\npm = static\npm.max_children = 4\nclear_env = no\ncatch_workers_output = yes\nphp_admin_value[sys_temp_dir] = {tmp}\nphp_admin_value[upload_tmp_dir] = {tmp}\n",
                dir = dir.display(),
                tmp = php_tmp.display()
            ),
        )
        .expect("write php-fpm.conf");
        let binary = find_binary(&["php-fpm8.2", "/usr/sbin/php-fpm8.2", "php-fpm"]);
        let guard = ChildGuard::spawn(
            "php-fpm",
            Command::new(binary).arg("-F").arg("-y").arg(&config),
        );
        PhpFpm { port: 0, guard }
    }
}

/// nginx with `server_block` (which may use `{port}`) inside an http block whose pid, logs
/// and temp paths all live in `dir`.
pub struct Nginx {
    pub port: u16,
    pub guard: ChildGuard,
}

impl Nginx {
    pub async fn start(dir: &Path, server_block: &str) -> Nginx {
        let port = free_port();
        let d = dir.display();
        let user = if Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout.starts_with(b"0"))
            .unwrap_or(false)
        {
            "user www-data;"
        } else {
            ""
        };
        let config = format!(
            "{user}\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log warn;\nevents {{ worker_connections 1024; }}\nhttp {{\n  access_log {d}/nginx-access.log;\n  client_body_temp_path {d}/client_body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  {block}\n}}\n",
            block = server_block.replace("{port}", &port.to_string()),
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, config).expect("write nginx.conf");
        let binary = find_binary(&["nginx", "/usr/sbin/nginx"]);
        let guard = ChildGuard::spawn(
            "nginx",
            Command::new(binary)
                .arg("-c")
                .arg(&path)
                .arg("-p")
                .arg(dir)
                .arg("-e")
                .arg(dir.join("nginx-error.log"))
                .arg("-g")
                .arg("daemon off;"),
        );
        wait_for_port(SocketAddr::from(([127, 0, 0, 1], port)), "nginx to listen").await;
        Nginx { port, guard }
    }
}

/// Makes `dir` and its parents readable by php-fpm's and nginx's unprivileged workers.
pub fn open_up(dir: &Path) {
    let mut current = Some(dir);
    while let Some(path) = current {
        let _ = Command::new("chmod").arg("a+rx").arg(path).status();
        current = path.parent();
        if current == Some(Path::new("/")) {
            break;
        }
    }
}

/// A redis-server of the test's own, on a free port, without persistence.
pub struct RedisServer {
    pub port: u16,
    pub guard: ChildGuard,
    /// `requirepass`, which [`RedisServer::cli`] logs in with.
    pub password: Option<String>,
}

impl RedisServer {
    pub async fn start(dir: &Path) -> RedisServer {
        let port = free_port();
        RedisServer::start_on(dir, port).await
    }

    pub async fn start_on(dir: &Path, port: u16) -> RedisServer {
        RedisServer::spawn(dir, port, &["--appendonly", "no"]).await
    }

    /// Starts redis-server on `port` with its files in `dir`, nothing saved unless `extra`
    /// says so, and waits until it listens.
    async fn spawn(dir: &Path, port: u16, extra: &[&str]) -> RedisServer {
        let binary = find_binary(&["redis-server", "/usr/bin/redis-server"]);
        let guard = ChildGuard::spawn(
            "redis-server",
            Command::new(binary)
                .args([
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    &port.to_string(),
                    "--save",
                    "",
                ])
                .args(extra)
                .arg("--dir")
                .arg(dir)
                .args(["--daemonize", "no"]),
        );
        wait_for_port(
            SocketAddr::from(([127, 0, 0, 1], port)),
            "redis-server to listen",
        )
        .await;
        RedisServer {
            port,
            guard,
            password: None,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A server that speaks TLS only, with the certificates [`make_certificates`] made in
    /// `certs`, and that asks clients for a certificate of that CA (Redis's default).
    pub async fn start_tls(dir: &Path, certs: &Path) -> RedisServer {
        let port = free_port();
        let file = |name: &str| certs.join(name).display().to_string();
        let (cert, key, ca) = (file("server.pem"), file("server.key"), file("ca.pem"));
        RedisServer::spawn(
            dir,
            port,
            &[
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &ca,
                "--appendonly",
                "no",
            ],
        )
        .await
    }

    /// Like [`RedisServer::start_on`], but with an append-only file fsynced on every write
    /// in `dir`, so a SIGKILLed server restarted on the same `dir` comes back with its data.
    pub async fn start_persistent(dir: &Path, port: u16) -> RedisServer {
        RedisServer::spawn(
            dir,
            port,
            &["--appendonly", "yes", "--appendfsync", "always"],
        )
        .await
    }

    /// A server that asks for `password` (`requirepass`), and gives it to its master
    /// (`masterauth`) when it is made a replica.
    pub async fn start_with_password(dir: &Path, password: &str) -> RedisServer {
        let port = free_port();
        let mut server = RedisServer::spawn(
            dir,
            port,
            &[
                "--appendonly",
                "no",
                "--requirepass",
                password,
                "--masterauth",
                password,
            ],
        )
        .await;
        server.password = Some(password.to_string());
        server
    }

    /// Runs one command with redis-cli against this server and returns what it printed.
    pub fn cli(&self, args: &[&str]) -> String {
        match &self.password {
            Some(password) => {
                let mut logged_in = vec!["-a", password, "--no-auth-warning"];
                logged_in.extend_from_slice(args);
                redis_cli(self.port, &logged_in)
            }
            None => redis_cli(self.port, args),
        }
    }

    /// How many times `command` (lower case: `get`, `eval`, `wait`) has run on this server,
    /// from `INFO commandstats`; 0 before its first.
    pub fn calls(&self, command: &str) -> u64 {
        let prefix = format!("cmdstat_{command}:calls=");
        self.cli(&["INFO", "commandstats"])
            .lines()
            .find_map(|line| line.strip_prefix(prefix.as_str()))
            .and_then(|rest| rest.split(',').next())
            .and_then(|calls| calls.parse().ok())
            .unwrap_or(0)
    }

    /// SIGKILLs the server (no chance to save anything) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.guard.child.kill();
        let _ = self.guard.child.wait();
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: connections stay open, answers stop.
    pub fn pause(&self, paused: bool) {
        pause(&self.guard, paused);
    }
}

/// Runs one command with redis-cli against the server on `port`; what it printed.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let binary = find_binary(&["redis-cli", "/usr/bin/redis-cli"]);
    let output = Command::new(binary)
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// SIGSTOP (`paused`) or SIGCONT to a child.
fn pause(child: &ChildGuard, paused: bool) {
    let signal = if paused { "-STOP" } else { "-CONT" };
    let _ = Command::new("kill")
        .arg(signal)
        .arg(child.pid().to_string())
        .status();
}

/// The name the sentinel of [`RedisSentinel`] monitors its master under.
pub const SENTINEL_MASTER: &str = "levee-test";

/// A master, its replica and one sentinel watching them (quorum 1), each with files in a
/// directory of its own.
pub struct RedisSentinel {
    pub master: RedisServer,
    pub replica: RedisServer,
    pub sentinel_port: u16,
    sentinel: ChildGuard,
    sentinel_password: Option<String>,
}

impl RedisSentinel {
    pub async fn start(dir: &Path) -> RedisSentinel {
        RedisSentinel::start_with_passwords(dir, None).await
    }

    /// `passwords`: the servers' `requirepass`, and the sentinel's own.
    pub async fn start_with_passwords(
        dir: &Path,
        passwords: Option<(&str, &str)>,
    ) -> RedisSentinel {
        let own_dir = |name: &str| {
            let path = dir.join(name);
            std::fs::create_dir_all(&path).expect("dir");
            path
        };
        let (master, replica) = match passwords {
            Some((servers, _)) => (
                RedisServer::start_with_password(&own_dir("master"), servers).await,
                RedisServer::start_with_password(&own_dir("replica"), servers).await,
            ),
            None => (
                RedisServer::start(&own_dir("master")).await,
                RedisServer::start(&own_dir("replica")).await,
            ),
        };
        let master_port = master.port.to_string();
        assert_eq!(
            replica
                .cli(&["REPLICAOF", "127.0.0.1", &master_port])
                .trim(),
            "OK"
        );
        eventually(Duration::from_secs(10), "the replica in sync", || async {
            replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        })
        .await;
        // The sentinel rewrites its own file, so it is written where it may.
        let sentinel_dir = own_dir("sentinel");
        let sentinel_port = free_port();
        let conf = sentinel_dir.join("sentinel.conf");
        let mut text = format!(
            "port {sentinel_port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master_port} 1\nsentinel down-after-milliseconds {SENTINEL_MASTER} 1000\nsentinel failover-timeout {SENTINEL_MASTER} 10000\n",
            sentinel_dir.display()
        );
        if let Some((servers, own)) = passwords {
            text.push_str(&format!(
                "sentinel auth-pass {SENTINEL_MASTER} {servers}\nrequirepass {own}\n"
            ));
        }
        let sentinel = spawn_sentinel(&conf, &text, sentinel_port).await;
        let group = RedisSentinel {
            master,
            replica,
            sentinel_port,
            sentinel,
            sentinel_password: passwords.map(|(_, own)| own.to_string()),
        };
        // A failover needs a replica the sentinel knows of (from the master's INFO), is
        // connected to and has heard from itself.
        let replica_port = group.replica.port.to_string();
        eventually(
            Duration::from_secs(15),
            "the sentinel to see the replica",
            || async {
                let replicas = group.sentinel_cli(&["SENTINEL", "REPLICAS", SENTINEL_MASTER]);
                replicas.contains(&replica_port)
                    && !replicas.contains("disconnected")
                    && replicas.contains("master-link-status\nok")
            },
        )
        .await;
        group
    }

    pub fn sentinel_url(&self) -> String {
        match &self.sentinel_password {
            Some(password) => format!("redis://:{password}@127.0.0.1:{}", self.sentinel_port),
            None => format!("redis://127.0.0.1:{}", self.sentinel_port),
        }
    }

    pub fn sentinel_cli(&self, args: &[&str]) -> String {
        match &self.sentinel_password {
            Some(password) => {
                let mut logged_in = vec!["-a", password, "--no-auth-warning"];
                logged_in.extend_from_slice(args);
                redis_cli(self.sentinel_port, &logged_in)
            }
            None => redis_cli(self.sentinel_port, args),
        }
    }

    /// The port of the server the sentinel names master now.
    pub fn named_master_port(&self) -> Option<u16> {
        let named = self.sentinel_cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER]);
        named.lines().nth(1)?.trim().parse().ok()
    }

    /// Has the sentinel promote the replica, and waits until the sentinel names it and it is
    /// a master.
    pub async fn fail_over(&self) {
        let answer = self.sentinel_cli(&["SENTINEL", "FAILOVER", SENTINEL_MASTER]);
        assert_eq!(answer.trim(), "OK", "{answer}");
        eventually(Duration::from_secs(15), "the replica promoted", || async {
            self.named_master_port() == Some(self.replica.port)
                && self.replica.cli(&["ROLE"]).starts_with("master")
        })
        .await;
    }

    /// Stops the sentinel (the servers go on).
    pub fn stop_sentinel(&mut self) {
        self.sentinel.stop();
    }
}

/// Writes `text` to `conf` (a sentinel rewrites its own file, so it must be writable) and
/// starts `redis-server --sentinel` on it; waits until it listens on `port`.
async fn spawn_sentinel(conf: &Path, text: &str, port: u16) -> ChildGuard {
    std::fs::write(conf, text).expect("sentinel.conf");
    let binary = find_binary(&["redis-server", "/usr/bin/redis-server"]);
    let sentinel = ChildGuard::spawn(
        "redis-server (sentinel)",
        Command::new(binary)
            .arg(conf)
            .args(["--sentinel", "--daemonize", "no"]),
    );
    wait_for_port(
        SocketAddr::from(([127, 0, 0, 1], port)),
        "the sentinel to listen",
    )
    .await;
    sentinel
}

/// A sentinel that speaks TLS only, with the certificates [`make_certificates`] made in
/// `certs` (also to the master, `tls-replication`), watching the TLS master on `master_port`
/// as [`SENTINEL_MASTER`]. Its files go in `dir`; returns it and its port.
pub async fn start_tls_sentinel(dir: &Path, certs: &Path, master_port: u16) -> (ChildGuard, u16) {
    std::fs::create_dir_all(dir).expect("sentinel dir");
    let port = free_port();
    let file = |name: &str| certs.join(name).display().to_string();
    let text = format!(
        "port 0\ntls-port {port}\nbind 127.0.0.1\ndir {}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\ntls-replication yes\nsentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master_port} 1\n",
        dir.display(),
        file("server.pem"),
        file("server.key"),
        file("ca.pem")
    );
    let sentinel = spawn_sentinel(&dir.join("sentinel.conf"), &text, port).await;
    (sentinel, port)
}

/// A Redis Cluster of 3 masters (and a replica each, with `start_with_replicas`) on free
/// ports whose bus ports (+10000) are free too.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    nodes: Vec<ChildGuard>,
}

fn port_pair_free(port: u16) -> bool {
    port < 55_000
        && StdListener::bind(("127.0.0.1", port)).is_ok()
        && StdListener::bind(("127.0.0.1", port + 10_000)).is_ok()
}

impl RedisCluster {
    pub async fn start(dir: &Path) -> RedisCluster {
        RedisCluster::start_nodes(dir, 0).await
    }

    /// 3 masters with a replica each.
    pub async fn start_with_replicas(dir: &Path) -> RedisCluster {
        RedisCluster::start_nodes(dir, 1).await
    }

    async fn start_nodes(dir: &Path, replicas: usize) -> RedisCluster {
        let binary = find_binary(&["redis-server", "/usr/bin/redis-server"]);
        let mut ports = Vec::new();
        while ports.len() < 3 * (1 + replicas) {
            let port = free_port();
            if port_pair_free(port) && !ports.contains(&port) {
                ports.push(port);
            }
        }
        let mut nodes = Vec::new();
        for port in &ports {
            let node_dir = dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).expect("node dir");
            nodes.push(ChildGuard::spawn(
                "redis-server (cluster)",
                Command::new(&binary)
                    .args([
                        "--bind",
                        "127.0.0.1",
                        "--port",
                        &port.to_string(),
                        "--cluster-enabled",
                        "yes",
                    ])
                    .arg("--cluster-config-file")
                    .arg(node_dir.join("nodes.conf"))
                    // The nodes left keep serving their slots when one is gone (a test
                    // stops one), however long the test takes to notice.
                    .args([
                        "--cluster-require-full-coverage",
                        "no",
                        "--cluster-node-timeout",
                        "5000",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ])
                    .arg("--dir")
                    .arg(&node_dir),
            ));
        }
        for port in &ports {
            wait_for_port(
                SocketAddr::from(([127, 0, 0, 1], *port)),
                "cluster node to listen",
            )
            .await;
        }
        let cli = find_binary(&["redis-cli", "/usr/bin/redis-cli"]);
        let created = Command::new(cli)
            .args(["--cluster", "create"])
            .args(ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        // What redis-cli said, for a failure that is rare and otherwise unexplained.
        assert!(
            created.status.success(),
            "cluster create failed on {ports:?}: {}{}",
            String::from_utf8_lossy(&created.stdout),
            String::from_utf8_lossy(&created.stderr)
        );
        // The cluster is usable once every node reports cluster_state:ok.
        let cli = find_binary(&["redis-cli", "/usr/bin/redis-cli"]);
        for port in &ports {
            let cli = cli.clone();
            let port = *port;
            eventually(Duration::from_secs(20), "cluster_state:ok", move || {
                let cli = cli.clone();
                async move {
                    Command::new(&cli)
                        .args(["-p", &port.to_string(), "cluster", "info"])
                        .output()
                        .map(|out| {
                            String::from_utf8_lossy(&out.stdout).contains("cluster_state:ok")
                        })
                        .unwrap_or(false)
                }
            })
            .await;
        }
        RedisCluster { ports, nodes }
    }

    /// Waits until replica `node` has its master's data (indices into `ports`).
    pub async fn replica_in_sync(&self, node: usize) {
        eventually(Duration::from_secs(10), "the replica in sync", || async {
            self.cli(node, &["INFO", "replication"])
                .contains("master_link_status:up")
        })
        .await;
    }

    /// Waits until every node but those `gone` serves the cluster (`cluster_state:ok`) and
    /// lists `node` as a master, as after a failover settles (indices into `ports`).
    pub async fn agreed_master(&self, node: usize, gone: &[usize]) {
        let id = self.cli(node, &["CLUSTER", "MYID"]).trim().to_string();
        eventually(
            Duration::from_secs(20),
            "the nodes agree on the new master",
            || async {
                (0..self.ports.len())
                    .filter(|other| !gone.contains(other))
                    .all(|other| {
                        let listed_master = self
                            .cli(other, &["CLUSTER", "NODES"])
                            .lines()
                            .any(|line| line.starts_with(&id) && line.contains("master"));
                        listed_master
                            && self
                                .cli(other, &["CLUSTER", "INFO"])
                                .contains("cluster_state:ok")
                    })
            },
        )
        .await;
    }

    /// The node that replicates `master` (indices into `ports`).
    pub fn replica_of(&self, master: usize) -> Option<usize> {
        let line = format!("master_port:{}", self.ports[master]);
        (0..self.ports.len()).find(|&node| {
            node != master && self.cli(node, &["INFO", "replication"]).contains(&line)
        })
    }

    /// The master that serves `key` (it answers EXISTS; the others redirect with MOVED).
    pub fn owner(&self, key: &str) -> usize {
        (0..self.ports.len())
            .find(|&node| matches!(self.cli(node, &["EXISTS", key]).trim(), "0" | "1"))
            .expect("a node serves every slot")
    }

    /// Runs one command with redis-cli against node `node` (an index into `ports`).
    pub fn cli(&self, node: usize, args: &[&str]) -> String {
        redis_cli(self.ports[node], args)
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) one node.
    pub fn pause(&self, node: usize, paused: bool) {
        pause(&self.nodes[node], paused);
    }

    /// SIGKILLs one node and reaps it.
    pub fn kill(&mut self, node: usize) {
        let _ = self.nodes[node].child.kill();
        let _ = self.nodes[node].child.wait();
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The nodes' URLs as the inside of a TOML list, for `[redis] cluster = [...]`.
    pub fn toml_list(&self) -> String {
        self.urls()
            .iter()
            .map(|url| format!("\"{url}\""))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The value of one exact series (`name` or `name{labels}`) in Prometheus text, 0 if absent.
pub fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            line.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A PHP site as in production: nginx (believing X-Real-IP from loopback, like the backend
/// vhost in nginx.conf) in front of php-fpm, serving `scripts` from a temp docroot.
pub struct PhpSite {
    pub dir: tempfile::TempDir,
    pub php: Option<PhpFpm>,
    pub nginx: Nginx,
}

impl PhpSite {
    pub async fn start(scripts: &[(&str, &str)]) -> PhpSite {
        let dir = tempfile::tempdir().expect("temp dir");
        let docroot = dir.path().join("www");
        std::fs::create_dir_all(&docroot).expect("docroot");
        for (name, code) in scripts {
            std::fs::write(docroot.join(name), code).expect("script");
        }
        open_up(dir.path());
        open_up(&docroot);
        let _ = Command::new("chmod")
            .arg("-R")
            .arg("a+r")
            .arg(&docroot)
            .status();
        let php = PhpFpm::start(dir.path()).await;
        let block = format!(
            "server {{\n listen 127.0.0.1:{{port}};\n root {root};\n set_real_ip_from 127.0.0.1;\n real_ip_header X-Real-IP;\n location ~ \\.php$ {{\n  include /etc/nginx/fastcgi_params;\n  fastcgi_param SCRIPT_FILENAME $document_root$fastcgi_script_name;\n  fastcgi_pass 127.0.0.1:{php};\n }}\n}}",
            root = docroot.display(),
            php = php.port,
        );
        let nginx = Nginx::start(dir.path(), &block).await;
        PhpSite {
            dir,
            php: Some(php),
            nginx,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.nginx.port))
    }

    /// Stops php-fpm (nginx stays and answers 502), as when the PHP pool dies.
    pub fn stop_php(&mut self) {
        self.php = None;
    }
}

/// Runs `levee check --policies DIR`; returns (success, stdout, stderr).
pub fn levee_check(dir: &Path) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_levee"))
        .args(["check", "--policies"])
        .arg(dir)
        .output()
        .expect("run levee check");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Checks a one-file policy (`levee.toml`) that must be refused; returns what was printed.
pub fn check_fails(policy: &str) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("levee.toml"), policy).expect("write policy");
    let (ok, _, stderr) = levee_check(dir.path());
    assert!(!ok, "levee check accepted a broken policy:\n{policy}");
    stderr
}

/// A TCP relay to `target` that, once armed, holds back the answers (target → client bytes)
/// that follow the first client bytes containing a marker, for a while: a server that ran a
/// command in time whose answer is slow to travel back. Everything else passes at once.
pub struct SlowAnswers {
    pub addr: SocketAddr,
    state: Arc<std::sync::Mutex<SlowState>>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct SlowState {
    armed: Option<(Vec<u8>, Duration)>,
    held_until: Option<tokio::time::Instant>,
}

impl SlowAnswers {
    pub async fn start(target: SocketAddr) -> SlowAnswers {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("relay address");
        let state = Arc::new(std::sync::Mutex::new(SlowState::default()));
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let requests = shared.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buffer = vec![0u8; 64 * 1024];
                    while let Ok(read @ 1..) = client_read.read(&mut buffer).await {
                        let chunk = &buffer[..read];
                        {
                            let mut state = requests.lock().expect("relay state");
                            let hit = state.armed.as_ref().is_some_and(|(marker, _)| {
                                chunk.windows(marker.len()).any(|window| window == marker)
                            });
                            if hit {
                                let hold = state.armed.take().map_or(Duration::ZERO, |(_, h)| h);
                                state.held_until = Some(tokio::time::Instant::now() + hold);
                            }
                        }
                        if server_write.write_all(chunk).await.is_err() {
                            break;
                        }
                    }
                });
                let answers = shared.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buffer = vec![0u8; 64 * 1024];
                    while let Ok(read @ 1..) = server_read.read(&mut buffer).await {
                        let until = answers.lock().expect("relay state").held_until;
                        if let Some(until) = until {
                            tokio::time::sleep_until(until).await;
                        }
                        if client_write.write_all(&buffer[..read]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        SlowAnswers {
            addr,
            state,
            accept,
        }
    }

    /// Holds back, for `hold`, the answers that follow the next client bytes containing
    /// `marker` (once).
    pub fn arm(&self, marker: &str, hold: Duration) {
        self.state.lock().expect("relay state").armed = Some((marker.as_bytes().to_vec(), hold));
    }
}

impl Drop for SlowAnswers {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Runs `openssl` with `args` in `dir`, and checks that it succeeded.
pub fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stderr(Stdio::null())
        .status()
        .expect("openssl");
    assert!(status.success(), "openssl {args:?}");
}

/// Signs the request `csr` with the CA that [`make_certificates`] made in `dir`, into `out`,
/// with the extensions in the file `extensions` (X.509 version 3), or none (version 1).
pub fn sign_certificate(dir: &Path, csr: &str, out: &str, extensions: Option<&str>) {
    let mut args = vec![
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        out,
        "-days",
        "2",
    ];
    if let Some(extensions) = extensions {
        args.extend(["-extfile", extensions]);
    }
    openssl(dir, &args);
}

/// Makes a CA (`ca.pem`), a server certificate for `localhost` and 127.0.0.1
/// (`server.pem`, `server.key`) and a client certificate (`client.pem`, `client.key`) in `dir`;
/// returns the CA's path.
pub fn make_certificates(dir: &Path) -> PathBuf {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=levee test CA",
        ],
    );
    // Extensions make X.509 version 3 certificates, which TLS libraries require.
    let made = [
        (
            "server",
            "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
        ),
        (
            "client",
            "/CN=levee",
            "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
        ),
    ];
    for (name, subject, extensions) in made {
        let (key, csr, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.ext"),
        );
        std::fs::write(dir.join(&ext), extensions).expect("extensions");
        openssl(
            dir,
            &[
                "req", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &csr, "-subj",
                subject,
            ],
        );
        sign_certificate(dir, &csr, &format!("{name}.pem"), Some(&ext));
    }
    dir.join("ca.pem")
}

/// The `LD_PRELOAD` the `faketime` command runs a program with (libfaketime), or `None` when
/// faketime is not installed. levee is then started with it directly, not under the
/// `faketime` command: that one forks and waits, and stopping it would leave levee running.
pub fn faketime_preload() -> Option<String> {
    let output = std::process::Command::new("faketime")
        .args(["-f", "+0", "sh", "-c", "printf %s \"$LD_PRELOAD\""])
        .output()
        .ok()?;
    let preload = String::from_utf8_lossy(&output.stdout).into_owned();
    (output.status.success() && preload.contains("faketime")).then_some(preload)
}
