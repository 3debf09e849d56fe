#!/usr/bin/env python3
"""`gpuio xfer`'s cases run through NIXL's Python API with its UCX backend, for a side-by-side
comparison: the same flags, the same result line (ending `path: NIXL UCX`) and, with --json,
a JSON line with the same keys.

    python3 nixl_xfer.py --size 16M --descs 64 --op read --initiator vram:0 --target vram:1 --procs 2
    python3 nixl_xfer.py --notif --procs 2

--procs 1: an initiator and a target agent in this process (NIXL's two-agent example);
--procs 2: the target in a child process (this script with --serve), metadata and descriptors
exchanged over its stdin/stdout. DRAM is numpy memory (torch pinned memory with --pinned),
VRAM a torch CUDA tensor on GPU N. One warm-up round, then --rounds rounds of --iters
transfers of one request (created once, posted again after each completion); the median round
gives GB/s and descriptors/s. --notif: ping-pong notifications, one way = half a round trip.
Prints `SKIPPED: ...` and exits 0 where NIXL (or torch with that GPU) cannot be used.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(s):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size (examples: 4096, 4K, 1M, 1.5G)")
    n = round(float(m.group(1)) * UNITS[m.group(2).upper()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: want at least 1 byte")
    return n


def mem_spec(s):
    l = s.lower()
    if l in ("dram", "host"):
        return ("DRAM", 0)
    m = re.fullmatch(r"(?:vram|gpu)(?::(\d+))?", l)
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r}: want dram, vram or vram:N")
    return ("VRAM", int(m.group(1) or 0))


def show(spec):
    return "DRAM" if spec[0] == "DRAM" else f"VRAM:{spec[1]}"


def short_size(n):  # gpuio's `16M`, `4K`, `1.5M`, `512B`
    for unit, k in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f}{unit}".replace(".0", "")
    return f"{n}B"


def fmt_bytes(n):  # gpuio's `1.00 GiB`, `512 B`
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def quantile(sorted_ns, q):  # the smallest value at or above quantile q, in microseconds
    return sorted_ns[max(0, math.ceil(q * len(sorted_ns)) - 1)] / 1e3


def skip(reason):
    print(f"SKIPPED: {reason}", flush=True)
    sys.exit(0)


def import_nixl():
    """nixl_agent and nixl_agent_config, pointing NIXL at the plugins beside its library."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("nixl_cu13")
        if spec and spec.origin and "NIXL_PLUGIN_DIR" not in os.environ:
            plugins = os.path.join(os.path.dirname(os.path.dirname(spec.origin)),
                                   ".nixl_cu13.mesonpy.libs", "plugins")
            if os.path.isdir(plugins):
                os.environ["NIXL_PLUGIN_DIR"] = plugins
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # ImportError, or a shared library that would not load
        skip(f"NIXL not importable: {type(e).__name__}: {e}")
    return nixl_agent, nixl_agent_config


def make_agent(name, *specs, pinned=False):
    if pinned or any(s[0] == "VRAM" for s in specs):
        try:  # before NIXL: its UCX's CUDA modules need the CUDA runtime torch loads
            import torch  # noqa: F401
        except ImportError:
            pass  # Memory says so
    nixl_agent, nixl_agent_config = import_nixl()
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    except Exception as e:
        skip(f"NIXL agent with the UCX backend could not start: {type(e).__name__}: {e}")
    if "UCX" not in agent.backends:
        skip(f"NIXL has no UCX backend (plugins: {agent.get_plugin_list()})")
    return agent


