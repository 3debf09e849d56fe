//! The io_uring ceiling for small O_DIRECT reads from one thread, and what each part of
//! gpuio's reactor design costs on top of it: a single thread keeps `QD` 4 KiB random reads in
//! the kernel (as fio does), optionally with the ring flags the reactor uses, with an eventfd
//! read armed beside the I/O (the reactor's doorbell), or with every completion handed to
//! another thread that sends the next request back (the future's round trip).
//!
//! `cargo run --release --example uring_ceiling -- FILE [QD] [SECONDS] [VARIANT...]`, variants
//! `defer` (SINGLE_ISSUER|DEFER_TASKRUN), `doorbell` (eventfd read armed), `handoff`
//! (completions round-trip through a second thread), `peers16` (through sixteen threads in
//! turn). The file (or block device) must exist and be at least 1 MiB; it is only read.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};

const BS: usize = 4096;
const DOORBELL: u64 = u64::MAX;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        return Err("usage: uring_ceiling FILE [QD] [SECONDS] [defer] [doorbell] [handoff]".into());
    };
    let qd: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let secs: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let has = |v: &str| args.iter().skip(3).any(|a| a == v);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    // A block device's metadata says 0 bytes; the library asks the device.
    let blocks = gpuio::plan::align::file_len(std::os::fd::AsFd::as_fd(&file))? / BS as u64;
    if blocks < 256 {
        return Err("the file must be at least 1 MiB".into());
    }
    let mut ring = if has("defer") {
        IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .build((qd as u32 + 1).next_power_of_two())?
    } else {
        IoUring::new((qd as u32 + 1).next_power_of_two())?
    };
    // One aligned buffer per slot.
    let layout = std::alloc::Layout::from_size_align(qd * BS, BS)?;
    // SAFETY: the layout has a non-zero size; the memory is freed at the end.
    let mem = unsafe { std::alloc::alloc_zeroed(layout) };
    if mem.is_null() {
        return Err("out of memory".into());
    }
    // SAFETY: a fresh eventfd; the result is checked.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if efd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let mut bell = 0u64;
    let mut rng = fastrand::Rng::with_seed(7);
    let fd = types::Fd(file.as_raw_fd());
    let push = |ring: &mut IoUring, slot: usize, off: u64| {
        // SAFETY: the slot's buffer lies inside `mem`, which outlives the ring's use of it
        // (every read completes before the loop ends); one slot has one read at a time.
        let sqe = opcode::Read::new(fd, unsafe { mem.add(slot * BS) }, BS as u32)
            .offset(off)
            .build()
            .user_data(slot as u64);
        // SAFETY: as above; the queue has room (entries > qd + 1).
        unsafe { ring.submission().push(&sqe) }.map_err(|_| "submission queue full")
    };
    // The hand-off partners (one, or `peers16`: sixteen, taking turns, as runtime workers
    // would): each gets a finished slot and answers with the slot to read next.
    let handoff = has("handoff") || has("peers16");
    let npeers = if has("peers16") { 16 } else { 1 };
    let (peer_tx, from_peer) = mpsc::channel::<usize>();
    let mut to_peers = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..if handoff { npeers } else { 0 } {
        let (to_peer, peer_rx) = mpsc::channel::<usize>();
        let peer_tx = peer_tx.clone();
        to_peers.push(to_peer);
        peers.push(std::thread::spawn(move || {
            for slot in peer_rx {
                if peer_tx.send(slot).is_err() {
                    break;
                }
                let one = 1u64;
                // SAFETY: writes 8 bytes from a live u64 to our eventfd.
                unsafe { libc::write(efd, (&one as *const u64).cast(), 8) };
            }
        }));
    }
    drop(peer_tx);
    let mut next_peer = 0usize;
    for slot in 0..qd {
        push(&mut ring, slot, rng.u64(0..blocks) * BS as u64)?;
    }
    let mut armed = false;
    let mut done = 0u64;
    let mut outstanding = qd;
    let start = Instant::now();
    let run = Duration::from_secs_f64(secs);
    while outstanding > 0 {
        if (has("doorbell") || handoff) && !armed {
            let sqe = opcode::Read::new(types::Fd(efd), (&mut bell as *mut u64).cast(), 8)
                .build()
                .user_data(DOORBELL);
            // SAFETY: `bell` outlives the ring's use of it (the ring is dropped first below
            // only after the read completed or the process exits).
            unsafe { ring.submission().push(&sqe) }.map_err(|_| "submission queue full")?;
            armed = true;
        }
        ring.submit_and_wait(1)?;
        let finished: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let running = start.elapsed() < run;
        for (slot, res) in finished {
            if slot == DOORBELL {
                armed = false;
                continue;
            }
            if res != BS as i32 {
                return Err(format!("read returned {res}").into());
            }
            done += 1;
            outstanding -= 1;
            if !running {
                continue;
            }
            if handoff {
                to_peers[next_peer % npeers].send(slot as usize)?;
                next_peer += 1;
            } else {
                push(&mut ring, slot as usize, rng.u64(0..blocks) * BS as u64)?;
                outstanding += 1;
            }
        }
        if handoff {
            while let Ok(slot) = from_peer.try_recv() {
                push(&mut ring, slot, rng.u64(0..blocks) * BS as u64)?;
                outstanding += 1;
            }
            // Slots still with the peer come back later: wait for them while running.
            if running && outstanding == 0 {
                let slot = from_peer.recv()?;
                push(&mut ring, slot, rng.u64(0..blocks) * BS as u64)?;
                outstanding += 1;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    drop(to_peers);
    for p in peers {
        let _ = p.join();
    }
    // Retire the doorbell read before the ring goes.
    if armed {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(efd, (&one as *const u64).cast(), 8) };
        ring.submit_and_wait(1)?;
    }
    drop(ring);
    // SAFETY: allocated above with this layout; no read is outstanding any more.
    unsafe { std::alloc::dealloc(mem, layout) };
    // SAFETY: our eventfd, closed once.
    unsafe { libc::close(efd) };
    let variants: Vec<&str> = args.iter().skip(3).map(String::as_str).collect();
    println!(
        "uring_ceiling qd={qd} [{}]: {:.0} IOPS",
        variants.join(","),
        done as f64 / secs
    );
    Ok(())
}
