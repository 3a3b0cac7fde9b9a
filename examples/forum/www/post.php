<?php
// Accepts a post. levee limits it per user and per IP before PHP ever runs.
header('Content-Type: application/json');
echo json_encode(['ok' => true, 'length' => strlen($_POST['text'] ?? '')]);
