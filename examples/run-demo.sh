#!/usr/bin/env bash
# One-command demo of levee in front of the example forum (examples/forum).
#
#   bash examples/run-demo.sh          start everything, print the URLs, run until Ctrl-C
#   bash examples/run-demo.sh --check  start everything, run a short self-test, stop; exit 0/1
#
# What runs, all on free loopback ports, all files in one temp dir (removed on exit):
#
#   front nginx ─► levee ─► forum vhost (nginx) ─► php-fpm ─► files in the temp dir
#   (repo's        (this     (same nginx process,    (the PHP code from examples/forum/www)
#    nginx.conf)    policy)   second server block)
#                     │
#                     ├─► Redis (shared limits, switches, the notification queue)
#                     └─► AI stand-in (examples/forum/ai_standin.py), called by /ai_reply.php
#                         through levee's egress route
#
# Missing Debian packages (nginx, php-fpm, redis-server, redis-tools, curl, python3) are
# installed when run as root; nothing is started on the system's default ports and no system
# service is started by the install. levee is built with `cargo build --release` unless
# LEVEE_BIN names a binary to use. Every process started here is stopped by its own pid when
# the script exits, whether it ends normally, fails, or gets Ctrl-C.
#
# Environment:
#   LEVEE_BIN=path        use this levee binary instead of building target/release/levee
#   LEVEE_DEMO_KEEP=1     keep the temp dir (config, logs, data) after exit
#   LEVEE_LOG=filter      levee's log filter (default: info)

set -euo pipefail

usage() {
    sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'
}

CHECK=0
case "${1:-}" in
    "") ;;
    --check) CHECK=1 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
esac

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)   # examples/
REPO=$(cd "$HERE/.." && pwd)                          # the levee checkout
FORUM="$HERE/forum"
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"   # nginx and php-fpm live in sbin

IS_ROOT=0
[ "$(id -u)" -eq 0 ] && IS_ROOT=1

say() { printf '%s\n' "$*"; }
step() { printf '==> %s\n' "$*"; }
die() { printf 'run-demo: %s\n' "$*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

# ------------------------------------------------------------------------------------------
# Cleanup: stop every process we started (newest first) by pid, then remove the temp dir.

PIDS=()        # pids of the services we started
NAMES=()       # their names, same order
WORK=""        # the temp dir
MADE_POLICY_RC=0

# True while pid $1 runs (a zombie waiting to be reaped counts as stopped).
is_running() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != "Z" ]
}

