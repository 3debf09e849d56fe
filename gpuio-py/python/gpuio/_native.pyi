"""Type stubs for gpuio's extension module (re-exported by ``gpuio``)."""

import os
import pathlib
from typing import Any, Awaitable, Optional, Sequence, Union

#: Host memory (buffer protocol: numpy, bytearray, memoryview), device memory
#: (``__cuda_array_interface__`` or ``__dlpack__``: torch, cupy), or a DLPack capsule.
Memory = Any
#: An int CUDA stream handle, ``torch.cuda.Stream``, ``cupy.cuda.Stream``, or an object with
#: ``__cuda_stream__``.
Stream = Any
#: ``(offset, length, dst_offset)``.
Desc = tuple[int, int, int]

__version__: str

class CheckReport:
    """What ``gpuio check`` reports; ``str()`` prints it as the command does."""

    @property
    def sections(self) -> list[tuple[str, list[str]]]: ...

def check(path: Optional[Union[str, os.PathLike[str]]] = None) -> CheckReport:
    """Examines this machine and ``path`` (default ``"."``) as ``gpuio check PATH`` does."""

def cuda_available() -> bool:
    """Whether a usable CUDA device exists (cached after the first call)."""

class Engine:
    """One reactor thread and its bounce pool; the builder's settings as keywords (sizes in
    bytes, times in seconds). ``backend``: ``"auto"``, ``"uring"``, ``"pread"`` or ``"gds"``.
    ``async_copy_threshold``: ``-1`` keeps the default, ``None`` keeps all copies inline.
    Usable as a context manager (``shutdown`` on exit)."""

    def __init__(
        self,
        *,
        backend: str = "auto",
        chunk_size: Optional[int] = None,
        buffered_chunk_size: Optional[int] = None,
        direct_chunk_size: Optional[int] = None,
        queue_depth: Optional[int] = None,
        iowq_workers: Optional[int] = None,
        page_cache_copies: Optional[int] = None,
        bounce_slots: Optional[int] = None,
        bounce_growth: Optional[int] = None,
        pool_wait_limit: Optional[float] = None,
        pread_threads: Optional[int] = None,
        async_copy_threshold: Optional[int] = -1,
        spdk_memory: bool = False,
        cufile_compat: bool = False,
        reactor_spin: Optional[float] = None,
        reactor_tick: Optional[float] = None,
        residency_aware: bool = True,
    ) -> None: ...
    def open(
        self,
        path: Union[str, os.PathLike[str]],
        direct: bool = False,
        write: bool = False,
        create: bool = False,
        truncate: bool = False,
    ) -> File: ...
    @property
    def backend(self) -> str: ...
    @property
    def backend_detail(self) -> str: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> Engine: ...
    def __exit__(self, *exc: Any) -> bool: ...

class File:
    """An open file on an engine. Sync calls release the GIL; ``a*`` forms are awaitables
    completing on the running asyncio loop, safe to cancel."""

    def read_into(self, dst: Memory, offset: int = 0, *, stream: Optional[Stream] = None) -> int: ...
    def aread_into(
        self, dst: Memory, offset: int = 0, *, stream: Optional[Stream] = None
    ) -> Awaitable[int]: ...
    def write_from(self, src: Memory, offset: int = 0, *, stream: Optional[Stream] = None) -> int: ...
    def awrite_from(
        self, src: Memory, offset: int = 0, *, stream: Optional[Stream] = None
    ) -> Awaitable[int]: ...
    def read_batch(
        self, descs: Sequence[Desc], dst: Memory, *, stream: Optional[Stream] = None
    ) -> list[int]: ...
    def aread_batch(
        self, descs: Sequence[Desc], dst: Memory, *, stream: Optional[Stream] = None
    ) -> Awaitable[list[int]]: ...
    def sync_all(self) -> None: ...
    def size(self) -> int: ...
    @property
    def path(self) -> pathlib.Path: ...
    @property
    def direct(self) -> bool: ...
    def gds_status(self) -> str: ...

#: ``(name, dtype, shape, start, end)``; dtype is safetensors' name ("F32", "BF16", ...).
TensorRow = tuple[str, str, list[int], int, int]

class SafetensorsFile:
    def tensors(self) -> list[TensorRow]: ...
    def metadata(self) -> dict[str, str]: ...
    def shards(self) -> list[str]: ...
    def plan(self, names: Optional[Sequence[str]] = None) -> LoadPlan: ...
    def plan_shards(self, ranks: int, rules: dict[str, object]) -> list[LoadPlan]: ...
    def plan_shards_read_once(
        self, ranks: int, rules: dict[str, object]
    ) -> tuple[list[LoadPlan], list[tuple[int, int, int, int, int]]]: ...

def read_plans(
    plans: Sequence[LoadPlan], dsts: Sequence[object], streams: Optional[Sequence[object]] = None
) -> list[int]: ...

class LoadPlan:
    @property
    def dst_len(self) -> int: ...
    @property
    def tensors(self) -> list[TensorRow]: ...
    def read_into(self, dst: Memory, *, stream: Optional[Stream] = None) -> int: ...
    def aread_into(self, dst: Memory, *, stream: Optional[Stream] = None) -> Awaitable[int]: ...

def open_safetensors(engine: Engine, path: Union[str, os.PathLike[str]]) -> SafetensorsFile: ...
