//! Device leases: how a read lets the reactor copy into the caller's device memory after the
//! future has stopped being polled, soundly (DESIGN.md, Contracts → device leases; the full
//! argument, checked against cudarc 0.19.10's source, is `docs/device-leases.md`).
//!
//! # Protocol
//! At the future's first poll, on the destination's own stream S (the stream the memory is
//! freed on):
//! 1. `write_ptr(S)`: S waits for the memory's earlier tracked uses (cudarc's events);
//! 2. record E0 on S: the reactor polls it (from the host, never from a stream) and issues
//!    no copy before earlier work on S is done;
//! 3. `cuStreamWaitValue32(S, W, generation, GEQ)`: S stops here until the lease is released;
//! 4. record E1 on S: S has passed the wait (when W's word may be reused); a stream given
//!    with `on_stream` waits on E1;
//! 5. drop the guard: cudarc's write event is recorded on S after the wait.
//!
//! The reactor then copies each read piece into the memory on its own non-blocking copy
//! stream C and, after the op's last copy (or when the op is dropped, or fails), queues
//! `cuStreamWriteValue32(C, W, generation)`. C runs in order and the write is fenced, so S, and
//! everything queued on S afterwards (kernels, the stream-ordered free of the memory, any
//! reuse of it), runs after every copy. Nothing depends on the future being polled again, so
//! dropping or `mem::forget`-ting it mid-flight is sound; cudarc's events are only needed for
//! uses of the memory on other streams, which then follow the write event of step 5.
//!
//! A lease whose op never queued a copy (refused, declined, its message dropped) is released
//! by writing W from the host. Once a copy may have been queued, only C may release it: a dead
//! context leaves S waiting, which hangs and never corrupts.
//!
//! # Where leases are refused (the poll-issued copies serve instead)
//! The per-thread default stream (its handle means a different stream on the dropping
//! thread), a capturing stream, `on_stream` with a stream of another context, a device without
//! the stream-ordered allocator (a drop would block its thread on the lease), a driver without
//! stream memory operations, and all lease words in use.

use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::result::{event, stream};
use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::device::DeviceDst;
use super::event::EVENT_POOL;
use super::memops::{MemOps, is_capturing, memops};

/// Lease words per context (each on its own cache line).
const WORDS: usize = 1024;
/// Bytes between two words.
const STRIDE: usize = 64;
/// `CU_STREAM_PER_THREAD`: the handle of "the calling thread's per-thread default stream".
const PER_THREAD_STREAM: usize = 0x2;

/// One context's lease words: registered, device-mapped host memory the GPU polls, kept for the process
/// (a wait may read a word until its stream passes it, which nothing here can bound).
pub(crate) struct LeaseBoard {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    dev: CUdeviceptr,
    ops: &'static MemOps,
    /// The context's copy stream for reactor-issued copies (non-blocking, kept for the
    /// process). Made here, on a caller's thread: with another thread inside a driver call that
    /// waits on a leased stream (a copy from pageable memory, a synchronous free), the driver
    /// holds back resource creation (`cuEventCreate`, measured) on every other thread, and the
    /// reactor must never be the thread held back.
    copy_stream: sys::CUstream,
    state: Mutex<BoardState>,
}

// SAFETY: `host` points into a process-lifetime allocation only ever accessed through
// volatile word writes and reads; everything else is behind the mutex.
unsafe impl Send for LeaseBoard {}
// SAFETY: as above.
unsafe impl Sync for LeaseBoard {}

#[derive(Default)]
struct BoardState {
    free: Vec<u32>,
    /// Last generation handed out per word.
    generations: Vec<u32>,
    /// Released words, reusable once their stream has passed the wait (E1 complete).
    retiring: Vec<(u32, CudaEvent)>,
}

