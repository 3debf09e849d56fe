//! Agents for Python: the library's `gpuio::agent` (NIXL's model: registrations, peers loaded
//! from metadata, READ/WRITE transfers between descriptor lists, notifications) as native
//! classes. `gpuio.agent` (python/gpuio/agent.py) builds NIXL's Python API on them.
//!
//! Memory: a registered Python object (numpy array, bytearray, torch or cupy tensor) is
//! extracted as the other operations' memory is (`memory::extract`) and kept, with what keeps
//! it exported or alive, in the [`Registration`] until the library has deregistered it, which
//! waits for every transfer touching it. Raw `(addr, len, dev)` registrations are the caller's
//! to keep valid, as in NIXL and the C API.
//!
//! Waiting: blocking calls release the GIL; a transfer's result is awaitable on asyncio
//! through the binding's pool (`runner::spawn`). One posting may be waited for by several
//! callers at once (a thread in `wait`, tasks awaiting it, `status` polls): the library's
//! [`Transfer`](gpuio::agent::Transfer) future wakes one waiter, so it is wrapped in a
//! `Shared` future that wakes them all.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt, Shared};
use gpuio::RawDeviceSlice;
use gpuio::agent::{
    Agent as LibAgent, AgentConfig, AgentMemory, Desc, DescList as LibDescList, MemType,
    PreparedList as LibPreparedList, RawMemory, Registration as LibRegistration, UcxMode, XferOp,
    XferPath, XferRequest as LibXferRequest,
};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PySequence};

use crate::errors::{int_arg, invalid, to_py, to_py_ref};
use crate::exit;
use crate::file::Engine;
use crate::memory::{Access, Memory, extract};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn mem_type(py: Python<'_>, s: &str) -> PyResult<MemType> {
    s.parse().map_err(|e: String| invalid(py, e))
}

fn xfer_op(py: Python<'_>, s: &str) -> PyResult<XferOp> {
    s.parse().map_err(|e: String| invalid(py, e))
}

fn indices(py: Python<'_>, side: &str, v: Vec<i128>) -> PyResult<Vec<usize>> {
    v.into_iter()
        .map(|i| int_arg(py, &format!("{side} index"), i))
        .collect()
}

/// A list of ranges of one memory type (NIXL's descriptor lists): ``DescList("DRAM", [(addr,
/// len, dev), ...])``. Rows may be any sequences of three integers (tuples, lists, rows of an
/// Nx3 numpy array); a fourth element (NIXL's registration meta string) is accepted and
/// dropped. Compares equal by memory type and ranges; pickles through
/// :meth:`serialize`.
#[pyclass(frozen, eq, module = "gpuio._native", name = "DescList")]
#[derive(PartialEq)]
pub struct DescList {
    pub(crate) inner: LibDescList,
}

impl DescList {
    fn from_rows(py: Python<'_>, mem: MemType, rows: &Bound<'_, PyAny>) -> PyResult<DescList> {
        let mut descs = Vec::new();
        for (i, row) in rows.try_iter()?.enumerate() {
            let row = row?;
            let seq = row.cast::<PySequence>().map_err(|_| {
                invalid(
                    py,
                    format!("descriptor {i}: want an (addr, len, dev) tuple, not {row}"),
                )
            })?;
            let n = seq.len()?;
            if n != 3 && n != 4 {
                return Err(invalid(
                    py,
                    format!(
                        "descriptor {i}: want (addr, len, dev) or (addr, len, dev, meta), \
                         not {n} elements"
                    ),
                ));
            }
            let field = |k: usize, name: &str| -> PyResult<i128> {
                seq.get_item(k)?
                    .extract::<i128>()
                    .map_err(|_| invalid(py, format!("descriptor {i}: {name} must be an integer")))
            };
            descs.push(Desc::new(
                int_arg(py, &format!("descriptor {i}: addr"), field(0, "addr")?)?,
                int_arg(py, &format!("descriptor {i}: len"), field(1, "len")?)?,
                int_arg(py, &format!("descriptor {i}: dev"), field(2, "dev")?)?,
            ));
        }
        Ok(DescList {
            inner: LibDescList::new(mem, descs),
        })
    }
}

#[pymethods]
impl DescList {
    #[new]
    fn new(py: Python<'_>, mem_type: &str, descs: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mem = self::mem_type(py, mem_type)?;
        DescList::from_rows(py, mem, descs)
    }

