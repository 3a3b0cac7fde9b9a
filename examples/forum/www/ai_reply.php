<?php
// "AI reply": asks an external AI API for a suggested answer. The call goes through levee's
// egress route (Host: ai.egress), so the API gets levee's breaker, timeouts and fallback: when
// the API is down or slow, levee answers at once with
// {"reply":null,"degraded":true,...} instead of letting php-fpm workers pile up behind it.
require __DIR__ . '/_common.php';

$question = (string) ($_POST['q'] ?? $_GET['q'] ?? 'How do I reset my password?');
$egress = getenv('LEVEE_EGRESS') ?: '127.0.0.1:8080'; // levee's [server] listen
$url = 'http://' . $egress . '/v1/reply';
$payload = json_encode(['question' => $question, 'user' => current_user()]);
$headers = ['Host: ai.egress', 'Content-Type: application/json', 'Accept: application/json'];

if (function_exists('curl_init')) {
    // The usual way: the curl extension (Debian package php-curl).
    $ch = curl_init($url);
    curl_setopt_array($ch, [
        CURLOPT_HTTPHEADER => $headers,
        CURLOPT_POSTFIELDS => $payload,
        CURLOPT_RETURNTRANSFER => true,
        CURLOPT_TIMEOUT => 10,
    ]);
    $body = curl_exec($ch);
    $status = (int) curl_getinfo($ch, CURLINFO_RESPONSE_CODE);
    curl_close($ch);
} else {
    // Without php-curl: PHP's own http:// stream, same request.
    $context = stream_context_create(['http' => [
        'method' => 'POST',
        'header' => implode("\r\n", $headers),
        'content' => $payload,
        'timeout' => 10,
        'ignore_errors' => true, // give us the body of 4xx/5xx answers too
    ]]);
    $body = @file_get_contents($url, false, $context);
    $status = 0;
    foreach ($http_response_header ?? [] as $line) {
        if (preg_match('#^HTTP/\S+ (\d{3})#', $line, $m)) {
            $status = (int) $m[1];
        }
    }
}

$answer = is_string($body) ? json_decode($body, true) : null;
if ($status === 200 && is_array($answer)) {
    // A real reply, or levee's fallback while the `ai` breaker is open (degraded = true).
    json_out([
        'reply' => $answer['reply'] ?? null,
        'degraded' => (bool) ($answer['degraded'] ?? false),
        'message' => $answer['message'] ?? null,
        'upstream_status' => $status,
    ]);
} else {
    // The API failed before levee's breaker opened: say so politely, the page keeps working.
    json_out([
        'reply' => null,
        'degraded' => true,
        'message' => 'The assistant could not answer this time.',
        'upstream_status' => $status,
    ]);
}
