//! Loading `.safetensors` checkpoints: every tensor (or a chosen subset) into one allocation,
//! host or device, with one batch read, and typed views of the tensors afterwards; or across
//! the ranks of a tensor-parallel group, each rank's shards into its own buffer ([`Shard`],
//! [`SafetensorsFile::plan_shards`]).
//!
//! Two coordinate systems, two types: a [`FileTensor`] (from [`SafetensorsFile::tensors`]) says
//! where a tensor's bytes are in the file; a [`Tensor`] (from a [`Checkpoint`]) says where they
//! are in that checkpoint's buffer. A checkpoint's accessors ([`Checkpoint::bytes`],
//! [`Checkpoint::to_vec`], `Checkpoint::view`) take the tensor's name, so they always use the
//! checkpoint's own placement.
//!
//! The header is read through the engine and parsed with the `safetensors` crate. Selected
//! tensors are packed in file order; each keeps its file offset's remainder modulo 256 in the
//! buffer, so tensors that are neighbours in the file stay neighbours in the buffer (and merge
//! into one read: a whole checkpoint is a single chunked read) and keep the alignment the file
//! gave them.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("model.safetensors");
//! # let w: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
//! # let t = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 2], &w)?;
//! # safetensors::serialize_to_file([("w", t)], None, &path)?;
//! # let rt = tokio::runtime::Runtime::new()?;
//! # rt.block_on(async {
//! let engine = gpuio::Engine::new()?;
//! let st = gpuio::safetensors::SafetensorsFile::open(&engine, &path).await?;
//! let ckpt = st.load_host(|_name| true).await?;     // or load_device(&stream, ..)
//! let w = ckpt.tensor("w").expect("tensor w");
//! assert_eq!(w.shape, [2, 2]);
//! assert_eq!(ckpt.bytes("w")?, &[1.0f32, 2.0, 3.0, 4.0].map(f32::to_le_bytes).concat()[..]);
//! assert_eq!(ckpt.to_vec::<f32>("w")?, [1.0, 2.0, 3.0, 4.0]);
//! # Ok::<_, gpuio::Error>(()) })?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

pub use model::{INDEX_FILE, SafetensorsModel};
pub use safetensors::Dtype;
pub use save::{
    SaveTensor, dtype_from_name, save_file, save_file_with_progress, save_sharded,
    save_sharded_with_progress,
};
pub use shard::{MAX_RANKS, ReplicaCopy, Replicas, Shard};

mod model;
mod parallel;
#[cfg(feature = "cuda")]
mod replica;
mod save;
mod shard;

use crate::batch::{BatchPlan, ReadDesc};
use crate::buf::ReadDst;
use crate::engine::Engine;
use crate::error::{Context, Error, OpKind, Result};
use crate::file::File;

/// The header may not be larger than this (the `safetensors` crate's own limit).
const MAX_HEADER: u64 = 100_000_000;
/// Tensors keep their file offset modulo this in the buffer.
const PLACEMENT: u64 = 256;

/// A tensor as the file lists it ([`SafetensorsFile::tensors`]): name, type, shape, and where
/// its bytes are in the file. It has no place in any buffer: a loaded tensor is a [`Tensor`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileTensor {
    /// Name in the checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range in the file (absolute: past the 8-byte length and the header).
    pub file_range: Range<u64>,
}

impl FileTensor {
    /// Bytes of data.
    pub fn byte_len(&self) -> usize {
        // The header gave the range as usize data offsets, so its length fits a usize.
        (self.file_range.end - self.file_range.start) as usize
    }
}

/// A tensor placed in a buffer: by a [`Checkpoint`] (its [`tensors`](Checkpoint::tensors),
/// [`tensor`](Checkpoint::tensor)) or by [`SafetensorsFile::plan`]. `buffer_range` indexes
/// that buffer and no other; a checkpoint's own accessors take the tensor's name instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Name in the checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range in the file it was read from: the whole tensor's, also for a shard
    /// ([`Shard`]), which read only its part of it.
    pub file_range: Range<u64>,
    /// Byte range in the buffer it was loaded into.
    pub buffer_range: Range<usize>,
}