    /// ``"DRAM"`` (host memory) or ``"VRAM"`` (GPU memory).
    #[getter]
    fn mem_type(&self) -> String {
        self.inner.mem.to_string()
    }

    /// The ranges as ``(addr, len, dev)`` tuples.
    #[getter]
    fn descs(&self) -> Vec<(u64, u64, u32)> {
        self.inner
            .descs
            .iter()
            .map(|d| (d.addr, d.len, d.dev))
            .collect()
    }

    /// Bytes the list covers.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.inner.total_bytes()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __getitem__(&self, i: isize) -> PyResult<(u64, u64, u32)> {
        let n = self.inner.len() as isize;
        let at = if i < 0 { i + n } else { i };
        if !(0..n).contains(&at) {
            return Err(PyIndexError::new_err(format!(
                "descriptor {i} of a list of {n}"
            )));
        }
        let d = self.inner.descs[at as usize];
        Ok((d.addr, d.len, d.dev))
    }

    /// The list as bytes for a peer (the library's versioned format).
    fn serialize<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.serialize())
    }

    /// A list from :meth:`serialize`'s bytes; anything else is ``gpuio.InvalidInput``.
    #[staticmethod]
    fn deserialize(data: &[u8]) -> PyResult<DescList> {
        LibDescList::deserialize(data)
            .map(|inner| DescList { inner })
            .map_err(to_py)
    }

    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let cls = py.get_type::<DescList>().getattr("deserialize")?;
        Ok((cls, (self.serialize(py),)))
    }

    /// NIXL's name for ``len()``.
    #[pyo3(name = "descCount")]
    fn desc_count(&self) -> usize {
        self.inner.len()
    }

    /// NIXL's emptiness test.
    #[pyo3(name = "isEmpty")]
    fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// NIXL's registration list to transfer list: the same ranges (gpuio's lists carry no
    /// meta strings).
    fn trim(&self) -> DescList {
        DescList {
            inner: self.inner.clone(),
        }
    }

    fn __repr__(&self) -> String {
        let shown: Vec<String> = self
            .inner
            .descs
            .iter()
            .take(8)
            .map(|d| format!("({:#x}, {}, {})", d.addr, d.len, d.dev))
            .collect();
        let more = if self.inner.len() > 8 {
            format!(", ... {} more", self.inner.len() - 8)
        } else {
            String::new()
        };
        format!(
            "DescList({:?}, [{}{more}])",
            self.inner.mem.to_string(),
            shown.join(", ")
        )
    }
}

/// A descriptor list checked once against an agent's registrations (its own, or a peer's),
/// for transfers that pick entries by index (NIXL's prepared list handle).
#[pyclass(frozen, module = "gpuio._native", name = "PreparedList")]
pub struct PreparedList {
    inner: LibPreparedList,
    peer: Option<String>,
    mem: MemType,
}

#[pymethods]
impl PreparedList {
    /// The peer whose memory it describes; ``None`` for the agent's own.
    #[getter]
    fn peer(&self) -> Option<String> {
        self.peer.clone()
    }

    #[getter]
    fn mem_type(&self) -> String {
        self.mem.to_string()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "PreparedList({} {} descriptors of {})",
            self.inner.len(),
            self.mem,
            self.peer.as_deref().unwrap_or("this agent")
        )
    }
}

/// What a live registration holds: the library's registration, then the Python memory it
/// covers (released only after the library gave the range back).
struct Held {
    reg: LibRegistration<RawMemory>,
    keep: Option<Memory>,
}

impl Held {
    /// Deregisters, waiting (without the GIL) for every transfer that touches the memory,
    /// then lets the Python object go.
    fn release(self, py: Python<'_>) {
        let Held { reg, keep } = self;
        exit::detach(py, move || {
            reg.release_blocking();
        });
        drop(keep);
    }
}

/// Memory registered with an agent. :meth:`release` deregisters it once no transfer touches
/// it; until then the registered object is kept alive (and a ``bytearray`` cannot resize).
/// Dropping an unreleased registration releases it, waiting as :meth:`release` does.
#[pyclass(frozen, module = "gpuio._native", name = "Registration")]
pub struct Registration {
    held: Mutex<Option<Held>>,
    mem: MemType,
    desc: Desc,
    id: u64,
}

