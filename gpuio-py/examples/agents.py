#!/usr/bin/env python3
"""Two agents in one process moving memory through gpuio's NIXL-compatible API.

A "target" agent exposes two halves of a host buffer; an "initiator" agent loads the target's
metadata, READs both halves (twice, with a notification each time), then WRITEs its own halves
into the target's swapped over, through prepared lists selected by index. Where CUDA and torch
are present, the same READ and swapped WRITE run between torch CUDA tensors, and one transfer
is awaited on asyncio. Every result is checked; the exit code is 0 only if all checks passed.

    python gpuio-py/examples/agents.py

Written against ``gpuio.agent``; a program written for NIXL (``nixl._api``) runs on it with
only its import changed.
"""

import asyncio
import sys
import time

import numpy as np

import gpuio
from gpuio.agent import nixl_agent, nixl_agent_config

HALF = 4096
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def poll(handle_owner, handle, target, initiator_name, tag, limit=10.0):
    """Polls the transfer to DONE on the initiator and its notification on the target."""
    deadline = time.monotonic() + limit
    done = seen = False
    while not (done and seen):
        if time.monotonic() > deadline:
            return False
        done = done or handle_owner.check_xfer_state(handle) == "DONE"
        seen = seen or target.check_remote_xfer_done(initiator_name, tag)
    return True


def host_flow():
    print("-- host memory")
    target = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    initiator = nixl_agent("initiator", None)
    print("paths:", target.get_plugin_list(), "| transport:", target.agent.transport)

    # The memory: raw ranges of numpy buffers that this program keeps alive (NIXL's
    # (addr, len, dev) registration), two halves per agent.
    theirs = np.random.default_rng(7).integers(0, 256, 2 * HALF, dtype=np.uint8)
    mine = np.zeros(2 * HALF, dtype=np.uint8)
    t0, i0 = theirs.ctypes.data, mine.ctypes.data
    t_ranges = [(t0, HALF, 0), (t0 + HALF, HALF, 0)]
    i_ranges = [(i0, HALF, 0), (i0 + HALF, HALF, 0)]

    t_reg = target.get_reg_descs([r + ("half",) for r in t_ranges], "DRAM")
    t_xfer = target.get_xfer_descs(t_ranges, "DRAM")
    check(t_xfer == target.get_xfer_descs(np.array(t_ranges, dtype=np.uint64), "DRAM"),
          "tuples and an Nx3 numpy array give the same descriptors")
    check(target.register_memory(t_reg) == t_reg, "target registered its halves")
    i_reg = initiator.register_memory(initiator.get_reg_descs([r + ("",) for r in i_ranges], "DRAM"))
    i_xfer = initiator.get_xfer_descs(i_ranges, "DRAM")

    # Metadata and descriptors travel as bytes.
    name = initiator.add_remote_agent(target.get_agent_metadata())
    check(name == b"target", f"metadata names {name!r}")
    wire = target.get_serialized_descs(t_xfer)
    remote = initiator.deserialize_descs(wire)
    check(remote == t_xfer, "descriptors survive serialisation")

    # READ both halves, twice on one handle.
    read = initiator.initialize_xfer("READ", i_xfer, remote, name, b"UUID1")
    print("READ path:", initiator.query_xfer_backend(read), "-", read.request.path_description)
    for n in range(2):
        mine[:] = 0
        state = initiator.transfer(read)
        check(state in ("PROC", "DONE"), f"READ {n} posted ({state})")
        check(poll(initiator, read, target, "initiator", b"UUID1"), f"READ {n} done and notified")
        check(np.array_equal(mine, theirs), f"READ {n} brought the target's bytes")

    # Prepared lists, and a notification on its own carrying the descriptors.
    local = initiator.prep_xfer_dlist("NIXL_INIT_AGENT", i_ranges, "DRAM")
    far = initiator.prep_xfer_dlist(name, remote, "DRAM")
    note = b"DESCS: " + wire
    initiator.send_notif(name, note)
    got = False
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        got = note in target.get_new_notifs().get("initiator", [])
    check(got, "the target received the notification")

    # WRITE local half 0 to remote half 1 and local half 1 to remote half 0.
    mine[:] = np.random.default_rng(8).integers(0, 256, 2 * HALF, dtype=np.uint8)
    write = initiator.make_prepped_xfer("WRITE", local, [0, 1], far, [1, 0], b"UUID2")
    initiator.transfer(write)
    check(poll(initiator, write, target, "initiator", b"UUID2"), "WRITE done and notified")
    check(np.array_equal(theirs[HALF:], mine[:HALF]) and np.array_equal(theirs[:HALF], mine[HALF:]),
          "WRITE swapped the halves into the target")

    # asyncio: the same READ, awaited.
    mine[:] = 0
    check(asyncio.run(initiator.atransfer(read)) == "DONE" and np.array_equal(mine, theirs),
          "an awaited READ")
    # Its notification was queued before the transfer counted as done.
    check(target.check_remote_xfer_done("initiator", b"UUID1"), "the awaited READ notified")

    for h in (read, write):
        initiator.release_xfer_handle(h)
    for h in (local, far):
        initiator.release_dlist_handle(h)
    initiator.remove_remote_agent("target")
    target.deregister_memory(t_reg)
    initiator.deregister_memory(i_reg)
    check(target.check_remote_xfer_done("initiator", b"UUID") is False, "no notification left over")


