//! Saving tensors from host or device memory as a `.safetensors` file ([`save_file`]), the
//! way the `safetensors` package lays one out (same header for the same tensors), written
//! through the engine, crash-safe: the bytes go to a temporary file in the target's
//! directory, which is fsynced and then renamed over the final name (and the directory
//! fsynced), so the final name is absent, the old file, or the whole new one, never a part.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use safetensors::tensor::{Metadata, TensorInfo};

use super::Dtype;
use crate::buf::WriteSrc;
use crate::engine::Engine;
use crate::error::{Context, Error, OpKind, Result};
use crate::file::OpenOptions;

/// Tensor data at least this large is written with O_DIRECT where the filesystem takes it
/// (a checkpoint is written once and read later: it need not sit in the page cache).
const DIRECT_MIN: u64 = 64 << 20;

/// Tensor writes in flight at once (each is an op the engine splits into its own pieces).
const WRITES_IN_FLIGHT: usize = 32;

/// One tensor to save: its name, element type, shape and bytes (host memory, or device
/// memory through any [`WriteSrc`]), which must be exactly the shape's size.
#[derive(Clone, Copy)]
pub struct SaveTensor<'a> {
    /// Name in the checkpoint.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// The tensor's bytes, little-endian, row-major.
    pub data: &'a dyn WriteSrc,
}

impl std::fmt::Debug for SaveTensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveTensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

