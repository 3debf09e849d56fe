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
/// the failure (`bytes` 0). Every call that is given a results array of `count` entries writes
/// all of them, whatever happens: a descriptor that cannot run (no file, a closed file, past
/// the destination's end, overlapping another's destination range) gets its own failure, a
/// batch refused as a whole (a bad destination, a blocking call inside a callback) gives every
/// entry that refusal's status, and a request cancelled before it completed leaves
/// `GPUIO_ERR_CANCELED` in every entry. Only a `count` of 0 or one no array can have (see
/// `gpuio_read_batch`) leaves the array untouched.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpuio_batch_result {
    /// The descriptor's status.
    pub status: gpuio_status,
    /// Bytes read.
    pub bytes: u64,
}

/// Most descriptors a batch may name: the most a C array of them can hold (no object is
/// larger than `isize::MAX` bytes). A larger `count` cannot describe real memory: it is
/// refused before anything is read or allocated (it used to reach `slice::from_raw_parts`,
/// undefined behaviour, and an allocation that panicked with "capacity overflow").
const MAX_DESCS: usize = isize::MAX as usize / size_of::<gpuio_batch_desc>();

/// Refuses a `count` no batch can have.
fn check_count(count: usize, call: &str) -> Result<(), Failure> {
    if count == 0 {
        return Err(Failure::invalid(format!("{call}: batch of 0 descriptors")));
    }
    if count > MAX_DESCS {
        return Err(Failure::invalid(format!(
            "{call}: a batch of {count} descriptors is more than any array holds (at most \
             {MAX_DESCS} descriptors of {} bytes)",
            size_of::<gpuio_batch_desc>()
        )));
    }
    Ok(())
}

/// The caller's results array (NULL, or `count` entries), written whatever becomes of the batch.
#[derive(Clone, Copy)]
struct Outputs {
    results: *mut gpuio_batch_result,
    count: usize,
}
// SAFETY: the array is only written by one thread at a time: the calling thread before a
// request starts, then the one task that runs it; the caller keeps it valid and unread until
// the request completes (the C contract).
unsafe impl Send for Outputs {}

impl Outputs {
    /// Writes `status` (and 0 bytes) into every entry: a batch refused or cancelled as a whole.
    ///
    /// # Safety
    /// `results` is NULL or has `count` writable elements.
    unsafe fn fail_all(&self, status: gpuio_status) {
        // No array: nothing to write (and no need to count up to `count`).
        if self.results.is_null() {
            return;
        }
        for i in 0..self.count {
            // SAFETY: forwarded from this function's contract.
            unsafe { self.write(i, gpuio_batch_result { status, bytes: 0 }) };
        }
    }

    /// Writes each descriptor's outcome; returns the bytes the successful ones read and the
    /// first failure, if any.
    ///
    /// # Safety
    /// `results` is NULL or has `count` writable elements.
    unsafe fn fill(
        &self,
        outcomes: impl Iterator<Item = Result<usize, Failure>>,
    ) -> (usize, Option<Failure>) {
        let mut first: Option<Failure> = None;
        let mut total = 0usize;
        for (i, r) in outcomes.enumerate().take(self.count) {
            let entry = match r {
                Ok(n) => {
                    total = total.saturating_add(n);
                    gpuio_batch_result {
                        status: gpuio_status::GPUIO_OK,
                        bytes: n as u64,
                    }
                }
                Err(f) => {
                    let status = f.status;
                    first.get_or_insert(f);
                    gpuio_batch_result { status, bytes: 0 }
                }
            };
            // SAFETY: forwarded from this function's contract.
            unsafe { self.write(i, entry) };
        }
        (total, first)
    }

    /// Writes entry `i` (nothing past `count`, nothing without an array).
    ///
    /// # Safety
    /// `results` is NULL or has `count` writable elements.
    unsafe fn write(&self, i: usize, entry: gpuio_batch_result) {
        if !self.results.is_null() && i < self.count {
            // SAFETY: `i < count`, and the array has `count` writable elements.
            unsafe { self.results.add(i).write(entry) };
        }
    }
}

