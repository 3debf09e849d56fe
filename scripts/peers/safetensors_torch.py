#!/usr/bin/env python3
"""safetensors + torch peer for `examples/load_safetensors.rs`: loads every tensor of FILE
onto the GPU the usual way, `safetensors.torch.load_file(FILE, device="cuda:0")`, and prints
one JSON line per run (seconds until `torch.cuda.synchronize()` returns, GB/s of tensor data).

    safetensors_torch.py FILE [--cold] [--reps N]

--cold drops the page cache before every run (needs root). Exits 3, with a reason on stderr,
where torch, CUDA or safetensors is missing, so callers can report the peer as absent.
"""
import json
import os
import sys
import time

import peer_args


def main():
    args, cold, reps = peer_args.parse(__doc__)
    path = args[0]
    try:
        import torch
        from safetensors.torch import load_file
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001 - any failure here means "peer absent"
        print(f"safetensors+torch peer unavailable: {e}", file=sys.stderr)
        return 3
    for r in range(reps):
        if cold:
            os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
        t0 = time.perf_counter()
        tensors = load_file(path, device="cuda:0")
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        print(json.dumps({"peer": "safetensors+torch", "cold": cold, "rep": r,
                          "tensors": len(tensors), "bytes": nbytes, "seconds": secs,
                          "gbps": nbytes / secs / 1e9}), flush=True)
        del tensors
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
