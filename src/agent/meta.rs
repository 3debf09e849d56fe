//! Agent metadata: what a peer loads to reach an agent (NIXL's `get_agent_metadata` /
//! `add_remote_agent`): its name, an instance token, where it runs, its transport address and
//! its registrations with their remote keys. Versioned; metadata of another format, version
//! or a truncated copy is an error.

use super::desc::{Desc, MemType};
use super::wire::{Reader, Writer};

const MAGIC: &[u8; 8] = b"GPUIOAM\0";
/// Bumped whenever a field changes; a reader refuses other versions by number.
pub(crate) const VERSION: u16 = 1;

/// A registration as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RemoteReg {
    pub(crate) id: u64,
    pub(crate) mem: MemType,
    pub(crate) desc: Desc,
    /// The transport's packed remote key (empty where the agent has no transport for other
    /// processes).
    pub(crate) rkey: Vec<u8>,
    /// The CUDA IPC export of device memory (empty for host memory or where the allocation
    /// cannot be exported): peers on the same host copy to and from it directly.
    pub(crate) ipc: Vec<u8>,
}

/// One agent's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Metadata {
    pub(crate) name: String,
    /// Random per agent instance: a restarted peer has another, so its old metadata is
    /// recognised as stale.
    pub(crate) token: u64,
    pub(crate) pid: u32,
    /// Which boot of which host the agent runs on ([`host_id`]).
    pub(crate) host: u64,
    /// The UCX worker's address (empty without UCX).
    pub(crate) address: Vec<u8>,
    pub(crate) regs: Vec<RemoteReg>,
}

impl Metadata {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(MAGIC, VERSION);
        w.str(&self.name);
        w.u64(self.token);
        w.u32(self.pid);
        w.u64(self.host);
        w.bytes(&self.address);
        w.u64(self.regs.len() as u64);
        for r in &self.regs {
            w.u64(r.id);
            w.u8(r.mem.code());
            w.u64(r.desc.addr);
            w.u64(r.desc.len);
            w.u32(r.desc.dev);
            w.bytes(&r.rkey);
            w.bytes(&r.ipc);
        }
        let sum = fnv(&w.buf);
        w.u64(sum);
        w.buf
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Metadata, String> {
        // The checksum first: UCX parses worker addresses and keys with few checks, so bytes
        // damaged on the way must never reach it.
        if bytes.len() >= 18 {
            let (body, sum) = bytes.split_at(bytes.len() - 8);
            let want = u64::from_le_bytes(sum.try_into().unwrap_or_default());
            if bytes.starts_with(MAGIC) && fnv(body) != want {
                return Err("agent metadata damaged: its checksum does not match".into());
            }
        }
        let (mut r, v) = Reader::new(bytes, MAGIC, "agent metadata")?;
        if v != VERSION {
            return Err(format!(
                "agent metadata version {v}; this gpuio reads version {VERSION} \
                 (the peer runs another gpuio)"
            ));
        }
        let name = r.str("name")?;
        let token = r.u64("token")?;
        let pid = r.u32("pid")?;
        let host = r.u64("host")?;
        let address = r.bytes("address")?.to_vec();
        let n = r.count("registrations", 45)?;
        let mut regs = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u64("registration id")?;
            let mem = MemType::from_code(r.u8("memory type")?)?;
            let desc = Desc::new(r.u64("addr")?, r.u64("len")?, r.u32("dev")?);
            let rkey = r.bytes("remote key")?.to_vec();
            let ipc = r.bytes("IPC handle")?.to_vec();
            regs.push(RemoteReg {
                id,
                mem,
                desc,
                rkey,
                ipc,
            });
        }
        r.u64("checksum")?;
        r.finish()?;
        if name.is_empty() {
            return Err("agent metadata names no agent".into());
        }
        Ok(Metadata {
            name,
            token,
            pid,
            host,
            address,
            regs,
        })
    }
}

/// FNV-1a, 64 bits.
fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// This boot of this host: FNV-1a over the kernel's boot id and the host name. Two agents
/// with the same value can reach each other's memory through the CUDA driver or shared
/// memory; others only through the network.
pub(crate) fn host_id() -> u64 {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    fnv(format!("{}\0{}", boot.trim(), host.trim()).as_bytes())
}

/// A fresh instance token (never 0).
pub(crate) fn new_token() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is a valid 8-byte buffer for getrandom to fill.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let mut t = u64::from_le_bytes(b);
    if n != 8 {
        // No getrandom: the clock and the pid are unique enough per instance on one host.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t = now ^ (u64::from(std::process::id()) << 32);
    }
    t.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_refuses_what_is_not_its_own() {
        let m = Metadata {
            name: "target".into(),
            token: 7,
            pid: 42,
            host: host_id(),
            address: vec![1, 2, 3],
            regs: vec![RemoteReg {
                id: 1,
                mem: MemType::Device,
                desc: Desc::new(0x7000_0000, 1 << 20, 1),
                rkey: vec![9; 20],
                ipc: vec![1; 80],
            }],
        };
        let b = m.encode();
        assert_eq!(Metadata::decode(&b).unwrap(), m);
        for cut in 0..b.len() {
            assert!(Metadata::decode(&b[..cut]).is_err());
        }
        let mut flipped = b.clone();
        flipped[20] ^= 1;
        assert!(Metadata::decode(&flipped).unwrap_err().contains("checksum"));
        let mut other = b.clone();
        other[8] = 2; // version 2, checksum recomputed
        let n = other.len() - 8;
        let sum = fnv(&other[..n]);
        other[n..].copy_from_slice(&sum.to_le_bytes());
        let e = Metadata::decode(&other).unwrap_err();
        assert!(e.contains("version 2"), "{e}");
        assert!(Metadata::decode(b"nixl metadata").is_err());
    }
}
