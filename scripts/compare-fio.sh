#!/usr/bin/env bash
# Side by side with fio (io_uring engine) on the same file, in one run, alternating rounds.
#
#   scripts/compare-fio.sh [FILE] [SIZE] [ROUNDS] [SECONDS]
#
# FILE defaults to $TMPDIR/gpuio-compare.bin (laid out by fio if missing, kept afterwards);
# SIZE 4G, ROUNDS 3, SECONDS 10. Prints medians and the gpuio/fio ratios against the targets
# of issue 2: O_DIRECT sequential 1 MiB QD32 >= 95%, O_DIRECT 4 KiB random QD64 >= 90%.
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=${1:-${TMPDIR:-/tmp}/gpuio-compare.bin}
SIZE=${2:-4G}
ROUNDS=${3:-3}
SECS=${4:-10}
command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)" >&2; exit 2; }
cargo build --release --quiet --bin gpuio
GPUIO=target/release/gpuio
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

if [ ! -f "$FILE" ]; then
  echo "laying out $FILE ($SIZE)" >&2
  fio --name=layout --filename="$FILE" --size="$SIZE" --rw=write --bs=4M --direct=1 \
      --ioengine=io_uring --iodepth=16 >/dev/null
fi

fio_run() { # name rw bs qd
  fio --name="$1" --filename="$FILE" --size="$SIZE" --rw="$2" --bs="$3" --iodepth="$4" \
      --direct=1 --ioengine=io_uring --time_based --runtime="$SECS" --ramp_time=1 \
      --output-format=json > "$OUT/fio-$1-$round.json"
}
gpuio_run() { # name pattern bs qd
  "$GPUIO" bench --file "$FILE" --size "$SIZE" --pattern "$2" --bs "$3" --qd "$4" --direct \
      --seconds "$SECS" --json | tail -n 1 > "$OUT/gpuio-$1-$round.json"
}

for round in $(seq 1 "$ROUNDS"); do
  echo "round $round/$ROUNDS" >&2
  fio_run seq read 1M 32
  gpuio_run seq seq 1M 32
  fio_run rand randread 4K 64
  gpuio_run rand rand 4K 64
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys, glob, os
out, rounds = sys.argv[1], int(sys.argv[2])
def fio(name):
    v = []
    for f in sorted(glob.glob(os.path.join(out, f"fio-{name}-*.json"))):
        j = json.load(open(f))["jobs"][0]["read"]
        v.append((j["bw_bytes"] / 1e9, j["iops"]))
    return v
def gp(name):
    v = []
    for f in sorted(glob.glob(os.path.join(out, f"gpuio-{name}-*.json"))):
        j = json.load(open(f))
        v.append((j["gbps"], j["iops"]))
    return v
rows = [("O_DIRECT seq read 1 MiB QD32", "seq", 0, "GB/s", 0.95),
        ("O_DIRECT rand read 4 KiB QD64", "rand", 1, "IOPS", 0.90)]
print(f"{'test':32} {'fio (median)':>14} {'gpuio (median)':>15} {'ratio':>7} {'target':>7}  runs")
for label, name, idx, unit, target in rows:
    f = [x[idx] for x in fio(name)]
    g = [x[idx] for x in gp(name)]
    fm, gm = statistics.median(f), statistics.median(g)
    fmt = (lambda x: f"{x:.3f} {unit}") if unit == "GB/s" else (lambda x: f"{x/1e3:.1f} k{unit}")
    ok = "PASS" if gm / fm >= target else "MISS"
    print(f"{label:32} {fmt(fm):>14} {fmt(gm):>15} {gm/fm:7.3f} {target:7.2f}  {ok} fio={['%.3g'%x for x in f]} gpuio={['%.3g'%x for x in g]}")
PY
