"""``gpuio.safetensors.numpy.load_file``: ``safetensors.numpy.load_file`` through gpuio."""

import os
from typing import Callable, Dict, List, Optional, Union

import numpy as np

import gpuio
from gpuio.safetensors import Checkpoint

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "U64": np.uint64,
    "I32": np.int32,
    "U32": np.uint32,
    "I16": np.int16,
    "U16": np.uint16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "C64": np.complex64,
}


_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _dtype(name, dtype):
    try:
        return np.dtype(_DTYPES[dtype]).newbyteorder("<")
    except KeyError:
        raise TypeError(
            f"tensor {name!r}: safetensors dtype {dtype} has no numpy equivalent "
            "(as in safetensors.numpy); load it with gpuio.safetensors.torch"
        ) from None


def _build(buf, name, dtype, shape, start, end):
    return buf[start:end].view(_dtype(name, dtype)).reshape(shape)


def _load(checkpoint, names, progress=None):
    for n in names if names is not None else checkpoint.keys():
        _dtype(n, checkpoint.listing(n)[1])  # refuse before reading anything
    # The load allocates the memory and reads into it in place; the array wraps it.
    return checkpoint.load(
        names,
        alloc=None,
        build=_build,
        progress=progress,
        host=lambda b: np.frombuffer(b, dtype=np.uint8),
    )


def load_file(
    filename: Union[str, "os.PathLike[str]"],
    *,
    engine: Optional[gpuio.Engine] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Dict[str, np.ndarray]:
    """Loads every tensor of a ``.safetensors`` file as numpy arrays:
    ``{name: np.ndarray}``, the same dtypes, shapes and values as
    ``safetensors.numpy.load_file``. ``filename`` may also be a model directory or an index
    file (see ``gpuio.safetensors.torch.load_file``, which also says what ``progress`` gets)."""
    return _load(Checkpoint(filename, engine), None, progress)


def load_shards(
    filename: Union[str, "os.PathLike[str]"],
    ranks: int,
    rule,
    *,
    engine: Optional[gpuio.Engine] = None,
) -> List[Dict[str, np.ndarray]]:
    """Tensor-parallel load into ``ranks`` sets of numpy arrays: ``rule`` is a dict of tensor
    names to ``"replicate"``, ``("split", dim)`` (rank ``r`` gets part ``r`` of ``dim``) or
    ``("only", rank)``, or a callable ``rule(name, shape)`` returning one of those or
    ``None``. Each rank reads only its own part of the file."""
    checkpoint = Checkpoint(filename, engine)
    rules = checkpoint.shard_rules(rule)
    for n in rules:
        _dtype(n, checkpoint.listing(n)[1])  # refuse before reading anything
    return checkpoint.load_shards(
        rules,
        ranks,
        alloc=None,
        build=_build,
        host=lambda b: np.frombuffer(b, dtype=np.uint8),
    )


def save_file(
    tensor_dict: Dict[str, np.ndarray],
    filename: Union[str, "os.PathLike[str]"],
    metadata: Optional[Dict[str, str]] = None,
    *,
    engine: Optional[gpuio.Engine] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> None:
    """``safetensors.numpy.save_file`` through gpuio: the same file, byte for byte, written
    into a temporary file that is fsynced and renamed into place; ``progress`` as for
    ``gpuio.safetensors.torch.save_file``."""
    from gpuio.safetensors import default_engine

    rows = []
    for name, a in tensor_dict.items():
        a = np.asarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))  # the format is little-endian
        try:
            dtype = _NAMES[a.dtype.newbyteorder("=")]
        except KeyError:
            raise TypeError(f"tensor {name!r}: {a.dtype} has no safetensors dtype") from None
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        rows.append((name, dtype, list(a.shape), flat))
    engine = engine if engine is not None else default_engine()
    gpuio._native.save_safetensors(engine, os.fspath(filename), rows, metadata, progress=progress)


__all__ = ["load_file", "load_shards", "save_file"]
