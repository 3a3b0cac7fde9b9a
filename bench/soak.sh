#!/usr/bin/env bash
# levee soak: a steady moderate load for a long time, with 100,000 distinct client addresses and
# users rotating, through levee with Redis rate limits in front of an nginx backend.
#
#   bench/soak.sh                       # 30 minutes (the reliability target)
#   MINUTES=2 bench/soak.sh             # a short look
#
# It passes when: no request failed beyond the configured limits (every answer is 200 or 429,
# no socket errors or timeouts), levee's RSS after the warm-up stays flat (end within 10% + 2 MiB
# of the first sample after warm-up), and Redis's key count stays bounded by the keys' TTLs.
# The report goes to stdout and to bench/results/soak-<date>-<time>.md (ignored by git).
#
# Settings (environment): MINUTES (30), CLIENTS (100000 addresses and as many users),
# CONNECTIONS (20), DELAY_MS (20: each connection waits this long between requests, so the rate
# is about CONNECTIONS * 1000 / DELAY_MS requests/s), SAMPLE_SECONDS (30), WARMUP_SECONDS (120,
# capped at a third of the run), LEVEE_BIN (default target/release/levee, built when missing).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
LIB=$REPO/bench/lib
MINUTES=${MINUTES:-30}
CLIENTS=${CLIENTS:-100000}
CONNECTIONS=${CONNECTIONS:-20}
DELAY_MS=${DELAY_MS:-20}
SAMPLE_SECONDS=${SAMPLE_SECONDS:-30}
DURATION=$((MINUTES * 60))
WARMUP_SECONDS=${WARMUP_SECONDS:-120}
((WARMUP_SECONDS <= DURATION / 3)) || WARMUP_SECONDS=$((DURATION / 3))
LEVEE=${LEVEE_BIN:-$REPO/target/release/levee}

log() { printf '[soak %4ds] %s\n' "$SECONDS" "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

for tool in nginx redis-server redis-cli wrk python3 curl; do
	command -v "$tool" >/dev/null || [[ -x /usr/sbin/$tool ]] || die "$tool is required (bench/run.sh installs the same packages)"
done
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
if [[ -z ${LEVEE_BIN:-} ]] && { [[ ! -x $LEVEE ]] ||
	[[ -n $(find "$REPO/src" "$REPO/Cargo.toml" -newer "$LEVEE" -print -quit) ]]; }; then
	log "building levee (cargo build --release)"
	(cd "$REPO" && cargo build --release) >&2 || die "cargo build --release failed"
fi

DIR=$(mktemp -d -t levee-soak.XXXXXX)
chmod 755 "$DIR"
declare -a PIDS=()
cleanup() {
	local pid
	for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
	for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
	[[ -f $DIR/nginx.pid ]] && kill "$(cat "$DIR/nginx.pid")" 2>/dev/null || true
	[[ -n ${KEEP:-} ]] || rm -rf "$DIR"
}
trap cleanup EXIT

mapfile -t PORTS < <(python3 "$LIB/free_ports.py" 4)
BACKEND_PORT=${PORTS[0]} REDIS_PORT=${PORTS[1]} PORT=${PORTS[2]} ADMIN_PORT=${PORTS[3]}

wait_port() { # PORT WHAT
	local tries=0
	until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
		((++tries < 100)) || die "$2 did not open port $1"
		sleep 0.1
	done
}

# The backend: nginx answering a small page, as cheap as it gets.
mkdir -p "$DIR/www"
cat >"$DIR/nginx.conf" <<EOF
worker_processes 1;
pid $DIR/nginx.pid;
error_log $DIR/nginx-error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $DIR/client_body_temp;
    proxy_temp_path $DIR/proxy_temp;
    fastcgi_temp_path $DIR/fastcgi_temp;
    uwsgi_temp_path $DIR/uwsgi_temp;
    scgi_temp_path $DIR/scgi_temp;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:$BACKEND_PORT;
        location / { return 200 "item page\n"; }
    }
}
EOF
"$NGINX" -c "$DIR/nginx.conf" -e "$DIR/nginx-error.log"
wait_port "$BACKEND_PORT" "backend nginx"

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
	--dir "$DIR" --logfile "$DIR/redis.log" &
