"""NIXL's Python agent API on gpuio's agents.

A program written against ``from nixl._api import nixl_agent, nixl_agent_config`` runs with
its import changed to ``from gpuio.agent import nixl_agent, nixl_agent_config``: the same
classes, method names, arguments and return values (``add_remote_agent`` returns the name as
bytes, ``transfer``/``check_xfer_state`` return ``"PROC"``/``"DONE"``, ``get_new_notifs`` a
dict of name to list of bytes, ...). What differs:

- Errors are ``gpuio`` exceptions (``gpuio.InvalidInput``, a ``ValueError``, for bad input:
  a descriptor outside every registration, an unknown peer, garbage metadata; ``gpuio.IoError``
  for a transfer that failed). Like NIXL's bindings, ``transfer`` and ``check_xfer_state``
  raise for a failed transfer rather than return ``"ERR"``. Where NIXL logs and returns
  ``None`` (a malformed descriptor list, a non-contiguous tensor) or raises ``KeyError`` (an
  unknown operation or memory type), gpuio raises ``gpuio.InvalidInput``. NIXL's exception
  classes live in its ``_bindings`` module, not in ``nixl._api``, so none are aliased here.
- Paths, not plugins: two agents in one process copy directly (``memcpy`` threads, or the CUDA
  driver where GPU memory is involved); peers in other processes are reached through UCX where
  it loads, GPU memory of another process on this host through CUDA IPC.
  ``query_xfer_backend`` names the path (``"MEMCPY"``, ``"CUDA"``, ``"CUDA_IPC"``, ``"UCX"``);
  ``backends=`` arguments are accepted and ignored.
- Metadata travels by hand (``get_agent_metadata`` to the peer's ``add_remote_agent``): there is
  no listener thread or metadata server (``send_local_metadata`` and ``fetch_remote_metadata``
  raise ``gpuio.Unsupported``). A loopback transfer (an agent to itself) is not offered: use a
  second agent.
- Memory types are ``DRAM`` and ``VRAM``. Descriptor lists are :class:`gpuio.agent.DescList`
  (registration and transfer lists alike; a 4th tuple element, NIXL's meta string, is dropped).
  Besides NIXL's inputs (tensors, lists of tensors, ``(addr, len, dev)`` tuples, Nx3 integer
  numpy arrays of descriptors with a ``mem_type``), any object with the buffer protocol,
  ``__cuda_array_interface__`` or DLPack (a numpy array of data, a bytearray, a cupy array) is
  taken as its memory.
- ``register_memory`` of objects (tensors, arrays) keeps them referenced until
  ``deregister_memory``; raw ``(addr, len, dev)`` ranges stay the caller's to keep valid.
  ``deregister_memory`` waits for transfers in flight that touch the memory.
- asyncio: ``await agent.atransfer(handle)`` posts and awaits a transfer, ``await
  agent.await_xfer(handle)`` awaits the last posting; ``agent.wait_xfer(handle)`` blocks with
  the GIL released. Each returns ``"DONE"`` or raises.

The native classes (:class:`Agent`, :class:`DescList`, :class:`Registration`,
:class:`XferRequest`, :class:`PreparedList`) are the library's API itself, for programs not
written for NIXL.
"""

from __future__ import annotations

import enum
import os
import sys
import threading
from typing import Any, Optional

from gpuio._errors import InvalidInput, Unsupported
from gpuio._native import (
    Agent,
    DescList,
    Engine,
    PreparedList,
    Registration,
    XferRequest,
    cuda_available,
)

__all__ = [
    "Agent",
    "DEFAULT_COMM_PORT",
    "DescList",
    "NIXL_INIT_AGENT",
    "PreparedList",
    "Registration",
    "XferRequest",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]

#: NIXL's default listener port (kept for signatures; gpuio has no listener).
DEFAULT_COMM_PORT = 8888
#: The agent name ``prep_xfer_dlist`` takes for the local side (as does ``""``).
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"

nixl_backend_handle = int

