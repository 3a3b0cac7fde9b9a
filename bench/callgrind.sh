#!/usr/bin/env bash
# bench/callgrind.sh: instructions levee executes per request, counted by valgrind's callgrind.
#
# Wall-clock benchmarks on a small shared machine move by ±10% from run to run; an instruction
# count does not, so it tells whether a change made levee's own work cheaper. It leaves out
# the kernel (most of a pass-through request's time) and what instructions cost (cache misses,
# a `rep movsb` copy counts one instruction per byte), so it complements bench/run.sh and
# never replaces it.
#
#   bench/callgrind.sh                 every case below
#   CASES="hide" bench/callgrind.sh    some of them
#
# Cases: pass (the 1 KiB answer passed through), page (the 50 KiB page passed through), hide
# (the page with #ranking removed), full (run.sh's case 5c, the full policy: the request matches
# the last of 50 routes, two Redis limit rules, a breaker and a bulkhead; with its own Redis);
# and, as yardsticks for pass, nginx (proxy_pass with
# upstream keep-alive) and haproxy (http mode, keep-alive), configured as in bench/run.sh, one
# worker each. Each runs its proxy under callgrind behind a backend nginx, sends WARMUP (3)
# seconds of wrk load, zeroes the counters, sends DURATION (10) seconds of load (wrk -c 4),
# dumps the counters and divides by the requests wrk completed. Prints a Markdown table (with
# pass against nginx and haproxy when they ran), and the TOP (8) functions with the most
# instructions of their own per request.
#
# CACHE=1 also simulates the first-level caches (valgrind's `--cache-sim=yes`, sized like this
# machine's) and adds each case's misses per request: instruction fetches, data reads and data
# writes that missed. Two proxies with the same instructions can differ there: memory touched
# once per request (a block an allocator hands out cold, a value copied into fresh memory)
# costs a miss for each 64-byte line, which the instruction count does not show. The run is
# some 2x slower.
#
# KEEP=DIR copies each case's callgrind dump to DIR/CASE.callgrind, for callgrind_annotate
# --inclusive=yes (who calls what) after the run.
#
# Needs: valgrind, nginx, wrk, python3 (and haproxy, redis-server for their cases).
# LEVEE_BIN [target/release/levee].
set -euo pipefail
cd "$(dirname "$0")/.."

LIB=bench/lib
CASES=${CASES:-"pass page hide full nginx haproxy"}
WARMUP=${WARMUP:-3}
MEASURED_SECONDS=${DURATION:-10}
TOP=${TOP:-8}
LEVEE_BIN=${LEVEE_BIN:-target/release/levee}
CALLGRIND_OPTIONS=""
[ "${CACHE:-0}" = 0 ] || CALLGRIND_OPTIONS="--cache-sim=yes"

tools="valgrind callgrind_control nginx wrk python3"
case " $CASES " in *" haproxy "*) tools="$tools haproxy" ;; esac
case " $CASES " in *" full "*) tools="$tools redis-server" ;; esac
for tool in $tools; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] ||
    { echo "callgrind.sh: $tool is not installed (apt-get install valgrind nginx wrk python3 haproxy)" >&2; exit 1; }
done
HAPROXY=$(command -v haproxy || echo /usr/sbin/haproxy)
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$LEVEE_BIN" ] || cargo build --release --quiet

TMP=$(mktemp -d)
chmod 755 "$TMP"
NGINX_STARTED=""
REDIS_PID=""
cleanup() {
  [ -z "$NGINX_STARTED" ] || "$NGINX" -c "$TMP/backend.conf" -p "$TMP" -s stop 2>/dev/null || true
  [ -z "$REDIS_PID" ] || { kill "$REDIS_PID" 2>/dev/null; wait "$REDIS_PID" 2>/dev/null; } || true
  [ -n "${KEEP_TMP:-}" ] || rm -rf "$TMP"
}
trap cleanup EXIT

mapfile -t PORTS < <(python3 "$LIB/free_ports.py" 4)
BACKEND_PORT=${PORTS[0]}
PORT=${PORTS[1]}
ADMIN_PORT=${PORTS[2]}
REDIS_PORT=${PORTS[3]}

