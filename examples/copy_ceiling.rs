//! Host-to-device copy ceilings on this machine: pinned and pageable `cuMemcpyHtoDAsync`
//! bandwidth, the numbers gpuio's bounce path is measured against; and the rate of small
//! (4 KiB) copies, each followed by an event record as gpuio's bounce path issues them, from
//! 1, 4 and 16 threads: the ceiling of 4 KiB random reads into GPU memory for any path that
//! copies each block on its own.
//!
//! Then the cost of each driver call the bounce path makes per piece (copy, event record,
//! stream wait, event query, all five of a piece together, and a 64-copy
//! `cuMemcpyBatchAsync` from pinned memory and from pageable memory read during the call, as
//! the page-cache fast path issues it), from 1, 4, 8 and 16 threads with a stream each, and from 16 threads
//! that take turns through one lock: what decides how the per-piece work should be issued.
//!
//! `cargo run --release --example copy_ceiling [MiB]` (default 1024). Prints
//! "SKIPPED" and exits 0 where no GPU exists.

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let ctx = match gpuio::cuda::context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("SKIPPED copy_ceiling: {e}");
            return Ok(());
        }
    };
    let len = mib << 20;
    let stream = ctx.new_stream()?;
    let mut dst = stream.alloc_zeros::<u8>(len)?;
    // SAFETY: the pinned buffer is fully written before any copy reads it.
    let mut pinned = unsafe { ctx.alloc_pinned::<u8>(len)? };
    pinned.as_mut_slice()?.fill(7);
    let pageable = vec![7u8; len];
    let mut results = Vec::new();
    for (name, rounds) in [("pinned", 5), ("pageable", 3)] {
        let mut best = 0.0f64;
        for _ in 0..rounds {
            let t = Instant::now();
            if name == "pinned" {
                stream.memcpy_htod(&pinned, &mut dst)?;
            } else {
                stream.memcpy_htod(&pageable, &mut dst)?;
            }
            stream.synchronize()?;
            best = best.max(len as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        results.push((name, best));
    }
    for (name, gbps) in &results {
        println!("host-to-device {name:8} {mib} MiB: best {gbps:.1} GB/s");
    }
    for threads in [1usize, 4, 16] {
        let rate = small_copy_rate(&ctx, threads, 4096, std::time::Duration::from_secs(1))?;
        println!(
            "host-to-device 4 KiB copies + event, {threads:2} threads: {:.1} k copies/s",
            rate / 1e3
        );
    }
    for call in CALLS {
        let mut row = format!("driver call {:>22}:", call.name());
        for (threads, serialized) in [
            (1usize, false),
            (4, false),
            (8, false),
            (16, false),
            (16, true),
        ] {
            let rate = call_rate(&ctx, *call, threads, serialized, 0.5)?;
            row += &format!(
                "  {threads:2}{} {:6.0} k/s",
                if serialized { "L" } else { " " },
                rate / 1e3
            );
        }
        println!("{row}");
    }
    Ok(())
}

/// One kind of driver work a bounce-path piece needs.
#[derive(Clone, Copy)]
enum Call {
    Copy,
    Record,
    Wait,
    Query,
    /// wait, wait, copy, record, record: a piece as the bounce path issues it.
    Piece,
    /// 64 copies in one `cuMemcpyBatchAsync` (counted per copy).
    Batch64,
    /// 64 copies in one `cuMemcpyBatchAsync` from pageable memory, each source read before
    /// the call returns, as the page-cache fast path issues them (counted per copy).
    Batch64Pageable,
}

const CALLS: &[Call] = &[
    Call::Copy,
    Call::Record,
    Call::Wait,
    Call::Query,
    Call::Piece,
    Call::Batch64,
    Call::Batch64Pageable,
];

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Copy => "4 KiB copy",
            Call::Record => "event record",
            Call::Wait => "stream wait event",
            Call::Query => "event query",
            Call::Piece => "piece (5 calls)",
            Call::Batch64 => "batch of 64 (per copy)",
            Call::Batch64Pageable => "pageable batch of 64",
        }
    }
}

