#!/usr/bin/env bash
# Builds everything a GPU machine without a Rust toolchain needs to run gpuio's tests and
# benchmarks: release test binaries, the gpuio CLI and the examples, stripped, plus a runner.
#
#   scripts/gpu-bundle.sh [DIR]        # default DIR: gpu-bundle (git-ignored), and DIR.tar.gz
#   # copy DIR (or DIR.tar.gz, unpacked) to the GPU machine, then:  DIR/run.sh
#   # the data-path rows (issue 20) alone:                          DIR/datapath.sh
#
# run.sh runs every test binary (device tests included), the C API's test programs and its
# throughput next to `gpuio bench` (CAPI=0 skips them), the Python package's pytest suite
# (PY=1, default) and its checkpoint benchmark, `gpuio check`, the copy ceilings and
# `gpuio bench --to gpu`, and prints a table last. The bundle must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-bundle}
rm -rf "$OUT"
mkdir -p "$OUT/tests" "$OUT/bin"

cargo build --release --workspace --bins --examples
# Prints "kind-name<TAB>executable" for each compiled test (or bench) target cargo reports.
executables() { # cargo args...
  cargo "$@" --message-format=json 2>/dev/null | python3 scripts/cargo-executables.py
}
executables test --release --workspace --no-run | while IFS=$'\t' read -r name exe; do
  # gpuio-capi's test harnesses compile C and read the crate's source: the capi phase of
  # run.sh runs the C programs they compile, built below, instead. tests/layering.rs reads
  # src/ at the build machine's path (a property of the source, not of the machine): it ran
  # here, and FAILed in the bundle on the H200 only because that path is absent there.
  case "$name" in test-c_api|test-header|test-layering) continue ;; esac
  cp "$exe" "$OUT/tests/$name"
done
# The criterion benches that measure device memory (they skip, saying why, without a GPU).
executables bench --workspace --no-run | while IFS=$'\t' read -r name exe; do
  case "$name" in bench-device_*) cp "$exe" "$OUT/bin/${name#bench-}" ;; esac
