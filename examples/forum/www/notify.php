<?php
// Notifications. POST queues one ("user X replied to you"); GET lists what was applied.
//
// While the notifications module is off, levee answers the POST itself with 202 and keeps the
// request in Redis; when the module is back on, levee replays it here with an
// `Idempotency-Key` header (the job id). The key is remembered so a replay that arrives twice
// is applied once.
require __DIR__ . '/_common.php';

if ($_SERVER['REQUEST_METHOD'] !== 'POST') {
    header('Cache-Control: no-store');
    json_out(['applied' => read_lines('notifications.jsonl')]);
    exit;
}

$key = (string) ($_SERVER['HTTP_IDEMPOTENCY_KEY'] ?? '');
if ($key !== '') {
    foreach (read_lines('notifications.jsonl') as $done) {
        if (($done['idempotency_key'] ?? '') === $key) {
            json_out(['ok' => true, 'duplicate' => true, 'idempotency_key' => $key]);
            exit;
        }
    }
}
$record = [
    'to' => (string) ($_POST['to'] ?? 'someone'),
    'message' => clip((string) ($_POST['message'] ?? ''), 200),
    'idempotency_key' => $key !== '' ? $key : null, // null: applied at once, not replayed
    'client_ip' => $_SERVER['REMOTE_ADDR'] ?? '-',
    'applied_at' => date('c'),
];
append_line('notifications.jsonl', $record);
json_out(['ok' => true, 'applied' => $record]);
