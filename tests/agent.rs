//! Agents in one process: NIXL's two-agent example in host memory (and in device memory
//! where a GPU is present), every bad input an error, and transfers whose futures are dropped
//! or leaked mid-flight never writing memory their owner got back.

use std::time::Duration;

use gpuio::Engine;
use gpuio::agent::{Agent, AgentConfig, Desc, DescList, MemType, UcxMode, XferOp, XferPath};

fn engine() -> Engine {
    Engine::builder().bounce_slots(4).build().unwrap()
}

/// Two agents that know each other, without UCX (so nothing here depends on it).
fn pair(e: &Engine) -> (Agent, Agent) {
    let cfg = AgentConfig {
        ucx: UcxMode::Off,
        ..AgentConfig::default()
    };
    let target = Agent::with_config(e, "target", cfg.clone()).unwrap();
    let initiator = Agent::with_config(e, "initiator", cfg).unwrap();
    assert_eq!(initiator.add_peer(&target.metadata()).unwrap(), "target");
    assert_eq!(target.add_peer(&initiator.metadata()).unwrap(), "initiator");
    (target, initiator)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test]
async fn read_write_prepared_and_notifications_in_host_memory() {
    let e = engine();
    let (target, initiator) = pair(&e);
    let n = 4 << 20;
    let theirs = target.register(pattern(n, 1)).unwrap();
    let mine = initiator.register(vec![0u8; n]).unwrap();

    // READ the whole buffer, repeatedly, with a notification after each.
    let read = initiator
        .request(
            XferOp::Read,
            &mine.descs(),
            "target",
            &theirs.descs(),
            Some(b"UUID1"),
        )
        .unwrap();
    assert_eq!(read.path(), XferPath::HostCopy);
    for _ in 0..3 {
        read.post().unwrap().await.unwrap();
        let note = target.wait_notification(Duration::from_secs(5)).unwrap();
        assert_eq!(
            (note.from.as_str(), note.msg.as_slice()),
            ("initiator", &b"UUID1"[..])
        );
    }

    // WRITE with prepared lists and remapped indices: local half 0 goes to remote half 1 and
    // local half 1 to remote half 0.
    let h = (n / 2) as u64;
    let split = |d: &DescList| {
        let a = d.descs[0];
        DescList::new(
            d.mem,
            vec![Desc::new(a.addr, h, a.dev), Desc::new(a.addr + h, h, a.dev)],
        )
    };
    let local = initiator.prepare(None, &split(&mine.descs())).unwrap();
    let remote = initiator
        .prepare(Some("target"), &split(&theirs.descs()))
        .unwrap();
    let w = initiator
        .request_prepared(
            XferOp::Write,
            &local,
            &[0, 1],
            &remote,
            &[1, 0],
            Some(b"UUID2"),
        )
        .unwrap();
    w.post().unwrap().await.unwrap();
    let notes = target.take_notifications();
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].msg, b"UUID2");

    // A notification on its own, as a stream.
    initiator.send_notification("target", b"hello").unwrap();
    use futures::StreamExt;
    let note = target.notifications().next().await.unwrap();
    assert_eq!(note.msg, b"hello");

    let mine = mine.release().await;
    let theirs = theirs.release().await;
    let p = pattern(n, 1);
    assert_eq!(mine, p);
    assert_eq!(&theirs[..n / 2], &p[n / 2..]);
    assert_eq!(&theirs[n / 2..], &p[..n / 2]);
}

#[tokio::test]
async fn many_small_descriptors() {
    let e = engine();
    let (target, initiator) = pair(&e);
    let count = 4096;
    let theirs = target.register(pattern(count * 4096, 9)).unwrap();
    let mine = initiator.register(vec![0u8; count * 4096]).unwrap();
    let descs = |d: &DescList| {
        let a = d.descs[0];
        // Reversed order, so a mix-up of pairs shows.
        DescList::new(
            d.mem,
            (0..count as u64)
                .map(|i| Desc::new(a.addr + i * 4096, 4096, 0))
                .collect(),
        )
    };
    let mut remote = descs(&theirs.descs());
    remote.descs.reverse();
    initiator
        .transfer(XferOp::Read, &descs(&mine.descs()), "target", &remote, None)
        .unwrap()
        .await
        .unwrap();
    let got = mine.release().await;
    let want = pattern(count * 4096, 9);
    for i in 0..count {
        let j = count - 1 - i;
        assert_eq!(
            &got[i * 4096..(i + 1) * 4096],
            &want[j * 4096..(j + 1) * 4096]
        );
    }
    drop(theirs);
}