impl Registration {
    fn new(
        py: Python<'_>,
        agent: &LibAgent,
        raw: RawMemory,
        keep: Option<Memory>,
    ) -> PyResult<Self> {
        let (mem, desc) = (raw.mem_type(), raw.desc());
        let agent = agent.clone();
        // Detached: with UCX, registering maps (pins) the memory, which takes a while for a
        // large range.
        let reg = exit::detach(py, move || agent.register(raw)).map_err(to_py)?;
        Ok(Registration {
            id: reg.id(),
            held: Mutex::new(Some(Held { reg, keep })),
            mem,
            desc,
        })
    }
}

#[pymethods]
impl Registration {
    /// The registered range as a one-descriptor :class:`DescList`.
    #[getter]
    fn descs(&self) -> DescList {
        DescList {
            inner: LibDescList::new(self.mem, vec![self.desc]),
        }
    }

    /// ``(addr, len, dev)``.
    #[getter]
    fn desc(&self) -> (u64, u64, u32) {
        (self.desc.addr, self.desc.len, self.desc.dev)
    }

    #[getter]
    fn mem_type(&self) -> String {
        self.mem.to_string()
    }

    /// The registration's number, unique within its agent.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Whether :meth:`release` ran.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.held).is_none()
    }

    /// Deregisters: new transfers can no longer use the memory, transfers in flight that touch
    /// it are waited for (GIL released), then the memory is given back. A second call does
    /// nothing.
    fn release(&self, py: Python<'_>) {
        let held = lock(&self.held).take();
        if let Some(h) = held {
            h.release(py);
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Registration({}, {} {} bytes at {:#x}, dev {}{})",
            self.id,
            self.mem,
            self.desc.len,
            self.desc.addr,
            self.desc.dev,
            if self.released() { ", released" } else { "" }
        )
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let held = self
            .held
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = held {
            // Dropped unreleased (garbage collected): the memory may still be the target of a
            // transfer, so this waits as `release` does, without the GIL.
            Python::attach(|py| h.release(py));
        }
    }
}

/// A posting's result, awaitable by several waiters at once.
type Done = Shared<BoxFuture<'static, Result<(), Arc<gpuio::Error>>>>;

/// A checked transfer (NIXL's transfer handle): :meth:`post` starts it (again), :meth:`status`
/// and :meth:`wait` / ``await wait_async()`` follow the last posting.
#[pyclass(frozen, module = "gpuio._native", name = "XferRequest")]
pub struct XferRequest {
    req: Mutex<LibXferRequest>,
    last: Mutex<Option<Done>>,
    path: XferPath,
    bytes: u64,
    descs: usize,
    peer: String,
}

impl XferRequest {
    fn new(req: LibXferRequest) -> XferRequest {
        XferRequest {
            path: req.path(),
            bytes: req.bytes(),
            descs: req.descs(),
            peer: req.peer().to_string(),
            req: Mutex::new(req),
            last: Mutex::new(None),
        }
    }

    fn posted(&self, py: Python<'_>) -> PyResult<Done> {
        lock(&self.last)
            .clone()
            .ok_or_else(|| invalid(py, "the transfer has not been posted"))
    }
}

#[pymethods]
impl XferRequest {
    /// Starts the transfer (again). It runs to completion whatever happens to this handle;
    /// the memory it touches stays registered until then. Fails if the peer was removed or
    /// reloaded, or a registration it uses was released, since the request was made.
    fn post(&self, py: Python<'_>) -> PyResult<()> {
        // The lock is taken without the GIL and released before re-attaching, so a thread
        // holding the GIL never waits for it while this one waits for the GIL.
        let t = exit::detach(py, || lock(&self.req).post()).map_err(to_py)?;
        let done: Done = t.map(|r| r.map_err(Arc::new)).boxed().shared();
        *lock(&self.last) = Some(done);
        Ok(())
    }

    /// The last posting: ``"PROC"`` (in progress), ``"DONE"`` or ``"ERR"`` (:meth:`wait`
    /// raises its error). ``gpuio.InvalidInput`` before the first :meth:`post`.
    fn status(&self, py: Python<'_>) -> PyResult<&'static str> {
        let done = self.posted(py)?;
        let out = match done.peek() {
            Some(r) => Some(r.clone()),
            // Polls once (cheap: the library's future only reads its state); the shared
            // future keeps the wakers of other waiters.
            None => done.now_or_never(),
        };
        Ok(match out {
            None => "PROC",
            Some(Ok(())) => "DONE",
            Some(Err(_)) => "ERR",
        })
    }

    /// Waits for the last posting to finish (GIL released) and raises its error, if any.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let done = self.posted(py)?;
        crate::runner::block(py, done).map_err(|e| to_py_ref(&e))
    }

    /// An awaitable of the last posting's end (``None``, or its error raised). Cancelling the
    /// await leaves the transfer running.
    fn wait_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let done = self.posted(py)?;
        crate::runner::spawn(py, done)
    }

    /// Replaces the notification later postings carry (``None``: none).
    #[pyo3(signature = (msg))]
    fn set_notification(&self, py: Python<'_>, msg: Option<&[u8]>) {
        let msg = msg.map(<[u8]>::to_vec);
        exit::detach(py, || lock(&self.req).set_notification(msg.as_deref()));
    }

    /// The path that moves the bytes: ``"memcpy"`` or ``"cuda"`` (both agents in this
    /// process; host copies, or the CUDA driver's where device memory is involved),
    /// ``"cuda-ipc"`` (GPU memory of a peer process on this host) or ``"ucx"`` (a peer in
    /// another process or host).
    #[getter]
    fn path(&self) -> &'static str {
        self.path.backend()
    }

    /// The path in words.
    #[getter]
    fn path_description(&self) -> String {
        self.path.to_string()
    }

    /// Bytes one posting moves.
    #[getter]
    fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Descriptor pairs one posting moves.
    #[getter]
    fn descs(&self) -> usize {
        self.descs
    }

    /// The peer agent's name.
    #[getter]
    fn peer(&self) -> String {
        self.peer.clone()
    }

    fn __repr__(&self) -> String {
        format!(
            "XferRequest({} descriptors, {} bytes with {:?} via {})",
            self.descs,
            self.bytes,
            self.peer,
            self.path.backend()
        )
    }
}

