<?php
// The example forum's homepage: a legacy page with a ranking block and a visitors block.
// levee cuts both blocks out of the HTML while their module is switched off (the `hide` of the
// `home` route); the page itself never changes.
require __DIR__ . '/_common.php';
$user = current_user();
$posts = recent_posts();
?><!doctype html>
<html><head><meta charset="utf-8"><title>Example forum</title>
<link rel="stylesheet" href="/style.css"></head>
<body>
<h1>Example forum</h1>
<p><?= $user ? 'Hello, ' . h($user) : '<a href="/login.php">Log in</a> to post' ?></p>
<form method="post" action="/post.php"><textarea name="text" placeholder="Say something"></textarea><button>Post</button></form>

<h2>Latest posts</h2>
<ul class="posts">
<?php foreach ($posts as $post): ?>
  <li><b><?= h($post['user']) ?></b>: <?= h($post['text']) ?></li>
<?php endforeach; ?>
<?php if (!$posts): ?>  <li>No posts yet.</li>
<?php endif; ?>
</ul>

<div id="ranking"><h2>Top posters</h2><ol>
<?php foreach (ranking(5) as $row): ?>
  <li><?= h($row['user']) ?> (<?= (int) $row['posts'] ?>)</li>
<?php endforeach; ?>
</ol><a href="/ranking.php">Full ranking</a></div>

<div data-module="visitors">Visitors online: <?= visitors_online() ?></div>

<form method="get" action="/ai_reply.php" class="ai">
  <input name="q" placeholder="Ask the AI assistant"><button>Ask</button>
</form>

<p class="small">Your IP as PHP sees it: <?= h($_SERVER['REMOTE_ADDR']) ?></p>
</body></html>