class Memory:
    """`nbytes` bytes of DRAM or VRAM:N, registered with `agent`, filled with `fill`."""

    def __init__(self, agent, spec, nbytes, fill, pinned):
        self.agent, self.mem, self.dev = agent, spec[0], spec[1]
        if self.mem == "VRAM" or pinned:
            try:
                import torch
            except ImportError as e:
                skip(f"torch is needed for {show(spec)}{' pinned' if pinned else ''}: {e}")
        if self.mem == "VRAM":
            if not torch.cuda.is_available() or torch.cuda.device_count() <= self.dev:
                skip(f"no GPU {self.dev} here (torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 0})")
            torch.cuda.set_device(self.dev)
            self.buf = torch.full((nbytes,), fill, dtype=torch.uint8, device=f"cuda:{self.dev}")
            torch.cuda.synchronize(self.dev)
            self.addr = self.buf.data_ptr()
        elif pinned:
            self.buf = torch.full((nbytes,), fill, dtype=torch.uint8).pin_memory()
            self.addr = self.buf.data_ptr()
        else:
            import numpy as np

            self.buf = np.full(nbytes, fill, dtype=np.uint8)
            self.addr = self.buf.ctypes.data
        self.reg = agent.register_memory([(self.addr, nbytes, self.dev, "")], self.mem)

    def pieces(self, descs, size):  # [[addr, len, dev], ...]
        return [[self.addr + i * size, size, self.dev] for i in range(descs)]

    def release(self):
        self.agent.deregister_memory(self.reg)


def xfer_list(agent, pieces, mem):
    import numpy as np

    return agent.get_xfer_descs(np.array(pieces, dtype=np.uint64).reshape(-1, 3), mem)


def echo_once(agent):
    """Sends every new notification back to its sender; True if there was one."""
    got = False
    for sender, msgs in agent.get_new_notifs().items():
        for m in msgs:
            agent.send_notif(sender, m)
            got = True
    return got


def serve(a):
    """--serve: the target of --procs 2. Prints its metadata and descriptors, loads the
    initiator's metadata, then echoes notifications (--notif) until stdin closes."""
    agent = make_agent("target", a.target, pinned=a.pinned)
    mem = Memory(agent, a.target, a.size * a.descs, 0x5A, a.pinned)
    print("META " + agent.get_agent_metadata().hex(), flush=True)
    print("DESCS " + json.dumps({"mem": mem.mem, "pieces": mem.pieces(a.descs, a.size)}), flush=True)
    line = sys.stdin.readline()
    if not line.startswith("META "):
        sys.exit("serve: no initiator metadata")
    agent.add_remote_agent(bytes.fromhex(line[5:].strip()))
    print("READY", flush=True)
    if a.notif:
        closed = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
        while not closed.is_set():
            echo_once(agent)
    else:
        sys.stdin.read()
    mem.release()


def expect(out, prefix):
    """The next line from the child that starts with `prefix` (NIXL may log other lines)."""
    for line in out:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if line.startswith("SKIPPED: "):
            skip("target: " + line[len("SKIPPED: "):].strip())
    raise RuntimeError(f"the target exited before sending {prefix.strip()}")


