#!/usr/bin/env bash
# bench/pgo-build.sh: a profile-guided release build of levee, at target/pgo/release/levee.
#
# The compiler lays out and inlines levee's code by where a real run spent its time: the
# request path's code becomes denser and its rarely taken branches move out of the way. On
# this project's benchmark machine that took a pass-through request from 21,524 to 16,534
# instructions and roughly halved its first-level instruction-cache misses (bench/README.md,
# "profile-guided build"). It takes two release builds and a minute of training load: about
# 10 minutes on 2 cores.
#
#   bash bench/pgo-build.sh            build (and train) into target/pgo
#   LLVM_PROFDATA=/path/to/llvm-profdata bash bench/pgo-build.sh
#
# Steps: (1) build levee with instrumentation (target/pgo-instrumented); (2) train it: the
# benchmark harness's levee cases in smoke mode (pass-through, 50 routes, Redis limits with a
# breaker and bulkhead, hide on a 50 KiB page, the 50 KiB page passed through, a FastCGI upstream
# and the queue), each levee writing its profile when it stops; (3) merge the profiles with
# llvm-profdata; (4) build levee again with them. The binary says so in `levee --version`.
#
# Needs what bench/run.sh needs (nginx, wrk, redis-server, haproxy; php-fpm for the FastCGI
# case) and `llvm-profdata` from an LLVM at least as new as the one that wrote the profiles'
# format (Debian's llvm-19 reads rustc 1.95's). Found as LLVM_PROFDATA, as `llvm-profdata`
# in rustup's llvm-tools component, as the newest `llvm-profdata-NN` on the PATH, or as a plain
# `llvm-profdata`; as root it installs Debian's llvm-19 when none is found. RUSTFLAGS set in the
# environment are not used for these builds.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

log() { printf '[pgo %3ds] %s\n' "$SECONDS" "$*" >&2; }
die() {
	printf '[pgo] ERROR: %s\n' "$*" >&2
	exit 1
}

# An llvm-profdata to merge with, on stdout; nothing when none is found.
find_profdata() {
	local sysroot found
	sysroot=$(rustc --print sysroot)
	found=$(find "$sysroot/lib/rustlib" -name llvm-profdata -type f 2>/dev/null | head -n 1)
	[[ -n $found ]] && echo "$found" && return
	# The newest versioned one (Debian's llvm-NN), else a plain `llvm-profdata`.
	found=$(compgen -c llvm-profdata- 2>/dev/null | sort -t- -k3 -n | tail -n 1)
	[[ -n $found ]] && command -v "$found" && return
	command -v llvm-profdata
}

if [[ -n ${LLVM_PROFDATA:-} ]]; then
	[[ -x $LLVM_PROFDATA ]] || die "LLVM_PROFDATA=$LLVM_PROFDATA is not an executable"
	PROFDATA=$LLVM_PROFDATA
elif ! PROFDATA=$(find_profdata); then
	if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
		log "no llvm-profdata found: installing Debian's llvm-19"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends llvm-19 >&2 ||
			{ apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends llvm-19 >&2; }
		PROFDATA=$(find_profdata) || die "llvm-19 installed, but no llvm-profdata-19 on the PATH"
	else
		die "no llvm-profdata found: install an LLVM's tools (Debian: apt-get install llvm-19) or set LLVM_PROFDATA"
	fi
fi
log "llvm-profdata: $PROFDATA ($("$PROFDATA" --version 2>&1 | grep -m1 -i 'version' | sed 's/^ *//'))"

WORK=$REPO/target/pgo-work
PROFILES=$WORK/profiles
MERGED=$WORK/levee.profdata
rm -rf "$WORK"
mkdir -p "$PROFILES"
# `levee_pgo` only changes what `levee --version` says; both builds get it, so their code is
# the same and every function's profile matches. The flags go as CARGO_ENCODED_RUSTFLAGS
# (separated by 0x1f), so a path with spaces stays one argument; they replace RUSTFLAGS.
SEP=$'\x1f'
unset RUSTFLAGS

log "1/4 instrumented build (target/pgo-instrumented)"
CARGO_ENCODED_RUSTFLAGS="--cfg${SEP}levee_pgo${SEP}-Cprofile-generate=$PROFILES" \
	cargo build --release --quiet --target-dir "$REPO/target/pgo-instrumented"
# Build scripts ran instrumented too and left profiles of their own: only the training's count.
rm -f "$PROFILES"/*.profraw

log "2/4 training: bench/run.sh --smoke on the levee cases"
# The profiles directory must be writable by whoever runs levee; the harness runs it as the
# current user.
LEVEE_BIN=$REPO/target/pgo-instrumented/release/levee \
	ONLY="4 5 5b 5c 6 7b 8b fastcgi queue" \
	bash bench/run.sh --smoke >"$WORK/training-report.md" 2>"$WORK/training.log" ||
	die "the training run failed; see $WORK/training.log"
shopt -s nullglob
raw=("$PROFILES"/*.profraw)
[[ ${#raw[@]} -gt 0 ]] || die "the training run left no profiles in $PROFILES"

log "3/4 merging ${#raw[@]} profiles"
"$PROFDATA" merge -o "$MERGED" "${raw[@]}" 2>"$WORK/merge.log" ||
	die "llvm-profdata could not merge the profiles (an LLVM older than rustc's $(rustc -vV | sed -n 's/^LLVM version: //p')? see $WORK/merge.log)"

log "4/4 optimised build (target/pgo)"
CARGO_ENCODED_RUSTFLAGS="--cfg${SEP}levee_pgo${SEP}-Cprofile-use=$MERGED" \
	cargo build --release --quiet --target-dir "$REPO/target/pgo"
"$REPO/target/pgo/release/levee" --version >&2
log "done: target/pgo/release/levee (bench/run.sh measures it with LEVEE_BIN=target/pgo/release/levee)"
