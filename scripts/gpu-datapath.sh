#!/usr/bin/env bash
# The data-path rows (issue 20) on a GPU machine, from inside a GPU bundle
# (scripts/gpu-bundle.sh copies this script in as datapath.sh):
#
#   gpu-bundle/datapath.sh            # ROUNDS (default 3), SECONDS_PER (default 4)
#
# Same run, alternating rounds, medians and ratios printed by the tools themselves:
# - the pinned host-to-device copy ceiling;
# - page-cache-warm 4 GiB into GPU memory, gpuio vs KvikIO's best thread count vs fio, plus
#   single rounds of the settings that could move it (to say where the gap is);
# - 4 KiB random into GPU memory, warm and O_DIRECT, vs fio; the batch API;
# - a cold file read whole into GPU memory: residency-aware (default), everything through the
#   page cache (--no-residency, the previous behaviour), and O_DIRECT;
# - a cold and a warm 4 GiB checkpoint into GPU memory, gpuio vs every loader importable here.
set -uo pipefail
cd "$(dirname "$0")"
LOGS=${LOGS:-$PWD/logs}
mkdir -p "$LOGS"
export GPUIO_TEST_DIR=${GPUIO_TEST_DIR:-/tmp/gpuio-tests}
mkdir -p "$GPUIO_TEST_DIR"
export PATH=$PWD/bin:$PATH
R=${ROUNDS:-3}
S=${SECONDS_PER:-4}
F="$GPUIO_TEST_DIR/bench.bin"
KV="GPUIO_KVIKIO_PEER=$PWD/kvikio/kvikio-peer"
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }
row() { printf '%-44s %s\n' "$1" "$2" | tee -a "$LOGS/datapath.txt"; }

# cuFile (and torch.cuda.gds, a peer below) needs udev data this VM lacks (ENVIRONMENT.md).
d=$(mountpoint -d "$(df --output=target "$GPUIO_TEST_DIR" | tail -1)")
[ -e "/run/udev/data/b$d" ] || { mkdir -p /run/udev/data \
  && printf 'E:ID_FS_TYPE=ext4\nE:ID_FS_USAGE=filesystem\n' > "/run/udev/data/b$d"; }
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
./bin/copy_ceiling 1024 2>&1 | grep -E 'host-to-device' | while read -r l; do row ceiling "$l"; done
[ -f "$F" ] || ./bin/gpuio bench --file "$F" --rw write --size 4G --bs 8M --qd 8 --seconds 6 > /dev/null

compare() { # label, file, args..., (environment through ENVS)
  local label=$1 file=$2; shift 2
  case "$label" in warm*) cat "$file" > /dev/null ;; *) drop_caches ;; esac
  local log="$LOGS/dp-${label//[^A-Za-z0-9_.-]/_}.txt"
  env ${ENVS:-} ./bin/gpuio bench --file "$file" --size 4G "$@" --seconds "$S" --rounds "$R" \
    --compare > "$log" 2>&1
  row "$label" "$(grep 'vs fio' "$log" | sed 's/.*): //')"
  grep -q 'vs kvikio' "$log" && row "$label" "$(grep 'vs kvikio' "$log" | sed 's/.*(medians of [0-9]*, //')"
  grep -E '^(gpuio|fio|kvikio).*cores' "$log" | head -6 >> "$LOGS/datapath-detail.txt"
}
# COMPARE=0 skips the side-by-side rows (the variants below still run).
[ "${COMPARE:-1}" = 1 ] && {
ENVS=$KV compare "warm 16M qd8 to gpu" "$F" --bs 16M --qd 8 --to gpu --kvikio-threads 8,16,32
compare "warm 4K rand qd64 to gpu" "$F" --bs 4K --qd 64 --pattern rand --to gpu
compare "O_DIRECT 4K rand qd64 to gpu" "$F" --bs 4K --qd 64 --pattern rand --direct --to gpu
ENVS=$KV compare "O_DIRECT 4M qd16 to gpu" "$F" --bs 4M --qd 16 --direct --to gpu --kvikio-threads 8,16
compare "O_DIRECT 4K rand qd64 to host" "$F" --bs 4K --qd 64 --pattern rand --direct
compare "O_DIRECT 4K rand qd64 to host, owned" "$F" --bs 4K --qd 64 --pattern rand --direct --owned
}