# The native paths in NIXL's backend vocabulary (upper case, as its plugin names).
_PATH_NAMES = {"memcpy": "MEMCPY", "cuda": "CUDA", "cuda-ipc": "CUDA_IPC", "process_vm": "CMA", "ucx": "UCX"}

# NIXL's storage memory types, which gpuio's agents do not move.
_STORAGE_MEMS = {"FILE", "BLOCK", "BLK", "OBJ"}

_engine_lock = threading.Lock()
_engine: Optional[tuple[int, Engine]] = None


def _default_engine() -> Engine:
    """The engine agents made here belong to: one per process (a forked child makes its own,
    an engine not surviving a fork). Agents use none of its bounce memory."""
    global _engine
    with _engine_lock:
        if _engine is None or _engine[0] != os.getpid():
            _engine = (os.getpid(), Engine(bounce_slots=4))
        return _engine[1]


def _name(x: Any, what: str = "agent name") -> str:
    """An agent name as str: NIXL hands names around as bytes (``add_remote_agent``)."""
    if isinstance(x, str):
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        try:
            return bytes(x).decode()
        except UnicodeDecodeError:
            raise InvalidInput(f"{what} {bytes(x)!r} is not UTF-8") from None
    raise TypeError(f"{what} must be str or bytes, not {type(x).__name__}")


def _msg(x: Any, what: str = "notif_msg") -> bytes:
    """A notification as bytes (NIXL takes str too)."""
    if x is None:
        return b""
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    raise TypeError(f"{what} must be bytes or str, not {type(x).__name__}")


def _mem(mem_type: Any) -> Optional[str]:
    if mem_type is None:
        return None
    m = str(mem_type)
    if m.upper() in _STORAGE_MEMS:
        raise Unsupported(
            f"memory type {m}: gpuio's agents move host (DRAM) and GPU (VRAM) memory; for "
            "files use gpuio.Engine"
        )
    return m


def _is_torch(obj: Any) -> bool:
    # Without importing torch: a tensor exists only where the program imported it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_ndarray(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def _is_desc_table(obj: Any, mem_type: Optional[str]) -> bool:
    """NIXL's Nx3 integer numpy array of ``(addr, len, dev)`` rows (with a memory type);
    any other array is memory."""
    return (
        mem_type is not None
        and _is_ndarray(obj)
        and obj.ndim == 2
        and obj.shape[1] == 3
        and obj.dtype.kind in "iu"
    )


def _torch_desc(t: Any) -> tuple[str, tuple[int, int, int]]:
    if not t.is_contiguous():
        raise InvalidInput(
            "a tensor of a descriptor list must be contiguous (pass t.contiguous())"
        )
    dev = t.get_device()
    return ("DRAM" if dev < 0 else "VRAM"), (t.data_ptr(), t.numel() * t.element_size(), max(dev, 0))


