//! Safe types over SPDK's NVMe driver: transport IDs, controllers (shared per target within a
//! process), namespaces and I/O queue pairs.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use super::env::{Spdk, spdk};
use super::sys::{self, RawCtrlrOpts, RawQpairOpts, RawTrid};

/// A parsed SPDK transport ID: `trtype:TCP adrfam:IPv4 traddr:… trsvcid:… subnqn:…`, or
/// `trtype:PCIe traddr:0000:04:00.0`; an optional `ns:N` picks the namespace (default: the
/// first active one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportId {
    pairs: Vec<(String, String)>,
    nsid: Option<u32>,
}

/// Keys SPDK 20.07's parser accepts (`ns` is gpuio's own).
const KEYS: &[&str] = &[
    "trtype",
    "adrfam",
    "traddr",
    "trsvcid",
    "subnqn",
    "priority",
    "hostaddr",
    "hostsvcid",
    "hostnqn",
];

impl TransportId {
    /// Parses and checks a transport ID string.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut pairs: Vec<(String, String)> = Vec::new();
        let mut nsid = None;
        for word in s.split_whitespace() {
            let (k, v) = word
                .split_once([':', '='])
                .ok_or_else(|| format!("`{word}` is not key:value"))?;
            let key = k.to_ascii_lowercase();
            if v.is_empty() {
                return Err(format!("`{k}` has no value"));
            }
            if v.len() > 255 || v.bytes().any(|b| b == 0) {
                return Err(format!("the value of `{k}` is too long or has a NUL"));
            }
            if key == "ns" {
                nsid = Some(
                    v.parse::<u32>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| format!("ns:{v} is not a namespace ID (1, 2, ...)"))?,
                );
                continue;
            }
            if !KEYS.contains(&key.as_str()) {
                return Err(format!(
                    "unknown key `{k}` (known: {}, ns)",
                    KEYS.join(", ")
                ));
            }
            if pairs.iter().any(|(k2, _)| *k2 == key) {
                return Err(format!("`{k}` given twice"));
            }
            pairs.push((key, v.to_string()));
        }
        let get = |k: &str| {
            pairs
                .iter()
                .find(|(k2, _)| k2 == k)
                .map(|(_, v)| v.as_str())
        };
        let trtype = get("trtype").ok_or("no trtype (TCP, RDMA or PCIe)")?;
        match trtype.to_ascii_lowercase().as_str() {
            "pcie" => {
                get("traddr").ok_or("PCIe needs traddr (a PCI address like 0000:04:00.0)")?;
            }
            "tcp" | "rdma" => {
                for k in ["traddr", "trsvcid", "subnqn"] {
                    if get(k).is_none() {
                        return Err(format!("{trtype} needs {k}"));
                    }
                }
                let port = get("trsvcid").unwrap_or_default();
                if port.parse::<u16>().is_err() {
                    return Err(format!("trsvcid:{port} is not a port number"));
                }
            }
            other => return Err(format!("unsupported trtype `{other}` (TCP, RDMA or PCIe)")),
        }
        Ok(TransportId { pairs, nsid })
    }

    /// Whether the transport is local PCIe (which needs DMA-able memory).
    pub fn is_pcie(&self) -> bool {
        self.get("trtype")
            .is_some_and(|t| t.eq_ignore_ascii_case("pcie"))
    }

    /// The namespace asked for with `ns:N`, if any.
    pub fn nsid(&self) -> Option<u32> {
        self.nsid
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k2, _)| k2 == k)
            .map(|(_, v)| v.as_str())
    }

    /// The controller part, as SPDK parses it (no `ns`).
    pub(crate) fn controller_string(&self) -> String {
        self.pairs
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

impl std::fmt::Display for TransportId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.controller_string())?;
        if let Some(n) = self.nsid {
            write!(f, " ns:{n}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for TransportId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        TransportId::parse(s)
    }
}

/// An attached NVMe controller. SPDK attaches a target once per process, so controllers are
/// shared: every open of the same transport ID gets the same one, detached when the last
/// user goes.
pub(crate) struct Controller {
    spdk: &'static Spdk,
    ptr: NonNull<c_void>,
    /// Serialises resets (SPDK's reset is not reentrant).
    reset_lock: Mutex<()>,
    pub(crate) trid: String,
}