/// An agent: registrations, peers, transfers and notifications. ``ucx``: ``"auto"`` (reach
/// other processes through UCX where it loads), ``"off"`` (peers in this process only) or
/// ``"required"`` (fail where UCX is missing). ``same_host_ipc``: GPU memory of a peer process
/// on this host is copied directly through CUDA IPC (default) rather than through UCX.
#[pyclass(frozen, module = "gpuio._native", name = "Agent")]
pub struct Agent {
    /// Dropped without the GIL (`Drop`): the last handle stops the UCX progress thread.
    inner: ManuallyDrop<LibAgent>,
    engine: gpuio::Engine,
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and never used again.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        Python::attach(|py| exit::detach(py, move || drop(inner)));
    }
}

impl Agent {
    fn agent(&self) -> &LibAgent {
        &self.inner
    }
}

fn name_and_msg<'py>(py: Python<'py>, from: String, msg: &[u8]) -> (String, Bound<'py, PyBytes>) {
    (from, PyBytes::new(py, msg))
}

#[pymethods]
impl Agent {
    #[new]
    #[pyo3(signature = (engine, name, ucx = "auto", same_host_ipc = true))]
    fn new(
        py: Python<'_>,
        engine: PyRef<'_, Engine>,
        name: &str,
        ucx: &str,
        same_host_ipc: bool,
    ) -> PyResult<Self> {
        let mode = match ucx.to_ascii_lowercase().as_str() {
            "auto" => UcxMode::Auto,
            "off" => UcxMode::Off,
            "required" => UcxMode::Required,
            other => {
                return Err(invalid(
                    py,
                    format!("ucx={other:?}: want \"auto\", \"off\" or \"required\""),
                ));
            }
        };
        let engine = engine.inner.clone();
        let e = engine.clone();
        let name = name.to_string();
        // Detached: starting UCX loads the library and its progress thread.
        let inner = exit::detach(py, move || {
            // Settings the library adds later keep their defaults.
            #[allow(clippy::needless_update)]
            let config = AgentConfig {
                ucx: mode,
                same_host_ipc,
                ..AgentConfig::default()
            };
            LibAgent::with_config(&e, &name, config)
        })
        .map_err(to_py)?;
        Ok(Agent {
            inner: ManuallyDrop::new(inner),
            engine,
        })
    }

    #[getter]
    fn name(&self) -> String {
        self.agent().name().to_string()
    }

    /// The transport that reaches other processes, in words, or why there is none.
    #[getter]
    fn transport(&self) -> String {
        self.agent().transport()
    }

