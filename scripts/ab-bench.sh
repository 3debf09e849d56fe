#!/usr/bin/env bash
# Same-run before/after table: two gpuio binaries, alternating rounds on one file, medians.
#   scripts/ab-bench.sh BEFORE AFTER FILE [ROUNDS] [--no-gpu]
# Rows into GPU memory are skipped with --no-gpu. Writes go to FILE: use a scratch file.
# `sync` runs before every run, so one run's writeback does not land in the next.
set -euo pipefail
before=$1 after=$2 file=$3 rounds=${4:-3} gpu=${5:-}
rows=(
  "warm 4K rand read qd64 host|--bs 4K --qd 64 --pattern rand"
  "warm 4K rand read qd64 gpu|--bs 4K --qd 64 --pattern rand --to gpu"
  "warm 16M read qd8 gpu|--bs 16M --qd 8 --to gpu"
  "O_DIRECT 4M read qd16 gpu|--bs 4M --qd 16 --direct --to gpu"
  "4K rand write qd64 host|--bs 4K --qd 64 --pattern rand --rw write"
  "O_DIRECT 4M write qd16 host|--bs 4M --qd 16 --direct --rw write"
  "O_DIRECT 4M write qd16 gpu|--bs 4M --qd 16 --direct --rw write --to gpu"
)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
cat "$file" >/dev/null
for row in "${rows[@]}"; do
  name=${row%%|*} args=${row#*|}
  if [ "$gpu" = --no-gpu ] && [[ $args == *"--to gpu"* ]]; then continue; fi
  for _ in $(seq "$rounds"); do
    for v in before after; do
      bin=$before; [ $v = after ] && bin=$after
      sync
      # shellcheck disable=SC2086 # the row's flags are meant to split
      j=$("$bin" bench --file "$file" $args --seconds 3 --json 2>/dev/null | tail -n 1)
      echo "$name|$v|$j" >>"$out"
    done
  done
done
python3 - "$out" <<'PY'
import collections, json, statistics as st, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, side, js = line.rstrip("\n").split("|", 2)
    try:
        d = json.loads(js)
    except ValueError:
        print(f"{name} {side}: no result ({js[:80]})", file=sys.stderr)
        continue
    runs[(name, side)].append((d["gbps"], d["iops"], d["cpu_cores"]))
print("| workload | before GB/s (IOPS) | after GB/s (IOPS) | after/before | cores before/after |")
print("|---|---|---|---|---|")
for name in dict.fromkeys(k[0] for k in runs):
    b, a = runs[(name, "before")], runs[(name, "after")]
    if not a or not b:
        continue
    med = lambda rs, i: st.median(r[i] for r in rs)
    print(f"| {name} | {med(b,0):.2f} ({med(b,1):,.0f}) | {med(a,0):.2f} ({med(a,1):,.0f}) "
          f"| {med(a,0)/med(b,0):.3f} | {med(b,2):.2f} / {med(a,2):.2f} |")
PY
