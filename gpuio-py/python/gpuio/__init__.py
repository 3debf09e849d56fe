"""gpuio: async storage I/O into GPU and host memory.

    import gpuio
    engine = gpuio.Engine()                   # io_uring, or the pread pool
    f = engine.open("weights.bin")
    buf = bytearray(f.size())
    n = f.read_into(buf)                      # GIL released meanwhile
    n = await f.aread_into(tensor, 0)         # asyncio; torch/cupy tensors on their stream

Destinations and sources: the buffer protocol (numpy, bytearray, memoryview) for host memory;
``__cuda_array_interface__`` and DLPack (torch, cupy) for device memory.
``gpuio.safetensors.torch`` and ``gpuio.safetensors.numpy`` mirror the safetensors package's
modules. ``gpuio.agent`` moves memory between agents (processes, hosts) with NIXL's Python
API. ``print(gpuio.check())`` says what this machine offers (as ``gpuio check``). Errors are ``gpuio.Error`` subclasses (see ``gpuio._errors``).
"""

from gpuio._errors import (
    CudaError,
    Error,
    InvalidInput,
    IoError,
    PoolExhausted,
    ReactorDied,
    ShutDown,
    UnexpectedEof,
    Unsupported,
)
from gpuio._native import CheckReport, Engine, File, __version__, check, cuda_available

import atexit as _atexit

from gpuio._native import _at_exit

# From interpreter exit on, only the exiting thread re-enters Python from gpuio: a daemon
# thread still inside a gpuio call parks instead of taking the GIL during finalization, which
# CPython answers with pthread_exit (an abort through the extension's frames).
_atexit.register(_at_exit)
del _atexit

__all__ = [
    "CheckReport",
    "CudaError",
    "Engine",
    "Error",
    "File",
    "InvalidInput",
    "IoError",
    "PoolExhausted",
    "ReactorDied",
    "ShutDown",
    "UnexpectedEof",
    "Unsupported",
    "__version__",
    "check",
    "cuda_available",
]
