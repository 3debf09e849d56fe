//! UCX in one process: one context, two workers connected to each other (UCX picks shared
//! memory or TCP over loopback), driven from one thread. Without libucp the tests say
//! `SKIPPED` and pass, unless `GPUIO_UCX_REQUIRED=1` (CI) makes that a failure.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use super::*;

const DEADLINE: Duration = Duration::from_secs(10);

fn lib_or_skip() -> Option<&'static UcxLib> {
    match library() {
        Ok(lib) => Some(lib),
        Err(e) => {
            if std::env::var("GPUIO_UCX_REQUIRED").is_ok_and(|v| v == "1") {
                panic!("GPUIO_UCX_REQUIRED=1 but UCX cannot be loaded: {e}");
            }
            println!("SKIPPED: {e}");
            None
        }
    }
}

/// Progresses both workers until `req` completes; fails after [`DEADLINE`].
fn wait(workers: &[&Worker], req: Option<Request>, what: &str) -> Result<(), UcsError> {
    let Some(req) = req else { return Ok(()) };
    let start = Instant::now();
    loop {
        for w in workers {
            w.progress();
        }
        if let Some(r) = req.check() {
            return r;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: not complete after {DEADLINE:?}"
        );
    }
}

/// Progresses both workers until `done()`; fails after [`DEADLINE`].
fn progress_until(workers: &[&Worker], what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        for w in workers {
            w.progress();
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: not done after {DEADLINE:?}"
        );
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn poll_readable(fd: std::os::fd::RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    n > 0 && p.revents & libc::POLLIN != 0
}

#[test]
fn probe_reports_the_library() {
    let Some(lib) = lib_or_skip() else { return };
    let info = probe().expect("probe");
    println!(
        "UCX {} from {} (CUDA memory: {})",
        info.version, info.library, info.cuda
    );
    assert_eq!(info.version, lib.version_string);
    assert!(info.library.contains("libucp"), "{}", info.library);
    assert!(lib.version >= (1, 13, 0));
    // Cached: the same answer again.
    assert_eq!(probe().unwrap(), info);
}

#[test]
fn two_workers_in_one_process() {
    let Some(lib) = lib_or_skip() else { return };
    let ctx = Arc::new(Context::with_lib(lib).expect("ucp_init"));
    let a = Worker::new(&ctx).expect("worker A");
    let b = Worker::new(&ctx).expect("worker B");
    let both = [&a, &b];

    // Connect each to the other.
    let errors: Rc<RefCell<Vec<UcsError>>> = Rc::default();
    let on_err = |who: &'static str| {
        let errors = errors.clone();
        Box::new(move |e: UcsError| {
            println!("{who}: endpoint error: {e}");
            errors.borrow_mut().push(e);
        }) as Box<dyn FnMut(UcsError)>
    };
    let addr_a = a.address().expect("address A");
    let addr_b = b.address().expect("address B");
    assert!(!addr_a.is_empty() && !addr_b.is_empty());
    // SAFETY: addresses made by Worker::address in this process.
    let ab = unsafe { a.connect(&addr_b, on_err("A->B")) }.expect("connect A->B");
    // SAFETY: as above.
    let ba = unsafe { b.connect(&addr_a, on_err("B->A")) }.expect("connect B->A");
    wait(&both, ab.flush().expect("flush"), "wire-up A->B").expect("wire-up A->B");
    wait(&both, ba.flush().expect("flush"), "wire-up B->A").expect("wire-up B->A");
    println!("endpoint A->B:\n{}", ab.describe());

    // B exposes 1 MiB of host memory.
    const LEN: usize = 1 << 20;
    let mut target = vec![0u8; LEN];
    // SAFETY: `target` outlives `mem` and every operation on it (all waited for below).
    let mem = unsafe { ctx.mem_map(target.as_mut_ptr(), LEN, MemType::Host) }.expect("map");
    assert_eq!(mem.len(), LEN);
    let packed = mem.pack_rkey().expect("pack rkey");
    // SAFETY: a key packed by this UCX.
    let rkey = unsafe { ab.unpack_rkey(&packed) }.expect("unpack rkey");

    // A puts a pattern into B's memory, flushes, and waits.
    let src = pattern(LEN, 7);
    // SAFETY: `src` lives until the flush below completes.
    let put = unsafe { ab.put(src.as_ptr(), LEN, mem.addr(), &rkey) }.expect("put");
    wait(&both, put, "put").expect("put");
    wait(&both, ab.flush().expect("flush"), "flush after put").expect("flush");
    assert!(target == src, "B's memory does not hold what A put");

    // A gets it back, and a piece at an odd offset.
    let mut back = vec![0u8; LEN];
    // SAFETY: `back` is not touched until the flush completes.
    let get = unsafe { ab.get(back.as_mut_ptr(), LEN, mem.addr(), &rkey) }.expect("get");
    wait(&both, get, "get").expect("get");
    wait(&both, ab.flush().expect("flush"), "flush after get").expect("flush");
    assert!(back == src, "A got back something else");
    let mut piece = vec![0u8; 4096];
    // SAFETY: as above.
    let get =
        unsafe { ab.get(piece.as_mut_ptr(), 4096, mem.addr() + 12345, &rkey) }.expect("get piece");
    wait(&both, get, "get piece").expect("get piece");
    wait(&both, ab.flush().expect("flush"), "flush").expect("flush");
    assert_eq!(piece, src[12345..12345 + 4096]);

    // A key used on an endpoint it was not unpacked on is refused before UCX sees it.
    // SAFETY: nothing is started (refused); `piece` is valid anyway.
    let wrong = unsafe { ba.get(piece.as_mut_ptr(), 16, mem.addr(), &rkey) };
    let e = wrong.expect_err("rkey on the wrong endpoint");
    assert_eq!(e.status, -5, "{e}");

    // Active message 7 from A to B.
    type Messages = Rc<RefCell<Vec<(Vec<u8>, Vec<u8>)>>>;
    let got: Messages = Rc::default();
    let sink = got.clone();
    b.set_am_handler(
        7,
        Box::new(move |h, d| sink.borrow_mut().push((h.to_vec(), d.to_vec()))),
    )
    .expect("set handler");
    let header = b"gpuio-header".to_vec();
    let data = pattern(8192, 3);
    // SAFETY: `header` and `data` live until the send completes (waited for).
    let send = unsafe { ab.am_send(7, &header, &data) }.expect("am_send");
    wait(&both, send, "am_send").expect("am_send");
    progress_until(&both, "active message at B", || !got.borrow().is_empty());
    assert_eq!(got.borrow().len(), 1);
    assert_eq!(got.borrow()[0].0, header);
    assert_eq!(got.borrow()[0].1, data);

    // Wake-up: B armed with nothing pending; an active message from A makes its fd readable.
    let efd = b.event_fd().expect("event fd");
    assert!(efd >= 0);
    progress_until(&both, "arming B", || {
        b.progress();
        b.arm().expect("arm")
    });
    let before = got.borrow().len();
    let small = b"wake".to_vec();
    // SAFETY: `small` lives until the send completes (waited for, progressing A only).
    let send = unsafe { ab.am_send(7, b"", &small) }.expect("am_send");
    let start = Instant::now();
    let mut readable = false;
    while !readable {
        a.progress();
        readable = poll_readable(efd, 50);
        assert!(
            start.elapsed() < DEADLINE,
            "B's event fd did not become readable"
        );
    }
    wait(&[&a], send, "am_send (wake-up)").expect("am_send");
    progress_until(&[&b], "wake-up message at B", || {
        got.borrow().len() > before
    });
    assert_eq!(got.borrow().last().unwrap().1, small);
    assert!(got.borrow().last().unwrap().0.is_empty());

    // A replaced handler frees the old closure and runs the new one.
    let replaced = Rc::new(RefCell::new(0usize));
    let count = replaced.clone();
    b.set_am_handler(7, Box::new(move |_, _| *count.borrow_mut() += 1))
        .expect("replace handler");
    assert_eq!(Rc::strong_count(&got), 1, "the old handler was not freed");
    // SAFETY: static bytes.
    let send = unsafe { ab.am_send(7, b"h", b"d") }.expect("am_send");
    wait(&both, send, "am_send").expect("am_send");
    progress_until(&both, "message to the new handler", || {
        *replaced.borrow() == 1
    });

    // Malformed input that UCX refuses cleanly is an error, not a crash. (UCX does not
    // validate remote keys at all, and aborts on some garbled addresses: `connect` and
    // `unpack_rkey` are unsafe for that reason, and only these cases are safe to test.)
    // SAFETY: empty input is refused before UCX sees it.
    assert!(unsafe { ab.unpack_rkey(&[]) }.is_err());
    // SAFETY: as above.
    assert!(unsafe { a.connect(&[], on_err("empty")) }.is_err());
    for cut in [1, 8] {
        // SAFETY: the head of a real address, which UCX reads through gpuio's zero-padded
        // copy and refuses.
        let e = unsafe { a.connect(&addr_b[..cut], on_err("truncated")) }
            .expect_err("a truncated address connected");
        println!("address cut to {cut} bytes: {e}");
    }
    // SAFETY: all zeroes: version 0, which UCX refuses (other version bytes abort UCX).
    let e = unsafe { a.connect(&[0u8; 64], on_err("zeroes")) }.expect_err("zero address");
    println!("zero address: {e}");

    // Dropping a request in progress hands it to the worker; progress frees it.
    let mut big = vec![0u8; LEN];
    // SAFETY: `big` lives until the flush after it completes.
    let get = unsafe { ab.get(big.as_mut_ptr(), LEN, mem.addr(), &rkey) }.expect("get");
    drop(get);
    wait(&both, ab.flush().expect("flush"), "flush").expect("flush");
    progress_until(&both, "orphans freed", || a.orphans() == 0);
    assert!(big == src);

    // Dropping the key while the endpoint lives, then closing the endpoints.
    drop(rkey);
    wait(&both, ab.close().expect("close A->B"), "close A->B").ok();
    wait(&both, ba.close().expect("close B->A"), "close B->A").ok();
    drop(mem);
    assert!(errors.borrow().is_empty(), "{:?}", errors.borrow());
    drop(target);
}

