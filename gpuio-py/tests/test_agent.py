"""Agents (``gpuio.agent``): NIXL's two-agent flow in host memory (and GPU memory where CUDA
and torch are present), every bad input an error, notifications only after the data,
awaitables, and deregistration waiting for the transfers in flight."""

import asyncio
import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import gpuio
from gpuio.agent import Agent, DescList, nixl_agent, nixl_agent_config

from conftest import skip_loudly

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "agents.py")


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def until(pred, what, limit=20.0):
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def pair():
    """Two agents of this process that know each other, UCX off (nothing here needs it)."""
    conf = nixl_agent_config(backends=[])
    target = nixl_agent("target", conf)
    initiator = nixl_agent("initiator", conf)
    assert initiator.add_remote_agent(target.get_agent_metadata()) == b"target"
    assert target.add_remote_agent(initiator.get_agent_metadata()) == b"initiator"
    yield target, initiator


def test_the_two_agent_flow_in_host_memory(pair):
    target, initiator = pair
    half = 1 << 16
    theirs = rand(2 * half, 1)
    mine = np.zeros(2 * half, dtype=np.uint8)
    t_reg = target.register_memory(theirs)  # an object: kept referenced
    i_reg = initiator.register_memory([mine[:half], mine[half:]])  # two registrations
    assert len(t_reg) == 1 and len(i_reg) == 2 and t_reg.mem_type == "DRAM"
    assert initiator.add_remote_agent(target.get_agent_metadata()) == b"target"  # reload

    t0 = theirs.ctypes.data
    remote = initiator.deserialize_descs(
        target.get_serialized_descs(target.get_xfer_descs([(t0, half, 0), (t0 + half, half, 0)], "DRAM"))
    )
    read = initiator.initialize_xfer("READ", i_reg, remote, b"target", b"UUID1")
    assert initiator.query_xfer_backend(read) == "MEMCPY"
    for _ in range(3):
        mine[:] = 0
        assert initiator.transfer(read) in ("PROC", "DONE")
        until(lambda: initiator.check_xfer_state(read) == "DONE", "READ")
        until(lambda: target.check_remote_xfer_done("initiator", b"UUID1"), "READ's notification")
        assert np.array_equal(mine, theirs)

    local = initiator.prep_xfer_dlist("", [mine[:half], mine[half:]])
    far = initiator.prep_xfer_dlist("target", remote)
    initiator.send_notif("target", b"DESCS: " + remote.serialize())
    until(lambda: target.update_notifs().get("initiator"), "the notification")
    assert target.notifs["initiator"] == [b"DESCS: " + remote.serialize()]

    mine[:] = rand(2 * half, 2)
    write = initiator.make_prepped_xfer("WRITE", local, np.array([0, 1], dtype=np.int32), far, [1, 0], "UUID2")
    initiator.transfer(write)
    until(lambda: initiator.check_xfer_state(write) == "DONE", "WRITE")
    until(lambda: target.check_remote_xfer_done("initiator", b"UUID", tag_is_prefix=True), "WRITE's notification")
    assert np.array_equal(theirs[half:], mine[:half]) and np.array_equal(theirs[:half], mine[half:])

    for h in (read, write):
        initiator.release_xfer_handle(h)
    for h in (local, far):
        initiator.release_dlist_handle(h)
    with pytest.raises(gpuio.InvalidInput, match="released"):
        initiator.transfer(read)
    initiator.remove_remote_agent("target")
    target.deregister_memory(t_reg)
    initiator.deregister_memory(i_reg)


def test_descriptor_lists(pair):
    target, _ = pair
    rows = [(0x1000, 64, 0), (0x2000, 32, 1)]
    a = target.get_xfer_descs(rows, "DRAM")
    b = target.get_reg_descs([r + ("meta",) for r in rows], "cpu")  # NIXL's older name
    c = target.get_xfer_descs(np.array(rows, dtype=np.uint64), "DRAM")
    assert a == b == c
    assert len(a) == a.descCount() == 2 and a[1] == a[-1] == (0x2000, 32, 1) and list(a) == rows
    assert a.trim() == a and not a.isEmpty() and a.total_bytes == 96
    assert pickle.loads(pickle.dumps(a)) == a
    assert DescList.deserialize(a.serialize()) == a
    assert a != target.get_xfer_descs(rows, "VRAM")
    with pytest.raises(IndexError):
        a[2]
    arr = np.zeros(10, dtype=np.float64)
    assert target.get_xfer_descs(arr) == DescList("DRAM", [(arr.ctypes.data, 80, 0)])
    assert len(target.get_xfer_descs([arr, bytearray(5)])) == 2
    for garbage in (b"", b"GPUIODL\0", b"nixl descriptors", a.serialize()[:-1], a.serialize() + b"\0"):
        with pytest.raises(gpuio.InvalidInput):
            target.deserialize_descs(garbage)