/// A batch ready to run: the library's plan, and the descriptors refused before it.
struct Prepared {
    /// The plan and the engine of the first descriptor that names a live file; `None` when
    /// none does. Refused descriptors hold empty placeholders in the plan, so that it numbers
    /// the others (in its messages and results) as the caller did.
    plan: Option<(BatchPlan, Arc<EngineHandle>)>,
    /// Descriptors that cannot run at all (no file, a closed file, a length too large for
    /// this machine), in order, with why.
    refused: Vec<(usize, Failure)>,
    count: usize,
}

impl Prepared {
    /// Each descriptor's outcome, in order: the plan's, or why it was refused.
    fn outcomes(self, done: Option<BatchResult>) -> impl Iterator<Item = Result<usize, Failure>> {
        let mut planned = done.map(|d| d.into_results().into_iter());
        let mut refused = self.refused.into_iter().peekable();
        (0..self.count).map(move |i| {
            // The plan has a result for every descriptor, placeholders included.
            let from_plan = planned.as_mut().and_then(Iterator::next);
            match refused.next_if(|(j, _)| *j == i) {
                Some((_, f)) => Err(f),
                None => match from_plan {
                    Some(r) => r.map_err(Failure::from),
                    None => Err(Failure::new(
                        gpuio_status::GPUIO_ERR_INTERNAL,
                        format!("batch descriptor {i}: the batch gave no result for it"),
                    )),
                },
            }
        })
    }
}

/// What descriptor `i` reads, or why it cannot run.
fn resolve(
    i: usize,
    d: &gpuio_batch_desc,
) -> Result<(gpuio::File, Arc<EngineHandle>, usize, usize), Failure> {
    let numbered = |f: Failure| Failure {
        message: format!("batch descriptor {i}: {}", f.message),
        ..f
    };
    let handle = FILES.get(d.file).map_err(numbered)?;
    let engine = handle.engine().map_err(numbered)?;
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
    Ok((handle.file.clone(), engine, len, dst_offset))
}

/// The plan for `descs[..count]`: a descriptor that names no live file fails alone, as one
/// past the destination's end does.
///
/// # Safety
/// `descs` is NULL (an error) or has `count` readable elements; `count` passed `check_count`.
unsafe fn prepare(descs: *const gpuio_batch_desc, count: usize) -> Result<Prepared, Failure> {
    if descs.is_null() {
        return Err(Failure::invalid("batch descriptors: null pointer"));
    }
    // SAFETY: non-null with `count` readable elements (this function's contract), which
    // `check_count` keeps within isize::MAX bytes; the descriptor struct has no invalid bit
    // patterns.
    let descs = unsafe { std::slice::from_raw_parts(descs, count) };
    let mut list: Vec<Option<ReadDesc>> = Vec::new();
    // A count the caller's array holds may still be more than this process can allocate
    // again: a status, not an abort.
    list.try_reserve_exact(count).map_err(|e| {
        Failure::new(
            gpuio_status::GPUIO_ERR_NO_MEMORY,
            format!("batch of {count} descriptors: no memory for its plan: {e}"),
        )
    })?;
    // The first descriptor naming a live file: its engine serves the destination.
    let mut first_live: Option<(gpuio::File, Arc<EngineHandle>)> = None;
    let mut refused = Vec::new();
    for (i, d) in descs.iter().enumerate() {
        match resolve(i, d) {
            Ok((file, engine, len, dst_offset)) => {
                list.push(Some(ReadDesc::new(&file, d.offset, len, dst_offset)));
                first_live.get_or_insert((file, engine));
            }
            Err(f) => {
                refused.push((i, f));
                list.push(None);
            }
        }
    }
    let plan = match first_live {
        Some((file, engine)) => {
            // An empty read claims no destination bytes and reads nothing: the refused
            // descriptors' places, so that the plan numbers the rest as the caller did.
            let list = list
                .into_iter()
                .map(|d| d.unwrap_or_else(|| ReadDesc::new(&file, 0, 0, 0)))
                .collect();
            Some((BatchPlan::new(list), engine))
        }
        None => None,
    };
    Ok(Prepared {
        plan,
        refused,
        count,
    })
}

