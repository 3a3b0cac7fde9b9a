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

# Names of Object's own members: the page keeps its lookups by name in objects.
[limit.toString]
key = ["ip"]
rate = "1/s"
burst = 1

[[route]]
name = "constructor"
match = { path_prefix = "/constructor" }
tier = 3
module = "valueOf"
limits = ["toString"]

# A route for one host and one network, whatever the path: no catch-all.
[[route]]
name = "back_office"
match = { host = "office.example", client = "10.0.0.0/8", method = ["GET", "POST"] }
"#;

/// Opens the dashboard, checks the numbers show (also of a route and a rule named like Object's
/// members) and every route shows all it matches on (one for a host and a network only was
/// shown as "any"), that a rebuilt row keeps the keyboard's focus, is refused without the token (and
/// says so), that a dismissed confirmation sends nothing, then turns the ranking module off with
/// the token and waits until the page shows it off; pins the breaker (who and when shown) and
/// hands it back; shows a refused reload's errors. No errors in the page throughout.
const SCRIPT: &str = r#"
const fs = require('fs');
const { chromium } = require('playwright-core');
const [url, screenshot, userDataDir, executablePath, token, policyFile] = process.argv.slice(2);

// A wait that times out says what it waited for and what the page showed instead.
async function waitFor(page, testid, wanted, check) {
  try {
    await page.waitForFunction(check, [testid, wanted]);
  } catch (error) {
    const shown = await page.evaluate((id) => {
      const node = document.querySelector(`[data-testid="${id}"]`);
      return node === null ? 'nothing' : JSON.stringify(node.textContent);
    }, testid);
    const pollError = await page.getByTestId('poll-error').textContent();
    throw new Error(`${testid}: waited for ${JSON.stringify(wanted)}, the page shows ${shown}` +
      (pollError ? `; poll error: ${pollError}` : '') + `\n${error.message}`);
  }
}

async function waitText(page, testid, wanted) {
  await waitFor(page, testid, wanted, ([id, wanted]) => {
    const node = document.querySelector(`[data-testid="${id}"]`);
    return node !== null && node.textContent.trim() === wanted;
  });
}

