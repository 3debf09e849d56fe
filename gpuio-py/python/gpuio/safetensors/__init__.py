"""Drop-ins for the safetensors package's loaders, reading through gpuio.

    from gpuio.safetensors.torch import load_file    # was: from safetensors.torch import load_file
    tensors = load_file("model.safetensors", device="cuda:0")

    from gpuio.safetensors.numpy import load_file    # was: from safetensors.numpy import load_file

    from gpuio.safetensors import safe_open          # lazy: only the tensors asked for
    with safe_open("model.safetensors", framework="pt", device="cuda:0") as f:
        w = f.get_tensor("lm_head.weight")

The header is parsed and checked by the library (``gpuio::safetensors``), which plans one
batch read of the selected tensors into one buffer (tensors packed in file order, neighbours
merged into one read); this package allocates that buffer (torch or numpy) and returns views
of it. The returned tensors therefore share one allocation: it is freed when the last of them
is. They do not overlap, so ``safetensors.torch.save_file`` accepts them as they are.
"""

import os
import threading

import gpuio

_ENGINE = None
_ENGINE_LOCK = threading.Lock()


def default_engine():
    """The engine the loaders use when none is given (one per process, made on first use; a
    child made by ``fork()`` makes its own, since an engine does not survive a fork)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = gpuio.Engine()
        return _ENGINE


def _forget_engine_in_child():
    # The parent's engine is unusable here (its reactor thread did not survive the fork, and
    # every call on it fails with gpuio.Unsupported): the child's first load makes its own.
    # The lock may have been held by another thread of the parent at the fork.
    global _ENGINE, _ENGINE_LOCK
    _ENGINE = None
    _ENGINE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_engine_in_child)


class Checkpoint:
    """An open ``.safetensors`` file, or a model directory or index file of several shards
    loaded as one: its header(s), and loads of any subset of its tensors into memory a
    framework allocates (``alloc(nbytes)`` returns a 1-D uint8 buffer)."""

    def __init__(self, filename, engine=None):
        self.engine = engine if engine is not None else default_engine()
        self._file = gpuio._native.open_safetensors(self.engine, os.fspath(filename))
        self._listed = {row[0]: row for row in self._file.tensors()}

    def keys(self):
        """Tensor names, in file order."""
        return list(self._listed)

    def shards(self):
        """The shard files, in the order their tensors are listed (one for a single file)."""
        return [os.fspath(p) for p in self._file.shards()]

    def metadata(self):
        """The header's ``__metadata__`` strings (``None`` when it has none, as safetensors)."""
        return self._file.metadata() or None

    def listing(self, name):
        """``(name, dtype, shape, file_start, file_end)`` of tensor ``name``."""
        try:
            return self._listed[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the checkpoint") from None

    def load(self, names, alloc, build, stream=None, sync=None, progress=None, host=None):
        """Reads ``names`` (all where ``None``) into one buffer from ``alloc`` and returns
        ``{name: build(buffer, name, dtype, shape, start, end)}`` in file order; ``sync``
        (if given) runs after the read, before the tensors are built; ``progress(done,
        total)`` (bytes; if given) is called about every 100 ms and at the end. With ``host``
        (host memory), the load allocates the buffer itself and reads into it in place
        (``LoadPlan.read_host``), and ``host(HostBuffer)`` wraps it instead of ``alloc``."""
        if names is not None:
            names = list(names)
            for n in names:
                self.listing(n)
        plan = self._file.plan(names)
        if host is not None:
            buf = host(plan.read_host(progress=progress))
        else:
            buf = alloc(plan.dst_len)
            plan.read_into(buf, stream=stream, progress=progress)
        if sync is not None:
            sync()
        return {n: build(buf, n, dtype, shape, s, e) for n, dtype, shape, s, e in plan.tensors}


    def shard_rules(self, rule):
        """``{name: rule}`` for ``plan_shards`` from ``rule``: a dict of tensor names to
        ``"replicate"``, ``("split", dim)`` or ``("only", rank)``, or a callable
        ``rule(name, shape)`` returning one of those or ``None`` (not loaded)."""
        if callable(rule):
            out = {}
            for name, row in self._listed.items():
                r = rule(name, tuple(row[2]))
                if r is not None:
                    out[name] = r
            return out
        for n in rule:
            self.listing(n)
        return dict(rule)

    def load_shards(
        self, rule, ranks, alloc, build, streams=None, sync=None, copy=None, progress=None,
        host=None,
    ):
        """Tensor-parallel load: each rank's shards (see ``shard_rules``) into one buffer
        from ``alloc(rank, nbytes)``; returns one ``{name: build(...)}`` per rank. Every
        byte of a split tensor is read once, by the rank it belongs to. ``streams[rank]``
        orders device copies; ``sync(rank)`` (if given) runs after the reads. With ``copy``,
        each replicated tensor is read by one rank only and ``copy(dst, dst_start, src,
        src_start, src_end)`` (buffers, byte offsets) brings it to the others after the reads,
        before ``sync``. With ``host`` (every rank in host memory), each rank's load
        allocates its buffer and reads into it in place, and ``host(HostBuffer)`` wraps it
        instead of ``alloc``."""
        rules = self.shard_rules(rule)
        if copy is None:
            plans, copies = self._file.plan_shards(ranks, rules), []
        else:
            plans, copies = self._file.plan_shards_read_once(ranks, rules)
        # Every rank at once, one wait for all of them.
        if host is not None:
            bufs = [host(b) for b in gpuio._native.read_plans_host(plans, progress)]
        else:
            bufs = [alloc(rank, plan.dst_len) for rank, plan in enumerate(plans)]
            gpuio._native.read_plans(plans, bufs, streams, progress)
        for src, s, e, dst, d in copies:
            copy(bufs[dst], d, bufs[src], s, e)
        if sync is not None:
            for rank in range(ranks):
                sync(rank)
        return [
            {n: build(buf, n, dtype, shape, s, e) for n, dtype, shape, s, e in plan.tensors}
            for buf, plan in zip(bufs, plans)
        ]


class safe_open:
    """Like ``safetensors.safe_open``: ``framework`` is ``"pt"``/``"torch"`` or
    ``"np"``/``"numpy"``; ``device`` applies to torch. Tensors are read when asked for
    (``get_tensor``, or ``get_tensors`` for several in one batch read)."""

    def __init__(self, filename, framework="pt", device="cpu", *, engine=None):
        if framework in ("pt", "torch", "pytorch"):
            from gpuio.safetensors import torch as frontend

            self._load = lambda ck, names: frontend._load(ck, names, device)
        elif framework in ("np", "numpy"):
            from gpuio.safetensors import numpy as frontend

            self._load = frontend._load
        else:
            raise ValueError(f"framework {framework!r}: use 'pt' (torch) or 'np' (numpy)")
        self._checkpoint = Checkpoint(filename, engine)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return self._checkpoint.keys()

    def metadata(self):
        return self._checkpoint.metadata()

    def get_tensor(self, name):
        return self._load(self._checkpoint, [name])[name]

    def get_tensors(self, names=None):
        """The tensors named (all where ``None``), read together in one batch."""
        return self._load(self._checkpoint, names)


__all__ = ["Checkpoint", "default_engine", "safe_open"]
