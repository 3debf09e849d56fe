"""Checkpoints kept as hubs keep them: a directory of shards with
``model.safetensors.index.json``, loaded by ``load_file`` (directory or index file) as one
checkpoint, compared with the safetensors package shard by shard; bad indices refused."""

import json
import os

import numpy as np
import pytest

import gpuio
from gpuio.safetensors import Checkpoint

st_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
from gpuio.safetensors.numpy import load_file, load_shards  # noqa: E402


def shard_tensors(s):
    rng = np.random.default_rng(100 + s)
    return {
        f"layers.{s}.w": rng.standard_normal((64, 32)).astype(np.float32),
        f"layers.{s}.b": rng.standard_normal(32).astype(np.float16),
        f"layers.{s}.idx": rng.integers(-1000, 1000, size=(5, 3), dtype=np.int64),
    }


def write_model(d, shards=3, index=True):
    weight_map, ref = {}, {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        t = shard_tensors(s)
        st_numpy.save_file(t, os.path.join(d, name))
        ref.update(t)
        weight_map.update({k: name for k in t})
    if index:
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 4242}, "weight_map": weight_map}, f)
    return ref, weight_map


def assert_same(got, ref):
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        assert np.array_equal(got[name], want), name


def test_a_directory_loads_every_shard_as_one_checkpoint(tmp_path):
    ref, _ = write_model(str(tmp_path))
    assert_same(load_file(tmp_path), ref)
    assert_same(load_file(tmp_path / "model.safetensors.index.json"), ref)
    ck = Checkpoint(tmp_path)
    assert len(ck.shards()) == 3
    assert ck.metadata() == {"total_size": "4242"}


def test_a_directory_without_an_index_loads_its_files(tmp_path):
    ref, _ = write_model(str(tmp_path), shards=2, index=False)
    assert_same(load_file(str(tmp_path)), ref)


def test_bad_indices_fail_before_reading(tmp_path):
    _, weight_map = write_model(str(tmp_path))
    index = tmp_path / "model.safetensors.index.json"
    weight_map["ghost"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(gpuio.InvalidInput, match="does not hold it"):
        load_file(tmp_path)
    del weight_map["ghost"]
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(gpuio.InvalidInput, match="which is missing"):
        load_file(tmp_path)


def test_tensor_parallel_loads_span_every_shard(tmp_path):
    ref, _ = write_model(str(tmp_path))
    rule = {"layers.0.w": ("split", 0), "layers.1.w": ("split", 1), "layers.2.b": "replicate",
            "layers.2.idx": ("only", 1)}
    ranks = load_shards(tmp_path, 2, rule)
    for r in range(2):
        np.testing.assert_array_equal(ranks[r]["layers.0.w"], np.split(ref["layers.0.w"], 2, 0)[r])
        np.testing.assert_array_equal(ranks[r]["layers.2.b"], ref["layers.2.b"])
    np.testing.assert_array_equal(ranks[0]["layers.1.w"], ref["layers.1.w"][:, :16])
    assert "layers.2.idx" not in ranks[0]
    np.testing.assert_array_equal(ranks[1]["layers.2.idx"], ref["layers.2.idx"])
