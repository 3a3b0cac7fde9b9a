<?php
// The example forum's homepage: a legacy page with a ranking block and a visitors block.
$user = $_COOKIE['forum_uid'] ?? null;
?><!doctype html>
<html><head><meta charset="utf-8"><title>Example forum</title></head>
<body>
<h1>Example forum</h1>
<p><?= $user ? 'Hello, user ' . htmlspecialchars($user) : '<a href="/login.php">Log in</a>' ?></p>
<form method="post" action="/post.php"><textarea name="text"></textarea><button>Post</button></form>
<div id="ranking"><h2>Top posters</h2><ol><li>alice</li><li>bob</li></ol></div>
<div data-module="visitors">Visitors online: <?= random_int(10, 99) ?></div>
<p>Your IP as PHP sees it: <?= htmlspecialchars($_SERVER['REMOTE_ADDR']) ?></p>
</body></html>
