#!/usr/bin/env bash
# KvikIO as a peer for `gpuio bench --compare`, for machines that cannot install it (the GPU
# machine: no network, no compiler, no CuPy). Downloads KvikIO's C++ library wheel (and the
# headers it needs to compile against) from PyPI, builds scripts/peers/kvikio_peer.cpp against
# it, and lays out a self-contained directory:
#
#   scripts/kvikio-peer.sh build          # prints the directory (kvikio-peer + lib/)
#   scripts/kvikio-peer.sh bundle DIR     # copies the built peer into DIR
#
# `gpuio bench --compare` runs DIR/kvikio-peer when it is on PATH or named by
# GPUIO_KVIKIO_PEER. At run time it needs only libcuda (and libcufile for --compat auto|off),
# which every GPU machine has. Output: ${GPUIO_KVIKIO_HOME:-~/.cache/gpuio/kvikio-peer}.
set -euo pipefail
HOME_DIR=${GPUIO_KVIKIO_HOME:-$HOME/.cache/gpuio/kvikio-peer}
SRC="$(cd "$(dirname "$0")" && pwd)/peers/kvikio_peer.cpp"
# The versions measured in BENCHMARKS.md (ENVIRONMENT.md's KvikIO 26.10, CUDA 13).
KVIKIO=${GPUIO_KVIKIO_VERSION:-26.10.0}
WHEELS=("libkvikio-cu13==$KVIKIO" "rapids-logger==0.3.0" "nvidia-cuda-runtime==13.*" "nvidia-cufile==1.*")

die() { echo "kvikio-peer.sh: $*" >&2; exit 1; }

build() {
    local stamp="$HOME_DIR/.built-$KVIKIO-$(sha256sum "$SRC" | cut -c1-16)"
    if [[ -x "$HOME_DIR/kvikio-peer" && -e "$stamp" ]]; then
        echo "$HOME_DIR"
        return
    fi
    command -v g++ >/dev/null || die "g++ is needed"
    command -v pip >/dev/null || command -v pip3 >/dev/null || die "pip is needed"
    local pip; pip=$(command -v pip || command -v pip3)
    local work="$HOME_DIR.work"
    rm -rf "$work" && mkdir -p "$work/wheels" "$work/x"
    "$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$work/wheels" "${WHEELS[@]}" >&2 \
        || die "could not download KvikIO's wheels from PyPI"
    for w in "$work"/wheels/*.whl; do
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$work/x"
    done
    local x="$work/x" cuinc
    cuinc=$(dirname "$(find "$x/nvidia" -name cuda.h | head -1)")
    [[ -f "$cuinc/cufile.h" ]] || die "the CUDA wheels carry no cuda.h/cufile.h"
    rm -rf "$HOME_DIR" && mkdir -p "$HOME_DIR/lib"
    cp "$x"/libkvikio/lib64/libkvikio.so "$x"/rapids_logger/lib64/librapids_logger.so "$HOME_DIR/lib/"
    cp "$x"/libkvikio_cu13.libs/*.so* "$HOME_DIR/lib/" 2>/dev/null || true
    # The wheel was built with cuFile: its headers must see the same declarations.
    g++ -std=c++17 -O2 -DKVIKIO_CUFILE_FOUND -DKVIKIO_CUFILE_VERSION_API_FOUND -o "$HOME_DIR/kvikio-peer" "$SRC" \
        -I"$x/libkvikio/include" -I"$x/rapids_logger/include" -I"$cuinc" \
        -L"$HOME_DIR/lib" -lkvikio -lrapids_logger -ldl -lpthread \
        -Wl,-rpath,'$ORIGIN/lib' -Wl,--allow-shlib-undefined \
        || die "compiling the peer failed"
    strip "$HOME_DIR/kvikio-peer" "$HOME_DIR"/lib/*.so* 2>/dev/null || true
    rm -rf "$work"
    touch "$stamp"
    echo "$HOME_DIR"
}

case "${1:-}" in
    build) build ;;
    bundle)
        [[ -n "${2:-}" ]] || die "usage: $0 bundle DIR"
        dir=$(build)
        mkdir -p "$2" && cp -r "$dir"/kvikio-peer "$dir"/lib "$2/"
        ;;
    *) die "usage: $0 build | bundle DIR" ;;
esac