impl Tensor {
    /// Bytes of data.
    pub fn byte_len(&self) -> usize {
        self.buffer_range.len()
    }
}

/// An open `.safetensors` file with its parsed header.
#[derive(Debug)]
pub struct SafetensorsFile {
    file: File,
    tensors: Vec<FileTensor>,
    metadata: HashMap<String, String>,
    /// Where loads report the bytes they move ([`set_progress`](Self::set_progress)).
    progress: Option<Arc<crate::op::progress::Progress>>,
}

impl SafetensorsFile {
    /// Opens `path` on `engine` and reads and checks its header: a clear
    /// [`Error::InvalidInput`] for a header that does not parse, does not add up, or
    /// describes more data than the file holds.
    pub async fn open(engine: &Engine, path: impl AsRef<Path>) -> Result<Self> {
        let file = engine.open(path)?;
        let bad = |why: String| Error::invalid(file.ctx(OpKind::Read, 0), why);
        let file_len = file.len()?;
        let mut n = [0u8; 8];
        if file_len < 8 {
            return Err(bad(format!(
                "{file_len} bytes is too short for a safetensors file"
            )));
        }
        file.read_exact_at(&mut n, 0).await?;
        let header_len = u64::from_le_bytes(n);
        if header_len > MAX_HEADER || 8 + header_len > file_len {
            return Err(bad(format!(
                "header length {header_len} does not fit the file's {file_len} bytes (limit {MAX_HEADER})"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8).await?;
        let meta: safetensors::tensor::Metadata =
            serde_json::from_slice(&header).map_err(|e| bad(format!("safetensors header: {e}")))?;
        let data_start = 8 + header_len;
        let data_len = file_len - data_start;
        let mut tensors = Vec::new();
        for name in meta.offset_keys() {
            let Some(info) = meta.info(&name) else {
                continue;
            };
            let (s, e) = info.data_offsets;
            if e as u64 > data_len {
                return Err(bad(format!(
                    "tensor {name:?} ends at data byte {e}, past the {data_len} bytes the file holds"
                )));
            }
            tensors.push(FileTensor {
                name,
                dtype: info.dtype,
                shape: info.shape.clone(),
                file_range: data_start + s as u64..data_start + e as u64,
            });
        }
        // As the safetensors package decides: the tensors' ranges (already checked to follow
        // one another from byte 0, and by the loop above to end inside the file) must cover
        // the data exactly. Trailing bytes, and a name listed twice (JSON keeps the last,
        // which leaves a hole), are refused.
        if (meta.data_len() as u64) < data_len {
            return Err(bad(format!(
                "the file is not fully covered: its tensors' data ends at byte {} of the \
                 {data_len} bytes after the header (trailing bytes, or a tensor listed twice)",
                meta.data_len()
            )));
        }
        Ok(SafetensorsFile {
            progress: None,
            file,
            tensors,
            metadata: meta.metadata().clone().unwrap_or_default(),
        })
    }

    /// Every tensor the header lists, in file order, with its place in the file.
    pub fn tensors(&self) -> &[FileTensor] {
        &self.tensors
    }

    /// The header's `__metadata__` strings.
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The batch that loads the tensors `keep` selects, and where each lands in the batch's
    /// destination (`buffer_range`; the destination needs [`BatchPlan::dst_len`] bytes).
    pub fn plan(&self, mut keep: impl FnMut(&str) -> bool) -> (BatchPlan, Vec<Tensor>) {
        plan_tensors(
            self.tensors
                .iter()
                .filter(|t| keep(&t.name))
                .map(|t| (&self.file, t)),
        )
    }

    /// Makes every later load of this file (whole, or across ranks) add the bytes it plans to
    /// `progress`'s total and the bytes it moves to its count; `None` stops reporting.
    pub fn set_progress(&mut self, progress: Option<Arc<crate::op::progress::Progress>>) {
        self.progress = progress;
    }

    /// Loads the selected tensors into one host buffer.
    pub async fn load_host(&self, keep: impl FnMut(&str) -> bool) -> Result<Checkpoint<Vec<u8>>> {
        let (plan, tensors) = self.plan(keep);
        load_host(plan, tensors, self.file.path(), self.progress.as_ref()).await
    }

    /// Loads the selected tensors into one allocation on `stream`'s device. The copies are
    /// queued on `stream`; kernels queued there afterwards (or anything cudarc orders after
    /// the buffer's events) see the data.
    #[cfg(feature = "cuda")]
    pub async fn load_device(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        keep: impl FnMut(&str) -> bool,
    ) -> Result<Checkpoint<cudarc::driver::CudaSlice<u8>>> {
        let (plan, tensors) = self.plan(keep);
        load_device(
            stream,
            plan,
            tensors,
            self.file.path(),
            self.progress.as_ref(),
        )
        .await
    }

    async fn run<D: ReadDst + ?Sized>(
        plan: &BatchPlan,
        dst: &mut D,
        progress: Option<&Arc<crate::op::progress::Progress>>,
    ) -> Result<()> {
        let done = match progress {
            Some(p) => plan.read_into_with_progress(dst, p).await,
            None => plan.read_into(dst).await,
        };
        done.exact(plan.descs()).map(drop)
    }

    /// [`run`](Self::run) into a new host buffer the batch owns while it runs: reads land in
    /// it in place (`BatchPlan::read_to_vec`), copied out of the page cache by the kernel's
    /// workers rather than out of bounce slots by the one thread that polls the load.
    async fn run_to_vec(
        plan: &BatchPlan,
        progress: Option<&Arc<crate::op::progress::Progress>>,
    ) -> Result<Vec<u8>> {
        let (done, buf) = match progress {
            Some(p) => plan.read_to_vec_with_progress(p).await,
            None => plan.read_to_vec().await,
        };
        done.exact(plan.descs()).map(|_| buf)
    }
}

/// The batch that reads `tensors` (each with the file it is in), packed in the order given,
/// and where each lands in the batch's destination. Each keeps its file offset's remainder
/// modulo [`PLACEMENT`]: neighbours in a file stay neighbours (one read) and keep the file's
/// alignment.
fn plan_tensors<'a>(
    tensors: impl Iterator<Item = (&'a File, &'a FileTensor)>,
) -> (BatchPlan, Vec<Tensor>) {
    let mut at = 0u64;
    let mut placed = Vec::new();
    let mut descs = Vec::new();
    for (file, t) in tensors {
        // An empty tensor takes no room (its range cannot then lie past the buffer's end).
        let dst = if t.byte_len() == 0 {
            at
        } else {
            at + (t.file_range.start + PLACEMENT - at % PLACEMENT) % PLACEMENT
        };
        let dst = dst as usize;
        descs.push(ReadDesc::new(file, t.file_range.start, t.byte_len(), dst));
        placed.push(Tensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            file_range: t.file_range.clone(),
            buffer_range: dst..dst + t.byte_len(),
        });
        at = (dst + t.byte_len()) as u64;
    }
    (BatchPlan::new(descs), placed)
}

/// Tells the kernel that `plan`'s files (the loader's own) are read in sequence, once each.
/// Host loads read cold data through the page cache, in place (`BatchPlan::read_owned`), and a
/// larger readahead window took a cold 4 GiB load from 1.64-1.82 to 1.77-2.07 GB/s on fewer
/// cores, the rate of one thread reading the file in a loop (BENCHMARKS.md, "Twenty-first
/// session").
fn advise_sequential(plan: &BatchPlan) {
    let mut seen: Vec<&File> = Vec::new();
    for d in plan.descs() {
        if !seen.iter().any(|f| f.same_file(&d.file)) {
            d.file.advise_sequential();
            seen.push(&d.file);
        }
    }
}

/// Runs `plan` into a new host buffer: the checkpoint of `tensors`, named `path` in errors.
async fn load_host(
    plan: BatchPlan,
    tensors: Vec<Tensor>,
    path: &Path,
    progress: Option<&Arc<crate::op::progress::Progress>>,
) -> Result<Checkpoint<Vec<u8>>> {
    advise_sequential(&plan);
    let buf = SafetensorsFile::run_to_vec(&plan, progress).await?;
    Ok(Checkpoint::new(buf, tensors, path))
}

/// Runs `plan` into a new allocation on `stream`'s device.
#[cfg(feature = "cuda")]
async fn load_device(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    plan: BatchPlan,
    tensors: Vec<Tensor>,
    path: &Path,
    progress: Option<&Arc<crate::op::progress::Progress>>,
) -> Result<Checkpoint<cudarc::driver::CudaSlice<u8>>> {
    let ctx = || {
        Context::op(OpKind::Read)
            .with_path(&Arc::from(path))
            .with_backend("cuda")
    };
    let mut buf = stream
        .alloc_zeros::<u8>(plan.dst_len().max(1))
        .map_err(|e| Error::cuda(ctx(), e))?;
    SafetensorsFile::run(&plan, &mut buf, progress).await?;
    Ok(Checkpoint::new(buf, tensors, path))
}

/// Tensors loaded into one buffer `B` (`Vec<u8>`, or `CudaSlice<u8>` on a GPU).
///
/// Its accessors take a tensor's name, never a [`Tensor`] or [`FileTensor`]: a range from
/// another checkpoint (a different subset packs differently) or from the file's listing would
/// index this buffer wrongly, and a name cannot.
#[derive(Debug)]
pub struct Checkpoint<B> {
    buffer: B,
    tensors: Vec<Tensor>,
    by_name: HashMap<String, usize>,
    /// The file the tensors came from, for errors.
    path: Arc<Path>,
}

impl<B> Checkpoint<B> {
    fn new(buffer: B, tensors: Vec<Tensor>, path: &Path) -> Self {
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Checkpoint {
            buffer,
            tensors,
            by_name,
            path: Arc::from(path),
        }
    }

