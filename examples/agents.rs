//! Two agents, "target" and "initiator", taking the steps of NIXL's two-agent example with
//! gpuio's API: register memory (host, and device memory where a GPU is present), exchange
//! metadata, send descriptors serialised, READ polled to completion and repeated, prepared
//! lists with a WRITE that remaps them, notifications, then release and cleanup.
//!
//! ```text
//! cargo run --release --example agents           # host memory, and GPU 0 where present
//! ```
//! Exits non-zero if any byte or notification is not where it should be.

use std::time::Duration;

use gpuio::Engine;
use gpuio::agent::{Agent, Desc, DescList, MemType, XferOp, XferStatus};

const BUF: usize = 256;

/// Two halves of one registration, as NIXL's example describes its two buffers.
fn halves(whole: &DescList) -> DescList {
    let d = whole.descs[0];
    let h = d.len / 2;
    DescList::new(
        whole.mem,
        vec![Desc::new(d.addr, h, d.dev), Desc::new(d.addr + h, h, d.dev)],
    )
}

fn run<M, N>(
    target: &Agent,
    initiator: &Agent,
    theirs: &gpuio::agent::Registration<M>,
    mine: &gpuio::agent::Registration<N>,
) -> gpuio::Result<()>
where
    M: gpuio::agent::AgentMemory,
    N: gpuio::agent::AgentMemory,
{
    // The target sends its descriptors serialised, as it would over a socket.
    let wire = halves(&theirs.descs()).serialize();
    let remote = DescList::deserialize(&wire).expect("descriptors round-trip");
    let local = halves(&mine.descs());

    // READ: one request, posted twice, polled until done; a notification after each.
    let read = initiator.request(XferOp::Read, &local, "target", &remote, Some(b"UUID1"))?;
    println!("READ path: {}", read.path());
    for round in 0..2 {
        let t = read.post()?;
        loop {
            match t.status() {
                XferStatus::InProgress => std::thread::sleep(Duration::from_micros(50)),
                XferStatus::Done => break,
                XferStatus::Failed(e) => return Err(e),
            }
        }
        let n = target
            .wait_notification(Duration::from_secs(5))
            .expect("the target hears of the READ");
        assert_eq!(
            (n.from.as_str(), n.msg.as_slice()),
            ("initiator", &b"UUID1"[..])
        );
        println!("READ {round}: done, target notified");
    }

    // Prepared lists, and a WRITE that swaps the halves: local 0 -> remote 1, 1 -> 0.
    let local_prep = initiator.prepare(None, &local)?;
    let remote_prep = initiator.prepare(Some("target"), &remote)?;
    let write = initiator.request_prepared(
        XferOp::Write,
        &local_prep,
        &[0, 1],
        &remote_prep,
        &[1, 0],
        Some(b"UUID2"),
    )?;
    write.post()?.wait()?;
    let n = target
        .wait_notification(Duration::from_secs(5))
        .expect("the target hears of the WRITE");
    assert_eq!(n.msg, b"UUID2");
    println!("WRITE (remapped): done, target notified");

    // A notification on its own, both ways.
    target.send_notification("initiator", b"from target")?;
    let n = initiator
        .wait_notification(Duration::from_secs(5))
        .expect("the initiator hears from the target");
    assert_eq!(n.msg, b"from target");
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let engine = Engine::new()?;
    let target = Agent::new(&engine, "target")?;
    let initiator = Agent::new(&engine, "initiator")?;
    println!("transport to other processes: {}", target.transport());

    // Host memory: the target's buffer holds a pattern, the initiator's is empty.
    let pattern: Vec<u8> = (0..2 * BUF).map(|i| i as u8).collect();
    let theirs = target.register(pattern.clone())?;
    let mine = initiator.register(vec![0u8; 2 * BUF])?;
    initiator.add_peer(&target.metadata())?;
    target.add_peer(&initiator.metadata())?;
    run(&target, &initiator, &theirs, &mine)?;
    let mine = mine.release_blocking();
    let theirs = theirs.release_blocking();
    assert_eq!(mine, pattern, "READ brought the target's bytes");
    assert_eq!(&theirs[..BUF], &pattern[BUF..], "WRITE swapped the halves");
    assert_eq!(&theirs[BUF..], &pattern[..BUF]);
    println!("host memory: every byte checked");

    if gpuio::cuda::available() {
        let gpus = gpuio::cuda::probe().devices.len();
        let ctx = gpuio::cuda::context(0)?;
        let other = gpuio::cuda::context(gpus.saturating_sub(1))?;
        let s0 = ctx.default_stream();
        let s1 = other.default_stream();
        let dev = |e: gpuio::cuda::cudarc::driver::DriverError| {
            std::io::Error::other(format!("CUDA: {e:?}"))
        };
        let theirs = target.register(s0.clone_htod(&pattern).map_err(dev)?)?;
        let mine = initiator.register(s1.alloc_zeros::<u8>(2 * BUF).map_err(dev)?)?;
        // The peers' metadata changed (new registrations): load it again.
        initiator.add_peer(&target.metadata())?;
        target.add_peer(&initiator.metadata())?;
        assert_eq!(theirs.descs().mem, MemType::Device);
        run(&target, &initiator, &theirs, &mine)?;
        let mine = mine.release_blocking();
        let theirs = theirs.release_blocking();
        let (m, t) = (
            s1.clone_dtoh(&mine).map_err(dev)?,
            s0.clone_dtoh(&theirs).map_err(dev)?,
        );
        assert_eq!(m, pattern);
        assert_eq!(&t[..BUF], &pattern[BUF..]);
        println!(
            "device memory (GPU {} <-> GPU 0): every byte checked",
            gpus.saturating_sub(1)
        );
    } else {
        println!("device memory: skipped (no CUDA device here)");
    }

    initiator.remove_peer("target")?;
    target.remove_peer("initiator")?;
    println!("agents example: OK");
    Ok(())
}
