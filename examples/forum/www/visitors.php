<?php
// Live visitor count as JSON (polled by the homepage widget on a real site). Tier 3: the first
// thing switched off under load.
require __DIR__ . '/_common.php';
header('Cache-Control: no-store');
json_out(['online' => visitors_online()]);
