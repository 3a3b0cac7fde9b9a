//! The admin dashboard in a real browser: Debian's headless Chromium driven by playwright-core
//! (from the npm registry; it never downloads a browser of its own).
//!
//! playwright-core is found through `LEVEE_PLAYWRIGHT_NODE_MODULES` (a `node_modules` directory
//! holding it), else installed once with npm under cargo's target directory.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const TOKEN: &str = "dashboard-test-token-0123456789";

const ROUTES: &str = r#"
[limit.ranking_per_ip]
key = ["ip"]
rate = "2/s"
burst = 2

[[route]]
name = "home"
match = { path = "/" }

[[route]]
name = "ranking"
match = { path_prefix = "/ranking" }
tier = 3
module = "ranking"
limits = ["ranking_per_ip"]
"#;

/// Opens the dashboard, checks the numbers show, is refused without the token (and says so),
/// then turns the ranking module off with the token and waits until the page shows it off.
const SCRIPT: &str = r#"
const { chromium } = require('playwright-core');
const [url, screenshot, userDataDir, executablePath, token] = process.argv.slice(2);

async function waitText(page, testid, wanted) {
  await page.waitForFunction(([id, wanted]) => {
    const node = document.querySelector(`[data-testid="${id}"]`);
    return node !== null && node.textContent.trim() === wanted;
  }, [testid, wanted]);
}

async function waitMatch(page, testid, source) {
  await page.waitForFunction(([id, source]) => {
    const node = document.querySelector(`[data-testid="${id}"]`);
    return node !== null && !node.hidden && new RegExp(source).test(node.textContent);
  }, [testid, source]);
}

(async () => {
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: { width: 1360, height: 1000 },
  });
  const page = context.pages()[0] || await context.newPage();
  page.setDefaultTimeout(20000);
  const pageErrors = [];
  page.on('pageerror', (error) => pageErrors.push(String(error)));
  await page.goto(url);

  await waitText(page, 'module-ranking-state', 'on');
  await waitText(page, 'level', '0');
  await waitText(page, 'stat-degrade', 'level 0');
  await waitMatch(page, 'stat-backlog', '^0$');
  await waitMatch(page, 'stat-breaker-opens', '^0$');
  // The traffic the test sends runs into the ranking limit, and the sparkline has a rate.
  await waitMatch(page, 'stat-limited', '^[1-9]');
  await waitMatch(page, 'route-ranking-requests', '429: [1-9]');
  await page.waitForFunction(() =>
    document.getElementById('spark-req').getAttribute('points').split(' ').length >= 2);

  // Without the token the server refuses, and its answer is on the page.
  await page.getByTestId('module-ranking-off').click();
  await waitMatch(page, 'message', 'HTTP 401: 401 this admin action needs a token');
  await waitText(page, 'module-ranking-state', 'on');

  await page.getByTestId('token').fill(token);
  await page.getByTestId('module-ranking-off').click();
  await waitText(page, 'module-ranking-state', 'off');
  await waitMatch(page, 'stat-degrade-detail', 'off: ranking');
  const stored = await page.evaluate(() => sessionStorage.getItem('levee.adminToken'));
  if (stored !== token) throw new Error('token not kept in sessionStorage: ' + stored);

  // A few more polls, so the screenshot shows a line rather than a dot.
  await page.waitForFunction(() =>
    document.getElementById('spark-req').getAttribute('points').split(' ').length >= 4);
  await page.screenshot({ path: screenshot, fullPage: true });
  await context.close();
  if (pageErrors.length) throw new Error('errors in the page: ' + pageErrors.join('; '));
  console.log('dashboard ok');
})().catch((error) => {
  console.error(error && error.stack ? error.stack : String(error));
  process.exit(1);
});
"#;

