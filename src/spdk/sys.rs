//! Raw SPDK symbols, loaded at run time from the initiator library `scripts/spdk.sh` builds
//! (`libspdk_gpuio.so`: SPDK 20.07's NVMe driver, sock, env and DPDK in one object).
//!
//! Structures SPDK fills in are kept as opaque, 8-byte-aligned byte blocks of SPDK 20.07's
//! sizes; the few fields gpuio sets are written at their 20.07 offsets. The library reports its
//! version (`gpuio_spdk_version`, SPDK's own `SPDK_VERSION_STRING`) and [`load`] refuses any
//! other release, so the layouts below can be trusted.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use libloading::Library;

/// The SPDK release whose layouts this file encodes.
pub(crate) const SPDK_RELEASE: &str = "SPDK v20.07";

/// `struct spdk_env_opts` (SPDK 20.07).
#[repr(C)]
pub(crate) struct RawEnvOpts {
    pub(crate) name: *const c_char,
    pub(crate) core_mask: *const c_char,
    pub(crate) shm_id: c_int,
    pub(crate) mem_channel: c_int,
    pub(crate) master_core: c_int,
    pub(crate) mem_size: c_int,
    pub(crate) no_pci: bool,
    pub(crate) hugepage_single_segments: bool,
    pub(crate) unlink_hugepage: bool,
    pub(crate) num_pci_addr: usize,
    pub(crate) hugedir: *const c_char,
    pub(crate) pci_blacklist: *mut c_void,
    pub(crate) pci_whitelist: *mut c_void,
    pub(crate) iova_mode: *const c_char,
    pub(crate) base_virtaddr: u64,
    pub(crate) env_context: *mut c_void,
}

/// An opaque SPDK structure of `N` bytes, aligned like the C one (8).
#[repr(C, align(8))]
pub(crate) struct Opaque<const N: usize>(pub(crate) [u8; N]);