def gpu_flow():
    print("-- GPU memory")
    if not gpuio.cuda_available():
        print("skipped: no CUDA device here")
        return
    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        return
    rows = 16
    theirs = torch.arange(2 * rows * 256, dtype=torch.float32, device="cuda:0").reshape(2 * rows, 256)
    last = torch.cuda.device_count() - 1
    mine = torch.zeros_like(theirs, device=f"cuda:{last}")
    torch.cuda.synchronize()  # the agents' copies are not ordered after torch's streams

    target = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    initiator = nixl_agent("initiator")
    t_reg = target.register_memory(theirs)  # a tensor: kept referenced until deregistered
    i_reg = initiator.register_memory(mine)
    check(t_reg.mem_type == "VRAM", f"a CUDA tensor registers as {t_reg.mem_type}")
    name = initiator.add_remote_agent(target.get_agent_metadata())

    halves_t = [theirs[:rows], theirs[rows:]]
    halves_i = [mine[:rows], mine[rows:]]
    remote = initiator.deserialize_descs(target.get_serialized_descs(target.get_xfer_descs(halves_t)))
    read = initiator.initialize_xfer("READ", initiator.get_xfer_descs(halves_i), remote, name, b"GPU1")
    print(f"READ path (cuda:0 -> cuda:{last}):", initiator.query_xfer_backend(read))
    initiator.transfer(read)
    check(poll(initiator, read, target, "initiator", b"GPU1"), "GPU READ done and notified")
    check(torch.equal(mine.cpu(), theirs.cpu()), "GPU READ brought the target's tensor")

    mine.copy_(torch.randn_like(mine))
    torch.cuda.synchronize()
    local = initiator.prep_xfer_dlist("", halves_i)
    far = initiator.prep_xfer_dlist(name, remote)
    write = initiator.make_prepped_xfer("WRITE", local, [0, 1], far, [1, 0], b"GPU2")
    check(asyncio.run(initiator.atransfer(write)) == "DONE", "GPU WRITE awaited")
    check(torch.equal(theirs[rows:].cpu(), mine[:rows].cpu()) and torch.equal(theirs[:rows].cpu(), mine[rows:].cpu()),
          "GPU WRITE swapped the halves into the target")

    # Host to GPU: a host buffer of the initiator READ from the target's tensor.
    host = np.zeros(theirs.numel(), dtype=np.float32)
    h_reg = initiator.register_memory(host)
    whole = initiator.deserialize_descs(target.get_serialized_descs(t_reg))
    h2d = initiator.initialize_xfer("READ", h_reg, whole, name)
    print("READ path (cuda:0 -> host):", initiator.query_xfer_backend(h2d))
    initiator.transfer(h2d)
    check(initiator.wait_xfer(h2d) == "DONE", "GPU to host READ")
    check(np.array_equal(host, theirs.cpu().numpy().ravel()), "the host buffer holds the tensor")

    for h in (read, write, h2d):
        initiator.release_xfer_handle(h)
    for h in (local, far):
        initiator.release_dlist_handle(h)
    initiator.remove_remote_agent(name)
    initiator.deregister_memory(h_reg)
    initiator.deregister_memory(i_reg)
    target.deregister_memory(t_reg)


if __name__ == "__main__":
    host_flow()
    gpu_flow()
    if failures:
        print(f"{len(failures)} checks failed")
        sys.exit(1)
    print("all checks passed")