cleanup() {
    local status=$? i pid deadline
    trap - EXIT INT TERM
    if [ "$MADE_POLICY_RC" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
    if [ "${#PIDS[@]}" -gt 0 ]; then
        step "stopping ${NAMES[*]}"
        # SIGTERM to all, newest first: nginx and php-fpm masters take their workers down,
        # levee drains and exits, Redis and the stand-in exit.
        for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
            kill -TERM "${PIDS[i]}" 2>/dev/null || true
        done
        # Give them 10 s in all, then SIGKILL whatever is left.
        deadline=$((SECONDS + 10))
        for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
            pid=${PIDS[i]}
            while is_running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
            if is_running "$pid"; then
                say "   ${NAMES[i]} (pid $pid) did not stop in time; killing it"
                kill -KILL "$pid" 2>/dev/null || true
            fi
            wait "$pid" 2>/dev/null || true
        done
    fi
    if [ -n "$WORK" ] && [ -d "$WORK" ]; then
        if [ "${LEVEE_DEMO_KEEP:-0}" = 1 ]; then
            say "kept $WORK (logs in $WORK/logs)"
        else
            rm -rf "$WORK"
        fi
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Starts a service in the background: start NAME LOGFILE COMMAND...
start() {
    local name=$1 log=$2
    shift 2
    "$@" >"$log" 2>&1 &
    PIDS+=("$!")
    NAMES+=("$name")
}

# Shows the end of a log, for errors.
show_log() {
    [ -f "$1" ] || return 0
    say "--- last lines of $1:"
    tail -n 20 "$1" | sed 's/^/    /'
}

# Polls until a command succeeds: wait_until SECONDS NAME LOGFILE COMMAND...
# Fails early if the service (the newest one started) has exited.
wait_until() {
    local limit=$1 name=$2 log=$3 pid=${PIDS[${#PIDS[@]} - 1]}
    shift 3
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if ! is_running "$pid"; then
            show_log "$log"
            die "$name exited during start-up"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            show_log "$log"
            die "$name did not answer within ${limit}s"
        fi
        sleep 0.1
    done
}

# curl to loopback only: never through a proxy from the environment, never hanging.
c() { curl -sS --noproxy '*' --max-time 20 "$@"; }

# ------------------------------------------------------------------------------------------
# 1. What the demo needs.

find_php_fpm() {
    if have php-fpm8.2; then command -v php-fpm8.2; return; fi
    local found
    found=$(compgen -c php-fpm | sort -V | tail -n 1)
    [ -n "$found" ] && command -v "$found"
}

need=()
have redis-server || need+=(redis-server)
have redis-cli || need+=(redis-tools)
have nginx || need+=(nginx)
find_php_fpm >/dev/null || need+=(php-fpm)
have curl || need+=(curl)
have python3 || need+=(python3)
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$IS_ROOT" != 1 ]; then
        die "missing: ${need[*]}. Install them (sudo apt-get install ${need[*]}) or run this as root."
    fi
    have apt-get || die "missing: ${need[*]}, and this is not a Debian-like system (no apt-get)"
    step "installing ${need[*]}"
    # A policy-rc.d that says "no" keeps the packages from starting the system's own nginx,
    # php-fpm and Redis on their default ports. Removed again on exit (see cleanup).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        MADE_POLICY_RC=1
    fi
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
    if [ "$MADE_POLICY_RC" = 1 ]; then rm -f /usr/sbin/policy-rc.d; MADE_POLICY_RC=0; fi
fi
PHP_FPM=$(find_php_fpm) || die "php-fpm is not installed"

# ------------------------------------------------------------------------------------------
# 2. levee itself.

if [ -n "${LEVEE_BIN:-}" ]; then
    LEVEE=$(command -v "$LEVEE_BIN") || die "LEVEE_BIN=$LEVEE_BIN is not an executable"
    LEVEE="$(cd "$(dirname "$LEVEE")" && pwd)/$(basename "$LEVEE")"   # absolute, for the hints below
elif have cargo; then
    step "building levee (cargo build --release; quick when nothing changed)"
    (cd "$REPO" && cargo build --release --quiet)
    LEVEE="$REPO/target/release/levee"
else
    LEVEE="$REPO/target/release/levee"
fi
[ -x "$LEVEE" ] || die "no levee binary at $LEVEE (install Rust, or set LEVEE_BIN)"

# ------------------------------------------------------------------------------------------
# 3. A temp dir with the site, the configs and the logs; free ports.

# php-fpm and nginx workers run as www-data when we are root: the dir must be reachable.
if [ "$IS_ROOT" = 1 ]; then
    WORK=$(mktemp -d /tmp/levee-demo.XXXXXX)
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/levee-demo.XXXXXX")
fi
chmod 755 "$WORK"
mkdir -p "$WORK/logs" "$WORK/data" "$WORK/redis" "$WORK/policies" "$WORK/nginx"
cp -R "$FORUM/www" "$WORK/www"
chmod -R a+rX "$WORK/www"
[ "$IS_ROOT" = 1 ] && chown www-data:www-data "$WORK/data"
LOGS="$WORK/logs"

# Seven distinct loopback ports that were free a moment ago (held together, then released).
read -r P_FRONT P_LEVEE P_ADMIN P_APP P_FPM P_REDIS P_AI < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(7)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
')

# The policy, with the default ports of examples/forum/policies/levee.toml replaced.
sed -e "s/127\.0\.0\.1:8080\b/127.0.0.1:$P_LEVEE/g" \
    -e "s/127\.0\.0\.1:9901\b/127.0.0.1:$P_ADMIN/g" \
    -e "s/127\.0\.0\.1:8081\b/127.0.0.1:$P_APP/g" \
    -e "s/127\.0\.0\.1:8090\b/127.0.0.1:$P_AI/g" \
    -e "s/127\.0\.0\.1:6379\b/127.0.0.1:$P_REDIS/g" \
    "$FORUM/policies/levee.toml" >"$WORK/policies/levee.toml"
"$LEVEE" check --policies "$WORK/policies" >"$LOGS/levee-check.log" 2>&1 ||
    { show_log "$LOGS/levee-check.log"; die "the example policy does not pass levee check"; }

# php-fpm: one pool of 8 workers (levee's max_inflight for `app` matches it). The site finds
# its data dir and levee's address (for the AI egress call) in its environment.
{
    echo "[global]"
    echo "pid = $WORK/php-fpm.pid"
    echo "error_log = $LOGS/php-fpm.log"
    echo "daemonize = no"
    echo
    echo "[forum]"
    if [ "$IS_ROOT" = 1 ]; then echo "user = www-data"; echo "group = www-data"; fi
    echo "listen = 127.0.0.1:$P_FPM"
    echo "pm = static"
    echo "pm.max_children = 8"
    echo "catch_workers_output = yes"
    echo "env[FORUM_DATA] = $WORK/data"
    echo "env[LEVEE_EGRESS] = 127.0.0.1:$P_LEVEE"
} >"$WORK/php-fpm.conf"

# nginx: the repository's nginx.conf as shipped (front server + backend vhost), with its
# placeholder ports and document root replaced and every file nginx writes moved into $WORK.
NGINX_SRC="$REPO/nginx.conf"
for placeholder in "listen 80;" "127.0.0.1:8080" "127.0.0.1:8081" "127.0.0.1:9000" "/var/www/forum" "http {"; do
    grep -qF "$placeholder" "$NGINX_SRC" || die "nginx.conf no longer contains '$placeholder'; update run-demo.sh"
done
{
    [ "$IS_ROOT" = 1 ] && echo "user www-data;"
    echo "pid $WORK/nginx.pid;"
    echo "error_log $LOGS/nginx-error.log warn;"
    sed -e "s|listen 80;|listen 127.0.0.1:$P_FRONT;|" \
        -e "s|listen \[::\]:80;||" \
        -e "s|127\.0\.0\.1:8080\b|127.0.0.1:$P_LEVEE|g" \
        -e "s|127\.0\.0\.1:8081\b|127.0.0.1:$P_APP|g" \
        -e "s|127\.0\.0\.1:9000\b|127.0.0.1:$P_FPM|g" \
        -e "s|/var/www/forum|$WORK/www|g" \
        -e "s|^http {|http {\n    access_log $LOGS/nginx-access.log;\n    client_body_temp_path $WORK/nginx/client_body;\n    proxy_temp_path $WORK/nginx/proxy;\n    fastcgi_temp_path $WORK/nginx/fastcgi;\n    uwsgi_temp_path $WORK/nginx/uwsgi;\n    scgi_temp_path $WORK/nginx/scgi;|" \
        "$NGINX_SRC"
} >"$WORK/nginx.conf"
if grep -qE 'listen 80;|:80;|127\.0\.0\.1:(8080|8081|9000)\b' "$WORK/nginx.conf"; then
    die "a placeholder port was left in $WORK/nginx.conf"
fi
NGINX_ARGS=(-c "$WORK/nginx.conf" -p "$WORK/nginx" -e "$LOGS/nginx-error.log")
nginx -t -q "${NGINX_ARGS[@]}" -g 'daemon off;' >"$LOGS/nginx-t.log" 2>&1 ||
    { show_log "$LOGS/nginx-t.log"; die "nginx -t refused the generated config"; }

# ------------------------------------------------------------------------------------------
# 4. Start everything, each waited for until it answers.

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

step "starting redis-server on 127.0.0.1:$P_REDIS"
start redis "$LOGS/redis.log" redis-server --bind 127.0.0.1 --port "$P_REDIS" \
    --save "" --appendonly no --dir "$WORK/redis" --daemonize no
wait_until 15 redis-server "$LOGS/redis.log" sh -c "redis-cli -h 127.0.0.1 -p $P_REDIS ping | grep -q PONG"

step "starting php-fpm ($(basename "$PHP_FPM")) on 127.0.0.1:$P_FPM"
start php-fpm "$LOGS/php-fpm.out" "$PHP_FPM" -F -y "$WORK/php-fpm.conf"
wait_until 15 php-fpm "$LOGS/php-fpm.log" port_open "$P_FPM"

step "starting the AI stand-in on 127.0.0.1:$P_AI"
start ai-standin "$LOGS/ai-standin.log" python3 "$FORUM/ai_standin.py" --port "$P_AI"
wait_until 15 "the AI stand-in" "$LOGS/ai-standin.log" c -f "http://127.0.0.1:$P_AI/control"

step "starting levee on 127.0.0.1:$P_LEVEE (admin 127.0.0.1:$P_ADMIN)"
export LEVEE_LOG=${LEVEE_LOG:-info}
export NO_COLOR=1   # plain text in the log file
start levee "$LOGS/levee.log" "$LEVEE" run --policies "$WORK/policies"
LEVEE_PID=${PIDS[${#PIDS[@]} - 1]}
wait_until 30 levee "$LOGS/levee.log" c -f "http://127.0.0.1:$P_LEVEE/readyz"

step "starting nginx: front on 127.0.0.1:$P_FRONT, forum vhost on 127.0.0.1:$P_APP"
start nginx "$LOGS/nginx.out" nginx "${NGINX_ARGS[@]}" -g 'daemon off;'
wait_until 15 "the forum vhost" "$LOGS/nginx-error.log" c -f "http://127.0.0.1:$P_APP/index.php"
wait_until 15 "the front nginx" "$LOGS/nginx-error.log" c -f "http://127.0.0.1:$P_FRONT/"

SITE="http://127.0.0.1:$P_FRONT"
ADMIN="http://127.0.0.1:$P_ADMIN"
AI="http://127.0.0.1:$P_AI"

# ------------------------------------------------------------------------------------------
# 5a. --check: a short self-test through the front nginx, then stop.

# Prints one field of JSON read on stdin: json_field PYTHON_EXPRESSION_ON_d
json_field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

if [ "$CHECK" = 1 ]; then
    FAILED=0
    pass() { say "  ok    $*"; }
    fail() { say "  FAIL  $*"; FAILED=1; }
    step "self-test"

    # Homepage through the front nginx and levee, with both module blocks.
    home=$(c -w '\n%{http_code}' "$SITE/") || home=""
    if [ "${home##*$'\n'}" = 200 ] && grep -q 'id="ranking"' <<<"$home" &&
        grep -q 'data-module="visitors"' <<<"$home"; then
        pass "homepage 200 through the front nginx, ranking and visitors blocks shown"
    else
        fail "homepage: expected 200 with both blocks, got: $(tail -c 300 <<<"$home")"
    fi
    counted=$(c "$ADMIN/metrics" | grep -c '^levee_requests_total{route="home",status="200"}' || true)
    if [ "$counted" -ge 1 ]; then pass "levee counted it (route home)"; else fail "levee did not see the homepage request"; fi

    # A good copy of the ranking page, then the ranking module off.
    code=$(c -o /dev/null -w '%{http_code}' "$SITE/ranking.php" || true)
    [ "$code" = 200 ] && pass "ranking page 200" || fail "ranking page: $code"
    code=$(c -o /dev/null -w '%{http_code}' -X POST -H 'X-Levee-Operator: run-demo' -d off "$ADMIN/modules/ranking" || true)
    [ "$code" = 200 ] && pass "admin: ranking module switched off" || fail "admin POST /modules/ranking: $code"
    home=$(c -w '\n%{http_code}' "$SITE/") || home=""
    if [ "${home##*$'\n'}" = 200 ] && ! grep -q 'id="ranking"' <<<"$home" &&
        grep -q 'data-module="visitors"' <<<"$home"; then
        pass "homepage 200 with the ranking block hidden, visitors still shown"
    else
        fail "homepage with ranking off: $(tail -c 300 <<<"$home")"
    fi
    stale=$(c -D - -o /dev/null "$SITE/ranking.php" | tr -d '\r' | grep -i '^x-levee-stale:' || true)
    [ -n "$stale" ] && pass "ranking page served from levee's last good copy ($stale)" ||
        fail "ranking page with ranking off: no X-Levee-Stale header"
    c -o /dev/null -X POST -d policy "$ADMIN/modules/ranking" || true

    # Notifications: queued while the module is off, applied with Idempotency-Key when back on.
    c -o /dev/null -X POST -H 'X-Levee-Operator: run-demo' -d off "$ADMIN/modules/notifications" || true
    job=$(c -D - -o /dev/null -d 'to=bob&message=alice+replied' "$SITE/notify.php" | tr -d '\r' |
        sed -n 's/^[Xx]-[Ll]evee-[Jj]ob: *//p' || true)
    if [ -n "$job" ]; then pass "notification accepted and queued while off (job $job)"; else fail "notification was not queued"; fi
    c -o /dev/null -X POST -d policy "$ADMIN/modules/notifications" || true
    deadline=$((SECONDS + 15))
    until c "$SITE/notify.php" | grep -qF "\"idempotency_key\":\"$job\"" || [ "$SECONDS" -ge "$deadline" ]; do sleep 0.2; done
    if [ -n "$job" ] && c "$SITE/notify.php" | grep -qF "\"idempotency_key\":\"$job\""; then
        pass "queued notification applied by PHP once the module was back on"
    else
        fail "queued notification not applied within 15 s"
    fi

    # The AI reply: real answer first, then the stand-in fails and levee's breaker answers.
    reply=$(c "$SITE/ai_reply.php?q=hello" || true)
    grep -q '"degraded":false' <<<"$reply" && pass "AI reply through levee's egress route: $reply" ||
        fail "AI reply: $reply"
    c -o /dev/null -d fail "$AI/control" || true
    deadline=$((SECONDS + 20))
    until grep -q '"upstream_status":200' <<<"$reply" && grep -q '"degraded":true' <<<"$reply" ||
        [ "$SECONDS" -ge "$deadline" ]; do
        sleep 0.2
        reply=$(c "$SITE/ai_reply.php?q=hello" || true)
    done
    state=$(c "$ADMIN/status" | json_field '[u["breaker"]["state"] for u in d["upstreams"] if u["name"] == "ai"][0]' || true)
    if grep -q '"upstream_status":200' <<<"$reply" && grep -q '"degraded":true' <<<"$reply" && [ "$state" = open ]; then
        pass "AI stand-in failing: breaker $state, PHP got levee's fallback: $reply"
    else
        fail "AI fallback: breaker '$state', last reply: $reply"
    fi
    c -o /dev/null -d ok "$AI/control" || true

    # Per-IP login limit: 10 at once, the 11th is refused.
    codes=()
    for _ in $(seq 11); do codes+=("$(c -o /dev/null -w '%{http_code}' -d user=demo "$SITE/login.php" || true)"); done
    if [ "${codes[10]}" = 429 ] && [[ " ${codes[*]:0:10} " != *" 429 "* ]]; then
        pass "per-IP login limit: ${codes[*]}"
    else
        fail "per-IP login limit: expected 429 on the 11th attempt only, got ${codes[*]}"
    fi

    if [ "$FAILED" = 0 ]; then
        say "self-test passed"
        exit 0
    fi
    for log in levee.log nginx-error.log php-fpm.log ai-standin.log redis.log; do show_log "$LOGS/$log"; done
    say "self-test FAILED"
    exit 1
fi

# ------------------------------------------------------------------------------------------
# 5b. Interactive: print where everything is, then run until Ctrl-C.

cat <<EOF

levee demo is running.

  Site (front nginx)   $SITE/
  levee (direct)       http://127.0.0.1:$P_LEVEE/
  Dashboard (admin)    $ADMIN/        (API: GET /status /metrics /queues; POST /level /modules/NAME /breakers/NAME /reload)
  Status               $ADMIN/status
  Metrics              $ADMIN/metrics
  AI stand-in          $AI/control    (POST ok | slow | fail)
  Policy in use        $WORK/policies/levee.toml   (edit and save: levee reloads it)
  Logs                 $LOGS/

Things to try:

  # Switch the ranking off: its block disappears from the homepage, /ranking.php is served stale
  curl -s -X POST -H 'X-Levee-Operator: you' -d off $ADMIN/modules/ranking
  curl -s $SITE/ | grep -c 'id="ranking"'
  curl -si $SITE/ranking.php | grep -i x-levee-stale
  curl -s -X POST -d policy $ADMIN/modules/ranking

  # Make the AI API fail (or slow): after 3 failures levee answers PHP with its JSON fallback
  curl -s -d fail $AI/control
  for i in 1 2 3 4 5; do curl -s '$SITE/ai_reply.php?q=hi'; done
  curl -s -d ok $AI/control

  # Queue notifications while they are off; they are applied when switched back on
  curl -s -X POST -d off $ADMIN/modules/notifications
  curl -si -d 'to=bob&message=hi' $SITE/notify.php
  curl -s -X POST -d policy $ADMIN/modules/notifications
  curl -s $SITE/notify.php

  # Degrade the whole site one level (tier 3 off), see it in the status, hand it back
  curl -s -X POST -d 1 $ADMIN/level
  $LEVEE status --admin 127.0.0.1:$P_ADMIN
  curl -s -X POST -d policy $ADMIN/level

  # Rate limits: the 11th login attempt from one IP gets 429
  for i in \$(seq 12); do curl -s -o /dev/null -w '%{http_code} ' -d user=me $SITE/login.php; done; echo

  # Fail open: stop levee and the front nginx answers through its backup server
  kill -TERM $LEVEE_PID
  curl -s -o /dev/null -w '%{http_code}\n' $SITE/

Ctrl-C stops everything.
EOF

# Run until Ctrl-C (the INT trap exits and cleanup stops everything). If levee stops, the demo
# goes on without it (the front nginx fails open to the PHP vhost); if anything else stops, the
# demo ends.
REPORTED=" "
while true; do
    wait -n || true
    for i in "${!PIDS[@]}"; do
        if ! is_running "${PIDS[i]}" && [[ "$REPORTED" != *" ${PIDS[i]} "* ]]; then
            REPORTED+="${PIDS[i]} "
            if [ "${NAMES[i]}" = levee ]; then
                say "levee (pid ${PIDS[i]}) exited: the front nginx now sends requests straight to the PHP vhost. Ctrl-C stops the rest."
            else
                say "${NAMES[i]} (pid ${PIDS[i]}) exited; stopping the demo (logs in $LOGS)"
                LEVEE_DEMO_KEEP=1
                exit 1
            fi
        fi
    done
done