    /// The loaded tensors, in file order; `buffer_range`s index [`Checkpoint::buffer`].
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The buffer holding every tensor.
    pub fn buffer(&self) -> &B {
        &self.buffer
    }

    /// Bytes of tensor data loaded.
    pub fn byte_len(&self) -> u64 {
        self.tensors.iter().map(|t| t.byte_len() as u64).sum()
    }

    /// The buffer, and the tensors' places in it.
    pub fn into_parts(self) -> (B, Vec<Tensor>) {
        (self.buffer, self.tensors)
    }

    /// An [`Error::InvalidInput`] naming the file and, where there is one, the tensor's file
    /// offset.
    fn invalid(&self, t: Option<&Tensor>, why: String) -> Error {
        let mut ctx = Context::op(OpKind::Read).with_path(&self.path);
        if let Some(t) = t {
            ctx = ctx.with_offset(t.file_range.start);
        }
        Error::invalid(ctx, why)
    }

    /// The tensor called `name`, or an error saying there is none.
    fn named(&self, name: &str) -> Result<&Tensor> {
        self.tensor(name).ok_or_else(|| {
            let why = format!("no tensor named {name:?} in the checkpoint");
            self.invalid(None, why)
        })
    }

    /// The tensor called `name`, checked to hold elements of `T`'s size. Alignment is not
    /// checked here: decoding copies and does not need it, only a zero-copy view does.
    fn sized<T>(&self, name: &str) -> Result<&Tensor> {
        let t = self.named(name)?;
        let bits = 8 * std::mem::size_of::<T>();
        if t.dtype.bitsize() != bits {
            let why = format!(
                "tensor {name:?}: {:?} elements are {} bits, the requested type's {bits} bits",
                t.dtype,
                t.dtype.bitsize(),
            );
            return Err(self.invalid(Some(t), why));
        }
        Ok(t)
    }
}

impl Checkpoint<Vec<u8>> {
    /// The bytes of the tensor called `name`, as the file stores them (little-endian).
    ///
    /// Takes a name, so a tensor listed by the file or placed in another checkpoint cannot
    /// select the wrong bytes:
    ///
    /// ```compile_fail
    /// # async fn f(st: gpuio::safetensors::SafetensorsFile) -> gpuio::Result<()> {
    /// let ckpt = st.load_host(|name| name != "embed").await?;
    /// let listed = &st.tensors()[1]; // a FileTensor: its range is in the file
    /// let _ = ckpt.bytes(listed); // refused: mismatched types; write ckpt.bytes(&listed.name)
    /// # Ok(()) }
    /// ```
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.named(name)?;
        // In bounds: the buffer was sized by the plan that placed this checkpoint's tensors.
        Ok(&self.buffer[t.buffer_range.clone()])
    }