/// The peer's worker goes away: A's endpoint reports an error (to its handler or through
/// its requests), never hangs past the deadline.
#[test]
fn a_vanished_peer_fails_the_endpoint() {
    let Some(lib) = lib_or_skip() else { return };
    let ctx = Arc::new(Context::with_lib(lib).expect("ucp_init"));
    let a = Worker::new(&ctx).expect("worker A");
    let b = Worker::new(&ctx).expect("worker B");
    let errors: Rc<RefCell<Vec<UcsError>>> = Rc::default();
    let sink = errors.clone();
    let addr_b = b.address().expect("address");
    let addr_a = a.address().expect("address");
    // SAFETY: addresses made by Worker::address in this process.
    let ab = unsafe { a.connect(&addr_b, Box::new(move |e| sink.borrow_mut().push(e))) }
        .expect("connect");
    // SAFETY: as above.
    let ba = unsafe { b.connect(&addr_a, Box::new(|_| {})) }.expect("connect");
    wait(&[&a, &b], ab.flush().unwrap(), "wire-up").expect("wire-up");
    wait(&[&a, &b], ba.flush().unwrap(), "wire-up").expect("wire-up");
    println!("endpoint A->B:\n{}", ab.describe());
    drop(ba);
    drop(b);
    // Keep sending until UCX notices.
    let start = Instant::now();
    let mut failed: Option<UcsError> = None;
    while failed.is_none() && errors.borrow().is_empty() {
        // SAFETY: static bytes.
        match unsafe { ab.am_send(1, b"", b"ping") } {
            Err(e) => failed = Some(e),
            Ok(Some(req)) => {
                let t = Instant::now();
                while req.check().is_none() && t.elapsed() < Duration::from_millis(200) {
                    a.progress();
                }
                if let Some(Err(e)) = req.check() {
                    failed = Some(e);
                }
            }
            Ok(None) => {}
        }
        a.progress();
        if start.elapsed() > Duration::from_secs(30) {
            println!("SKIPPED: UCX did not notice the vanished peer within 30 s");
            return;
        }
    }
    println!(
        "noticed after {:?}: handler {:?}, request {:?}",
        start.elapsed(),
        errors.borrow(),
        failed
    );
}

