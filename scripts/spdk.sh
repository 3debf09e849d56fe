#!/usr/bin/env bash
# SPDK for gpuio: obtain, build and cache SPDK 20.07, reserve hugepages, and run an NVMe/TCP
# target (nvmf_tgt serving a malloc bdev on 127.0.0.1) for tests, benches and CI.
#
#   scripts/spdk.sh build              fetch + build once, install into the cache (idempotent)
#   scripts/spdk.sh env                print `export GPUIO_SPDK_LIB=...` for gpuio
#   scripts/spdk.sh hugepages [MiB]    reserve 2 MiB hugepages (default 2048 MiB) and mount hugetlbfs
#   scripts/spdk.sh start [--port P] [--size MiB] [--block B] [--core N]
#                                      start a target (idempotent per port), print its transport ID
#   scripts/spdk.sh stop [--port P]    stop it (SIGTERM, then SIGKILL)
#   scripts/spdk.sh kill [--port P]    kill it at once (SIGKILL), as a crash would
#   scripts/spdk.sh trid [--port P]    print the transport ID of the target on port P
#   scripts/spdk.sh perf ARGS...       run SPDK's own `perf` example from the cache
#   scripts/spdk.sh bundle DIR         copy what a machine without a compiler needs into DIR
#
# Where things live: GPUIO_SPDK_HOME (default ~/.cache/gpuio/spdk-20.07-x86-64-v2) holds lib/,
# bin/, the CPU target it was built for (TARGET) and the stamp of a finished build (BUILT);
# runtime files (logs, pid files, configs) go to GPUIO_SPDK_RUN (default /tmp/gpuio-spdk). A
# bundle made with `bundle` is a GPUIO_SPDK_HOME: point the variable at it and
# `start`/`perf`/`env` work there without building.
#
# CPU target: SPDK's configure defaults to -march=native and hands the same machine to its
# DPDK (meson -Dmachine), so a build made on one machine can die with SIGILL (or DPDK's own
# "does not support AVX512F" refusal) on another: the GPU bundle carries this build. It is
# built for GPUIO_SPDK_TARGET (default x86-64-v2: SSE4.2, SSSE3, POPCNT, CMPXCHG16B), the
# lowest that works: DPDK 20.05 requires SSE4.2 on x86 (it adds -msse4 to its own flags and
# checks the CPU at start), and SPDK's own sources include DPDK's rte_memcpy.h, whose SSE
# path uses SSSE3 intrinsics that do not compile under plain -march=x86-64. The target is
# part of the default home's and the build tree's names and is checked against TARGET, so a
# build for another target (the native builds of earlier versions of this script, in
# ~/.cache/gpuio/spdk-20.07) is never reused. gpuio's default search path
# (src/spdk/sys.rs) names the default target's home; for another target set GPUIO_SPDK_HOME.
#
# SPDK comes from Debian's ceph source package (trixie), which ships SPDK 20.07 with its DPDK
# under src/spdk (see ../shared/ENVIRONMENT.md). No SPDK source is kept in this repository.
set -euo pipefail