    /// Each loaded tensor with its bytes, in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&Tensor, &[u8])> {
        self.tensors
            .iter()
            .map(|t| (t, &self.buffer[t.buffer_range.clone()]))
    }

    /// The tensor's elements, decoded from its little-endian bytes into a new `Vec` (`T`
    /// must have the dtype's size; f16 and bf16 decode as `u16`/`i16`). The bytes may sit at
    /// any offset: a safetensors header may have any length, so a tensor can start at an odd
    /// file offset, and decoding copies byte by byte rather than reinterpreting the buffer.
    /// Big-endian machines decode little-endian all the same.
    pub fn to_vec<T: FromLeBytes>(&self, name: &str) -> Result<Vec<T>> {
        let t = self.sized::<T>(name)?;
        // `sized` made the element size match the dtype, and the header's validation made the
        // byte length the element count times that size, so `chunks_exact` leaves nothing.
        Ok(self.buffer[t.buffer_range.clone()]
            .chunks_exact(std::mem::size_of::<T>())
            .map(T::from_le)
            .collect())
    }
}

#[cfg(feature = "cuda")]
impl Checkpoint<cudarc::driver::CudaSlice<u8>> {
    /// The tensor as a typed device view, without a copy. `T` must have the dtype's element
    /// size (f16 and bf16 tensors view as `u16`/`i16`), and the tensor's data must be aligned
    /// for `T`: a view reinterprets the buffer in place, so it cannot fix alignment up.
    /// Tensors keep their file offset's alignment (modulo 256), so files written by the
    /// `safetensors` crate (which pads the header to a multiple of 8 and writes larger
    /// element types first) qualify; a legal file that leaves a tensor misaligned (a header
    /// length that is not a multiple of 8, say) gets an error saying so, and its elements can
    /// still be had on the host through [`Checkpoint::to_vec`].
    pub fn view<T: crate::cuda::Pod>(&self, name: &str) -> Result<cudarc::driver::CudaView<'_, T>> {
        let t = self.sized::<T>(name)?;
        let align = std::mem::align_of::<T>();
        if t.buffer_range.start % align != 0 {
            let why = format!(
                "tensor {name:?}: a typed view needs its data aligned to {align} bytes, but it \
                 starts at file byte {} (buffer byte {}; a loaded tensor keeps its file \
                 offset's alignment); load it to the host and decode it with to_vec instead",
                t.file_range.start, t.buffer_range.start,
            );
            return Err(self.invalid(Some(t), why));
        }
        let bytes = self.buffer.slice(t.buffer_range.clone());
        let n = t.byte_len() / std::mem::size_of::<T>();
        // SAFETY: `T: Pod` accepts every bit pattern; the view covers exactly the tensor's
        // bytes, which start aligned for `T` (checked above; the allocation itself is aligned
        // to 256 bytes and tensors keep their file offset modulo 256).
        unsafe { bytes.transmute::<T>(n) }.ok_or_else(|| {
            let why = format!("tensor {name:?} does not fit a view of {n} elements");
            self.invalid(Some(t), why)
        })
    }
}

/// Element types decoded from little-endian bytes ([`Checkpoint::to_vec`]).
pub trait FromLeBytes: Sized {
    /// Decodes one element from exactly `size_of::<Self>()` bytes.
    fn from_le(b: &[u8]) -> Self;
}

macro_rules! from_le {
    ($($t:ty),*) => {$(
        impl FromLeBytes for $t {
            fn from_le(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
        }
    )*};
}
from_le!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);
