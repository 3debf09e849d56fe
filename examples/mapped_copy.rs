//! Page-cache pages copied into GPU memory by the GPU itself, no CPU copy: what it costs to map
//! a warm file, register the mapping with the driver (`cuMemHostRegister`, read-only) and DMA
//! from it, against the CPU copy gpuio's bounce path makes of every byte.
//!
//! A warm read into GPU memory through the bounce path costs one CPU copy per byte (the page
//! cache into a pinned slot, about 4 GB/s per core) before the DMA: on the 16-core H100 host
//! twelve of those copies are the ceiling. Registering the file's pages instead pins them
//! (the kernel's `pin_user_pages` on the mapping) and the DMA reads the page cache directly.
//! This probe says whether the kernel allows it (file-backed pages, long-term read-only pins)
//! and what the registration costs per byte, for a few piece sizes and thread counts.
//!
//! `cargo run --release --example mapped_copy FILE [GiB [SECONDS THREADS [contexts]]]`
//! (default 4 GiB, at most the file's size; with SECONDS, one timed row instead of the table,
//! to run beside another reader; with `contexts`, each thread in a context of its own): read
//! FILE once first so it is in the page cache. Prints "SKIPPED" and exits 0 where
//! no GPU exists.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use gpuio::cuda::cudarc::driver::{CudaContext, DevicePtrMut, sys};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn main() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: mapped_copy FILE [GiB [SECONDS THREADS [contexts]]]");
        std::process::exit(2);
    };
    let gib: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(4);
    // `SECONDS THREADS`: one timed row (16 MiB pieces, one mapping) instead of the table.
    let timed: Option<f64> = args.next().and_then(|s| s.parse().ok());
    let timed_threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    // `contexts`: each thread registers and copies in a context of its own.
    let own_contexts = args.next().as_deref() == Some("contexts");
    let ctx = match gpuio::cuda::context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("SKIPPED mapped_copy: {e}");
            return Ok(());
        }
    };
    let file = std::fs::File::open(&path)?;
    let span = (gib << 30).min(file.metadata()?.len());
    if span < 64 << 20 {
        // The largest piece below; a smaller span has no whole piece to read.
        return Err(format!("{path}: at least 64 MiB are needed, {span} bytes to read").into());
    }
    // One mapping of the whole span, made once: pieces are registered within it, so no piece
    // pays for building or tearing down page tables (munmap's TLB shootdowns).
    let t = Instant::now();
    // SAFETY: a fresh read-only shared mapping of `span` bytes of an open file at offset 0,
    // unmapped at the end of main; nothing reads it but the driver's pins and the GPU.
    let whole = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if whole == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().into());
    }
    println!(
        "one mapping of {} MiB: {:.0} us",
        span >> 20,
        t.elapsed().as_secs_f64() * 1e6
    );
    if let (Some(secs), true) = (timed, own_contexts) {
        let gbps = run_own_contexts(whole as usize, span, 16 << 20, timed_threads, secs)?;
        println!(
            "one mapping, 16 MiB pieces, {timed_threads} threads with a context each, {secs} s: \
             {gbps:.2} GB/s"
        );
        // SAFETY: `whole` is the mapping made above; every registration within it has ended.
        unsafe { libc::munmap(whole, span as usize) };
        return Ok(());
    }
    if let Some(secs) = timed {
        // Beside another reader (a second process): one row, this many seconds.
        let r = run(
            &ctx,
            &file,
            span,
            16 << 20,
            timed_threads,
            Some(whole as usize),
            Some(Duration::from_secs_f64(secs)),
        )?;
        println!(
            "one mapping, 16 MiB pieces, {timed_threads} threads, {secs} s: {:.2} GB/s, {:.2} \
             cores; {}",
            r.gbps, r.cores, r.check
        );
        // SAFETY: `whole` is the mapping made above; every registration within it has ended.
        unsafe { libc::munmap(whole, span as usize) };
        return Ok(());
    }
    let modes: [(&str, Option<usize>); 2] = [
        ("one mapping", Some(whole as usize)),
        ("mapped per piece", None),
    ];
    for (mode, base) in modes {
        for piece_mib in [2usize, 16, 64] {
            for threads in [1usize, 2, 4, 8] {
                if base.is_none() && threads == 2 {
                    continue;
                }
                let r = run(&ctx, &file, span, piece_mib << 20, threads, base, None)?;
                println!(
                    "{mode}, {piece_mib:3} MiB pieces, {threads} threads: {:.2} GB/s, {:.2} \
                     cores ({:.2} CPU s/GB); per piece: (map+)register {:.0} us, copy {:.0} \
                     us, unregister(+unmap) {:.0} us; {}",
                    r.gbps,
                    r.cores,
                    r.cores / r.gbps,
                    r.register_us,
                    r.copy_us,
                    r.unregister_us,
                    r.check
                );
            }
        }
    }
    // SAFETY: `whole` is the mapping made above; every registration within it has ended.
    unsafe { libc::munmap(whole, span as usize) };
    Ok(())
}

