//! `.safetensors` checkpoints through the library's loader (`gpuio::safetensors`): the header
//! is read and checked there, and a load is the library's batch plan (tensors packed in file
//! order, neighbours merged into one read). The Python layer (`gpuio.safetensors`) allocates
//! the destination (a torch or numpy buffer of `LoadPlan.dst_len` bytes) and builds tensor
//! views over it.

use std::collections::HashSet;
use std::sync::Arc;

use gpuio::batch::BatchPlan;
use pyo3::prelude::*;

use crate::context::KeepCurrentContext;
use crate::errors::{int_arg, to_py};
use crate::file::Engine;
use crate::hostbuf::HostBuffer;
use crate::memory::{Access, Memory, extract};
use crate::runner::{block, block_asking, block_with_progress, spawn};

/// `(name, dtype, shape, start, end)`: safetensors' dtype name (``"F32"``, ``"BF16"``, ...).
type TensorRow = (String, String, Vec<usize>, u64, u64);

/// What was opened: one file, or a checkpoint of several shards (a directory or an index
/// file); both load whole or across tensor-parallel ranks.
enum Source {
    File(Arc<gpuio::safetensors::SafetensorsFile>),
    Model(Arc<gpuio::safetensors::SafetensorsModel>),
}

/// An open checkpoint with its parsed header(s).
#[pyclass(frozen, module = "gpuio._native")]
pub struct SafetensorsFile {
    inner: Source,
    engine: gpuio::Engine,
}

/// Opens `path` on `engine` and reads and checks its header: a ``.safetensors`` file, or a
/// directory (through ``model.safetensors.index.json`` where it has one, else every
/// ``.safetensors`` file in it) or an index file, as one checkpoint of all its shards.
#[pyfunction]
pub fn open_safetensors(
    py: Python<'_>,
    engine: &Engine,
    path: std::path::PathBuf,
) -> PyResult<SafetensorsFile> {
    let engine = engine.inner.clone();
    let sharded = path.is_dir() || path.extension().is_some_and(|x| x == "json");
    let opened = engine.clone();
    let inner = block(py, async move {
        if sharded {
            gpuio::safetensors::SafetensorsModel::open(&opened, &path)
                .await
                .map(|m| Source::Model(Arc::new(m)))
        } else {
            gpuio::safetensors::SafetensorsFile::open(&opened, &path)
                .await
                .map(|f| Source::File(Arc::new(f)))
        }
    })
    .map_err(to_py)?;
    Ok(SafetensorsFile { inner, engine })
}

#[pymethods]
impl SafetensorsFile {
    /// Every tensor in file order (shard by shard): ``(name, dtype, shape, file_start,
    /// file_end)``, the range in the tensor's own shard.
    fn tensors(&self) -> Vec<TensorRow> {
        let listed: Vec<&gpuio::safetensors::FileTensor> = match &self.inner {
            Source::File(f) => f.tensors().iter().collect(),
            Source::Model(m) => m.tensors().map(|(_, t)| t).collect(),
        };
        listed
            .into_iter()
            .map(|t| {
                let r = &t.file_range;
                (
                    t.name.clone(),
                    format!("{:?}", t.dtype),
                    t.shape.clone(),
                    r.start,
                    r.end,
                )
            })
            .collect()
    }

    /// The header's ``__metadata__`` strings (a sharded checkpoint's: its index's
    /// ``metadata``).
    fn metadata(&self) -> std::collections::HashMap<String, String> {
        match &self.inner {
            Source::File(f) => f.metadata().clone(),
            Source::Model(m) => m.metadata().clone(),
        }
    }

    /// The shard files, in the order their tensors are listed (one for a single file).
    fn shards(&self) -> Vec<std::path::PathBuf> {
        match &self.inner {
            Source::File(f) => vec![f.file().path().to_path_buf()],
            Source::Model(m) => m
                .shards()
                .iter()
                .map(|s| s.file().path().to_path_buf())
                .collect(),
        }
    }