async fn run(plan: &BatchPlan, dst: Dst) -> BatchResult {
    match dst {
        Dst::Host(buf) => plan.read_into(buf).await,
        Dst::Device(mut d) => plan.read_into(&mut d.range).await,
    }
}

/// Reads `count` descriptors into one destination `dst` (host or device memory) as one batch
/// (contiguous neighbours merge into one read; all in flight at once). `results` (NULL, or
/// `count` elements) gets each descriptor's outcome, always (see `gpuio_batch_result`);
/// `*total` (if not NULL) is always written: the bytes the descriptors that succeeded read (0
/// when the call fails before reading). Returns `GPUIO_OK` if every descriptor succeeded, else
/// the first failing descriptor's status and message: a descriptor naming no file or a closed
/// one, past `dst`'s end, or overlapping another's destination range fails alone, and the
/// others are read. A `count` of 0, or more descriptors than any array holds (over
/// `isize::MAX` bytes of them), is `GPUIO_ERR_INVALID` before anything is read. Device memory
/// with a NULL stream: complete when the data is there; with a stream: the copies are queued
/// on it. Blocks.
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
        // SAFETY: NULL or writable (this function's contract): 0 until bytes are read.
        unsafe { store(total, 0) };
        check_count(count, "gpuio_read_batch")?;
        let out = Outputs { results, count };
        // SAFETY: forwarded from this function's contract.
        match unsafe { read_batch(descs, count, dst, &out) } {
            Ok((n, first)) => {
                // SAFETY: as above.
                unsafe { store(total, n) };
                first.map_or(Ok(()), Err)
            }
            Err(refusal) => {
                // SAFETY: `results` is NULL or has `count` writable elements (the contract).
                unsafe { out.fail_all(refusal.status) };
                Err(refusal)
            }
        }
    })
}

/// `gpuio_read_batch` past its count check: the bytes read and the first failure, with every
/// result written; or why the batch was refused as a whole (nothing written yet).
///
/// # Safety
/// As for `gpuio_read_batch`.
unsafe fn read_batch(
    descs: *const gpuio_batch_desc,
    count: usize,
    dst: *const gpuio_buffer,
    out: &Outputs,
) -> Result<(usize, Option<Failure>), Failure> {
    refuse_on_executor("gpuio_read_batch")?;
    // SAFETY: forwarded from this function's contract.
    let prepared = unsafe { prepare(descs, count) }?;
    let (done, settled) = match &prepared.plan {
        Some((plan, engine)) => {
            // SAFETY: forwarded; the call ends after the batch.
            let dst = unsafe { memory::dst(engine, dst) }?;
            let settle = settle_stream(&dst);
            let done = match dst {
                // Lent for the call, so the kernel reads into it in place.
                Dst::Host(buf) => plan.read_into_blocking(buf),
                dst => futures::executor::block_on(run(plan, dst)),
            };
            // Settle before reporting, failures included: some copies may have been queued.
            let settled = settle.map(|d| futures::executor::block_on(d.settle(&engine.engine)));
            (Some(done), settled)
        }
        None => (None, None),
    };
    // SAFETY: forwarded from this function's contract.
    let (n, first) = unsafe { out.fill(prepared.outcomes(done)) };
    // A descriptor's own failure comes first; else copies that did not settle.
    let first = first.or_else(|| settled.and_then(|s| s.err().map(Failure::from)));
    Ok((n, first))
}

/// A batch's device destination named no stream: a copy of its handle to wait for after.
fn settle_stream(dst: &Dst) -> Option<memory::Settle> {
    match dst {
        Dst::Host(_) => None,
        Dst::Device(d) => d.settler(),
    }
}