impl LeaseBoard {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, String> {
        if !ctx.has_async_alloc() {
            return Err(
                "the device has no stream-ordered allocator (a dropped destination would \
                        block its thread until the lease ends)"
                    .into(),
            );
        }
        let ops = memops()?;
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let bytes = WORDS * STRIDE;
        // The words live in an anonymous mapping the process never unmaps, registered with
        // the driver: a context reset (`cuDevicePrimaryCtxReset`) drops the registration but
        // not the memory, so a late host release of an old lease writes harmless bytes instead
        // of faulting (memory from cuMemHostAlloc would be unmapped under it).
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if host == libc::MAP_FAILED {
            return Err(format!(
                "mapping the lease words: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: `host` is a fresh mapping of `bytes` bytes (zero-filled by the kernel), page
        // aligned; the context is bound; the mapping is never unmapped.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                host,
                bytes,
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostRegister of the lease words: {r:?}"));
        }
        let mut dev: CUdeviceptr = 0;
        // SAFETY: `host` was registered with DEVICEMAP in this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) };
        if r != CUresult::CUDA_SUCCESS {
            // The words stay registered and mapped (never freed): nothing waits on them.
            return Err(format!(
                "cuMemHostGetDevicePointer of the lease words: {r:?}"
            ));
        }
        let copy_stream = stream::create(stream::StreamKind::NonBlocking)
            .map_err(|e| format!("creating the copy stream: {e}"))?;
        let board = LeaseBoard {
            ctx: ctx.clone(),
            host: host.cast(),
            dev,
            ops,
            copy_stream,
            state: Mutex::new(BoardState {
                free: (0..WORDS as u32).rev().collect(),
                generations: vec![0; WORDS],
                retiring: Vec::new(),
            }),
        };
        board.probe()?;
        BOARDS_MADE.fetch_add(1, Ordering::Relaxed);
        Ok(board)
    }

    /// Enqueues a write and a wait on a scratch stream and checks both ran: the driver may
    /// still answer "not supported" for stream memory operations.
    fn probe(&self) -> Result<(), String> {
        let s = stream::create(stream::StreamKind::NonBlocking)
            .map_err(|e| format!("creating a scratch stream: {e}"))?;
        let word = WORDS as u32 - 1;
        // SAFETY: `s` is a live stream of the bound context; the word is device-mapped and
        // lives for the process.
        let r = unsafe {
            self.ops
                .write(s, self.dev_word(word), 1)
                .and_then(|()| self.ops.wait_geq(s, self.dev_word(word), 1))
        };
        // SAFETY: `s` is ours; synchronizing it waits only for the two operations above.
        let synced = unsafe { stream::synchronize(s) };
        // SAFETY: `s` is ours and idle (or failed); nothing else uses it.
        let _ = unsafe { stream::destroy(s) };
        r.map_err(|e| format!("stream memory operations refused: {e}"))?;
        synced.map_err(|e| format!("stream memory operations failed: {e}"))?;
        if self.host_word(word) != 1 {
            return Err("a stream write to a lease word did not reach it".into());
        }
        self.set_host_word(word, 0);
        Ok(())
    }

    /// Whether the words are still registered with the driver (a context reset drops the
    /// registration, and with it every device address of the board). Asked through
    /// `cuMemHostGetDevicePointer`, which answers for registered memory (`cuMemHostGetFlags`
    /// answers only for `cuMemHostAlloc` memory: with it every lease made a new board). Call
    /// with the context bound.
    fn registered(&self) -> bool {
        let mut dev: CUdeviceptr = 0;
        // SAFETY: the driver writes one device pointer; `host` stays mapped for the process.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, self.host.cast(), 0) };
        r == CUresult::CUDA_SUCCESS && dev == self.dev
    }

    fn dev_word(&self, i: u32) -> CUdeviceptr {
        self.dev + (i as usize * STRIDE) as u64
    }

    fn host_word(&self, i: u32) -> u32 {
        // SAFETY: word `i` lies inside the allocation (i < WORDS), aligned to STRIDE.
        unsafe { std::ptr::read_volatile(self.host.add(i as usize * STRIDE).cast::<u32>()) }
    }

    fn set_host_word(&self, i: u32, v: u32) {
        // Earlier host work (none touches device memory, but keep the order plain) before the
        // GPU can see the word.
        std::sync::atomic::fence(Ordering::SeqCst);
        // SAFETY: as `host_word`; a 32-bit volatile store is what the GPU's wait reads.
        unsafe { std::ptr::write_volatile(self.host.add(i as usize * STRIDE).cast::<u32>(), v) };
    }

    /// A word and its next generation, or `Err` when every word is held.
    fn acquire(&self) -> Result<(u32, u32), String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.free.is_empty() {
            let retiring = std::mem::take(&mut st.retiring);
            for (w, e1) in retiring {
                // SAFETY: the event is alive and of this board's context (bound by the caller).
                match unsafe { event::query(e1.cu_event()) } {
                    Ok(()) => {
                        st.free.push(w);
                        EVENT_POOL.put(e1);
                    }
                    Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_READY => st.retiring.push((w, e1)),
                    // The stream failed: its wait may never be seen to end; the word stays out.
                    Err(_) => {}
                }
            }
        }
        let w = st
            .free
            .pop()
            .ok_or_else(|| format!("all {WORDS} lease words are in use"))?;
        st.generations[w as usize] = st.generations[w as usize].wrapping_add(1);
        Ok((w, st.generations[w as usize]))
    }