    /// The load of the tensors named in ``names`` (all where ``None``): one batch across
    /// every shard.
    #[pyo3(signature = (names = None))]
    fn plan(&self, names: Option<Vec<String>>) -> LoadPlan {
        let wanted: Option<HashSet<String>> = names.map(|n| n.into_iter().collect());
        let keep = |name: &str| wanted.as_ref().is_none_or(|w| w.contains(name));
        let (plan, placed) = match &self.inner {
            Source::File(f) => f.plan(keep),
            Source::Model(m) => m.plan(keep),
        };
        self.load_plan(plan, placed)
    }

    /// One load per rank of a tensor-parallel group of ``ranks``: ``rules`` maps tensor names
    /// to ``"replicate"``, ``("split", dim)`` or ``("only", rank)``; tensors it does not name
    /// are not loaded. A rule that does not fit its tensor raises ``ValueError``.
    fn plan_shards(
        &self,
        py: Python<'_>,
        ranks: i128,
        rules: std::collections::HashMap<String, Bound<'_, PyAny>>,
    ) -> PyResult<Vec<LoadPlan>> {
        let ranks = int_arg(py, "ranks", ranks)?;
        let parsed = parse_rules(rules)?;
        let rule = |t: &gpuio::safetensors::FileTensor| parsed.get(&t.name).copied();
        let plans = match &self.inner {
            Source::File(f) => f.plan_shards(ranks, rule),
            Source::Model(m) => m.plan_shards(ranks, rule),
        }
        .map_err(to_py)?;
        Ok(self.load_plans(plans))
    }

    /// As ``plan_shards``, but each replicated tensor is read by one rank only; also returns
    /// the copies that complete the other ranks, as ``(from_rank, src_start, src_end,
    /// to_rank, dst_start)`` byte offsets in the ranks' buffers, to run after the loads.
    #[allow(clippy::type_complexity)]
    fn plan_shards_read_once(
        &self,
        py: Python<'_>,
        ranks: i128,
        rules: std::collections::HashMap<String, Bound<'_, PyAny>>,
    ) -> PyResult<(Vec<LoadPlan>, Vec<(usize, usize, usize, usize, usize)>)> {
        let ranks = int_arg(py, "ranks", ranks)?;
        let parsed = parse_rules(rules)?;
        let rule = |t: &gpuio::safetensors::FileTensor| parsed.get(&t.name).copied();
        let (plans, copies) = match &self.inner {
            Source::File(f) => f.plan_shards_read_once(ranks, rule),
            Source::Model(m) => m.plan_shards_read_once(ranks, rule),
        }
        .map_err(to_py)?;
        let copies = copies
            .into_iter()
            .map(|c| (c.from, c.src.start, c.src.end, c.to, c.dst_start))
            .collect();
        Ok((self.load_plans(plans), copies))
    }
}

/// Each tensor name's rule, parsed.
fn parse_rules(
    rules: std::collections::HashMap<String, Bound<'_, PyAny>>,
) -> PyResult<std::collections::HashMap<String, gpuio::safetensors::Shard>> {
    rules
        .into_iter()
        .map(|(name, rule)| Ok((name, shard_rule(&rule)?)))
        .collect()
}

impl SafetensorsFile {
    fn load_plans(
        &self,
        plans: Vec<(BatchPlan, Vec<gpuio::safetensors::Tensor>)>,
    ) -> Vec<LoadPlan> {
        plans
            .into_iter()
            .map(|(plan, placed)| self.load_plan(plan, placed))
            .collect()
    }

    fn load_plan(&self, plan: BatchPlan, placed: Vec<gpuio::safetensors::Tensor>) -> LoadPlan {
        let tensors = placed
            .into_iter()
            .map(|t| {
                let r = t.buffer_range;
                let dtype = format!("{:?}", t.dtype);
                (t.name, dtype, t.shape, r.start as u64, r.end as u64)
            })
            .collect();
        LoadPlan {
            engine: self.engine.clone(),
            plan: Arc::new(plan),
            tensors,
        }
    }
}