done
cp target/release/gpuio "$OUT/bin/"
for ex in target/release/examples/*; do
  [ -f "$ex" ] && [ -x "$ex" ] && case "$ex" in *-*|*.d) ;; *) cp "$ex" "$OUT/bin/" ;; esac
done
strip "$OUT"/tests/* "$OUT"/bin/*
# The C API: the library, its header, and the C test programs and examples compiled here (the
# GPU machine has no compiler), finding the library through $ORIGIN/../lib.
cargo build --release -p gpuio-capi --lib
mkdir -p "$OUT/capi/lib" "$OUT/capi/include" "$OUT/capi/bin"
cp "${CARGO_TARGET_DIR:-target}/release/libgpuio_capi.so" "$OUT/capi/lib/"
cp gpuio-capi/include/gpuio.h "$OUT/capi/include/"
for src in gpuio-capi/tests/c/*.c examples/c/*.c examples/c/*.cpp; do
  name=$(basename "${src%.*}")
  case "$src" in
    *.cpp) comp=${CXX:-c++} std=-std=c++17 ;;
    *) comp=${CC:-cc} std=-std=c11 ;;
  esac
  "$comp" "$std" -D_GNU_SOURCE -O2 -Wall -Werror -I gpuio-capi/include -I gpuio-capi/tests/c \
    -I examples/c "$src" -o "$OUT/capi/bin/$name" -L "${CARGO_TARGET_DIR:-target}/release" \
    -lgpuio_capi -lpthread -ldl -Wl,-rpath,'$ORIGIN/../lib'
done
strip "$OUT"/capi/lib/* "$OUT"/capi/bin/*
mkdir -p "$OUT/peers" && cp scripts/peers/*.py "$OUT/peers/"
cp scripts/gpu-datapath.sh "$OUT/datapath.sh"
# A static fio (the GPU machine has none) for `gpuio bench --compare` there.
if fio_bin=$(bash scripts/fio.sh build 2>/dev/null); then
  cp "$fio_bin" "$OUT/bin/fio"
else
  echo "gpu-bundle: fio could not be built; --compare will measure gpuio alone there" >&2
fi
# KvikIO's C++ library and a peer program built against it (the GPU machine has no network,
# no compiler and no CuPy), for the rows that compare with KvikIO.
if ! bash scripts/kvikio-peer.sh bundle "$OUT/kvikio" >/dev/null; then
  echo "gpu-bundle: the KvikIO peer could not be built; its rows will say so" >&2
fi
# SPDK (the initiator library, nvmf_tgt, perf and the libraries they need), built here once
# by scripts/spdk.sh: the GPU machine has no compiler and no package manager.
if bash scripts/spdk.sh build >/dev/null 2>&1; then
  bash scripts/spdk.sh bundle "$OUT/spdk" >/dev/null
  cp scripts/spdk.sh "$OUT/spdk.sh"
else
  echo "gpu-bundle: SPDK could not be built; the bundle's SPDK tests will skip" >&2
fi

# The Python package as an abi3 wheel (built here: the GPU machine has no Rust), its pytest
# suite and its benchmark; run.sh unpacks the wheel onto PYTHONPATH (nothing is installed).
PYVENV=${GPUIO_PY_VENV:-$PWD/target/py-venv}
if [ ! -x "$PYVENV/bin/maturin" ]; then
  python3 -m venv "$PYVENV" && "$PYVENV/bin/python" -m pip install -q maturin==1.16.0
fi
mkdir -p "$OUT/py"
"$PYVENV/bin/maturin" build --release --strip -m gpuio-py/Cargo.toml -o "$OUT/py" >/dev/null
cp -r gpuio-py/tests "$OUT/py/tests" && cp -r gpuio-py/bench "$OUT/py/bench"
# The checkpoint loaders the benchmark compares with (the GPU machine cannot download them);
# unpacked onto PYTHONPATH after gpuio's by py/bench/unpack_wheels.py.
if ! bash scripts/loader-wheels.sh "$OUT/py/loaders" >/dev/null; then
  echo "gpu-bundle: the peer loaders' wheels could not be downloaded; their rows will say absent" >&2
fi
rm -rf "$OUT"/py/tests/__pycache__ "$OUT"/py/bench/__pycache__
cat > "$OUT/py/run.sh" <<'PYRUN'
#!/usr/bin/env bash
# The Python part alone: unpacks the wheel onto PYTHONPATH (nothing is installed), runs the
# pytest suite, then the benchmark on CHECKPOINT (a .safetensors file) when one is given.
#   py/run.sh [CHECKPOINT [load_checkpoint.py args...]]
set -uo pipefail
cd "$(dirname "$0")"
rm -rf site && mkdir -p site && python3 -m zipfile -e gpuio-*.whl site || exit 1
export PYTHONPATH=$PWD/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import gpuio; print(gpuio.check())'
python3 -m pytest -rsfE -p no:cacheprovider tests; rc=$?
if [ $# -gt 0 ]; then
  ckpt=$1; shift
  peers=$(python3 bench/unpack_wheels.py loaders loaders-site)
  PYTHONPATH=$PYTHONPATH${peers:+:$peers} python3 bench/load_checkpoint.py "$ckpt" --rust-example ../bin/load_safetensors "$@" || rc=1
fi
exit $rc
PYRUN
chmod +x "$OUT/py/run.sh"

cat > "$OUT/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the gpuio bundle on a GPU machine. Writes logs under $LOGS (default ./logs).
# Phase A runs every test as the machine comes (AUTO falls back to the bounce path where
# cuFile cannot register files); phase B gives cuFile the udev data it needs (root only, see
# ENVIRONMENT.md), requires cuFile in the cuFile and device tests, and benchmarks cuFile
# against the bounce path on the same file; the fio rows compare with fio and KvikIO.
set -uo pipefail
cd "$(dirname "$0")"
LOGS=${LOGS:-$PWD/logs}
mkdir -p "$LOGS"
export GPUIO_TEST_DIR=${GPUIO_TEST_DIR:-/tmp/gpuio-tests}
mkdir -p "$GPUIO_TEST_DIR"
# The CLI tests run the bundle's binary (their build-tree path does not exist here).
export GPUIO_BIN=$PWD/bin/gpuio
if [ -f spdk/lib/libspdk_gpuio.so ]; then
  # SPDK travels with the bundle: the tests start their own NVMe/TCP targets with spdk.sh.
  export GPUIO_SPDK_HOME=$PWD/spdk GPUIO_SPDK_SCRIPT=$PWD/spdk.sh GPUIO_SPDK_REQUIRED=1 GPUIO_SPDK_HUGE_MIB=8192
  export LD_LIBRARY_PATH=$PWD/spdk/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# The bundle's own tools (fio among them) come first.
export PATH=$PWD/bin:$PATH
TABLE=()
run_test() { # phase, binary
  local phase=$1 t=$2 name start status secs summary skips
  name=$(basename "$t")
  start=$(date +%s)
  if timeout "${TEST_TIMEOUT:-240}" "$t" --test-threads=4 > "$LOGS/test-$phase-$name.log" 2>&1; then status=PASS; else status=FAIL; fi
  summary=$(grep -E '^test result:' "$LOGS/test-$phase-$name.log" | tail -1 | sed -E 's/test result: (ok|FAILED)\. //; s/; finished.*//')
  secs=$(( $(date +%s) - start ))
  skips=$(grep -c '^SKIPPED' "$LOGS/test-$phase-$name.log")
  TABLE+=("$(printf '%-34s %-5s %4ss  %s  skipped-parts=%s' "$phase:$name" "$status" "$secs" "$summary" "$skips")")
}
bench() { # label, args...
  local label=$1; shift
  local j
  j=$(./bin/gpuio bench "$@" --json 2>>"$LOGS/bench-err.log" | tail -n 1)
  echo "$label $j" >> "$LOGS/bench.jsonl"
  TABLE+=("$(printf '%-46s %s' "$label" "$(echo "$j" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%7.2f GB/s %8.0f IOPS via %s" % (j["gbps"], j["iops"], j["backend"]))' 2>/dev/null || echo "FAILED (see bench-err.log)")")")
}
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }

# ---- phase A: the machine as it comes
./bin/gpuio check "$GPUIO_TEST_DIR" > "$LOGS/check-before.txt" 2>&1
export GPUIO_EXPECT_AUTO=bounce
# SKIP_A=1 skips phase A's tests (a rerun on a machine whose udev data is already fixed).
[ -n "${SKIP_A:-}" ] || for t in tests/*; do run_test A "$t"; done
unset GPUIO_EXPECT_AUTO

# ---- Python: the wheel unpacked onto PYTHONPATH, its pytest suite with the GPU tests (torch,
# cupy, a 2 GiB checkpoint against safetensors.torch). PY=0 skips it and the Python benchmark.
if [ "${PY:-1}" = 1 ]; then
  rm -rf py/site && mkdir -p py/site
  if python3 -m zipfile -e py/gpuio-*.whl py/site 2> "$LOGS/py-unpack.err"; then
    start=$(date +%s)
    if (cd py && PYTHONPATH="$PWD/site" timeout "${PY_TIMEOUT:-900}" python3 -m pytest -rsfE -p no:cacheprovider tests) > "$LOGS/py-tests.log" 2>&1; then status=PASS; else status=FAIL; fi
    summary=$(grep -E '^=+ .*(passed|failed|error|skipped).* =+$' "$LOGS/py-tests.log" | tail -1 | tr -d '=' | xargs)
    TABLE+=("$(printf '%-34s %-5s %4ss  %s' "py:pytest" "$status" "$(( $(date +%s) - start ))" "$summary")")
    while read -r l; do TABLE+=("py: $l"); done < <(grep -E '^(SKIPPED|FAILED|ERROR) ' "$LOGS/py-tests.log" | head -20)
  else
    TABLE+=("py:pytest FAIL: the wheel did not unpack: $(tail -1 "$LOGS/py-unpack.err")")
  fi
fi
./bin/copy_ceiling 1024 | tee "$LOGS/ceiling.txt"
while read -r l; do TABLE+=("$l"); done < <(grep -E 'host-to-device|driver call|SKIPPED' "$LOGS/ceiling.txt")
F="$GPUIO_TEST_DIR/bench.bin"
./bin/gpuio bench --file "$F" --rw write --size 4G --bs 8M --qd 8 --seconds "${WRITE_SECONDS:-30}" > /dev/null 2>>"$LOGS/bench-err.log" || true
# The single-thread io_uring floor for 4 KiB O_DIRECT reads on this disk, and what hand-offs
# to one or sixteen other threads cost (examples/uring_ceiling.rs).
for v in "defer" "defer handoff" "defer peers16"; do
  drop_caches
  # shellcheck disable=SC2086
  TABLE+=("$(./bin/uring_ceiling "$F" 64 3 $v 2>&1 | tail -1)")
done

# ---- the C API (CAPI=0 skips): its C test programs (device memory included; each prints
# PASS or why it skipped), the C example and the C++ wrapper, and C async read throughput next
# to gpuio bench on the same file with the same settings, alternating (CAPI_ROUNDS, default 3).
if [ "${CAPI:-1}" = 1 ]; then
  for t in capi/bin/sync capi/bin/async capi/bin/batch capi/bin/errors capi/bin/pending \
           capi/bin/threads capi/bin/device capi/bin/fork; do
    name=$(basename "$t")
    dir=$(mktemp -d "$GPUIO_TEST_DIR/capi-XXXXXX")
    start=$(date +%s)
    if timeout "${TEST_TIMEOUT:-240}" "$t" "$dir" > "$LOGS/capi-$name.log" 2>&1 \
       && grep -qx "PASS $name" "$LOGS/capi-$name.log"; then status=PASS; else status=FAIL; fi
    TABLE+=("$(printf '%-34s %-5s %4ss  %s' "capi:$name" "$status" "$(( $(date +%s) - start ))" \
      "$(grep -m1 -E '^(SKIPPED|FAIL)' "$LOGS/capi-$name.log")")")
    rm -rf "$dir"
  done
  C="$GPUIO_TEST_DIR/capi.bin"
  head -c 1G "$F" > "$C"
  ./capi/bin/read_file "$C" > "$LOGS/capi-read_file.txt" 2>&1
  TABLE+=("capi read_file rc=$?")
  while read -r l; do TABLE+=("capi read_file $l"); done < <(grep -E '^(host|device):' "$LOGS/capi-read_file.txt")
  ./capi/bin/raii "$C" > "$LOGS/capi-raii.txt" 2>&1
  TABLE+=("capi raii (C++) rc=$?: $(grep -E '^async:' "$LOGS/capi-raii.txt")")
  rm -f "$C"
  # label|gpuio bench args|throughput args (the same settings)
  while IFS='|' read -r label bargs cargs; do
    [ -z "$label" ] && continue
    for r in $(seq 1 "${CAPI_ROUNDS:-3}"); do
      case "$label" in warm*) cat "$F" > /dev/null ;; *) drop_caches ;; esac
      # shellcheck disable=SC2086
      b=$(./bin/gpuio bench --file "$F" --size 4G $bargs --seconds 4 --json 2>>"$LOGS/bench-err.log" \
        | tail -n 1 | python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["gbps"])' 2>/dev/null)
      case "$label" in warm*) ;; *) drop_caches ;; esac
      # shellcheck disable=SC2086
      c=$(./capi/bin/throughput "$F" $cargs --seconds 4 2>>"$LOGS/capi-throughput.err" \
        | tee -a "$LOGS/capi-throughput.txt" | sed -nE 's/.*: ([0-9.]+) GB\/s$/\1/p')
      TABLE+=("$(printf '%-40s' "capi $label #$r") C async ${c:-FAILED} GB/s, gpuio bench ${b:-FAILED} GB/s, C/bench $(python3 -c "print('%.3f' % ($c / $b))" 2>/dev/null || echo n/a)")
    done
  done <<EOF_CAPI
warm 1M qd32 to host|--bs 1M --qd 32|--bs 1048576 --qd 32
warm 16M qd8 to gpu|--bs 16M --qd 8 --to gpu|--bs 16777216 --qd 8 --gpu 0
O_DIRECT 1M qd32 to host|--bs 1M --qd 32 --direct|--bs 1048576 --qd 32 --direct
O_DIRECT 4M qd16 to gpu|--bs 4M --qd 16 --direct --to gpu|--bs 4194304 --qd 16 --direct --gpu 0
EOF_CAPI
fi

# ---- phase B: give cuFile its udev data, then require it
d=$(mountpoint -d "$(df --output=target "$GPUIO_TEST_DIR" | tail -1)")
if [ ! -e "/run/udev/data/b$d" ]; then
  mkdir -p /run/udev/data && printf 'E:ID_FS_TYPE=ext4\nE:ID_FS_USAGE=filesystem\n' > "/run/udev/data/b$d" \
    && echo "udev fix applied for $d" > "$LOGS/udev-fix.txt"
fi
./bin/gpuio check "$GPUIO_TEST_DIR" > "$LOGS/check-after.txt" 2>&1
grep -E 'verdict|nvidia-fs|library' "$LOGS/check-after.txt" | while read -r l; do echo "check: $l"; done >> "$LOGS/verdicts.txt"
export GPUIO_REQUIRE_GDS=1
if grep -q 'nvidia-fs: loaded' "$LOGS/check-after.txt"; then export GPUIO_EXPECT_AUTO=gds; else export GPUIO_EXPECT_AUTO=compat; fi
# SKIP_B=1 skips phase B's tests (a benchmark-only run).
[ -n "${SKIP_B:-}" ] || for t in tests/test-gds tests/test-device tests/test-batch tests/test-gpu_faults; do [ -x "$t" ] && run_test B "$t"; done
unset GPUIO_REQUIRE_GDS GPUIO_EXPECT_AUTO

# ---- fio side by side on the same file, same settings, alternating rounds (fio reads into
# host memory: for GPU rows it is the storage side's ceiling). FIO_COMPARE=0 skips.
if [ "${FIO_COMPARE:-1}" = 1 ] && command -v fio >/dev/null; then
  W="$GPUIO_TEST_DIR/write.bin"
  # label|file|gpuio bench args|environment (optional, e.g. the runtime's worker count)
  # Rows whose label starts with "warm" read the file into the page cache first; the others
  # drop it. Rows with $KV in their environment compare with KvikIO too (its best thread
  # count of KVIKIO_THREADS, default 8,16,32).
  KV="GPUIO_KVIKIO_PEER=$PWD/kvikio/kvikio-peer"
  while IFS='|' read -r label file args envs; do
    [ -z "$label" ] && continue
    case "$label" in warm*) cat "$file" > /dev/null ;; *) drop_caches ;; esac
    case "$envs" in *GPUIO_KVIKIO_PEER*) args="$args --kvikio-threads ${KVIKIO_THREADS:-8,16,32}" ;; esac
    # shellcheck disable=SC2086
    env $envs ./bin/gpuio bench --file "$file" --size 4G $args --seconds "${FIO_SECONDS:-4}" --rounds "${FIO_ROUNDS:-3}" --compare > "$LOGS/fio-${label//[^A-Za-z0-9_.-]/_}.txt" 2>&1
    log="$LOGS/fio-${label//[^A-Za-z0-9_.-]/_}.txt"
    TABLE+=("$(printf '%-34s' "$label") $(grep 'vs fio' "$log" | sed 's/.*): //' || echo "FAILED: $(tail -1 "$log")")")
    case "$envs" in *GPUIO_KVIKIO_PEER*)
      TABLE+=("$(printf '%-34s' "$label") $(grep 'vs kvikio' "$log" | sed 's/.*(medians of [0-9]*, //' || grep -- '--compare' "$log" | tail -1)") ;;
    esac
  done <<EOF_SPECS
warm 16M qd8 to gpu|$F|--bs 16M --qd 8 --to gpu|$KV
O_DIRECT 4M qd16 to gpu|$F|--bs 4M --qd 16 --direct --to gpu|$KV
O_DIRECT 4K rand qd64 to gpu|$F|--bs 4K --qd 64 --pattern rand --direct --to gpu
O_DIRECT 4K rand qd128 to gpu|$F|--bs 4K --qd 128 --pattern rand --direct --to gpu
O_DIRECT 4K rand qd64 to gpu, 2 workers|$F|--bs 4K --qd 64 --pattern rand --direct --to gpu|TOKIO_WORKER_THREADS=2
O_DIRECT batch 64x4K qd8 to gpu|$F|--bs 4K --qd 8 --pattern batch --batch 64 --direct --to gpu
O_DIRECT write 4M qd16 from gpu|$W|--rw write --bs 4M --qd 16 --direct --to gpu
O_DIRECT 1M qd32 to host|$F|--bs 1M --qd 32 --direct
O_DIRECT 4K rand qd64 to host|$F|--bs 4K --qd 64 --pattern rand --direct
O_DIRECT 4K rand qd64 to host, 2 workers|$F|--bs 4K --qd 64 --pattern rand --direct|TOKIO_WORKER_THREADS=2
O_DIRECT 4K rand qd64 to host, owned|$F|--bs 4K --qd 64 --pattern rand --direct --owned
O_DIRECT 1M qd32 to host, owned|$F|--bs 1M --qd 32 --direct --owned
EOF_SPECS
fi

# ---- SPDK: gpuio over NVMe/TCP into GPU and host memory, next to SPDK's perf on the same
# target (perf reads into host DMA memory). SPDK_BENCH=0 skips.
if [ -n "${GPUIO_SPDK_HOME:-}" ] && [ "${SPDK_BENCH:-1}" = 1 ]; then
  trid=$(bash spdk.sh start --port 4420 --size 1024 --core 1 2>>"$LOGS/spdk.err")
  for r in 1 2 3; do
    bench "spdk 128K qd32 to gpu #$r" --backend spdk --target "$trid" --bs 128K --qd 32 --to gpu --seconds 4
    bench "spdk 4K rand qd64 to gpu #$r" --backend spdk --target "$trid" --bs 4K --qd 64 --pattern rand --to gpu --seconds 4
    for a in "--bs 128K --qd 32" "--bs 4K --qd 64 --pattern rand"; do
      ./bin/gpuio bench --backend spdk --target "$trid" $a --seconds 4 --compare > "$LOGS/spdk-compare.txt" 2>&1
      TABLE+=("spdk to host $a #$r: $(grep 'vs spdk-perf' "$LOGS/spdk-compare.txt" | sed 's/.*): //')")
    done
  done
  bash spdk.sh stop --port 4420
fi

# ---- benchmarks: bounce path (uring) vs cuFile (gds), same file, alternating, 3 rounds
# WARM_ROUNDS: only the page-cache-warm 4 GiB reads into GPU memory (the pinned-copy target).
[ "${WARM_ROUNDS:-0}" -gt 0 ] && cat "$F" > /dev/null  # into the page cache first
for r in $(seq 1 "${WARM_ROUNDS:-0}"); do
  bench "warm 16M qd8 to gpu #$r" --file "$F" --size 4G --bs 16M --qd 8 --to gpu --seconds 5
done
for r in $(seq 1 "${BENCH_ROUNDS:-3}"); do
  for be in uring gds; do
    bench "warm 16M qd8 to gpu $be #$r" --backend $be --file "$F" --size 4G --bs 16M --qd 8 --to gpu --seconds 5
    drop_caches
    bench "O_DIRECT 4M qd16 to gpu $be #$r" --backend $be --file "$F" --size 4G --bs 4M --qd 16 --direct --to gpu --seconds 5
    bench "O_DIRECT 4K rand qd64 to gpu $be #$r" --backend $be --file "$F" --size 4G --bs 4K --qd 64 --pattern rand --direct --to gpu --seconds 5
  done
  bench "O_DIRECT 4M qd16 to gpu auto #$r" --file "$F" --size 4G --bs 4M --qd 16 --direct --to gpu --seconds 5
  bench "warm 16M qd8 to host #$r" --file "$F" --size 4G --bs 16M --qd 8 --seconds 5
done
# ---- several GPUs, where the machine has them: one GPU against all of them (tasks spread
# over the GPUs, each GPU's rate in bench.jsonl's per_gpu_gbps), page cache warm, alternating.
# MULTI_GPU=0 skips.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${NGPU:-0}" -ge 2 ] && [ "${MULTI_GPU:-1}" = 1 ]; then
  cat "$F" > /dev/null
  for r in $(seq 1 "${BENCH_ROUNDS:-3}"); do
    bench "warm 16M qd8 to gpu:0 #$r" --file "$F" --size 4G --bs 16M --qd 8 --to gpu:0 --seconds 4
    bench "warm 16M qd$((8 * NGPU)) to gpu:all #$r" --file "$F" --size 4G --bs 16M --qd $((8 * NGPU)) --to gpu:all --seconds 4
    bench "warm 4K rand qd64 to gpu:0 #$r" --file "$F" --size 4G --bs 4K --qd 64 --pattern rand --to gpu:0 --seconds 4
    bench "warm 4K rand qd$((64 * NGPU)) to gpu:all #$r" --file "$F" --size 4G --bs 4K --qd $((64 * NGPU)) --pattern rand --to gpu:all --seconds 4
  done
fi
# ---- examples, the device criterion bench, and sweeps drawn as plots
# EXAMPLES=0 skips this part.
if [ "${EXAMPLES:-1}" = 1 ]; then
  ./bin/quickstart "$F" > "$LOGS/quickstart.txt" 2>&1; TABLE+=("quickstart: $(tail -1 "$LOGS/quickstart.txt")")
  ./bin/pipeline "$F" 64 2 > "$LOGS/pipeline.txt" 2>&1; TABLE+=("pipeline 64M K=2: $(tail -1 "$LOGS/pipeline.txt")")
  ./bin/service --requests 50000 --clients 64 > "$LOGS/service.txt" 2>&1
  while read -r l; do TABLE+=("service: $l"); done < <(tail -3 "$LOGS/service.txt")
  ./bin/device_read --bench > "$LOGS/device_read.txt" 2>&1
  while read -r l; do TABLE+=("criterion $l"); done < <(python3 -c '
import re, sys
name = None
for line in open(sys.argv[1]):
    m = re.match(r"^(device_read/\S+)", line)
    if m: name = m.group(1)
    t = re.search(r"thrpt:\s+\[\S+ \S+ (\S+ \S+) \S+ \S+\]", line)
    if t and name: print(name, t.group(1)); name = None
' "$LOGS/device_read.txt")
  for mode in warm direct; do
    flag=; [ $mode = direct ] && { flag=--direct; drop_caches; }
    ./bin/gpuio bench --file "$F" --size 4G --to gpu $flag --bs 64K,1M,4M,16M --qd 1,4,16 \
      --backend uring,gds --seconds 1 --plot "$LOGS/gpu-sweep-$mode.svg" > "$LOGS/gpu-sweep-$mode.txt" 2>&1
    TABLE+=("sweep $mode: $(tail -1 "$LOGS/gpu-sweep-$mode.txt")")
  done
fi

# ---- checkpoints and batches: safetensors into GPU memory vs safetensors+torch, batched reads
# CHECKPOINT_MIB sets the checkpoint's size (default 4096); BATCHES=0 skips this part.
if [ "${BATCHES:-1}" = 1 ]; then
  M="$GPUIO_TEST_DIR/model.safetensors"
  [ -f "$M" ] || ./bin/load_safetensors --make "$M" "${CHECKPOINT_MIB:-4096}" > "$LOGS/st-make.txt" 2>&1
  ./bin/load_safetensors "$M" > "$LOGS/st-verify.txt" 2>&1; TABLE+=("safetensors verified run: $(tail -1 "$LOGS/st-verify.txt")")
  for mode in warm cold; do
    for r in 1 2 3; do
      [ $mode = cold ] && drop_caches
      ./bin/load_safetensors "$M" --no-verify > "$LOGS/st-gpuio-$mode-$r.txt" 2>&1
      TABLE+=("safetensors gpuio $mode #$r: $(tail -1 "$LOGS/st-gpuio-$mode-$r.txt" | sed -E 's/.* in ([0-9.]+ s) .*: /\1 /')")
    done
    flag=; [ $mode = cold ] && flag=--cold
    if python3 peers/safetensors_torch.py "$M" --reps 3 $flag > "$LOGS/st-torch-$mode.jsonl" 2> "$LOGS/st-torch.err"; then
      while read -r l; do TABLE+=("safetensors torch $mode: $l"); done < <(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line); print("%.3f s %.2f GB/s" % (j["seconds"], j["gbps"]))' "$LOGS/st-torch-$mode.jsonl")
    else
      TABLE+=("safetensors torch $mode: not measured: $(tail -1 "$LOGS/st-torch.err")")
    fi
  done
  for r in 1 2 3; do
    bench "batch 64x4K qd8 to gpu warm #$r" --file "$F" --size 4G --bs 4K --qd 8 --pattern batch --batch 64 --to gpu --seconds 4
    bench "rand 4K qd512 to gpu warm #$r" --file "$F" --size 4G --bs 4K --qd 512 --pattern rand --to gpu --seconds 4
    bench "batch 64x4K qd8 O_DIRECT to gpu #$r" --file "$F" --size 4G --bs 4K --qd 8 --pattern batch --batch 64 --direct --to gpu --seconds 4
    bench "rand 4K qd64 O_DIRECT to gpu #$r" --file "$F" --size 4G --bs 4K --qd 64 --pattern rand --direct --to gpu --seconds 4
  done
fi

# ---- the Python benchmark: gpuio.safetensors.torch.load_file against each peer present
# (absent ones say so), warm and cold, alternating, one process; raw read_into vs KvikIO.
# Same checkpoint as the Rust example's rows above. PY_BENCH=0 skips; PY_BENCH_ROUNDS.
if [ "${PY:-1}" = 1 ] && [ "${PY_BENCH:-1}" = 1 ] && [ -d py/site ]; then
  M="$GPUIO_TEST_DIR/model.safetensors"
  [ -f "$M" ] || ./bin/load_safetensors --make "$M" "${CHECKPOINT_MIB:-4096}" > "$LOGS/st-make.txt" 2>&1
  peers=$(python3 py/bench/unpack_wheels.py py/loaders py/loaders-site)
  PYTHONPATH="$PWD/py/site${peers:+:$PWD/$peers}" timeout "${PY_BENCH_TIMEOUT:-900}" python3 py/bench/load_checkpoint.py "$M" \
    --rounds "${PY_BENCH_ROUNDS:-3}" --rust-example ./bin/load_safetensors \
    --json "$LOGS/py-bench.jsonl" > "$LOGS/py-bench.txt" 2>&1
  while read -r l; do TABLE+=("py-bench: $l"); done < <(grep -E '^(checkpoint|verify|absent|failed|cold|summary|ratio|raw)' "$LOGS/py-bench.txt")
fi

# ---- soak into GPU memory (all backends incl. AUTO -> cuFile for O_DIRECT, and NVMe/TCP
# through SPDK where the bundle has it), then the cancellation storm under compute-sanitizer
# where the toolkit has it. SOAK_MINUTES (default 2) and STORM_MINUTES (default 1); 0 skips.
nvme_args=()
if [ -n "${GPUIO_SPDK_HOME:-}" ] && { [ "${SOAK_MINUTES:-2}" != 0 ] || [ "${STORM_MINUTES:-1}" != 0 ]; }; then
  trid=$(bash spdk.sh start --port 4422 --size 512 --core 1 2>>"$LOGS/spdk.err") && nvme_args=(--nvme "$trid")
fi
if [ "${SOAK_MINUTES:-2}" != 0 ]; then
  ./bin/gpuio soak --to gpu --minutes "${SOAK_MINUTES:-2}" --size 256M --dir "$GPUIO_TEST_DIR" "${nvme_args[@]}" > "$LOGS/soak-gpu.txt" 2>&1
  TABLE+=("soak to gpu ${SOAK_MINUTES:-2} min: $(tail -2 "$LOGS/soak-gpu.txt" | head -1) [$(tail -1 "$LOGS/soak-gpu.txt")]")
fi
if [ "${STORM_MINUTES:-1}" != 0 ]; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$CS" ]; then
    timeout 400 "$CS" --tool memcheck --leak-check no ./bin/gpuio soak --to gpu --minutes "${STORM_MINUTES:-1}" \
      --size 256M --tasks 1024 --regions 1024 --max-len 256K --drop-percent 25 --leak-percent 2 \
      --dir "$GPUIO_TEST_DIR" "${nvme_args[@]}" > "$LOGS/storm-memcheck.txt" 2>&1
    rc=$?
    # Errors whose innermost frame is inside libcufile are the vendor library's own API calls
    # (cuFileDriverOpen frees an invalid pointer on these VMs: measured with this build and
    # with 9682a3e alike); counted apart so that one of gpuio's would stand out.
    vendor=$(python3 - "$LOGS/storm-memcheck.txt" <<'PYV'
import re, sys
blocks = re.split(r"^========= (?=Program hit|Invalid|Error)", open(sys.argv[1]).read(), flags=re.M)[1:]
frames = [re.search(r"Host Frame:.*? in (\S+)", b) for b in blocks]
print(sum(1 for f in frames if f and "libcufile" in f.group(1)), len(blocks))
PYV
)
    TABLE+=("storm under compute-sanitizer memcheck: rc=$rc $(grep -E 'ERROR SUMMARY|soak passed|soak failed' "$LOGS/storm-memcheck.txt" | tr '\n' ' ') (inside libcufile, of all reported: ${vendor:-?}) [$(grep -E '^[0-9]+ s:' "$LOGS/storm-memcheck.txt" | tail -1)]")
    grep -E '^=+ +(Invalid|Program hit|Saved host backtrace)' -A4 "$LOGS/storm-memcheck.txt" | head -40 > "$LOGS/storm-memcheck-errors.txt"
  else
    TABLE+=("compute-sanitizer: not on this machine")
  fi
fi
[ ${#nvme_args[@]} -gt 0 ] && bash spdk.sh stop --port 4422

echo
echo "==== gpuio GPU bundle summary ===="
cat "$LOGS/verdicts.txt" 2>/dev/null
printf '%s\n' "${TABLE[@]}"
RUN
chmod +x "$OUT/run.sh"
du -sh "$OUT"
# The device tool carries at most 64 MiB: a gzip'ed tarball beside the directory travels
# instead (`tar xzf gpu-bundle.tar.gz && gpu-bundle/run.sh` there).
tar -C "$(dirname "$OUT")" -czf "$OUT.tar.gz" "$(basename "$OUT")"
du -sh "$OUT.tar.gz"
