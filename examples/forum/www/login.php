<?php
// A legacy login: redirect built from Host, cookie Secure behind an https front.
// levee limits POSTs here per IP (login_per_ip) before PHP ever runs.
if ($_SERVER['REQUEST_METHOD'] === 'POST') {
    $name = preg_replace('/[^A-Za-z0-9_]/', '', (string) ($_POST['user'] ?? ''));
    $uid = $name !== '' ? substr($name, 0, 32) : (string) random_int(1, 1000);
    $secure = ($_SERVER['HTTP_X_FORWARDED_PROTO'] ?? 'http') === 'https';
    setcookie('forum_uid', $uid, ['path' => '/', 'secure' => $secure, 'httponly' => true]);
    header('Location: http://' . $_SERVER['HTTP_HOST'] . '/');
    http_response_code(302);
    exit;
}
?><!doctype html><meta charset="utf-8"><title>Log in</title>
<form method="post"><input name="user" placeholder="your name"><button>Log in</button></form>