    /// A word whose wait was never queued goes straight back.
    fn unused(&self, w: u32, generation: u32) {
        self.set_host_word(w, generation);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.free.push(w);
    }

    fn retire(&self, w: u32, e1: CudaEvent) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.retiring.push((w, e1));
    }
}

/// A reactor's progress marker on its context's copy stream: a board word the stream writes a
/// rising sequence number into after each batch of copies. The reactor reads it from the host
/// to know which batches are done (so it never needs an event, whose creation the driver may
/// hold back; see [`LeaseBoard::copy_stream`]).
pub(crate) struct CopyFence {
    board: Arc<LeaseBoard>,
    word: u32,
    last: std::sync::atomic::AtomicU32,
}

impl CopyFence {
    /// A fence on `board`'s copy stream (one board word, taken until [`close`](Self::close)).
    pub(crate) fn new(board: &Arc<LeaseBoard>) -> Result<Self, String> {
        let (word, _) = board.acquire()?;
        Ok(CopyFence {
            board: board.clone(),
            word,
            last: std::sync::atomic::AtomicU32::new(board.host_word(word)),
        })
    }

    /// The board (and copy stream) the fence is on.
    pub(crate) fn board(&self) -> &Arc<LeaseBoard> {
        &self.board
    }

    /// The copy stream the fence marks.
    pub(crate) fn stream(&self) -> sys::CUstream {
        self.board.copy_stream
    }

    /// Queues the next sequence number on the copy stream (after everything queued there)
    /// and returns it. Call with the context bound.
    pub(crate) fn signal(&self) -> Result<u32, String> {
        let seq = self.last.load(Ordering::Relaxed).wrapping_add(1);
        // SAFETY: the copy stream is live for the process and of the board's context (bound
        // by the caller); the word is device-mapped and lives for the process.
        unsafe {
            self.board
                .ops
                .write(self.board.copy_stream, self.board.dev_word(self.word), seq)?
        };
        self.last.store(seq, Ordering::Relaxed);
        Ok(seq)
    }

    /// Whether the copy stream has passed the signal `seq` (and so everything before it).
    pub(crate) fn passed(&self, seq: u32) -> bool {
        (self.board.host_word(self.word).wrapping_sub(seq) as i32) >= 0
    }

    /// Gives the word back once every signal has landed (else it stays out: the stream may
    /// still write it).
    pub(crate) fn close(self) {
        let last = self.last.load(Ordering::Relaxed);
        if !self.passed(last) {
            return;
        }
        let mut st = self.board.state.lock().unwrap_or_else(|p| p.into_inner());
        // A lease taking this word next waits for generation + 1: the word must read as the
        // last generation handed out (released), whatever sequence it reached.
        self.board
            .set_host_word(self.word, st.generations[self.word as usize]);
        st.free.push(self.word);
    }
}

/// Lease boards set up in this process (one per context, and one more after each reset).
pub(crate) static BOARDS_MADE: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// The lease board of `ctx`, set up (and probed) on first use; `Err` says why leases are
/// unusable on this context.
pub(crate) fn board(ctx: &Arc<CudaContext>) -> Result<Arc<LeaseBoard>, String> {
    type Boards = Vec<(usize, Result<Arc<LeaseBoard>, String>)>;
    static BOARDS: Mutex<Boards> = Mutex::new(Vec::new());
    let key = ctx.cu_ctx() as usize;
    let mut boards = BOARDS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = boards.iter().position(|(k, _)| *k == key) {
        match &boards[i].1 {
            Ok(b) if ctx.bind_to_thread().is_ok() && b.registered() => return Ok(b.clone()),
            Ok(_) => {
                // The context was reset under the board: its device addresses are gone. Leases
                // still out on it keep it (and its mapping) alive; new ones get a new board.
                tracing::warn!(
                    device = ctx.ordinal(),
                    "gpuio lease words lost their registration (context reset); registering anew"
                );
                let _stale = boards.remove(i);
            }
            Err(why) => return Err(why.clone()),
        }
    }
    let b = LeaseBoard::new(ctx).map(Arc::new);
    if let Err(why) = &b {
        tracing::info!(%why, device = ctx.ordinal(), "gpuio device leases unavailable; device copies are issued by futures");
    }
    boards.push((key, b.clone()));
    b
}

