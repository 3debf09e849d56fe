#!/usr/bin/env bash
# Builds everything a GPU machine without a Rust toolchain needs to run gpuio's tests and
# benchmarks: release test binaries, the gpuio CLI and the examples, stripped, plus a runner.
#
#   scripts/gpu-bundle.sh [DIR]        # default DIR: gpu-bundle (git-ignored)
#   # copy DIR to the GPU machine, then:  DIR/run.sh
#
# run.sh runs every test binary (device tests included), `gpuio check`, the copy ceilings and
# `gpuio bench --to gpu`, and prints a table last. The bundle must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-bundle}
rm -rf "$OUT"
mkdir -p "$OUT/tests" "$OUT/bin"

cargo build --release --bins --examples
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["kind"][0] + "-" + m["target"]["name"] + "\t" + m["executable"])
' | while IFS=$'\t' read -r name exe; do
    cp "$exe" "$OUT/tests/$name"
  done
cp target/release/gpuio "$OUT/bin/"
for ex in target/release/examples/*; do
  [ -f "$ex" ] && [ -x "$ex" ] && case "$ex" in *-*|*.d) ;; *) cp "$ex" "$OUT/bin/" ;; esac
done
strip "$OUT"/tests/* "$OUT"/bin/*

cat > "$OUT/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the gpuio bundle on a GPU machine. Writes logs under $LOGS (default ./logs).
set -uo pipefail
cd "$(dirname "$0")"
LOGS=${LOGS:-$PWD/logs}
mkdir -p "$LOGS"
export GPUIO_TEST_DIR=${GPUIO_TEST_DIR:-/tmp/gpuio-tests}
mkdir -p "$GPUIO_TEST_DIR"
TABLE=()
./bin/gpuio check "$GPUIO_TEST_DIR" | tee "$LOGS/check.txt"
for t in tests/*; do
  name=$(basename "$t")
  start=$(date +%s)
  if timeout "${TEST_TIMEOUT:-240}" "$t" --test-threads=4 > "$LOGS/test-$name.log" 2>&1; then status=PASS; else status=FAIL; fi
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E '^test result:' "$LOGS/test-$name.log" | tail -1 | sed -E 's/test result: (ok|FAILED)\. //; s/; finished.*//')
  skips=$(grep -c '^SKIPPED' "$LOGS/test-$name.log")
  TABLE+=("$(printf '%-28s %-5s %4ss  %s  skipped-parts=%s' "test:$name" "$status" "$secs" "$summary" "$skips")")
done
./bin/copy_ceiling 1024 | tee "$LOGS/ceiling.txt"
while read -r l; do TABLE+=("$l"); done < <(grep -E 'host-to-device|SKIPPED' "$LOGS/ceiling.txt")
bench() { # label, args...
  local label=$1; shift
  local j
  j=$(./bin/gpuio bench "$@" --json 2>>"$LOGS/bench-err.log" | tail -n 1)
  echo "$label $j" >> "$LOGS/bench.jsonl"
  TABLE+=("$(printf '%-40s %s' "$label" "$(echo "$j" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.2f GB/s %8.0f IOPS pinned=%s" % (j["gbps"], j["iops"], j.get("bounce_pinned")))' 2>/dev/null || echo "FAILED (see bench-err.log)")")")
}
F="$GPUIO_TEST_DIR/bench.bin"
./bin/gpuio bench --file "$F" --rw write --size 4G --bs 8M --qd 8 --seconds 30 > /dev/null 2>>"$LOGS/bench-err.log" || true
for r in 1 2 3; do
  bench "warm buffered 16M qd8 to gpu #$r" --file "$F" --size 4G --bs 16M --qd 8 --to gpu --seconds 5
  bench "O_DIRECT 4M qd16 to gpu #$r" --file "$F" --size 4G --bs 4M --qd 16 --direct --to gpu --seconds 5
  bench "O_DIRECT 4K rand qd64 to gpu #$r" --file "$F" --size 4G --bs 4K --qd 64 --pattern rand --direct --to gpu --seconds 5
  bench "warm buffered 16M qd8 to host #$r" --file "$F" --size 4G --bs 16M --qd 8 --seconds 5
done
echo
echo "==== gpuio GPU bundle summary ===="
printf '%s\n' "${TABLE[@]}"
RUN
chmod +x "$OUT/run.sh"
du -sh "$OUT"
