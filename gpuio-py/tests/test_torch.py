"""torch on the CPU: the safetensors drop-in against safetensors.torch (bf16, f16, bool,
scalars, empty tensors), and CPU tensors as destinations through DLPack. Skips, saying why,
where torch is not installed (CI: torch is not installable there; the GPU bundle runs these)."""

import os

import numpy as np
import pytest

import gpuio
from conftest import skip_loudly


@pytest.fixture(scope="module")
def torch():
    try:
        import torch
    except ImportError as e:
        skip_loudly(f"torch is not installed ({e}); torch tests run in the GPU bundle")
    return torch


@pytest.fixture
def st_torch():
    try:
        import safetensors.torch as st
    except ImportError as e:
        skip_loudly(f"safetensors.torch is unavailable ({e})")
    return st


def sample(torch):
    g = torch.Generator().manual_seed(3)
    return {
        "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 5, generator=g).to(torch.float16),
        "f32": torch.randn(1 << 20, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "i8": torch.randint(-128, 127, (9, 2), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(4, 4, generator=g) > 0.5,
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "scalar_i": torch.tensor(7),
        "empty": torch.zeros(0, 3),
        "empty_bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
    }


def assert_same(torch, got, ref, device=None):
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        have = got[name]
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        if device is not None:
            assert have.device == torch.device(device), name
        assert torch.equal(have.cpu(), want.cpu()), name


def test_load_file_cpu_matches_safetensors(torch, st_torch, tmpdir_path):
    from gpuio.safetensors.torch import load_file

    path = os.path.join(tmpdir_path, "m.safetensors")
    st_torch.save_file(sample(torch), path)
    got = load_file(path)
    assert_same(torch, got, st_torch.load_file(path), device="cpu")
    # The loaded tensors do not overlap: safetensors saves them again as they are.
    again = os.path.join(tmpdir_path, "again.safetensors")
    st_torch.save_file(got, again)
    assert_same(torch, st_torch.load_file(again), got)


def test_safe_open_torch_subset(torch, st_torch, tmpdir_path):
    from gpuio.safetensors import safe_open

    path = os.path.join(tmpdir_path, "m.safetensors")
    ref = sample(torch)
    st_torch.save_file(ref, path, metadata={"a": "b"})
    with safe_open(path, framework="pt", device="cpu") as f:
        assert f.metadata() == {"a": "b"}
        assert torch.equal(f.get_tensor("bf16"), ref["bf16"])
        some = f.get_tensors(["mask", "scalar"])
        assert torch.equal(some["mask"], ref["mask"]) and some["scalar"].shape == ()


def test_cpu_tensor_is_a_destination_through_dlpack(torch, engine, data_file):
    path, data = data_file
    f = engine.open(path)
    t = torch.zeros(1000, dtype=torch.int32)
    assert f.read_into(t, 8) == 4000
    assert t.numpy().tobytes() == data[8:4008]
    with pytest.raises(gpuio.InvalidInput, match="not C-contiguous"):
        f.read_into(torch.zeros(10, 10)[:, 1])
    assert np.frombuffer(data, np.uint8).size == len(data)


def test_tensor_parallel_shards_on_cpu_and_gpus(torch, st_torch, tmp_path):
    """load_shards: each rank's part of every split tensor equals torch.chunk of the tensor;
    ranks on the CPU, and where CUDA exists, spread over the GPUs."""
    from gpuio.safetensors.torch import load_shards

    g = torch.Generator().manual_seed(5)
    ts = {
        "qkv": torch.randn(6, 4, 12, generator=g).to(torch.bfloat16),
        "embed": torch.randn(12, 8, generator=g),
        "norm": torch.randn(12, generator=g),
    }
    path = tmp_path / "tp.safetensors"
    st_torch.save_file(ts, str(path))
    rules = {"qkv": ("split", 2), "embed": ("split", 0), "norm": "replicate"}
    layouts = [["cpu", "cpu", "cpu"]]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        ranks = max(d for d in (2, 3, 4, 6) if d <= max(2, n))  # divides 12
        layouts.append([f"cuda:{r % n}" for r in range(ranks)])
    for devices in layouts:
        for replicas in ("auto", "once", "each"):
            shards = load_shards(path, devices, rules, replicas=replicas)
            ranks = len(devices)
            for r, shard in enumerate(shards):
                for name, dim in (("qkv", 2), ("embed", 0)):
                    assert shard[name].device == torch.device(devices[r]), name
                    want = torch.chunk(ts[name], ranks, dim=dim)[r]
                    assert torch.equal(shard[name].cpu(), want), (name, replicas)
                assert torch.equal(shard["norm"].cpu(), ts["norm"]), replicas
            # Everything replicated: every rank holds every tensor whole.
            every = load_shards(path, devices, {n: "replicate" for n in ts}, replicas=replicas)
            for r, shard in enumerate(every):
                for name, t in ts.items():
                    assert shard[name].device == torch.device(devices[r]), name
                    assert torch.equal(shard[name].cpu(), t), (name, r, replicas)
    with pytest.raises(ValueError, match="replicas"):
        load_shards(path, ["cpu"], rules, replicas="twice")