#[test]
fn every_bad_input_is_an_error() {
    let e = engine();
    let (target, initiator) = pair(&e);
    let theirs = target.register(vec![1u8; 1 << 16]).unwrap();
    let mine = initiator.register(vec![0u8; 1 << 16]).unwrap();
    let l = mine.descs();
    let r = theirs.descs();
    let msg = |x: gpuio::Result<gpuio::agent::XferRequest>| match x {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };

    // A descriptor outside any registration, on either side.
    let mut out = l.clone();
    out.descs[0].addr += 1;
    assert!(
        msg(initiator.request(XferOp::Read, &out, "target", &r, None))
            .contains("local descriptor 0")
    );
    let mut out = r.clone();
    out.descs[0].len += 1;
    out.descs[0].addr -= 0;
    let mut l2 = l.clone();
    l2.descs[0].len += 1;
    assert!(
        msg(initiator.request(XferOp::Read, &l2, "target", &r, None)).contains("local descriptor")
    );
    let mut r2 = r.clone();
    r2.descs[0].addr += 8;
    assert!(
        msg(initiator.request(XferOp::Read, &l, "target", &r2, None))
            .contains("remote descriptor 0")
    );
    // The wrong memory kind.
    let mut dev = r.clone();
    dev.mem = MemType::Device;
    assert!(
        msg(initiator.request(XferOp::Read, &l, "target", &dev, None))
            .contains("remote descriptor 0")
    );
    // Lengths that differ, counts that differ, nothing at all.
    let mut short = r.clone();
    short.descs[0].len -= 1;
    assert!(msg(initiator.request(XferOp::Read, &l, "target", &short, None)).contains("pair 0"));
    let two = DescList::new(MemType::Host, vec![l.descs[0], l.descs[0]]);
    assert!(msg(initiator.request(XferOp::Read, &two, "target", &r, None)).contains("2 local"));
    let none = DescList::new(MemType::Host, vec![]);
    assert!(
        msg(initiator.request(XferOp::Read, &none, "target", &none, None))
            .contains("no descriptors")
    );
    // An unknown peer, and a removed one (a request made before removal fails when posted).
    assert!(msg(initiator.request(XferOp::Read, &l, "nobody", &r, None)).contains("add_peer"));
    let req = initiator
        .request(XferOp::Read, &l, "target", &r, None)
        .unwrap();
    initiator.remove_peer("target").unwrap();
    assert!(initiator.remove_peer("target").is_err());
    assert!(req.post().unwrap_err().to_string().contains("removed"));
    assert!(msg(initiator.request(XferOp::Read, &l, "target", &r, None)).contains("add_peer"));
    // Indices past a prepared list.
    initiator.add_peer(&target.metadata()).unwrap();
    let lp = initiator.prepare(None, &l).unwrap();
    let rp = initiator.prepare(Some("target"), &r).unwrap();
    assert!(
        initiator
            .request_prepared(XferOp::Read, &lp, &[1], &rp, &[0], None)
            .is_err()
    );
    assert!(
        initiator
            .request_prepared(XferOp::Read, &rp, &[0], &lp, &[0], None)
            .is_err()
    );
    // Metadata: garbage, truncated, its own, and stale (the agent it names was dropped).
    assert!(initiator.add_peer(b"not metadata at all").is_err());
    let m = target.metadata();
    assert!(initiator.add_peer(&m[..m.len() - 1]).is_err());
    assert!(initiator.add_peer(&initiator.metadata()).is_err());
    let ghost = Agent::with_config(
        &e,
        "ghost",
        AgentConfig {
            ucx: UcxMode::Off,
            ..AgentConfig::default()
        },
    )
    .unwrap();
    let stale = ghost.metadata();
    drop(ghost);
    let err = initiator.add_peer(&stale).unwrap_err().to_string();
    assert!(err.contains("stale"), "{err}");
    // Registrations: empty, overlapping.
    assert!(initiator.register(Vec::<u8>::new()).is_err());
    // SAFETY: the range is inside `mine`, which outlives this (refused) registration.
    let overlap = unsafe {
        gpuio::agent::RawMemory::new(MemType::Host, Desc::new(l.descs[0].addr + 8, 8, 0))
    };
    assert!(
        initiator
            .register(overlap)
            .unwrap_err()
            .to_string()
            .contains("overlap")
    );
    // A transfer posted after the remote registration was released.
    let req = initiator
        .request(XferOp::Write, &l, "target", &r, None)
        .unwrap();
    let back = theirs.release_blocking();
    assert_eq!(back.len(), 1 << 16);
    assert!(req.post().unwrap_err().to_string().contains("deregistered"));
    assert!(
        msg(initiator.request(XferOp::Write, &l, "target", &r, None))
            .contains("remote descriptor 0")
    );
    drop(mine);
}