/// Whether leases work on GPU `ordinal`, and how the reactor's copies are issued
/// (`gpuio check`).
pub(crate) fn support(ctx: &Arc<CudaContext>) -> Result<&'static str, String> {
    let b = board(ctx)?;
    Ok(if b.ops.has_batch() {
        "batched copies (cuMemcpyBatchAsync)"
    } else {
        "one cuMemcpyAsync per piece (the driver has no cuMemcpyBatchAsync)"
    })
}

const HELD: u8 = 0;
const COPIES_QUEUED: u8 = 1;
const RELEASED: u8 = 2;

/// A destination stream held at a wait until the reactor's copies into its memory are queued
/// (see the module docs). Shared by the op's future (until it sends it) and the reactor.
pub(crate) struct DeviceLease {
    board: Arc<LeaseBoard>,
    word: u32,
    generation: u32,
    /// Recorded on S before the wait: earlier work on the memory is done once it completes.
    /// Goes back to the event pool on drop (the reactor may drop the last reference, and must
    /// not destroy events: see [`LeaseBoard::copy_stream`]).
    e0: Option<CudaEvent>,
    /// Recorded on S after the wait: the word may be reused once it completes.
    e1: Mutex<Option<CudaEvent>>,
    state: AtomicU8,
    /// Reactor batches queuing copies for this lease right now, and [`STOP`]: the future was
    /// dropped, no copy may be queued from now on (the caller may free the memory as soon as
    /// the drop returns, and the driver forbids launching work on memory whose
    /// `cuMemFreeAsync` has returned).
    issuing: AtomicU32,
}

/// [`DeviceLease::issuing`]'s stop bit.
const STOP: u32 = 1 << 31;

