#!/usr/bin/env python3
"""Cold loads of one .safetensors checkpoint into GPU memory, several ways, in one process,
alternating, page cache dropped (root) before each; medians. Separates what the loader costs
from what the disk does on a noisy machine:

    python3 cold_cases.py MODEL.safetensors PATH/TO/load_safetensors [--rounds 3]

Cases: ``load_file`` on one engine; the same with ``residency_aware=False``; one
``read_into`` of the whole file into a torch tensor; ``load_file`` on an engine made for the
load; the Rust example (``examples/load_safetensors.rs``) as its own process.
"""
import os, subprocess, sys, time, statistics
import torch, gpuio
from gpuio.safetensors.torch import load_file

M, rust = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
size = os.path.getsize(M)
def drop():
    os.sync(); open("/proc/sys/vm/drop_caches", "w").write("3\n")
e_on = gpuio.Engine()
e_off = gpuio.Engine(residency_aware=False)
def raw(e):
    t = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    n = e.open(M).read_into(t)
    torch.cuda.synchronize()
    assert n == size
def st(e):
    d = load_file(M, device="cuda:0", engine=e); torch.cuda.synchronize(); del d
def fresh():
    st(gpuio.Engine())
def rust_ex():
    out = subprocess.run([rust, M, "--no-verify"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
cases = {"load_file default engine": lambda: st(e_on), "load_file residency off": lambda: st(e_off),
         "raw read_into (one op)": lambda: raw(e_on), "load_file fresh engine": fresh, "rust example (process)": rust_ex}
res = {k: [] for k in cases}
st(e_on)  # warm-up: CUDA context, pools
for r in range(rounds):
    for k, f in cases.items():
        drop(); t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
for k, v in res.items():
    print(f"cold {k:28s} median {statistics.median(v):.3f} s  {[round(x,3) for x in v]}")
