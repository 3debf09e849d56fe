//! Where each GPU sits: its PCI address, the NUMA node of that address and the CPUs local to
//! it, from the CUDA driver (the address) and sysfs (the rest). `gpuio check` prints it; bounce
//! memory and I/O threads for a GPU belong on its node, so that page-cache copies and the DMA
//! reading them do not cross the socket interconnect.

use std::path::Path;

/// One GPU's place in the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPlace {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// PCI address (`0000:1b:00.0`), where the driver gave one.
    pub pci: Option<String>,
    /// NUMA node of the PCI device; `None` on machines with one node (sysfs says -1) or where
    /// sysfs has no entry for it.
    pub numa_node: Option<u32>,
    /// CPUs local to the device, as sysfs lists them (`0-15,32-47`).
    pub local_cpus: Option<String>,
}

/// Every GPU the driver reports, in ordinal order (empty without CUDA).
pub fn gpus() -> Vec<GpuPlace> {
    let probe = super::probe();
    probe
        .devices
        .iter()
        .enumerate()
        .map(|(ordinal, name)| {
            let pci = probe.pci.get(ordinal).cloned().flatten();
            let (numa_node, local_cpus) = match &pci {
                Some(addr) => place_of(Path::new("/sys/bus/pci/devices"), addr),
                None => (None, None),
            };
            GpuPlace {
                ordinal,
                name: name.clone(),
                pci,
                numa_node,
                local_cpus,
            }
        })
        .collect()
}

/// The NUMA node and local CPU list of PCI device `addr` under `root` (sysfs's
/// `/sys/bus/pci/devices`).
fn place_of(root: &Path, addr: &str) -> (Option<u32>, Option<String>) {
    let dev = root.join(addr);
    let read = |f: &str| {
        std::fs::read_to_string(dev.join(f))
            .ok()
            .map(|s| s.trim().to_string())
    };
    // A negative node (-1) means the platform does not say: one node, or no NUMA.
    let node = read("numa_node").and_then(|s| s.parse::<u32>().ok());
    (node, read("local_cpulist").filter(|s| !s.is_empty()))
}

impl std::fmt::Display for GpuPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "gpu:{} {} -> PCI {} -> NUMA node {} -> CPUs {}",
            self.ordinal,
            self.name,
            self.pci.as_deref().unwrap_or("unknown"),
            self.numa_node.map_or_else(
                || "none (one node, or not reported)".into(),
                |n| n.to_string()
            ),
            self.local_cpus.as_deref().unwrap_or("unknown"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_entries_give_node_and_cpus() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("0000:1b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        std::fs::write(dev.join("local_cpulist"), "16-31,48-63\n").unwrap();
        assert_eq!(
            place_of(root.path(), "0000:1b:00.0"),
            (Some(1), Some("16-31,48-63".to_string()))
        );
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(place_of(root.path(), "0000:1b:00.0").0, None);
        assert_eq!(place_of(root.path(), "0000:ff:00.0"), (None, None));
    }
}
