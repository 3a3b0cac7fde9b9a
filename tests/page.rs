//! Degradation on a real PHP page (nginx + php-fpm): hiding modules while streaming and
//! serving the last good ranking when php-fpm is gone.

mod common;

use std::time::Duration;

use common::*;
use http::Request;

const HOME_PHP: &str = r#"<?php
header('Content-Type: text/html; charset=utf-8');
?><!doctype html>
<html><head><meta charset="utf-8"><title>论坛</title></head>
<body>
<h1>Welcome</h1>
<div id="ranking"><h2>Top posters</h2><ol><li>alice</li><li>bob</li></ol></div>
<p class="posts">Latest posts…</p>
<div data-module="visitors">Visitors online: 42</div>
<!-- levee:module ads --><aside>Buy things</aside><!-- /levee:module ads -->
<footer>© forum</footer>
</body></html>
"#;

const RANKING_PHP: &str = r#"<?php
header('Content-Type: application/json');
echo json_encode(['top' => ['alice', 'bob'], 'generated' => 'by php']);
"#;

const POLICY: &str = r##"
[[route]]
name = "home"
match = { path = "/home.php" }
hide = { ranking = "#ranking", visitors = "[data-module=visitors]", ads = "marker" }

[[route]]
name = "ranking"
match = { path_prefix = "/ranking" }
tier = 3
module = "ranking"
degrade = { action = "stale", max_age = "10m" }
"##;

async fn switch(levee: &Levee, module: &str, state: &str) {
    let answer = post(&levee.admin_url(&format!("/modules/{module}")), state).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_a_module_off_removes_exactly_its_block_from_the_page() {
    let site = PhpSite::start(&[("home.php", HOME_PHP)]).await;
    let levee = Levee::start(&policy_for(site.addr(), "", POLICY)).await;
    let gzip = || {
        Request::get(levee.url("/home.php"))
            .header("accept-encoding", "gzip")
            .body(full(""))
            .expect("request")
    };

    let original = send(gzip()).await;
    assert_eq!(original.status, 200);
    let original_text = original.text();
    assert!(original_text.contains("Top posters"));

    switch(&levee, "ranking", "off").await;
    let hidden = send(gzip()).await;
    assert_eq!(hidden.status, 200);
    assert!(
        hidden.header("content-encoding").is_none(),
        "the rewritten page comes back uncompressed"
    );
    let expected = original_text.replace(
        "<div id=\"ranking\"><h2>Top posters</h2><ol><li>alice</li><li>bob</li></ol></div>",
        "",
    );
    assert_ne!(expected, original_text);
    assert_eq!(
        hidden.text(),
        expected,
        "only the ranking block is gone; every other byte is the same"
    );

    switch(&levee, "visitors", "off").await;
    switch(&levee, "ads", "off").await;
    let bare = get(&levee.url("/home.php")).await.text();
    assert!(
        !bare.contains("Visitors online")
            && !bare.contains("Buy things")
            && !bare.contains("levee:module"),
        "{bare}"
    );
    assert!(bare.contains("Latest posts…") && bare.contains("© forum"));

    // Another set of modules off, then one seen before: each page is cut by its own set.
    switch(&levee, "ranking", "on").await;
    let ranked = get(&levee.url("/home.php")).await.text();
    assert!(
        ranked.contains("Top posters") && !ranked.contains("Visitors online"),
        "{ranked}"
    );
    switch(&levee, "ranking", "off").await;
    assert_eq!(get(&levee.url("/home.php")).await.text(), bare);

    for module in ["ranking", "visitors", "ads"] {
        switch(&levee, module, "on").await;
    }
    assert_eq!(
        get(&levee.url("/home.php")).await.text(),
        original_text,
        "switched on: the page is whole again"
    );
}

/// A page that skips the ranking's work when levee says the module is off.
const TOLD_PHP: &str = r#"<?php
$told = $_SERVER['HTTP_X_LEVEE_MODULES_OFF'] ?? '';
$off = array_map('trim', explode(',', $told));
echo '<p id="told">[' . htmlspecialchars($told) . ']</p>';
if (!in_array('ranking', $off, true)) {
    echo '<div id="ranking">ran the ranking query</div>';
}
echo '<div data-module="visitors">Visitors online: 42</div>';
"#;

/// With `[degrade] tell_app`, the app hears which of the route's modules are off
/// (`X-Levee-Modules-Off`) and can skip their work; a client's own field never reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_is_told_which_modules_are_off() {
    let site = PhpSite::start(&[("home.php", TOLD_PHP)]).await;
    let policy = format!("[degrade]\ntell_app = true\n{POLICY}");
    let levee = Levee::start(&policy_for(site.addr(), "", &policy)).await;
    let spoofed = || async {
        get_with(
            &levee.url("/home.php"),
            &[("x-levee-modules-off", "ranking")],
        )
        .await
        .text()
    };

    let whole = spoofed().await;
    assert!(
        whole.contains("[]") && whole.contains("ran the ranking query"),
        "a client's field is not passed on: {whole}"
    );

    switch(&levee, "ranking", "off").await;
    let page = spoofed().await;
    assert!(page.contains("[ranking]"), "{page}");
    assert!(!page.contains("ranking query"), "{page}");

    switch(&levee, "visitors", "off").await;
    let page = get(&levee.url("/home.php")).await.text();
    assert!(page.contains("[ranking, visitors]"), "{page}");
    assert!(!page.contains("Visitors online"), "still cut: {page}");

    switch(&levee, "ranking", "on").await;
    switch(&levee, "visitors", "on").await;
    let page = get(&levee.url("/home.php")).await.text();
    assert!(
        page.contains("[]") && page.contains("ran the ranking query"),
        "{page}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ranking_survives_php_fpm_going_away() {
    let mut site = PhpSite::start(&[("ranking.php", RANKING_PHP)]).await;
    let levee = Levee::start(&policy_for(site.addr(), "", POLICY)).await;
    let fresh = get(&levee.url("/ranking.php")).await;
    assert_eq!(fresh.status, 200);
    assert_eq!(fresh.json()["generated"], "by php");

    site.stop_php();
    // nginx is still up and answers 502 for PHP: levee serves the last good ranking instead.
    let stale = tokio::time::timeout(Duration::from_secs(10), get(&levee.url("/ranking.php")))
        .await
        .expect("answered");
    assert_eq!(stale.status, 200, "{}", stale.text());
    assert_eq!(stale.json()["top"][0], "alice");
    assert_eq!(stale.header("x-levee-stale"), Some("1"));
    assert!(stale.header("age").is_some());
}
