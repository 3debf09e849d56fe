"""gpuio.safetensors against the safetensors package: files it writes, loaded by both,
compared tensor by tensor (numpy here; torch in test_torch.py and test_gpu.py)."""

import json
import os
import struct

import numpy as np
import pytest

import gpuio
from gpuio.safetensors import safe_open

st_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
from gpuio.safetensors.numpy import load_file  # noqa: E402


def tensors():
    rng = np.random.default_rng(7)
    return {
        "embed": rng.standard_normal((257, 33)).astype(np.float32),
        "half": rng.standard_normal((5, 7, 3)).astype(np.float16),
        "f64": rng.standard_normal(11),
        "i64": rng.integers(-(2**62), 2**62, size=(4, 4), dtype=np.int64),
        "i32": rng.integers(-1000, 1000, size=100, dtype=np.int32),
        "u16": rng.integers(0, 65535, size=(3, 3), dtype=np.uint16),
        "i8": rng.integers(-128, 127, size=13, dtype=np.int8),
        "u8": rng.integers(0, 255, size=1, dtype=np.uint8),
        "mask": rng.integers(0, 2, size=(9, 2)).astype(bool),
        "scalar": np.array(2.5, dtype=np.float32),
        "scalar_int": np.array(-3, dtype=np.int64),
        "empty": np.zeros((0, 8), dtype=np.float32),
        "empty_1d": np.zeros(0, dtype=np.int16),
        "big": rng.standard_normal(3 << 20).astype(np.float32),  # 12 MiB: several chunks
    }


def assert_same(got, ref):
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        have = got[name]
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        assert np.array_equal(have, want), name


@pytest.fixture
def checkpoint(tmpdir_path):
    path = os.path.join(tmpdir_path, "model.safetensors")
    st_numpy.save_file(tensors(), path, metadata={"format": "np", "note": "gpuio test"})
    return path


def test_load_file_matches_safetensors(checkpoint):
    assert_same(load_file(checkpoint), st_numpy.load_file(checkpoint))


def test_host_loads_own_their_memory(checkpoint):
    # Host loads read into memory the load allocated (in place, LoadPlan.read_host): the
    # arrays are writable, independent of one another, and keep that memory alive.
    ref = st_numpy.load_file(checkpoint)
    a, b = load_file(checkpoint), load_file(checkpoint)
    assert a["big"].flags.writeable
    a["big"][...] = 0
    a["embed"][0, 0] = 123.0
    assert_same(b, ref)
    del b
    import gc

    gc.collect()
    assert a["embed"][0, 0] == 123.0 and not a["big"].any()


def test_read_host_gives_a_writable_buffer(checkpoint):
    ref = st_numpy.load_file(checkpoint)
    plan = gpuio._native.open_safetensors(gpuio.Engine(), checkpoint).plan(None)
    buf = plan.read_host()
    assert len(buf) == plan.dst_len
    view = memoryview(buf)
    assert view.nbytes == plan.dst_len and not view.readonly and view.format == "B"
    arr = np.frombuffer(buf, dtype=np.uint8)
    for name, _dtype, _shape, start, end in plan.tensors:
        assert arr[start:end].tobytes() == ref[name].tobytes(), name
    # Writable through the array, which keeps the memory alive once the buffer is gone.
    del view, buf
    arr[:] = 7
    assert (arr == 7).all()


def test_load_file_with_a_given_engine(checkpoint):
    engine = gpuio.Engine(backend="pread", chunk_size=1 << 20)
    assert_same(load_file(checkpoint, engine=engine), st_numpy.load_file(checkpoint))


def test_safe_open_subsets_and_metadata(checkpoint):
    ref = st_numpy.load_file(checkpoint)
    with safe_open(checkpoint, framework="np") as f:
        assert sorted(f.keys()) == sorted(ref)
        assert f.metadata() == {"format": "np", "note": "gpuio test"}
        assert np.array_equal(f.get_tensor("mask"), ref["mask"])
        assert f.get_tensor("scalar").shape == ()
        some = f.get_tensors(["i32", "embed", "empty"])
        assert sorted(some) == ["embed", "empty", "i32"]
        assert_same(some, {k: ref[k] for k in some})
        with pytest.raises(KeyError, match="nope"):
            f.get_tensor("nope")


def test_single_tensor_load_reads_only_its_bytes(checkpoint):
    # A subset's buffer holds the subset, not the file: the plan packs what was asked for.
    ck = gpuio.safetensors.Checkpoint(checkpoint)
    plan = ck._file.plan(["u8"])
    assert plan.dst_len < 256 + 1
    assert [row[0] for row in plan.tensors] == ["u8"]