/// Device memory on B's side: A puts host bytes into it and gets them back through UCX's CUDA
/// transports. Runs where UCX reports CUDA support and a GPU exists (the GPU machines, with
/// the CUDA-enabled UCX); says `SKIPPED` elsewhere.
#[cfg(feature = "cuda")]
#[test]
fn device_memory_through_ucx() {
    use cudarc::driver::DevicePtr;
    let Some(lib) = lib_or_skip() else { return };
    let info = probe().expect("probe");
    if !info.cuda || !crate::cuda::available() {
        println!(
            "SKIPPED: UCX CUDA support {}, CUDA device {}",
            info.cuda,
            crate::cuda::available()
        );
        return;
    }
    let cuda = crate::cuda::context(0).expect("CUDA context");
    let stream = cuda.new_stream().expect("stream");
    const LEN: usize = 4 << 20;
    let dev = stream.alloc_zeros::<u8>(LEN).expect("alloc");
    let (dptr, guard) = dev.device_ptr(&stream);
    drop(guard);
    stream.synchronize().expect("sync");

    let ctx = Arc::new(Context::with_lib(lib).expect("ucp_init"));
    assert!(ctx.supports_cuda());
    let a = Worker::new(&ctx).expect("worker A");
    let b = Worker::new(&ctx).expect("worker B");
    let both = [&a, &b];
    // SAFETY: addresses made by Worker::address in this process.
    let ab = unsafe { a.connect(&b.address().unwrap(), Box::new(|e| panic!("A->B: {e}"))) }
        .expect("connect");
    // SAFETY: as above.
    let ba = unsafe { b.connect(&a.address().unwrap(), Box::new(|e| panic!("B->A: {e}"))) }
        .expect("connect");
    wait(&both, ab.flush().unwrap(), "wire-up").expect("wire-up");
    wait(&both, ba.flush().unwrap(), "wire-up").expect("wire-up");
    // SAFETY: `dev` is LEN bytes of device memory that outlives `mem` and every operation.
    let mem = unsafe { ctx.mem_map(dptr as *mut u8, LEN, MemType::Cuda) }.expect("map device");
    // SAFETY: a key packed by this UCX.
    let rkey = unsafe { ab.unpack_rkey(&mem.pack_rkey().unwrap()) }.expect("unpack");
    println!("endpoint A->B (device memory at B):\n{}", ab.describe());

    let src = pattern(LEN, 9);
    // SAFETY: `src` lives until the flush completes.
    let put = unsafe { ab.put(src.as_ptr(), LEN, mem.addr(), &rkey) }.expect("put");
    wait(&both, put, "put").expect("put");
    wait(&both, ab.flush().unwrap(), "flush").expect("flush");
    let on_gpu = stream.clone_dtoh(&dev).expect("dtoh");
    assert!(on_gpu == src, "device memory does not hold what A put");

    let mut back = vec![0u8; LEN];
    // SAFETY: `back` is untouched until the flush completes.
    let get = unsafe { ab.get(back.as_mut_ptr(), LEN, mem.addr(), &rkey) }.expect("get");
    wait(&both, get, "get").expect("get");
    wait(&both, ab.flush().unwrap(), "flush").expect("flush");
    assert!(back == src, "A got back something else from device memory");
    drop(rkey);
    drop(mem);
    drop((ab, ba));
}