PIDS+=($!)
wait_port "$REDIS_PORT" redis-server

# The policy: what a forum would run. Per-address and per-user limits far above what one
# rotating client sends, so only the hot user (every 50th request) is refused; the keys of the
# 100,000 others expire after burst/rate seconds.
mkdir -p "$DIR/policies"
cat >"$DIR/policies/soak.toml" <<EOF
[server]
listen = "127.0.0.1:$PORT"
trusted_proxies = ["127.0.0.1/32"]
access_log = false

[admin]
listen = "127.0.0.1:$ADMIN_PORT"

[redis]
url = "redis://127.0.0.1:$REDIS_PORT/0"

[identity]
user = "header:X-User"

[limit.per_ip]
key = ["ip"]
rate = "2/s"
burst = 5

[limit.per_user]
key = ["user"]
rate = "1/s"
burst = 3
missing = "skip"

[upstream.app]
url = "http://127.0.0.1:$BACKEND_PORT"

[[route]]
name = "item"
match = { path_prefix = "/item" }
upstream = "app"
limits = ["per_ip", "per_user"]
EOF
"$LEVEE" check --policies "$DIR/policies" >&2 || die "levee check refused the soak policy"
LEVEE_LOG=warn "$LEVEE" run --policies "$DIR/policies" 2>"$DIR/levee.log" &
LEVEE_PID=$!
PIDS+=("$LEVEE_PID")
wait_port "$PORT" levee
wait_port "$ADMIN_PORT" "levee admin"

rss_kib() { awk '/^VmRSS/ { print $2 }' "/proc/$LEVEE_PID/status"; }
redis_keys() { redis-cli -p "$REDIS_PORT" dbsize; }
redis_memory() { redis-cli -p "$REDIS_PORT" info memory | awk -F: '/^used_memory:/ { printf "%d", $2 / 1024 }'; }

# Each wrk thread throttles its connections with delay(), the soak.lua hooks rotate the
# client address and user on every request, and count answers by status.
log "soak: ${MINUTES} min, $CONNECTIONS connections, ${DELAY_MS} ms between requests per connection, $CLIENTS clients"
SOAK_CLIENTS=$CLIENTS SOAK_DELAY_MS=$DELAY_MS \
	wrk -t 2 -c "$CONNECTIONS" -d "${DURATION}s" --timeout 5s --latency -s "$LIB/soak.lua" \
	"http://127.0.0.1:$PORT/" >"$DIR/wrk.out" 2>&1 &
WRK_PID=$!
PIDS+=("$WRK_PID")

SAMPLES="| elapsed | levee RSS | Redis keys | Redis memory |"$'\n'"|---|---|---|---|"$'\n'
START_RSS=$(rss_kib)
WARM_RSS="" MAX_KEYS=0 elapsed=0
while kill -0 "$WRK_PID" 2>/dev/null && ((elapsed < DURATION)); do
	sleep "$SAMPLE_SECONDS"
	elapsed=$((elapsed + SAMPLE_SECONDS))
	kill -0 "$LEVEE_PID" 2>/dev/null || die "levee exited during the soak; its log: $(tail -n 5 "$DIR/levee.log")"
	rss=$(rss_kib) keys=$(redis_keys) mem=$(redis_memory)
	((keys > MAX_KEYS)) && MAX_KEYS=$keys
	[[ -z $WARM_RSS ]] && ((elapsed >= WARMUP_SECONDS)) && WARM_RSS=$rss
	SAMPLES+="| ${elapsed} s | $((rss / 1024)).$(((rss % 1024) * 10 / 1024)) MiB | $keys | $((mem / 1024)) MiB |"$'\n'
	log "t=${elapsed}s levee RSS ${rss} KiB, Redis keys $keys, Redis used ${mem} KiB"