/// Starts a batch (as `gpuio_read_batch`) and stores its request in `*out`; the request's
/// bytes are the total (0 when a descriptor failed: the results say what each one read).
/// **`dst`'s memory and the `results` array must stay valid until the request completes**;
/// `descs` may go at once. `results` is written as for `gpuio_read_batch`: at once when this
/// call fails (with the descriptors' own failures when none names a live file, so that no
/// request can run), else by the time the request completes (`GPUIO_ERR_CANCELED` in every
/// entry of a request cancelled first).
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
        check_count(count, "gpuio_read_batch_async")?;
        let outputs = Outputs { results, count };
        if out.is_null() {
            let refusal = Failure::invalid("gpuio_read_batch_async: out is a null pointer");
            // SAFETY: `results` is NULL or has `count` writable elements (the contract).
            unsafe { outputs.fail_all(refusal.status) };
            return Err(refusal);
        }
        // SAFETY: forwarded from this function's contract.
        match unsafe { start_batch(descs, count, dst, outputs, callback, user_data) } {
            Ok(token) => {
                // SAFETY: checked non-null; the caller made it writable.
                unsafe { *out = std::ptr::without_provenance_mut::<gpuio_request>(token as usize) };
                Ok(())
            }
            Err(Refused::Written(first)) => Err(first),
            Err(Refused::Whole(refusal)) => {
                // SAFETY: `results` is NULL or has `count` writable elements (the contract);
                // no request runs that could write it.
                unsafe { outputs.fail_all(refusal.status) };
                Err(refusal)
            }
        }
    })
}

/// Why an asynchronous batch did not start.
enum Refused {
    /// Refused as a whole: every result is still to be written.
    Whole(Failure),
    /// No descriptor names a live file: each result holds its own failure; this is the first.
    Written(Failure),
}

/// `gpuio_read_batch_async` past its argument checks: the new request's token.
///
/// # Safety
/// As for `gpuio_read_batch_async`.
unsafe fn start_batch(
    descs: *const gpuio_batch_desc,
    count: usize,
    dst: *const gpuio_buffer,
    outputs: Outputs,
    callback: gpuio_callback,
    user_data: *mut libc::c_void,
) -> Result<u64, Refused> {
    // SAFETY: forwarded from this function's contract.
    let prepared = unsafe { prepare(descs, count) }.map_err(Refused::Whole)?;
    let Some((_, engine)) = &prepared.plan else {
        // Nothing can run, and there is no engine to run a request on: each descriptor's
        // failure now.
        // SAFETY: forwarded from this function's contract.
        let (_, first) = unsafe { outputs.fill(prepared.outcomes(None)) };
        return Err(Refused::Written(first.unwrap_or_else(|| {
            Failure::invalid("gpuio_read_batch_async: no descriptor names a live file")
        })));
    };
    let engine = engine.clone();
    // SAFETY: forwarded (valid until completion).
    let dst = unsafe { memory::dst(&engine, dst) }.map_err(Refused::Whole)?;
    let settle = settle_stream(&dst);
    // What a request cancelled before it writes its outcomes (its future dropped, perhaps
    // never polled) leaves behind.
    // SAFETY: `results` is NULL or has `count` writable elements, valid until completion.
    unsafe { outputs.fail_all(gpuio_status::GPUIO_ERR_CANCELED) };
    let reactor = engine.engine.clone();
    let op = async move {
        let done = match &prepared.plan {
            Some((plan, _)) => Some(run(plan, dst).await),
            None => None,
        };
        let settled = match settle {
            Some(d) => d.settle(&reactor).await,
            None => Ok(()),
        };
        // SAFETY: the caller keeps `results` (NULL or `count` elements) valid until this
        // request completes, which is after this write.
        let (n, first) = unsafe { outputs.fill(prepared.outcomes(done)) };
        match first {
            Some(f) => Err(f),
            None => settled.map(|()| n).map_err(Failure::from),
        }
    };
    // Not started (the engine is being freed): the caller writes the refusal over the
    // placeholders.
    submit(&engine, op, callback, user_data).map_err(Refused::Whole)
}
