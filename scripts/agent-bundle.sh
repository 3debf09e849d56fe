#!/usr/bin/env bash
# A slim bundle for comparing gpuio's agents with NIXL 1.5.1's UCX backend on a GPU machine
# that has no network, no compiler and no Rust (python3 with torch, a CUDA driver):
#
#   scripts/agent-bundle.sh [DIR]      # default DIR: agent-bundle (git-ignored), and DIR.tar.gz
#   # there: tar xzf agent-bundle.tar.gz && agent-bundle/agents.sh   (OUT=..., ROUNDS=..., CASES=...)
#
# It carries the gpuio CLI, the release test binaries of tests/agent.rs and tests/agent_procs.rs,
# examples/agents, the Python wheel with its agent tests and example, UCX 1.22 with the CUDA
# transports (the libucx-cu13 wheel's libraries, for GPUIO_UCX_DIR), NIXL (the nixl shim and the
# nixl_cu13 package trimmed to what its extension modules and UCX plugin load, computed from
# their NEEDED entries), and gpuio-py/bench/nixl_xfer.py. agents.sh runs the tests and a table
# of `gpuio xfer` against nixl_xfer.py, the same cases in alternating rounds.
#
# The wheels are copied from /work/wheels where present, else downloaded (pip) into
# target/wheels once. The bundle must stay under 64 MiB packed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-agent-bundle}
TARGET=${CARGO_TARGET_DIR:-target}
UCX_WHEEL=libucx-cu13==1.22.0
NIXL_WHEELS=(nixl-cu13==1.5.1 nixl==1.5.1)
rm -rf "$OUT" "$OUT.tar.gz"
mkdir -p "$OUT/bin" "$OUT/tests" "$OUT/py/tests" "$OUT/py/examples" "$OUT/ucx/lib/ucx" "$OUT/nixl/site"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# ---- the wheels: /work/wheels where present, else target/wheels (downloaded once)
CACHE=target/wheels
mkdir -p "$CACHE"
wheel() { # requirement (name==version) -> path of its wheel
  local req=$1 stem f
  stem="$(echo "${req%%==*}" | tr - _)-${req##*==}-"
  for f in /work/wheels/"$stem"*.whl; do
    [ -f "$f" ] && { [ -f "$CACHE/$(basename "$f")" ] || cp "$f" "$CACHE/"; }
  done
  if ! compgen -G "$CACHE/$stem*.whl" > /dev/null; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d "$CACHE" "$req" >&2
  fi
  compgen -G "$CACHE/$stem*.whl" | head -1
}
UCX_WHL=$(wheel "$UCX_WHEEL")
NIXL_CU_WHL=$(wheel "${NIXL_WHEELS[0]}")
NIXL_WHL=$(wheel "${NIXL_WHEELS[1]}")

# ---- gpuio: the CLI, the agent tests, the agents example
cargo build --release -p gpuio-cli
cp "$TARGET/release/gpuio" "$OUT/bin/"
if [ -f examples/agents.rs ]; then
  cargo build --release -p gpuio --example agents
  cp "$TARGET/release/examples/agents" "$OUT/bin/"
fi
# Prints "test-name<TAB>executable" for each compiled test target cargo reports.
cargo test --release -p gpuio --test agent --test agent_procs --no-run --message-format=json 2>/dev/null \
  | python3 scripts/cargo-executables.py > "$TMP/tests.tsv"
while IFS=$'\t' read -r name exe; do cp "$exe" "$OUT/tests/$name"; done < "$TMP/tests.tsv"
[ -x "$OUT/tests/test-agent" ] && [ -x "$OUT/tests/test-agent_procs" ] \
  || { echo "agent-bundle: the agent test binaries were not built" >&2; exit 1; }