TARGET=${GPUIO_SPDK_TARGET:-x86-64-v2}
SPDK_HOME=${GPUIO_SPDK_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuio/spdk-20.07-$TARGET}
RUN_DIR=${GPUIO_SPDK_RUN:-/tmp/gpuio-spdk}
# Downloads (dl/) are shared; each target configures and builds in its own tree (build-TARGET/).
WORK=${GPUIO_SPDK_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuio/spdk-work}
TREE=$WORK/build-$TARGET
MIRROR=${GPUIO_SPDK_MIRROR:-http://deb.debian.org/debian}
DEFAULT_PORT=4420
NQN_PREFIX=nqn.2016-06.io.spdk:gpuio

die() { echo "spdk.sh: $*" >&2; exit 1; }
log() { echo "spdk.sh: $*" >&2; }

have_build() {
    [[ -f "$SPDK_HOME/BUILT" && -f "$SPDK_HOME/lib/libspdk_gpuio.so" && -x "$SPDK_HOME/bin/nvmf_tgt" &&
        "$(cat "$SPDK_HOME/TARGET" 2>/dev/null)" == "$TARGET" ]]
}

# Why there is no usable build in SPDK_HOME, for error messages.
not_built() {
    if [[ -f "$SPDK_HOME/BUILT" ]]; then
        echo "SPDK in $SPDK_HOME was built for $(cat "$SPDK_HOME/TARGET" 2>/dev/null || echo 'the build machine (native)'), not $TARGET (run: scripts/spdk.sh build)"
    else
        echo "SPDK is not built in $SPDK_HOME (run: scripts/spdk.sh build)"
    fi
}

install_deps() {
    local pkgs=(meson ninja-build libnuma-dev libaio-dev uuid-dev libssl-dev python3-pyelftools
        nasm libncurses-dev libcunit1-dev pkg-config xz-utils)
    local missing=()
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
    fi
}

fetch_source() {
    local src="$TREE"
    if [[ -f "$src/spdk/include/spdk/version.h" ]]; then return; fi
    local tarball
    tarball=$(ls "$WORK"/dl/ceph_*.orig.tar.xz 2>/dev/null | head -1 || true)
    if [[ -z "$tarball" ]]; then
        # shellcheck source=scripts/debian-source.sh
        source "$(dirname "${BASH_SOURCE[0]}")/debian-source.sh"
        debian_source_download "$WORK" trixie ceph
        tarball=$(ls "$WORK"/dl/ceph_*.orig.tar.xz 2>/dev/null | head -1 || true)
    fi
    [[ -n "$tarball" ]] || die "could not download the ceph source package (needs $MIRROR)"
    log "extracting SPDK from $(basename "$tarball")"
    rm -rf "$src" && mkdir -p "$src"
    tar -xJf "$tarball" -C "$src" --wildcards '*/src/spdk/*'
    mv "$src"/ceph-*/src/spdk "$src/spdk"
    rm -rf "$src"/ceph-*
    [[ -f "$src/spdk/include/spdk/version.h" ]] || die "no SPDK in $tarball"
}

build() {
    if have_build; then
        log "SPDK already built for $TARGET in $SPDK_HOME"
        return
    fi
    install_deps
    fetch_source
    local s="$TREE/spdk"
    log "building SPDK for $TARGET in $s"
    (
        cd "$s"
        if ! grep -qs "CONFIG_SHARED?=y" mk/config.mk || ! grep -qsx "CONFIG_ARCH?=$TARGET" mk/config.mk; then
            # A tree configured otherwise: start clean, so no object built for another target stays.
            if [[ -f mk/config.mk ]]; then make clean >/dev/null 2>&1 || true; fi
            # --target-arch becomes -march for SPDK and meson's -Dmachine for DPDK.
            ./configure --target-arch="$TARGET" --disable-tests --disable-unit-tests --without-isal \
                --without-vhost --without-virtio --without-crypto --without-fio --with-shared \
                >"$TREE/configure.log" 2>&1 ||
                { tail -20 "$TREE/configure.log"; die "configure failed"; }
        fi
        # glibc >= 2.36 declares arc4random; SPDK 20.07's iSCSI code defines its own unless told.
        CFLAGS=-DHAVE_ARC4RANDOM make -j"$(nproc)" >"$TREE/make.log" 2>&1 ||
            { grep -m5 -B3 "error" "$TREE/make.log"; die "make failed (log: $TREE/make.log)"; }
    )
    grep -q "^#define RTE_MACHINE $TARGET\$" "$s/dpdk/build/include/rte_build_config.h" ||
        die "DPDK in $s was not configured for $TARGET (see its dpdk/build/include/rte_build_config.h)"
    install_build "$s"
}

# The NVMe initiator gpuio loads, as one self-contained shared object (SPDK's own per-library
# .so files would have to be found and loaded in dependency order). Whole archives, so that
# DPDK's constructor-registered drivers (PCI bus, ring mempool) and SPDK's posix sock module
# come along. `gpuio_spdk_version` reports SPDK_VERSION_STRING from SPDK's own header.
link_initiator() {
    local s=$1 out=$2
    local l="$s/build/lib" d="$s/dpdk/build/lib"
    local spdk_libs=(nvme sock_posix sock vmd thread util log env_dpdk json jsonrpc rpc trace)
    local dpdk_libs=(eal mempool ring mempool_ring pci bus_pci kvargs telemetry)
    local archives=()
    for x in "${spdk_libs[@]}"; do archives+=("$l/libspdk_$x.a"); done
    for x in "${dpdk_libs[@]}"; do archives+=("$d/librte_$x.a"); done
    printf '#include "spdk/version.h"\nconst char *gpuio_spdk_version(void) { return SPDK_VERSION_STRING; }\n' \
        >"$TREE/version.c"
    cc -shared -fPIC -O2 -march="$TARGET" -I"$s/include" -o "$out" "$TREE/version.c" \
        -Wl,--whole-archive "${archives[@]}" -Wl,--no-whole-archive \
        -Wl,--no-undefined -Wl,-soname,libspdk_gpuio.so \
        -lnuma -luuid -lcrypto -laio -ldl -lpthread -lrt -lm
}

install_build() {
    local s=$1 tmp="$SPDK_HOME.tmp"
    rm -rf "$tmp" && mkdir -p "$tmp/lib" "$tmp/bin"
    link_initiator "$s" "$tmp/lib/libspdk_gpuio.so"
    cp "$s/build/bin/nvmf_tgt" "$s/build/examples/perf" "$tmp/bin/"
    # The apps' own shared libraries (they link against SPDK's per-library .so files).
    local libs
    libs=$(LD_LIBRARY_PATH="$s/build/lib:$s/dpdk/build/lib" ldd "$tmp/bin/nvmf_tgt" "$tmp/bin/perf" |
        awk '$3 ~ /^\// {print $3}' | sort -u)
    for f in $libs; do
        case "$f" in
        "$s"/*) cp -L "$f" "$tmp/lib/" ;;
        esac
    done
    # DPDK loads its drivers from here at run time as well.
    cp -L "$s"/dpdk/build/lib/librte_mempool_ring.so.*.* "$s"/dpdk/build/lib/librte_bus_pci.so.*.* "$tmp/lib/" 2>/dev/null || true
    strip --strip-unneeded "$tmp"/lib/*.so* "$tmp"/bin/* 2>/dev/null || true
    grep -m1 -o 'SPDK_VERSION_MAJOR[[:space:]]*[0-9]*' "$s/include/spdk/version.h" >/dev/null
    echo "20.07" >"$tmp/VERSION"
    echo "$TARGET" >"$tmp/TARGET"
    date -u +%FT%TZ >"$tmp/BUILT"
    rm -rf "$SPDK_HOME" && mkdir -p "$(dirname "$SPDK_HOME")" && mv "$tmp" "$SPDK_HOME"
    log "installed into $SPDK_HOME ($(du -sh "$SPDK_HOME" | cut -f1))"
}

hugepages() {
    local mib=${1:-2048}
    local want=$((mib / 2))
    local have
    have=$(cat /proc/sys/vm/nr_hugepages)
    if ((have < want)); then
        echo "$want" >/proc/sys/vm/nr_hugepages || die "cannot reserve hugepages (needs root)"
        have=$(cat /proc/sys/vm/nr_hugepages)
        ((have >= want)) || log "only $have of $want hugepages could be reserved"
    fi
    if ! grep -qs ' /dev/hugepages hugetlbfs' /proc/mounts; then
        mkdir -p /dev/hugepages
        mount -t hugetlbfs nodev /dev/hugepages || die "cannot mount hugetlbfs on /dev/hugepages"
    fi
    log "hugepages: $have x 2 MiB ($(awk '/HugePages_Free/ {print $2}' /proc/meminfo) free)"
}

port_arg() {
    PORT=$DEFAULT_PORT SIZE=256 BLOCK=512 CORE=0
    while (($#)); do
        case $1 in
        --port) PORT=$2; shift 2 ;;
        --size) SIZE=$2; shift 2 ;;
        --block) BLOCK=$2; shift 2 ;;
        --core) CORE=$2; shift 2 ;;
        *) die "unknown argument $1" ;;
        esac
    done
}

trid_of() { echo "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$1 subnqn:$NQN_PREFIX$1"; }

pid_of() {
    local f="$RUN_DIR/tgt-$1.pid"
    [[ -f "$f" ]] || return 1
    local pid
    pid=$(cat "$f")
    kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
    port_arg "$@"
    have_build || die "$(not_built)"
    if pid_of "$PORT" >/dev/null && listening "$PORT"; then
        trid_of "$PORT"
        return
    fi
    hugepages "${GPUIO_SPDK_HUGE_MIB:-2048}" >/dev/null
    mkdir -p "$RUN_DIR"
    local cfg="$RUN_DIR/tgt-$PORT.json" nqn="$NQN_PREFIX$PORT"
    cat >"$cfg" <<EOF
{ "subsystems": [
  { "subsystem": "bdev", "config": [
    { "method": "bdev_malloc_create",
      "params": { "name": "Malloc$PORT", "num_blocks": $((SIZE * 1024 * 1024 / BLOCK)), "block_size": $BLOCK } } ] },
  { "subsystem": "nvmf", "config": [
    { "method": "nvmf_create_transport", "params": { "trtype": "TCP" } },
    { "method": "nvmf_create_subsystem",
      "params": { "nqn": "$nqn", "allow_any_host": true, "serial_number": "GPUIO$PORT", "max_namespaces": 1 } },
    { "method": "nvmf_subsystem_add_ns", "params": { "nqn": "$nqn", "namespace": { "bdev_name": "Malloc$PORT" } } },
    { "method": "nvmf_subsystem_add_listener",
      "params": { "nqn": "$nqn", "listen_address": { "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "$PORT" } } } ] } ] }
EOF
    local mem=$((SIZE + 256))
    LD_LIBRARY_PATH="$SPDK_HOME/lib" setsid "$SPDK_HOME/bin/nvmf_tgt" -m "$((1 << CORE))" -s "$mem" \
        -r "$RUN_DIR/tgt-$PORT.sock" --json "$cfg" >"$RUN_DIR/tgt-$PORT.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/tgt-$PORT.pid"
    for _ in $(seq 1 300); do
        if listening "$PORT"; then
            trid_of "$PORT"
            return
        fi
        kill -0 "$(cat "$RUN_DIR/tgt-$PORT.pid")" 2>/dev/null || break
        sleep 0.1
    done
    tail -20 "$RUN_DIR/tgt-$PORT.log" >&2
    stop --port "$PORT" || true
    die "nvmf_tgt did not start listening on 127.0.0.1:$PORT"
}

stop() {
    port_arg "$@"
    local pid
    pid=$(pid_of "$PORT") || { rm -f "$RUN_DIR/tgt-$PORT.pid"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$RUN_DIR/tgt-$PORT.pid"
}

crash() {
    port_arg "$@"
    local pid
    pid=$(pid_of "$PORT") || return 0
    kill -KILL "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
    rm -f "$RUN_DIR/tgt-$PORT.pid"
}

bundle() {
    local dir=${1:?usage: spdk.sh bundle DIR}
    have_build || build
    mkdir -p "$dir/lib" "$dir/bin"
    cp "$SPDK_HOME"/lib/* "$dir/lib/"
    cp "$SPDK_HOME"/bin/* "$dir/bin/"
    cp "$SPDK_HOME/VERSION" "$SPDK_HOME/TARGET" "$SPDK_HOME/BUILT" "$dir/"
    # System libraries a bare machine may lack.
    for so in libaio.so.1 libnuma.so.1; do
        local f
        # awk reads to the end: exiting early would kill ldconfig with SIGPIPE, which
        # pipefail and set -e turn into a failed bundle now and then.
        f=$(ldconfig -p | awk -v n="$so" '$1 == n && /x86-64/ && !found {print $NF; found = 1}')
        [[ -n "$f" ]] && cp -L "$f" "$dir/lib/"
    done
    echo "$(du -sh "$dir" | cut -f1) in $dir"
}

cmd=${1:-}
shift || true
case $cmd in
build) build ;;
env) have_build || die "$(not_built)"; echo "export GPUIO_SPDK_LIB=$SPDK_HOME/lib/libspdk_gpuio.so" ;;
hugepages) hugepages "$@" ;;
start) start "$@" ;;
stop) stop "$@" ;;
kill) crash "$@" ;;
trid) port_arg "$@"; trid_of "$PORT" ;;
perf) have_build || die "$(not_built)"; LD_LIBRARY_PATH="$SPDK_HOME/lib" exec "$SPDK_HOME/bin/perf" "$@" ;;
bundle) bundle "$@" ;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