/// ``"replicate"``, ``("split", dim)`` or ``("only", rank)`` as a [`Shard`](gpuio::safetensors::Shard).
fn shard_rule(rule: &Bound<'_, PyAny>) -> PyResult<gpuio::safetensors::Shard> {
    use gpuio::safetensors::Shard;
    if let Ok(s) = rule.extract::<String>() {
        if s == "replicate" {
            return Ok(Shard::Replicate);
        }
    } else if let Ok((kind, n)) = rule.extract::<(String, usize)>() {
        match kind.as_str() {
            "split" => return Ok(Shard::Split(n)),
            "only" => return Ok(Shard::Only(n)),
            _ => {}
        }
    }
    Err(pyo3::exceptions::PyValueError::new_err(format!(
        "shard rule {rule}: use \"replicate\", (\"split\", dim) or (\"only\", rank)"
    )))
}

/// Where each selected tensor lands in one destination of ``dst_len`` bytes, and the batch
/// that reads them there.
#[pyclass(frozen, module = "gpuio._native")]
pub struct LoadPlan {
    engine: gpuio::Engine,
    plan: Arc<BatchPlan>,
    tensors: Vec<TensorRow>,
}

/// Runs `plan` into `mem`, every byte or an error (a truncated file is `UnexpectedEof`).
async fn load(
    plan: Arc<BatchPlan>,
    mut mem: Memory,
    progress: Arc<gpuio::Progress>,
) -> gpuio::Result<usize> {
    let done = match &mut mem {
        Memory::Host(h) => plan.read_into_with_progress(h.bytes_mut(), &progress).await,
        Memory::Device(d) => plan.read_into_with_progress(&mut d.slice, &progress).await,
    };
    done.exact(plan.descs())
}

/// Runs `plan` into new host memory the load owns while it runs (reads in place), every byte
/// or an error.
async fn load_host(plan: Arc<BatchPlan>, progress: Arc<gpuio::Progress>) -> gpuio::Result<Vec<u8>> {
    let (done, buf) = plan.read_to_vec_with_progress(&progress).await;
    done.exact(plan.descs()).map(|_| buf)
}

/// Runs every plan into new host memory at once, as ``LoadPlan.read_host`` does, releasing the
/// GIL once for all of them; one ``HostBuffer`` per plan. The first error raises, after every
/// load has ended.
#[pyfunction]
#[pyo3(signature = (plans, progress = None))]
pub fn read_plans_host(
    py: Python<'_>,
    plans: Vec<Bound<'_, LoadPlan>>,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<Vec<HostBuffer>> {
    let counter = gpuio::Progress::new();
    let loads = plans
        .iter()
        .map(|p| load_host(p.get().plan.clone(), counter.clone()));
    let all = futures::future::join_all(loads);
    block_with_progress(py, all, &counter, progress.as_ref())?
        .into_iter()
        .map(|r| r.map(HostBuffer::new).map_err(to_py))
        .collect()
}

