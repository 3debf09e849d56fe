"""Saving checkpoints from Python: ``save_file`` writes what the safetensors package writes,
byte for byte (numpy here; torch where installed, GPU tensors in test_gpu.py); directories of
shards load back as one checkpoint; nothing is left under the final name on bad input."""

import json
import os

import numpy as np
import pytest

import gpuio

st_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
from gpuio.safetensors.numpy import load_file, save_file  # noqa: E402


def arrays():
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((65, 7)).astype(np.float32),
        "h": rng.standard_normal(9).astype(np.float16),
        "i": rng.integers(-5, 5, size=(2, 2, 2), dtype=np.int64),
        "m": rng.integers(0, 2, size=5).astype(bool),
        "e": np.zeros((0, 3), dtype=np.float32),
        "s": np.array(1.5, dtype=np.float64),
        "be": np.arange(6, dtype=">i4"),
    }


def test_numpy_save_file_is_byte_identical(tmp_path):
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    meta = {"format": "np"}
    save_file(arrays(), ours, metadata=meta)
    st_numpy.save_file(arrays(), str(theirs), metadata=meta)
    assert ours.read_bytes() == theirs.read_bytes()
    back = load_file(ours)
    for k, v in arrays().items():
        assert np.array_equal(back[k], v), k
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_bad_tensor_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):
        save_file({"x": np.array(["a", "b"])}, path)
    assert path.read_bytes() == b"old"


def test_torch_save_file_and_sharded_state_dicts(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    st_torch = pytest.importorskip("safetensors.torch")
    from gpuio.safetensors import torch as gt
    sd = {f"layers.{i}.w": torch.randn(128, 64 + i) for i in range(6)}
    sd["norm"] = torch.randn(64).to(torch.bfloat16)
    ours, theirs = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    gt.save_file(sd, ours)
    st_torch.save_file(sd, str(theirs))
    assert ours.read_bytes() == theirs.read_bytes()
    d = tmp_path / "model"
    files = gt.save_torch_state_dict(sd, d, max_shard_size="80KB")
    assert files[-1].endswith("model.safetensors.index.json")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)
    back = gt.load_file(d)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    with pytest.raises(ValueError, match="not contiguous"):
        gt.save_file({"t": torch.randn(4, 4).t()}, tmp_path / "c.safetensors")


def test_progress_callbacks_count_every_byte_and_can_stop(tmp_path):
    big = {"a": np.arange(40 << 18, dtype=np.float32), "b": np.ones(3 << 20, dtype=np.uint8)}
    nbytes = sum(a.nbytes for a in big.values())
    path = tmp_path / "p.safetensors"
    saved = []
    save_file(big, path, progress=lambda done, total: saved.append((done, total)))
    assert saved and saved[-1] == (nbytes, nbytes)
    assert all(d1 <= d2 for (d1, _), (d2, _) in zip(saved, saved[1:]))
    loaded = []
    back = load_file(path, progress=lambda done, total: loaded.append((done, total)))
    assert loaded[-1] == (nbytes, nbytes)
    assert np.array_equal(back["a"], big["a"])

    # A callback that raises stops the load and its exception comes out.
    class Stop(Exception):
        pass

    seen = []

    def stop(done, total):
        seen.append((done, total))
        raise Stop(f"{done}/{total}")

    with pytest.raises(Stop):
        load_file(path, progress=stop)
    # A save stopped by its callback leaves nothing under the final name, or (where it had
    # finished before the call) the whole file: never part of one.
    other = tmp_path / "q.safetensors"
    seen.clear()
    with pytest.raises(Stop):
        save_file(big, other, progress=stop)
    assert seen
    assert not other.exists() or other.read_bytes() == path.read_bytes()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_stopped_load_into_host_memory_lets_go_of_it(tmp_path):
    # LoadPlan.read_into host memory lends the array to the kernel for the call; a progress
    # callback that raises stops it, and the call raises only once no read holds the array:
    # nothing writes it afterwards.
    import time

    big = {"a": np.arange(12 << 20, dtype=np.float32)}
    path = tmp_path / "s.safetensors"
    save_file(big, path)
    plan = gpuio._native.open_safetensors(gpuio.Engine(), str(path)).plan(None)

    class Stop(Exception):
        pass

    calls = []

    def stop(done, total):
        calls.append((done, total))
        raise Stop()

    with open(path, "rb") as raw:
        os.posix_fadvise(raw.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    buf = np.zeros(plan.dst_len, dtype=np.uint8)
    with pytest.raises(Stop):
        plan.read_into(buf, progress=stop)
    nbytes = big["a"].nbytes
    assert len(calls) == 1 and calls[0][1] == nbytes
    left = buf.copy()
    time.sleep(0.2)
    assert np.array_equal(buf, left), "written after the call raised"
    # The same plan reads everything afterwards.
    reported = []
    assert plan.read_into(buf, progress=lambda d, t: reported.append((d, t))) == nbytes
    assert reported[-1] == (nbytes, nbytes)
    [(_, _, _, start, end)] = plan.tensors
    assert np.array_equal(buf[start:end].view(np.float32), big["a"])