/// A `node_modules` directory that holds playwright-core.
fn playwright_node_modules() -> PathBuf {
    if let Some(dir) = std::env::var_os("LEVEE_PLAYWRIGHT_NODE_MODULES") {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("playwright-core").join("package.json").exists(),
            "LEVEE_PLAYWRIGHT_NODE_MODULES={} holds no playwright-core",
            dir.display()
        );
        return dir;
    }
    let prefix = Path::new(env!("CARGO_TARGET_TMPDIR")).join("node");
    let modules = prefix.join("node_modules");
    if !modules
        .join("playwright-core")
        .join("package.json")
        .exists()
    {
        std::fs::create_dir_all(&prefix).expect("npm prefix dir");
        let status = Command::new(find_binary(&["npm"]))
            .arg("install")
            .arg("--prefix")
            .arg(&prefix)
            .args(["--no-audit", "--no-fund", "playwright-core@1"])
            .stdin(Stdio::null())
            .status()
            .expect("run npm");
        assert!(status.success(), "npm install playwright-core@1 failed");
    }
    modules
}

/// Runs `command`, killing it (by its own pid) after `within`; returns success, stdout, stderr.
fn run_with_deadline(mut command: Command, dir: &Path, within: Duration) -> (bool, String, String) {
    let out_path = dir.join("node.out");
    let err_path = dir.join("node.err");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("start node");
    let deadline = Instant::now() + within;
    let ok = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = |path: &Path| std::fs::read_to_string(path).unwrap_or_default();
    (ok, read(&out_path), read(&err_path))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_turns_a_module_off_from_the_dashboard() {
    let backend = echo_backend().await;
    let policy = policy_for(backend.addr, "access_log = false", ROUTES).replace(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        &format!("[admin]\nlisten = \"127.0.0.1:0\"\ntokens = {{ ops = \"{TOKEN}\" }}"),
    );
    let levee = Levee::start(&policy).await;

    // The page itself: served at / and /dashboard, never cached.
    for path in ["/", "/dashboard"] {
        let page = get(&levee.admin_url(path)).await;
        assert_eq!(page.status, 200, "{path}");
        assert_eq!(
            page.header("content-type"),
            Some("text/html; charset=utf-8")
        );
        assert_eq!(page.header("cache-control"), Some("no-store"));
        assert!(page.text().contains("data-testid=\"level\""), "{path}");
    }
    assert_eq!(get(&levee.url("/ranking")).await.status, 200);

    // Steady traffic while the browser watches: some of it runs into the ranking limit.
    let public = levee.public;
    let traffic = tokio::spawn(async move {
        loop {
            for path in ["/", "/ranking"] {
                let _ = get(&format!("http://{public}{path}")).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    let chromium = find_binary(&["chromium", "/usr/bin/chromium"]);
    let node = find_binary(&["node", "nodejs"]);
    let modules = tokio::task::spawn_blocking(playwright_node_modules)
        .await
        .expect("npm install");
    let work = tempfile::tempdir().expect("temp dir");
    let script = work.path().join("dashboard.js");
    std::fs::write(&script, SCRIPT).expect("write script");
    let profile = work.path().join("chromium-profile");
    std::fs::create_dir_all(&profile).expect("profile dir");
    let screenshot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&screenshot);

    let mut command = Command::new(node);
    command
        .arg(&script)
        .arg(levee.admin_url("/dashboard"))
        .arg(&screenshot)
        .arg(&profile)
        .arg(&chromium)
        .arg(TOKEN)
        .current_dir(work.path())
        .env("NODE_PATH", &modules);
    let dir = work.path().to_path_buf();
    let (ok, stdout, stderr) = tokio::task::spawn_blocking(move || {
        run_with_deadline(command, &dir, Duration::from_secs(120))
    })
    .await
    .expect("node");
    traffic.abort();
    assert!(
        ok,
        "browser script failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("dashboard ok"), "{stdout}");
    assert!(
        screenshot.exists(),
        "no screenshot at {}",
        screenshot.display()
    );

    // What the click did, seen from levee itself.
    let status = get(&levee.admin_url("/status")).await.json();
    assert_eq!(
        status["degrade"]["modules"]["ranking"]["off"], true,
        "{status}"
    );
    assert_eq!(status["degrade"]["modules"]["ranking"]["origin"], "runtime");
    assert!(
        status["degrade"]["modules"]["ranking"]["changed_by"]
            .as_str()
            .unwrap_or("")
            .starts_with("ops"),
        "{status}"
    );
    assert_eq!(get(&levee.url("/ranking")).await.status, 503);
    assert_eq!(get(&levee.url("/")).await.status, 200);
}