impl<const N: usize> Opaque<N> {
    pub(crate) fn zeroed() -> Box<Self> {
        Box::new(Opaque([0; N]))
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut c_void {
        self.0.as_mut_ptr().cast()
    }

    pub(crate) fn as_ptr(&self) -> *const c_void {
        self.0.as_ptr().cast()
    }

    /// Writes a `u32` field at byte offset `at`.
    pub(crate) fn set_u32(&mut self, at: usize, v: u32) {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
}

/// `struct spdk_nvme_transport_id`.
pub(crate) type RawTrid = Opaque<564>;
/// `struct spdk_nvme_ctrlr_opts`.
pub(crate) type RawCtrlrOpts = Opaque<600>;
/// `spdk_nvme_ctrlr_opts.keep_alive_timeout_ms`.
pub(crate) const CTRLR_OPTS_KEEP_ALIVE_MS: usize = 16;
/// `struct spdk_nvme_io_qpair_opts`.
pub(crate) type RawQpairOpts = Opaque<72>;

/// `struct spdk_nvme_cpl` (16 bytes; the status word is the last 16 bits).
#[repr(C)]
pub(crate) struct RawCpl {
    pub(crate) cdw0: u32,
    pub(crate) rsvd1: u32,
    pub(crate) sqhd: u16,
    pub(crate) sqid: u16,
    pub(crate) cid: u16,
    pub(crate) status: u16,
}

impl RawCpl {
    /// Status code type and status code (`spdk_nvme_status.sct`, `.sc`).
    pub(crate) fn sct_sc(&self) -> (u8, u8) {
        (
            ((self.status >> 9) & 0x7) as u8,
            ((self.status >> 1) & 0xff) as u8,
        )
    }
}

/// `spdk_nvme_cmd_cb`.
pub(crate) type CmdCallback = unsafe extern "C" fn(*mut c_void, *const RawCpl);

/// `SPDK_MALLOC_DMA`, `SPDK_ENV_SOCKET_ID_ANY`.
pub(crate) const MALLOC_DMA: u32 = 0x01;
pub(crate) const SOCKET_ID_ANY: c_int = -1;

macro_rules! symbols {
    ($( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// The SPDK entry points gpuio uses, resolved once.
        pub(crate) struct SpdkLib {
            $( pub(crate) $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            pub(crate) version: String,
            pub(crate) path: PathBuf,
            _lib: Library,
        }

        impl SpdkLib {
            fn resolve(lib: Library, path: PathBuf, version: String) -> Result<Self, String> {
                // SAFETY: each symbol is declared with its C signature in SPDK 20.07's headers
                // (the version was checked by the caller); the library stays loaded as long as
                // the pointers, because it moves into the struct that holds them.
                unsafe {
                    Ok(SpdkLib {
                        $( $name: *lib
                            .get(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| format!("{}: missing {}: {e}", path.display(), stringify!($name)))?, )*
                        version,
                        path,
                        _lib: lib,
                    })
                }
            }
        }
    };
}

symbols! {
    spdk_env_opts_init: fn(*mut RawEnvOpts);
    spdk_env_init: fn(*const RawEnvOpts) -> c_int;
    spdk_malloc: fn(usize, usize, *mut u64, c_int, u32) -> *mut c_void;
    spdk_free: fn(*mut c_void);
    spdk_nvme_transport_id_parse: fn(*mut c_void, *const c_char) -> c_int;
    spdk_nvme_ctrlr_get_default_ctrlr_opts: fn(*mut c_void, usize);
    spdk_nvme_connect: fn(*const c_void, *const c_void, usize) -> *mut c_void;
    spdk_nvme_detach: fn(*mut c_void) -> c_int;
    spdk_nvme_ctrlr_reset: fn(*mut c_void) -> c_int;
    spdk_nvme_ctrlr_get_first_active_ns: fn(*mut c_void) -> u32;
    spdk_nvme_ctrlr_get_ns: fn(*mut c_void, u32) -> *mut c_void;
    spdk_nvme_ns_get_sector_size: fn(*mut c_void) -> u32;
    spdk_nvme_ns_get_num_sectors: fn(*mut c_void) -> u64;
    spdk_nvme_ns_get_max_io_xfer_size: fn(*mut c_void) -> u32;
    spdk_nvme_ns_get_md_size: fn(*mut c_void) -> u32;
    spdk_nvme_ctrlr_get_default_io_qpair_opts: fn(*mut c_void, *mut c_void, usize);
    spdk_nvme_ctrlr_alloc_io_qpair: fn(*mut c_void, *const c_void, usize) -> *mut c_void;
    spdk_nvme_ctrlr_free_io_qpair: fn(*mut c_void) -> c_int;
    spdk_nvme_qpair_process_completions: fn(*mut c_void, u32) -> i32;
    spdk_nvme_ns_cmd_read: fn(*mut c_void, *mut c_void, *mut c_void, u64, u32, CmdCallback, *mut c_void, u32) -> c_int;
    spdk_nvme_ns_cmd_write: fn(*mut c_void, *mut c_void, *mut c_void, u64, u32, CmdCallback, *mut c_void, u32) -> c_int;
    spdk_nvme_ns_cmd_flush: fn(*mut c_void, *mut c_void, CmdCallback, *mut c_void) -> c_int;
}

// SAFETY: function pointers and a library handle. Which SPDK objects may be used from which
// thread is decided by the safe layer (qpairs only on the reactor), not by this table.
unsafe impl Send for SpdkLib {}
// SAFETY: as above.
unsafe impl Sync for SpdkLib {}

/// The cache `scripts/spdk.sh build` fills by default, under `$XDG_CACHE_HOME` or `~/.cache`:
/// SPDK built for the script's default CPU target, x86-64-v2 (its `TARGET`). The target is in
/// the name so that a native build of an earlier script (`gpuio/spdk-20.07`) is never loaded.
const DEFAULT_HOME: &str = "gpuio/spdk-20.07-x86-64-v2";

/// Where to look for the library: `GPUIO_SPDK_LIB`, then `GPUIO_SPDK_HOME/lib`, then the cache
/// `scripts/spdk.sh build` fills ([`DEFAULT_HOME`]).
pub(crate) fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("GPUIO_SPDK_LIB") {
        v.push(PathBuf::from(p));
        return v;
    }
    if let Some(h) = std::env::var_os("GPUIO_SPDK_HOME") {
        v.push(Path::new(&h).join("lib/libspdk_gpuio.so"));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")));
    if let Some(c) = cache {
        v.push(c.join(DEFAULT_HOME).join("lib/libspdk_gpuio.so"));
    }
    v
}

/// Loads the initiator library and checks that it is SPDK 20.07.
pub(crate) fn load() -> Result<SpdkLib, String> {
    let tried = candidates();
    let Some(path) = tried.iter().find(|p| p.exists()).cloned() else {
        return Err(format!(
            "the SPDK initiator library was not found (looked for {}); build it with \
             `scripts/spdk.sh build` or set GPUIO_SPDK_LIB",
            tried
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    };
    // SAFETY: loading runs SPDK's and DPDK's constructors, which only register drivers and
    // log types; nothing is started until `spdk_env_init`.
    let lib = unsafe { Library::new(&path) }
        .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    // SAFETY: `gpuio_spdk_version` is `const char *(void)`, returning a static string.
    let version = unsafe {
        let f = lib
            .get::<unsafe extern "C" fn() -> *const c_char>(b"gpuio_spdk_version\0")
            .map_err(|e| {
                format!(
                    "{} is not a gpuio SPDK initiator library (no gpuio_spdk_version: {e}); \
                     build it with scripts/spdk.sh",
                    path.display()
                )
            })?;
        let p = f();
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if !version.starts_with(SPDK_RELEASE) {
        return Err(format!(
            "{} is {version:?}; gpuio's SPDK bindings are for {SPDK_RELEASE}",
            path.display()
        ));
    }
    SpdkLib::resolve(lib, path, version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_opts_has_the_20_07_layout() {
        assert_eq!(std::mem::size_of::<RawEnvOpts>(), 96);
        assert_eq!(std::mem::offset_of!(RawEnvOpts, shm_id), 16);
        assert_eq!(std::mem::offset_of!(RawEnvOpts, no_pci), 32);
        assert_eq!(std::mem::offset_of!(RawEnvOpts, env_context), 88);
        assert_eq!(std::mem::size_of::<RawCpl>(), 16);
        assert_eq!(std::mem::align_of::<RawTrid>(), 8);
    }

    #[test]
    fn completion_status_fields() {
        // Phase bit 0, SC 0x80 (LBA out of range), SCT 0 (generic).
        let c = RawCpl {
            cdw0: 0,
            rsvd1: 0,
            sqhd: 0,
            sqid: 0,
            cid: 0,
            status: (0x80 << 1) | 1,
        };
        assert_eq!(c.sct_sc(), (0, 0x80));
        let c = RawCpl {
            cdw0: 0,
            rsvd1: 0,
            sqhd: 0,
            sqid: 0,
            cid: 0,
            status: (2 << 9) | (0x81 << 1),
        };
        assert_eq!(c.sct_sc(), (2, 0x81));
    }

    #[test]
    fn default_home_matches_the_build_script() {
        // scripts/spdk.sh installs into gpuio/spdk-20.07-$TARGET, TARGET defaulting to
        // x86-64-v2: the library's default search path must name the same directory.
        let script = include_str!("../../scripts/spdk.sh");
        let target = DEFAULT_HOME.strip_prefix("gpuio/spdk-20.07-").unwrap();
        assert!(script.contains(&format!("TARGET=${{GPUIO_SPDK_TARGET:-{target}}}")));
        assert!(script.contains("/gpuio/spdk-20.07-$TARGET}"));
    }
}
