<?php
// A legacy login: redirect built from Host, cookie Secure behind an https front.
if ($_SERVER['REQUEST_METHOD'] === 'POST') {
    $secure = ($_SERVER['HTTP_X_FORWARDED_PROTO'] ?? 'http') === 'https';
    setcookie('forum_uid', (string) random_int(1, 1000), ['path' => '/', 'secure' => $secure, 'httponly' => true]);
    header('Location: http://' . $_SERVER['HTTP_HOST'] . '/');
    http_response_code(302);
    exit;
}
?><!doctype html><meta charset="utf-8"><form method="post"><input name="user"><button>Log in</button></form>