// SAFETY: SPDK's controller-level calls (admin queue, reset, qpair allocation, detach) take the
// controller's own lock; I/O qpairs, which are single-threaded, are separate objects.
unsafe impl Send for Controller {}
// SAFETY: as above.
unsafe impl Sync for Controller {}

type Registry = Mutex<HashMap<String, Weak<Controller>>>;

fn registry() -> &'static Registry {
    static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Controller {
    /// Attaches to the controller at `trid` (blocking: SPDK connects and initialises it), or
    /// returns the one this process already has.
    pub(crate) fn attach(trid: &TransportId) -> Result<Arc<Controller>, String> {
        let spdk = spdk()?;
        let key = trid.controller_string();
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = reg.get(&key).and_then(Weak::upgrade) {
            return Ok(c);
        }
        let cstr = CString::new(key.clone()).map_err(|_| "transport ID has a NUL".to_string())?;
        let mut raw = RawTrid::zeroed();
        // SAFETY: `raw` is a zeroed spdk_nvme_transport_id (20.07 size), `cstr` a C string.
        let rc =
            unsafe { (spdk.lib.spdk_nvme_transport_id_parse)(raw.as_mut_ptr(), cstr.as_ptr()) };
        if rc != 0 {
            return Err(format!("SPDK rejects the transport ID `{key}` ({rc})"));
        }
        let mut opts = RawCtrlrOpts::zeroed();
        // SAFETY: `opts` has the full 20.07 size, passed as such.
        unsafe {
            (spdk.lib.spdk_nvme_ctrlr_get_default_ctrlr_opts)(
                opts.as_mut_ptr(),
                std::mem::size_of::<RawCtrlrOpts>(),
            )
        };
        // No keep-alive: an idle engine does not poll the admin queue, and a target that
        // times the host out would drop a healthy connection. Failures show up on I/O.
        opts.set_u32(sys::CTRLR_OPTS_KEEP_ALIVE_MS, 0);
        // SAFETY: both structures are initialised and sized for 20.07.
        let p = unsafe {
            (spdk.lib.spdk_nvme_connect)(
                raw.as_ptr(),
                opts.as_ptr(),
                std::mem::size_of::<RawCtrlrOpts>(),
            )
        };
        let ptr = NonNull::new(p).ok_or_else(|| {
            format!("cannot connect to the NVMe controller at `{key}` (is the target up?)")
        })?;
        let c = Arc::new(Controller {
            spdk,
            ptr,
            reset_lock: Mutex::new(()),
            trid: key.clone(),
        });
        reg.retain(|_, w| w.strong_count() > 0);
        reg.insert(key, Arc::downgrade(&c));
        Ok(c)
    }

    /// The namespace `nsid`, or the first active one.
    pub(crate) fn namespace(self: &Arc<Self>, nsid: Option<u32>) -> Result<Namespace, String> {
        let lib = &self.spdk.lib;
        // SAFETY: the controller is attached for as long as `self` lives.
        let id = match nsid {
            Some(n) => n,
            None => unsafe { (lib.spdk_nvme_ctrlr_get_first_active_ns)(self.ptr.as_ptr()) },
        };
        if id == 0 {
            return Err(format!(
                "the controller at `{}` has no active namespace",
                self.trid
            ));
        }
        // SAFETY: as above; SPDK returns null for an ID out of range.
        let ns = unsafe { (lib.spdk_nvme_ctrlr_get_ns)(self.ptr.as_ptr(), id) };
        let ns = NonNull::new(ns)
            .ok_or_else(|| format!("namespace {id} does not exist at `{}`", self.trid))?;
        // SAFETY: `ns` belongs to the attached controller.
        let (sector, sectors, max_xfer, md) = unsafe {
            (
                (lib.spdk_nvme_ns_get_sector_size)(ns.as_ptr()),
                (lib.spdk_nvme_ns_get_num_sectors)(ns.as_ptr()),
                (lib.spdk_nvme_ns_get_max_io_xfer_size)(ns.as_ptr()),
                (lib.spdk_nvme_ns_get_md_size)(ns.as_ptr()),
            )
        };
        if sectors == 0 {
            return Err(format!("namespace {id} at `{}` is not active", self.trid));
        }
        if !sector.is_power_of_two() || sector > 4096 {
            return Err(format!(
                "namespace {id} has {sector}-byte sectors; gpuio supports powers of two up to 4096"
            ));
        }
        if md != 0 {
            return Err(format!(
                "namespace {id} has {md} bytes of metadata per sector; gpuio supports none"
            ));
        }
        Ok(Namespace {
            ctrlr: self.clone(),
            ptr: ns,
            nsid: id,
            sector: sector as u64,
            size: sectors.saturating_mul(sector as u64),
            max_xfer: (max_xfer as usize).max(sector as usize),
        })
    }

    /// Allocates (and connects) an I/O queue pair. SPDK's default request pool (512) is kept:
    /// commands beyond it wait in the lane, which is what lets queue depth exceed it.
    pub(crate) fn alloc_qpair(self: &Arc<Self>) -> Result<Qpair, String> {
        let lib = &self.spdk.lib;
        let mut opts = RawQpairOpts::zeroed();
        // SAFETY: attached controller; `opts` has the 20.07 size, passed as such.
        unsafe {
            (lib.spdk_nvme_ctrlr_get_default_io_qpair_opts)(
                self.ptr.as_ptr(),
                opts.as_mut_ptr(),
                std::mem::size_of::<RawQpairOpts>(),
            )
        };
        // SAFETY: as above.
        let p = unsafe {
            (lib.spdk_nvme_ctrlr_alloc_io_qpair)(
                self.ptr.as_ptr(),
                opts.as_ptr(),
                std::mem::size_of::<RawQpairOpts>(),
            )
        };
        let ptr = NonNull::new(p)
            .ok_or_else(|| format!("cannot create an I/O queue pair at `{}`", self.trid))?;
        Ok(Qpair {
            ptr,
            ctrlr: self.clone(),
        })
    }

    /// Resets the controller: reconnects its admin queue (and SPDK's qpairs on it).
    pub(crate) fn reset(&self) -> Result<(), String> {
        let _g = self.reset_lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: attached controller; resets are serialised above.
        let rc = unsafe { (self.spdk.lib.spdk_nvme_ctrlr_reset)(self.ptr.as_ptr()) };
        if rc != 0 {
            return Err(format!("controller reset failed ({})", errno_name(-rc)));
        }
        Ok(())
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        // SAFETY: last reference: every namespace and qpair (which hold an Arc) is gone.
        let rc = unsafe { (self.spdk.lib.spdk_nvme_detach)(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(trid = %self.trid, rc, "SPDK detach failed");
        }
    }
}

/// One namespace of a controller: the unit gpuio reads and writes, like a file.
pub(crate) struct Namespace {
    pub(crate) ctrlr: Arc<Controller>,
    ptr: NonNull<c_void>,
    pub(crate) nsid: u32,
    /// Logical block size in bytes (the alignment of every command).
    pub(crate) sector: u64,
    /// Capacity in bytes.
    pub(crate) size: u64,
    /// Largest transfer of one command, in bytes.
    pub(crate) max_xfer: usize,
}

// SAFETY: a namespace handle is read-only data of its controller; commands go through qpairs.
unsafe impl Send for Namespace {}
// SAFETY: as above.
unsafe impl Sync for Namespace {}

impl Namespace {
    /// Bytes per command for an engine whose chunk size is `chunk`: a whole number of sectors,
    /// at most what one command carries.
    pub(crate) fn chunk(&self, chunk: usize) -> usize {
        let s = self.sector as usize;
        (chunk.min(self.max_xfer) / s).max(1) * s
    }
}

/// An I/O queue pair. Single-threaded by SPDK's rules: it is `Send` (it moves to the reactor)
/// but not `Sync`, and only the reactor that owns it submits and polls.
pub(crate) struct Qpair {
    ptr: NonNull<c_void>,
    pub(crate) ctrlr: Arc<Controller>,
}

// SAFETY: SPDK qpairs may move between threads as long as one thread uses them at a time,
// which `&mut self` on every use guarantees.
unsafe impl Send for Qpair {}

/// What one NVMe command does, as the queue pair submits it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NvmeCmd {
    Read,
    Write,
    Flush,
}

