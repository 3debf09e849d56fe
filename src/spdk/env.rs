//! SPDK's process-wide state: the library, loaded once, and its environment (DPDK's EAL),
//! started once; DMA-able memory from it.

use std::ptr::NonNull;
use std::sync::OnceLock;

use super::sys::{self, RawEnvOpts, SpdkLib};

/// The loaded library with a running environment.
pub(crate) struct Spdk {
    pub(crate) lib: SpdkLib,
}

static SPDK: OnceLock<Result<Spdk, String>> = OnceLock::new();

/// SPDK, loaded and started on first use. The error says what is missing (the library, its
/// version, hugepages) and is the same for every later call.
pub(crate) fn spdk() -> Result<&'static Spdk, String> {
    SPDK.get_or_init(|| {
        let lib = sys::load()?;
        start_env(&lib)?;
        tracing::info!(version = %lib.version, path = %lib.path.display(), "SPDK environment started");
        Ok(Spdk { lib })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether SPDK could be used here, without starting it: the library's path and version.
pub(crate) fn probe_library() -> Result<(String, String), String> {
    if let Some(r) = SPDK.get() {
        return r
            .as_ref()
            .map(|s| (s.lib.path.display().to_string(), s.lib.version.clone()))
            .map_err(Clone::clone);
    }
    // Kept for the process: loading ran SPDK's and DPDK's constructors, whose registrations
    // (allocated, and kept in the library's globals) its destructors do not all undo; a
    // dlclose would leave them unreachable (LeakSanitizer reports them) on every probe. Later
    // loads of the same path only take another reference.
    static PROBED: OnceLock<Result<SpdkLib, String>> = OnceLock::new();
    PROBED
        .get_or_init(sys::load)
        .as_ref()
        .map(|lib| (lib.path.display().to_string(), lib.version.clone()))
        .map_err(Clone::clone)
}

fn start_env(lib: &SpdkLib) -> Result<(), String> {
    // DPDK pins the thread that initialises it to its main core; a short-lived thread takes
    // that pinning with it instead of the caller's thread.
    let rc = std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name("gpuio-spdk-init".into())
            .spawn_scoped(scope, || {
                // SAFETY: all-zero is a valid bit pattern for the struct (null pointers, zeros);
                // spdk_env_opts_init then writes its defaults.
                let mut opts: RawEnvOpts = unsafe { std::mem::zeroed() };
                // SAFETY: `opts` is a live RawEnvOpts with SPDK 20.07's layout (version checked).
                unsafe { (lib.spdk_env_opts_init)(&mut opts) };
                opts.name = c"gpuio".as_ptr();
                // No shared-memory config: several gpuio processes (and targets) may run at once.
                opts.shm_id = -1;
                // Quiet EAL's informational lines; errors still print.
                opts.env_context = c"--log-level=lib.eal:4".as_ptr().cast_mut().cast();
                // DPDK unlinks its hugepage files once mapped (`--huge-unlink`): none is left
                // in /dev/hugepages after the process, however it ends.
                opts.unlink_hugepage = true;
                // SPDK prints its start-up banner with printf: on stdout, a program's data
                // channel. Send it to stderr while the environment starts.
                let _banner = StdoutToStderr::new();
                // SAFETY: `opts` is initialised; the strings it points to are static.
                unsafe { (lib.spdk_env_init)(&opts) }
            })
            .map_err(|e| format!("cannot start the SPDK init thread: {e}"))?;
        handle
            .join()
            .map_err(|_| "SPDK environment initialisation panicked".to_string())
    })?;
    if rc != 0 {
        return Err(format!(
            "the SPDK environment failed to start (spdk_env_init returned {rc}): are 2 MiB \
             hugepages reserved and hugetlbfs mounted? (`scripts/spdk.sh hugepages`)"
        ));
    }
    Ok(())
}

/// DMA-able memory from SPDK's hugepage heap (usable by every NVMe transport, PCIe included).
pub(crate) struct DmaRegion {
    ptr: NonNull<u8>,
    len: usize,
    spdk: &'static Spdk,
}

// SAFETY: plain memory; who touches which bytes is decided by its owner.
unsafe impl Send for DmaRegion {}
// SAFETY: as above; `&DmaRegion` only exposes a raw pointer.
unsafe impl Sync for DmaRegion {}

impl DmaRegion {
    /// `len` zeroed bytes aligned to `align` (a power of two).
    pub(crate) fn new(len: usize, align: usize) -> Result<Self, String> {
        let spdk = spdk()?;
        // SAFETY: plain allocation; a null return is handled below.
        let p = unsafe {
            (spdk.lib.spdk_malloc)(
                len,
                align,
                std::ptr::null_mut(),
                sys::SOCKET_ID_ANY,
                sys::MALLOC_DMA,
            )
        };
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| {
            format!(
                "SPDK could not allocate {len} bytes of DMA memory (reserve more hugepages: \
                 `scripts/spdk.sh hugepages MIB`)"
            )
        })?;
        // SAFETY: `ptr` points to `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(DmaRegion { ptr, len, spdk })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for DmaRegion {
    fn drop(&mut self) {
        // SAFETY: allocated by spdk_malloc; the owner guarantees nothing uses it any more.
        unsafe { (self.spdk.lib.spdk_free)(self.ptr.as_ptr().cast()) };
    }
}

/// Points file descriptor 1 at stderr until dropped. Other threads' stdout writes in the
/// window (the environment's start, once per process) go to stderr too: misrouted, not lost.
struct StdoutToStderr {
    saved: Option<std::os::fd::OwnedFd>,
}

impl StdoutToStderr {
    fn new() -> Self {
        use std::os::fd::FromRawFd;
        // SAFETY: flushing every C stream (NULL) has no preconditions; it sends output
        // already buffered for stdout where it was meant to go before the switch.
        unsafe { libc::fflush(std::ptr::null_mut()) };
        // SAFETY: dup of fd 1 has no memory preconditions; a new descriptor or -1.
        let saved = unsafe { libc::dup(1) };
        if saved < 0 {
            return StdoutToStderr { saved: None };
        }
        // SAFETY: `saved` is a descriptor this process just created and owns alone.
        let saved = unsafe { std::os::fd::OwnedFd::from_raw_fd(saved) };
        // SAFETY: dup2 onto fd 1 with a valid source; on failure fd 1 is unchanged.
        if unsafe { libc::dup2(2, 1) } < 0 {
            return StdoutToStderr { saved: None };
        }
        StdoutToStderr { saved: Some(saved) }
    }
}

impl Drop for StdoutToStderr {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        if let Some(saved) = &self.saved {
            // SAFETY: as in `new`: C's stdout buffer holds the banner; out to stderr it goes.
            unsafe { libc::fflush(std::ptr::null_mut()) };
            // SAFETY: `saved` is a valid descriptor (the original stdout).
            unsafe { libc::dup2(saved.as_raw_fd(), 1) };
        }
    }
}
