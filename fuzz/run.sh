#!/usr/bin/env bash
# Runs every fuzz target for a while and fails if any of them finds a crash.
#
#   bash fuzz/run.sh [seconds-per-target]     # default 20; CI runs 20, try 600 for a real hunt
#
# Each target starts from the committed seeds (fuzz/seeds/TARGET) and keeps what it learns in
# fuzz/corpus/TARGET (not committed), so longer local runs build on earlier ones. A crash leaves
# its input in fuzz/artifacts/TARGET/; turn it into a plain #[test] in tests/props.rs once fixed.
#
# Stable toolchain: cargo-fuzz builds with AddressSanitizer by default, which needs a nightly
# compiler (-Zsanitizer). levee forbids unsafe code, so we use `--sanitizer none` instead of
# RUSTC_BOOTSTRAP tricks; everything else cargo-fuzz does stays on (libFuzzer, coverage
# instrumentation, comparison tracing, debug assertions and overflow checks).
set -euo pipefail
cd "$(dirname "$0")"

seconds="${1:-20}"
targets=(policy_compile path_normalise limit_key request_head chunked_body upstream_response_head redis_reply)

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

started=$(date +%s)
cargo fuzz build --sanitizer none
echo "fuzz: built the targets in $(( $(date +%s) - started ))s"

failed=()
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target"
  flags=(-max_total_time="$seconds" -timeout=10 -print_final_stats=1)
  [ -f "$target.dict" ] && flags+=(-dict="$target.dict")
  echo "fuzz: $target for ${seconds}s"
  # First directory: where new inputs go; the seeds are only read. libFuzzer's progress lines
  # (`#1234 NEW …`) and its recommended dictionary are left out of the log; crash reports and
  # the final stats stay.
  if ! cargo fuzz run --sanitizer none "$target" "corpus/$target" "seeds/$target" -- "${flags[@]}" \
      2>&1 | { grep -v -E '^#[0-9]|# Uses: [0-9]+$' || true; }; then
    failed+=("$target")
  fi
done

echo "fuzz: done in $(( $(date +%s) - started ))s"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