/// One command for [`Qpair::submit`]: `count` sectors at `lba` into or out of `buf` (both
/// unused for a flush).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SectorIo {
    pub(crate) cmd: NvmeCmd,
    pub(crate) buf: *mut c_void,
    pub(crate) lba: u64,
    pub(crate) count: u32,
}

impl Qpair {
    /// Submits one command on `ns` (of this qpair's controller). `cb` runs with `arg` from
    /// [`process_completions`](Self::process_completions) once the command ends, unless
    /// SPDK refuses it here (a nonzero return: then it never calls back).
    ///
    /// # Safety
    /// `ns` belongs to this qpair's controller; `io.buf` points to `io.count` sectors of
    /// DMA-able memory that stay valid until `cb` runs; `arg` is what `cb` expects.
    pub(crate) unsafe fn submit(
        &mut self,
        ns: &Namespace,
        io: SectorIo,
        cb: sys::CmdCallback,
        arg: *mut c_void,
    ) -> i32 {
        let SectorIo {
            cmd,
            buf,
            lba,
            count,
        } = io;
        let lib = &self.ctrlr.spdk.lib;
        let (ns, qp) = (ns.ptr.as_ptr(), self.ptr.as_ptr());
        // SAFETY: the qpair is used by this thread only (`&mut self`); the rest is the
        // caller's promise.
        unsafe {
            match cmd {
                NvmeCmd::Flush => (lib.spdk_nvme_ns_cmd_flush)(ns, qp, cb, arg),
                NvmeCmd::Read => (lib.spdk_nvme_ns_cmd_read)(ns, qp, buf, lba, count, cb, arg, 0),
                NvmeCmd::Write => (lib.spdk_nvme_ns_cmd_write)(ns, qp, buf, lba, count, cb, arg, 0),
            }
        }
    }

