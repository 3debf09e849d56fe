#!/usr/bin/env python3
"""KvikIO peer for `gpuio bench`: reads FILE whole into GPU memory (CuPy) with KvikIO's
thread pool, for each thread count given, and prints one JSON line per run.

    kvikio_read.py FILE [THREADS ...] [--cold] [--reps N]

--cold drops the page cache before every run (needs root). Exits 3, with a reason on
stderr, where kvikio or cupy cannot be imported, so callers can report the peer as absent.
"""
import json
import os
import sys
import time

import peer_args


def main():
    args, cold, reps = peer_args.parse(__doc__)
    path, threads = args[0], [int(t) for t in args[1:]] or [1, 4, 8, 16]
    try:
        import cupy
        import kvikio
        import kvikio.defaults
    except Exception as e:  # noqa: BLE001 - any import failure means "peer absent"
        print(f"kvikio peer unavailable: {e}", file=sys.stderr)
        return 3
    size = os.path.getsize(path)
    buf = cupy.empty(size, dtype=cupy.uint8)
    for t in threads:
        for r in range(reps):
            if cold:
                os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
            with kvikio.defaults.set({"num_threads": t}) if hasattr(kvikio.defaults, "set") else _legacy(kvikio, t):
                with kvikio.CuFile(path, "r") as f:
                    start = time.perf_counter()
                    n = f.read(buf)
                    cupy.cuda.runtime.deviceSynchronize()
                    secs = time.perf_counter() - start
            print(json.dumps({"peer": "kvikio", "version": kvikio.__version__, "threads": t,
                              "rep": r, "cold": cold, "bytes": n, "seconds": secs,
                              "gbps": n / secs / 1e9,
                              "compat_mode": str(kvikio.defaults.compat_mode())
                              if hasattr(kvikio.defaults, "compat_mode") else "?"}), flush=True)
    return 0


class _legacy:
    """KvikIO < 25: set_num_threads instead of defaults.set."""

    def __init__(self, kvikio, t):
        self.kvikio, self.t = kvikio, t

    def __enter__(self):
        self.kvikio.defaults.num_threads_reset(self.t)

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    sys.exit(main())
