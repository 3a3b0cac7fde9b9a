<?php
// Shared helpers of the example forum, included by every page. Plain PHP, no framework, files
// instead of a database so the demo needs nothing but php-fpm.
//
// Environment (set in the php-fpm pool by examples/run-demo.sh):
//   FORUM_DATA    directory for posts, visitors and notifications (writable by php-fpm)
//   LEVEE_EGRESS  host:port of levee, through which the app calls the external AI API
if (basename($_SERVER['SCRIPT_FILENAME'] ?? '') === '_common.php') {
    http_response_code(404);
    exit;
}

function data_dir(): string
{
    $dir = getenv('FORUM_DATA') ?: (sys_get_temp_dir() . '/levee-forum');
    if (!is_dir($dir)) {
        @mkdir($dir, 0775, true);
    }
    return $dir;
}

function h(?string $text): string
{
    return htmlspecialchars((string) $text, ENT_QUOTES, 'UTF-8');
}

// The logged-in user: the forum_uid cookie set by login.php (levee keys per-user limits on it).
function current_user(): ?string
{
    $user = $_COOKIE['forum_uid'] ?? '';
    return preg_match('/^[A-Za-z0-9_]{1,32}$/', $user) ? $user : null;
}

// One JSON object per line; appending with LOCK_EX is enough for a demo.
function append_line(string $file, array $record): void
{
    file_put_contents(data_dir() . '/' . $file, json_encode($record) . "\n", FILE_APPEND | LOCK_EX);
}

function read_lines(string $file): array
{
    $path = data_dir() . '/' . $file;
    if (!is_file($path)) {
        return [];
    }
    $out = [];
    foreach (file($path, FILE_IGNORE_NEW_LINES | FILE_SKIP_EMPTY_LINES) as $line) {
        $record = json_decode($line, true);
        if (is_array($record)) {
            $out[] = $record;
        }
    }
    return $out;
}

function recent_posts(int $limit = 10): array
{
    return array_slice(array_reverse(read_lines('posts.jsonl')), 0, $limit);
}

// The "expensive" ranking: posts per user. On a real forum this is a heavy GROUP BY, which is
// why levee keeps a stale copy of /ranking.php and can switch the block off.
function ranking(int $limit = 10, bool $slow = false): array
{
    if ($slow) {
        usleep(300000); // the query that makes the ranking page the first thing to go
    }
    $counts = ['alice' => 3, 'bob' => 2]; // the regulars
    foreach (read_lines('posts.jsonl') as $post) {
        $user = $post['user'] ?? 'guest';
        $counts[$user] = ($counts[$user] ?? 0) + 1;
    }
    arsort($counts);
    $rows = [];
    foreach (array_slice($counts, 0, $limit, true) as $user => $posts) {
        $rows[] = ['user' => (string) $user, 'posts' => $posts];
    }
    return $rows;
}

// Live visitors: distinct client IPs seen in the last five minutes. Records this visit.
function visitors_online(): int
{
    $now = time();
    append_line('visitors.jsonl', ['ip' => $_SERVER['REMOTE_ADDR'] ?? '-', 'at' => $now]);
    $seen = [];
    foreach (read_lines('visitors.jsonl') as $visit) {
        if (($visit['at'] ?? 0) > $now - 300) {
            $seen[$visit['ip'] ?? '-'] = true;
        }
    }
    return count($seen);
}

// Cuts text to at most $chars characters without breaking a UTF-8 sequence (no mbstring needed).
function clip(string $text, int $chars): string
{
    return preg_match('/^.{0,' . $chars . '}/su', $text, $m) ? $m[0] : substr($text, 0, $chars);
}

function json_out(array $value, int $status = 200): void
{
    http_response_code($status);
    header('Content-Type: application/json');
    echo json_encode($value, JSON_UNESCAPED_UNICODE | JSON_UNESCAPED_SLASHES), "\n";
}

function wants_json(): bool
{
    return str_contains($_SERVER['HTTP_ACCEPT'] ?? '', 'application/json');
}