    /// Runs the callbacks of the commands that have ended, without waiting: their number, or
    /// a negative errno when the qpair failed (its commands are then completed as aborted).
    pub(crate) fn process_completions(&mut self) -> i32 {
        // SAFETY: the qpair is owned and used by this thread only (`&mut self`); 0 means no
        // limit on the completions processed.
        unsafe { (self.ctrlr.spdk.lib.spdk_nvme_qpair_process_completions)(self.ptr.as_ptr(), 0) }
    }
}

impl Drop for Qpair {
    fn drop(&mut self) {
        // SAFETY: owned qpair, used by no one else; SPDK completes its outstanding commands
        // (as aborted) before freeing it, so no transfer into their buffers follows.
        let rc = unsafe { (self.ctrlr.spdk.lib.spdk_nvme_ctrlr_free_io_qpair)(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(trid = %self.ctrlr.trid, rc, "SPDK qpair free failed");
        }
    }
}

/// `ENOTCONN` → "ENOTCONN", for messages.
pub(crate) fn errno_name(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_ids_parse_and_reject() {
        let t = TransportId::parse(
            "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2016-06.io.spdk:cnode1",
        )
        .unwrap();
        assert!(!t.is_pcie());
        assert_eq!(t.nsid, None);
        let t = TransportId::parse("trtype:PCIe traddr:0000:04:00.0 ns:2").unwrap();
        assert!(t.is_pcie());
        assert_eq!(t.nsid, Some(2));
        assert_eq!(t.to_string(), "trtype:PCIe traddr:0000:04:00.0 ns:2");
        for bad in [
            "",
            "traddr:1.2.3.4",
            "trtype:TCP traddr:1.2.3.4 trsvcid:4420",
            "trtype:TCP traddr:1.2.3.4 trsvcid:http subnqn:x",
            "trtype:FC traddr:x",
            "trtype:TCP trtype:TCP",
            "trtype:PCIe",
            "trtype:PCIe traddr:0000:04:00.0 ns:0",
            "trtype:PCIe traddr:0000:04:00.0 colour:blue",
            "trtype",
        ] {
            assert!(TransportId::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
