<?php
// Accepts a post. levee limits it per user and per IP before PHP ever runs.
require __DIR__ . '/_common.php';
if ($_SERVER['REQUEST_METHOD'] !== 'POST') {
    header('Location: /', true, 303);
    exit;
}
$text = trim((string) ($_POST['text'] ?? ''));
if ($text !== '') {
    append_line('posts.jsonl', [
        'user' => current_user() ?? 'guest',
        'text' => clip($text, 500),
        'at' => time(),
    ]);
}
if (str_contains($_SERVER['HTTP_ACCEPT'] ?? '', 'text/html')) {
    header('Location: /', true, 303); // a browser form: back to the homepage
    exit;
}
json_out(['ok' => true, 'length' => strlen($text)]);
