//! Raw driver-API symbols, loaded with libloading, and the checked probe built on them.

use libloading::{Library, Symbol};

type CuResult = i32;

/// What the CUDA driver on this machine offers.
#[derive(Debug, Clone)]
pub struct CudaProbe {
    /// The library that loaded, if any.
    pub library: Option<String>,
    /// Driver API version as `major.minor`, where the driver loaded.
    pub driver_version: Option<String>,
    /// Device names, in ordinal order.
    pub devices: Vec<String>,
    /// Each device's PCI address (`domain:bus:device.function`, lower case as sysfs spells
    /// it), in ordinal order; `None` where the driver did not say.
    pub pci: Vec<Option<String>>,
    /// Why CUDA is unusable, where it is.
    pub error: Option<String>,
}

impl CudaProbe {
    /// Whether at least one device is usable.
    pub fn available(&self) -> bool {
        self.error.is_none() && !self.devices.is_empty()
    }
}

const CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];

pub(super) fn probe() -> CudaProbe {
    let mut out = CudaProbe {
        library: None,
        driver_version: None,
        devices: Vec::new(),
        pci: Vec::new(),
        error: None,
    };
    let mut errors = Vec::new();
    let lib = CANDIDATES.iter().find_map(|name| {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions
        // on our side; the library is kept loaded for the probe's duration.
        match unsafe { Library::new(*name) } {
            Ok(l) => {
                out.library = Some((*name).to_string());
                Some(l)
            }
            Err(e) => {
                errors.push(format!("{name}: {e}"));
                None
            }
        }
    });
    let Some(lib) = lib else {
        out.error = Some(format!("CUDA driver not found ({})", errors.join("; ")));
        return out;
    };
    if let Err(e) = query(&lib, &mut out) {
        out.error = Some(e);
    }
    out
}

fn query(lib: &Library, out: &mut CudaProbe) -> Result<(), String> {
    // SAFETY: the symbol types match the CUDA driver API's C signatures:
    // cuInit(unsigned), cuDriverGetVersion(int*), cuDeviceGetCount(int*),
    // cuDeviceGet(CUdevice*, int), cuDeviceGetName(char*, int, CUdevice),
    // cuDeviceGetPCIBusId(char*, int, CUdevice).
    unsafe {
        let init: Symbol<unsafe extern "C" fn(u32) -> CuResult> =
            lib.get(b"cuInit\0").map_err(|e| e.to_string())?;
        let version: Symbol<unsafe extern "C" fn(*mut i32) -> CuResult> = lib
            .get(b"cuDriverGetVersion\0")
            .map_err(|e| e.to_string())?;
        let count: Symbol<unsafe extern "C" fn(*mut i32) -> CuResult> =
            lib.get(b"cuDeviceGetCount\0").map_err(|e| e.to_string())?;
        let get: Symbol<unsafe extern "C" fn(*mut i32, i32) -> CuResult> =
            lib.get(b"cuDeviceGet\0").map_err(|e| e.to_string())?;
        let name: Symbol<unsafe extern "C" fn(*mut u8, i32, i32) -> CuResult> =
            lib.get(b"cuDeviceGetName\0").map_err(|e| e.to_string())?;
        let bus_id: Option<Symbol<unsafe extern "C" fn(*mut u8, i32, i32) -> CuResult>> =
            lib.get(b"cuDeviceGetPCIBusId\0").ok();
        let mut v = 0i32;
        if version(&mut v) == 0 {
            out.driver_version = Some(format!("{}.{}", v / 1000, (v % 1000) / 10));
        }
        let rc = init(0);
        if rc != 0 {
            return Err(format!("cuInit failed with CUresult {rc} (no usable GPU?)"));
        }
        let mut n = 0i32;
        let rc = count(&mut n);
        if rc != 0 {
            return Err(format!("cuDeviceGetCount failed with CUresult {rc}"));
        }
        for i in 0..n {
            let mut dev = 0i32;
            let mut buf = [0u8; 256];
            let c_str = |buf: &[u8]| {
                let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                String::from_utf8_lossy(&buf[..end]).into_owned()
            };
            let got = get(&mut dev, i) == 0;
            if got && name(buf.as_mut_ptr(), buf.len() as i32, dev) == 0 {
                out.devices.push(c_str(&buf));
            } else {
                out.devices.push(format!("device {i} (name unavailable)"));
            }
            let mut id = [0u8; 64];
            out.pci.push(
                bus_id
                    .as_ref()
                    .filter(|_| got)
                    .filter(|f| f(id.as_mut_ptr(), id.len() as i32, dev) == 0)
                    .map(|_| c_str(&id).to_ascii_lowercase()),
            );
        }
        if n == 0 {
            return Err("the CUDA driver reports no devices".into());
        }
    }
    Ok(())
}
