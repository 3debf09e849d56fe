//! Batches: many `(file, offset, length)` ranges read into disjoint places of one destination,
//! as the library's `BatchPlan` runs them (validated, merged, all in flight at once).

use std::sync::Arc;

use gpuio::batch::{BatchPlan, BatchResult, ReadDesc};

use crate::engine::{EngineHandle, refuse_on_executor};
use crate::file::{FILES, gpuio_file, store};
use crate::memory::{self, Dst, gpuio_buffer};
use crate::request::{gpuio_callback, gpuio_request, submit};
use crate::status::{Failure, gpuio_status, guard};

/// One range of a batch: `len` bytes of `file` at `offset`, to land at byte `dst_offset` of
/// the batch's destination.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpuio_batch_desc {
    /// The file to read.
    pub file: *const gpuio_file,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: u64,
    /// Byte offset in the destination.
    pub dst_offset: u64,
}

/// One descriptor's outcome: `GPUIO_OK` and the bytes read (short only at end of file), or
/// the failure (`bytes` 0).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpuio_batch_result {
    /// The descriptor's status.
    pub status: gpuio_status,
    /// Bytes read.
    pub bytes: u64,
}

/// Out-parameters a batch fills when it completes.
struct Outputs {
    results: *mut gpuio_batch_result,
    count: usize,
}
// SAFETY: the pointer is only written once, by the one task that runs the batch, and the
// caller keeps the array valid and unread until the batch completes (the C contract).
unsafe impl Send for Outputs {}

impl Outputs {
    /// Writes each descriptor's outcome and returns the total, or the first failure.
    ///
    /// # Safety
    /// `results` is NULL or has `count` writable elements.
    unsafe fn fill(&self, done: BatchResult) -> Result<usize, Failure> {
        let mut first: Option<Failure> = None;
        let mut total = 0usize;
        for (i, r) in done.into_results().into_iter().enumerate().take(self.count) {
            let entry = match r {
                Ok(n) => {
                    total += n;
                    gpuio_batch_result {
                        status: gpuio_status::GPUIO_OK,
                        bytes: n as u64,
                    }
                }
                Err(e) => {
                    let f = Failure::from(e);
                    let status = f.status;
                    first.get_or_insert(f);
                    gpuio_batch_result { status, bytes: 0 }
                }
            };
            if !self.results.is_null() {
                // SAFETY: `i < count`, and the array has `count` writable elements.
                unsafe { self.results.add(i).write(entry) };
            }
        }
        first.map_or(Ok(total), Err)
    }
}

/// The plan for `descs[..count]` and the engine of its first file.
///
/// # Safety
/// `descs` is NULL (an error unless `count` is 0) or has `count` readable elements.
unsafe fn plan(
    descs: *const gpuio_batch_desc,
    count: usize,
) -> Result<(BatchPlan, Arc<EngineHandle>), Failure> {
    if count == 0 {
        return Err(Failure::invalid("batch of 0 descriptors"));
    }
    if descs.is_null() {
        return Err(Failure::invalid("batch descriptors: null pointer"));
    }
    // SAFETY: non-null with `count` readable elements (this function's contract); the
    // descriptor struct has no invalid bit patterns.
    let descs = unsafe { std::slice::from_raw_parts(descs, count) };
    let mut engine = None;
    let mut list = Vec::with_capacity(count);
    for (i, d) in descs.iter().enumerate() {
        let handle = FILES.get(d.file).map_err(|f| Failure {
            message: format!("batch descriptor {i}: {}", f.message),
            ..f
        })?;
        if engine.is_none() {
            engine = Some(handle.engine()?);
        }
        let len = usize::try_from(d.len).map_err(|_| {
            Failure::invalid(format!(
                "batch descriptor {i}: length {} is too large",
                d.len
            ))
        })?;
        let dst_offset = usize::try_from(d.dst_offset).map_err(|_| {
            Failure::invalid(format!(
                "batch descriptor {i}: destination offset {} is too large",
                d.dst_offset
            ))
        })?;
        list.push(ReadDesc::new(&handle.file, d.offset, len, dst_offset));
    }
    let engine = engine.ok_or_else(|| Failure::invalid("batch of 0 descriptors"))?;
    Ok((BatchPlan::new(list), engine))
}