/// Saves `tensors` (with the `__metadata__` strings `metadata`, if any) as a `.safetensors`
/// file at `path` and returns the file's size. The header is the one the `safetensors`
/// package writes for the same tensors (largest element types first, then by name; padded
/// with spaces to a multiple of 8). A bad tensor (a name used twice or reserved, bytes that do
/// not match the shape) is an [`Error::InvalidInput`] before anything is written; an I/O
/// error leaves no file under `path` (a previous file there stays as it was).
pub async fn save_file(
    engine: &Engine,
    tensors: &[SaveTensor<'_>],
    path: impl AsRef<Path>,
    metadata: Option<&HashMap<String, String>>,
) -> Result<u64> {
    save_one(engine, tensors, path.as_ref(), metadata, None).await
}

/// [`save_file`], adding the file's tensor bytes to `progress`'s total when it starts and to
/// its count as they are written.
pub async fn save_file_with_progress(
    engine: &Engine,
    tensors: &[SaveTensor<'_>],
    path: impl AsRef<Path>,
    metadata: Option<&HashMap<String, String>>,
    progress: &Arc<crate::op::progress::Progress>,
) -> Result<u64> {
    progress.add_total(data_bytes(tensors));
    save_one(engine, tensors, path.as_ref(), metadata, Some(progress)).await
}

/// The tensors' data bytes: what a save writes besides the header.
fn data_bytes(tensors: &[SaveTensor<'_>]) -> u64 {
    tensors.iter().map(|t| t.data.source().len() as u64).sum()
}

async fn save_one(
    engine: &Engine,
    tensors: &[SaveTensor<'_>],
    path: &Path,
    metadata: Option<&HashMap<String, String>>,
    progress: Option<&Arc<crate::op::progress::Progress>>,
) -> Result<u64> {
    let ctx = || Context::op(OpKind::Write).with_path(&Arc::from(path));
    let (header, order) = layout(tensors, metadata).map_err(|why| Error::invalid(ctx(), why))?;
    let data_len: u64 = order.iter().map(|&(_, _, len)| len).sum();
    let total = header.len() as u64 + data_len;
    let tmp = TempFile(Some(temp_name(path)));
    let tmp_path = tmp.0.as_deref().unwrap_or(path);
    write_all(
        engine, tmp_path, &header, tensors, &order, data_len, progress,
    )
    .await?;
    std::fs::rename(tmp_path, path).map_err(|e| Error::io(ctx(), e))?;
    tmp.kept();
    sync_dir(path).map_err(|e| Error::io(ctx(), e))?;
    Ok(total)
}

/// A temporary file removed when this is dropped: on an error, and when the save's future is
/// dropped mid-write (a write still in the kernel then lands in the unlinked file, never under
/// any name). [`kept`](Self::kept) once it has been renamed into place.
struct TempFile(Option<PathBuf>);

impl TempFile {
    fn kept(mut self) {
        self.0 = None;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The file's first bytes (length, header), and per tensor (in the file's order) its index in
/// `tensors`, its data's file offset and length; `Err` says what is wrong with the input.
#[allow(clippy::type_complexity)]
fn layout(
    tensors: &[SaveTensor<'_>],
    metadata: Option<&HashMap<String, String>>,
) -> std::result::Result<(Vec<u8>, Vec<(usize, u64, u64)>), String> {
    let mut seen = HashSet::new();
    for t in tensors {
        if t.name == "__metadata__" {
            return Err(
                "a tensor may not be called __metadata__ (the header's metadata key)".into(),
            );
        }
        if !seen.insert(t.name) {
            return Err(format!("tensor {:?} is given twice", t.name));
        }
        let elements = t
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("tensor {:?}: shape {:?} overflows", t.name, t.shape))?;
        let bits = elements
            .checked_mul(t.dtype.bitsize())
            .ok_or_else(|| format!("tensor {:?}: shape {:?} overflows", t.name, t.shape))?;
        let have = t.data.source().len();
        if bits % 8 != 0 || bits / 8 != have {
            return Err(format!(
                "tensor {:?}: {:?} of shape {:?} is {bits} bits, but its data is {have} bytes",
                t.name, t.dtype, t.shape
            ));
        }
    }
    // The safetensors package's order: larger element types first, then by name.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&tensors[a], &tensors[b]);
        b.dtype.cmp(&a.dtype).then(a.name.cmp(b.name))
    });
    let mut infos = Vec::with_capacity(tensors.len());
    let mut at = 0usize;
    for &i in &order {
        let t = &tensors[i];
        let len = t.data.source().len();
        infos.push((
            t.name.to_string(),
            TensorInfo {
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                data_offsets: (at, at + len),
            },
        ));
        at += len;
    }
    let meta = Metadata::new(metadata.cloned(), infos).map_err(|e| e.to_string())?;
    let mut json = serde_json::to_string(&meta)
        .map_err(|e| e.to_string())?
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut header = (json.len() as u64).to_le_bytes().to_vec();
    header.extend_from_slice(&json);
    let start = header.len() as u64;
    let mut placed = Vec::with_capacity(order.len());
    let mut at = start;
    for &i in &order {
        let len = tensors[i].data.source().len() as u64;
        placed.push((i, at, len));
        at += len;
    }
    Ok((header, placed))
}

/// Writes the header and every tensor into `tmp` (created anew), then fsyncs it.
async fn write_all(
    engine: &Engine,
    tmp: &Path,
    header: &[u8],
    tensors: &[SaveTensor<'_>],
    order: &[(usize, u64, u64)],
    data_len: u64,
    progress: Option<&Arc<crate::op::progress::Progress>>,
) -> Result<()> {
    let create = |direct: bool| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .direct(direct)
            .open(engine, tmp)
    };
    // O_DIRECT where the data is large and the filesystem takes it (tmpfs does not).
    let file = match data_len >= DIRECT_MIN {
        true => create(true).or_else(|_| create(false))?,
        false => create(false)?,
    };
    file.write_from(header, 0).await?;
    // By value, and no async block: a closure taking a reference makes the future fail to be
    // `Send` for every lifetime (rustc's higher-ranked check), and tokio's spawn needs `Send`.
    let file = &file;
    let writes = order.iter().copied().map(|(i, at, _)| {
        let write = file.write_from(tensors[i].data, at);
        match progress {
            Some(p) => write.with_progress(p),
            None => write,
        }
    });
    let mut writes = futures::stream::iter(writes).buffer_unordered(WRITES_IN_FLIGHT);
    while let Some(r) = writes.next().await {
        r?;
    }
    file.sync_all().await
}

/// `.NAME.gpuio-PID-N.tmp` beside `path`: in its directory (so the rename stays on one
/// filesystem), hidden, and unique per process and call.
fn temp_name(path: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy());
    path.with_file_name(format!(".{name}.gpuio-{}-{n}.tmp", std::process::id()))
}

/// Makes the rename durable: fsyncs the directory holding `path`.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// The element type safetensors names `name` (`"F32"`, `"BF16"`, ...), if there is one.
pub fn dtype_from_name(name: &str) -> Option<Dtype> {
    serde_json::from_value(serde_json::Value::String(name.to_string())).ok()
}

/// Saves `tensors` as a model directory the way hubs keep one (huggingface_hub's
/// `save_torch_state_dict` layout): shards of at most `max_shard_bytes` of tensor data each
/// (a tensor larger than that gets a shard of its own), filled in the order given and named
/// `model-00001-of-0000N.safetensors`, plus [`INDEX_FILE`](super::INDEX_FILE) mapping every
/// tensor to its shard, with `total_size` in its metadata. One shard is saved as
/// `model.safetensors`, with no index. `metadata` goes into every shard's header. Each file is
/// saved as [`save_file`] saves one (whole or absent), the index last, so a directory whose
/// index is present and fresh names only whole shards. Returns the files written.
pub async fn save_sharded(
    engine: &Engine,
    tensors: &[SaveTensor<'_>],
    dir: impl AsRef<Path>,
    max_shard_bytes: u64,
    metadata: Option<&HashMap<String, String>>,
) -> Result<Vec<PathBuf>> {
    save_shards(
        engine,
        tensors,
        dir.as_ref(),
        max_shard_bytes,
        metadata,
        None,
    )
    .await
}

/// [`save_sharded`], reporting to `progress` as [`save_file_with_progress`] does (every
/// shard's bytes are in the total from the start).
pub async fn save_sharded_with_progress(
    engine: &Engine,
    tensors: &[SaveTensor<'_>],
    dir: impl AsRef<Path>,
    max_shard_bytes: u64,
    metadata: Option<&HashMap<String, String>>,
    progress: &Arc<crate::op::progress::Progress>,
) -> Result<Vec<PathBuf>> {
    save_shards(
        engine,
        tensors,
        dir.as_ref(),
        max_shard_bytes,
        metadata,
        Some(progress),
    )
    .await
}

async fn save_shards(
    engine: &Engine,
    tensors: &[SaveTensor<'_>],
    dir: &Path,
    max_shard_bytes: u64,
    metadata: Option<&HashMap<String, String>>,
    progress: Option<&Arc<crate::op::progress::Progress>>,
) -> Result<Vec<PathBuf>> {
    let ctx = || Context::op(OpKind::Write).with_path(&Arc::from(dir));
    if max_shard_bytes == 0 {
        return Err(Error::invalid(ctx(), "a maximum shard size of 0 bytes"));
    }
    // Checked as a whole first: nothing is written for bad input.
    layout(tensors, metadata).map_err(|why| Error::invalid(ctx(), why))?;
    if let Some(p) = progress {
        p.add_total(data_bytes(tensors));
    }
    let mut shards: Vec<Vec<SaveTensor<'_>>> = Vec::new();
    let mut room = 0u64;
    for t in tensors {
        let len = t.data.source().len() as u64;
        if shards.is_empty() || len > room {
            shards.push(Vec::new());
            room = max_shard_bytes;
        }
        room = room.saturating_sub(len);
        shards.last_mut().expect("pushed above").push(*t);
    }
    if shards.len() <= 1 {
        let path = dir.join("model.safetensors");
        save_one(engine, tensors, &path, metadata, progress).await?;
        return Ok(vec![path]);
    }
    let n = shards.len();
    let mut written = Vec::with_capacity(n + 1);
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let path = dir.join(&name);
        save_one(engine, shard, &path, metadata, progress).await?;
        for t in shard {
            weight_map.insert(t.name.to_string(), serde_json::Value::String(name.clone()));
        }
        written.push(path);
    }
    let total = data_bytes(tensors);
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let text =
        serde_json::to_vec_pretty(&index).map_err(|e| Error::invalid(ctx(), e.to_string()))?;
    let path = dir.join(super::INDEX_FILE);
    write_small_atomically(&path, &text).map_err(|e| Error::io(ctx(), e))?;
    written.push(path);
    Ok(written)
}

/// Writes a small file (an index) whole or not at all: a temporary beside it, fsynced,
/// renamed, the directory fsynced.
fn write_small_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = temp_name(path);
    let done = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path)
    })();
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}
