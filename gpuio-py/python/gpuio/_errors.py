"""gpuio's exception hierarchy.

Every error the library reports is a :class:`Error`; each also derives from the standard
exception that fits, so ``except OSError`` or ``except ValueError`` keep working. The
attributes ``op``, ``path``, ``offset``, ``backend`` and ``peer`` (the other agent of an agent
operation) say what failed where (``None`` where the library had no such detail); the message
carries them too.
"""


class Error(Exception):
    """Base class of every gpuio error."""

    op = None
    path = None
    offset = None
    backend = None
    peer = None


class IoError(Error, OSError):
    """The operating system (or io_uring, or a device) reported an error; ``errno`` is set."""


class InvalidInput(Error, ValueError):
    """The request is invalid: a range past the largest file offset, a file opened without
    the access the operation needs, a read-only or non-contiguous destination, a bad setting."""


class UnexpectedEof(Error, EOFError):
    """A read that needed every byte reached the end of the file first."""


class Unsupported(Error):
    """The machine, the file or the build does not offer what was asked for (no CUDA, no
    cuFile for this file, ...); the message says why."""


class ShutDown(Error):
    """The engine was shut down before or while the operation ran."""


class CudaError(Error):
    """A CUDA driver call failed."""


class PoolExhausted(Error, MemoryError):
    """No bounce memory came free: operations that stopped being awaited hold all of it."""


class ReactorDied(Error):
    """The engine's reactor thread died; open a new engine."""
