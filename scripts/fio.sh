#!/usr/bin/env bash
# A self-contained fio for machines that have none (the GPU machine: no package manager, no
# network), so `gpuio bench --compare` can run fio side by side there.
#
#   scripts/fio.sh build        # Debian's fio source, built static without the engines that
#                               # need extra libraries (io_uring and psync stay); prints the path
#   scripts/fio.sh path         # the built binary's path (fails if not built)
#
# Source: Debian bookworm's fio 3.33 source package (the version the CPU machines run),
# through a private apt configuration (one deb-src line; the system's sources stay as they
# are). Output: ${GPUIO_FIO_HOME:-~/.cache/gpuio/fio}/fio.
set -euo pipefail
MIRROR=${GPUIO_DEBIAN_MIRROR:-http://deb.debian.org/debian}
HOME_DIR=${GPUIO_FIO_HOME:-$HOME/.cache/gpuio/fio}
WORK=${GPUIO_FIO_WORK:-$HOME/.cache/gpuio/fio-work}

die() { echo "fio.sh: $*" >&2; exit 1; }
log() { echo "fio.sh: $*" >&2; }

build() {
    if [[ -x "$HOME_DIR/fio" ]]; then
        echo "$HOME_DIR/fio"
        return
    fi
    mkdir -p "$HOME_DIR"
    # shellcheck source=scripts/debian-source.sh
    source "$(dirname "${BASH_SOURCE[0]}")/debian-source.sh"
    debian_source_download "$WORK" bookworm fio
    local tarball
    tarball=$(ls "$WORK"/dl/fio_3.33.orig.tar.* 2>/dev/null | head -1 || true)
    [[ -n "$tarball" ]] || die "could not download fio's source package (needs $MIRROR)"
    log "building $(basename "$tarball") (static, optional engines off)"
    rm -rf "$WORK/src" && mkdir -p "$WORK/src"
    tar -xf "$tarball" -C "$WORK/src" --strip-components=1
    (
        cd "$WORK/src"
        # Engines that need libraries the GPU machine lacks are off; io_uring, psync and
        # sync are built in and need none.
        ./configure --build-static --disable-native --disable-rdma --disable-rados \
            --disable-rbd --disable-http --disable-gfapi --disable-libnfs --disable-pmem \
            --disable-numa --disable-xnvme --disable-libzbc --disable-tcmalloc --disable-dfs \
            >"$WORK/configure.log" 2>&1 || die "configure failed (see $WORK/configure.log)"
        make -j"$(nproc)" fio >"$WORK/make.log" 2>&1 || die "make failed (see $WORK/make.log)"
    )
    strip -o "$HOME_DIR/fio" "$WORK/src/fio"
    "$HOME_DIR/fio" --version >/dev/null || die "the built fio does not run"
    echo "$HOME_DIR/fio"
}

case "${1:-}" in
    build) build ;;
    path) [[ -x "$HOME_DIR/fio" ]] && echo "$HOME_DIR/fio" || die "not built: scripts/fio.sh build" ;;
    *) die "usage: fio.sh build|path" ;;
esac
