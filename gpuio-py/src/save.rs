//! Saving checkpoints through the library (`gpuio::safetensors::save_file`, `save_sharded`):
//! the Python layer (`gpuio.safetensors.torch.save_file` and friends) hands over each tensor
//! as ``(name, dtype, shape, memory)`` with its bytes in host or device memory.

use std::collections::HashMap;
use std::path::PathBuf;

use gpuio::safetensors::{SaveTensor, dtype_from_name};
use pyo3::prelude::*;

use crate::context::KeepCurrentContext;
use crate::errors::to_py;
use crate::file::Engine;
use crate::memory::{Access, Memory, extract};
use crate::runner::block_with_progress;

/// A tensor's bytes as a source the library writes from.
enum Src<'a> {
    Host(&'a [u8]),
    Device(&'a gpuio::RawDeviceSlice),
}

/// A tensor to save, its memory extracted.
type Part = (String, gpuio::safetensors::Dtype, Vec<usize>, Memory);

/// Host bytes as sized `&[u8]` values, which a `&dyn WriteSrc` can point at.
fn sources(parts: &[Part]) -> Vec<Src<'_>> {
    let mut out = Vec::with_capacity(parts.len());
    for (.., mem) in parts {
        out.push(match mem {
            Memory::Host(h) => Src::Host(h.bytes()),
            Memory::Device(d) => Src::Device(&d.slice),
        });
    }
    out
}

fn save_list<'a>(parts: &'a [Part], srcs: &'a [Src<'a>]) -> Vec<SaveTensor<'a>> {
    let mut out = Vec::with_capacity(parts.len());
    for ((name, dtype, shape, _), src) in parts.iter().zip(srcs) {
        out.push(SaveTensor {
            name,
            dtype: *dtype,
            shape,
            data: match src {
                Src::Host(bytes) => bytes,
                Src::Device(slice) => *slice,
            },
        });
    }
    out
}

/// ``(name, dtype, shape, memory)``: safetensors' dtype name, and the tensor's bytes.
type TensorArg<'py> = (String, String, Vec<usize>, Bound<'py, PyAny>);

/// Saves ``tensors`` as one ``.safetensors`` file at ``path`` (``max_shard_size`` ``None``)
/// or as a model directory at ``path`` with shards of at most ``max_shard_size`` bytes and an
/// index; returns the files written. Each file is written to a temporary name, fsynced and
/// renamed into place. Releases the GIL while writing.
#[pyfunction]
#[pyo3(signature = (engine, path, tensors, metadata = None, max_shard_size = None, progress = None))]
pub fn save_safetensors(
    py: Python<'_>,
    engine: &Engine,
    path: PathBuf,
    tensors: Vec<TensorArg<'_>>,
    metadata: Option<HashMap<String, String>>,
    max_shard_size: Option<u64>,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<Vec<PathBuf>> {
    let _keep_context = KeepCurrentContext::save();
    let engine = engine.inner.clone();
    let mut parts: Vec<Part> = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, obj) in tensors {
        let d = dtype_from_name(&dtype).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "tensor {name:?}: {dtype:?} is not a safetensors dtype"
            ))
        })?;
        let mem = extract(&engine, &obj, None, Access::Src)?;
        parts.push((name, d, shape, mem));
    }
    let counter = gpuio::Progress::new();
    let count = counter.clone();
    let save = async move {
        use gpuio::safetensors::{save_file_with_progress, save_sharded_with_progress};
        let srcs = sources(&parts);
        let list = save_list(&parts, &srcs);
        let meta = metadata.as_ref();
        match max_shard_size {
            None => save_file_with_progress(&engine, &list, &path, meta, &count)
                .await
                .map(|_| vec![path.clone()]),
            Some(max) => save_sharded_with_progress(&engine, &list, &path, max, meta, &count).await,
        }
    };
    block_with_progress(py, save, &counter, progress.as_ref())?.map_err(to_py)
}
