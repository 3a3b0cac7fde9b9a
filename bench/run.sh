#!/usr/bin/env bash
# bench/run.sh: levee's benchmark harness.
#
# Puts levee, nginx and HAProxy in front of the same nginx backend on this machine, over
# loopback, and drives each with the same wrk load. Every proxy gets the same CPU budget
# (one worker/thread pinned to PROXY_CPUS); wrk, the backend and Redis share the other
# core(s), so the proxy alone owns its core and the backend's cost is identical in every case.
# The fastcgi section puts nginx (fastcgi_pass) and levee (a fastcgi:// upstream) in front of
# one php-fpm pool instead, pinned where the backend is, under the same load and CPU budget.
#
#   bench/run.sh            full run: DURATION s per round (default 10), ROUNDS rounds (3), median
#   bench/run.sh --smoke    every case ~2 s, 1 round; exit status 1 only when something is broken
#                           (a proxy did not start, a case had errors), never for a speed target
#
# The Markdown report goes to stdout and to bench/results/<date>-<time>.md (gitignored);
# progress goes to stderr. Everything runs in a mktemp -d directory that is removed on exit
# (KEEP_TMP=1 keeps it, with every config, log and raw wrk output).
#
# Settings (environment variables, defaults in brackets):
#   DURATION [10]  ROUNDS [3]  WARMUP [2] seconds of unmeasured load before each case
#   CONNECTIONS [64]  WRK_THREADS [1]
#   PROXY_CPUS [0]  LOAD_CPUS [1]  BACKEND_CPUS [1]   taskset core lists
#   BACKEND_WORKERS [1]  ROUTES [50]  RELOAD_ROUTES [500]  RELOAD_SAMPLES [9]  RELOADS [20]
#   IDLE_CONNS [5000]  LEVEE_BIN [target/release/levee, built when missing or stale]
#   LATENCY_CONNECTIONS [8]  PACE_MS [1]  the limiter-latency section's moderate load: that many
#        wrk connections, each pausing PACE_MS after every answer (lib/paced.lua)
#   EVALSHA_REQUESTS [sized to DURATION]  requests per redis-benchmark round (limiter-rate)
#   PAIR_RUNS [6]  PAIR_DURATION [5]  the paired runs behind the req/s targets: each pair of
#        cases a target compares (4/2, 4/3, 5c/4, 6/8b) runs back to back that many times, for
#        that many seconds each, and the target is the median of the per-pair ratios
#   FPM_CHILDREN [CONNECTIONS + 2 × 32 = 128]  the fastcgi section's php-fpm pool (pm = static):
#        a kept FastCGI connection holds one child until the proxy closes it, so the pool covers
#        the proxy under load plus the 32 connections each of the two idle keeping ones holds;
#        fewer children leave requests waiting for a child that never comes free
#   PHP_FPM [php-fpm8.2]  the fastcgi section is skipped, and says so, when it is missing
#   BUDGET_PCT [40]  BUDGET_PERIOD_US [10000]  the budget section holds each proxy of the pass-through
#        targets to BUDGET_PCT% of one core (a cgroup CPU quota per BUDGET_PERIOD_US), so that the
#        proxy and not the load core sets the pace; skipped, and says so, without a writable
#        cgroup cpu controller (root, cgroup v1's cpu or v2's cpu.max)
#   ONLY ["" = everything]  space-separated case ids and/or sections to run, e.g. ONLY="4 5b reload"
#        (sections: pairs, idle, conns, reload, reload-load, limiter-rate, limiter-latency, queue,
#        fastcgi, budget)
#
# Slots: a levee case that needs a policy feature (slot_case) runs only when `levee check`
# accepts its policy template; otherwise the report says "not yet available" with levee's
# reason. A future feature's case can be added before the feature exists.

set -euo pipefail
shopt -u patsub_replacement 2>/dev/null || true # `&` in template values stays literal
export LC_ALL=C                                  # '.' decimal point in EPOCHREALTIME and awk
export PATH="$PATH:/usr/sbin:/sbin"              # nginx and haproxy live in /usr/sbin

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$BENCH_DIR/.." && pwd)
CONF=$BENCH_DIR/conf
POLICIES=$BENCH_DIR/policies
LIB=$BENCH_DIR/lib

log() { printf '[bench %3ds] %s\n' "$SECONDS" "$*" >&2; }
warn() { printf '[bench] WARNING: %s\n' "$*" >&2; }
die() {
	printf '[bench] ERROR: %s\n' "$*" >&2
	exit 2
}

# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
MODE=full
case ${1:-} in
--smoke) MODE=smoke ;;
"") ;;
-h | --help)
	sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
	exit 0
	;;
*) die "unknown argument '$1' (use --smoke or --help)" ;;
esac

SUFFIX=
if [[ $MODE == smoke ]]; then
	SUFFIX=-smoke
	DURATION=2 ROUNDS=1 WARMUP=1 RELOAD_SAMPLES=3 PAIR_RUNS=1 PAIR_DURATION=1
else
	DURATION=${DURATION:-10} ROUNDS=${ROUNDS:-3} WARMUP=${WARMUP:-2} RELOAD_SAMPLES=${RELOAD_SAMPLES:-9}
	PAIR_RUNS=${PAIR_RUNS:-6} PAIR_DURATION=${PAIR_DURATION:-5}
fi
CONNECTIONS=${CONNECTIONS:-64}
# The fastcgi section's php-fpm pool. A kept FastCGI connection holds its php-fpm child until
# the proxy closes it, and the section's proxies stay up side by side: the one under load opens
# up to CONNECTIONS, while the two that keep connections (nginx keepalive 32, levee
# pool_max_idle = 32) hold up to 32 each, idle. A request sent on a connection no child is
# free to take waits until one is (with nginx, until wrk gives up on it).
FPM_CHILDREN=${FPM_CHILDREN:-$((CONNECTIONS + 2 * (CONNECTIONS < 32 ? CONNECTIONS : 32)))}
PHP_FPM=${PHP_FPM:-php-fpm8.2}
BUDGET_PCT=${BUDGET_PCT:-40}
BUDGET_PERIOD_US=${BUDGET_PERIOD_US:-10000}
WRK_THREADS=${WRK_THREADS:-1}
PROXY_CPUS=${PROXY_CPUS:-0}
LOAD_CPUS=${LOAD_CPUS:-1}
BACKEND_CPUS=${BACKEND_CPUS:-1}
BACKEND_WORKERS=${BACKEND_WORKERS:-1}
ROUTES=${ROUTES:-50}
# What every 1 KiB case asks for: the path the full policy's last route matches, so that the
# full policy against pass-through is the policy's cost alone, not also a longer path's.
REQUEST_PATH=/shop/cart.php
RELOAD_ROUTES=${RELOAD_ROUTES:-500}
RELOADS=${RELOADS:-20}
IDLE_CONNS=${IDLE_CONNS:-5000}
LATENCY_CONNECTIONS=${LATENCY_CONNECTIONS:-8}
export PACE_MS=${PACE_MS:-1}
PACE_MS_PACED=$PACE_MS
EVALSHA_REQUESTS=${EVALSHA_REQUESTS:-}
KEEP_TMP=${KEEP_TMP:-0}
ONLY=${ONLY:-}
wanted() { [[ -z $ONLY || " $ONLY " == *" $1 "* ]]; } # ID: selected by ONLY?
LEVEE=${LEVEE_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/levee}
# levee's limiter driven directly (bench/limiter_bench.rs), for the limiter-rate section.
LIMITER_BENCH=${LIMITER_BENCH_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/examples/limiter-bench}

# Targets (PASS/FAIL lines; informational, they never change the exit status).
TARGET_VS_NGINX=1.1 TARGET_VS_HAPROXY=1.0 TARGET_IDLE_MIB=20 TARGET_CONNS_MIB=60
TARGET_DECISIONS_VS_REDIS=0.7 TARGET_ADDED_P99_MS=1
TARGET_FULL_VS_PASS=0.85 TARGET_HIDE_VS_PASS=0.7
NOISE_PCT=${NOISE_PCT:-10} # warn when more than this share of the proxy core was busy with other work

