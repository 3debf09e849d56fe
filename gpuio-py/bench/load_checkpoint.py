#!/usr/bin/env python3
"""Loads one .safetensors checkpoint into GPU memory with gpuio and with every peer that is
importable here, in one process, alternating loaders round by round, page-cache warm and
cold; prints medians and ratios against the best peer. Then raw reads of the checkpoint's
bytes into one torch tensor: gpuio ``File.read_into`` against KvikIO ``CuFile.pread``.

    python3 load_checkpoint.py MODEL.safetensors [--device cuda:0] [--rounds 3]
        [--modes warm,cold] [--json OUT.jsonl] [--peers safetensors,kvikio,...]

Peers: safetensors.torch, fastsafetensors (``fastsafe_open``, without and with GDS), Run:ai
model streamer (``SafetensorsStreamer``, straight to the device and through host tensors),
InstantTensor (``safe_open``), KvikIO (the data section into one torch tensor, then views, as
gpuio does), torch.cuda.gds (GdsFile.load_storage). On a machine without network,
``scripts/loader-wheels.sh`` fetches the loaders' wheels elsewhere and ``unpack_wheels.py``
puts them on PYTHONPATH (the GPU bundle does both). A peer that is not importable is
reported as absent; one that fails, or whose first load differs from gpuio's tensors by a
single byte, is reported with its error and not timed. Nothing is estimated or filled in.

Cold rounds drop the page cache (``/proc/sys/vm/drop_caches``, root only) or else evict
the file's pages with ``posix_fadvise(DONTNEED)``, and say which; where neither works, cold
rounds are skipped with the reason.
"""

import argparse
import json
import os
import statistics
import struct
import sys
import time


