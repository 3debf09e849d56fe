#!/usr/bin/env python3
# Usage: python3 scripts/driver-lock-probe.py (a GPU machine; numpy). Which driver calls block on a thread while another thread is inside a call that waits on a
# stream held at cuStreamWaitValue32? Each scenario arms a wait on S, starts the "user" call on
# thread T, then times the reactor's calls on its own stream; a watchdog releases S from the
# host after 4 s so nothing hangs for good.
import ctypes as C, threading, time, sys
import numpy as np
cu = C.CDLL("libcuda.so.1")
def ck(r, what):
    if r: raise RuntimeError(f"{what}: CUresult {r}")
ck(cu.cuInit(0), "init")
dev = C.c_int(); ck(cu.cuDeviceGet(C.byref(dev), 0), "dev")
ctx = C.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "cur")
host = C.c_void_p(); ck(cu.cuMemHostAlloc(C.byref(host), C.c_size_t(4096), 1 | 2), "hostalloc")
dw = C.c_uint64(); ck(cu.cuMemHostGetDevicePointer_v2(C.byref(dw), host, 0), "devptr")
word = C.cast(host, C.POINTER(C.c_uint32)); word[0] = 0
def stream(flags=1):
    s = C.c_void_p(); ck(cu.cuStreamCreate(C.byref(s), flags), "stream"); return s
S, CS = stream(), stream()
N = 96 << 20
def dalloc(n):
    p = C.c_uint64(); ck(cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(n)), "alloc"); return p
dst, dst2 = dalloc(N), dalloc(2 << 20)
pinned = C.c_void_p(); ck(cu.cuMemHostAlloc(C.byref(pinned), C.c_size_t(2 << 20), 1), "pinned")
pageable = np.full(N, 0x5a, np.uint8)
gen = [0]
def timed(name, fn, limit=3.0):
    out = {}
    def run():
        cu.cuCtxSetCurrent(ctx); t = time.time(); out["r"] = fn(); out["t"] = time.time() - t
    th = threading.Thread(target=run, daemon=True); th.start(); th.join(limit)
    if th.is_alive():
        return th, f"{name}: BLOCKED >{limit}s"
    return None, f"{name}: rc={out['r']} {out['t']*1e3:.2f} ms"
def scenario(label, user):
    gen[0] += 1; g = gen[0]
    ck(cu.cuStreamWaitValue32_v2(S, dw, C.c_uint32(g), 0), "wait")
    released = threading.Event()
    def watchdog():
        if not released.wait(6): word[0] = g; print(f"  [{label}] watchdog released S from the host")
    threading.Thread(target=watchdog, daemon=True).start()
    ut = threading.Thread(target=lambda: (cu.cuCtxSetCurrent(ctx), user()), daemon=True)
    t0 = time.time(); ut.start(); time.sleep(0.3)
    res = [f"user call still running after 0.3 s: {ut.is_alive()}"]
    ev = C.c_void_p()
    blocked = []
    for name, fn in [
        ("cuMemcpyHtoDAsync pinned on C", lambda: cu.cuMemcpyHtoDAsync_v2(dst2, pinned, C.c_size_t(2 << 20), CS)),
        ("cuMemcpyAsync pinned on C", lambda: cu.cuMemcpyAsync(dst2, C.c_uint64(pinned.value), C.c_size_t(1 << 20), CS)),
        ("cuEventCreate", lambda: cu.cuEventCreate(C.byref(ev), 2)),
        ("cuEventRecord on C", lambda: cu.cuEventRecord(ev, CS)),
        ("cuEventQuery", lambda: cu.cuEventQuery(ev)),
        ("cuStreamWriteValue32 on C (release)", lambda: cu.cuStreamWriteValue32_v2(CS, dw, C.c_uint32(g), 0)),
    ]:
        th, line = timed(name, fn)
        res.append(line)
        if th is not None: blocked.append(th)
    for th in blocked: th.join(8)
    ut.join(10)
    released.set()
    res.append(f"user call done after {time.time()-t0:.2f} s (alive={ut.is_alive()})")
    cu.cuCtxSynchronize()
    print(f"== {label}"); [print("  " + r) for r in res]; sys.stdout.flush()
scenario("user: cuMemcpyHtoDAsync 96 MiB pageable on S", lambda: cu.cuMemcpyHtoDAsync_v2(dst, pageable.ctypes.data_as(C.c_void_p), C.c_size_t(N), S))
scenario("user: cuMemcpyDtoHAsync 96 MiB pageable on S", lambda: cu.cuMemcpyDtoHAsync_v2(pageable.ctypes.data_as(C.c_void_p), dst, C.c_size_t(N), S))
scenario("user: cuStreamSynchronize(S)", lambda: cu.cuStreamSynchronize(S))
scenario("user: cuCtxSynchronize", lambda: cu.cuCtxSynchronize())
scenario("user: cuMemFree of another allocation", lambda: cu.cuMemFree_v2(dalloc(1 << 20)))
scenario("user: cuMemHostRegister 64 MiB", lambda: cu.cuMemHostRegister_v2(np.zeros(64 << 20, np.uint8).ctypes.data_as(C.c_void_p), C.c_size_t(64 << 20), 1))