async function waitMatch(page, testid, source) {
  await waitFor(page, testid, source, ([id, source]) => {
    const node = document.querySelector(`[data-testid="${id}"]`);
    return node !== null && !node.hidden && new RegExp(source).test(node.textContent);
  });
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
  page.on('console', (message) => {
    // Chromium logs an answer that is not 2xx as a failed load: the test asks for a 401 and
    // a 422 on purpose.
    if (message.type() === 'error' && !/status of (401|422)/.test(message.text())) {
      pageErrors.push('console: ' + message.text());
    }
  });
  // Each confirmation asked is answered as `answer` says.
  const dialogs = [];
  let answer = 'accept';
  page.on('dialog', async (dialog) => {
    dialogs.push(dialog.message());
    if (answer === 'accept') await dialog.accept(); else await dialog.dismiss();
  });
  const posts = [];
  page.on('request', (request) => { if (request.method() === 'POST') posts.push(request.url()); });
  const pollErrorShown = async () =>
    page.evaluate(() => !document.querySelector('[data-testid="poll-error"]').hidden);
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
  // A route named "constructor" and a rule named "toString" are shown like any other.
  await waitMatch(page, 'route-constructor-requests', '200: [1-9]');
  await waitMatch(page, 'stat-limited-sub', 'toString [1-9]');
  // Each route shows every condition it matches on; "any" is the catch-all alone.
  await waitText(page, 'route-home-match', '= /');
  await waitText(page, 'route-ranking-match', '/ranking*');
  await waitText(page, 'route-back_office-match', 'GET,POST host office.example client 10.0.0.0/8');
  await waitText(page, 'route-default-match', 'any');
  if (await pollErrorShown()) throw new Error('poll error shown: ' + await page.getByTestId('poll-error').textContent());

  // A row rebuilt by a poll (its counters move with the traffic) keeps the keyboard's focus.
  await page.getByTestId('breaker-app-closed').focus();
  await page.evaluate(() => { document.querySelector('[data-testid="breaker-app-closed"]').leveeBefore = true; });
  await page.waitForFunction(() => {
    const button = document.querySelector('[data-testid="breaker-app-closed"]');
    return button !== null && !button.leveeBefore;
  });
  const focused = await page.evaluate(() => document.activeElement && document.activeElement.dataset.testid);
  if (focused !== 'breaker-app-closed') throw new Error('focus lost to a rebuilt row: ' + focused);

  // Without the token the server refuses, and its answer is on the page.
  await page.getByTestId('module-ranking-off').click();
  await waitMatch(page, 'message', 'HTTP 401: 401 this admin action needs a token');
  await waitText(page, 'module-ranking-state', 'on');
  if (dialogs.length !== 1 || !/ranking/.test(dialogs[0])) throw new Error('no confirmation asked: ' + dialogs);

  // A confirmation dismissed sends nothing, and nothing changes.
  await page.getByTestId('token').fill(token);
  answer = 'dismiss';
  const postsBefore = posts.length;
  const messageBefore = await page.getByTestId('message').textContent();
  await page.getByTestId('module-ranking-off').click();
  await page.waitForResponse((response) => response.url().endsWith('/status'));
  await page.waitForResponse((response) => response.url().endsWith('/status'));
  if (dialogs.length !== 2) throw new Error('no confirmation asked: ' + dialogs);
  if (posts.length !== postsBefore) throw new Error('sent after a dismissed confirmation: ' + posts.slice(postsBefore));
  await waitText(page, 'module-ranking-state', 'on');
  if (await page.getByTestId('message').textContent() !== messageBefore) throw new Error('message changed after a dismissed confirmation');

  answer = 'accept';
  await page.getByTestId('module-ranking-off').click();
  await waitText(page, 'module-ranking-state', 'off');
  await waitMatch(page, 'stat-degrade-detail', 'off: ranking');
  const stored = await page.evaluate(() => sessionStorage.getItem('levee.adminToken'));
  if (stored !== token) throw new Error('token not kept in sessionStorage: ' + stored);

  // A pin says who and when; "auto" hands it back without a question.
  await page.getByTestId('breaker-app-open').click();
  await waitMatch(page, 'breaker-app-force', '^open \\(by ops.* at \\d');
  if (dialogs.length !== 4 || !/breaker of "app" open/.test(dialogs[3])) throw new Error('no confirmation asked: ' + dialogs);
  await page.getByTestId('breaker-app-auto').click();
  await waitText(page, 'breaker-app-force', 'auto');
  if (dialogs.length !== 4) throw new Error('asked before "auto": ' + dialogs);

  // A refused reload: its errors one a line in the banner, and under the controls.
  const policy = fs.readFileSync(policyFile, 'utf8');
  fs.writeFileSync(policyFile, policy + '\n[[route]]\nname = "broken"\nupstream = "nowhere"\n');
  await page.getByTestId('reload').click();
  await waitMatch(page, 'message', '^policy reload refused: \\S*levee\\.toml:\\d+:\\d+: ');
  await waitMatch(page, 'reload-errors', 'nowhere');
  // Each as `levee check` prints it: its severity, and its hint under it.
  await waitMatch(page, 'reload-errors', '\\(1 error;[^]*levee\\.toml:\\d+:\\d+: error: upstream `nowhere` is not defined\\s+hint: defined upstreams');
  fs.writeFileSync(policyFile, policy);
  await page.getByTestId('reload').click();
  await waitMatch(page, 'message', '^policy reload: generation');
  await page.waitForFunction(() => document.querySelector('[data-testid="reload-errors"]').hidden);

  // A switch saved for a module the policy no longer has is listed, and "policy" clears it.
  await page.getByTestId('module-valueOf-off').click();
  await waitText(page, 'module-valueOf-state', 'off');
  fs.writeFileSync(policyFile, policy.replace('module = "valueOf"\n', ''));
  await page.getByTestId('reload').click();
  await waitMatch(page, 'saved-module-valueOf', 'module valueOf off \\(by ops.* at \\d');
  const asked = dialogs.length;
  await page.getByTestId('saved-module-valueOf-policy').click();
  await waitText(page, 'saved-modules', '');
  if (dialogs.length !== asked) throw new Error('asked before "policy": ' + dialogs);

  // A few more polls, so the screenshot shows a line rather than a dot.
  await page.waitForFunction(() =>
    document.getElementById('spark-req').getAttribute('points').split(' ').length >= 4);
  await page.screenshot({ path: screenshot, fullPage: true });
  if (await pollErrorShown()) throw new Error('poll error shown: ' + await page.getByTestId('poll-error').textContent());
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
            for path in ["/", "/ranking", "/constructor"] {
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
        .arg(levee.policy_file())
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