def test_every_bad_input_raises(pair):
    target, initiator = pair
    theirs, mine = rand(1 << 12, 3), np.zeros(1 << 12, dtype=np.uint8)
    t_reg = target.register_memory(theirs)
    i_reg = initiator.register_memory(mine)
    initiator.add_remote_agent(target.get_agent_metadata())
    t0, i0, n = theirs.ctypes.data, mine.ctypes.data, mine.nbytes

    def xfer(local, remote, peer="target", op="READ"):
        return initiator.initialize_xfer(op, local, remote, peer)

    # Descriptors outside the registrations, on either side.
    with pytest.raises(gpuio.InvalidInput, match="local descriptor 0"):
        xfer(DescList("DRAM", [(i0 + 1, n, 0)]), DescList("DRAM", [(t0, n, 0)]))
    with pytest.raises(gpuio.InvalidInput, match="remote descriptor 0"):
        xfer(i_reg, DescList("DRAM", [(t0 - 1, n, 0)]))
    # Wrong memory type, unknown memory type, NIXL's storage types.
    with pytest.raises(gpuio.InvalidInput):
        xfer(DescList("VRAM", [(i0, n, 0)]), t_reg)
    with pytest.raises(gpuio.InvalidInput, match="memory type"):
        initiator.get_xfer_descs([(i0, n, 0)], "HBM")
    with pytest.raises(gpuio.Unsupported):
        initiator.get_xfer_descs([(i0, n, 0)], "FILE")
    with pytest.raises(gpuio.InvalidInput, match="mem_type"):
        initiator.register_memory([(i0, n, 0, "")])
    # Pairs that do not match, a bad operation, bad indices.
    with pytest.raises(gpuio.InvalidInput, match="local bytes"):
        xfer(DescList("DRAM", [(i0, n // 2, 0)]), t_reg)
    with pytest.raises(gpuio.InvalidInput, match="1 local descriptors against 2"):
        xfer(i_reg, DescList("DRAM", [(t0, 8, 0), (t0 + 8, 8, 0)]))
    with pytest.raises(gpuio.InvalidInput, match="READ or WRITE"):
        xfer(i_reg, t_reg, op="COPY")
    local = initiator.prep_xfer_dlist("", i_reg)
    far = initiator.prep_xfer_dlist("target", t_reg)
    with pytest.raises(gpuio.InvalidInput, match="past the prepared list"):
        initiator.make_prepped_xfer("READ", local, [1], far, [0])
    with pytest.raises(gpuio.InvalidInput, match="negative"):
        initiator.make_prepped_xfer("READ", local, [-1], far, [0])
    with pytest.raises(gpuio.InvalidInput, match="prepared without a peer"):
        initiator.make_prepped_xfer("READ", far, [0], local, [0])
    with pytest.raises(gpuio.InvalidInput, match="negative"):
        DescList("DRAM", [(-5, 1, 0)])
    # Unknown peers, loopback.
    with pytest.raises(gpuio.InvalidInput, match="knows no agent"):
        xfer(i_reg, t_reg, peer="nobody")
    with pytest.raises(gpuio.InvalidInput, match="knows no agent"):
        initiator.send_notif("nobody", b"x")
    with pytest.raises(gpuio.InvalidInput, match="knows no agent"):
        initiator.prep_xfer_dlist("nobody", t_reg)
    with pytest.raises(gpuio.Unsupported, match="loopback"):
        xfer(i_reg, i_reg, peer="initiator")
    # A handle that never posted.
    h = xfer(i_reg, t_reg)
    with pytest.raises(gpuio.InvalidInput, match="not been posted"):
        initiator.check_xfer_state(h)
    # Metadata: garbage, truncated, another format's, our own.
    meta = target.get_agent_metadata()
    for garbage in (b"", b"nixl metadata", meta[:-1], meta[:20], b"\0" * 64):
        with pytest.raises(gpuio.InvalidInput):
            initiator.add_remote_agent(garbage)
    with pytest.raises(gpuio.InvalidInput, match="own metadata"):
        target.add_remote_agent(meta)
    # Memory gpuio cannot register.
    with pytest.raises(gpuio.InvalidInput, match="read-only"):
        initiator.register_memory(b"immutable bytes")
    with pytest.raises(gpuio.InvalidInput, match="contiguous"):
        initiator.register_memory(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError):
        initiator.register_memory(object())
    with pytest.raises(gpuio.InvalidInput, match="zero bytes"):
        initiator.register_memory(bytearray())
    with pytest.raises(gpuio.InvalidInput, match="overlap"):
        initiator.register_memory(mine[10:20])
    if gpuio.cuda_available():
        with pytest.raises(gpuio.InvalidInput, match="not CUDA device memory"):
            initiator.register_memory([(i0, n, 0)], "VRAM")
    else:
        with pytest.raises(gpuio.Unsupported):
            initiator.register_memory([(i0, n, 0)], "VRAM")
    # Deregistering what is not registered, or twice.
    with pytest.raises(gpuio.InvalidInput, match="no such registration"):
        initiator.deregister_memory(DescList("DRAM", [(i0, 16, 0)]))
    initiator.deregister_memory(i_reg)
    with pytest.raises(gpuio.InvalidInput, match="no such registration"):
        initiator.deregister_memory(i_reg)
    # A transfer whose local memory was deregistered since it was made.
    with pytest.raises(gpuio.InvalidInput, match="deregistered"):
        initiator.transfer(h)
    # Removed peers: old handles and new requests fail, a second removal too.
    mine2 = np.zeros(n, dtype=np.uint8)
    r2 = initiator.register_memory(mine2)
    h2 = xfer(r2, t_reg)
    initiator.remove_remote_agent(b"target")
    with pytest.raises(gpuio.InvalidInput, match="removed or reloaded"):
        initiator.transfer(h2)
    with pytest.raises(gpuio.InvalidInput, match="knows no agent"):
        xfer(r2, t_reg)
    with pytest.raises(gpuio.InvalidInput, match="knows no agent"):
        initiator.remove_remote_agent("target")
    # Errors carry the peer and the op.
    try:
        xfer(r2, t_reg)
    except gpuio.InvalidInput as e:
        assert e.peer == "target" and e.op == "agent"
    initiator.deregister_memory(r2)
    target.deregister_memory(t_reg)


def test_stale_metadata_of_a_dropped_agent():
    gone = nixl_agent("gone", nixl_agent_config(backends=[]))
    buf = np.zeros(64, dtype=np.uint8)
    gone.register_memory(buf)
    meta = gone.get_agent_metadata()
    other = nixl_agent("other", nixl_agent_config(backends=[]))
    other.add_remote_agent(meta)
    descs = DescList("DRAM", [(buf.ctypes.data, 64, 0)])
    mine = np.zeros(64, dtype=np.uint8)
    other.register_memory(mine)
    del gone
    gc.collect()
    with pytest.raises(gpuio.InvalidInput, match="stale metadata"):
        other.add_remote_agent(meta)
    # The peer loaded before it went: requests against it fail cleanly too.
    with pytest.raises(gpuio.InvalidInput, match="dropped"):
        other.initialize_xfer("READ", mine, descs, "gone")


def test_notifications_arrive_only_after_the_data(pair):
    target, initiator = pair
    n = 32 << 20  # large enough for the copy threads, so the copy takes a while
    theirs = np.zeros(n, dtype=np.uint8)
    mine = np.zeros(n, dtype=np.uint8)
    t_reg = target.register_memory(theirs)
    i_reg = initiator.register_memory(mine)
    write = initiator.initialize_xfer("WRITE", i_reg, t_reg, "target")
    read = initiator.initialize_xfer("READ", i_reg, t_reg, "target")
    for k in range(6):
        seed = k % 250 + 1
        if k % 2 == 0:  # WRITE: the target sees its own memory filled when notified
            mine[:] = seed
            initiator.transfer(write, f"w{k}".encode())
            until(lambda: target.check_remote_xfer_done("initiator", f"w{k}".encode()), "notification")
            # Every byte, first to last, landed before the notification was queued.
            assert theirs[0] == seed and theirs[-1] == seed and (theirs == seed).all()
        else:  # READ: the initiator's memory is filled when the target is notified
            theirs[:] = seed
            initiator.transfer(read, f"r{k}".encode())
            got = target.agent.wait_notification(20.0)
            assert got == ("initiator", f"r{k}".encode())
            assert (mine == seed).all()
        until(lambda: initiator.check_xfer_state(write if k % 2 == 0 else read) == "DONE", "done")
    assert target.agent.wait_notification(0.0) is None
    with pytest.raises(gpuio.InvalidInput, match="timeout"):
        target.agent.wait_notification(-1.0)


def test_asyncio_awaitables(pair):
    target, initiator = pair
    n = 8 << 20
    theirs, mine = rand(n, 5), np.zeros(n, dtype=np.uint8)
    t_reg = target.register_memory(theirs)
    i_reg = initiator.register_memory(mine)
    read = initiator.initialize_xfer("READ", i_reg, t_reg, "target", b"async")

    async def main():
        assert await initiator.atransfer(read) == "DONE"
        assert np.array_equal(mine, theirs)
        mine[:] = 0
        initiator.transfer(read)
        # Several waiters on one posting: tasks and a blocking thread all see its end.
        blocking = asyncio.get_running_loop().run_in_executor(None, initiator.wait_xfer, read)
        got = await asyncio.gather(*(initiator.await_xfer(read) for _ in range(4)), blocking)
        assert got == ["DONE"] * 5
        assert np.array_equal(mine, theirs)
        # Cancelling an await leaves the transfer running to completion.
        mine[:] = 0
        initiator.transfer(read)
        t = asyncio.ensure_future(initiator.await_xfer(read))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert await initiator.await_xfer(read) == "DONE"
        assert np.array_equal(mine, theirs)

    asyncio.run(main())
    assert target.get_new_notifs()["initiator"] == [b"async"] * 3
    # The native awaitable raises a failed transfer's error.
    initiator.deregister_memory(i_reg)

    async def failing():
        await initiator.atransfer(read)

    with pytest.raises(gpuio.InvalidInput, match="deregistered"):
        asyncio.run(failing())


def test_deregistration_waits_for_a_transfer_in_flight(pair):
    target, initiator = pair
    n = 256 << 20
    theirs = np.full(n, 7, dtype=np.uint8)
    mine = np.zeros(n, dtype=np.uint8)
    i_reg = initiator.register_memory(mine)
    in_flight = 0
    for attempt in range(5):
        mine[:] = 0
        t_reg = target.register_memory(theirs)
        initiator.add_remote_agent(target.get_agent_metadata())
        read = initiator.initialize_xfer("READ", i_reg, t_reg, "target")
        state = initiator.transfer(read)
        # The target deregisters while the initiator's READ copies out of its memory: the
        # call returns only once the transfer's last byte has landed.
        target.deregister_memory(t_reg)
        assert mine[0] == 7 and mine[-1] == 7 and (mine == 7).all()
        # (The library releases the registrations a moment before it marks the transfer
        # done, so the state may still read PROC here.)
        until(lambda: initiator.check_xfer_state(read) == "DONE", "the READ's end")
        # Nothing can touch the memory from now on.
        with pytest.raises(gpuio.InvalidInput, match="deregistered"):
            initiator.transfer(read)
        in_flight += state == "PROC"
        if in_flight >= 2:
            break
    assert in_flight, "the READ was never in flight when deregistration began"
    initiator.deregister_memory(i_reg)


def test_registered_objects_are_kept_until_deregistered():
    agent = nixl_agent("keeper", nixl_agent_config(backends=[]))
    arr = np.zeros(1 << 16, dtype=np.uint8)
    ref = weakref.ref(arr)
    reg = agent.register_memory(arr)
    del arr
    gc.collect()
    assert ref() is not None, "a registered array must stay alive"
    agent.deregister_memory(reg)
    gc.collect()
    assert ref() is None
    ba = bytearray(100)
    reg = agent.register_memory(ba)
    with pytest.raises(BufferError):
        ba.extend(b"x")  # it cannot move while registered
    agent.deregister_memory(reg)
    ba.extend(b"x")


def test_the_native_api():
    engine = gpuio.Engine(bounce_slots=2)
    a = Agent(engine, "a", ucx="off")
    b = Agent(engine, "b", ucx="off")
    assert a.transport.startswith("none")
    with pytest.raises(gpuio.InvalidInput, match="ucx"):
        Agent(engine, "c", ucx="maybe")
    with pytest.raises(gpuio.InvalidInput, match="name"):
        Agent(engine, "")
    src, dst = rand(1000, 9), bytearray(1000)
    ra = a.register(src)
    rb = b.register(dst)
    assert ra.mem_type == "DRAM" and ra.desc[1] == 1000 and not ra.released
    assert b.add_peer(a.metadata()) == "a" and b.peers() == ["a"]
    req = b.request("READ", rb.descs, "a", ra.descs, b"hi")
    assert req.path == "memcpy" and req.bytes == 1000 and req.peer == "a"
    req.post()
    req.wait()
    assert req.status() == "DONE" and bytes(dst) == src.tobytes()
    assert a.take_notifications() == [("b", b"hi")]
    req.set_notification(None)
    req.post()
    req.wait()
    assert a.take_notifications() == []
    lp, rp = b.prepare(None, rb.descs), b.prepare("a", ra.descs)
    assert len(lp) == 1 and rp.peer == "a" and lp.peer is None
    b.request_prepared("WRITE", lp, [0], rp, [0]).post()
    rb.release()
    rb.release()  # a second release does nothing
    assert rb.released
    raws = a.register_descs(DescList("DRAM", [(rb.desc[0], 10, 0)]))  # raw: caller keeps it valid
    assert len(raws) == 1
    raws[0].release()
    ra.release()


def test_the_example_runs():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True, timeout=300, env=env)
    print(p.stdout[-4000:], p.stderr[-4000:])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all checks passed" in p.stdout
    assert "READ path: MEMCPY" in p.stdout


# ---- GPU memory (torch CUDA tensors)


def torch_cuda():
    if not gpuio.cuda_available():
        skip_loudly("no CUDA device: gpuio.cuda_available() is false")
    try:
        import torch
    except ImportError:
        skip_loudly("torch is not installed")
    if not torch.cuda.is_available():
        skip_loudly("torch sees no CUDA device")
    return torch


def test_gpu_transfers(pair):
    torch = torch_cuda()
    target, initiator = pair
    last = torch.cuda.device_count() - 1
    n = 1 << 20
    theirs = torch.arange(n, dtype=torch.float32, device="cuda:0")
    mine = torch.zeros(n, dtype=torch.float32, device=f"cuda:{last}")
    host = torch.zeros(n, dtype=torch.float32)
    torch.cuda.synchronize()
    with pytest.raises(gpuio.InvalidInput, match="not both"):
        initiator.register_memory([mine, host])
    t_reg = target.register_memory(theirs)
    assert t_reg.mem_type == "VRAM" and t_reg[0][2] == 0
    i_reg = initiator.register_memory(mine)
    h_reg = initiator.register_memory(host)
    assert h_reg.mem_type == "DRAM"
    initiator.add_remote_agent(target.get_agent_metadata())
    rows = [theirs[: n // 2], theirs[n // 2 :]]
    remote = initiator.deserialize_descs(target.get_serialized_descs(target.get_xfer_descs(rows)))
    assert remote.mem_type == "VRAM" and len(remote) == 2

    # Device to device (another GPU where there are two), notified after the data.
    read = initiator.initialize_xfer("READ", initiator.get_xfer_descs([mine[: n // 2], mine[n // 2 :]]), remote, "target", b"g1")
    assert initiator.query_xfer_backend(read) == "CUDA"
    initiator.transfer(read)
    until(lambda: target.check_remote_xfer_done("initiator", b"g1"), "GPU READ's notification")
    assert torch.equal(mine.cpu(), theirs.cpu())
    assert initiator.check_xfer_state(read) == "DONE"

    # Host to device and back: WRITE a CPU tensor into the target's GPU memory, swapped.
    host.copy_(torch.randn(n))
    local = initiator.prep_xfer_dlist("", [host[: n // 2], host[n // 2 :]])
    far = initiator.prep_xfer_dlist("target", remote)
    write = initiator.make_prepped_xfer("WRITE", local, [0, 1], far, [1, 0], b"g2")
    assert asyncio.run(initiator.atransfer(write)) == "DONE"
    assert torch.equal(theirs[n // 2 :].cpu(), host[: n // 2]) and torch.equal(theirs[: n // 2].cpu(), host[n // 2 :])

    # Deregistration waits for a device transfer in flight.
    big_t = torch.ones(64 << 20, dtype=torch.uint8, device="cuda:0")
    big_i = torch.zeros(64 << 20, dtype=torch.uint8, device=f"cuda:{last}")
    torch.cuda.synchronize()
    bt, bi = target.register_memory(big_t), initiator.register_memory(big_i)
    initiator.add_remote_agent(target.get_agent_metadata())
    big = initiator.initialize_xfer("READ", bi, bt, "target")
    initiator.transfer(big)
    target.deregister_memory(bt)
    assert initiator.check_xfer_state(big) == "DONE"
    assert int(big_i.sum()) == 64 << 20

    # A VRAM descriptor naming the wrong GPU, and host memory described as VRAM.
    with pytest.raises(gpuio.InvalidInput):
        initiator.initialize_xfer("READ", DescList("VRAM", [(mine.data_ptr(), 64, last + 1)]), remote, "target")
    with pytest.raises(gpuio.InvalidInput):
        initiator.register_memory([(host.data_ptr(), 64, 0)], "VRAM")
    for r, a in ((t_reg, target), (i_reg, initiator), (h_reg, initiator), (bi, initiator)):
        a.deregister_memory(r)


# ---- another process on this host: UCX (host memory), CUDA IPC (GPU memory)


CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from gpuio.agent import nixl_agent
    gpu = sys.argv[1] == "cuda"
    if gpu:
        import torch
        buf = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
    else:
        buf = np.arange(1 << 20, dtype=np.int32)
    a = nixl_agent("far")
    reg = a.register_memory(buf)
    sys.stdout.write(a.get_agent_metadata().hex() + " " + a.get_serialized_descs(reg).hex() + "\\n")
    sys.stdout.flush()
    a.add_remote_agent(bytes.fromhex(sys.stdin.readline()))
    while not a.check_remote_xfer_done("near", b"wrote"):
        pass
    got = buf.cpu().numpy() if gpu else buf
    half = 1 << 19
    ok = bool((got[:half] == 5).all() and (got[half:] == np.arange(half, 1 << 20)).all())
    a.send_notif("near", b"ok" if ok else b"bad")
    sys.stdin.readline()
    a.deregister_memory(reg)
    """
)


@pytest.mark.parametrize("memory", ["host", "cuda"])
def test_a_peer_in_another_process(memory):
    probe = nixl_agent("probe")
    if not probe.agent.transport.startswith("UCX"):
        skip_loudly(f"no UCX here: {probe.agent.transport}")
    if memory == "cuda":
        torch = torch_cuda()
        mine = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        expected_paths = {"CUDA_IPC"}
    else:
        mine = np.zeros(1 << 20, dtype=np.int32)
        # Cross-memory attach where ptrace permission allows (same user, Yama), else UCX.
        expected_paths = {"CMA", "UCX"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, memory], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        meta_hex, descs_hex = child.stdout.readline().split()
        near = nixl_agent("near")
        reg = near.register_memory(mine)
        assert near.add_remote_agent(bytes.fromhex(meta_hex)) == b"far"
        child.stdin.write(near.get_agent_metadata().hex() + "\n")
        child.stdin.flush()
        remote = near.deserialize_descs(bytes.fromhex(descs_hex))
        read = near.initialize_xfer("READ", reg, remote, "far")
        assert near.query_xfer_backend(read) in expected_paths
        near.transfer(read)
        assert near.wait_xfer(read) == "DONE"
        got = mine.cpu().numpy() if memory == "cuda" else mine
        assert np.array_equal(got, np.arange(1 << 20, dtype=np.int32))
        if memory == "cuda":
            mine[:] = 5
            torch.cuda.synchronize()
        else:
            mine[:] = 5
        half = mine[: 1 << 19]
        far_half = DescList(remote.mem_type, [(remote[0][0], 4 << 19, remote[0][2])])
        write = near.initialize_xfer("WRITE", near.get_xfer_descs(half), far_half, "far", b"wrote")
        near.transfer(write)
        assert near.wait_xfer(write) == "DONE"
        until(lambda: near.check_remote_xfer_done("far", b"ok"), "the child's verdict", limit=60)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
        near.remove_remote_agent("far")
        near.deregister_memory(reg)
    finally:
        if child.poll() is None:
            child.kill()