def transfers(a, ini, mine, remote_pieces, remote_mem):
    local = xfer_list(ini, mine.pieces(a.descs, a.size), mine.mem)
    remote = xfer_list(ini, remote_pieces, remote_mem)
    handle = ini.initialize_xfer(a.op.upper(), local, remote, "target")
    lat, rounds = [], []
    for r in range(a.rounds + 1):
        cpu0, t0 = time.process_time(), time.perf_counter_ns()
        for _ in range(a.iters):
            t1 = time.perf_counter_ns()
            state = ini.transfer(handle)
            while state == "PROC":
                state = ini.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer failed: state {state}")
            if r > 0:
                lat.append(time.perf_counter_ns() - t1)
        if r > 0:
            rounds.append(((time.perf_counter_ns() - t0) / 1e9, time.process_time() - cpu0))
    handle.release()
    rounds.sort()
    secs, cpu = rounds[len(rounds) // 2]
    lat.sort()
    nbytes = a.size * a.descs
    gbs, dps = nbytes * a.iters / secs / 1e9, a.descs * a.iters / secs
    op = a.op.capitalize()
    procs = f"{a.procs} process{'' if a.procs == 1 else 'es'}"
    print(f"{op} {a.descs} x {short_size(a.size)} {show(a.initiator)} (initiator) "
          f"{'<-' if op == 'Read' else '->'} {show(a.target)} (target), {procs}: {gbs:.2f} GB/s, "
          f"{dps:.0f} descriptors/s, per transfer p50 {quantile(lat, .5):.1f} us p99 "
          f"{quantile(lat, .99):.1f} us, {cpu / secs:.2f} cores here; path: NIXL UCX", flush=True)
    if a.json:
        print(json.dumps({
            "op": op, "size": a.size, "descs": a.descs, "initiator": show(a.initiator),
            "target": show(a.target), "procs": a.procs, "gbps": gbs, "descs_per_s": dps,
            "p50_us": quantile(lat, .5), "p99_us": quantile(lat, .99), "cores": cpu / secs,
            "path": "NIXL UCX", "bytes": fmt_bytes(nbytes)}), flush=True)


def notif_latency(a, ini, target_here):
    """Ping-pong: with the target here, this one thread also plays its echo (two Python threads
    polling would hand the GIL over only every few milliseconds)."""
    n, lat = max(a.iters, 1000), []
    for i in range(n + 100):
        t = time.perf_counter_ns()
        ini.send_notif("target", b"ping")
        deadline = time.monotonic() + 10
        while True:
            if target_here is not None:
                echo_once(target_here)
            back = ini.get_new_notifs().get("target")
            if back:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("no answer to a ping within 10 s")
        if back != [b"ping"]:
            raise RuntimeError(f"unexpected notifications {back!r}")
        if i >= 100:
            lat.append((time.perf_counter_ns() - t) // 2)
    lat.sort()
    p50, p99 = quantile(lat, .5), quantile(lat, .99)
    print(f"notification one way ({a.procs} process{'' if a.procs == 1 else 'es'}): p50 {p50:.1f} "
          f"us, p99 {p99:.1f} us over {n} round trips; path: NIXL UCX", flush=True)
    if a.json:
        print(json.dumps({"notif_one_way_p50_us": p50, "p99_us": p99, "procs": a.procs}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=byte_size, default=16 << 20, help="bytes per descriptor")
    p.add_argument("--descs", type=int, default=64, help="descriptors per transfer")
    p.add_argument("--op", choices=["read", "write"], default="read", type=str.lower)
    p.add_argument("--initiator", type=mem_spec, default=("DRAM", 0), help="dram or vram:N")
    p.add_argument("--target", type=mem_spec, default=("DRAM", 0), help="dram or vram:N")
    p.add_argument("--procs", type=int, choices=[1, 2], default=1)
    p.add_argument("--iters", type=int, default=20, help="transfers per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    p.add_argument("--notif", action="store_true", help="notification one-way latency instead")
    p.add_argument("--json", action="store_true", help="a JSON line after the result line")
    p.add_argument("--pinned", action="store_true", help="DRAM as pinned torch tensors")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if min(a.descs, a.iters, a.rounds) < 1:
        p.error("--descs, --iters and --rounds must be at least 1")
    if a.serve:
        return serve(a)
    ini = make_agent("initiator", a.initiator, a.target, pinned=a.pinned)
    mine = Memory(ini, a.initiator, a.size * a.descs, 0, a.pinned)
    child = target = theirs = None
    try:
        if a.procs == 1:
            target = make_agent("target", a.target, pinned=a.pinned)
            theirs = Memory(target, a.target, a.size * a.descs, 0x5A, a.pinned)
            ini.add_remote_agent(target.get_agent_metadata())
            target.add_remote_agent(ini.get_agent_metadata())
            remote_pieces, remote_mem = theirs.pieces(a.descs, a.size), theirs.mem
        else:
            args = [sys.executable, os.path.abspath(__file__), "--serve", "--size", str(a.size),
                    "--descs", str(a.descs), "--target", show(a.target).lower()]
            child = subprocess.Popen(args + ["--notif"] * a.notif + ["--pinned"] * a.pinned,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            meta = expect(child.stdout, "META ")
            d = json.loads(expect(child.stdout, "DESCS "))
            ini.add_remote_agent(bytes.fromhex(meta))
            child.stdin.write("META " + ini.get_agent_metadata().hex() + "\n")
            child.stdin.flush()
            expect(child.stdout, "READY")
            remote_pieces, remote_mem = d["pieces"], d["mem"]
        if a.notif:
            notif_latency(a, ini, target)
        else:
            transfers(a, ini, mine, remote_pieces, remote_mem)
    finally:
        if child is not None:
            child.stdin.close()
            child.wait(timeout=30)
    mine.release()
    if theirs is not None:
        theirs.release()


if __name__ == "__main__":
    main()