class nixl_thread_sync_t(enum.Enum):
    """NIXL's thread synchronisation modes (accepted; gpuio's agents are always thread-safe)."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


class nixl_agent_config:
    """NIXL's agent configuration. ``backends`` containing ``"UCX"`` lets the agent reach other
    processes through UCX where it loads (otherwise peers in this process only); the rest is
    accepted and ignored (gpuio's agents always have their progress thread, and no listener)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = 0,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ):
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.sync_mode = sync_mode


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (from ``prep_xfer_dlist``)."""

    __slots__ = ("_prepared", "_released")

    def __init__(self, prepared: PreparedList):
        self._prepared = prepared
        self._released = False

    @property
    def prepared(self) -> PreparedList:
        """The native prepared list."""
        if self._prepared is None:
            raise InvalidInput("this prepared descriptor list was released")
        return self._prepared

    def release(self) -> None:
        self._prepared = None
        self._released = True

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle({self._prepared!r}, released={self._released})"


class nixl_xfer_handle:
    """A transfer handle (from ``initialize_xfer`` or ``make_prepped_xfer``). Releasing it
    while a posting is in flight leaves that posting running to completion (its memory stays
    registered until then); nothing is cancelled."""

    __slots__ = ("_request", "_released", "_posted")

    def __init__(self, request: XferRequest):
        self._request = request
        self._released = False
        self._posted = False

    @property
    def request(self) -> XferRequest:
        """The native transfer request."""
        if self._request is None:
            raise InvalidInput("this transfer handle was released")
        return self._request

    def release(self) -> None:
        self._request = None
        self._released = True

    def __repr__(self) -> str:
        return f"nixl_xfer_handle({self._request!r}, released={self._released})"


class nixl_agent:
    """NIXL's agent (see the module's docs for what differs). ``engine``: the gpuio engine
    the agent belongs to (default: one shared by the agents of this process).

    The list defaults (``backends=[]``) are NIXL's signatures; they are never mutated."""

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Optional[nixl_agent_config] = None,
        instantiate_all: bool = False,
        *,
        engine: Optional[Engine] = None,
    ):
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        ucx = "auto" if instantiate_all or "UCX" in nixl_conf.backends else "off"
        self.name = _name(agent_name)
        self.agent = Agent(engine if engine is not None else _default_engine(), self.name, ucx=ucx)
        self.notifs: dict[str, list[bytes]] = {}
        # Registered ranges, by (memory type, addr, len, dev): the native registrations, which
        # hold the registered objects.
        self._regs: dict[tuple[str, int, int, int], Registration] = {}
        self._lock = threading.Lock()
        self._has_ucx = self.agent.transport.startswith("UCX")
        self.plugin_list = self._paths()
        self.backends: dict[str, int] = {b: i + 1 for i, b in enumerate(self.plugin_list)}

    # ---- paths in NIXL's plugin vocabulary

    def _paths(self) -> list[str]:
        paths = ["MEMCPY"]
        if cuda_available():
            paths.append("CUDA")
            if self._has_ucx:
                # Peer processes on this host are found through UCX's connection.
                paths.append("CUDA_IPC")
        if self._has_ucx:
            paths.insert(0, "UCX")
        return paths

    def _path_mems(self, backend: str) -> list[str]:
        if backend not in self.plugin_list:
            return []
        if backend == "MEMCPY":
            return ["DRAM"]
        if backend == "CUDA_IPC":
            return ["VRAM"]
        if backend == "UCX" and "no CUDA" in self.agent.transport:
            return ["DRAM"]
        return ["DRAM", "VRAM"]

    def get_plugin_list(self) -> list[str]:
        """The paths this agent can move data on: ``"UCX"`` (other processes, where UCX
        loaded), ``"MEMCPY"`` and ``"CUDA"`` (agents in this process), ``"CUDA_IPC"`` (GPU
        memory of other processes on this host)."""
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return self._path_mems(backend)

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return self._path_mems(backend)

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:
        """Nothing to create: the paths exist with the agent. Unknown names are refused."""
        if backend not in self.plugin_list:
            raise Unsupported(
                f"backend {backend!r}: this agent moves data on {', '.join(self.plugin_list)}"
            )

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The path that moves the transfer's bytes: ``"UCX"``, ``"MEMCPY"``, ``"CUDA"`` or
        ``"CUDA_IPC"``."""
        path = handle.request.path
        return _PATH_NAMES.get(path, path.upper())

    # ---- descriptor lists

    def _descs(self, descs: Any, mem_type: Optional[str], objects_ok: bool = True) -> Any:
        """``descs`` as a DescList, or (for ``register_memory``) a list of memory objects."""
        mem = _mem(mem_type)
        if isinstance(descs, DescList):
            return descs
        if _is_torch(descs):
            m, d = _torch_desc(descs)
            return DescList(m, [d])
        if _is_desc_table(descs, mem):
            return DescList(mem, descs.tolist())
        if isinstance(descs, (list, tuple)):
            if len(descs) == 0:
                raise InvalidInput("an empty descriptor list")
            if isinstance(descs[0], (tuple, list)):
                if mem is None:
                    raise InvalidInput(
                        "mem_type (\"DRAM\" or \"VRAM\") is needed with (addr, len, dev) tuples"
                    )
                return DescList(mem, descs)
            if all(_is_torch(t) for t in descs):
                rows = [_torch_desc(t) for t in descs]
                kinds = {m for m, _ in rows}
                if len(kinds) != 1:
                    raise InvalidInput("a list of tensors must be all on the CPU or all on GPUs")
                return DescList(kinds.pop(), [d for _, d in rows])
            # Memory objects of any kind (arrays, bytearrays, cupy arrays).
            lists = [self._descs(o, None) for o in descs]
            kinds = {dl.mem_type for dl in lists}
            if len(kinds) != 1:
                raise InvalidInput("a descriptor list takes host memory or GPU memory, not both")
            return DescList(kinds.pop(), [d for dl in lists for d in dl.descs])
        if isinstance(descs, (str, bytes, int)) or descs is None:
            raise TypeError(f"{type(descs).__name__} is not a descriptor list or memory")
        # Any other object is memory: its own range.
        return self.agent.describe(descs)

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False) -> DescList:
        """A transfer descriptor list from a DescList, a tensor, a list of tensors,
        ``(addr, len, dev)`` tuples or an Nx3 numpy array (both with ``mem_type``), or memory
        objects (arrays, bytearrays)."""
        return self._descs(descs, mem_type)

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None, is_sorted: bool = False) -> DescList:
        """A registration descriptor list: as :meth:`get_xfer_descs` (``(addr, len, dev,
        meta)`` tuples too; the meta string is dropped)."""
        return self._descs(descs, mem_type)

    def get_serialized_descs(self, descs: DescList) -> bytes:
        """The list as bytes for a peer (gpuio's versioned format)."""
        if not isinstance(descs, DescList):
            raise TypeError(f"serializing {type(descs).__name__}: want a DescList")
        return descs.serialize()

    def deserialize_descs(self, serialized_descs: bytes) -> DescList:
        """A list from :meth:`get_serialized_descs`'s bytes; anything else is
        ``gpuio.InvalidInput``."""
        return DescList.deserialize(bytes(serialized_descs))

    # ---- memory

    @staticmethod
    def _key(mem: str, d: tuple[int, int, int]) -> tuple[str, int, int, int]:
        # Host memory's device number means nothing (written as 0).
        return (mem, d[0], d[1], d[2] if mem == "VRAM" else 0)

    def register_memory(
        self,
        reg_list: Any,
        mem_type: Optional[str] = None,
        is_sorted: bool = False,
        backends: list[str] = [],
    ) -> DescList:
        """Registers memory and returns its registration descriptors (for
        :meth:`deregister_memory`). Objects (tensors, numpy arrays, bytearrays; alone or in a
        list) are kept referenced until deregistered; ``(addr, len, dev[, meta])`` tuples, an Nx3
        numpy array with ``mem_type`` or a DescList are raw ranges the caller keeps valid. All
        or nothing: on an error nothing stays registered."""
        mem = _mem(mem_type)
        raw = isinstance(reg_list, DescList) or _is_desc_table(reg_list, mem) or (
            isinstance(reg_list, (list, tuple))
            and len(reg_list) > 0
            and isinstance(reg_list[0], (tuple, list))
        )
        if raw:
            regs = self.agent.register_descs(self._descs(reg_list, mem))
        else:
            objs = list(reg_list) if isinstance(reg_list, (list, tuple)) else [reg_list]
            if not objs:
                raise InvalidInput("an empty registration list")
            regs = []
            try:
                for o in objs:
                    regs.append(self.agent.register(o))
                if len({r.mem_type for r in regs}) != 1:
                    raise InvalidInput(
                        "a registration list takes host memory or GPU memory, not both"
                    )
            except BaseException:
                for r in regs:
                    r.release()
                raise
        with self._lock:
            for r in regs:
                self._regs[self._key(r.mem_type, r.desc)] = r
        return DescList(regs[0].mem_type, [r.desc for r in regs])

    def deregister_memory(self, dereg_list: Any, backends: list[str] = []) -> None:
        """Deregisters what :meth:`register_memory` registered (its returned descriptors, or
        the same objects), waiting for transfers in flight that touch it (GIL released)."""
        descs = dereg_list if isinstance(dereg_list, DescList) else self._descs(dereg_list, None)
        keys = [self._key(descs.mem_type, d) for d in descs.descs]
        with self._lock:
            missing = [k for k in keys if k not in self._regs]
            if missing or len(set(keys)) != len(keys):
                bad = missing[0] if missing else keys[0]
                raise InvalidInput(
                    f"deregistering {bad[0]} {bad[2]} bytes at {bad[1]:#x}: agent "
                    f"{self.name!r} has no such registration (pass what register_memory returned)"
                )
            regs = [self._regs.pop(k) for k in keys]
        for r in regs:
            r.release()

    # ---- metadata and peers

    def get_agent_metadata(self) -> bytes:
        """What a peer passes to ``add_remote_agent``: this agent's address and its
        registrations live now (fetch it again after registering more)."""
        return self.agent.metadata()

    def get_partial_agent_metadata(self, descs: Any = None, inc_conn_info: bool = False, backends: list[str] = []) -> bytes:
        """The full metadata (a superset of any partial metadata)."""
        return self.agent.metadata()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a peer's metadata and returns its name (as bytes, as NIXL does)."""
        return self.agent.add_peer(bytes(metadata)).encode()

    def remove_remote_agent(self, agent: Any) -> None:
        """Forgets a peer: transfers already posted run on, its handles can no longer post."""
        self.agent.remove_peer(_name(agent))

    def check_remote_metadata(self, agent: Any, descs: Any = None) -> bool:
        """Whether the peer's metadata is loaded (and, with ``descs``, covers them)."""
        name = _name(agent)
        if name not in self.agent.peers():
            return False
        if descs is None:
            return True
        try:
            self.agent.prepare(name, self._descs(descs, None))
        except InvalidInput:
            return False
        return True

    def make_connection(self, remote_agent: Any, backends: list[str] = []) -> None:
        """Nothing to do beyond ``add_remote_agent`` (which connects); refuses unknown peers."""
        name = _name(remote_agent)
        if name not in self.agent.peers():
            raise InvalidInput(f"agent {self.name!r} knows no agent {name!r}: add_remote_agent first")

    def _no_listener(self, *args: Any, **kwargs: Any) -> None:
        raise Unsupported(
            "gpuio's agents have no listener thread or metadata server: pass "
            "get_agent_metadata()'s bytes to the peer's add_remote_agent yourself"
        )

    send_local_metadata = _no_listener
    send_partial_agent_metadata = _no_listener
    fetch_remote_metadata = _no_listener
    invalidate_local_metadata = _no_listener

    # ---- transfers

    def _peer(self, name: Any) -> str:
        name = _name(name)
        if name == self.name:
            raise Unsupported(
                f"a loopback transfer (agent {name!r} to itself) is not offered by gpuio's "
                "agents: register the memory with a second agent of this process"
            )
        return name

    def prep_xfer_dlist(
        self,
        agent_name: Any,
        xfer_list: Any,
        mem_type: Optional[str] = None,
        is_sorted: bool = False,
        backends: list[str] = [],
    ) -> nixl_prepped_dlist_handle:
        """Checks a descriptor list once for transfers by index: ``agent_name`` ``""`` or
        ``"NIXL_INIT_AGENT"`` for this agent's memory, else a peer's name."""
        descs = self._descs(xfer_list, mem_type)
        name = _name(agent_name)
        peer = None if name in ("", NIXL_INIT_AGENT) else self._peer(name)
        return nixl_prepped_dlist_handle(self.agent.prepare(peer, descs))

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Any,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Any,
        notif_msg: Any = b"",
        backends: list[str] = [],
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A transfer between entries of two prepared lists (the i-th local index with the
        i-th remote one); ``operation`` ``"READ"`` or ``"WRITE"``."""
        li = local_indices.tolist() if _is_ndarray(local_indices) else list(local_indices)
        ri = remote_indices.tolist() if _is_ndarray(remote_indices) else list(remote_indices)
        msg = _msg(notif_msg)
        req = self.agent.request_prepared(
            operation,
            local_xfer_side.prepared,
            li,
            remote_xfer_side.prepared,
            ri,
            msg or None,
        )
        return nixl_xfer_handle(req)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: Any,
        notif_msg: Any = b"",
        backends: list[str] = [],
    ) -> nixl_xfer_handle:
        """A transfer between ``local_descs`` (this agent's registered memory) and
        ``remote_descs`` (the peer's): ``"READ"`` (remote to local) or ``"WRITE"``.
        ``notif_msg`` reaches the peer after each posting's data landed."""
        local = self._descs(local_descs, None)
        remote = self._descs(remote_descs, None)
        msg = _msg(notif_msg)
        req = self.agent.request(operation, local, self._peer(remote_agent), remote, msg or None)
        return nixl_xfer_handle(req)

    def _state(self, req: XferRequest) -> str:
        state = req.status()
        if state == "ERR":
            req.wait()  # raises the transfer's error
        return state

    def _post(self, handle: nixl_xfer_handle, notif_msg: Any) -> XferRequest:
        req = handle.request
        if handle._posted and req.status() == "PROC":
            raise InvalidInput(
                "the transfer is still in progress from its last posting: wait for DONE "
                "before posting it again"
            )
        msg = _msg(notif_msg)
        if msg:
            req.set_notification(msg)
        req.post()
        handle._posted = True
        return req

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
        """Posts the transfer: ``"DONE"`` if it already finished, else ``"PROC"``. A non-empty
        ``notif_msg`` replaces the handle's notification. Raises if it failed."""
        return self._state(self._post(handle, notif_msg))

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """``"PROC"`` or ``"DONE"``; raises the transfer's error if it failed."""
        return self._state(handle.request)

    def wait_xfer(self, handle: nixl_xfer_handle) -> str:
        """Blocks (GIL released) until the last posting finished: ``"DONE"``, or raises."""
        handle.request.wait()
        return "DONE"

    async def atransfer(self, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
        """Posts the transfer and awaits it on the running asyncio loop: ``"DONE"``, or
        raises. Cancelling the await leaves the transfer running."""
        await self._post(handle, notif_msg).wait_async()
        return "DONE"

    async def await_xfer(self, handle: nixl_xfer_handle) -> str:
        """Awaits the last posting of ``handle``: ``"DONE"``, or raises."""
        await handle.request.wait_async()
        return "DONE"

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    # ---- notifications

    def _take(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for name, msg in self.agent.take_notifications():
            out.setdefault(name, []).append(msg)
        return out

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        """Notifications received since the last call (or ``update_notifs`` /
        ``check_remote_xfer_done``, which take them too), by sender."""
        return self._take()

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        """Adds the new notifications to ``self.notifs`` and returns it."""
        for name, msgs in self._take().items():
            self.notifs.setdefault(name, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: Any,
        lookup_tag: Any,
        backends: list[str] = [],
        tag_is_prefix: bool = True,
    ) -> bool:
        """Whether a notification from the peer starts with ``lookup_tag`` (contains it, with
        ``tag_is_prefix=False``); the one found is removed from ``self.notifs``."""
        self.update_notifs()
        tag = _msg(lookup_tag, "lookup_tag")
        msgs = self.notifs.get(_name(remote_agent_name), [])
        for i, m in enumerate(msgs):
            if m.startswith(tag) if tag_is_prefix else tag in m:
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: Any, notif_msg: Any, backend: Optional[str] = None) -> None:
        """Sends a notification on its own, not bound to a transfer."""
        self.agent.send_notification(_name(remote_agent_name), _msg(notif_msg))