    /// What a peer passes to :meth:`add_peer`: the agent's address and live registrations
    /// (fetch it again after registering more).
    fn metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.agent().metadata())
    }

    /// Loads a peer's metadata (again: replaces what was loaded) and returns its name.
    /// Garbage, this agent's own metadata, or metadata of an agent of this process that no
    /// longer exists is ``gpuio.InvalidInput``.
    fn add_peer(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<String> {
        let agent = self.agent().clone();
        let metadata = metadata.to_vec();
        // Detached: connecting to a peer in another process waits for UCX.
        exit::detach(py, move || agent.add_peer(&metadata)).map_err(to_py)
    }

    /// Forgets a peer; transfers already posted to it run on, new ones fail.
    fn remove_peer(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let agent = self.agent().clone();
        let name = name.to_string();
        exit::detach(py, move || agent.remove_peer(&name)).map_err(to_py)
    }

    /// The names of the peers loaded, sorted.
    fn peers(&self) -> Vec<String> {
        self.agent().peers()
    }

    /// Registers a Python object's memory: host memory through the buffer protocol (numpy,
    /// bytearray) or DLPack (CPU torch tensors), GPU memory through
    /// ``__cuda_array_interface__`` or DLPack (torch, cupy). It must be writable and
    /// C-contiguous (peers may write it). The object is kept until the registration is
    /// released.
    fn register(&self, py: Python<'_>, memory: &Bound<'_, PyAny>) -> PyResult<Registration> {
        let m = extract(&self.engine, memory, None, Access::Dst)?;
        let (mem, desc) = match &m {
            Memory::Host(h) => {
                let (addr, len) = h.range();
                (MemType::Host, Desc::new(addr, len as u64, 0))
            }
            Memory::Device(d) => (
                MemType::Device,
                Desc::new(
                    d.slice.ptr(),
                    d.slice.len() as u64,
                    d.slice.ordinal() as u32,
                ),
            ),
        };
        // SAFETY: `m` holds what keeps the range valid (the buffer export, the tensor or its
        // DLPack capsule), and the registration keeps `m` until the library has deregistered
        // the range (`Held::release`: `reg.release_blocking()` returns before `keep` drops),
        // which happens only once no transfer touches it.
        let raw = unsafe { RawMemory::new(mem, desc) };
        Registration::new(py, self.agent(), raw, Some(m))
    }

    /// Registers raw ranges, one registration each (NIXL's ``(addr, len, dev)`` lists). The
    /// caller keeps the memory valid until each registration is released. GPU ranges are
    /// checked with the driver (device memory of GPU ``dev``); host ranges cannot be checked.
    fn register_descs(&self, py: Python<'_>, descs: &DescList) -> PyResult<Vec<Registration>> {
        let list = &descs.inner;
        if list.mem == MemType::Device {
            for (i, d) in list.descs.iter().enumerate() {
                check_device_range(py, i, d)?;
            }
        }
        let mut out: Vec<Registration> = Vec::with_capacity(list.len());
        for d in &list.descs {
            // SAFETY: the caller promised (the method's contract, NIXL's) that the range stays
            // valid memory of this type until its registration is released; GPU ranges were
            // confirmed with the driver above.
            let raw = unsafe { RawMemory::new(list.mem, *d) };
            match Registration::new(py, self.agent(), raw, None) {
                Ok(r) => out.push(r),
                Err(e) => {
                    // All or nothing: the ones made so far go (no transfer can use them yet).
                    for r in out {
                        r.release(py);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// A Python object's memory as a one-descriptor :class:`DescList` (for transfer lists;
    /// nothing is kept: the object must stay alive while transfers use the range).
    fn describe(&self, memory: &Bound<'_, PyAny>) -> PyResult<DescList> {
        let m = extract(&self.engine, memory, None, Access::Src)?;
        let (mem, desc) = match &m {
            Memory::Host(h) => {
                let (addr, len) = h.range();
                (MemType::Host, Desc::new(addr, len as u64, 0))
            }
            Memory::Device(d) => (
                MemType::Device,
                Desc::new(
                    d.slice.ptr(),
                    d.slice.len() as u64,
                    d.slice.ordinal() as u32,
                ),
            ),
        };
        Ok(DescList {
            inner: LibDescList::new(mem, vec![desc]),
        })
    }

    /// Checks ``descs`` once for transfers that pick entries by index: this agent's memory
    /// where ``peer`` is ``None``, else the peer's.
    #[pyo3(signature = (peer, descs))]
    fn prepare(&self, peer: Option<&str>, descs: &DescList) -> PyResult<PreparedList> {
        let inner = self.agent().prepare(peer, &descs.inner).map_err(to_py)?;
        Ok(PreparedList {
            inner,
            peer: peer.map(str::to_string),
            mem: descs.inner.mem,
        })
    }

    /// A checked transfer between ``local`` (this agent's registered memory) and ``remote``
    /// (``peer``'s), ``op`` ``"READ"`` (remote to local) or ``"WRITE"``; ``notif`` reaches the
    /// peer after each posting's data has landed.
    #[pyo3(signature = (op, local, peer, remote, notif = None))]
    fn request(
        &self,
        py: Python<'_>,
        op: &str,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<&[u8]>,
    ) -> PyResult<XferRequest> {
        let op = xfer_op(py, op)?;
        let req = self
            .agent()
            .request(op, &local.inner, peer, &remote.inner, notif)
            .map_err(to_py)?;
        Ok(XferRequest::new(req))
    }

    /// A transfer between entries of two prepared lists: the ``i``-th local index pairs with
    /// the ``i``-th remote one.
    #[pyo3(signature = (op, local, local_indices, remote, remote_indices, notif = None))]
    #[allow(clippy::too_many_arguments)]
    fn request_prepared(
        &self,
        py: Python<'_>,
        op: &str,
        local: &PreparedList,
        local_indices: Vec<i128>,
        remote: &PreparedList,
        remote_indices: Vec<i128>,
        notif: Option<&[u8]>,
    ) -> PyResult<XferRequest> {
        let op = xfer_op(py, op)?;
        let li = indices(py, "local", local_indices)?;
        let ri = indices(py, "remote", remote_indices)?;
        let req = self
            .agent()
            .request_prepared(op, &local.inner, &li, &remote.inner, &ri, notif)
            .map_err(to_py)?;
        Ok(XferRequest::new(req))
    }

    /// Sends ``msg`` to ``peer`` on its own.
    fn send_notification(&self, peer: &str, msg: &[u8]) -> PyResult<()> {
        self.agent().send_notification(peer, msg).map_err(to_py)
    }

    /// Every notification received and not yet taken, oldest first, as ``(from, msg)``.
    fn take_notifications<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        self.agent()
            .take_notifications()
            .into_iter()
            .map(|n| name_and_msg(py, n.from, &n.msg))
            .collect()
    }

    /// The next notification as ``(from, msg)``, waiting up to ``timeout`` seconds (GIL
    /// released); ``None`` if none came.
    fn wait_notification<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        let t = Duration::try_from_secs_f64(timeout).map_err(|_| {
            invalid(
                py,
                format!("timeout: {timeout} is not a number of seconds (0 or more)"),
            )
        })?;
        let agent = self.agent().clone();
        let got = exit::detach(py, move || agent.wait_notification(t));
        Ok(got.map(|n| name_and_msg(py, n.from, &n.msg)))
    }

    fn __repr__(&self) -> String {
        format!(
            "Agent({:?}, {} peers, transport: {})",
            self.agent().name(),
            self.agent().peers().len(),
            self.agent().transport()
        )
    }
}

/// Checks with the driver that `d` is device (or managed) memory of GPU `d.dev` from its first
/// byte to its last: a host pointer registered as VRAM would otherwise reach the CUDA copies
/// as a device address. Asking for the GPU of the address alone is not enough: page-locked
/// host memory (which host registrations become once a CUDA copy used them) has one too.
fn check_device_range(py: Python<'_>, i: usize, d: &Desc) -> PyResult<()> {
    let len = usize::try_from(d.len)
        .map_err(|_| invalid(py, format!("descriptor {i}: {} bytes is too long", d.len)))?;
    if len == 0 {
        return Err(invalid(
            py,
            format!("descriptor {i}: registering zero bytes"),
        ));
    }
    // SAFETY: the slice is built only for the checks its constructor makes (it asks the driver
    // about the range, touching none of it) and dropped at once: no operation ever uses it, so
    // its requirement that the memory outlive such operations holds trivially. The range is
    // the caller's to keep valid, as for the raw registration itself.
    let checked = unsafe { RawDeviceSlice::new(d.dev as usize, d.addr, len) };
    // The library's error says what the range is instead (`Unsupported` without CUDA).
    checked.map(drop).map_err(to_py)
}