/// Runs every plan into its destination at once (``plans[i]`` into ``dsts[i]``, ordered on
/// ``streams[i]`` where given), releasing the GIL once for all of them; returns the bytes
/// each read. Each destination is checked before anything is read. The first error raises,
/// after every load has ended.
#[pyfunction]
#[pyo3(signature = (plans, dsts, streams = None, progress = None))]
pub fn read_plans(
    py: Python<'_>,
    plans: Vec<Bound<'_, LoadPlan>>,
    dsts: Vec<Bound<'_, PyAny>>,
    streams: Option<Vec<Option<Bound<'_, PyAny>>>>,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<Vec<usize>> {
    if dsts.len() != plans.len() || streams.as_ref().is_some_and(|s| s.len() != plans.len()) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "read_plans: {} plans, {} destinations{}: one each",
            plans.len(),
            dsts.len(),
            streams
                .as_ref()
                .map_or(String::new(), |s| format!(", {} streams", s.len()))
        )));
    }
    let _keep_context = KeepCurrentContext::save();
    let counter = gpuio::Progress::new();
    let mut loads = Vec::with_capacity(plans.len());
    for (i, (plan, dst)) in plans.iter().zip(&dsts).enumerate() {
        let plan = plan.get();
        let stream = streams.as_ref().and_then(|s| s[i].as_ref());
        loads.push(load(
            plan.plan.clone(),
            plan.memory(dst, stream)?,
            counter.clone(),
        ));
    }
    let all = futures::future::join_all(loads);
    block_with_progress(py, all, &counter, progress.as_ref())?
        .into_iter()
        .map(|r| r.map_err(to_py))
        .collect()
}

impl LoadPlan {
    fn memory(
        &self,
        dst: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Memory> {
        extract(&self.engine, dst, stream, Access::Dst)
    }
}

#[pymethods]
impl LoadPlan {
    /// Bytes the destination needs.
    #[getter]
    fn dst_len(&self) -> usize {
        self.plan.dst_len()
    }

    /// ``(name, dtype, shape, start, end)`` per tensor: its bytes in the destination.
    #[getter]
    fn tensors(&self) -> Vec<TensorRow> {
        self.tensors.clone()
    }

    /// Reads every selected tensor into ``dst`` (at least ``dst_len`` bytes; host or device
    /// memory, as for ``File.read_into``, with the same stream semantics) and returns the
    /// bytes read. Releases the GIL. ``progress(done, total)`` (bytes), where given, is
    /// called about every 100 ms and once at the end; if it raises, the read is cancelled
    /// (nothing lands in ``dst`` afterwards) and the exception propagates.
    #[pyo3(signature = (dst, *, stream = None, progress = None))]
    fn read_into(
        &self,
        py: Python<'_>,
        dst: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        progress: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let _keep_context = KeepCurrentContext::save();
        let mem = self.memory(dst, stream)?;
        let counter = gpuio::Progress::new();
        if let Memory::Host(mut h) = mem {
            // Lent to the library for the call: the kernel reads into it in place.
            let plan = &self.plan;
            let done = block_asking(py, &counter, progress, |keep_going| {
                plan.read_into_blocking_with_progress(h.bytes_mut(), &counter, keep_going)
            })?;
            return done.exact(plan.descs()).map_err(to_py);
        }
        let read = load(self.plan.clone(), mem, counter.clone());
        block_with_progress(py, read, &counter, progress)?.map_err(to_py)
    }

    /// Reads every selected tensor into new host memory (``dst_len`` bytes) and returns it as
    /// a ``HostBuffer`` (wrap it with ``np.frombuffer`` or ``torch.frombuffer``, no copy).
    /// The load owns the memory while it runs, so the kernel's workers read into it in place,
    /// several at once, instead of every byte passing through a bounce buffer and one copy.
    /// Releases the GIL; ``progress`` as for ``read_into`` (if it raises, the load stops and
    /// no buffer comes back).
    #[pyo3(signature = (*, progress = None))]
    fn read_host(
        &self,
        py: Python<'_>,
        progress: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<HostBuffer> {
        let counter = gpuio::Progress::new();
        let read = load_host(self.plan.clone(), counter.clone());
        let buf = block_with_progress(py, read, &counter, progress)?.map_err(to_py)?;
        Ok(HostBuffer::new(buf))
    }

    /// ``read_into`` as an awaitable (see ``File.aread_into``).
    #[pyo3(signature = (dst, *, stream = None))]
    fn aread_into<'py>(
        &self,
        py: Python<'py>,
        dst: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _keep_context = KeepCurrentContext::save();
        let mem = self.memory(dst, stream)?;
        let op = load(self.plan.clone(), mem, gpuio::Progress::new());
        spawn(py, op)
    }
}