def write_raw(path, header, data):
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def test_unaligned_header_still_loads(tmpdir_path):
    # A legal file whose header length leaves the tensor at an odd offset.
    path = os.path.join(tmpdir_path, "odd.safetensors")
    values = np.arange(6, dtype=np.float32)
    write_raw(path, {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "x": {"dtype": "U8", "shape": [1], "data_offsets": [24, 25]}}, values.tobytes() + b"\x07")
    got = load_file(path)
    assert np.array_equal(got["w"], values.reshape(2, 3)) and got["x"].tolist() == [7]
    assert_same(got, st_numpy.load_file(path))


def test_bf16_has_no_numpy_form(tmpdir_path):
    path = os.path.join(tmpdir_path, "bf16.safetensors")
    write_raw(path, {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\x80\x3f\x00\x40")
    with pytest.raises(TypeError, match="BF16"):
        load_file(path)


def test_corrupt_files_fail_clearly(tmpdir_path):
    path = os.path.join(tmpdir_path, "bad.safetensors")
    with open(path, "wb") as f:
        f.write(b"\x05")
    with pytest.raises(gpuio.InvalidInput, match="too short"):
        load_file(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(gpuio.InvalidInput, match="header"):
        load_file(path)
    # The header promises more data than the file holds.
    write_raw(path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\x00" * 8)
    with pytest.raises(gpuio.InvalidInput, match="past the"):
        load_file(path)
    with pytest.raises(OSError):
        load_file(os.path.join(tmpdir_path, "missing.safetensors"))


def test_unknown_framework_is_refused(checkpoint):
    with pytest.raises(ValueError, match="framework"):
        safe_open(checkpoint, framework="tf")


def test_tensor_parallel_shards_match_numpy_slices(tmp_path):
    from gpuio.safetensors.numpy import load_shards

    rng = np.random.default_rng(11)
    ts = {
        "qkv": rng.standard_normal((6, 4, 12)).astype(np.float32),
        "up": rng.standard_normal((5, 12)).astype(np.float16),
        "norm": rng.standard_normal(12).astype(np.float32),
        "head": rng.integers(0, 255, size=(3, 7), dtype=np.uint8),
        "skipped": np.zeros(3, dtype=np.float32),
    }
    path = tmp_path / "tp.safetensors"
    st_numpy.save_file(ts, str(path))
    rules = {"qkv": ("split", 2), "up": ("split", 1), "norm": "replicate", "head": ("only", 2)}
    for rule in (rules, lambda name, shape: rules.get(name)):
        shards = load_shards(path, 3, rule)
        assert len(shards) == 3
        for r, shard in enumerate(shards):
            np.testing.assert_array_equal(shard["qkv"], np.split(ts["qkv"], 3, axis=2)[r])
            np.testing.assert_array_equal(shard["up"], np.split(ts["up"], 3, axis=1)[r])
            np.testing.assert_array_equal(shard["norm"], ts["norm"])
            assert ("head" in shard) == (r == 2)
            assert "skipped" not in shard
        np.testing.assert_array_equal(shards[2]["head"], ts["head"])
    with pytest.raises(ValueError, match="equal parts"):
        load_shards(path, 5, {"qkv": ("split", 2)})
    with pytest.raises(ValueError, match="shard rule"):
        load_shards(path, 2, {"qkv": ("cut", 2)})
    with pytest.raises(KeyError):
        load_shards(path, 2, {"nope": "replicate"})


def test_read_plans_checks_its_lists(tmp_path):
    path = tmp_path / "one.safetensors"
    st_numpy.save_file({"w": np.arange(10, dtype=np.float32)}, str(path))
    f = gpuio._native.open_safetensors(gpuio.Engine(), str(path))
    plan = f.plan(None)
    with pytest.raises(ValueError, match="one each"):
        gpuio._native.read_plans([plan, plan], [np.empty(plan.dst_len, dtype=np.uint8)])
    bufs = [np.empty(plan.dst_len, dtype=np.uint8) for _ in range(3)]
    assert gpuio._native.read_plans([plan] * 3, bufs) == [40, 40, 40]
    (_, _, _, start, end), = plan.tensors
    for b in bufs:
        np.testing.assert_array_equal(b[start:end].view(np.float32), np.arange(10, dtype=np.float32))
