<?php
// The ranking as JSON for the mobile app and partners. Route `ranking_api`: the per-API-key
// quota of /api/ plus a stale copy while the ranking module is off.
require __DIR__ . '/../_common.php';
header('Cache-Control: public, max-age=30');
json_out(['ranking' => ranking(50, true), 'computed_at' => date('c')]);
