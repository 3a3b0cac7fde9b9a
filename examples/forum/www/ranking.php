<?php
// The full ranking page: slow on purpose. levee serves its last good copy (route `ranking`,
// `degrade = { action = "stale" }`) while the ranking module is off or the app fails.
require __DIR__ . '/_common.php';
header('Cache-Control: public, max-age=30'); // cacheable: no cookie, nothing private
$rows = ranking(50, true);
?><!doctype html>
<html><head><meta charset="utf-8"><title>Ranking</title><link rel="stylesheet" href="/style.css"></head>
<body>
<h1>Top posters</h1>
<ol id="full-ranking">
<?php foreach ($rows as $row): ?>
  <li><?= h($row['user']) ?> (<?= (int) $row['posts'] ?> posts)</li>
<?php endforeach; ?>
</ol>
<p class="small">Computed at <?= date('H:i:s') ?>.</p>
<p><a href="/">Back</a></p>
</body></html>
