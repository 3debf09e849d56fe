"""Device memory from Python: torch and cupy tensors through __cuda_array_interface__ and
DLPack, on the object's stream or a given one, kernels after a read seeing its data,
cancellation, and a 2 GiB checkpoint against safetensors.torch. Every test skips, saying
why, without torch, cupy or a usable CUDA device (CI has none; the GPU bundle runs them)."""

import asyncio
import gc
import os
import time
import weakref

import numpy as np
import pytest

import gpuio
from conftest import pattern, skip_loudly


@pytest.fixture(scope="module")
def torch():
    try:
        import torch
    except ImportError as e:
        skip_loudly(f"torch is not installed ({e})")
    if not torch.cuda.is_available():
        skip_loudly("torch sees no CUDA device")
    if not gpuio.cuda_available():
        skip_loudly("gpuio finds no usable CUDA driver")
    return torch


@pytest.fixture(scope="module")
def cupy():
    try:
        import cupy
    except ImportError as e:
        skip_loudly(f"cupy is not installed ({e})")
    if not gpuio.cuda_available():
        skip_loudly("gpuio finds no usable CUDA driver")
    return cupy


def host_sum(data):
    return int(np.frombuffer(data, dtype=np.uint8).astype(np.int64).sum())


class DLPackOnly:
    """Hides everything but DLPack, to test that path with objects that also have CAI."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None, **kw):
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_read_on_the_tensors_stream_then_a_kernel(torch, engine, data_file):
    path, data = data_file
    f = engine.open(path)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.empty(len(data), dtype=torch.uint8, device="cuda")
        # Earlier work on the stream: a spin, then zeros. The read's copies must queue after
        # both (were they on another stream, the late zero_() would wipe the data).
        torch.cuda._sleep(50_000_000)
        t.zero_()
        n = f.read_into(t)  # CAI names s (the current stream)
        total = t.to(torch.int64).sum()  # a kernel right after, no synchronisation
    s.synchronize()
    assert n == len(data)
    assert total.item() == host_sum(data)
    assert t.cpu().numpy().tobytes() == data


def test_read_on_a_given_stream(torch, engine, data_file):
    path, data = data_file
    f = engine.open(path)
    t = torch.empty(len(data) - 1000, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        t.fill_(3)
    n = f.read_into(t, 1000, stream=s)
    with torch.cuda.stream(s):
        total = t.to(torch.int64).sum()
    s.synchronize()
    assert n == t.numel() and total.item() == host_sum(data[1000:])


def test_mapped_reads_on_the_tensors_stream(torch, data_file):
    # A warm 9 MiB read copied straight from the page cache, queued on the tensor's stream
    # behind earlier work there, and a kernel right after it.
    path, data = data_file
    with open(path, "rb") as f:
        assert f.read() == data  # warm
    with gpuio.Engine(mapped_reads=True) as e:
        f = e.open(path)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = torch.empty(len(data) - 5, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(50_000_000)
            t.zero_()
            n = f.read_into(t, 5)
            total = t.to(torch.int64).sum()
        s.synchronize()
        assert n == len(data) - 5
        assert e.mapped_reads == 1, "the warm read was not mapped"
        assert total.item() == host_sum(data[5:])
        assert t.cpu().numpy().tobytes() == data[5:]
    with gpuio.Engine() as e:
        assert e.mapped_reads == 0


def test_dlpack_paths(torch, engine, data_file):
    path, data = data_file
    f = engine.open(path)
    t = torch.zeros(4096, dtype=torch.float32, device="cuda")
    assert f.read_into(DLPackOnly(t), 64) == t.numel() * 4
    assert t.cpu().numpy().tobytes() == data[64 : 64 + 16384]
    u = torch.zeros(100, dtype=torch.int16, device="cuda")
    capsule = torch.utils.dlpack.to_dlpack(u)
    assert f.read_into(capsule, 3) == 200
    torch.cuda.synchronize()
    assert u.cpu().numpy().tobytes() == data[3:203]


def test_write_from_device(torch, engine, tmpdir_path):
    out = os.path.join(tmpdir_path, "dev.bin")
    f = engine.open(out, write=True, create=True)
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda") * 7
    assert f.write_from(src, 0) == src.numel() * 4
    assert f.write_from(DLPackOnly(src[:10]), src.numel() * 4) == 40
    with open(out, "rb") as g:
        on_disk = g.read()
    want = (np.arange(1 << 20, dtype=np.int32) * 7).tobytes()
    assert on_disk == want + want[:40]


def test_bad_device_memory_is_refused(torch, engine, data_file):
    f = engine.open(data_file[0])
    t = torch.zeros(8, 8, device="cuda")
    with pytest.raises(gpuio.InvalidInput, match="not C-contiguous"):
        f.read_into(t.t())
    host = np.zeros(64, dtype=np.uint8)

    class HostBehindCAI:
        __cuda_array_interface__ = {
            "data": (host.ctypes.data, False),
            "shape": (64,),
            "typestr": "|u1",
            "strides": None,
            "version": 3,
        }

    with pytest.raises(gpuio.InvalidInput, match="not CUDA"):
        f.read_into(HostBehindCAI())
    assert not host.any()

    class ReadOnly:
        __cuda_array_interface__ = dict(t.__cuda_array_interface__, data=(t.data_ptr(), True))

    with pytest.raises(gpuio.InvalidInput, match="read-only"):
        f.read_into(ReadOnly())


def test_cupy_cai_and_dlpack(cupy, engine, data_file):
    path, data = data_file
    f = engine.open(path)
    a = cupy.zeros(5000, dtype=cupy.float64)
    assert f.read_into(a, 11) == 40000
    assert cupy.asnumpy(a).tobytes() == data[11:40011]
    total = int(a.view(cupy.uint8).astype(cupy.int64).sum())
    assert total == host_sum(data[11:40011])
    s = cupy.cuda.Stream(non_blocking=True)
    b = cupy.zeros(1 << 20, dtype=cupy.uint8)
    assert f.read_into(b, 0, stream=s) == 1 << 20
    s.synchronize()
    assert cupy.asnumpy(b).tobytes() == data[: 1 << 20]
    c = cupy.zeros(777, dtype=cupy.uint8)
    assert f.read_into(DLPackOnly(c), 5) == 777
    cupy.cuda.Device().synchronize()
    assert cupy.asnumpy(c).tobytes() == data[5:782]


def test_async_read_and_cancel_on_device(torch, engine, tmpdir_path):
    path = os.path.join(tmpdir_path, "dev-cancel.bin")
    data = pattern(256 << 20, seed=9)
    with open(path, "wb") as g:
        g.write(data)
    f = engine.open(path)

    async def main():
        t = torch.empty(len(data), dtype=torch.uint8, device="cuda")
        assert await f.aread_into(t) == len(data)
        torch.cuda.current_stream().synchronize()
        assert t[:4096].cpu().numpy().tobytes() == data[:4096]
        # Cancel a read in flight: the tensor is released once its stream has passed the
        # copies already queued, and the engine goes on working.
        victim = torch.empty(len(data), dtype=torch.uint8, device="cuda")
        alive = weakref.ref(victim)
        # A slow engine (one 64 KiB piece at a time): the read is far from done when cancelled.
        slow = gpuio.Engine(backend="pread", queue_depth=1, pread_threads=1, chunk_size=64 << 10)
        task = asyncio.ensure_future(slow.open(path).aread_into(victim))
        del victim
        await asyncio.sleep(0)
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while alive() is not None and time.monotonic() < deadline:
            gc.collect()
            await asyncio.sleep(0.01)
        assert alive() is None, "the cancelled device read still holds its tensor"
        again = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert await f.aread_into(again, 77) == 1 << 20
        torch.cuda.current_stream().synchronize()
        assert again.cpu().numpy().tobytes() == data[77 : 77 + (1 << 20)]

    asyncio.run(main())


def test_checkpoint_matches_safetensors_torch(torch, tmpdir_path):
    try:
        import safetensors.torch as st
    except ImportError as e:
        skip_loudly(f"safetensors.torch is unavailable ({e})")
    from gpuio.safetensors import safe_open
    from gpuio.safetensors.torch import load_file

    gib = float(os.environ.get("GPUIO_PY_CKPT_GIB", "2"))
    g = torch.Generator(device="cuda").manual_seed(1)
    per = int(gib * (1 << 30)) // 4  # four tensors carry the bulk
    tensors = {
        "w.bf16": torch.randn(per // 2, device="cuda", generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(per // 2, device="cuda", generator=g).to(torch.float16).view(-1, 64),
        "w.f32": torch.randn(per // 4, device="cuda", generator=g).view(1024, -1),
        "w.i8": torch.randint(-128, 127, (per,), device="cuda", generator=g, dtype=torch.int8),
        "mask": torch.rand(1000, device="cuda", generator=g) > 0.5,
        "scalar": torch.tensor(0.25, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 16, dtype=torch.float16),
        "odd": torch.arange(3, dtype=torch.int16),
    }
    path = os.path.join(tmpdir_path, "big.safetensors")
    st.save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, path)
    del tensors
    ref = st.load_file(path, device="cuda:0")
    got = load_file(path, device="cuda:0")
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        have = got[name]
        assert (have.dtype, have.shape, have.device) == (want.dtype, want.shape, want.device), name
        assert torch.equal(have, want), name
    with safe_open(path, framework="pt", device="cuda:0") as f:
        assert torch.equal(f.get_tensor("mask"), ref["mask"])


def test_torch_current_device_is_left_alone(torch, engine, data_file):
    if torch.cuda.device_count() < 2:
        skip_loudly(f"needs two GPUs, this machine has {torch.cuda.device_count()}")
    path, data = data_file
    f = engine.open(path)
    torch.cuda.set_device(0)
    t = torch.zeros(1000, dtype=torch.uint8, device="cuda:1")
    assert f.read_into(t, 5) == 1000
    assert torch.cuda.current_device() == 0, "a read into cuda:1 changed torch's device"
    torch.cuda.synchronize(1)
    assert t.cpu().numpy().tobytes() == data[5:1005]


def test_batch_into_device_memory(torch, engine, data_file):
    path, data = data_file
    f = engine.open(path)
    t = torch.full((3 << 20,), 7, dtype=torch.uint8, device="cuda")
    descs = [(0, 1 << 20, 2 << 20), (5 << 20, 1 << 20, 0), (len(data) - 100, 1000, 1 << 20)]
    assert f.read_batch(descs, t) == [1 << 20, 1 << 20, 100]
    host = t.cpu().numpy().tobytes()
    assert host[2 << 20 :] == data[: 1 << 20]
    assert host[: 1 << 20] == data[5 << 20 : 6 << 20]
    assert host[1 << 20 : (1 << 20) + 100] == data[-100:]
    assert host[(1 << 20) + 100 : 2 << 20] == b"\x07" * ((1 << 20) - 100)

    async def main():
        u = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        got = await f.aread_batch([(1, 2048, 2048), (9, 2048, 0)], u)
        torch.cuda.current_stream().synchronize()
        return got, u.cpu().numpy().tobytes()

    got, host = asyncio.run(main())
    assert got == [2048, 2048] and host == data[9:2057] + data[1:2049]


def test_cancelled_device_write_never_lands_after_a_later_write(torch, tmpdir_path):
    # Issue 40 on the H100: 10 of 20 cancelled writes from a CUDA tensor landed after a later
    # successful write. cancel() now ends the operation before CancelledError is seen.
    engine = gpuio.Engine()
    path = os.path.join(tmpdir_path, "w.bin")
    f = engine.open(path, write=True, create=True)
    size = 64 << 20
    old = torch.full((size,), 0xAA, dtype=torch.uint8, device="cuda")
    new = torch.full((size,), 0xBB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    async def main():
        late = []
        for i in range(10):
            task = asyncio.ensure_future(f.awrite_from(old, 0))
            await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            assert f.write_from(new, 0) == size
            await asyncio.sleep(0.05)
            got = np.fromfile(path, dtype=np.uint8, count=size)
            if (got != 0xBB).any():
                late.append(i)
        return late

    assert asyncio.run(main()) == []


def test_cancelled_device_read_is_ordered_before_later_work_on_its_stream(torch, tmpdir_path):
    # After CancelledError no new copy is queued; copies already queued run on the tensor's
    # stream before anything queued there afterwards, so a fill queued after the cancel wins.
    engine = gpuio.Engine()
    path = os.path.join(tmpdir_path, "r.bin")
    size = 64 << 20
    np.full(size, 0x5A, dtype=np.uint8).tofile(path)
    f = engine.open(path)

    async def main():
        wrong = 0
        for _ in range(10):
            dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
            task = asyncio.ensure_future(f.aread_into(dst, 0))
            await asyncio.sleep(0)
            task.cancel()
            try:
                await task
                continue
            except asyncio.CancelledError:
                pass
            dst.fill_(7)
            await asyncio.sleep(0.05)
            torch.cuda.synchronize()
            wrong += int((dst != 7).any())
        return wrong

    assert asyncio.run(main()) == 0


def test_save_from_gpu_memory_matches_safetensors(torch, tmp_path):
    from safetensors.torch import save_file as st_save

    from gpuio.safetensors import torch as gt

    sd = {f"w{i}": torch.randn(257, 129 + i, device="cuda") for i in range(4)}
    sd["h"] = torch.randn(1000, device="cuda").half()
    sd["b"] = torch.randn(33, device="cuda").to(torch.bfloat16)
    gt.save_file(sd, tmp_path / "gpu.safetensors", metadata={"from": "gpu"})
    st_save({k: v.cpu() for k, v in sd.items()}, str(tmp_path / "ref.safetensors"), metadata={"from": "gpu"})
    assert (tmp_path / "gpu.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    files = gt.save_torch_state_dict(sd, tmp_path / "model", max_shard_size=200_000)
    assert len(files) > 2
    back = gt.load_file(tmp_path / "model", device="cuda")
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