strip "$OUT"/bin/* "$OUT"/tests/*

# ---- the Python package (abi3 wheel; agents.sh unpacks it onto PYTHONPATH), its agent tests
PYVENV=${GPUIO_PY_VENV:-$PWD/target/py-venv}
if [ ! -x "$PYVENV/bin/maturin" ]; then
  python3 -m venv "$PYVENV" && "$PYVENV/bin/python" -m pip install -q maturin==1.16.0
fi
if ! "$PYVENV/bin/maturin" build --release --strip -m gpuio-py/Cargo.toml -o "$OUT/py" > "$TMP/maturin.log" 2>&1; then
  tail -20 "$TMP/maturin.log" >&2
  echo "agent-bundle: the Python wheel did not build; agents.sh will skip the Python parts" >&2
fi
cp gpuio-py/tests/conftest.py "$OUT/py/tests/"
for f in gpuio-py/tests/test_agent.py; do [ -f "$f" ] && cp "$f" "$OUT/py/tests/"; done
for f in gpuio-py/examples/agents.py; do [ -f "$f" ] && cp "$f" "$OUT/py/examples/"; done
cp gpuio-py/bench/nixl_xfer.py "$OUT/nixl_xfer.py"

# ---- UCX 1.22 with the CUDA transports, from the libucx-cu13 wheel. gpuio opens
# $GPUIO_UCX_DIR/libucp.so.0; UCX's module loader looks for lib<module>.so.0 (the suffix of the
# libucs it was loaded as) in ucx/ beside libucs. libucm_cuda finds the wheel's CUDA runtime
# through its RPATH $ORIGIN/../../../libucx_cu13.libs, that is DIR/libucx_cu13.libs here.
python3 -m zipfile -e "$UCX_WHL" "$TMP/ucx"
U=$TMP/ucx/libucx/lib
for l in ucp ucs uct ucm; do
  cp "$U/lib$l.so.0.0.0" "$OUT/ucx/lib/lib$l.so.0"
  ln -s "lib$l.so.0" "$OUT/ucx/lib/lib$l.so"
done
for m in uct_cuda uct_cma ucm_cuda; do
  cp "$U/ucx/lib$m.so.0.0.0" "$OUT/ucx/lib/ucx/lib$m.so.0"
  ln -s "lib$m.so.0" "$OUT/ucx/lib/ucx/lib$m.so"
done
# The wheel's libraries carry debug info (libucp 10 MB): dropped, nothing else changes.
strip --strip-debug "$OUT"/ucx/lib/*.so.0 "$OUT"/ucx/lib/ucx/*.so.0
mkdir -p "$OUT/libucx_cu13.libs"
for n in $(readelf -d "$U/ucx/libucm_cuda.so.0.0.0" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'); do
  [ -f "$TMP/ucx/libucx_cu13.libs/$n" ] && cp "$TMP/ucx/libucx_cu13.libs/$n" "$OUT/libucx_cu13.libs/"
done
cp "$TMP/ucx/libucx_cu13-"*.dist-info/licenses/LICENSE "$OUT/ucx/LICENSE"

# ---- NIXL trimmed to its UCX backend, in the wheel's own layout (RPATHs are $ORIGIN-relative):
# the nixl shim (pure Python) whole but nixl_ep, and from nixl_cu13 its Python files, its
# metadata and licences, and the NEEDED closure of its extension modules, its UCX plugin and
# the UCX modules NIXL's UCX loads (cuda, cma, ucm_cuda), resolved within the wheel.
python3 - "$NIXL_CU_WHL" "$NIXL_WHL" "$OUT/nixl/site" <<'PY'
import os, re, subprocess, sys, zipfile
cu, shim, site = sys.argv[1:4]
z = zipfile.ZipFile(cu)
names = [n for n in z.namelist() if not n.endswith("/")]
libs = {}  # basename -> member, for the shared libraries outside the Python packages
for n in names:
    if re.search(r"\.so(\.[0-9.]+)?$", n) and n.split("/")[0].endswith(".libs"):
        libs.setdefault(os.path.basename(n), []).append(n)
roots = [n for n in names if re.match(r"nixl_cu13/_(bindings|utils)\.cpython-.*\.so$", n)]
roots += [n for n in names if re.match(r"\.nixl_cu13\.mesonpy\.libs/plugins/libplugin_UCX\.so$", n)]
roots += [n for n in names if re.match(r"nixl_cu13\.libs/ucx/lib(uct_cuda|uct_cma|ucm_cuda)\.so", n)]
if len(roots) != 6:
    sys.exit(f"agent-bundle: unexpected nixl_cu13 layout, roots found: {roots}")
keep, todo = set(), list(roots)
tmp = os.path.join(site, ".elf")
while todo:
    n = todo.pop()
    if n in keep:
        continue
    keep.add(n)
    path = z.extract(n, tmp)
    dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    for need in re.findall(r"\(NEEDED\).*\[(.*)\]", dyn):
        cands = libs.get(need, [])
        # The copy the library's own RPATH/RUNPATH would find: beside it, or one level up.
        here = os.path.dirname(n)
        cands.sort(key=lambda c: (os.path.dirname(c) not in (here, os.path.dirname(here)), c))
        if cands:
            todo.append(cands[0])
subprocess.run(["rm", "-rf", tmp], check=True)
py = [n for n in names if n.startswith("nixl_cu13/") and not n.endswith(".so")]
meta = [n for n in names if n.startswith("nixl_cu13-") and ".dist-info/" in n and not n.endswith("RECORD")]
for n in sorted(keep) + py + meta:
    z.extract(n, site)
zs = zipfile.ZipFile(shim)
for n in zs.namelist():
    if not n.startswith("nixl_ep/") and not n.endswith("RECORD"):
        zs.extract(n, site)
print(f"agent-bundle: NIXL: {len(keep)} shared libraries kept of {len(libs) + 2}", file=sys.stderr)
PY

# ---- the runner
cat > "$OUT/agents.sh" <<'RUN'
#!/usr/bin/env bash
# Runs gpuio's agents next to NIXL 1.5.1's UCX backend on this machine:
#   1. the agent tests (tests/test-agent, tests/test-agent_procs), `gpuio check`, the agents
#      example, pytest on py/tests/test_agent.py and py/examples/agents.py;
#   2. the copy ceilings (torch dst.copy_(src), 1 GiB: GPU1->GPU0, GPU0->GPU1, GPU0->GPU0,
#      pinned host->GPU0);
#   3. a table: `gpuio xfer --json` and `python3 nixl_xfer.py --json`, same case, alternating,
#      ROUNDS times each (default 3), for --procs 1 and 2, READ and WRITE; notification latency.
# Writes $OUT (default DIR/out): logs, xfer.jsonl (one record per run), xfer.md (the table).
# Environment: OUT, ROUNDS, ITERS (transfers per round, default 5), CASE_TIMEOUT (s, default
# 120), CASES (a regex over case labels: only those run; '^$' runs none), PROCS (default "1 2"),
# TESTS=0 (no tests, only the table), NIXL_PYTHON (a CPython 3.12 with torch for NIXL; default
# python3 where it is 3.12, else python3.12). A full run is long (NIXL's one-process GPU rows
# move ~0.4 GB/s): under a 10-minute limit, split it with TESTS=0, CASES, PROCS and ROUNDS.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$D/out}
mkdir -p "$OUT/logs"
export GPUIO_UCX_DIR=$D/ucx/lib GPUIO_BIN=$D/bin/gpuio
export GPUIO_UCX_REQUIRED=${GPUIO_UCX_REQUIRED:-1}
T=${CASE_TIMEOUT:-120}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-5}
SUMMARY=()
note() { echo "$*"; SUMMARY+=("$*"); }

# ---- Python: gpuio's wheel unpacked onto PYTHONPATH (nothing is installed)
GPY=
if compgen -G "$D/py/gpuio-*.whl" > /dev/null; then
  rm -rf "$D/py/site" && mkdir -p "$D/py/site" \
    && python3 -m zipfile -e "$D"/py/gpuio-*.whl "$D/py/site" && GPY=$D/py/site
fi
[ -n "$GPY" ] || note "SKIPPED: gpuio Python parts: no gpuio wheel in the bundle (or it did not unpack)"
# NIXL: nixl_cu13 1.5.1 is built for CPython 3.12 only (cp312).
NPY=${NIXL_PYTHON:-}
if [ -z "$NPY" ]; then
  if python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then NPY=python3
  elif command -v python3.12 > /dev/null; then NPY=python3.12; fi
fi
if [ -z "$NPY" ]; then
  note "SKIPPED: NIXL rows: nixl_cu13 1.5.1 is built for CPython 3.12 (cp312) and python3 here is $(python3 -V 2>&1); set NIXL_PYTHON to a python3.12"
fi
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "${NGPU:-0}" -gt 0 ] || NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
NGPU=${NGPU//[^0-9]/}; NGPU=${NGPU:-0}
note "machine: $NGPU GPU(s); $(python3 -V 2>&1); NIXL python: ${NPY:-none}; UCX: $GPUIO_UCX_DIR"

run_step() { # label, timeout, command...
  local label=$1 t=$2 log rc start
  shift 2
  log="$OUT/logs/${label//[^A-Za-z0-9_.-]/_}.log"
  start=$(date +%s)
  timeout "$t" "$@" > "$log" 2>&1; rc=$?
  local how=PASS says
  says=$(grep -E '^test result:|^=+ .*(passed|failed|error|skipped)|^SKIPPED|^FAIL' "$log" | tail -n 2 | tr '\n' ' ')
  if [ $rc != 0 ]; then
    how="FAIL(rc=$rc)"; [ $rc = 124 ] && how="TIMEOUT(${t}s)"
    [ -n "$says" ] || says=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)
  fi
  note "$(printf '%-26s %-12s %4ss  %s' "$label" "$how" "$(( $(date +%s) - start ))" "$says")"
}

# ---- 1. tests and examples
if [ "${TESTS:-1}" = 1 ]; then
  run_step "gpuio check" 120 "$D/bin/gpuio" check
  grep -iE 'ucx|agent|cuda' "$OUT/logs/gpuio_check.log" | head -12 | sed 's/^/  check: /'
  for t in "$D"/tests/test-agent "$D"/tests/test-agent_procs; do
    [ -x "$t" ] && run_step "$(basename "$t")" 300 "$t" --test-threads=2
  done
  [ -x "$D/bin/agents" ] && run_step "example agents" 120 "$D/bin/agents"
  if [ -n "$GPY" ]; then
    if [ -f "$D/py/tests/test_agent.py" ]; then
      run_step "pytest test_agent.py" 600 env PYTHONPATH="$GPY" python3 -m pytest -rsfE -p no:cacheprovider "$D/py/tests/test_agent.py"
    fi
    [ -f "$D/py/examples/agents.py" ] && run_step "python agents.py" 120 env PYTHONPATH="$GPY" python3 "$D/py/examples/agents.py"
  fi
fi

# ---- 2. copy ceilings: torch copy_ of 1 GiB
timeout 180 python3 - > "$OUT/ceiling.txt" 2>&1 <<'PY'
import time
try:
    import torch
except ImportError as e:
    raise SystemExit(f"SKIPPED: ceiling: no torch: {e}")
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
if n == 0:
    raise SystemExit("SKIPPED: ceiling: no GPU")
B = 1 << 30
def rate(dst, src, reps=5):
    dst.copy_(src); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return B / sorted(ts)[reps // 2] / 1e9
g0 = torch.empty(B, dtype=torch.uint8, device="cuda:0")
cases = [("GPU0->GPU0", lambda: (torch.empty(B, dtype=torch.uint8, device="cuda:0"), g0))]
if n >= 2:
    # Both directions: a READ pulls GPU1->GPU0 (initiator on GPU 0), a WRITE pushes GPU0->GPU1.
    cases.insert(0, ("GPU1->GPU0", lambda: (g0, torch.ones(B, dtype=torch.uint8, device="cuda:1"))))
    cases.insert(1, ("GPU0->GPU1", lambda: (torch.empty(B, dtype=torch.uint8, device="cuda:1"), g0)))
cases.append(("pinned host->GPU0", lambda: (g0, torch.ones(B, dtype=torch.uint8).pin_memory())))
for name, make in cases:
    try:
        dst, src = make()
        print(f"ceiling: torch copy_ 1 GiB {name}: {rate(dst, src):.1f} GB/s")
        del dst, src
    except Exception as e:
        print(f"ceiling: {name}: FAILED: {e}")
PY
while read -r l; do note "$l"; done < <(grep -E '^(ceiling|SKIPPED)' "$OUT/ceiling.txt")

# ---- 3. gpuio xfer and NIXL, the same cases, alternating
# label|arguments|gpuio-only arguments|environment for both|process counts (default $PROCS)
# (initiator and target; READ pulls from the target, WRITE pushes to it)
CASE_LIST="DRAM<-DRAM 64x16M|--initiator dram --target dram --size 16M --descs 64"
[ "$NGPU" -ge 1 ] && CASE_LIST+=$'\n'"VRAM:0<-VRAM:0 64x16M|--initiator vram:0 --target vram:0 --size 16M --descs 64"
[ "$NGPU" -ge 2 ] && CASE_LIST+=$'\n'"VRAM:0<-VRAM:1 64x16M|--initiator vram:0 --target vram:1 --size 16M --descs 64"
[ "$NGPU" -ge 1 ] && CASE_LIST+=$'\n'"VRAM:0<-DRAM 64x16M|--initiator vram:0 --target dram --size 16M --descs 64"
CASE_LIST+=$'\n'"DRAM<-DRAM 65536x4K|--initiator dram --target dram --size 4K --descs 65536"
# Host memory between two processes over UCX (gpuio's own same-host path off), as UCX picks
# its transports and over TCP alone (UCX_TLS=tcp for both libraries).
CASE_LIST+=$'\n'"DRAM<-DRAM 64x16M UCX|--initiator dram --target dram --size 16M --descs 64|--no-ipc||2"
CASE_LIST+=$'\n'"DRAM<-DRAM 64x16M UCX tcp|--initiator dram --target dram --size 16M --descs 64|--no-ipc|UCX_TLS=tcp|2"
CASE_LIST+=$'\n'"notif|--notif"
[ "$NGPU" -ge 1 ] || note "SKIPPED: VRAM cases: no GPU here"
INDEX=$OUT/runs.tsv
: > "$INDEX"
one() { # impl, case, procs, op, round, command...
  local impl=$1 case=$2 procs=$3 op=$4 r=$5 log rc
  shift 5
  log="$OUT/logs/xfer-$impl-${case//[^A-Za-z0-9]/_}-p$procs-$op-$r.log"
  timeout "$T" "$@" > "$log" 2>&1; rc=$?
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$impl" "$case" "$procs" "$op" "$r" "$rc" "$log" >> "$INDEX"
  echo "  $impl $case procs=$procs $op #$r: rc=$rc $(grep -vE '^\{' "$log" | tail -1 | cut -c1-160)"
}
while IFS='|' read -r label cargs gargs cenv cprocs; do
  [ -n "$label" ] || continue
  [[ "$label" =~ ${CASES:-.} ]] || continue
  for procs in ${cprocs:-${PROCS:-1 2}}; do
    [[ " ${PROCS:-1 2} " == *" $procs "* ]] || continue
    for op in read write; do
      [ "$label" = notif ] && [ $op = write ] && continue
      opargs=(--op $op); [ "$label" = notif ] && opargs=()
      for r in $(seq 1 "$ROUNDS"); do
        # shellcheck disable=SC2086
        one gpuio "$label" $procs $op "$r" env $cenv "$D/bin/gpuio" xfer $cargs $gargs "${opargs[@]}" --procs $procs --iters "$ITERS" --json
        if [ -n "$NPY" ]; then
          # shellcheck disable=SC2086
          one nixl "$label" $procs $op "$r" env $cenv PYTHONPATH="$D/nixl/site" "$NPY" "$D/nixl_xfer.py" $cargs "${opargs[@]}" --procs $procs --iters "$ITERS" --json
        fi
      done
    done
  done
done <<< "$CASE_LIST"

python3 - "$INDEX" "$OUT/xfer.jsonl" "$NPY" > "$OUT/xfer.md" <<'PY'
import json, statistics, sys
index, jsonl, npy = sys.argv[1:4]
runs = {}
with open(jsonl, "w") as out:
    for line in open(index):
        impl, case, procs, op, r, rc, log = line.rstrip("\n").split("\t")
        text = open(log, errors="replace").read().splitlines()
        js = [l for l in text if l.startswith("{")]
        rec = {"impl": impl, "case": case, "procs": int(procs), "op": op, "round": int(r), "rc": int(rc)}
        if js and rc == "0":
            rec.update(json.loads(js[-1]))
        else:
            skipped = [l for l in text if l.startswith("SKIPPED")]
            rec["error"] = (skipped or [l for l in text if l.strip()] or [f"no output (rc {rc}{', timed out' if rc == '124' else ''})"])[-1][:200]
        out.write(json.dumps(rec) + "\n")
        runs.setdefault((case, int(procs), op), {}).setdefault(impl, []).append(rec)
def cell(recs, key, fmt):
    ok = [x[key] for x in recs or [] if key in x]
    if ok:
        return fmt % statistics.median(ok) + ("" if len(ok) == len(recs) else f" ({len(recs) - len(ok)} failed)")
    if not recs:
        return "not run" + ("" if npy else " (no python3.12)")
    err = recs[-1].get("error", "?").replace("|", "/")
    return (err if err.startswith("SKIPPED") else "FAILED: " + err)[:90]
def path(recs):
    p = [x["path"] for x in recs or [] if "path" in x]
    return max(set(p), key=p.count) if p else ""
print("| case | procs | op | gpuio GB/s | NIXL GB/s | gpuio/NIXL | gpuio path | NIXL path |")
print("|---|---|---|---|---|---|---|---|")
notif = []
for (case, procs, op), by in runs.items():
    g, n = by.get("gpuio"), by.get("nixl")
    if case == "notif":
        notif.append((procs, g, n))
        continue
    gm = [x["gbps"] for x in g or [] if "gbps" in x]
    nm = [x["gbps"] for x in n or [] if "gbps" in x]
    ratio = "%.2f" % (statistics.median(gm) / statistics.median(nm)) if gm and nm and statistics.median(nm) > 0 else ""
    print(f"| {case} | {procs} | {op.upper()} | {cell(g, 'gbps', '%.2f')} | {cell(n, 'gbps', '%.2f')} | {ratio} | {path(g)} | {path(n)} |")
if notif:
    print("\n| notification one way | procs | gpuio p50 us | gpuio p99 us | NIXL p50 us | NIXL p99 us |")
    print("|---|---|---|---|---|---|")
    for procs, g, n in notif:
        print(f"| ping-pong / 2 | {procs} | {cell(g, 'notif_one_way_p50_us', '%.1f')} | {cell(g, 'p99_us', '%.1f')} "
              f"| {cell(n, 'notif_one_way_p50_us', '%.1f')} | {cell(n, 'p99_us', '%.1f')} |")
PY
{ echo; grep -E '^(ceiling|SKIPPED: ceiling)' "$OUT/ceiling.txt" | sed 's/^/- /'; } >> "$OUT/xfer.md"

echo
echo "==== gpuio agents vs NIXL: summary ===="
printf '%s\n' "${SUMMARY[@]}"
echo
cat "$OUT/xfer.md"
echo
echo "(records: $OUT/xfer.jsonl; logs: $OUT/logs)"
RUN
chmod +x "$OUT/agents.sh" "$OUT/nixl_xfer.py"

du -sh "$OUT"
# The device tool carries at most 64 MiB: the packed bundle travels instead. gzip where it fits
# with room to spare, xz otherwise (tar xf reads either; the name stays DIR.tar.gz).
tar -C "$(dirname "$OUT")" -czf "$OUT.tar.gz" "$(basename "$OUT")"
if [ "$(stat -c %s "$OUT.tar.gz")" -gt $((48 << 20)) ]; then
  tar -C "$(dirname "$OUT")" -cJf "$OUT.tar.gz" "$(basename "$OUT")"
  echo "agent-bundle: compressed with xz (gzip would pass 48 MiB)"
fi
echo "agent-bundle: $OUT.tar.gz is $(du -h "$OUT.tar.gz" | cut -f1) ($(stat -c %s "$OUT.tar.gz") bytes)"
