"""``gpuio.safetensors.torch.load_file``: ``safetensors.torch.load_file`` through gpuio,
straight into GPU memory for ``device="cuda:N"``."""

import os
from typing import Callable, Dict, List, Optional, Union

import torch

import gpuio
from gpuio.safetensors import Checkpoint

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in [
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    # OCP MX scale type; torch 2.7+ (safetensors' own table sizes it but does not map it).
    ("F8_E8M0", "float8_e8m0fnu"),
    ("C64", "complex64"),
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
]:
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


_SIZES = {k: torch.empty((), dtype=v).element_size() for k, v in _DTYPES.items()}


def _dtype(name, dtype):
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"tensor {name!r}: safetensors dtype {dtype} has no equivalent in this torch"
        ) from None


def _build(buf, name, dtype, shape, start, end):
    dt = _dtype(name, dtype)
    raw = buf[start:end]
    if start % _SIZES[dtype]:
        # A view must start aligned to its element size; a file whose header length leaves
        # this tensor misaligned gets its own (aligned) copy.
        raw = raw.clone()
    return raw.view(dt).reshape(shape)


def _load(checkpoint, names, device="cpu", progress=None):
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    for n in names if names is not None else checkpoint.keys():
        _dtype(n, checkpoint.listing(n)[1])  # refuse before reading anything
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            stream = torch.cuda.current_stream(dev)
            return checkpoint.load(
                names,
                alloc=lambda n: torch.empty(max(n, 1), dtype=torch.uint8, device=dev),
                build=_build,
                stream=stream,
                # As safetensors does, return tensors that are ready on any stream.
                sync=stream.synchronize,
                progress=progress,
            )
    if dev.type != "cpu":
        raise ValueError(f"device {device!r}: gpuio loads into 'cpu' or 'cuda:N'")
    # The load allocates the memory and reads into it in place; the tensor wraps it.
    return checkpoint.load(
        names,
        alloc=None,
        build=_build,
        progress=progress,
        host=_wrap_host,
    )


def _wrap_host(buf):
    # torch.frombuffer refuses an empty buffer.
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


