//! CUDA IPC for agents on one host: a registration of device memory exports a handle to its
//! allocation ([`export`]); a peer process on the same host opens it ([`IpcMapping::open`])
//! and copies to and from it with the CUDA driver's own copies (NVLink or PCIe peer copies,
//! or a copy within one GPU), no network stack involved.
//!
//! The exported bytes: the 64-byte `CUipcMemHandle`, the registration's offset in its
//! allocation, and the GPU's PCI bus id, which names the same GPU in every process whatever
//! `CUDA_VISIBLE_DEVICES` each one sees.

use std::ffi::{CStr, c_char};

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};

const HANDLE: usize = 64;

fn check(rc: CUresult, what: &str) -> Result<(), String> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {rc:?}"))
    }
}

/// The IPC export of device memory at `ptr` on GPU `ordinal`, or why there is none (memory
/// from a stream-ordered pool without IPC support, for one).
pub(crate) fn export(ordinal: usize, ptr: u64) -> Result<Vec<u8>, String> {
    let ctx = super::context(ordinal).map_err(|e| e.to_string())?;
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut base: CUdeviceptr = 0;
    let mut size = 0usize;
    // SAFETY: valid out-pointers; `ptr` is an address the driver checks.
    check(
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
        "cuMemGetAddressRange",
    )?;
    let mut handle = sys::CUipcMemHandle_st {
        reserved: [0; HANDLE],
    };
    // SAFETY: `handle` is a valid out-pointer; `base` is the start of an allocation.
    check(
        unsafe { sys::cuIpcGetMemHandle(&mut handle, base) },
        "cuIpcGetMemHandle",
    )?;
    let mut bus = [0 as c_char; 32];
    // SAFETY: `bus` is a valid buffer of the length passed.
    check(
        unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, ctx.cu_device()) },
        "cuDeviceGetPCIBusId",
    )?;
    let mut out = Vec::with_capacity(HANDLE + 8 + 16);
    out.extend(handle.reserved.iter().map(|&c| c as u8));
    out.extend_from_slice(&(ptr - base).to_le_bytes());
    // SAFETY: the driver wrote a NUL-terminated string into `bus`.
    out.extend_from_slice(unsafe { CStr::from_ptr(bus.as_ptr()) }.to_bytes());
    Ok(out)
}

/// A peer's device memory mapped into this process; closed when dropped.
pub(crate) struct IpcMapping {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    base: CUdeviceptr,
    /// The registration's start in this process's address space.
    pub(crate) ptr: u64,
}

impl IpcMapping {
    /// Opens the memory [`export`] described, or says why not (another host's GPU, a GPU this
    /// process cannot see, a handle from this very process).
    pub(crate) fn open(exported: &[u8]) -> Result<IpcMapping, String> {
        if exported.len() <= HANDLE + 8 {
            return Err("no IPC handle".into());
        }
        let mut handle = sys::CUipcMemHandle_st {
            reserved: [0; HANDLE],
        };
        for (d, s) in handle.reserved.iter_mut().zip(&exported[..HANDLE]) {
            *d = *s as c_char;
        }
        let offset = u64::from_le_bytes(
            exported[HANDLE..HANDLE + 8]
                .try_into()
                .map_err(|_| "bad IPC offset")?,
        );
        let bus = std::ffi::CString::new(&exported[HANDLE + 8..]).map_err(|_| "bad PCI bus id")?;
        if !super::available() {
            return Err("no CUDA device here".into());
        }
        let mut dev = 0;
        // SAFETY: `dev` is a valid out-pointer and `bus` a NUL-terminated string.
        check(
            unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, bus.as_ptr()) },
            "cuDeviceGetByPCIBusId (the peer's GPU is not visible here)",
        )?;
        let ordinal = (0..super::probe().devices.len())
            .find(|&i| {
                let mut d = 0;
                // SAFETY: valid out-pointer; `i` is below the device count.
                let rc = unsafe { sys::cuDeviceGet(&mut d, i as i32) };
                rc == CUresult::CUDA_SUCCESS && d == dev
            })
            .ok_or("the peer's GPU has no ordinal here")?;
        let ctx = super::context(ordinal).map_err(|e| e.to_string())?;
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut base: CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-pointer; the handle came from `export` in another
        // process (the driver refuses one from this process, or one it does not know).
        check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut base,
                    handle,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(IpcMapping {
            ctx,
            base,
            ptr: base + offset,
        })
    }

    /// The GPU (this process's ordinal) the memory is on.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `base` came from cuIpcOpenMemHandle and is closed once; transfers using
            // it hold the mapping (through their peer) until they have finished.
            let rc = unsafe { sys::cuIpcCloseMemHandle(self.base) };
            if rc != CUresult::CUDA_SUCCESS {
                tracing::warn!("cuIpcCloseMemHandle: {rc:?}");
            }
        }
    }
}