mkdir -p "$TMP/www"
python3 "$LIB/make_page.py" "$TMP/www/page.html" 51200
BODY_1K=$(printf 'x%.0s' $(seq 1 1024))
sed -e "s#@WORKERS@#1#; s#@DIR@#$TMP#g; s#@PORT@#$BACKEND_PORT#; s#@BODY_1K@#$BODY_1K#" \
  bench/conf/backend-nginx.conf.tmpl > "$TMP/backend.conf"
"$NGINX" -c "$TMP/backend.conf" -p "$TMP" 2>/dev/null
NGINX_STARTED=1

# shellcheck source=lib/filler_routes.sh
source "$LIB/filler_routes.sh" # filler_routes N

# policy TEMPLATE DIR: renders one of run.sh's policy templates with run.sh's values (50 routes).
policy() {
  local template=$1 dir=$2 text
  mkdir -p "$dir"
  text=$(<"bench/policies/$template")
  text=${text//@PORT@/$PORT}
  text=${text//@ADMIN_PORT@/$ADMIN_PORT}
  text=${text//@BACKEND_PORT@/$BACKEND_PORT}
  text=${text//@REDIS_PORT@/$REDIS_PORT}
  text=${text//@STAMP@/0}
  text=${text//@RESPONSE_TIMEOUT@/30s}
  text=${text//@FILLER_ROUTES@/"$(filler_routes 49)"} # quoted: taken as it is
  if [[ $text =~ @[A-Z0-9_]+@ ]]; then
    echo "callgrind.sh: $template: placeholder ${BASH_REMATCH[0]} was not filled" >&2
    exit 1
  fi
  printf '%s\n' "$text" > "$dir/levee.toml"
}

# The full policy's Redis: no persistence, on a free port, stopped with the backend.
start_redis() {
  mkdir -p "$TMP/redis"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$TMP/redis" >"$TMP/redis/redis.log" 2>&1 &
  REDIS_PID=$!
  for _ in $(seq 1 50); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "callgrind.sh: redis-server did not start (see below)" >&2
  cat "$TMP/redis/redis.log" >&2
  exit 1
}

# The command that runs case NAME's proxy (in the foreground, one worker), rendered into $TMP.
proxy_command() {
  local name=$1
  case $name in
    pass | page) policy passthrough.toml.tmpl "$TMP/policy-$name" ;;
    hide) policy hide.toml.tmpl "$TMP/policy-$name" ;;
    full) policy full.toml.tmpl "$TMP/policy-$name" ;;
  esac
  case $name in
    nginx)
      # run.sh's case 2, with no master process: callgrind then follows the one worker.
      mkdir -p "$TMP/nginx"
      sed -e "s#@DIR@#$TMP/nginx#g; s#@PORT@#$PORT#; s#@BACKEND_PORT@#$BACKEND_PORT#" \
        bench/conf/proxy-nginx.conf.tmpl > "$TMP/nginx/nginx.conf"
      printf 'master_process off;\ndaemon off;\n' >> "$TMP/nginx/nginx.conf"
      echo "$NGINX -c $TMP/nginx/nginx.conf -p $TMP/nginx/ -e $TMP/nginx/error.log"
      ;;
    haproxy)
      sed -e "s#@PORT@#$PORT#; s#@BACKEND_PORT@#$BACKEND_PORT#" bench/conf/haproxy.cfg.tmpl > "$TMP/haproxy.cfg"
      echo "$HAPROXY -f $TMP/haproxy.cfg -db"
      ;;
    *) echo "$LEVEE_BIN run --policies $TMP/policy-$name --threads 1" ;;
  esac
}

# measure NAME PATH: prints one table row; the profile stays in $TMP/NAME.out.
measure() {
  local name=$1 path=$2 command
  command=$(proxy_command "$name")
  # shellcheck disable=SC2086 # the command is words without spaces in them
  valgrind --tool=callgrind $CALLGRIND_OPTIONS --callgrind-out-file="$TMP/$name.out" $command >"$TMP/$name.log" 2>&1 &
  local pid=$!
  local url="http://127.0.0.1:$PORT$path"
  for _ in $(seq 1 200); do
    curl -s -o /dev/null "$url" && break
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "callgrind.sh: case $name: the proxy exited:" >&2
      grep -v '^==' "$TMP/$name.log" >&2
      exit 1
    fi
    sleep 0.2
  done
  wrk -t1 -c4 -d"${WARMUP}s" "$url" >/dev/null
  callgrind_control -z "$pid" >/dev/null 2>&1
  wrk -t1 -c4 -d"${MEASURED_SECONDS}s" "$url" >"$TMP/$name.wrk"
  callgrind_control -d "$pid" >/dev/null 2>&1
  if [ "$name" = full ]; then
    # Under valgrind levee is some 50x slower: say when decisions missed Redis's timeout.
    curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" | awk '
      /^levee_ratelimit_decisions_total[{]/ {
        match($0, /source="[^"]*"/); by[substr($0, RSTART + 8, RLENGTH - 9)] += $NF }
      END { for (s in by) printf "%s%s %d", (n++ ? ", " : "full: rate-limit decisions by source since start: "), s, by[s]
            if (n) print "" }' > "$TMP/full.note" || true
  fi
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  local requests
  requests=$(grep -oE '^ +[0-9]+ requests' "$TMP/$name.wrk" | grep -oE '[0-9]+')
  local dump
  dump=$(ls -t "$TMP/$name.out".* | head -1)
  python3 "$LIB/callgrind_per_request.py" "$dump" "$requests" "$name" "$TOP" "$TMP/$name.top" \
    | tee "$TMP/$name.row"
  if [ -n "${KEEP:-}" ]; then
    mkdir -p "$KEEP"
    cp "$dump" "$KEEP/$name.callgrind"
  fi
}

echo "# levee instructions per request (callgrind), $(date -u '+%Y-%m-%d %H:%M') UTC"
echo
echo "levee $("$LEVEE_BIN" --version 2>/dev/null | head -1) (git $(git rev-parse --short HEAD 2>/dev/null || echo '?')), one worker thread, wrk -c 4 for ${MEASURED_SECONDS} s after ${WARMUP} s of warm-up"
echo
if [ -n "$CALLGRIND_OPTIONS" ]; then
  echo "| case | requests | instructions / request | L1 instruction misses | L1 data read misses | L1 data write misses |"
  echo "|---|---:|---:|---:|---:|---:|"
else
  echo "| case | requests | instructions / request |"
  echo "|---|---:|---:|"
fi
# pass, nginx, haproxy and full send the same request (REQUEST_PATH), so that full against
# pass is the full policy's cost and not also that of a longer path.
REQUEST_PATH=/shop/cart.php
for case in $CASES; do
  case $case in
    pass | nginx | haproxy) measure "$case" "$REQUEST_PATH" ;;
    page | hide) measure "$case" /page.html ;;
    full)
      [ -n "$REDIS_PID" ] || start_redis
      measure full "$REQUEST_PATH"
      ;;
    *) echo "callgrind.sh: unknown case $case (pass, page, hide, full, nginx, haproxy)" >&2; exit 1 ;;
  esac
done
per_request() { # NAME: the instructions per request of a case that ran
  [ -f "$TMP/$1.row" ] && awk -F'|' '{ gsub(/[ ,]/, "", $4); print $4 }' "$TMP/$1.row"
}
blank=echo
for peer in nginx haproxy; do
  if levee=$(per_request pass) && other=$(per_request "$peer"); then
    $blank && blank=true
    awk -v l="$levee" -v o="$other" -v p="$peer" \
      'BEGIN { printf "levee pass-through executes %.2fx the instructions per request of %s\n", l / o, p }'
  fi
done
[ ! -s "$TMP/full.note" ] || { echo; cat "$TMP/full.note"; }
if [ "$TOP" -gt 0 ]; then
  echo
  for case in $CASES; do
    [ -f "$TMP/$case.top" ] && cat "$TMP/$case.top"
  done
fi