def load_file(
    filename: Union[str, "os.PathLike[str]"],
    device: Union[str, int, "torch.device"] = "cpu",
    *,
    engine: Optional[gpuio.Engine] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Dict[str, "torch.Tensor"]:
    """Loads every tensor of a ``.safetensors`` file: ``{name: torch.Tensor}`` with the same
    dtypes, shapes and values as ``safetensors.torch.load_file``. ``filename`` may also be a
    model directory (through its ``model.safetensors.index.json``, else every
    ``.safetensors`` file in it) or an index file: every shard is read in one batch, the
    files concurrently, into one allocation. ``device`` is ``"cpu"``
    (default), ``"cuda"``, ``"cuda:N"``, an int or a ``torch.device``; on a GPU the bytes go
    from the file (or page cache) through pinned bounce buffers, or cuFile, into one device
    allocation, and the tensors are ready when this returns.

    ``progress(done, total)`` (bytes), where given, is called about every 100 ms during the
    load and once at the end; if it raises, the load stops (nothing is written into the
    tensors' memory afterwards) and the exception propagates."""
    return _load(Checkpoint(filename, engine), None, device, progress)


def _device(device):
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: gpuio loads into 'cpu' or 'cuda:N'")
    return dev


def load_shards(
    filename: Union[str, "os.PathLike[str]"],
    devices: List[Union[str, int, "torch.device"]],
    rule,
    *,
    engine: Optional[gpuio.Engine] = None,
    replicas: str = "auto",
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[Dict[str, "torch.Tensor"]]:
    """Tensor-parallel load: one ``{name: torch.Tensor}`` per entry of ``devices`` (rank
    ``r`` on ``devices[r]``; several ranks may share a device). ``rule`` is a dict of tensor
    names to ``"replicate"``, ``("split", dim)`` (rank ``r`` gets part ``r`` of ``dim``, which
    must divide evenly) or ``("only", rank)``, or a callable ``rule(name, shape)`` returning
    one of those or ``None`` (not loaded). Each rank reads only its own part of the file,
    straight into its device; the tensors are ready when this returns.

    ``replicas`` says how replicated tensors reach every rank: ``"once"`` (one rank reads
    each from the file, the others get a GPU-to-GPU copy), ``"each"`` (every rank reads them)
    or ``"auto"`` (``"once"`` where every device is a GPU and each pair reaches the other
    directly, over NVLink or PCIe peer-to-peer). ``progress`` as for ``load_file`` (the bytes
    read from the file by every rank)."""
    if replicas not in ("auto", "once", "each"):
        raise ValueError(f"replicas={replicas!r}: use 'auto', 'once' or 'each'")
    devs = [_device(d) for d in devices]
    checkpoint = Checkpoint(filename, engine)
    rules = checkpoint.shard_rules(rule)
    for n in rules:
        _dtype(n, checkpoint.listing(n)[1])  # refuse before reading anything
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devs]

    def alloc(rank, n):
        if devs[rank].type == "cuda":
            return torch.empty(max(n, 1), dtype=torch.uint8, device=devs[rank])
        return torch.empty(n, dtype=torch.uint8)

    def sync(rank):
        if streams[rank] is not None:
            streams[rank].synchronize()

    if replicas == "auto":
        gpus = sorted({d.index for d in devs if d.type == "cuda"})
        replicas = "once" if all(d.type == "cuda" for d in devs) and all(
            torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b
        ) else "each"

    def copy(dst, d, src, s, e):
        # torch orders a copy between GPUs after both devices' current streams (where the
        # reads were queued) and makes both wait for it.
        dst[d : d + (e - s)].copy_(src[s:e])

    return checkpoint.load_shards(
        rules,
        len(devs),
        alloc=alloc,
        build=_build,
        streams=streams,
        sync=sync,
        copy=copy if replicas == "once" else None,
        progress=progress,
        # Every rank in CPU memory: the loads allocate it and read in place.
        host=_wrap_host if all(d.type == "cpu" for d in devs) else None,
    )


_NAMES = {v: k for k, v in _DTYPES.items()}


def _parse_size(size):
    """``5GB``-style sizes as huggingface_hub reads them (decimal units; ``GiB`` binary)."""
    if isinstance(size, int):
        return size
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    text = str(size).strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def _to_save(tensors):
    rows, devices = [], set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r}: a torch.Tensor, not {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(
                f"tensor {name!r} is not contiguous: save t.contiguous() (as safetensors asks)"
            )
        try:
            dtype = _NAMES[t.dtype]
        except KeyError:
            raise TypeError(f"tensor {name!r}: {t.dtype} has no safetensors dtype") from None
        if t.device.type == "cuda":
            devices.add(t.device)
        elif t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {t.device}: gpuio saves from 'cpu' or 'cuda'")
        rows.append((name, dtype, list(t.shape), t.reshape(-1).view(torch.uint8)))
    # The bytes are read as they are once queued work is done: wait for the producers.
    for d in devices:
        torch.cuda.current_stream(d).synchronize()
    return rows


def save_file(
    tensors: Dict[str, "torch.Tensor"],
    filename: Union[str, "os.PathLike[str]"],
    metadata: Optional[Dict[str, str]] = None,
    *,
    engine: Optional[gpuio.Engine] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> None:
    """``safetensors.torch.save_file`` through gpuio: the same file, byte for byte, written
    from host or GPU memory (GPU tensors through pinned bounce buffers, no host copy of the
    checkpoint), into a temporary file that is fsynced and renamed into place, so ``filename``
    is never left holding part of a checkpoint. ``progress(done, total)`` (tensor bytes), where
    given, is called about every 100 ms and at the end; if it raises before the save has
    finished, the save stops and leaves no file under ``filename``."""
    from gpuio.safetensors import default_engine

    engine = engine if engine is not None else default_engine()
    gpuio._native.save_safetensors(
        engine, os.fspath(filename), _to_save(tensors), metadata, progress=progress
    )


def save_torch_state_dict(
    state_dict: Dict[str, "torch.Tensor"],
    save_directory: Union[str, "os.PathLike[str]"],
    *,
    max_shard_size: Union[int, str] = "5GB",
    metadata: Optional[Dict[str, str]] = None,
    engine: Optional[gpuio.Engine] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[str]:
    """``huggingface_hub.save_torch_state_dict``'s layout through gpuio: shards of at most
    ``max_shard_size`` (``"5GB"``, ``"500MB"``, or bytes) named
    ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``, or one
    ``model.safetensors`` where everything fits. Returns the files written (the index last).
    ``progress`` as for ``save_file``, over every shard."""
    from gpuio.safetensors import default_engine

    engine = engine if engine is not None else default_engine()
    os.makedirs(save_directory, exist_ok=True)
    files = gpuio._native.save_safetensors(
        engine,
        os.fspath(save_directory),
        _to_save(state_dict),
        metadata,
        _parse_size(max_shard_size),
        progress=progress,
    )
    return [os.fspath(f) for f in files]


__all__ = ["load_file", "load_shards", "save_file", "save_torch_state_dict"]