/// Futures dropped or leaked mid-flight: the transfer still finishes before the memory comes
/// back, so the memory is whole (every byte written) when it does, and nothing writes it
/// afterwards (the canary past the transfer's end stays, and a buffer refilled after release
/// keeps its new contents).
#[test]
fn dropped_and_leaked_transfers_finish_before_memory_comes_back() {
    let e = engine();
    let (target, initiator) = pair(&e);
    let n = 64 << 20;
    for leak in [false, true] {
        let theirs = target.register(pattern(n, 3)).unwrap();
        let mut buf = vec![0u8; n + 4096];
        buf[n..].fill(0xAB);
        let mine = initiator.register(buf).unwrap();
        let l = DescList::new(
            MemType::Host,
            vec![Desc::new(mine.descs().descs[0].addr, n as u64, 0)],
        );
        for _ in 0..4 {
            let t = initiator
                .transfer(XferOp::Read, &l, "target", &theirs.descs(), None)
                .unwrap();
            if leak {
                std::mem::forget(t);
            } else {
                drop(t);
            }
        }
        let mut back = mine.release_blocking();
        assert!(
            back[..n] == pattern(n, 3)[..],
            "a released buffer was not whole (leak {leak})"
        );
        assert!(
            back[n..].iter().all(|&b| b == 0xAB),
            "the canary was written"
        );
        back.fill(0x11);
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            back.iter().all(|&b| b == 0x11),
            "memory was written after release"
        );
        drop(theirs);
    }
}

#[test]
fn transfers_and_notifications_from_many_threads() {
    let e = engine();
    let (target, initiator) = pair(&e);
    let theirs = target.register(pattern(1 << 20, 5)).unwrap();
    let mine = initiator.register(vec![0u8; 1 << 20]).unwrap();
    let req = initiator
        .request(
            XferOp::Read,
            &mine.descs(),
            "target",
            &theirs.descs(),
            Some(b"n"),
        )
        .unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    req.post().unwrap().wait().unwrap();
                }
            });
        }
    });
    assert_eq!(target.take_notifications().len(), 200);
    assert_eq!(mine.release_blocking(), pattern(1 << 20, 5));
}

/// Device memory between two agents in this process: same GPU, across GPUs where there are
/// two, and host to device; READ and WRITE; leaked futures with a canary past the range.
#[test]
fn device_memory_in_one_process() {
    if !gpuio::cuda::available() {
        println!("SKIPPED: no CUDA device here");
        return;
    }
    use gpuio::agent::DeviceBuffer;
    let e = engine();
    let (target, initiator) = pair(&e);
    let gpus = gpuio::cuda::probe().devices.len();
    let n = 32 << 20;
    for (theirs_gpu, mine_gpu) in [(0, 0), (gpus - 1, 0)] {
        let theirs_buf = DeviceBuffer::new(theirs_gpu, n).unwrap();
        theirs_buf.write(&pattern(n, 11)).unwrap();
        let theirs = target.register(theirs_buf).unwrap();
        let mine_buf = DeviceBuffer::new(mine_gpu, n + 4096).unwrap();
        let mut canary = vec![0u8; n + 4096];
        canary[n..].fill(0xCD);
        mine_buf.write(&canary).unwrap();
        let mine = initiator.register(mine_buf).unwrap();
        initiator.add_peer(&target.metadata()).unwrap();
        let whole = mine.descs().descs[0];
        let l = DescList::new(
            MemType::Device,
            vec![Desc::new(whole.addr, n as u64, whole.dev)],
        );
        let read = initiator
            .request(XferOp::Read, &l, "target", &theirs.descs(), Some(b"r"))
            .unwrap();
        assert_eq!(read.path(), XferPath::CudaCopy);
        for _ in 0..3 {
            std::mem::forget(read.post().unwrap());
        }
        read.post().unwrap().wait().unwrap();
        assert_eq!(target.take_notifications().len(), 4);
        let back = mine.release_blocking().to_vec().unwrap();
        assert!(
            back[..n] == pattern(n, 11)[..],
            "GPU {theirs_gpu} -> GPU {mine_gpu}"
        );
        assert!(
            back[n..].iter().all(|&b| b == 0xCD),
            "the canary was written"
        );
        // WRITE from host memory into the target's device memory.
        let src = initiator.register(pattern(n, 12)).unwrap();
        initiator
            .transfer(XferOp::Write, &src.descs(), "target", &theirs.descs(), None)
            .unwrap()
            .wait()
            .unwrap();
        assert!(theirs.release_blocking().to_vec().unwrap() == pattern(n, 12));
        drop(src);
    }
}
