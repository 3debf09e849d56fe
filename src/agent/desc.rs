//! Descriptor lists: ranges of host or device memory a transfer reads or writes, NIXL's
//! `(addr, len, dev)` triples under one memory type, and their serialised form.

use super::wire::{Reader, Writer};

/// Which memory a descriptor list describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemType {
    /// Host memory (NIXL's `DRAM`); the descriptors' `dev` is ignored and written as 0.
    Host,
    /// GPU memory (NIXL's `VRAM`); `dev` is the GPU's ordinal.
    Device,
}

impl MemType {
    pub(crate) fn code(self) -> u8 {
        match self {
            MemType::Host => 0,
            MemType::Device => 1,
        }
    }
    pub(crate) fn from_code(c: u8) -> Result<MemType, String> {
        match c {
            0 => Ok(MemType::Host),
            1 => Ok(MemType::Device),
            other => Err(format!("unknown memory type {other}")),
        }
    }
}

impl std::fmt::Display for MemType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemType::Host => "DRAM",
            MemType::Device => "VRAM",
        })
    }
}

impl std::str::FromStr for MemType {
    type Err = String;
    fn from_str(s: &str) -> Result<MemType, String> {
        match s.to_ascii_uppercase().as_str() {
            "DRAM" | "HOST" | "CPU" => Ok(MemType::Host),
            "VRAM" | "DEVICE" | "GPU" | "CUDA" => Ok(MemType::Device),
            other => Err(format!("unknown memory type {other:?} (DRAM or VRAM)")),
        }
    }
}

/// One contiguous range: its address, length in bytes and device (the GPU's ordinal for
/// device memory, 0 for host memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Desc {
    /// Start address (a host pointer or a CUDA device pointer, as an integer).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// GPU ordinal for device memory; 0 for host memory.
    pub dev: u32,
}

impl Desc {
    /// A descriptor.
    pub fn new(addr: u64, len: u64, dev: u32) -> Desc {
        Desc { addr, len, dev }
    }
    /// One past the last byte, or `None` where the range wraps the address space.
    pub(crate) fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }
}

/// Ranges of one memory type, in order: a transfer pairs the i-th local descriptor with the
/// i-th remote one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescList {
    /// The memory every descriptor lies in.
    pub mem: MemType,
    /// The ranges.
    pub descs: Vec<Desc>,
}

const MAGIC: &[u8; 8] = b"GPUIODL\0";
const VERSION: u16 = 1;

impl DescList {
    /// A list of `mem` ranges.
    pub fn new(mem: MemType, descs: Vec<Desc>) -> DescList {
        DescList { mem, descs }
    }
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len()
    }
    /// Whether the list has no descriptors.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }
    /// Bytes the list covers.
    pub fn total_bytes(&self) -> u64 {
        self.descs.iter().map(|d| d.len).sum()
    }
    /// The list as bytes a peer can [`deserialize`](Self::deserialize) (NIXL's
    /// `get_serialized_descs`).
    pub fn serialize(&self) -> Vec<u8> {
        let mut w = Writer::new(MAGIC, VERSION);
        w.u8(self.mem.code());
        w.u64(self.descs.len() as u64);
        for d in &self.descs {
            w.u64(d.addr);
            w.u64(d.len);
            w.u32(d.dev);
        }
        w.buf
    }
    /// A list from [`serialize`](Self::serialize)'s bytes; anything else is an error.
    pub fn deserialize(bytes: &[u8]) -> crate::error::Result<DescList> {
        Self::decode(bytes).map_err(|why| {
            crate::error::Error::invalid(
                crate::error::Context::op(crate::error::OpKind::Agent),
                why,
            )
        })
    }

    fn decode(bytes: &[u8]) -> Result<DescList, String> {
        let (mut r, v) = Reader::new(bytes, MAGIC, "descriptor list")?;
        if v != VERSION {
            return Err(format!(
                "descriptor list version {v}; this gpuio reads version {VERSION}"
            ));
        }
        let mem = MemType::from_code(r.u8("memory type")?)?;
        let n = r.count("descriptors", 20)?;
        let mut descs = Vec::with_capacity(n);
        for _ in 0..n {
            descs.push(Desc {
                addr: r.u64("addr")?,
                len: r.u64("len")?,
                dev: r.u32("dev")?,
            });
        }
        r.finish()?;
        Ok(DescList { mem, descs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_round_trips_and_garbage_is_an_error() {
        let l = DescList::new(
            MemType::Device,
            vec![Desc::new(0x1000, 64, 1), Desc::new(u64::MAX - 1, 1, 0)],
        );
        let b = l.serialize();
        assert_eq!(DescList::deserialize(&b).unwrap(), l);
        for cut in 0..b.len() {
            assert!(DescList::deserialize(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(DescList::deserialize(&long).is_err());
        let mut huge = b.clone();
        huge[11..19].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(DescList::deserialize(&huge).is_err());
    }
}