struct Row {
    gbps: f64,
    cores: f64,
    register_us: f64,
    copy_us: f64,
    unregister_us: f64,
    check: String,
}

/// One thread's pieces: how many, the time in each step, and what the content check found.
type Tally = (u64, Duration, Duration, Duration, String);

/// User + system CPU seconds of this process so far (NaN where the kernel would not say).
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given; a zeroed one is a valid input.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage struct.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return f64::NAN;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Every thread takes the next piece of the span until it is read once; each piece is mapped,
/// registered, copied on the thread's stream, waited for, unregistered and unmapped.
fn run(
    ctx: &std::sync::Arc<CudaContext>,
    file: &std::fs::File,
    span: u64,
    piece: usize,
    threads: usize,
    base: Option<usize>,
    run_for: Option<Duration>,
) -> Res<Row> {
    let next = std::sync::atomic::AtomicU64::new(0);
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let per_thread: Vec<Res<Tally>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Res<Tally> {
                    ctx.bind_to_thread()?;
                    let stream = ctx.new_stream()?;
                    let mut dst = stream.alloc_zeros::<u8>(piece)?;
                    let (mut n, mut reg, mut copy, mut unreg) =
                        (0u64, Duration::ZERO, Duration::ZERO, Duration::ZERO);
                    let mut check = String::from("contents not checked");
                    loop {
                        let mut off =
                            next.fetch_add(piece as u64, std::sync::atomic::Ordering::Relaxed);
                        match run_for {
                            // Timed: round and round the span until the time is up.
                            Some(d) if t0.elapsed() < d => {
                                off %= span - span % piece as u64;
                            }
                            Some(_) => break,
                            None if off + piece as u64 > span => break,
                            None => {}
                        }
                        let t = Instant::now();
                        let p = if let Some(b) = base {
                            (b + off as usize) as *mut libc::c_void
                        } else {
                            // SAFETY: a fresh read-only shared mapping of `piece` bytes of an
                            // open file at a page-aligned offset; unmapped below.
                            unsafe {
                                libc::mmap(
                                    std::ptr::null_mut(),
                                    piece,
                                    libc::PROT_READ,
                                    libc::MAP_SHARED | libc::MAP_POPULATE,
                                    file.as_raw_fd(),
                                    off as libc::off_t,
                                )
                            }
                        };
                        if p == libc::MAP_FAILED {
                            return Err(std::io::Error::last_os_error().into());
                        }
                        // SAFETY: `p` is a live mapping of `piece` bytes; read-only
                        // registration matches its protection.
                        let rc = unsafe {
                            sys::cuMemHostRegister_v2(p, piece, sys::CU_MEMHOSTREGISTER_READ_ONLY)
                        };
                        if rc != sys::CUresult::CUDA_SUCCESS {
                            if base.is_none() {
                                // SAFETY: `p` is the mapping made above, unused after this.
                                unsafe { libc::munmap(p, piece) };
                            }
                            return Err(
                                format!("cuMemHostRegister on a file mapping: {rc:?}").into()
                            );
                        }
                        let t1 = Instant::now();
                        {
                            let (dptr, _rec) = dst.device_ptr_mut(&stream);
                            // SAFETY: `p` is registered and `piece` bytes long; `dst` holds
                            // `piece` bytes; the stream is waited for before either goes.
                            let rc = unsafe {
                                sys::cuMemcpyHtoDAsync_v2(dptr, p, piece, stream.cu_stream())
                            };
                            if rc != sys::CUresult::CUDA_SUCCESS {
                                return Err(format!("copy: {rc:?}").into());
                            }
                        }
                        stream.synchronize()?;
                        let t2 = Instant::now();
                        if n == 0 {
                            // The first piece: its first and last 4 KiB as the GPU got
                            // them, against a pread of the same bytes.
                            let got = stream.clone_dtoh(&dst)?;
                            let mut want = vec![0u8; piece];
                            std::os::unix::fs::FileExt::read_exact_at(file, &mut want, off)?;
                            check = if got[..4096] == want[..4096]
                                && got[piece - 4096..] == want[piece - 4096..]
                            {
                                "contents match a pread".into()
                            } else {
                                "CONTENTS DIFFER from a pread".into()
                            };
                        }
                        // The check above is not part of any step's time.
                        let t3 = Instant::now();
                        // SAFETY: `p` was registered above and its copy has completed.
                        let rc = unsafe { sys::cuMemHostUnregister(p) };
                        if base.is_none() {
                            // SAFETY: `p` is the mapping made above, no longer used.
                            unsafe { libc::munmap(p, piece) };
                        }
                        if rc != sys::CUresult::CUDA_SUCCESS {
                            return Err(format!("cuMemHostUnregister: {rc:?}").into());
                        }
                        reg += t1 - t;
                        copy += t2 - t1;
                        unreg += t3.elapsed();
                        n += 1;
                    }
                    Ok((n, reg, copy, unreg, check))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into())))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let cores = (cpu_seconds() - cpu0) / secs;
    let (mut n, mut reg, mut copy, mut unreg, mut check) = (
        0u64,
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
        String::new(),
    );
    for r in per_thread {
        let (tn, tr, tc, tu, tk) = r?;
        n += tn;
        reg += tr;
        copy += tc;
        unreg += tu;
        if check.is_empty() || tk.starts_with("CONTENTS") {
            check = tk;
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n.max(1) as f64;
    Ok(Row {
        gbps: (n * piece as u64) as f64 / secs / 1e9,
        cores,
        register_us: per(reg),
        copy_us: per(copy),
        unregister_us: per(unreg),
        check,
    })
}

/// Threads that each create a context of their own on device 0 and register, copy and
/// unregister 16 MiB pieces of the mapping at `base` there, for `secs`: whether the driver's
/// registration lock is the process's or the context's.
fn run_own_contexts(base: usize, span: u64, piece: usize, threads: usize, secs: f64) -> Res<f64> {
    let ok = |rc: sys::CUresult, what: &str| -> Res<()> {
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {rc:?}").into())
        }
    };
    let next = std::sync::atomic::AtomicU64::new(0);
    let t0 = Instant::now();
    let run_for = Duration::from_secs_f64(secs);
    let bytes: Vec<Res<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Res<u64> {
                    let mut dev = 0;
                    let mut ctx: sys::CUcontext = std::ptr::null_mut();
                    let mut stream: sys::CUstream = std::ptr::null_mut();
                    let mut dst: sys::CUdeviceptr = 0;
                    // SAFETY: out-pointers to locals; the context is made current on this
                    // thread before the stream and the allocation are made in it, and all
                    // three are destroyed below, after the last copy was waited for.
                    unsafe {
                        ok(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet")?;
                        ok(
                            sys::cuCtxCreate_v4(&mut ctx, std::ptr::null_mut(), 0, dev),
                            "cuCtxCreate",
                        )?;
                        ok(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
                        ok(sys::cuStreamCreate(&mut stream, 0), "cuStreamCreate")?;
                        ok(sys::cuMemAlloc_v2(&mut dst, piece), "cuMemAlloc")?;
                    }
                    let mut moved = 0u64;
                    while t0.elapsed() < run_for {
                        let off = next
                            .fetch_add(piece as u64, std::sync::atomic::Ordering::Relaxed)
                            % (span - span % piece as u64);
                        let p = (base + off as usize) as *mut libc::c_void;
                        // SAFETY: `p` lies in the live read-only mapping (`off + piece` within the
                        // span); `dst` holds `piece` bytes; the copy is waited for before the
                        // range is unregistered.
                        unsafe {
                            ok(
                                sys::cuMemHostRegister_v2(
                                    p,
                                    piece,
                                    sys::CU_MEMHOSTREGISTER_READ_ONLY,
                                ),
                                "register",
                            )?;
                            ok(sys::cuMemcpyHtoDAsync_v2(dst, p, piece, stream), "copy")?;
                            ok(sys::cuStreamSynchronize(stream), "sync")?;
                            ok(sys::cuMemHostUnregister(p), "unregister")?;
                        }
                        moved += piece as u64;
                    }
                    // SAFETY: made above on this thread; nothing is in flight.
                    unsafe {
                        ok(sys::cuMemFree_v2(dst), "cuMemFree")?;
                        ok(sys::cuStreamDestroy_v2(stream), "cuStreamDestroy")?;
                        ok(sys::cuCtxDestroy_v2(ctx), "cuCtxDestroy")?;
                    }
                    Ok(moved)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into())))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut total = 0u64;
    for b in bytes {
        total += b?;
    }
    Ok(total as f64 / secs / 1e9)
}