# ---------------------------------------------------------------------------------------------
# Dependencies: Debian packages (installed only when missing, only as root) and the levee build
# ---------------------------------------------------------------------------------------------
ensure_packages() {
	local -a missing=()
	local pair
	for pair in nginx:nginx haproxy:haproxy wrk:wrk redis-server:redis-server redis-cli:redis-tools redis-benchmark:redis-tools; do
		command -v "${pair%%:*}" >/dev/null || [[ " ${missing[*]} " == *" ${pair#*:} "* ]] || missing+=("${pair#*:}")
	done
	if ((${#missing[@]})); then
		((EUID == 0)) || die "missing packages: ${missing[*]}; install them or run as root"
		log "installing ${missing[*]}"
		# No init system here, but keep package scripts from starting the system nginx, HAProxy
		# or Redis on their default ports: a policy-rc.d that says "no" for the install only.
		local policy_rc=/usr/sbin/policy-rc.d own_policy_rc=0
		if [[ ! -e $policy_rc ]]; then
			printf '#!/bin/sh\nexit 101\n' >"$policy_rc" && chmod 755 "$policy_rc" && own_policy_rc=1
		fi
		apt-get update -q >&2
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2 ||
			{ ((own_policy_rc)) && rm -f "$policy_rc"; die "apt-get install failed"; }
		((own_policy_rc)) && rm -f "$policy_rc"
	fi
	local tool
	for tool in python3 curl taskset timeout getconf; do
		command -v "$tool" >/dev/null || die "$tool is required"
	done
}

ensure_levee() {
	if [[ -n ${LEVEE_BIN:-} ]]; then
		[[ -x $LEVEE ]] || die "LEVEE_BIN=$LEVEE is not executable"
	elif [[ ! -x $LEVEE ]] ||
		[[ -n $(find "$REPO/src" "$REPO/Cargo.toml" "$REPO/Cargo.lock" -newer "$LEVEE" -print -quit 2>/dev/null) ]]; then
		log "building levee (cargo build --release)"
		(cd "$REPO" && cargo build --release) >&2 || die "cargo build --release failed"
	fi
	# The limiter-rate section measures the library's limiter (a plain release build of the
	# example) whichever levee binary the proxy cases run.
	if [[ -z ${LIMITER_BENCH_BIN:-} ]] && { [[ ! -x $LIMITER_BENCH ]] ||
		[[ -n $(find "$REPO/src" "$REPO/bench/limiter_bench.rs" "$REPO/Cargo.lock" -newer "$LIMITER_BENCH" -print -quit 2>/dev/null) ]]; }; then
		log "building the limiter driver (cargo build --release --example limiter-bench)"
		(cd "$REPO" && cargo build --release --example limiter-bench) >&2 ||
			warn "cargo build --release --example limiter-bench failed: the limiter-rate section runs without it"
	fi
}

check_cpus() {
	local list
	for list in "$PROXY_CPUS" "$LOAD_CPUS" "$BACKEND_CPUS"; do
		taskset -c "$list" true 2>/dev/null || die "cannot pin to CPU list '$list' (see PROXY_CPUS, LOAD_CPUS, BACKEND_CPUS)"
	done
}

# ---------------------------------------------------------------------------------------------
# Processes: every one we start is tracked by pid and stopped by that pid on exit
# ---------------------------------------------------------------------------------------------
declare -A RUNNING=() # pid -> name

now_us() { echo "${EPOCHREALTIME/./}"; }

alive() { # PID: running and not a zombie
	local line state
	{ read -r line <"/proc/$1/stat"; } 2>/dev/null || return 1
	state=${line##*) }
	[[ ${state%% *} != Z ]]
}

stop_pid() { # PID: SIGTERM, wait up to 10 s, then SIGKILL; reaps it when it is our child
	local pid=$1 deadline
	deadline=$(($(now_us) + 10000000))
	kill -TERM "$pid" 2>/dev/null || true
	while alive "$pid"; do
		if (($(now_us) > deadline)); then
			warn "${RUNNING[$pid]:-pid $pid} ignored SIGTERM; killing it"
			kill -KILL "$pid" 2>/dev/null || true
			break
		fi
		sleep 0.05
	done
	wait "$pid" 2>/dev/null || true
	unset "RUNNING[$pid]"
}

cleanup() {
	local rc=$? pid
	trap - EXIT INT TERM
	[[ ${#CGROUPS[@]} -eq 0 ]] || cgroup_release
	for pid in "${!RUNNING[@]}"; do stop_pid "$pid"; done
	if [[ -n ${TMP:-} && -d $TMP ]]; then
		if [[ $KEEP_TMP == 1 ]]; then log "kept the temp dir: $TMP"; else rm -rf "$TMP"; fi
	fi
	exit "$rc"
}

wait_port() { # PORT PID SECONDS: poll until PORT accepts connections; fail early if PID died
	local port=$1 pid=$2 deadline
	deadline=$(($(now_us) + $3 * 1000000))
	while (($(now_us) < deadline)); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
		alive "$pid" || return 1
		sleep 0.02
	done
	return 1
}

LAST_PID=
started() { # NAME PID LOG PORT...: track PID and wait for every PORT; on failure show LOG
	local name=$1 pid=$2 logfile=$3 port
	shift 3
	RUNNING[$pid]=$name
	LAST_PID=$pid
	for port; do
		if ! wait_port "$port" "$pid" 15; then
			warn "$name did not start (port $port not answering); last lines of its log:"
			tail -n 5 "$logfile" >&2 || true
			stop_pid "$pid"
			return 1
		fi
	done
}

# Free ports: one batch for the whole run (all distinct, below the ephemeral range).
PORT_POOL=()
take_port() { # VAR: assign the next free port to VAR
	((${#PORT_POOL[@]})) || die "out of pre-allocated ports"
	printf -v "$1" '%s' "${PORT_POOL[0]}"
	PORT_POOL=("${PORT_POOL[@]:1}")
}

# ---------------------------------------------------------------------------------------------
# Measurements from /proc
# ---------------------------------------------------------------------------------------------
descendants() { # PID: print PID and all its descendants (nginx master -> workers)
	local -A kids=()
	local f line pid rest
	for f in /proc/[0-9]*/stat; do
		{ read -r line <"$f"; } 2>/dev/null || continue
		pid=${line%% *}
		rest=${line##*) } # "state ppid ..."; comm (in parentheses) may contain spaces
		rest=${rest#* }
		kids[${rest%% *}]+=" $pid"
	done
	local -a queue=("$1") out=()
	while ((${#queue[@]})); do
		pid=${queue[0]}
		queue=("${queue[@]:1}")
		out+=("$pid")
		# shellcheck disable=SC2206
		queue+=(${kids[$pid]:-})
	done
	echo "${out[*]}"
}

cpu_ticks() { # PID...: summed utime + stime (all threads) in clock ticks
	local total=0 pid line
	local -a f
	for pid; do
		{ read -r line <"/proc/$pid/stat"; } 2>/dev/null || continue
		read -ra f <<<"${line##*) }" # f[0] is field 3 (state); utime is field 14, stime 15
		total=$((total + f[11] + f[12]))
	done
	echo "$total"
}

status_kb() { # FIELD PID...: sum of a /proc/PID/status field in kB (VmRSS, VmHWM)
	local field=$1 total=0 pid key value rest
	shift
	for pid; do
		[[ -r /proc/$pid/status ]] || continue
		while read -r key value rest; do
			[[ $key == "$field:" ]] && total=$((total + value))
		done <"/proc/$pid/status"
	done
	echo "$total"
}

expand_cpus() { # LIST: "0,2-3" -> "0 2 3"
	local part out=()
	for part in ${1//,/ }; do
		if [[ $part == *-* ]]; then out+=($(seq "${part%-*}" "${part#*-}")); else out+=("$part"); fi
	done
	echo "${out[*]}"
}

core_busy() { # CORE...: busy ticks of these cores from /proc/stat (all but idle and iowait)
	local total=0 name user nice system idle iowait irq softirq steal rest core
	for core; do
		while read -r name user nice system idle iowait irq softirq steal rest; do
			[[ $name == "cpu$core" ]] && total=$((total + user + nice + system + irq + softirq + steal))
		done </proc/stat
	done
	echo "$total"
}

# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
calc() { awk "BEGIN { $1 }" </dev/null; } # calc 'printf "%.2f", 1/3'

median() { # NUMBER...: median
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END {
		if (NR == 0) exit 1
		if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

render() { # TEMPLATE OUT KEY=VALUE...: fill @KEY@ placeholders (first pair wins); refuse leftovers
	local tmpl=$1 out=$2 text kv
	shift 2
	text=$(<"$tmpl")
	for kv; do text=${text//"@${kv%%=*}@"/"${kv#*=}"}; done
	if [[ $text =~ @[A-Z0-9_]+@ ]]; then
		warn "$(basename "$tmpl"): placeholder ${BASH_REMATCH[0]} was not filled"
		return 1
	fi
	printf '%s\n' "$text" >"$out"
}

# shellcheck source=lib/filler_routes.sh
source "$LIB/filler_routes.sh" # filler_routes N

# render_policy NAME TEMPLATE PORT ADMIN_PORT [KEY=VALUE...]: writes $TMP/policies/NAME/levee.toml
# with the common values filled in (route-table templates get ROUTES routes). KEY=VALUE pairs
# given here come first, so they win over the defaults after them.
render_policy() {
	local name=$1 tmpl=$2 port=$3 admin=$4
	shift 4
	mkdir -p "$TMP/policies/$name"
	render "$POLICIES/$tmpl" "$TMP/policies/$name/levee.toml" "$@" \
		PORT="$port" ADMIN_PORT="$admin" BACKEND_PORT="$PORT_BACKEND" REDIS_PORT="$PORT_REDIS" \
		STAMP=0 RESPONSE_TIMEOUT=30s FILLER_ROUTES="$(filler_routes $((ROUTES - 1)))"
}

check_policy() { # DIR: `levee check`; on refusal, SLOT_REASON holds its first error (no paths)
	local out
	if out=$("$LEVEE" check --policies "$1" 2>&1); then return 0; fi
	SLOT_REASON=$(grep -m1 'error' <<<"$out" | sed 's/^[^ ]*: error: //; s/, expected .*//')
	return 1
}

# ---------------------------------------------------------------------------------------------
# wrk
# ---------------------------------------------------------------------------------------------
declare -A W=() # fields of the last wrk run (see lib/report.lua) plus errors, rps

wrk_start() { # URL SECONDS OUT: wrk on the load cores in the background; pid in LAST_PID
	taskset -c "$LOAD_CPUS" timeout $(($2 + 30)) \
		wrk -t "$WRK_THREADS" -c "$CONNECTIONS" -d "${2}s" --timeout 5s --latency \
		-s "${WRK_SCRIPT:-$LIB/report.lua}" "$1" >"$3" 2>&1 &
	LAST_PID=$!
	RUNNING[$LAST_PID]=wrk
}

wrk_parse() { # OUT: fill W from wrk's BENCH line
	local line kv
	line=$(grep -m1 '^BENCH ' "$1") || {
		warn "wrk printed no result; its output:"
		tail -n 5 "$1" >&2
		return 1
	}
	W=()
	for kv in ${line#BENCH }; do W[${kv%%=*}]=${kv#*=}; done
	W[errors]=$((W[err_connect] + W[err_read] + W[err_write] + W[err_status] + W[err_timeout]))
	W[rps]=$(calc "printf \"%.1f\", ${W[requests]} / (${W[duration_us]} / 1e6)")
}

run_wrk() { # URL SECONDS OUT: one wrk run in the foreground
	local pid
	wrk_start "$@"
	pid=$LAST_PID
	wait "$pid" || true
	unset "RUNNING[$pid]"
	wrk_parse "$3"
}

probe() { # URL EXPECTED_BYTES [MUST_NOT_CONTAIN]: one request; 200 with the right body?
	local got code size
	got=$(curl -s -o "$TMP/probe.body" -w '%{http_code} %{size_download}' --max-time 5 "$1") || got="000 0"
	code=${got% *} size=${got#* }
	if [[ $code != 200 ]]; then
		PROBE_ERROR="status $code from $1"
		return 1
	fi
	if [[ -n ${3:-} ]]; then
		if grep -qF -- "$3" "$TMP/probe.body"; then
			PROBE_ERROR="the body still contains '$3'"
			return 1
		fi
	elif [[ $size != "$2" ]]; then
		PROBE_ERROR="body of $size bytes, expected $2"
		return 1
	fi
}

# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
CASES=()
declare -A LABEL=() STATUS=() NOTE=() RPS=() P50=() P99=() P999=() ERR=() CPU=() HWM=() OTHER=() OTHER_MAX=() LOAD_BUSY=()
declare -A REQS=() DECISIONS=() DEC_RATE=() DEC_OTHER=() # measure with ADMIN_PORT: levee's rate-limit decisions
BROKEN=()

broken() { # MESSAGE: something that makes the run (and --smoke) fail
	BROKEN+=("$1")
	warn "$1"
}

skip_case() { # ID LABEL REASON
	CASES+=("$1")
	LABEL[$1]=$2 STATUS[$1]=skipped NOTE[$1]="not yet available: $3"
	log "case $1: $2: not yet available ($3)"
}

# measure ID PID URL ON_PROXY_CORE(1|0) [ADMIN_PORT]: warm-up, then ROUNDS measured wrk runs;
# fills RPS P50 P99 P999 ERR CPU HWM OTHER LOAD_BUSY STATUS for ID (and, with ADMIN_PORT, the
# decisions levee made by Redis and otherwise, and their rate). With ADMIN_PORT (a levee with
# rate limits) it reads levee's decision counters around every measured round: DECISIONS (Redis
# decisions, summed), DEC_RATE (median of Redis decisions / wrk's duration), DEC_OTHER
# (decisions made anywhere else: ahead, fallback, local, cache). The cases use its three steps
# apart (`warm_up`, `measure_round`, `finish_measure`) to interleave their rounds.
measure() {
	warm_up "$@" || return 0
	local round
	for ((round = 1; round <= ROUNDS; round++)); do
		measure_round "$1" "$round" || return 0
	done
	finish_measure "$1"
}

declare -A PIDS_OF=() URL_OF=() OWN_OF=() ADMIN_OF=() # what measure_round needs per case
# Per case, what the rounds measured so far: counters, and lists (space-separated) of the
# per-round figures whose median is reported.
declare -A ACC_TICKS=() ACC_REQS=() ACC_ERRORS=() ACC_STATUS=() ACC_DEC_REDIS=() ACC_DEC_OTHER=()
declare -A ROUND_RPS=() ROUND_P50=() ROUND_P99=() ROUND_P999=() ROUND_OTHER=() ROUND_LOAD=() ROUND_DEC=()
declare -A REDIS_CALLS=() REDIS_CPU=() # the case's share of Redis's work (see redis_load)

redis_share() { # ID BEFORE: adds Redis's work since BEFORE (a redis_load) to the case's share
	local after
	after=$(redis_load)
	read -r REDIS_CALLS[$1] REDIS_CPU[$1] < <(awk -v b="$2" -v a="$after" -v c="${REDIS_CALLS[$1]:-0}" -v u="${REDIS_CPU[$1]:-0}" 'BEGIN {
		split(b, x, " "); split(a, y, " "); printf "%d %.6f\n", c + y[1] - x[1], u + y[2] - x[2] }')
}

warm_up() { # ID PID URL ON_PROXY_CORE [ADMIN_PORT]: the unmeasured warm-up; fails (and marks the case) when wrk fails
	local id=$1 redis_before
	redis_before=$(redis_load)
	run_wrk "$3" "$WARMUP" "$TMP/wrk-$id-warmup.txt" || {
		broken "case $id: wrk warm-up failed"
		STATUS[$id]=failed
		return 1
	}
	redis_share "$id" "$redis_before"
	PIDS_OF[$id]=$(descendants "$2") # after warm-up, so every worker exists
	URL_OF[$id]=$3 OWN_OF[$id]=$4 ADMIN_OF[$id]=${5:-}
	ACC_ERRORS[$id]=${W[errors]} ACC_STATUS[$id]=${W[err_status]}
	ACC_TICKS[$id]=0 ACC_REQS[$id]=0 ACC_DEC_REDIS[$id]=0 ACC_DEC_OTHER[$id]=0
	ROUND_RPS[$id]= ROUND_P50[$id]= ROUND_P99[$id]= ROUND_P999[$id]= ROUND_OTHER[$id]= ROUND_LOAD[$id]= ROUND_DEC[$id]=
	STATUS[$id]=warm
}

measure_round() { # ID ROUND: one measured wrk run of a warmed-up case; fails (and marks the case) when it breaks
	local id=$1 round=$2 admin=${ADMIN_OF[$1]} url=${URL_OF[$1]} own=${OWN_OF[$1]} pids=${PIDS_OF[$1]}
	local t0 t1 b0 b1 l0 l1 w0 w1 d0 d1 redis_before
	# (The counters are read outside the CPU window: the scrape is not the proxy's work.)
	if [[ -n $admin ]] && ! d0=$(decisions "$admin"); then
		broken "case $id: cannot read levee's /metrics"
		STATUS[$id]=failed
		return 1
	fi
	redis_before=$(redis_load)
	t0=$(cpu_ticks $pids) b0=$(core_busy $PROXY_CORES) l0=$(core_busy $LOAD_CORES) w0=$(now_us)
	if ! run_wrk "$url" "$DURATION" "$TMP/wrk-$id-$round.txt"; then
		broken "case $id: wrk round $round failed"
		STATUS[$id]=failed
		return 1
	fi
	t1=$(cpu_ticks $pids) b1=$(core_busy $PROXY_CORES) l1=$(core_busy $LOAD_CORES) w1=$(now_us)
	redis_share "$id" "$redis_before"
	if [[ -n $admin ]]; then
		if ! d1=$(decisions "$admin"); then
			broken "case $id: cannot read levee's /metrics"
			STATUS[$id]=failed
			return 1
		fi
		ACC_DEC_REDIS[$id]=$((ACC_DEC_REDIS[$id] + ${d1% *} - ${d0% *}))
		ACC_DEC_OTHER[$id]=$((ACC_DEC_OTHER[$id] + ${d1#* } - ${d0#* }))
		ROUND_DEC[$id]+=" $(calc "printf \"%.1f\", (${d1% *} - ${d0% *}) / (${W[duration_us]} / 1e6)")"
	fi
	# Noise check: busy time of the proxy core(s) that the proxy itself did not use
	# (other processes, and interrupt work the kernel did not charge to the proxy).
	ROUND_OTHER[$id]+=" $(calc "v = 100 * (($b1 - $b0) - $own * ($t1 - $t0)) / (($w1 - $w0) / 1e6 * $CLK_TCK * $PROXY_NCORES); printf \"%.1f\", (v < 0 ? 0 : v)")" # < 0: tick rounding
	# How busy the other core(s) were: when they are full, the proxy is not what limits req/s.
	ROUND_LOAD[$id]+=" $(calc "printf \"%.0f\", 100 * ($l1 - $l0) / (($w1 - $w0) / 1e6 * $CLK_TCK * $LOAD_NCORES)")"
	ACC_TICKS[$id]=$((ACC_TICKS[$id] + t1 - t0)) ACC_REQS[$id]=$((ACC_REQS[$id] + W[requests]))
	ACC_ERRORS[$id]=$((ACC_ERRORS[$id] + W[errors])) ACC_STATUS[$id]=$((ACC_STATUS[$id] + W[err_status]))
	ROUND_RPS[$id]+=" ${W[rps]}" ROUND_P50[$id]+=" ${W[p50_us]}" ROUND_P99[$id]+=" ${W[p99_us]}" ROUND_P999[$id]+=" ${W[p999_us]}"
	log "  case $id round $round/$ROUNDS: ${W[rps]} req/s, p99 ${W[p99_us]} us, errors ${W[errors]}"
}

finish_measure() { # ID: the case's figures from its rounds
	local id=$1 pids=${PIDS_OF[$1]} errors=${ACC_ERRORS[$1]} status=${ACC_STATUS[$1]} requests=${ACC_REQS[$1]}
	# shellcheck disable=SC2086 # the lists are space-separated numbers
	{
		RPS[$id]=$(median ${ROUND_RPS[$id]}) P50[$id]=$(median ${ROUND_P50[$id]})
		P99[$id]=$(median ${ROUND_P99[$id]}) P999[$id]=$(median ${ROUND_P999[$id]})
		OTHER[$id]=$(median ${ROUND_OTHER[$id]})
		LOAD_BUSY[$id]=$(median ${ROUND_LOAD[$id]})
		OTHER_MAX[$id]=$(printf '%s\n' ${ROUND_OTHER[$id]} | sort -g | tail -n1)
	}
	ERR[$id]=$errors
	((errors == 0)) || ERR[$id]+=" ($status HTTP ≥ 400, $((errors - status)) socket)"
	CPU[$id]=$(calc "if ($requests > 0) printf \"%.2f\", ${ACC_TICKS[$id]} / $CLK_TCK / $requests * 100000")
	HWM[$id]=$(status_kb VmHWM $pids)
	REQS[$id]=$requests
	if [[ -n ${ADMIN_OF[$id]} ]]; then
		# shellcheck disable=SC2086
		DECISIONS[$id]=${ACC_DEC_REDIS[$id]} DEC_OTHER[$id]=${ACC_DEC_OTHER[$id]} DEC_RATE[$id]=$(median ${ROUND_DEC[$id]})
	fi
	STATUS[$id]=ok
	((errors == 0)) || broken "case $id (${LABEL[$id]}): ${ERR[$id]} failed requests"
}

# run_case ID LABEL KIND TEMPLATE PATH EXPECTED_BYTES [MUST_NOT_CONTAIN]
#   KIND backend: measure the backend itself; nginx, haproxy: a config template under conf/;
#   levee: a policy template under policies/ (already checked for slots).
run_case() {
	local id=$1 label=$2 kind=$3 tmpl=$4 path=$5 expect=$6 absent=${7:-} port admin pid= dir
	wanted "$id" || return 0
	CASES+=("$id")
	LABEL[$id]=$label
	log "case $id: $label"
	case $kind in
	backend)
		port=$PORT_BACKEND pid=$BACKEND_PID
		;;
	nginx)
		take_port port
		dir=$TMP/case$id
		mkdir -p "$dir"
		render "$CONF/$tmpl" "$dir/nginx.conf" DIR="$dir" PORT="$port" BACKEND_PORT="$PORT_BACKEND"
		taskset -c "$PROXY_CPUS" nginx -c "$dir/nginx.conf" -p "$dir/" -e "$dir/error.log" \
			-g 'daemon off;' >"$dir/stdout.log" 2>&1 &
		started "nginx (case $id)" $! "$dir/error.log" "$port" && pid=$LAST_PID
		;;
	haproxy)
		take_port port
		dir=$TMP/case$id
		mkdir -p "$dir"
		render "$CONF/$tmpl" "$dir/haproxy.cfg" PORT="$port" BACKEND_PORT="$PORT_BACKEND"
		taskset -c "$PROXY_CPUS" haproxy -f "$dir/haproxy.cfg" -db >"$dir/haproxy.log" 2>&1 &
		started "haproxy (case $id)" $! "$dir/haproxy.log" "$port" && pid=$LAST_PID
		;;
	levee)
		take_port port
		take_port admin
		render_policy "case$id" "$tmpl" "$port" "$admin"
		taskset -c "$PROXY_CPUS" "$LEVEE" run --policies "$TMP/policies/case$id" --no-watch --threads 1 \
			>"$TMP/levee-case$id.log" 2>&1 &
		started "levee (case $id)" $! "$TMP/levee-case$id.log" "$port" "$admin" && pid=$LAST_PID
		;;
	esac
	if [[ -z $pid ]]; then
		STATUS[$id]=failed NOTE[$id]="did not start"
		broken "case $id ($label): the proxy did not start"
		return
	fi
	PROC_OF[$id]=$pid KIND_OF[$id]=$kind CASE_ADMIN[$id]=${admin:-}
	if ! probe "http://127.0.0.1:$port$path" "$expect" "$absent"; then
		STATUS[$id]=failed NOTE[$id]="wrong answer: $PROBE_ERROR"
		broken "case $id ($label): $PROBE_ERROR"
	elif warm_up "$id" "$pid" "http://127.0.0.1:$port$path" "$([[ $kind == backend ]] && echo 0 || echo 1)"; then
		WARM+=("$id") # stays up until measure_cases has run its rounds
		return 0
	fi
	[[ $kind == backend ]] || stop_pid "$pid"
}

declare -A PROC_OF=() KIND_OF=() CASE_ADMIN=()
WARM=() # the cases started and warmed up, in order

# measure_cases: the measured rounds of every warmed-up case, interleaved: round 1 of every
# case, then round 2 in reverse order, and so on. A slow spell of the machine (this VM has
# them) then lands on all cases alike instead of on the few measured during it, which is what
# the ratios between cases need. Then each case's figures and rate-limit notes (before the
# paired runs, whose load the notes' Redis shares do not count); the proxies stay up for
# measure_pairs, and stop_cases stops them.
measure_cases() {
	local round id
	local -a order
	for ((round = 1; round <= ROUNDS; round++)); do
		order=("${WARM[@]}")
		if ((round % 2 == 0)); then
			order=()
			for ((id = ${#WARM[@]} - 1; id >= 0; id--)); do order+=("${WARM[id]}"); done
		fi
		for id in "${order[@]}"; do
			[[ ${STATUS[$id]} == warm ]] || continue
			measure_round "$id" "$round" || true
		done
	done
	for id in "${WARM[@]}"; do
		[[ ${STATUS[$id]} != warm ]] || finish_measure "$id"
		[[ ${KIND_OF[$id]} != levee || ${STATUS[$id]} != ok ]] || limit_note "$id" "${CASE_ADMIN[$id]}"
	done
}

stop_cases() { # after measure_cases and measure_pairs: every proxy stopped
	local id
	for id in "${WARM[@]}"; do
		[[ ${KIND_OF[$id]} == backend ]] || stop_pid "${PROC_OF[$id]}"
	done
}

# The pairs of cases whose req/s the targets compare: "A B" judges A against B.
TARGET_PAIRS=("4 2" "4 3" "5c 4" "6 8b")
declare -A PAIR_RATIOS=() PAIR_CPU_RATIOS=() # "A B" -> space-separated per-pair ratios of A to B
declare -A PAIR_FAILED=()                      # ID -> 1 once a paired run of the case failed

# measure_pairs: the req/s targets' own measurement. However the rounds of measure_cases are
# ordered, the two cases of a target can sit minutes apart, and this machine's speed drifts by a
# third within minutes (backend-direct rounds of 112k and 145k req/s in one run). So each
# target's two cases, still up and warm, run back to back PAIR_RUNS times (A then B, then B then
# A, so a drift favours neither), and the target is the median of the per-pair ratios.
measure_pairs() {
	local pair a b run id
	local -A rps=() cpu=()
	for pair in "${TARGET_PAIRS[@]}"; do
		read -r a b <<<"$pair"
		[[ ${STATUS[$a]:-} == ok && ${STATUS[$b]:-} == ok ]] || continue
		[[ -z ${PAIR_FAILED[$a]:-}${PAIR_FAILED[$b]:-} ]] || continue
		log "paired runs: case $a against case $b"
		for ((run = 1; run <= PAIR_RUNS; run++)); do
			for id in $( ((run % 2)) && echo "$a $b" || echo "$b $a"); do
				if ! pair_run "$id" "$run"; then
					# A pair cut short is judged on no ratio at all, not on its first runs.
					PAIR_FAILED[$id]=1
					unset "PAIR_RATIOS[$pair]" "PAIR_CPU_RATIOS[$pair]"
					continue 3
				fi
				rps[$id]=$PAIR_RPS cpu[$id]=$PAIR_CPU
			done
			PAIR_RATIOS[$pair]+=" $(calc "printf \"%.4f\", ${rps[$a]} / ${rps[$b]}")"
			# Requests per proxy CPU-second, A to B (the backend case has no proxy CPU).
			[[ ${KIND_OF[$b]} == backend ]] || PAIR_CPU_RATIOS[$pair]+=" $(calc "if (${cpu[$a]} > 0) printf \"%.4f\", ${cpu[$b]} / ${cpu[$a]}")"
			log "  $a vs $b, pair $run/$PAIR_RUNS: $(calc "printf \"%.3f\", ${rps[$a]} / ${rps[$b]}")× req/s"
		done
	done
}

# pair_run ID RUN: one PAIR_DURATION-second wrk run of a warm case; leaves its req/s in PAIR_RPS
# and its proxy CPU seconds per 100k requests in PAIR_CPU. Fails (and says so) when wrk fails
# or requests fail.
pair_run() {
	local id=$1 t0 t1
	t0=$(cpu_ticks ${PIDS_OF[$id]})
	if ! run_wrk "${URL_OF[$id]}" "$PAIR_DURATION" "$TMP/wrk-pair-$id-$2.txt" || ((W[requests] == 0)); then
		broken "case $id: wrk failed in a paired run"
		return 1
	fi
	t1=$(cpu_ticks ${PIDS_OF[$id]})
	if ((W[errors] > 0)); then
		broken "case $id (${LABEL[$id]}): ${W[errors]} failed requests in a paired run"
		return 1
	fi
	PAIR_RPS=${W[rps]}
	PAIR_CPU=$(calc "printf \"%.4f\", ($t1 - $t0) / $CLK_TCK / ${W[requests]} * 100000")
}

# ---------------------------------------------------------------------------------------------
# Under a CPU limit (section "budget")
# ---------------------------------------------------------------------------------------------
# On this 2-core machine the core that carries wrk and the backend is nearly full under any
# proxy, so it, not the proxy, sets the pace of the cases above. Here each proxy of a target
# pair is held to the same share of its core by a cgroup CPU quota (as a container's CPU limit
# holds a sidecar), well below what the load core can feed: the proxy is then what limits
# req/s, and the ratio is of the proxies' own work. The proxies are the warm ones of the cases
# above, moved into a cgroup of their own for the section and moved back after it.
# The pass-through targets, and levee's own: the full policy's and hide's cost, which the load
# core's cap hides too (both cases of such a pair slowed to its pace).
BUDGET_PAIRS=("4 2" "4 3" "5c 4" "6 8b")
declare -A BUDGET_RATIOS=() BUDGET_P99_RATIOS=() BUDGET_RPS=() BUDGET_P99=() BUDGET_THROTTLED=() BUDGET_LOAD=() BUDGET_USED=()
BUDGET_SKIPPED= CGROUP_KIND= CGROUP_BASE=
CGROUPS=() # made by the section; emptied, then removed, on exit

# cgroup_setup: where CPU-limited cgroups can be made (cgroup v1's cpu hierarchy, or v2 with its
# cpu controller); fails with the reason in BUDGET_SKIPPED
cgroup_setup() {
	if [[ -w /sys/fs/cgroup/cpu/cpu.cfs_quota_us || -w /sys/fs/cgroup/cpu/cgroup.procs ]]; then
		CGROUP_KIND=v1 CGROUP_BASE=/sys/fs/cgroup/cpu
	elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
		CGROUP_KIND=v2 CGROUP_BASE=/sys/fs/cgroup
		grep -qw cpu "$CGROUP_BASE/cgroup.subtree_control" ||
			echo +cpu >"$CGROUP_BASE/cgroup.subtree_control" 2>/dev/null || {
			BUDGET_SKIPPED="cgroup v2's cpu controller cannot be enabled here"
			return 1
		}
	else
		BUDGET_SKIPPED="no writable cgroup cpu controller (needs root and cgroup v1's cpu or v2's cpu.max)"
		return 1
	fi
}

cgroup_limit() { # ID: a cgroup holding case ID's processes to BUDGET_PCT of one core; its path in LAST_CGROUP
	local dir=$CGROUP_BASE/levee-bench-$$-$1 quota=$((BUDGET_PERIOD_US * BUDGET_PCT / 100)) pid
	mkdir "$dir" 2>/dev/null || {
		BUDGET_SKIPPED="cannot make a cgroup under $CGROUP_KIND's cpu hierarchy"
		return 1
	}
	CGROUPS+=("$dir")
	if [[ $CGROUP_KIND == v1 ]]; then
		echo "$BUDGET_PERIOD_US" >"$dir/cpu.cfs_period_us" && echo "$quota" >"$dir/cpu.cfs_quota_us"
	else
		echo "$quota $BUDGET_PERIOD_US" >"$dir/cpu.max"
	fi 2>/dev/null || {
		BUDGET_SKIPPED="cannot set a CPU quota on a cgroup"
		return 1
	}
	# Every process of the case (nginx's master and worker); a process moves with all its threads.
	for pid in ${PIDS_OF[$1]}; do
		echo "$pid" >"$dir/cgroup.procs" 2>/dev/null || {
			BUDGET_SKIPPED="cannot move a proxy into a cgroup"
			return 1
		}
	done
	LAST_CGROUP=$dir
}

cgroup_throttled() { # DIR: how many periods the cgroup's quota has run out so far
	awk '$1 == "nr_throttled" { print $2 }' "$1/cpu.stat"
}

cgroup_release() { # every cgroup made: its processes back to the top, then removed
	local dir pid
	for dir in "${CGROUPS[@]}"; do
		[[ -d $dir ]] || continue
		while read -r pid; do echo "$pid" >"$CGROUP_BASE/cgroup.procs" 2>/dev/null || true; done <"$dir/cgroup.procs"
		rmdir "$dir" 2>/dev/null || warn "could not remove the cgroup $dir"
	done
	CGROUPS=()
}

section_budget() {
	local pair a b run id dir t0 l0 w0
	local -A cgroup_of=() rps=() p99=() throttled=() load=()
	cgroup_setup || {
		log "budget section skipped: $BUDGET_SKIPPED"
		return 0
	}
	for pair in "${BUDGET_PAIRS[@]}"; do
		read -r a b <<<"$pair"
		[[ ${STATUS[$a]:-} == ok && ${STATUS[$b]:-} == ok ]] || continue
		for id in $a $b; do
			[[ -n ${cgroup_of[$id]:-} ]] && continue
			cgroup_limit "$id" || {
				log "budget section skipped: $BUDGET_SKIPPED"
				cgroup_release
				return 0
			}
			cgroup_of[$id]=$LAST_CGROUP
		done
		log "under a CPU limit of $BUDGET_PCT% of one core: case $a against case $b"
		for ((run = 1; run <= PAIR_RUNS; run++)); do
			for id in $( ((run % 2)) && echo "$a $b" || echo "$b $a"); do
				dir=${cgroup_of[$id]}
				t0=$(cgroup_throttled "$dir") l0=$(core_busy $LOAD_CORES) w0=$(now_us)
				pair_run "$id" "budget-$run" || {
					# As in measure_pairs: a pair cut short is judged on no ratio at all.
					unset "BUDGET_RATIOS[$pair]" "BUDGET_P99_RATIOS[$pair]"
					cgroup_release
					return 0
				}
				throttled[$id]=$(($(cgroup_throttled "$dir") - t0))
				load[$id]=$(calc "printf \"%.0f\", 100 * ($(core_busy $LOAD_CORES) - $l0) / (($(now_us) - $w0) / 1e6 * $CLK_TCK * $LOAD_NCORES)")
				rps[$id]=$PAIR_RPS p99[$id]=${W[p99_us]}
				BUDGET_RPS[$id]+=" $PAIR_RPS" BUDGET_P99[$id]+=" ${W[p99_us]}"
				BUDGET_THROTTLED[$id]+=" $(calc "v = 100 * ${throttled[$id]} / (${W[duration_us]} / $BUDGET_PERIOD_US); printf \"%.0f\", (v > 100 ? 100 : v)")"
				BUDGET_LOAD[$id]+=" ${load[$id]}"
				# The CPU the proxy got, in % of a core: a proxy the kernel charges late runs
				# past its quota, so the quota alone does not say that both had the same.
				BUDGET_USED[$id]+=" $(calc "printf \"%.1f\", $PAIR_CPU * $PAIR_RPS / 1000")"
			done
			BUDGET_RATIOS[$pair]+=" $(calc "printf \"%.4f\", ${rps[$a]} / ${rps[$b]}")"
			BUDGET_P99_RATIOS[$pair]+=" $(calc "printf \"%.4f\", ${p99[$a]} / ${p99[$b]}")"
			log "  $a vs $b under the limit, pair $run/$PAIR_RUNS: $(calc "printf \"%.3f\", ${rps[$a]} / ${rps[$b]}")× req/s (${rps[$a]} vs ${rps[$b]})"
		done
	done
	cgroup_release
}

decisions() { # ADMIN_PORT: "REDIS OTHER", levee's rate-limit decisions so far (all rules and
	# results) made by Redis, and made any other way (ahead, fallback, local, cache); fails when
	# /metrics does not answer
	local text
	text=$(curl -sf --max-time 5 "http://127.0.0.1:$1/metrics") || return 1
	awk '/^[a-z_]*ratelimit_decisions[a-z_]*[{]/ { if ($0 ~ /source="redis"/) r += $NF; else o += $NF }
		END { printf "%d %d\n", r, o }' <<<"$text"
}

redis_load() { # "EVALSHA_CALLS CPU_SECONDS" of the harness's Redis so far ("0 0" if it does not answer)
	redis-cli -h 127.0.0.1 -p "$PORT_REDIS" info all 2>/dev/null | tr -d '\r' | awk -F'[:,=]' '
		/^cmdstat_evalsha:/ { calls = $3 }
		/^used_cpu_(sys|user):/ { cpu += $2 }
		END { printf "%d %.6f\n", calls, cpu }' || echo "0 0"
}

limit_note() { # ID ADMIN_PORT: levee's rate-limit decisions during the case, from /metrics, and
	# what they cost Redis (the case's share of script calls and CPU, see redis_share)
	local summary total=0 counts
	if counts=$(decisions "$2"); then total=$((${counts% *} + ${counts#* })); fi
	summary=$(curl -s --max-time 5 "http://127.0.0.1:$2/metrics" | awk '
		/^[a-z_]*ratelimit_decisions[a-z_]*[{]/ {
			match($0, /source="[^"]*"/); src = substr($0, RSTART + 8, RLENGTH - 9)
			match($0, /result="[^"]*"/); res = substr($0, RSTART + 8, RLENGTH - 9)
			by[src] += $NF
			if (res != "allowed") refused[res] += $NF
		}
		END {
			for (s in by) printf "%s%s %d", (n++ ? ", " : ""), s, by[s]
			for (r in refused) printf ", %s %d", r, refused[r]
		}') || true
	[[ -n $summary ]] || return 0
	NOTE[$1]="rate-limit decisions by source: $summary"
	# Redis's side: script calls and Redis CPU per rule decision (a request has one per rule),
	# all of Redis's CPU while the case ran, warm-up included, like the decisions.
	if ((total > 0)); then
		NOTE[$1]+=$(awk -v calls="${REDIS_CALLS[$1]:-0}" -v cpu="${REDIS_CPU[$1]:-0}" -v n="$total" 'BEGIN {
			if (calls > 0) printf "; Redis ran one EVALSHA per %.0f rule decisions, %.2f µs of Redis CPU per rule decision", n / calls, cpu / n * 1e6
		}')
	fi
	if [[ $summary == *fallback* ]]; then
		NOTE[$1]+="; levee fell back to in-process limits (Redis slower than its timeout) for part of the run"
	fi
}

# slot_case ID LABEL TEMPLATE PATH EXPECTED_BYTES [MUST_NOT_CONTAIN]: a levee case that runs
# only once `levee check` accepts its policy template.
slot_case() {
	local id=$1 label=$2 tmpl=$3
	wanted "$id" || return 0
	render_policy "check$id" "$tmpl" 1 2 # dummy ports, only checked
	if check_policy "$TMP/policies/check$id"; then
		run_case "$id" "$label" levee "$tmpl" "${@:4}"
	else
		skip_case "$id" "$label" "$SLOT_REASON"
	fi
}

start_levee_section() { # NAME TEMPLATE [KEY=VALUE...]: fresh levee for a section; SEC_* globals
	local name=$1 tmpl=$2
	shift 2
	take_port SEC_PORT
	take_port SEC_ADMIN
	SEC_DIR=$TMP/policies/$name
	render_policy "$name" "$tmpl" "$SEC_PORT" "$SEC_ADMIN" "$@" || return 1
	taskset -c "$PROXY_CPUS" "$LEVEE" run --policies "$SEC_DIR" --no-watch --threads 1 \
		>"$TMP/levee-$name.log" 2>&1 &
	started "levee ($name)" $! "$TMP/levee-$name.log" "$SEC_PORT" "$SEC_ADMIN" || return 1
	SEC_PID=$LAST_PID
}

# ---------------------------------------------------------------------------------------------
# Sections beyond throughput
# ---------------------------------------------------------------------------------------------
IDLE_RSS= CONNS_RSS= CONNS_NOTE= RELOAD_MS= RELOAD_NOTE= RELOAD_FAILED= RELOAD_LOAD_NOTE=

section_idle_rss() { # VmRSS of a fresh levee as soon as both listeners answer
	log "section: idle RSS"
	start_levee_section idle passthrough.toml.tmpl || {
		broken "idle RSS: levee did not start"
		return
	}
	IDLE_RSS=$(status_kb VmRSS "$SEC_PID")
	stop_pid "$SEC_PID"
}

section_idle_conns() { # VmRSS with IDLE_CONNS idle keep-alive clients (one request answered each)
	local n=$IDLE_CONNS limit holder deadline out=$TMP/idle-conns.txt before fds
	log "section: $n idle keep-alive connections"
	limit=$(ulimit -n)
	if ((n + 200 > limit)); then
		n=$((limit - 200))
		CONNS_NOTE="capped at $n connections by the open-files limit ($limit)"
		warn "$CONNS_NOTE"
	fi
	start_levee_section conns passthrough.toml.tmpl || {
		broken "idle connections: levee did not start"
		return
	}
	before=$(status_kb VmRSS "$SEC_PID")
	# (No `timeout` wrapper: it would not pass SIGUSR1 on. The script gives up by itself.)
	taskset -c "$LOAD_CPUS" python3 "$LIB/idle_conns.py" "$SEC_PORT" "$n" / >"$out" 2>&1 &
	holder=$!
	RUNNING[$holder]=idle_conns.py
	deadline=$(($(now_us) + 120000000))
	until grep -q '^READY' "$out"; do
		if ! alive "$holder" || (($(now_us) > deadline)); then
			broken "idle connections: the client did not get its answers: $(tail -n 1 "$out")"
			stop_pid "$holder"
			stop_pid "$SEC_PID"
			return
		fi
		sleep 0.05
	done
	CONNS_RSS=$(status_kb VmRSS "$SEC_PID")
	fds=$(find "/proc/$SEC_PID/fd" -mindepth 1 -maxdepth 1 | wc -l) # clients + upstream pool + listeners
	kill -USR1 "$holder"
	wait "$holder" || true
	unset "RUNNING[$holder]"
	local ready still
	ready=$(grep -m1 '^READY' "$out")
	still=$(grep -m1 '^STILL_OPEN' "$out" || echo "STILL_OPEN ?")
	ready=${ready#READY answered=}
	CONNS_NOTE="${CONNS_NOTE:+$CONNS_NOTE; }${ready/ of //} answered 200, ${still#STILL_OPEN } still open after the reading; levee had $fds open descriptors; $(mib "$before") before the clients"
	[[ $ready == "$n of $n" ]] || broken "idle connections: only $ready requests were answered"
	stop_pid "$SEC_PID"
}

section_reload_time() { # median time of POST /reload for a RELOAD_ROUTES-route policy
	local i t reply
	local -a times=()
	log "section: reload time with $RELOAD_ROUTES routes"
	start_levee_section reload-time routes.toml.tmpl FILLER_ROUTES="$(filler_routes $((RELOAD_ROUTES - 1)))" || {
		broken "reload time: levee did not start"
		return
	}
	for ((i = 1; i <= RELOAD_SAMPLES; i++)); do
		# Rewrite the file (new stamp) so the reload reads, parses and compiles changed text.
		render "$POLICIES/routes.toml.tmpl" "$SEC_DIR/levee.toml" PORT="$SEC_PORT" ADMIN_PORT="$SEC_ADMIN" \
			BACKEND_PORT="$PORT_BACKEND" STAMP="$i" RESPONSE_TIMEOUT=30s \
			FILLER_ROUTES="$(filler_routes $((RELOAD_ROUTES - 1)))"
		t=$(curl -s -o "$TMP/reload.json" -w '%{time_total}' --max-time 30 -X POST "http://127.0.0.1:$SEC_ADMIN/reload") || t=
		reply=$(tr -d ' \n' <"$TMP/reload.json" 2>/dev/null || true)
		if [[ -z $t || $reply != *'"ok":true'* || $reply != *'"changed":true'* ]]; then
			broken "reload time: reload $i failed: ${reply:0:200}"
			stop_pid "$SEC_PID"
			return
		fi
		times+=("$(calc "printf \"%.2f\", $t * 1000")")
	done
	RELOAD_MS=$(median "${times[@]}")
	RELOAD_NOTE="$RELOAD_SAMPLES rewrites + POST /reload, curl time_total incl. compile; min $(printf '%s\n' "${times[@]}" | sort -g | head -n1) ms, max $(printf '%s\n' "${times[@]}" | sort -g | tail -n1) ms"
	stop_pid "$SEC_PID"
}

section_reload_load() { # failed requests while levee reloads RELOADS times under wrk load
	local secs interval i t0 wait_us wrk_pid reply failed=0 routes rto out=$TMP/wrk-reload.txt
	log "section: $RELOADS reloads under load"
	start_levee_section reload-load routes.toml.tmpl || {
		broken "reloads under load: levee did not start"
		return
	}
	secs=$((DURATION > 4 ? DURATION : 4))
	# Reloads are paced evenly over the load window: reload i is due i intervals after wrk
	# starts, the last one two intervals before wrk stops (pacing against the clock, not a
	# wait for something a poll could see).
	interval=$((secs * 1000000 / (RELOADS + 2)))
	wrk_start "http://127.0.0.1:$SEC_PORT$REQUEST_PATH" "$secs" "$out"
	wrk_pid=$LAST_PID
	t0=$(now_us)
	for ((i = 1; i <= RELOADS; i++)); do
		wait_us=$((t0 + i * interval - $(now_us)))
		((wait_us <= 0)) || sleep "$(calc "printf \"%.3f\", $wait_us / 1e6")"
		# Every rewrite changes the route table size; every other one also changes the upstream
		# (response_timeout), which replaces its connection pool mid-load.
		routes=$((ROUTES - 1 + i % 7))
		rto=$((i % 2 ? 31 : 30))s
		render "$POLICIES/routes.toml.tmpl" "$SEC_DIR/levee.toml" PORT="$SEC_PORT" ADMIN_PORT="$SEC_ADMIN" \
			BACKEND_PORT="$PORT_BACKEND" STAMP="$i" RESPONSE_TIMEOUT="$rto" \
			FILLER_ROUTES="$(filler_routes "$routes")"
		reply=$(curl -s --max-time 10 -X POST "http://127.0.0.1:$SEC_ADMIN/reload" | tr -d ' \n') || reply=
		[[ $reply == *'"ok":true'* ]] || failed=$((failed + 1))
	done
	alive "$wrk_pid" || RELOAD_LOAD_NOTE="load ended before the last reload; "
	wait "$wrk_pid" || true
	unset "RUNNING[$wrk_pid]"
	if wrk_parse "$out"; then
		RELOAD_FAILED=${W[errors]}
		RELOAD_LOAD_NOTE+="${W[requests]} requests in ${secs} s, $((RELOADS - failed))/$RELOADS reloads accepted, every other one replacing the upstream"
		((W[errors] == 0)) || broken "reloads under load: ${W[errors]} failed requests"
	else
		broken "reloads under load: wrk failed"
	fi
	((failed == 0)) || broken "reloads under load: $failed reloads were refused"
	stop_pid "$SEC_PID"
}

# ---------------------------------------------------------------------------------------------
# Rate limiter sections: decisions/s against the Redis ceiling, and added latency
# ---------------------------------------------------------------------------------------------
EVALSHA_SHA= CEIL_RPS= CEIL_P50= CEIL_P99= CEIL_NOTE=
DIRECT_RPS= DIRECT_P50= DIRECT_P99= DIRECT_REDIS= DIRECT_OTHER= DIRECT_NOTE=
LIMITS_ON='limits = ["decide"]' LIMITS_OFF='limits = []' # the two renderings of limiter.toml.tmpl
# What every redis-benchmark call sends: the limiter's own script, one key per call, the
# key drawn from 100,000 (-r, __rand_int__) so the calls spread over many buckets; an interval
# of 100 ms and a burst of 10^9, so every call admits and writes its bucket, as levee's do.
EVALSHA_ARGS=(1 'rl:{key:__rand_int__}' 1 1 0 100000 1000000000 0) # one request, one rule, waiting

declare -A RB=() # fields of the last redis-benchmark run: requests, rps, p50_ms, p99_ms

run_redis_benchmark() { # REQUESTS OUT: EVALSHA against our Redis, pinned to the load cores like wrk
	local line test avg min p95 max
	if ! taskset -c "$LOAD_CPUS" timeout $((DURATION * 5 + 60)) \
		redis-benchmark -h 127.0.0.1 -p "$PORT_REDIS" -c "$CONNECTIONS" -n "$1" -P 1 -r 100000 --csv \
		EVALSHA "$EVALSHA_SHA" "${EVALSHA_ARGS[@]}" >"$2" 2>&1; then
		warn "redis-benchmark failed (it stops at the first error reply); its output:"
		tail -n 5 "$2" >&2
		return 1
	fi
	# --csv: a header, then "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",...
	line=$(grep -m1 '^"EVALSHA ' "$2") || {
		warn "redis-benchmark printed no result; its output:"
		tail -n 5 "$2" >&2
		return 1
	}
	IFS=, read -r test RB[rps] avg min RB[p50_ms] p95 RB[p99_ms] max <<<"${line//\"/}"
	RB[requests]=$1
}

evalsha_ceiling() { # the Redis ceiling: redis-benchmark running the limiter's EVALSHA
	local i n out reply
	local -a rps=() p50=() p99=()
	EVALSHA_SHA=$(redis-cli -h 127.0.0.1 -p "$PORT_REDIS" -x SCRIPT LOAD <"$REPO/src/limit/script.lua") || EVALSHA_SHA=
	if [[ ! $EVALSHA_SHA =~ ^[0-9a-f]{40}$ ]]; then
		broken "limiter decisions/s: SCRIPT LOAD of src/limit/script.lua failed: ${EVALSHA_SHA:0:200}"
		return 1
	fi
	# One call by hand: the reply starts with 0 (not blocked), then 1 (the rule admits).
	reply=$(redis-cli -h 127.0.0.1 -p "$PORT_REDIS" EVALSHA "$EVALSHA_SHA" 1 'rl:{key:probe}' 1 1 0 100000 1000000000 0) || reply=
	if [[ $reply != "0 1 "* ]]; then
		broken "limiter decisions/s: EVALSHA does not admit: '$reply'"
		return 1
	fi
	# Warm-up run, which also sizes the measured runs: EVALSHA_REQUESTS, or as many requests as
	# the warm-up rate gives in DURATION seconds, so each round lasts about as long as wrk's.
	run_redis_benchmark 20000 "$TMP/redis-benchmark-warmup.txt" || {
		broken "limiter decisions/s: redis-benchmark warm-up failed"
		return 1
	}
	n=${EVALSHA_REQUESTS:-$(calc "n = ${RB[rps]} * $DURATION; printf \"%d\", (n < 10000 ? 10000 : n)")}
	for ((i = 1; i <= ROUNDS; i++)); do
		out=$TMP/redis-benchmark-$i.txt
		run_redis_benchmark "$n" "$out" || {
			broken "limiter decisions/s: redis-benchmark round $i failed"
			return 1
		}
		rps+=("${RB[rps]}") p50+=("${RB[p50_ms]}") p99+=("${RB[p99_ms]}")
		log "  redis-benchmark round $i/$ROUNDS: ${RB[rps]} EVALSHA/s, p99 ${RB[p99_ms]} ms"
	done
	CEIL_RPS=$(median "${rps[@]}")
	CEIL_P50=$(calc "printf \"%.0f\", $(median "${p50[@]}") * 1000") # µs, like wrk's
	CEIL_P99=$(calc "printf \"%.0f\", $(median "${p99[@]}") * 1000")
	CEIL_NOTE="redis-benchmark -c $CONNECTIONS -P 1 -r 100000 -n $n, $ROUNDS round(s) after a 20000-request warm-up"
}

limiter_direct() { # levee's limiter driven directly, like redis-benchmark: ROUNDS rounds, median
	local i out line kv
	local -a rps=() p50=() p99=()
	local -A L=()
	if [[ ! -x $LIMITER_BENCH ]]; then
		DIRECT_NOTE="not run: $LIMITER_BENCH is missing"
		return
	fi
	render_policy limiter-direct limiter.toml.tmpl 1 2 LIMITS="$LIMITS_ON" REDIS_TIMEOUT=1s || {
		broken "limiter decisions/s: the limiter-bench policy did not render"
		return
	}
	DIRECT_REDIS=0 DIRECT_OTHER=0
	for ((i = 1; i <= ROUNDS; i++)); do
		out=$TMP/limiter-bench-$i.txt
		if ! taskset -c "$LOAD_CPUS" timeout $((DURATION + 60)) "$LIMITER_BENCH" \
			"$TMP/policies/limiter-direct" decide "$CONNECTIONS" "$DURATION" 100000 >"$out" 2>&1 ||
			! line=$(grep -m1 '^LIMITER ' "$out"); then
			broken "limiter decisions/s: limiter-bench round $i failed: $(tail -n 1 "$out")"
			return
		fi
		L=()
		for kv in ${line#LIMITER }; do L[${kv%%=*}]=${kv#*=}; done
		rps+=("$(calc "printf \"%.1f\", ${L[decisions]} / (${L[duration_us]} / 1e6)")")
		p50+=("${L[p50_us]}") p99+=("${L[p99_us]}")
		DIRECT_REDIS=$((DIRECT_REDIS + L[redis])) DIRECT_OTHER=$((DIRECT_OTHER + L[other]))
		log "  limiter-bench round $i/$ROUNDS: ${rps[-1]} decisions/s (redis ${L[redis]}, without redis ${L[other]}), p99 ${L[p99_us]} µs"
	done
	DIRECT_RPS=$(median "${rps[@]}")
	DIRECT_P50=$(median "${p50[@]}")
	DIRECT_P99=$(median "${p99[@]}")
}

section_limiter_rate() { # Redis EVALSHA ceiling, then levee's decisions/s with one Redis rule
	log "section: limiter decisions/s vs the Redis EVALSHA ceiling"
	evalsha_ceiling || return 0
	log "  levee's limiter driven directly (limiter-bench, $CONNECTIONS in flight)"
	limiter_direct
	start_levee_section limiter-rate limiter.toml.tmpl LIMITS="$LIMITS_ON" REDIS_TIMEOUT=25ms || {
		broken "limiter decisions/s: levee did not start"
		return
	}
	if probe "http://127.0.0.1:$SEC_PORT/" 1024; then
		log "  levee, one Redis limit rule, wrk -c $CONNECTIONS"
		measure limiter-rate "$SEC_PID" "http://127.0.0.1:$SEC_PORT/" 1 "$SEC_ADMIN"
	else
		broken "limiter decisions/s: levee: $PROBE_ERROR"
	fi
	stop_pid "$SEC_PID"
}

section_limiter_latency() { # the same levee and route at moderate load, without and with the rule
	# Dynamic scope: wrk_start (called by measure_round) sees this CONNECTIONS.
	local CONNECTIONS=$LATENCY_CONNECTIONS WRK_SCRIPT=$LIB/paced.lua variant limits round
	local -A pid_of=()
	log "section: latency added by the limiter at moderate load (wrk -c $CONNECTIONS)"
	# Both levees run side by side (the idle one waits on the proxy core, using nothing) and
	# their rounds alternate, so that each round with the rule has one without it next to it:
	# at this load p99 is mostly how fast this VM wakes a sleeping core, which changes by
	# milliseconds from minute to minute.
	for variant in off on; do
		[[ $variant == on ]] && limits=$LIMITS_ON || limits=$LIMITS_OFF
		if ! start_levee_section "limiter-latency-$variant" limiter.toml.tmpl LIMITS="$limits" REDIS_TIMEOUT=25ms; then
			broken "limiter latency: levee ($variant) did not start"
			continue
		fi
		pid_of[$variant]=$SEC_PID
		if probe "http://127.0.0.1:$SEC_PORT/" 1024; then
			log "  levee, limit rule $variant: warm-up"
			warm_up "limiter-$variant" "$SEC_PID" "http://127.0.0.1:$SEC_PORT/" 1 "$SEC_ADMIN" || true
		else
			broken "limiter latency: levee ($variant): $PROBE_ERROR"
		fi
	done
	for ((round = 1; round <= ROUNDS; round++)); do
		for variant in $( ((round % 2)) && echo off on || echo on off); do
			[[ ${STATUS[limiter-$variant]:-} == warm ]] || continue
			measure_round "limiter-$variant" "$round" || true
		done
	done
	for variant in off on; do
		[[ ${STATUS[limiter-$variant]:-} != warm ]] || finish_measure "limiter-$variant"
		[[ -z ${pid_of[$variant]:-} ]] || stop_pid "${pid_of[$variant]}"
	done
}

section_queue() { # a queue route's 202s without and with a replica's acknowledgement
	local variant load id round replica_pid
	local -A pid_of=()
	log "section: queue, jobs answered 202 without and with wait_replicas = 1"
	take_port PORT_REPLICA
	mkdir -p "$TMP/replica"
	taskset -c "$BACKEND_CPUS" redis-server --port "$PORT_REPLICA" --bind 127.0.0.1 --save '' --appendonly no \
		--replicaof 127.0.0.1 "$PORT_REDIS" --daemonize no --logfile "$TMP/replica/redis.log" --dir "$TMP/replica" &
	if ! started "redis-server (replica)" $! "$TMP/replica/redis.log" "$PORT_REPLICA"; then
		broken "queue: the Redis replica did not start"
		return
	fi
	replica_pid=$LAST_PID
	local deadline=$((SECONDS + 20))
	until redis-cli -h 127.0.0.1 -p "$PORT_REPLICA" info replication 2>/dev/null | grep -q 'master_link_status:up'; do
		if ((SECONDS > deadline)); then
			broken "queue: the Redis replica did not catch up with the master in 20 s"
			stop_pid "$replica_pid"
			return
		fi
		sleep 0.2
	done
	# Redis's own record of its stalls (over 10 ms) during the section, for the report.
	redis-cli -h 127.0.0.1 -p "$PORT_REDIS" config set latency-monitor-threshold 10 >/dev/null 2>&1 || true
	redis-cli -h 127.0.0.1 -p "$PORT_REDIS" latency reset >/dev/null 2>&1 || true
	for variant in 0 1; do
		if ! start_levee_section "queue-$variant" queue.toml.tmpl WAIT_REPLICAS="$variant"; then
			broken "queue: levee (wait_replicas = $variant) did not start"
			continue
		fi
		pid_of[$variant]=$SEC_PID
		local code
		code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -d 'probe=1' "http://127.0.0.1:$SEC_PORT/subscribe.php") || code=000
		if [[ $code != 202 ]]; then
			broken "queue: levee (wait_replicas = $variant) answered a job with $code, not 202"
			continue
		fi
		for load in full paced; do
			id=queue-$variant-$load
			LABEL[$id]="queue, $load load, wait_replicas = $variant"
			log "  levee, wait_replicas = $variant, $load load: warm-up"
			queue_load "$load" warm_up "$id" "$SEC_PID" "http://127.0.0.1:$SEC_PORT/subscribe.php" 1 || true
		done
	done
	# Rounds alternate the two variants, as in the limiter-latency section.
	for ((round = 1; round <= ROUNDS; round++)); do
		for load in full paced; do
			for variant in $( ((round % 2)) && echo 0 1 || echo 1 0); do
				id=queue-$variant-$load
				[[ ${STATUS[$id]:-} == warm ]] || continue
				local waits_before
				waits_before=$(wait_calls)
				queue_load "$load" measure_round "$id" "$round" || true
				QUEUE_WAITS[$id]=$((${QUEUE_WAITS[$id]:-0} + $(wait_calls) - waits_before))
			done
		done
	done
	for variant in 0 1; do
		for load in full paced; do
			id=queue-$variant-$load
			[[ ${STATUS[$id]:-} != warm ]] || finish_measure "$id"
		done
		[[ -z ${pid_of[$variant]:-} ]] || stop_pid "${pid_of[$variant]}"
	done
	QUEUE_STALLS=$(redis-cli -h 127.0.0.1 -p "$PORT_REDIS" latency latest 2>/dev/null | paste -sd' ' | sed 's/  */ /g') || QUEUE_STALLS=
	QUEUE_BACKLOG=$(redis-cli -h 127.0.0.1 -p "$PORT_REDIS" xlen 'levee:queue:{jobs}:jobs' 2>/dev/null) || QUEUE_BACKLOG=
	stop_pid "$replica_pid"
}

declare -A QUEUE_WAITS=() # per queue case: WAIT calls Redis ran during its measured rounds

wait_calls() { # WAIT calls the harness's Redis has run so far (0 if it does not answer)
	redis-cli -h 127.0.0.1 -p "$PORT_REDIS" info commandstats 2>/dev/null | tr -d '\r' |
		awk -F'[:,=]' '/^cmdstat_wait:/ { calls = $3 } END { print calls + 0 }' || echo 0
}

queue_load() { # full|paced COMMAND ARGS...: COMMAND under the queue section's wrk load
	# Dynamic scope: wrk_start sees these CONNECTIONS, WRK_SCRIPT and PACE_MS.
	local CONNECTIONS=$CONNECTIONS WRK_SCRIPT=$LIB/post.lua PACE_MS=0
	[[ $1 == paced ]] && CONNECTIONS=$LATENCY_CONNECTIONS PACE_MS=${PACE_MS_PACED}
	export PACE_MS
	"${@:2}"
}

# ---------------------------------------------------------------------------------------------
# FastCGI section: nginx fastcgi_pass and levee's fastcgi:// upstream in front of one php-fpm
# ---------------------------------------------------------------------------------------------
FASTCGI_SKIP='' FPM_VERSION='' FPM_OPCACHE='' FPM_PIDS=''
declare -A FPM_TICKS=() FPM_ROUND_PCT=() FPM_CORE_ROUND_PCT=() # per case: php-fpm's CPU and its core's busy time
# The section's cases, in the report's order: each proxy with its FastCGI connections kept
# open between requests (nginx keepalive 32 + fastcgi_keep_conn on, levee pool_max_idle = 32),
# then each with a connection per request (nginx's default, fastcgi_keep_conn off, and levee's
# default for fastcgi://). Each levee is compared with the nginx that handles connections alike.
FASTCGI_CASES=(fcgi-nginx-keep fcgi-levee-keep fcgi-nginx-close fcgi-levee-close)
LABEL[fcgi-nginx-keep]="nginx fastcgi_pass, keepalive 32, fastcgi_keep_conn on"
LABEL[fcgi-levee-keep]="levee fastcgi://, pool_max_idle = 32"
LABEL[fcgi-nginx-close]="nginx fastcgi_pass, fastcgi_keep_conn off (a connection per request)"
LABEL[fcgi-levee-close]="levee fastcgi://, default (a connection per request)"

# fastcgi_round ID ROUND: measure_round, plus what php-fpm and its core(s) did meanwhile.
# php-fpm is likely what sets the pace here (PHP's work per request is larger than a proxy's,
# and its core is shared with wrk), so the report needs to show how busy that core was.
fastcgi_round() {
	local id=$1 f0 f1 c0 c1 w0 w1
	# shellcheck disable=SC2086 # space-separated pid and core lists
	{
		f0=$(cpu_ticks $FPM_PIDS) c0=$(core_busy $FPM_CORES) w0=$(now_us)
		measure_round "$id" "$2" || return 1
		f1=$(cpu_ticks $FPM_PIDS) c1=$(core_busy $FPM_CORES) w1=$(now_us)
	}
	FPM_TICKS[$id]=$((${FPM_TICKS[$id]:-0} + f1 - f0))
	FPM_ROUND_PCT[$id]+=" $(calc "printf \"%.0f\", 100 * ($f1 - $f0) / (($w1 - $w0) / 1e6 * $CLK_TCK * $FPM_NCORES)")"
	FPM_CORE_ROUND_PCT[$id]+=" $(calc "printf \"%.0f\", 100 * ($c1 - $c0) / (($w1 - $w0) / 1e6 * $CLK_TCK * $FPM_NCORES)")"
}

section_fastcgi() { # nginx fastcgi_pass and levee fastcgi://, side by side, to one php-fpm
	local dir=$TMP/fastcgi port user id round url fpm_pid variant pool i
	local -a order
	local -A pid_of=() url_of=()
	log "section: FastCGI, nginx fastcgi_pass and levee fastcgi:// in front of one php-fpm"
	if ! command -v "$PHP_FPM" >/dev/null; then
		FASTCGI_SKIP="not run: $PHP_FPM is not installed (Debian package php-fpm)"
		warn "fastcgi: $FASTCGI_SKIP"
		return
	fi
	mkdir -p "$dir/www/shop"
	render_policy check-fastcgi fastcgi.toml.tmpl 1 2 FPM_PORT=3 FPM_ROOT="$dir/www" POOL="pool_max_idle = 32" || {
		broken "fastcgi: the levee policy did not render"
		return
	}
	if ! check_policy "$TMP/policies/check-fastcgi"; then
		FASTCGI_SKIP="not yet available: $SLOT_REASON"
		log "fastcgi: $FASTCGI_SKIP"
		return
	fi
	# The 1 KiB answer of the other cases, at the path they ask for. opcache.php tells what
	# opcache does in the workers themselves (`php-fpm -i` shows the ini, not the pool's state).
	printf '%s\n' "<?php header('Content-Type: text/plain'); echo str_repeat('x', 1024);" >"$dir/www/shop/cart.php"
	printf '%s\n' "<?php header('Content-Type: text/plain');" \
		"\$s = function_exists('opcache_get_status') ? opcache_get_status(false) : false;" \
		"printf('opcache.enable=%s, opcache in use: %s, JIT: %s', ini_get('opcache.enable') ?: '0'," \
		"	(\$s && \$s['opcache_enabled']) ? 'yes' : 'no', (\$s && !empty(\$s['jit']['on'])) ? 'on' : 'off');" \
		>"$dir/www/opcache.php"
	chmod -R a+rX "$dir" # php-fpm's and nginx's workers run unprivileged when started as root
	user="; not root: the workers run as the harness's own user"
	((EUID != 0)) || user=$'user = www-data\ngroup = www-data' # php-fpm runs no worker as root
	take_port FPM_PORT
	render "$CONF/php-fpm.conf.tmpl" "$dir/php-fpm.conf" DIR="$dir" PORT="$FPM_PORT" CHILDREN="$FPM_CHILDREN" USER="$user" || {
		broken "fastcgi: php-fpm's configuration did not render"
		return
	}
	taskset -c "$BACKEND_CPUS" "$PHP_FPM" -F -y "$dir/php-fpm.conf" >"$dir/stdout.log" 2>&1 &
	if ! started "php-fpm" $! "$dir/php-fpm.log" "$FPM_PORT"; then
		broken "fastcgi: php-fpm did not start"
		return
	fi
	fpm_pid=$LAST_PID
	FPM_VERSION=$("$PHP_FPM" -v | head -n1 | sed 's/ (fpm-fcgi).*//; s/ (built.*//')

	for variant in keep close; do
		id=fcgi-nginx-$variant
		take_port port
		mkdir -p "$dir/nginx-$variant"
		if ! render "$CONF/fastcgi-nginx.conf.tmpl" "$dir/nginx-$variant/nginx.conf" DIR="$dir/nginx-$variant" \
			PORT="$port" FPM_PORT="$FPM_PORT" ROOT="$dir/www" KEEP_CONN="$([[ $variant == keep ]] && echo on || echo off)"; then
			broken "fastcgi: ${LABEL[$id]}: nginx's configuration did not render"
		else
			taskset -c "$PROXY_CPUS" nginx -c "$dir/nginx-$variant/nginx.conf" -p "$dir/nginx-$variant/" \
				-e "$dir/nginx-$variant/error.log" -g 'daemon off;' >"$dir/nginx-$variant/stdout.log" 2>&1 &
			if started "nginx ($id)" $! "$dir/nginx-$variant/error.log" "$port"; then
				pid_of[$id]=$LAST_PID url_of[$id]=http://127.0.0.1:$port$REQUEST_PATH
			else
				broken "fastcgi: ${LABEL[$id]}: nginx did not start"
			fi
		fi
		id=fcgi-levee-$variant
		pool="# pool_max_idle: levee's default for fastcgi:// (0: a connection per request)"
		[[ $variant != keep ]] || pool="pool_max_idle = 32                              # as nginx's keepalive 32"
		if start_levee_section "$id" fastcgi.toml.tmpl FPM_PORT="$FPM_PORT" FPM_ROOT="$dir/www" POOL="$pool"; then
			pid_of[$id]=$SEC_PID url_of[$id]=http://127.0.0.1:$SEC_PORT$REQUEST_PATH
		else
			broken "fastcgi: ${LABEL[$id]}: levee did not start"
		fi
	done
	for id in "${FASTCGI_CASES[@]}"; do
		[[ -n ${pid_of[$id]:-} ]] || continue
		url=${url_of[$id]}
		if ! probe "$url" 1024; then
			broken "fastcgi: ${LABEL[$id]}: $PROBE_ERROR"
			continue
		fi
		[[ -n $FPM_OPCACHE ]] || FPM_OPCACHE=$(curl -s --max-time 5 "${url%"$REQUEST_PATH"}/opcache.php") || FPM_OPCACHE=''
		log "  ${LABEL[$id]}: warm-up"
		warm_up "$id" "${pid_of[$id]}" "$url" 1 || true
	done
	FPM_PIDS=$(descendants "$fpm_pid") # after the warm-ups: the master and its children
	# Every proxy stays up (the idle ones wait, using nothing but the php-fpm children their
	# kept connections hold), and the rounds run the cases in turn, forwards then backwards, as
	# measure_cases does, so a slow spell of the machine lands on all of them.
	for ((round = 1; round <= ROUNDS; round++)); do
		order=("${FASTCGI_CASES[@]}")
		if ((round % 2 == 0)); then
			order=()
			for ((i = ${#FASTCGI_CASES[@]} - 1; i >= 0; i--)); do order+=("${FASTCGI_CASES[i]}"); done
		fi
		for id in "${order[@]}"; do
			[[ ${STATUS[$id]:-} == warm ]] || continue
			fastcgi_round "$id" "$round" || true
		done
	done
	for id in "${FASTCGI_CASES[@]}"; do
		[[ ${STATUS[$id]:-} != warm ]] || finish_measure "$id"
		[[ -z ${pid_of[$id]:-} ]] || stop_pid "${pid_of[$id]}"
	done
	stop_pid "$fpm_pid"
}

# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
REPORT=
out() { REPORT+="$*"$'\n'; }

ms() { [[ -n ${1:-} ]] && calc "printf \"%.2f ms\", $1 / 1000" || echo "—"; }
mib() { [[ -n ${1:-} ]] && calc "printf \"%.1f MiB\", $1 / 1024" || echo "—"; }
ratio() { [[ -n ${1:-} && -n ${2:-} ]] && calc "if ($2 > 0) printf \"%.2f×\", $1 / $2; else printf \"—\"" || echo "—"; }

judged() { # VALUE TARGET: VALUE as "N.NN×", with a third decimal where two would print the
	# target itself for a value on the other side of it ("FAIL … 1.00×" for 0.996 against 1.0)
	calc "v = sprintf(\"%.2f\", $1); t = sprintf(\"%.2f\", $2); if (v == t && $1 != $2) printf \"%.3f×\", $1; else printf \"%.2f×\", $1"
}

pass_fail() { # CONDITION(awk expr) TEXT
	if calc "exit !($1)"; then out "- PASS $2"; else out "- FAIL $2"; fi
}

report_header() {
	local levee_rev
	levee_rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "?")
	[[ -z $(git -C "$REPO" status --porcelain -- src Cargo.toml Cargo.lock 2>/dev/null) ]] || levee_rev+=" + uncommitted changes"
	out "# levee benchmark, $(date -u '+%Y-%m-%d %H:%M:%S UTC')${SUFFIX:+ ($MODE)}"
	[[ $MODE == smoke ]] && out "" && out "**Smoke run** (--smoke): ${DURATION} s per case, 1 round; checks that everything works, numbers are indicative only."
	out ""
	out "## What ran"
	out ""
	out "- $("$LEVEE" --version) (git $levee_rev), release build"
	out "- $(nginx -v 2>&1 | sed 's/^nginx version: //'), $(haproxy -v | head -n1 | sed 's/ - .*//; s/ version//'), $(wrk -v 2>&1 | head -n1 | sed 's/ Copyright.*//'), $(redis-server --version | sed 's/ sha=.*//; s/ server v=/ /')"
	out "- machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')), Linux $(uname -r), loopback only"
	out "- pinning: every proxy on CPU $PROXY_CPUS with one worker (nginx worker_processes 1, HAProxy nbthread 1, levee --threads 1); wrk on CPU $LOAD_CPUS; backend nginx ($BACKEND_WORKERS worker) and Redis on CPU $BACKEND_CPUS."
	out "  The proxy owns its core alone; wrk and the backend share the other, so their cost is the same in every case and ratios compare proxies. Absolute numbers are lower than on a larger machine."
	out "- load: wrk -t $WRK_THREADS -c $CONNECTIONS -d ${DURATION}s --latency, ${WARMUP} s warm-up per case, $ROUNDS round(s) interleaved across the cases (round 1 of every case, then round 2 in reverse order, …), median of rounds"
	out "- backend: nginx \`return 200\` with a 1 KiB body at every path but /page.html, a 50 KiB static page (with a \`<div id=\"ranking\">\` module)"
	out "- request: every 1 KiB case of the table below asks for $REQUEST_PATH (the path the full policy's last route matches); the page cases for /page.html"
}

report_cases() {
	local id base
	local -a noisy=()
	out ""
	out "## Throughput and latency"
	out ""
	out "| # | case | req/s | p50 | p99 | p99.9 | errors | proxy CPU s / 100k req | proxy peak RSS | req/s vs nginx | p99 vs nginx | other load on proxy core | load core(s) busy |"
	out "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
	for id in "${CASES[@]}"; do
		if [[ ${STATUS[$id]} != ok ]]; then
			out "| $id | ${LABEL[$id]} | ${STATUS[$id]}: ${NOTE[$id]:-} | | | | | | | | | | |"
			continue
		fi
		base=2
		[[ $id == 8b || $id == 6 ]] && base=8a # the page cases compare with nginx on the page
		out "| $id | ${LABEL[$id]} | $(printf '%.0f' "${RPS[$id]}") | $(ms "${P50[$id]}") | $(ms "${P99[$id]}") | $(ms "${P999[$id]}") | ${ERR[$id]} | ${CPU[$id]} | $(mib "${HWM[$id]}") | $(ratio "${RPS[$id]}" "${RPS[$base]:-}") | $(ratio "${P99[$id]}" "${P99[$base]:-}") | ${OTHER[$id]}% | ${LOAD_BUSY[$id]}% |"
		calc "exit !(${OTHER_MAX[$id]} > $NOISE_PCT)" && noisy+=("$id (up to ${OTHER_MAX[$id]}%)")
	done
	out ""
	out "Errors: wrk socket errors + HTTP status ≥ 400 (no 3xx here), warm-up included. CPU: utime+stime of the proxy process and its children (nginx master + worker) over the measured rounds. Peak RSS: VmHWM summed over those processes. Case 1 shows the backend nginx's own CPU and RSS. \"vs nginx\" is against case 2 (nginx proxy_pass), for 6 and 8b against case 8a (nginx on the 50 KiB page); req/s higher is better, p99 lower is better. Other load on proxy core: busy time of CPU $PROXY_CPUS not charged to the proxy (other processes, interrupt work), median of rounds. Load core(s) busy: busy time of CPU $LOAD_CORES_TEXT (wrk, the backend, Redis), median of rounds; near 100% the proxy is not what limits req/s, and the proxy CPU per request tells more."
	if ((${#noisy[@]})); then
		out ""
		out "**Warning: noisy machine.** More than $NOISE_PCT% of the proxy core went to something other than the proxy in cases ${noisy[*]}. Those numbers are unreliable; rerun on a quiet machine."
	fi
	local -a pairs=("4:3:levee pass-through vs HAProxy" "5:4:levee route table vs levee pass-through"
		"5b:5:+ 2 Redis limits + breaker vs routes only" "5c:5b:+ bulkhead vs 5b"
		"5c:4:levee full policy vs levee pass-through"
		"7b:7:levee limit vs nginx limit_req" "8b:8a:levee vs nginx, 50 KiB page" "6:8b:levee hide vs levee pass-through, 50 KiB page")
	local pair a b
	out ""
	out "| comparison | req/s ratio | p99 ratio | requests per proxy CPU-second ratio |"
	out "|---|---:|---:|---:|"
	for pair in "${pairs[@]}"; do
		IFS=: read -r a b _ <<<"$pair"
		if [[ ${STATUS[$a]:-} == ok && ${STATUS[$b]:-} == ok ]]; then
			out "| ${pair#*:*:} | $(ratio "${RPS[$a]}" "${RPS[$b]}") | $(ratio "${P99[$a]}" "${P99[$b]}") | $(ratio "${CPU[$b]}" "${CPU[$a]}") |"
		else
			out "| ${pair#*:*:} | n/a (case $a or $b did not run) | | |"
		fi
	done
	# p99 round by round for the proxies the pass-through targets compare: how much of a
	# difference between medians is the machine, and how much the proxy.
	local rounds_text=
	for id in 2 3 4; do
		[[ ${STATUS[$id]:-} == ok ]] || continue
		rounds_text+="${rounds_text:+; }case $id:$(for v in ${ROUND_P99[$id]}; do calc "printf \" %.2f\", $v / 1000"; done)"
	done
	if [[ -n $rounds_text ]] && ((ROUNDS > 1)); then
		out ""
		out "p99 of each round in ms, rounds 1 to $ROUNDS (each round ran the cases one after another): $rounds_text."
	fi
	for id in "${CASES[@]}"; do
		[[ ${STATUS[$id]} == ok && -n ${NOTE[$id]:-} ]] && out "" && out "Case $id: ${NOTE[$id]}"
	done
	return 0
}

report_sections() {
	out ""
	out "## Memory and reloads (levee)"
	out ""
	out "- idle RSS right after start (pass-through policy): $(mib "$IDLE_RSS")"
	out "- RSS with $IDLE_CONNS idle keep-alive connections: $(mib "$CONNS_RSS")${CONNS_NOTE:+ ($CONNS_NOTE)}"
	out "- reload time with $RELOAD_ROUTES routes, median: ${RELOAD_MS:-—} ms${RELOAD_NOTE:+ ($RELOAD_NOTE)}"
	out "- failed requests during $RELOADS reloads under load: ${RELOAD_FAILED:-—}${RELOAD_LOAD_NOTE:+ ($RELOAD_LOAD_NOTE)}"
}

usec() { calc "printf \"%+.2f ms\", ($1) / 1000"; } # EXPR: a difference in µs, signed, as ms

# paired_p99 A B: A's p99 against B's, round by round. The rounds are interleaved, so round r of
# A ran right next to round r of B, and a slow spell of the machine lands on both; the median of
# the per-round ratios is steadier than the ratio of the two medians. Prints "RATIO WINS ROUNDS":
# the median of A/B, and in how many rounds A's p99 was at most B's.
paired_p99() {
	local -a a b
	read -r -a a <<<"${ROUND_P99[$1]}"
	read -r -a b <<<"${ROUND_P99[$2]}"
	local i n=${#a[@]} wins=0 ratios=()
	((n == ${#b[@]} && n > 0)) || return 1
	for ((i = 0; i < n; i++)); do
		ratios+=("$(calc "printf \"%.4f\", ${a[i]} / ${b[i]}")")
		((a[i] > b[i])) || wins=$((wins + 1))
	done
	echo "$(median "${ratios[@]}") $wins $n"
}

paired_difference() { # FIELD A B: median over the rounds of A's per-round FIELD (P50, P99) minus B's
	local -n rounds_of=ROUND_$1
	local -a a b differences=()
	read -r -a a <<<"${rounds_of[$2]}"
	read -r -a b <<<"${rounds_of[$3]}"
	local i n=${#a[@]}
	((n == ${#b[@]} && n > 0)) || return 1
	for ((i = 0; i < n; i++)); do differences+=($((a[i] - b[i]))); done
	median "${differences[@]}"
}

rounds_ms() { # "µs µs …": the same in ms, for the report
	local v text=
	for v in $1; do text+="${text:+ }$(calc "printf \"%.2f\", $v / 1000")"; done
	echo "${text:-—}"
}

paired_ratio() { # LIST: "MEDIAN LOWEST HIGHEST COUNT" of a space-separated list of ratios; fails when empty
	local -a r
	read -r -a r <<<"$1"
	((${#r[@]})) || return 1
	echo "$(median "${r[@]}") $(printf '%s\n' "${r[@]}" | sort -g | sed -n '1p;$p' | tr '\n' ' ')${#r[@]}"
}

# rps_target A B TARGET TEXT [NOTE]: the target "A's req/s ≥ TARGET × B's", judged on the median
# of the paired runs' ratios (measure_pairs) when there are any, else on the rounds' medians.
rps_target() {
	local paired median low high n cpu=
	if paired=$(paired_ratio "${PAIR_RATIOS[$1 $2]:-}"); then
		read -r median low high n <<<"$paired"
		if paired=$(paired_ratio "${PAIR_CPU_RATIOS[$1 $2]:-}"); then
			cpu="; requests per proxy CPU-second $(printf '%.2f×' "${paired%% *}")"
		fi
		pass_fail "$median >= $3" "$4: $(judged "$median" "$3") (median of $n paired run$( ((n == 1)) || echo s), $(printf '%.2f' "$low")–$(printf '%.2f×' "$high")$cpu; from the rounds' medians: $(ratio "${RPS[$1]}" "${RPS[$2]}"))${5:+; $5}"
	else
		pass_fail "${RPS[$1]} >= $3 * ${RPS[$2]}" "$4: $(ratio "${RPS[$1]}" "${RPS[$2]}")${5:+ ($5)}"
	fi
}

report_pairs() {
	local pair a b ratios cpu
	((${#PAIR_RATIOS[@]})) || return 0
	out ""
	out "## Paired runs (the req/s targets)"
	out ""
	out "Each target's two cases, warm and still up after the rounds above, ran back to back $PAIR_RUNS time$( ((PAIR_RUNS == 1)) || echo s) for $PAIR_DURATION s each (A then B, then B then A, …), so that the machine's drifts in speed land on both. Per pair: A's req/s over B's, and requests per proxy CPU-second, A's over B's."
	out ""
	out "| A vs B | req/s ratio per pair | median | per CPU-second, median |"
	out "|---|---|---:|---:|"
	for pair in "${TARGET_PAIRS[@]}"; do
		[[ -n ${PAIR_RATIOS[$pair]:-} ]] || continue
		read -r a b <<<"$pair"
		ratios=$(printf '%.2f ' ${PAIR_RATIOS[$pair]})
		cpu=$(paired_ratio "${PAIR_CPU_RATIOS[$pair]:-}") && cpu=$(printf '%.2f×' "${cpu%% *}") || cpu=—
		out "| $a (${LABEL[$a]}) vs $b (${LABEL[$b]}) | ${ratios% } | $(printf '%.2f×' "$(median ${PAIR_RATIOS[$pair]})") | $cpu |"
	done
}

report_budget() {
	local pair a b ratios
	wanted budget || return 0
	out ""
	out "## Under a CPU limit (the req/s targets with the proxy setting the pace)"
	out ""
	if [[ -n $BUDGET_SKIPPED ]]; then
		out "Skipped: $BUDGET_SKIPPED."
		return 0
	fi
	((${#BUDGET_RATIOS[@]})) || {
		out "Not run (a case of the pairs did not run)."
		return 0
	}
	out "Each proxy held to $BUDGET_PCT% of one core by a cgroup CPU quota ($((BUDGET_PERIOD_US * BUDGET_PCT / 100)) µs of CPU every $BUDGET_PERIOD_US µs, one cgroup per proxy), as a container's CPU limit holds a sidecar, so that the proxy and not the core of wrk and the backend sets the pace: req/s then compares the proxies' own work per request. The same load as above; the two cases of a pair back to back $PAIR_RUNS time$( ((PAIR_RUNS == 1)) || echo s) for $PAIR_DURATION s each (A then B, then B then A, …). Throttled: the share of quota periods in which the proxy used up its quota (near 100%: the limit held it). CPU used: the proxy's own CPU time (utime+stime) over the run's, in % of a core; above $BUDGET_PCT% it ran past its quota (the kernel charges a thread that never sleeps at its timer ticks). Load core: how busy the core of wrk and the backend was (well under 100%: it did not hold the proxy back)."
	out ""
	out "| A vs B | req/s A / B, medians | req/s ratio per pair | median | p99 A / B, medians | p99 ratio, median | throttled A / B | CPU used A / B | load core busy A / B |"
	out "|---|---:|---|---:|---:|---:|---:|---:|---:|"
	for pair in "${BUDGET_PAIRS[@]}"; do
		[[ -n ${BUDGET_RATIOS[$pair]:-} ]] || continue
		read -r a b <<<"$pair"
		# shellcheck disable=SC2086 # the lists are space-separated numbers
		ratios=$(printf '%.2f ' ${BUDGET_RATIOS[$pair]})
		# shellcheck disable=SC2086
		out "| $a (${LABEL[$a]}) vs $b (${LABEL[$b]}) | $(printf '%.0f' "$(median ${BUDGET_RPS[$a]})") / $(printf '%.0f' "$(median ${BUDGET_RPS[$b]})") | ${ratios% } | $(printf '%.2f×' "$(median ${BUDGET_RATIOS[$pair]})") | $(ms "$(median ${BUDGET_P99[$a]})") / $(ms "$(median ${BUDGET_P99[$b]})") | $(printf '%.2f×' "$(median ${BUDGET_P99_RATIOS[$pair]})") | $(median ${BUDGET_THROTTLED[$a]})% / $(median ${BUDGET_THROTTLED[$b]})% | $(printf '%.1f' "$(median ${BUDGET_USED[$a]})")% / $(printf '%.1f' "$(median ${BUDGET_USED[$b]})")% | $(median ${BUDGET_LOAD[$a]})% / $(median ${BUDGET_LOAD[$b]})% |"
	done
}

budget_target() { # A B TARGET TEXT [P99_NAME]: A's req/s (and with P99_NAME, p99) against B's under the CPU limit, when the section ran
	local paired median low high n
	paired=$(paired_ratio "${BUDGET_RATIOS[$1 $2]:-}") || return 0
	read -r median low high n <<<"$paired"
	pass_fail "$median >= $3" "under a CPU limit of $BUDGET_PCT% of one core each, $4: $(judged "$median" "$3") (median of $n paired run$( ((n == 1)) || echo s), $(printf '%.2f' "$low")–$(printf '%.2f×' "$high"))"
	[[ -n ${5:-} ]] || return 0
	paired=$(paired_ratio "${BUDGET_P99_RATIOS[$1 $2]}") || return 0
	read -r median low high n <<<"$paired"
	pass_fail "$median <= 1" "under the same limit, levee pass-through p99 ≤ $5 p99: $(judged "$median" 1) (median of the per-pair ratios, $(printf '%.2f' "$low")–$(printf '%.2f×' "$high"))"
}

p99_target() { # A B NAME: the p99 target of case A against case B (named NAME), from paired rounds
	local paired ratio wins rounds
	if ! paired=$(paired_p99 "$1" "$2"); then
		pass_fail "${P99[$1]} <= ${P99[$2]}" "levee pass-through p99 ≤ $3 p99: $(ms "${P99[$1]}") vs $(ms "${P99[$2]}")"
		return
	fi
	read -r ratio wins rounds <<<"$paired"
	pass_fail "$ratio <= 1" "levee pass-through p99 ≤ $3 p99: $(judged "$ratio" 1) (median of the per-round ratios; levee's p99 was at most $3's in $wins of $rounds rounds; medians $(ms "${P99[$1]}") vs $(ms "${P99[$2]}"))"
}

limiter_row() { # ID LABEL: a levee row of the limiter tables, from measure
	if [[ ${STATUS[$1]:-} == ok ]]; then
		out "| $2 | $(printf '%.0f' "${RPS[$1]}") | $(ms "${P50[$1]}") | $(ms "${P99[$1]}") | $(ms "${P999[$1]}") | ${ERR[$1]} | ${CPU[$1]} | ${OTHER[$1]}% |"
	else
		out "| $2 | ${STATUS[$1]:-failed} (see Broken) | | | | | | |"
	fi
}

noisy_note() { # ID...: the noisy-machine warning for these measurements, when it applies
	local id noisy=()
	for id; do
		[[ ${STATUS[$id]:-} == ok ]] && calc "exit !(${OTHER_MAX[$id]} > $NOISE_PCT)" && noisy+=("$id (up to ${OTHER_MAX[$id]}%)")
	done
	((${#noisy[@]} == 0)) && return 0
	out ""
	out "**Warning: noisy machine.** More than $NOISE_PCT% of the proxy core went to something other than the proxy in ${noisy[*]}. Those numbers are unreliable; rerun on a quiet machine."
}

report_limiter() {
	local id=limiter-rate share
	if wanted limiter-rate; then
		out ""
		out "## Rate limiter: decisions/s vs the Redis EVALSHA ceiling"
		out ""
		out "Ceiling: \`redis-benchmark\` on CPU $LOAD_CPUS (where wrk runs) against the harness's Redis (CPU $BACKEND_CPUS), sending the EVALSHA levee sends: \`src/limit/script.lua\` loaded with SCRIPT LOAD, \`EVALSHA <sha> ${EVALSHA_ARGS[*]}\` (every call admits${CEIL_NOTE:+; $CEIL_NOTE}). levee: one route with one Redis limit rule that never refuses (\`policies/limiter.toml.tmpl\`), wrk -c $CONNECTIONS; one request is one decision, so decisions/s = levee's req/s."
		out ""
		out "| what | decisions/s | p50 | p99 | p99.9 | errors | proxy CPU s / 100k req | other load on proxy core |"
		out "|---|---:|---:|---:|---:|---:|---:|---:|"
		if [[ -n $CEIL_RPS ]]; then
			out "| Redis EVALSHA ceiling (redis-benchmark) | $(printf '%.0f' "$CEIL_RPS") | $(ms "$CEIL_P50") | $(ms "$CEIL_P99") | — | 0 | — | — |"
		else
			out "| Redis EVALSHA ceiling (redis-benchmark) | failed (see Broken) | | | | | | |"
		fi
		if [[ -n $DIRECT_RPS ]]; then
			out "| levee's limiter driven directly (limiter-bench) | $(printf '%.0f' "$DIRECT_RPS") | $(ms "$DIRECT_P50") | $(ms "$DIRECT_P99") | — | 0 | — | — |"
		else
			out "| levee's limiter driven directly (limiter-bench) | ${DIRECT_NOTE:-failed (see Broken)} | | | | | | |"
		fi
		limiter_row "$id" "levee, one Redis limit rule (HTTP proxying included)"
		out ""
		if [[ -n $DIRECT_RPS ]]; then
			out "- levee's limiter / Redis ceiling: $(ratio "$DIRECT_RPS" "${CEIL_RPS:-}"). \`limiter-bench\` (\`bench/limiter_bench.rs\`) compiles the same policy (its Redis timeout 1 s instead of 25 ms: Redis shares its core with the driver, and a slow moment is waited for rather than decided in-process) and calls \`Limiter::check\`, the call the proxy makes per request, with $CONNECTIONS decisions in flight on one thread (tokio's current-thread scheduler), each for another of 100,000 client addresses, pinned where redis-benchmark runs (CPU $LOAD_CPUS). Decisions Redis made: $DIRECT_REDIS; made without Redis (timeout fallback): $DIRECT_OTHER. redis-benchmark waits for each reply before the next call on each of its $CONNECTIONS connections (\`-P 1\`), like that many separate clients; levee keeps up to two script calls at Redis and sends the decisions that wait meanwhile together in its next call, so Redis runs one call for many decisions and levee can go past that ceiling."
			[[ $DIRECT_OTHER == 0 ]] || out "- **limiter-bench decided $DIRECT_OTHER calls without Redis**: Redis overran even the 1 s timeout; those calls did not pay the EVALSHA, so the direct figure is not a clean Redis figure."
		fi
		if [[ ${STATUS[$id]:-} == ok ]]; then
			share=$(calc "if (${RPS[$id]} > 0) printf \"%.1f\", 100 * ${DEC_RATE[$id]} / ${RPS[$id]}")
			out "- levee / Redis ceiling: $(ratio "${RPS[$id]}" "${CEIL_RPS:-}")"
			out "- confirmed by levee's \`/metrics\`: \`levee_ratelimit_decisions_total{…,source=\"redis\"}\` grew by ${DECISIONS[$id]} over the measured rounds for ${REQS[$id]} requests, $(printf '%.0f' "${DEC_RATE[$id]}") decisions/s (${share}% of req/s); decisions made another way (ahead, fallback, local, cache): ${DEC_OTHER[$id]}"
			[[ ${DEC_OTHER[$id]} == 0 ]] || out "- **levee decided ${DEC_OTHER[$id]} requests without Redis** (Redis slower than levee's timeout, or down): those requests did not pay the EVALSHA."
		fi
		out "- levee's number includes the whole HTTP proxying work on the proxy core (accept, parse, route, forward to the backend nginx and relay its 1 KiB answer), one EVALSHA per request on top; redis-benchmark only talks to Redis. The ratio is the share of Redis's ceiling that a single-core levee turns into proxied, rate-limited requests."
		[[ $LOAD_CPUS != "$BACKEND_CPUS" ]] ||
			out "- LOAD_CPUS = BACKEND_CPUS ($LOAD_CPUS): redis-benchmark shares its core with Redis, as wrk shares it with Redis and the backend nginx in the levee run."
		noisy_note "$id"
	fi
	if wanted limiter-latency; then
		out ""
		out "## Rate limiter: added latency at moderate load"
		out ""
		out "The same levee and route (\`policies/limiter.toml.tmpl\`) without and with the one Redis limit rule, wrk -t $WRK_THREADS -c $LATENCY_CONNECTIONS -d ${DURATION}s with each connection pausing ${PACE_MS} ms after every answer (\`lib/paced.lua\`: a moderate load, far from saturating the proxy core), ${WARMUP} s warm-up, $ROUNDS round(s), median."
		out ""
		out "| levee | req/s | p50 | p99 | p99.9 | errors | proxy CPU s / 100k req | other load on proxy core |"
		out "|---|---:|---:|---:|---:|---:|---:|---:|"
		limiter_row limiter-off "route without a limit"
		limiter_row limiter-on "route with one Redis limit rule"
		if [[ ${STATUS[limiter-off]:-} == ok && ${STATUS[limiter-on]:-} == ok ]]; then
			local field added cells=
			for field in P50 P99 P999; do
				local -n medians=$field
				added=$(paired_difference "$field" limiter-on limiter-off) || added="${medians[limiter-on]} - ${medians[limiter-off]}"
				cells+=" $(usec "$added") |"
				unset -n medians
			done
			out "| added by the limiter (median of per-round differences) | |$cells | | |"
			out ""
			out "With the rule, \`/metrics\` counted ${DECISIONS[limiter-on]} Redis decisions for ${REQS[limiter-on]} requests (other sources: ${DEC_OTHER[limiter-on]})."
		fi
		noisy_note limiter-off limiter-on
	fi
	return 0
}

report_queue() {
	wanted queue || return 0
	out ""
	out "## Queue: a job's 202 without and with a replica's acknowledgement"
	out ""
	out "One route that queues every POST (\`policies/queue.toml.tmpl\`, \`always_queue\`), Redis with one replica (both on the backend core). \`wait_replicas = 1\` answers 202 only once the replica acknowledged the job (\`WAIT 1\`, jobs arriving meanwhile sent together). Full load: wrk -t $WRK_THREADS -c $CONNECTIONS; moderate: -c $LATENCY_CONNECTIONS, each connection pausing ${PACE_MS_PACED} ms after every answer (\`lib/post.lua\`). ${DURATION} s, ${WARMUP} s warm-up, $ROUNDS round(s), median; the two variants' rounds alternate. The workers replay the jobs to the backend meanwhile, in both."
	out ""
	out "| levee | req/s | p50 | p99 | p99.9 | errors | proxy CPU s / 100k req | other load on proxy core |"
	out "|---|---:|---:|---:|---:|---:|---:|---:|"
	local load variant id
	for load in full paced; do
		for variant in 0 1; do
			limiter_row "queue-$variant-$load" "$load load, wait_replicas = $variant"
		done
	done
	for load in full paced; do
		local a=queue-1-$load b=queue-0-$load
		[[ ${STATUS[$a]:-} == ok && ${STATUS[$b]:-} == ok ]] || continue
		local field added cells=
		for field in P50 P99 P999; do
			local -n medians=$field
			added=$(paired_difference "$field" "$a" "$b") || added="${medians[$a]} - ${medians[$b]}"
			cells+=" $(usec "$added") |"
			unset -n medians
		done
		out "| $load load: waiting for the replica (req/s ratio; median of per-round latency differences) | $(ratio "${RPS[$a]}" "${RPS[$b]}") |$cells | | |"
	done
	local waits=
	for load in full paced; do
		id=queue-1-$load
		[[ ${STATUS[$id]:-} == ok && ${QUEUE_WAITS[$id]:-0} -gt 0 ]] || continue
		waits+="${waits:+; }$load load: ${REQS[$id]} jobs, ${QUEUE_WAITS[$id]} WAITs ($(calc "printf \"%.1f\", ${REQS[$id]} / ${QUEUE_WAITS[$id]}") jobs per WAIT)"
	done
	if [[ -n $waits ]]; then
		out ""
		out "With \`wait_replicas = 1\`, Redis ran (\`INFO commandstats\`, measured rounds): $waits."
	fi
	out ""
	out "Jobs left in the stream when the section ended: ${QUEUE_BACKLOG:-unknown}. Redis's stalls over 10 ms during the section (\`LATENCY LATEST\`: event, last, worst ms): ${QUEUE_STALLS:-none}."
	noisy_note queue-0-full queue-1-full queue-0-paced queue-1-paced
}

declare -A FCGI_CORE_BUSY=() FCGI_FPM_BUSY=() FCGI_FPM_CPU=() # per case: medians of the rounds' busy shares; php-fpm CPU s / 100k req

fastcgi_row() { # ID: a row of the FastCGI table
	local id=$1
	if [[ ${STATUS[$id]:-} != ok ]]; then
		out "| ${LABEL[$id]} | ${STATUS[$id]:-failed} (see Broken) | | | | | | | | | |"
		return
	fi
	out "| ${LABEL[$id]} | $(printf '%.0f' "${RPS[$id]}") | $(ms "${P50[$id]}") | $(ms "${P99[$id]}") | $(ms "${P999[$id]}") | ${ERR[$id]} | ${CPU[$id]} | $(mib "${HWM[$id]}") | ${OTHER[$id]}% | ${FCGI_FPM_CPU[$id]} | ${FCGI_CORE_BUSY[$id]}% (${FCGI_FPM_BUSY[$id]}%) |"
}

report_fastcgi() {
	wanted fastcgi || return 0
	local id pair a b p99_paired core rest
	out ""
	out "## FastCGI: php-fpm behind nginx fastcgi_pass and behind levee"
	out ""
	if [[ -n $FASTCGI_SKIP ]]; then
		out "${FASTCGI_SKIP^}."
		return 0
	fi
	for id in "${FASTCGI_CASES[@]}"; do
		[[ ${STATUS[$id]:-} == ok ]] || continue
		# shellcheck disable=SC2086 # space-separated lists of numbers
		FCGI_CORE_BUSY[$id]=$(median ${FPM_CORE_ROUND_PCT[$id]}) FCGI_FPM_BUSY[$id]=$(median ${FPM_ROUND_PCT[$id]})
		FCGI_FPM_CPU[$id]=$(calc "if (${REQS[$id]} > 0) printf \"%.2f\", ${FPM_TICKS[$id]:-0} / $CLK_TCK / ${REQS[$id]} * 100000")
	done
	out "One php-fpm pool (${FPM_VERSION:-$PHP_FPM}, \`pm = static\`, $FPM_CHILDREN children, \`conf/php-fpm.conf.tmpl\`) on CPU $BACKEND_CPUS runs a script that answers 1 KiB (\`header('Content-Type: text/plain'); echo str_repeat('x', 1024);\`) at $REQUEST_PATH. opcache as the distribution sets it, read by a script in the pool: ${FPM_OPCACHE:-unknown}. In front of it, each on CPU $PROXY_CPUS with one worker: nginx as the PHP vhost (\`conf/fastcgi-nginx.conf.tmpl\`: \`fastcgi_pass\`, Debian's \`fastcgi_params\`, \`SCRIPT_FILENAME \$document_root\$fastcgi_script_name\`, and the forwarding fields levee gives PHP), and levee with a \`fastcgi://\` upstream, pass-through (\`policies/fastcgi.toml.tmpl\`); each with its FastCGI connections kept open (nginx \`keepalive 32\` + \`fastcgi_keep_conn on\`, levee \`pool_max_idle = 32\`) and with a connection per request (nginx's default \`fastcgi_keep_conn off\`, levee's default for \`fastcgi://\`). wrk -t $WRK_THREADS -c $CONNECTIONS -d ${DURATION}s on CPU $LOAD_CPUS, ${WARMUP} s warm-up, $ROUNDS round(s), the cases' rounds in turn (forwards, then backwards), median."
	out ""
	out "| proxy | req/s | p50 | p99 | p99.9 | errors | proxy CPU s / 100k req | proxy peak RSS | other load on proxy core | php-fpm CPU s / 100k req | php-fpm's core busy (php-fpm's own share) |"
	out "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
	for id in "${FASTCGI_CASES[@]}"; do fastcgi_row "$id"; done
	out ""
	out "| comparison | req/s ratio | p99 ratio (per-round median) | proxy CPU per request ratio | php-fpm CPU per request ratio |"
	out "|---|---:|---:|---:|---:|"
	for pair in "fcgi-levee-keep:fcgi-nginx-keep:levee / nginx, connections kept" \
		"fcgi-levee-close:fcgi-nginx-close:levee / nginx, a connection per request" \
		"fcgi-levee-close:fcgi-nginx-keep:levee's default / nginx with keep-alive" \
		"fcgi-levee-keep:fcgi-levee-close:levee, kept / a connection per request"; do
		IFS=: read -r a b _ <<<"$pair"
		if [[ ${STATUS[$a]:-} != ok || ${STATUS[$b]:-} != ok ]]; then
			out "| ${pair#*:*:} | n/a (a case did not run) | | | |"
			continue
		fi
		p99_paired=$(paired_p99 "$a" "$b") && p99_paired=" ($(printf '%.2f×' "${p99_paired%% *}"))" || p99_paired=''
		out "| ${pair#*:*:} | $(ratio "${RPS[$a]}" "${RPS[$b]}") | $(ratio "${P99[$a]}" "${P99[$b]}")$p99_paired | $(ratio "${CPU[$a]}" "${CPU[$b]}") | $(ratio "${FCGI_FPM_CPU[$a]}" "${FCGI_FPM_CPU[$b]}") |"
	done
	out ""
	core="CPU $BACKEND_CPUS" rest="other processes"
	[[ $LOAD_CPUS != "$BACKEND_CPUS" ]] || core+=", which wrk shares" rest="wrk"
	out "Ratios are A / B of the medians; below 1× A spends less CPU per request, or has the lower p99; the p99 in brackets is the median of the per-round ratios (round r of each case ran one after the other). php-fpm's core ($core): busy time over each round, and in brackets php-fpm's own share of it (master and children); the rest is $rest. Near 100% that core sets the pace for every case, req/s and latency say more about it than about the proxies, and proxy CPU per request is the figure that compares them. php-fpm CPU per request shows what each proxy's way of talking to php-fpm costs PHP's side (a connect per request, the parameters sent, how the records are cut). The pool is sized for every FastCGI connection the proxies keep open at once: a kept connection holds its child until the proxy closes it."
	noisy_note "${FASTCGI_CASES[@]}"
}

report_targets() {
	out ""
	out "## Targets"
	out ""
	[[ $MODE == smoke ]] && out "Smoke run: shown for information, never a failure." && out ""
	if [[ ${STATUS[4]:-} == ok && ${STATUS[2]:-} == ok ]]; then
		# For scale: no proxy at all is the most any proxy case can reach on this machine's
		# load core, and proxy CPU per request compares the proxies' own work.
		local scale="proxy CPU per request, levee vs nginx: $(ratio "${CPU[4]}" "${CPU[2]}")"
		[[ ${STATUS[1]:-} != ok ]] || scale="no proxy at all (case 1) reaches $(ratio "${RPS[1]}" "${RPS[2]}") of nginx here; $scale"
		# The load core's ceiling: wrk and the backend cost about the same per request behind
		# any proxy, so levee's req/s with that core at 100% is the most it could reach here.
		if awk -v b="${LOAD_BUSY[4]:-0}" 'BEGIN { exit !(b > 0) }'; then
			local ceiling
			ceiling=$(awk -v r="${RPS[4]}" -v b="${LOAD_BUSY[4]}" 'BEGIN { printf "%.0f", r * 100 / b }')
			scale="$scale; the load core was ${LOAD_BUSY[4]}% busy under levee, so that core alone caps levee at about $(ratio "$ceiling" "${RPS[2]}") of nginx here"
		fi
		rps_target 4 2 "$TARGET_VS_NGINX" "levee pass-through req/s ≥ ${TARGET_VS_NGINX}× nginx proxy_pass" "$scale"
		p99_target 4 2 "nginx proxy_pass"
		budget_target 4 2 "$TARGET_VS_NGINX" "levee pass-through req/s ≥ ${TARGET_VS_NGINX}× nginx proxy_pass" "nginx proxy_pass"
	else
		out "- n/a levee pass-through vs nginx proxy_pass (a case did not run)"
	fi
	if [[ ${STATUS[4]:-} == ok && ${STATUS[3]:-} == ok ]]; then
		rps_target 4 3 "$TARGET_VS_HAPROXY" "levee pass-through req/s ≥ ${TARGET_VS_HAPROXY}× HAProxy"
		p99_target 4 3 HAProxy
		budget_target 4 3 "$TARGET_VS_HAPROXY" "levee pass-through req/s ≥ ${TARGET_VS_HAPROXY}× HAProxy" HAProxy
	else
		out "- n/a levee pass-through vs HAProxy (a case did not run)"
	fi
	if [[ ${STATUS[5c]:-} == ok && ${STATUS[4]:-} == ok ]]; then
		rps_target 5c 4 "$TARGET_FULL_VS_PASS" "levee full policy req/s ≥ ${TARGET_FULL_VS_PASS}× levee pass-through" "in the rounds, requests per proxy CPU-second: $(ratio "${CPU[4]}" "${CPU[5c]}"), load core(s) busy ${LOAD_BUSY[5c]}% against ${LOAD_BUSY[4]}%"
		budget_target 5c 4 "$TARGET_FULL_VS_PASS" "levee full policy req/s ≥ ${TARGET_FULL_VS_PASS}× levee pass-through"
	else
		out "- n/a levee full policy vs pass-through (a case did not run)"
	fi
	if [[ ${STATUS[6]:-} == ok && ${STATUS[8b]:-} == ok ]]; then
		rps_target 6 8b "$TARGET_HIDE_VS_PASS" "levee hide req/s ≥ ${TARGET_HIDE_VS_PASS}× levee pass-through of the 50 KiB page"
		budget_target 6 8b "$TARGET_HIDE_VS_PASS" "levee hide req/s ≥ ${TARGET_HIDE_VS_PASS}× levee pass-through of the 50 KiB page"
	else
		out "- n/a levee hide vs pass-through of the page (a case did not run)"
	fi
	if [[ -n $IDLE_RSS ]]; then
		pass_fail "$IDLE_RSS <= $TARGET_IDLE_MIB * 1024" "levee idle RSS ≤ $TARGET_IDLE_MIB MiB: $(mib "$IDLE_RSS")"
	else out "- n/a levee idle RSS"; fi
	if [[ -n $CONNS_RSS ]]; then
		pass_fail "$CONNS_RSS <= $TARGET_CONNS_MIB * 1024" "levee RSS with $IDLE_CONNS idle connections ≤ $TARGET_CONNS_MIB MiB: $(mib "$CONNS_RSS")"
	else out "- n/a levee RSS with idle connections"; fi
	if [[ -n $RELOAD_FAILED ]]; then
		pass_fail "$RELOAD_FAILED == 0" "0 failed requests during $RELOADS reloads under load: $RELOAD_FAILED"
	else out "- n/a failed requests during reloads"; fi
	if [[ -n $DIRECT_RPS && -n $CEIL_RPS ]]; then
		pass_fail "$DIRECT_RPS >= $TARGET_DECISIONS_VS_REDIS * $CEIL_RPS && $DIRECT_OTHER == 0" "limiter decisions/s ≥ ${TARGET_DECISIONS_VS_REDIS}× Redis EVALSHA ceiling, all by Redis: $(printf '%.0f' "$DIRECT_RPS") vs $(printf '%.0f' "$CEIL_RPS") = $(ratio "$DIRECT_RPS" "$CEIL_RPS") (limiter-bench; $DIRECT_OTHER without Redis)"
	else out "- n/a limiter decisions/s vs Redis EVALSHA ceiling (limiter-bench did not run)"; fi
	if [[ ${STATUS[limiter-rate]:-} == ok && -n $CEIL_RPS ]]; then
		out "- info: levee proxying HTTP with one Redis rule on every request, req/s vs the Redis EVALSHA ceiling: $(printf '%.0f' "${RPS[limiter-rate]}") vs $(printf '%.0f' "$CEIL_RPS") = $(ratio "${RPS[limiter-rate]}" "$CEIL_RPS") (bounded by the proxying work on one core, see the pass-through case)"
	fi
	if [[ ${STATUS[limiter-on]:-} == ok && ${STATUS[limiter-off]:-} == ok ]]; then
		local added
		added=$(paired_difference P99 limiter-on limiter-off) || added=$(calc "print ${P99[limiter-on]} - ${P99[limiter-off]}")
		pass_fail "$added <= $TARGET_ADDED_P99_MS * 1000" "p99 added ≤ $TARGET_ADDED_P99_MS ms: $(usec "$added") (median of the per-round differences, each round with the rule next to one without; medians $(ms "${P99[limiter-on]}") with the limit vs $(ms "${P99[limiter-off]}") without, wrk -c $LATENCY_CONNECTIONS paced ${PACE_MS} ms; rounds with: $(rounds_ms "${ROUND_P99[limiter-on]}"), without: $(rounds_ms "${ROUND_P99[limiter-off]}"))"
	else out "- n/a p99 added by the limiter"; fi
}

# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
ensure_packages
ensure_levee
check_cpus
CLK_TCK=$(getconf CLK_TCK)
PROXY_CORES=$(expand_cpus "$PROXY_CPUS")
PROXY_NCORES=$(wc -w <<<"$PROXY_CORES")
LOAD_CORES=$(printf '%s\n' $(expand_cpus "$LOAD_CPUS") $(expand_cpus "$BACKEND_CPUS") | sort -un | tr '\n' ' ')
LOAD_NCORES=$(wc -w <<<"$LOAD_CORES")
LOAD_CORES_TEXT=$(tr ' ' ',' <<<"${LOAD_CORES% }")
FPM_CORES=$(expand_cpus "$BACKEND_CPUS") # php-fpm's, in the fastcgi section
FPM_NCORES=$(wc -w <<<"$FPM_CORES")

# 5,000 idle clients need 5,000 descriptors in the client and twice that in levee.
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

TMP=$(mktemp -d "${TMPDIR:-/tmp}/levee-bench.XXXXXX")
chmod 755 "$TMP" # nginx workers run unprivileged when started as root and read www/ here
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mapfile -t PORT_POOL < <(python3 "$LIB/free_ports.py" 48) || die "cannot find free ports"
((${#PORT_POOL[@]} == 48)) || die "cannot find free ports"
take_port PORT_BACKEND
take_port PORT_REDIS

log "mode $MODE: ${DURATION} s x $ROUNDS round(s), $CONNECTIONS connections; proxy CPU $PROXY_CPUS, wrk CPU $LOAD_CPUS, backend CPU $BACKEND_CPUS"

# Backend nginx with its 1 KiB answer and the 50 KiB page.
mkdir -p "$TMP/backend/www"
python3 "$LIB/make_page.py" "$TMP/backend/www/page.html" 51200
chmod -R a+rX "$TMP/backend"
PAGE_BYTES=$(stat -c %s "$TMP/backend/www/page.html")
BODY_1K=$(printf 'levee benchmark body. %.0s' {1..47})
BODY_1K=${BODY_1K:0:1024}
render "$CONF/backend-nginx.conf.tmpl" "$TMP/backend/nginx.conf" DIR="$TMP/backend" PORT="$PORT_BACKEND" \
	WORKERS="$BACKEND_WORKERS" BODY_1K="$BODY_1K"
taskset -c "$BACKEND_CPUS" nginx -c "$TMP/backend/nginx.conf" -p "$TMP/backend/" -e "$TMP/backend/error.log" \
	-g 'daemon off;' >"$TMP/backend/stdout.log" 2>&1 &
started "backend nginx" $! "$TMP/backend/error.log" "$PORT_BACKEND" || die "the backend nginx did not start"
BACKEND_PID=$LAST_PID

# Redis for the limiter cases (slots for now), no persistence. Not daemonized: as our own
# child it is stopped and reaped by its pid like everything else (a daemonized Redis would be
# left a zombie where PID 1 does not reap).
mkdir -p "$TMP/redis"
taskset -c "$BACKEND_CPUS" redis-server --port "$PORT_REDIS" --bind 127.0.0.1 --save '' --appendonly no \
	--daemonize no --pidfile "$TMP/redis/redis.pid" --logfile "$TMP/redis/redis.log" --dir "$TMP/redis" &
started "redis-server" $! "$TMP/redis/redis.log" "$PORT_REDIS" || die "Redis did not start"
[[ $(redis-cli -h 127.0.0.1 -p "$PORT_REDIS" ping) == PONG ]] || die "Redis does not answer PING"

# The cases. Each proxy is started fresh and warmed up; then the measured rounds of all of them,
# interleaved (measure_cases); then each is stopped. Every 1 KiB case asks for REQUEST_PATH.
run_case 1 "backend direct (no proxy)" backend - "$REQUEST_PATH" 1024
run_case 2 "nginx proxy_pass, keepalive 64" nginx proxy-nginx.conf.tmpl "$REQUEST_PATH" 1024
run_case 3 "HAProxy http-keep-alive, http-reuse always" haproxy haproxy.cfg.tmpl "$REQUEST_PATH" 1024
run_case 4 "levee pass-through" levee passthrough.toml.tmpl "$REQUEST_PATH" 1024
# Case 5 and its growth into the full policy: routes only; + two Redis limit rules and a
# breaker; + a bulkhead (slot until levee has bulkheads).
run_case 5 "levee $ROUTES routes (routes only)" levee routes.toml.tmpl "$REQUEST_PATH" 1024
slot_case 5b "levee $ROUTES routes + 2 Redis limits + breaker" routes-limits.toml.tmpl "$REQUEST_PATH" 1024
slot_case 5c "levee full policy (5b + bulkhead)" full.toml.tmpl "$REQUEST_PATH" 1024
slot_case 6 "levee hide #ranking, 50 KiB page" hide.toml.tmpl /page.html "$PAGE_BYTES" 'id="ranking"'
run_case 7 "nginx limit_req (single node)" nginx proxy-nginx-limit.conf.tmpl "$REQUEST_PATH" 1024
slot_case 7b "levee Redis limit, one rule" limit.toml.tmpl "$REQUEST_PATH" 1024
run_case 8a "nginx proxy_pass, 50 KiB page" nginx proxy-nginx.conf.tmpl /page.html "$PAGE_BYTES"
run_case 8b "levee pass-through, 50 KiB page" levee passthrough.toml.tmpl /page.html "$PAGE_BYTES"
measure_cases
wanted pairs && measure_pairs
wanted budget && section_budget
stop_cases

wanted idle && section_idle_rss
wanted conns && section_idle_conns
wanted reload && section_reload_time
wanted reload-load && section_reload_load
wanted limiter-rate && section_limiter_rate
wanted limiter-latency && section_limiter_latency
wanted queue && section_queue
wanted fastcgi && section_fastcgi

report_header
report_cases
report_sections
report_limiter
report_queue
report_fastcgi
report_pairs
report_budget
report_targets
if ((${#BROKEN[@]})); then
	out ""
	out "## Broken"
	out ""
	for b in "${BROKEN[@]}"; do out "- $b"; done
fi

mkdir -p "$BENCH_DIR/results"
RESULT=$BENCH_DIR/results/$(date '+%Y-%m-%d-%H%M%S')$SUFFIX.md
printf '%s' "$REPORT" | tee "$RESULT"
log "report written to bench/results/$(basename "$RESULT")"
if ((${#BROKEN[@]})); then
	log "BROKEN: ${#BROKEN[@]} problem(s), see above"
	exit 1
fi