# What moves the warm row (one round each, same file, warm): say where the gap is.
cat "$F" > /dev/null
# VARIANTS=0 skips these single rounds.
# Each line: environment (or -) | bench arguments.
[ "${VARIANTS:-1}" = 1 ] && while IFS='|' read -r envs v; do
  [ -z "$v" ] && continue
  [ "$envs" = - ] && envs=
  # shellcheck disable=SC2086
  j=$(env $envs ./bin/gpuio bench --file "$F" --size 4G --to gpu $v --seconds "$S" --json 2>>"$LOGS/dp-err.log" | tail -1)
  row "warm to gpu [$envs $v]" "$(echo "$j" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.2f GB/s %.0f IOPS, %.1f cores" % (j["gbps"], j["iops"], j.get("cpu_cores", float("nan"))))' 2>/dev/null || echo "FAILED: $(tail -1 "$LOGS/dp-err.log")")"
done <<EOF_V
-|--bs 16M --qd 8
-|--bs 16M --qd 8
-|--bs 16M --qd 8
-|--bs 64M --qd 4
-|--bs 1M --qd 32
-|--bs 1M --qd 32
-|--bs 4K --qd 64 --pattern rand
-|--bs 4K --qd 8 --pattern batch --batch 64
EOF_V
for r in $(seq 1 "$R"); do
  j=$(./bin/gpuio bench --file "$F" --size 4G --bs 4K --qd 8 --pattern batch --batch 64 --to gpu --seconds "$S" --json 2>/dev/null | tail -1)
  row "warm batch 64x4K qd8 to gpu #$r" "$(echo "$j" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.0f IOPS" % j["iops"])' 2>/dev/null || echo FAILED)"
done

# A cold 4 GiB file read whole into GPU memory, three ways, alternating; with BEFORE=DIR (a
# directory holding an earlier build's gpuio and load_safetensors) that build's rows too.
for r in $(seq 1 "$R"); do
  for v in "" "--no-residency" "--direct"; do
    drop_caches
    # shellcheck disable=SC2086
    row "cold read --to gpu [${v:-residency-aware}] #$r" "$(./bin/gpuio read "$F" --to gpu $v 2>&1 | tail -1)"
  done
  if [ -n "${BEFORE:-}" ]; then
    drop_caches
    row "cold read --to gpu [before] #$r" "$("$BEFORE/gpuio" read "$F" --to gpu 2>&1 | tail -1)"
  fi
done

# Checkpoints: the Rust example (and the earlier build's) and every Python loader present.
M="$GPUIO_TEST_DIR/model.safetensors"
[ -f "$M" ] || ./bin/load_safetensors --make "$M" "${CHECKPOINT_MIB:-4096}" > "$LOGS/st-make.txt" 2>&1
for r in $(seq 1 "$R"); do
  drop_caches
  row "checkpoint rust example cold #$r" "$(./bin/load_safetensors "$M" --no-verify 2>&1 | tail -1 | sed -E 's/ via bounce \(.*\)\)//')"
  if [ -n "${BEFORE:-}" ]; then
    drop_caches
    row "checkpoint rust example cold [before] #$r" "$("$BEFORE/load_safetensors" "$M" --no-verify 2>&1 | tail -1 | sed -E 's/ via bounce \(.*\)\)//')"
  fi
done
if [ -d py ]; then
  rm -rf py/site && mkdir -p py/site && python3 -m zipfile -e py/gpuio-*.whl py/site
  peers=$(python3 py/bench/unpack_wheels.py py/loaders py/loaders-site)
  PYTHONPATH="$PWD/py/site${peers:+:$PWD/$peers}" timeout "${PY_BENCH_TIMEOUT:-400}" python3 py/bench/load_checkpoint.py "$M" \
    --rounds "$R" --json "$LOGS/dp-py-bench.jsonl" > "$LOGS/dp-py-bench.txt" 2>&1
  grep -E '^(checkpoint|verify|absent|failed|cold|warm|summary|ratio|raw)' "$LOGS/dp-py-bench.txt" \
    | while read -r l; do row py-bench "$l"; done
fi
echo "==== datapath rows"
cat "$LOGS/datapath.txt"
echo "==== cores"
cat "$LOGS/datapath-detail.txt" 2>/dev/null || true