/// Driver calls (copies for `Batch64`) per second of `call`, from `threads` threads with a
/// stream each; `serialized`: the threads take turns through one mutex.
fn call_rate(
    ctx: &std::sync::Arc<gpuio::cuda::cudarc::driver::CudaContext>,
    call: Call,
    threads: usize,
    serialized: bool,
    secs: f64,
) -> Result<f64, Box<dyn std::error::Error>> {
    use gpuio::cuda::cudarc::driver::sys;
    const LEN: usize = 4096;
    const BATCH: usize = 64;
    let lock = std::sync::Mutex::new(());
    let run = std::time::Duration::from_secs_f64(secs);
    let lock = &lock;
    let total = on_threads(threads, move || -> Result<u64, String> {
        let e = |e: gpuio::cuda::cudarc::driver::DriverError| format!("{e:?}");
        let ok = |rc: sys::CUresult, what: &str| {
            if rc == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("{what}: {rc:?}"))
            }
        };
        ctx.bind_to_thread().map_err(e)?;
        let stream = ctx.new_stream().map_err(e)?;
        let dst = stream.alloc_zeros::<u8>(LEN * BATCH).map_err(e)?;
        // SAFETY: written in full before any copy reads it.
        let mut src = unsafe { ctx.alloc_pinned::<u8>(LEN * BATCH) }.map_err(e)?;
        src.as_mut_slice().map_err(e)?.fill(1);
        // The page-cache fast path's source: plain (pageable) memory the driver stages.
        let pageable = vec![1u8; LEN * BATCH];
        let src_ptr = match call {
            Call::Batch64Pageable => pageable.as_ptr() as u64,
            _ => src.as_ptr().map_err(e)? as u64,
        };
        let (dptr, _g) = gpuio::cuda::cudarc::driver::DevicePtr::device_ptr(&dst, &stream);
        let ev = ctx.new_event(None).map_err(e)?;
        let ev2 = ctx.new_event(None).map_err(e)?;
        ev.record(&stream).map_err(e)?;
        ev2.record(&stream).map_err(e)?;
        let cs = stream.cu_stream();
        let mut dsts: Vec<u64> = (0..BATCH as u64).map(|i| dptr + i * LEN as u64).collect();
        let mut srcs: Vec<u64> = (0..BATCH as u64)
            .map(|i| src_ptr + i * LEN as u64)
            .collect();
        let mut sizes = vec![LEN; BATCH];
        // SAFETY: an all-zero attribute block is valid plain data; the fields that
        // matter are set next.
        let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = match call {
            Call::Batch64Pageable => {
                sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL
            }
            _ => sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        };
        let mut attr_idx = [0usize];
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < run {
            let _turn = serialized.then(|| lock.lock().unwrap_or_else(|p| p.into_inner()));
            // SAFETY: every pointer is a live allocation of this context (or, for the
            // pageable batch, plain host memory read before the call returns) of at least
            // the bytes named; the events and stream belong to it.
            unsafe {
                match call {
                    Call::Copy => ok(
                        sys::cuMemcpyHtoDAsync_v2(dptr, src_ptr as *const _, LEN, cs),
                        "copy",
                    )?,
                    Call::Record => ok(sys::cuEventRecord(ev.cu_event(), cs), "record")?,
                    Call::Wait => ok(sys::cuStreamWaitEvent(cs, ev2.cu_event(), 0), "wait")?,
                    Call::Query => {
                        let rc = sys::cuEventQuery(ev2.cu_event());
                        if rc != sys::CUresult::CUDA_ERROR_NOT_READY {
                            ok(rc, "query")?;
                        }
                    }
                    Call::Piece => {
                        ok(sys::cuStreamWaitEvent(cs, ev2.cu_event(), 0), "wait")?;
                        ok(sys::cuStreamWaitEvent(cs, ev2.cu_event(), 0), "wait")?;
                        ok(
                            sys::cuMemcpyHtoDAsync_v2(dptr, src_ptr as *const _, LEN, cs),
                            "copy",
                        )?;
                        ok(sys::cuEventRecord(ev2.cu_event(), cs), "record")?;
                        ok(sys::cuEventRecord(ev.cu_event(), cs), "record")?;
                    }
                    Call::Batch64 | Call::Batch64Pageable => {
                        ok(
                            sys::cuMemcpyBatchAsync_v2(
                                dsts.as_mut_ptr(),
                                srcs.as_mut_ptr(),
                                sizes.as_mut_ptr(),
                                BATCH,
                                &mut attr,
                                attr_idx.as_mut_ptr(),
                                1,
                                cs,
                            ),
                            "batch copy",
                        )?;
                        n += BATCH as u64 - 1;
                    }
                }
            }
            n += 1;
        }
        stream.synchronize().map_err(e)?;
        Ok(n)
    })?;
    Ok(total as f64 / secs)
}

/// Runs `work` on `threads` threads at once and adds up what each counted.
fn on_threads(
    threads: usize,
    work: impl Fn() -> Result<u64, String> + Sync,
) -> Result<u64, String> {
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads).map(|_| s.spawn(&work)).collect();
        let mut total = 0;
        for w in workers {
            total += w
                .join()
                .map_err(|_| "measuring thread panicked".to_string())??;
        }
        Ok(total)
    })
}

/// Copies of `len` pinned bytes to the device per second, each followed by an event record
/// (what the bounce path does per piece), from `threads` threads with a stream each.
fn small_copy_rate(
    ctx: &std::sync::Arc<gpuio::cuda::cudarc::driver::CudaContext>,
    threads: usize,
    len: usize,
    run: std::time::Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let total = on_threads(threads, || -> Result<u64, String> {
        let e = |e: gpuio::cuda::cudarc::driver::DriverError| format!("{e:?}");
        ctx.bind_to_thread().map_err(e)?;
        let stream = ctx.new_stream().map_err(e)?;
        let mut dst = stream.alloc_zeros::<u8>(len).map_err(e)?;
        // SAFETY: written in full before any copy reads it.
        let mut src = unsafe { ctx.alloc_pinned::<u8>(len) }.map_err(e)?;
        src.as_mut_slice().map_err(e)?.fill(1);
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < run {
            stream.memcpy_htod(&src, &mut dst).map_err(e)?;
            let _event = stream.record_event(None).map_err(e)?;
            n += 1;
        }
        stream.synchronize().map_err(e)?;
        Ok(n)
    })?;
    Ok(total as f64 / run.as_secs_f64())
}