impl DeviceLease {
    /// The context the lease's stream belongs to.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.board.ctx
    }

    /// The board the lease's word is on (its copy stream serves the lease's copies).
    pub(crate) fn board(&self) -> &Arc<LeaseBoard> {
        &self.board
    }

    /// Whether work queued on the destination's stream before the lease has completed (the
    /// reactor copies nothing before). Call with the context bound.
    pub(crate) fn prior_work_done(&self) -> Result<bool, String> {
        let Some(e0) = self.e0.as_ref() else {
            return Ok(true);
        };
        // SAFETY: the event is alive (owned) and of the bound context.
        match unsafe { event::query(e0.cu_event()) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(format!(
                "the destination stream's work before the read failed: {e}"
            )),
        }
    }

    /// The reactor is about to queue copies into the memory: false once the future was
    /// dropped (queue none). Pair a true with [`end_issue`](Self::end_issue) once the driver
    /// call returned.
    pub(crate) fn begin_issue(&self) -> bool {
        if self.issuing.fetch_add(1, Ordering::SeqCst) & STOP != 0 {
            self.issuing.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// The copies [`begin_issue`](Self::begin_issue) allowed are queued.
    pub(crate) fn end_issue(&self) {
        self.issuing.fetch_sub(1, Ordering::SeqCst);
    }

    /// From the dropped future: no copy is queued into the memory once this returns. Waits
    /// (spinning: a batch's driver call, microseconds) for one being queued right now.
    pub(crate) fn stop_copies(&self) {
        self.issuing.fetch_or(STOP, Ordering::SeqCst);
        while self.issuing.load(Ordering::SeqCst) & !STOP != 0 {
            std::thread::yield_now();
        }
    }

    /// Marks that a copy into the memory may be queued from now on: only a stream write on
    /// the copy stream may release the lease after this.
    pub(crate) fn copies_queued(&self) {
        let _ =
            self.state
                .compare_exchange(HELD, COPIES_QUEUED, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Queues the release on the copy stream `copy_stream`, after every copy queued there.
    ///
    /// # Safety
    /// `copy_stream` must be a live stream of this lease's context, bound on this thread,
    /// that holds every copy queued for this lease.
    pub(crate) unsafe fn release_on(&self, copy_stream: sys::CUstream) -> Result<(), String> {
        if self.state.load(Ordering::SeqCst) == RELEASED {
            return Ok(());
        }
        // SAFETY: the caller's preconditions; the word lives for the process.
        unsafe {
            self.board
                .ops
                .write(copy_stream, self.board.dev_word(self.word), self.generation)?
        };
        self.state.store(RELEASED, Ordering::SeqCst);
        self.retire();
        Ok(())
    }

    /// Releases a lease none of whose copies was ever queued, from the host. Returns false
    /// (and does nothing) once copies may have been queued.
    pub(crate) fn release_unused(&self) -> bool {
        if self
            .state
            .compare_exchange(HELD, RELEASED, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return self.state.load(Ordering::SeqCst) == RELEASED;
        }
        self.board.set_host_word(self.word, self.generation);
        self.retire();
        true
    }

    fn retire(&self) {
        let e1 = self.e1.lock().unwrap_or_else(|p| p.into_inner()).take();
        // Without E1 nothing says when the stream passed the wait: the word stays out.
        if let Some(e1) = e1 {
            self.board.retire(self.word, e1);
        }
    }
}

impl Drop for DeviceLease {
    fn drop(&mut self) {
        if let Some(e0) = self.e0.take() {
            EVENT_POOL.put(e0);
        }
        if self.state.load(Ordering::SeqCst) == RELEASED || self.release_unused() {
            return;
        }
        // Copies may be queued and no copy stream released the lease (the reactor lost its
        // context): the stream stays blocked, which hangs its work but corrupts nothing.
        tracing::error!(
            word = self.word,
            "a device lease with queued copies was never released; its stream stays blocked"
        );
    }
}

/// Takes a lease on `dst`'s stream (steps 1-5 of the module docs) and returns it with the
/// memory's device address; `Err` says why the poll-issued copies must serve instead.
/// `on`: the stream the caller named with `on_stream`, which then waits for the lease too.
pub(crate) fn take(
    dst: &mut dyn DeviceDst,
    on: Option<&Arc<CudaStream>>,
) -> Result<(Arc<DeviceLease>, CUdeviceptr), String> {
    let s = dst.own_stream().clone();
    let ctx = s.context().clone();
    if s.cu_stream() as usize == PER_THREAD_STREAM
        || on.is_some_and(|x| x.cu_stream() as usize == PER_THREAD_STREAM)
    {
        return Err("the per-thread default stream names a different stream on each thread".into());
    }
    if on.is_some_and(|x| x.context().cu_ctx() != ctx.cu_ctx()) {
        return Err("on_stream names a stream of another context".into());
    }
    let board = board(&ctx)?;
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    for st in std::iter::once(&s).chain(on) {
        // SAFETY: a live stream of the bound context.
        if unsafe { is_capturing(st.cu_stream()) }? {
            return Err("the stream is capturing a graph".into());
        }
    }
    let (word, generation) = board.acquire()?;
    let (ptr, guard) = dst.write_ptr(&s);
    let e0 = match EVENT_POOL.record(&s) {
        Ok(e) => e,
        Err(e) => {
            board.unused(word, generation);
            return Err(format!("recording the lease's first event: {e}"));
        }
    };
    // SAFETY: `s` is a live stream of the bound context (the caller's slice holds it); the word
    // is device-mapped and lives for the process.
    if let Err(e) = unsafe {
        board
            .ops
            .wait_geq(s.cu_stream(), board.dev_word(word), generation)
    } {
        board.unused(word, generation);
        return Err(e);
    }
    let lease = DeviceLease {
        board: board.clone(),
        word,
        generation,
        e0: Some(e0),
        e1: Mutex::new(None),
        state: AtomicU8::new(HELD),
        issuing: AtomicU32::new(0),
    };
    match EVENT_POOL.record(&s) {
        Ok(e1) => *lease.e1.lock().unwrap_or_else(|p| p.into_inner()) = Some(e1),
        Err(e) => {
            lease.release_unused();
            return Err(format!("recording the lease's second event: {e}"));
        }
    }
    if let Some(x) = on.filter(|x| x.cu_stream() != s.cu_stream()) {
        let e1 = lease.e1.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = x.wait(e1.as_ref().expect("set above")) {
            drop(e1);
            lease.release_unused();
            return Err(format!("ordering on_stream's stream after the lease: {e}"));
        }
    }
    // cudarc's write event for the memory: recorded on S after the wait.
    drop(guard);
    Ok((Arc::new(lease), ptr))
}