done
wait "$WRK_PID" || true
END_RSS=$(rss_kib)
[[ -n $WARM_RSS ]] || WARM_RSS=$START_RSS

line=$(grep -m1 '^SOAK ' "$DIR/wrk.out") || die "wrk printed no result: $(tail -n 5 "$DIR/wrk.out")"
declare -A R=()
for kv in ${line#SOAK }; do R[${kv%%=*}]=${kv#*=}; done
socket_errors=$((R[err_connect] + R[err_read] + R[err_write] + R[err_timeout]))
other_status=0 statuses=""
for key in "${!R[@]}"; do
	[[ $key == s[0-9]* ]] || continue
	statuses+="${key#s}: ${R[$key]}, "
	[[ $key == s200 || $key == s429 ]] || other_status=$((other_status + R[$key]))
done
rps=$(awk "BEGIN { printf \"%.0f\", ${R[requests]} / (${R[duration_us]} / 1e6) }")
fallbacks=$(curl -fsS "http://127.0.0.1:$ADMIN_PORT/metrics" |
	awk '/^levee_ratelimit_decisions_total/ && /source="(local|fallback)"/ { n += $NF } END { printf "%d", n }')
# Keys live for at most burst/rate seconds after their last request (per_ip 2.5 s, per_user
# 3 s): at this rate and with two rules, the key count cannot exceed about rate * 3 s * 2.
key_bound=$((rps * 3 * 2 + 100))
rss_ok=$(awk "BEGIN { print ($END_RSS <= $WARM_RSS * 1.10 + 2048) ? 1 : 0 }")
verdict() { (($1)) && echo PASS || echo FAIL; }

REPORT=$(
	cat <<EOF
# levee soak, $(date -u '+%Y-%m-%d %H:%M UTC')

$(uname -srm), $(nproc) cores; $("$LEVEE" --version 2>/dev/null || echo levee), $(redis-server --version | sed 's/.*v=\([^ ]*\).*/Redis \1/'), $(wrk --version 2>&1 | head -n1 | awk '{ print $1, $2 }'), backend $("$NGINX" -v 2>&1 | sed 's/.*: //').
Load: wrk -t 2 -c $CONNECTIONS for $MINUTES min, ${DELAY_MS} ms between requests per connection,
$CLIENTS client addresses (X-Forwarded-For from the trusted loopback peer) and $CLIENTS users
rotating; every 50th request is one hot user. Policy: per_ip 2/s burst 5, per_user 1/s burst 3,
Redis on loopback.

| measure | value | target | |
|---|---|---|---|
| requests | ${R[requests]} (${rps}/s) | | |
| answers by status | ${statuses%, } | 200 or 429 only | $(verdict $((other_status == 0))) |
| socket errors / timeouts | $socket_errors | 0 | $(verdict $((socket_errors == 0))) |
| latency p50 / p99 / max | $((R[p50_us] / 1000)).$(((R[p50_us] % 1000) / 100)) ms / $((R[p99_us] / 1000)).$(((R[p99_us] % 1000) / 100)) ms / $((R[max_us] / 1000)) ms | | |
| levee RSS: start / after warm-up (${WARMUP_SECONDS} s) / end | $((START_RSS / 1024)) / $((WARM_RSS / 1024)) / $((END_RSS / 1024)) MiB | end ≤ warm-up + 10% + 2 MiB | $(verdict "$rss_ok") |
| Redis keys, most seen | $MAX_KEYS | ≤ $key_bound (TTL bound) | $(verdict $((MAX_KEYS <= key_bound))) |
| decisions made without Redis | $fallbacks | | |

## Samples

$SAMPLES
EOF
)
printf '%s\n' "$REPORT"
mkdir -p "$REPO/bench/results"
printf '%s\n' "$REPORT" >"$REPO/bench/results/soak-$(date -u +%Y-%m-%d-%H%M%S).md"
((other_status == 0 && socket_errors == 0 && rss_ok && MAX_KEYS <= key_bound))