async fn run(plan: BatchPlan, dst: Dst) -> BatchResult {
    match dst {
        Dst::Host(buf) => plan.read_into(buf).await,
        Dst::Device(mut d) => plan.read_into(&mut d.range).await,
    }
}

/// Reads `count` descriptors into one destination `dst` (host or device memory) as one batch
/// (contiguous neighbours merge into one read; all in flight at once). `results` (NULL, or
/// `count` elements) gets each descriptor's outcome; `*total` (if not NULL) the bytes read.
/// Returns `GPUIO_OK` if every descriptor succeeded, else the first failing descriptor's
/// status and message (a descriptor past `dst`'s end, or overlapping another's destination
/// range, fails alone). Device memory with a NULL stream: complete when the data is there; with
/// a stream: the copies are queued on it. Blocks.
///
/// # Safety
/// `descs` has `count` readable elements; `dst` as for `gpuio_read`; `results` NULL or `count`
/// writable elements; `total` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_read_batch(
    descs: *const gpuio_batch_desc,
    count: usize,
    dst: *const gpuio_buffer,
    results: *mut gpuio_batch_result,
    total: *mut u64,
) -> gpuio_status {
    guard(|| {
        refuse_on_executor("gpuio_read_batch")?;
        // SAFETY: forwarded from this function's contract.
        let (plan, engine) = unsafe { plan(descs, count) }?;
        // SAFETY: forwarded; the call ends after the batch.
        let dst = unsafe { memory::dst(&engine, dst) }?;
        let settle = settle_stream(&dst);
        let done = futures::executor::block_on(run(plan, dst));
        // Settle before reporting, failures included: some copies may have been queued.
        let settled = settle.map(|d| futures::executor::block_on(d.settle(&engine.engine)));
        let out = Outputs { results, count };
        // SAFETY: forwarded from this function's contract.
        let n = unsafe { out.fill(done) }?;
        settled.transpose()?;
        // SAFETY: forwarded from this function's contract.
        unsafe { store(total, n) };
        Ok(())
    })
}

/// A batch's device destination named no stream: a copy of its handle to wait for after.
fn settle_stream(dst: &Dst) -> Option<memory::Settle> {
    match dst {
        Dst::Host(_) => None,
        Dst::Device(d) => d.settler(),
    }
}

/// Starts a batch (as `gpuio_read_batch`) and stores its request in `*out`; the request's
/// bytes are the total. **`dst`'s memory and the `results` array must stay valid until the
/// request completes**; `descs` may go at once.
///
/// # Safety
/// As for `gpuio_read_batch`, with validity until completion; `out` NULL (an error) or
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_read_batch_async(
    descs: *const gpuio_batch_desc,
    count: usize,
    dst: *const gpuio_buffer,
    results: *mut gpuio_batch_result,
    callback: gpuio_callback,
    user_data: *mut libc::c_void,
    out: *mut *mut gpuio_request,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid(
                "gpuio_read_batch_async: out is a null pointer",
            ));
        }
        // SAFETY: forwarded from this function's contract.
        let (plan, engine) = unsafe { plan(descs, count) }?;
        // SAFETY: forwarded (valid until completion).
        let dst = unsafe { memory::dst(&engine, dst) }?;
        let settle = settle_stream(&dst);
        let outputs = Outputs { results, count };
        let reactor = engine.engine.clone();
        let op = async move {
            let outputs = outputs;
            let done = run(plan, dst).await;
            let settled = match settle {
                Some(d) => d.settle(&reactor).await,
                None => Ok(()),
            };
            // SAFETY: the caller keeps `results` (NULL or `count` elements) valid until this
            // request completes, which is after this write.
            let n = unsafe { outputs.fill(done) }?;
            settled?;
            Ok(n)
        };
        let token = submit(&engine, op, callback, user_data)?;
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { *out = std::ptr::without_provenance_mut::<gpuio_request>(token as usize) };
        Ok(())
    })
}