def header(path):
    """(data_start, [(name, dtype, shape, start, end)]) from the file's JSON header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    rows = [(k, v["dtype"], v["shape"], *v["data_offsets"]) for k, v in meta.items()]
    return 8 + n, sorted(rows, key=lambda r: r[3])


def views(torch, buf, rows):
    """Tensors over one uint8 buffer holding the data section (rows' offsets index it)."""
    from gpuio.safetensors.torch import _build

    return {name: _build(buf, name, dt, shape, s, e) for name, dt, shape, s, e in rows}


def make_loaders(torch, device, only):
    """name -> (load(path) -> dict of tensors, or None where absent, with the reason)."""
    loaders = {}

    def add(name, fn):
        if only and name not in only:
            return
        loaders[name] = fn

    import gpuio.safetensors
    from gpuio.safetensors.torch import load_file as gpuio_load

    gpuio.safetensors.default_engine()  # engine start-up is not part of a load
    add("gpuio", lambda p: gpuio_load(p, device=device))

    try:
        from safetensors.torch import load_file as st_load

        add("safetensors", lambda p: st_load(p, device=device))
    except ImportError as e:
        add("safetensors", ("absent", str(e)))

    # The peers as their documentation says to use them, into `device`; where a loader has
    # more than one way in (GDS or not, straight to the device or through host memory), each
    # is its own row and the best one is the peer gpuio is compared with.
    try:
        from fastsafetensors import fastsafe_open

        def fst(nogds):
            def load(p):
                # fastsafetensors 0.5: returned tensors keep their buffer alive after close.
                with fastsafe_open(p, framework="pt", device=device, nogds=nogds) as f:
                    return {k: f.get_tensor(k) for k in f.keys()}

            return load

        add("fastsafetensors", fst(True))
        add("fastsafetensors-gds", fst(False))
    except ImportError as e:
        add("fastsafetensors", ("absent", str(e)))

    try:
        from runai_model_streamer import SafetensorsStreamer

        def runai(to_device):
            def load(p):
                out = {}
                with SafetensorsStreamer() as s:
                    if to_device:
                        s.stream_file(p, device=device)
                        for name, t in s.get_tensors():
                            out[name] = t
                    else:
                        s.stream_file(p)
                        for name, t in s.get_tensors():
                            out[name] = t.to(device, non_blocking=True)
                return out

            return load

        add("runai-streamer", runai(True))
        add("runai-streamer-host", runai(False))
    except ImportError as e:
        add("runai-streamer", ("absent", str(e)))

    try:
        from instanttensor import safe_open as instant_open

        def instant(p):
            with instant_open(p, framework="pt", device=device) as f:
                return dict(f.tensors())

        add("instanttensor", instant)
    except ImportError as e:
        add("instanttensor", ("absent", str(e)))

    try:
        import kvikio

        def kv(p):
            start, rows = header(p)
            size = os.path.getsize(p) - start
            buf = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
            with kvikio.CuFile(p, "r") as f:
                got = f.pread(buf[:size], size, file_offset=start).get()
            if got != size:
                raise RuntimeError(f"kvikio read {got} of {size} bytes")
            return views(torch, buf, rows)

        add("kvikio", kv)
    except ImportError as e:
        add("kvikio", ("absent", str(e)))

    gds = getattr(getattr(torch, "cuda", None), "gds", None)
    if gds is not None and hasattr(gds, "GdsFile"):

        def tgds(p):
            start, rows = header(p)
            size = os.path.getsize(p) - start
            buf = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
            f = gds.GdsFile(p, os.O_RDONLY)
            f.load_storage(buf[:size].untyped_storage(), start)
            return views(torch, buf, rows)

        add("torch.cuda.gds", tgds)
    else:
        add("torch.cuda.gds", ("absent", "torch.cuda.gds.GdsFile is not in this torch"))
    return loaders


class Cache:
    """Page-cache control for warm and cold rounds."""

    def __init__(self, path):
        self.path = path
        self.how = None
        self.why_not_root = ""
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                os.sync()
                f.write("3\n")
            self.how = "drop_caches"
        except OSError as e:
            self.why_not_root = str(e)
            if hasattr(os, "posix_fadvise"):
                self.how = "posix_fadvise(DONTNEED)"

    def cold(self):
        if self.how == "drop_caches":
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        elif self.how:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def warm(self):
        with open(self.path, "rb", buffering=0) as f:
            buf = bytearray(16 << 20)
            while f.readinto(buf):
                pass


_REPORTED_CPUS = [None]
_REPORTED_ENV = [None]


def affinity_watch(after):
    """Says once each time this thread's CPU mask differs from the one it started with (a
    loader's import or load may narrow it, and children inherit it)."""
    changed = sorted(k for k in set(os.environ) | set(START_ENV) if os.environ.get(k) != START_ENV.get(k))
    if changed and changed != _REPORTED_ENV[0]:
        _REPORTED_ENV[0] = changed
        print(f"environment: after {after}, changed: " + ", ".join(
            f"{k}={os.environ.get(k)!r} (was {START_ENV.get(k)!r})" for k in changed))
    if START_CPUS is None:
        return
    now = set(os.sched_getaffinity(0))
    if now != START_CPUS and now != _REPORTED_CPUS[0]:
        _REPORTED_CPUS[0] = now
        print(f"affinity: after {after}, this thread may run on {len(now)} of the "
              f"{len(START_CPUS)} CPUs it started with; the Rust example runs on all of them")


# The CPUs this process could run on when it started, before any loader was imported or run,
# and its environment then.
START_CPUS = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
START_ENV = dict(os.environ)


def rust_example(binary, path):
    """Runs the Rust load_safetensors example; returns its load time (header included) as
    the 'tensors' value, which timed() replaces by that time. The child runs on the CPUs this
    process started with: a child inherits its parent thread's CPU mask, and a peer loader
    that narrows the main thread's mask (see ``affinity_watch``) would otherwise slow the
    example's I/O threads, not the loaders measured in-process, whose threads started
    earlier."""
    import re
    import subprocess

    def restore():
        if START_CPUS:
            os.sched_setaffinity(0, START_CPUS)

    out = subprocess.run(
        [binary, path, "--no-verify"],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=restore,
        env=START_ENV if os.environ.get("GPUIO_BENCH_CHILD_ENV") == "start" else None,
    )
    m = re.search(r" in ([0-9.]+) s \(header ([0-9.]+) ms\)", out.stdout)
    if not m:
        raise RuntimeError(f"unexpected output: {out.stdout.strip().splitlines()[-1:]}")
    return RustSeconds(float(m.group(1)) + float(m.group(2)) / 1e3)


class RustSeconds(float):
    """A time measured by the Rust example itself (its process start is not the load)."""


def timed(torch, fn, path):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(path)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    if isinstance(out, RustSeconds):
        secs = float(out)
    return secs, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--peers", default="", help="comma-separated subset of loaders")
    ap.add_argument("--json", help="append one JSON line per measurement here")
    ap.add_argument("--raw-rounds", type=int, default=5)
    ap.add_argument(
        "--rust-example",
        help="the load_safetensors example binary: timed in the same rounds (header read "
        "included), for the Python layer's overhead",
    )
    args = ap.parse_args()

    try:
        import torch
    except ImportError as e:
        print(f"absent: torch ({e}); nothing measured")
        return 1

    import gpuio

    if not torch.cuda.is_available():
        print("absent: CUDA (torch sees no GPU); nothing measured")
        return 1
    size = os.path.getsize(args.path)
    print(f"checkpoint {args.path}: {size / 1e9:.3f} GB; device {args.device}; torch {torch.__version__}")
    only = set(filter(None, args.peers.split(",")))
    loaders = make_loaders(torch, args.device, only)
    affinity_watch("importing the loaders")
    runnable = {k: v for k, v in loaders.items() if callable(v)}
    for name, v in loaders.items():
        if not callable(v):
            print(f"absent: {name}: {v[1]}")
    cache = Cache(args.path)
    modes = [m for m in args.modes.split(",") if m]
    if "cold" in modes and cache.how is None:
        print(f"cold: skipped: cannot drop the page cache here ({cache.why_not_root}) and no posix_fadvise")
        modes.remove("cold")
    elif "cold" in modes:
        print(f"cold: page cache dropped with {cache.how}")
    out = open(args.json, "a") if args.json else None

    # Correctness: gpuio's tensors against safetensors' once; then every loader's first load
    # against gpuio's (below). A loader whose bytes differ is reported as failed, not timed.
    def same(a, b):
        # Bit for bit: random checkpoints hold NaNs, which torch.equal calls unequal.
        return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))

    ref = None
    if "gpuio" in runnable:
        try:
            ref = runnable["gpuio"](args.path)
            if "safetensors" in runnable:
                st = runnable["safetensors"](args.path)
                bad = [k for k in st if k not in ref or not same(st[k], ref[k])]
                print(f"verify: gpuio vs safetensors: {len(st)} tensors, {len(bad)} differ {bad[:3]}")
                del st
        except Exception as e:
            print(f"verify: failed: {type(e).__name__}: {e}")
            ref = None
        torch.cuda.empty_cache()

    if args.rust_example:
        runnable["rust-example"] = lambda p: rust_example(args.rust_example, p)
    results = {}
    names = list(runnable)
    failed = {}
    checked = set()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for mode in modes:
            for name in order:
                if name in failed:
                    continue
                cache.cold() if mode == "cold" else cache.warm()
                try:
                    secs, tensors = timed(torch, runnable[name], args.path)
                    affinity_watch(name)
                except Exception as e:  # a peer that fails is reported, not measured
                    failed[name] = f"{type(e).__name__}: {e}"
                    print(f"failed: {name}: {failed[name]}")
                    continue
                if ref is not None and name not in checked and name != "rust-example":
                    checked.add(name)
                    bad = [k for k in ref if k not in tensors or not same(ref[k], tensors[k])]
                    extra = len(tensors.keys() - ref.keys())
                    print(f"verify: {name} vs gpuio: {len(ref)} tensors, {len(bad)} differ "
                          f"{bad[:3]}, {extra} extra")
                    if bad or extra:
                        failed[name] = f"returned {len(bad)} tensors that differ, {extra} extra"
                        print(f"failed: {name}: {failed[name]}")
                        del tensors
                        continue
                del tensors
                results.setdefault((name, mode), []).append(secs)
                rec = {"loader": name, "mode": mode, "round": r, "seconds": secs, "gbps": size / secs / 1e9}
                print(json.dumps(rec))
                if out:
                    out.write(json.dumps(rec) + "\n")

    del ref
    torch.cuda.empty_cache()
    for mode in modes:
        med = {n: statistics.median(v) for (n, m), v in results.items() if m == mode}
        for n, s in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"summary {mode}: {n:16s} median {s:.3f} s  {size / s / 1e9:6.2f} GB/s")
        peers = {n: s for n, s in med.items() if n not in ("gpuio", "rust-example")}
        if "gpuio" in med and "rust-example" in med:
            print(f"ratio {mode}: python overhead: gpuio.safetensors.torch takes "
                  f"{med['gpuio'] / med['rust-example']:.3f}x the Rust example's time")
        if "gpuio" in med and peers:
            best = min(peers, key=peers.get)
            print(f"ratio {mode}: gpuio {peers[best] / med['gpuio']:.2f}x the best peer ({best}); "
                  + ", ".join(f"{n} {s / med['gpuio']:.2f}x" for n, s in sorted(peers.items())))

    # Raw reads of the data section into one torch tensor: gpuio vs KvikIO, warm.
    start, _ = header(args.path)
    n = size - start
    buf = torch.empty(n, dtype=torch.uint8, device=args.device)
    f = gpuio.safetensors.default_engine().open(args.path)
    raw = {"gpuio read_into": lambda: f.read_into(buf, start)}
    try:
        import kvikio

        kf = kvikio.CuFile(args.path, "r")
        raw["kvikio pread"] = lambda: kf.pread(buf, n, file_offset=start).get()
    except ImportError as e:
        print(f"absent: kvikio (raw read): {e}")
    cache.warm()
    times = {k: [] for k in raw}
    for r in range(args.raw_rounds):
        for k in (list(raw) if r % 2 == 0 else list(raw)[::-1]):
            secs, got = timed(torch, lambda _p: raw[k](), None)
            if got != n:
                print(f"failed: {k}: read {got} of {n} bytes")
            times[k].append(secs)
    for k, v in times.items():
        s = statistics.median(v)
        print(f"raw warm {k}: median {s:.3f} s  {n / s / 1e9:6.2f} GB/s")
    if len(times) == 2:
        a, b = (statistics.median(v) for v in times.values())
        print(f"raw ratio warm: gpuio read_into {b / a:.2f}x kvikio CuFile.pread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
