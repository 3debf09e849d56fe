//! Agents in two processes, over UCX (TCP over loopback stands in for a network): READ and
//! WRITE of host memory, notifications after the data, stale metadata of a restarted peer,
//! and a peer killed with SIGKILL mid-transfer failing its transfers within a bounded time
//! while another peer goes on.
//!
//! The peer is this test binary run again with `--ignored --exact child_target`: it registers
//! memory, prints its metadata and descriptors, loads the parent's metadata, echoes
//! notifications, and exits when its stdin closes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpuio::Engine;
use gpuio::agent::{Agent, AgentConfig, DescList, UcxMode, XferOp, XferPath};

const SIZE: usize = 8 << 20;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    let s = s.trim();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// UCX, or `None` with the reason printed (a failure where CI requires UCX).
fn ucx_or_skip() -> Option<()> {
    match gpuio::ucx::probe() {
        Ok(_) => Some(()),
        Err(e) if std::env::var("GPUIO_UCX_REQUIRED").as_deref() == Ok("1") => {
            panic!("UCX is required here (GPUIO_UCX_REQUIRED=1): {e}")
        }
        Err(e) => {
            println!("SKIPPED: no UCX: {e}");
            None
        }
    }
}

/// UCX and a CUDA device, or `None` after saying which is missing.
fn ucx_and_gpu_or_skip() -> Option<()> {
    ucx_or_skip()?;
    if !gpuio::cuda::available() {
        println!("SKIPPED: no CUDA device here");
        return None;
    }
    Some(())
}

struct Peer {
    child: Child,
    name: String,
    descs: DescList,
}

impl Peer {
    fn start(name: &str, seed: u8, parent: &Agent) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "child_target", "--nocapture"])
            .env("GPUIO_AGENT_CHILD", format!("{name}:{seed}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let (mut meta, mut descs) = (None, None);
        let mut line = String::new();
        while meta.is_none() || descs.is_none() {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the child exited early"
            );
            if let Some(m) = line.strip_prefix("META ") {
                meta = Some(unhex(m));
            } else if let Some(d) = line.strip_prefix("DESCS ") {
                descs = Some(DescList::deserialize(&unhex(d)).unwrap());
            }
        }
        // Keep draining the child's stdout so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in out.lines() {});
        let stdin = child.stdin.as_mut().unwrap();
        writeln!(stdin, "META {}", hex(&parent.metadata())).unwrap();
        stdin.flush().unwrap();
        let got = parent.add_peer(meta.as_ref().unwrap()).unwrap();
        assert_eq!(got, name);
        Peer {
            child,
            name: name.to_string(),
            descs: descs.unwrap(),
        }
    }

    fn stop(mut self) {
        drop(self.child.stdin.take());
        assert!(self.child.wait().unwrap().success());
    }
}

#[test]
#[ignore = "the peer process of the tests in this file, started by them"]
fn child_target() {
    let Ok(spec) = std::env::var("GPUIO_AGENT_CHILD") else {
        return;
    };
    let (name, seed) = spec.split_once(':').unwrap();
    let e = Engine::new().unwrap();
    let cfg = AgentConfig {
        ucx: UcxMode::Required,
        ..AgentConfig::default()
    };
    let me = Agent::with_config(&e, name, cfg).unwrap();
    let seed: u8 = seed.parse().unwrap();
    // "vram..." names get device memory (GPU 0), the rest host memory.
    #[cfg(feature = "cuda")]
    let _device_reg;
    let reg = me.register(pattern(SIZE, seed)).unwrap();
    #[cfg(feature = "cuda")]
    if name.starts_with("vram") {
        let b = gpuio::agent::DeviceBuffer::new(0, SIZE).unwrap();
        b.write(&pattern(SIZE, seed)).unwrap();
        let r = me.register(b).unwrap();
        println!("META {}", hex(&me.metadata()));
        println!("DESCS {}", hex(&r.descs().serialize()));
        _device_reg = Some(r);
    } else {
        _device_reg = None;
    }
    if !name.starts_with("vram") {
        println!("META {}", hex(&me.metadata()));
        println!("DESCS {}", hex(&reg.descs().serialize()));
    }
    std::io::stdout().flush().unwrap();
    let stdin = std::io::stdin();
    let mut line = String::new();
    stdin.lock().read_line(&mut line).unwrap();
    me.add_peer(&unhex(line.strip_prefix("META ").unwrap()))
        .unwrap();
    // Echo notifications; on "check", answer whether the memory holds the parent's WRITE.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let echo = {
        let (me, stop) = (me.clone(), stop.clone());
        let addr = reg.descs().descs[0].addr;
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(n) = me.wait_notification(Duration::from_millis(20)) {
                    let reply = if n.msg.starts_with(b"written:") {
                        // The WRITE's notification: its bytes must have landed already.
                        let seed: u8 = String::from_utf8_lossy(&n.msg[8..]).parse().unwrap();
                        // SAFETY: `reg` outlives this thread (joined below) and the parent
                        // writes nothing more until it gets this answer.
                        let now = unsafe { std::slice::from_raw_parts(addr as *const u8, SIZE) };
                        if now == pattern(SIZE, seed).as_slice() {
                            b"landed".to_vec()
                        } else {
                            b"missing".to_vec()
                        }
                    } else {
                        n.msg
                    };
                    me.send_notification(&n.from, &reply).unwrap();
                }
            }
        })
    };
    while stdin.lock().read_line(&mut line).unwrap() > 0 {}
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    echo.join().unwrap();
    drop(reg);
}

/// The parent agent: `direct` reaches same-host peers directly (cross-memory attach, CUDA
/// IPC), else everything goes over UCX.
fn parent_with(e: &Engine, direct: bool) -> Agent {
    let cfg = AgentConfig {
        ucx: UcxMode::Required,
        same_host_ipc: direct,
        ..AgentConfig::default()
    };
    Agent::with_config(e, "parent", cfg).unwrap()
}

fn parent(e: &Engine) -> Agent {
    parent_with(e, false)
}

#[tokio::test(flavor = "multi_thread")]
async fn read_write_and_notifications_across_processes() {
    if ucx_or_skip().is_none() {
        return;
    }
    for direct in [false, true] {
        read_write_and_notify(direct).await;
    }
}

async fn read_write_and_notify(direct: bool) {
    let e = Engine::new().unwrap();
    let me = parent_with(&e, direct);
    let peer = Peer::start("target", 7, &me);
    let mine = me.register(vec![0u8; SIZE]).unwrap();
    let read = me
        .request(XferOp::Read, &mine.descs(), &peer.name, &peer.descs, None)
        .unwrap();
    println!(
        "host memory across processes (direct {direct}): {}",
        read.path()
    );
    if !direct {
        assert_eq!(read.path(), XferPath::Ucx);
    }
    read.post().unwrap().await.unwrap();
    // WRITE another pattern back with a notification; the peer checks its memory when the
    // notification arrives and answers.
    let mine = mine.release().await;
    assert_eq!(mine, pattern(SIZE, 7));
    let mine = me.register(pattern(SIZE, 99)).unwrap();
    me.transfer(
        XferOp::Write,
        &mine.descs(),
        &peer.name,
        &peer.descs,
        Some(b"written:99"),
    )
    .unwrap()
    .await
    .unwrap();
    let answer = me.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(answer.msg, b"landed", "the notification overtook the data");
    // Ping-pong.
    for i in 0..100u32 {
        me.send_notification(&peer.name, &i.to_le_bytes()).unwrap();
        let n = me.wait_notification(Duration::from_secs(10)).unwrap();
        assert_eq!(n.msg, i.to_le_bytes());
    }
    peer.stop();
    drop(mine);
}

#[test]
fn a_killed_peer_fails_its_transfers_and_others_go_on() {
    if ucx_or_skip().is_none() {
        return;
    }
    let e = Engine::new().unwrap();
    let me = parent(&e);
    let doomed = Peer::start("doomed", 1, &me);
    let other = Peer::start("other", 2, &me);
    let mine = me.register(vec![0u8; SIZE]).unwrap();
    let to_doomed = me
        .request(
            XferOp::Read,
            &mine.descs(),
            &doomed.name,
            &doomed.descs,
            None,
        )
        .unwrap();
    let to_other = me
        .request(XferOp::Read, &mine.descs(), &other.name, &other.descs, None)
        .unwrap();
    to_doomed.post().unwrap().wait().unwrap();
    // Kill it with transfers in flight.
    let mut doomed_child = doomed.child;
    let inflight: Vec<_> = (0..8).map(|_| to_doomed.post().unwrap()).collect();
    doomed_child.kill().unwrap();
    let t = Instant::now();
    let mut failed = 0;
    for x in inflight {
        if x.wait().is_err() {
            failed += 1;
        }
    }
    // Later transfers fail too (once UCX has noticed), within a bounded time.
    loop {
        match to_doomed.post().unwrap().wait() {
            Err(e) => {
                println!("after SIGKILL: {e}");
                break;
            }
            Ok(()) => assert!(t.elapsed() < Duration::from_secs(30), "no error in 30 s"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "{failed} of 8 in-flight transfers failed; error after {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(30));
    let _ = doomed_child.wait();
    // The other peer is unaffected.
    to_other.post().unwrap().wait().unwrap();
    assert_eq!(mine.release_blocking(), pattern(SIZE, 2));
    other.stop();
}

#[test]
fn metadata_of_a_restarted_peer_is_refreshed_and_old_requests_fail() {
    if ucx_or_skip().is_none() {
        return;
    }
    let e = Engine::new().unwrap();
    let me = parent(&e);
    let first = Peer::start("target", 3, &me);
    let mine = me.register(vec![0u8; SIZE]).unwrap();
    let old = me
        .request(XferOp::Read, &mine.descs(), "target", &first.descs, None)
        .unwrap();
    old.post().unwrap().wait().unwrap();
    first.stop();
    // The peer restarts under the same name; its new metadata replaces the old.
    let second = Peer::start("target", 4, &me);
    let err = old.post().unwrap_err().to_string();
    assert!(err.contains("reloaded"), "{err}");
    me.transfer(XferOp::Read, &mine.descs(), "target", &second.descs, None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(mine.release_blocking(), pattern(SIZE, 4));
    second.stop();
}

/// Device memory of a peer process on this host: CUDA IPC where the allocation exports, READ
/// and WRITE, with the notification after the data.
#[test]
fn device_memory_across_processes_on_one_host() {
    if ucx_and_gpu_or_skip().is_none() {
        return;
    }
    let e = Engine::new().unwrap();
    let me = parent_with(&e, true);
    let peer = Peer::start("vram-target", 21, &me);
    let mine = gpuio::agent::DeviceBuffer::new(0, SIZE).unwrap();
    let mine = me.register(mine).unwrap();
    let read = me
        .request(XferOp::Read, &mine.descs(), &peer.name, &peer.descs, None)
        .unwrap();
    println!("device memory across processes: {}", read.path());
    assert_eq!(read.path(), XferPath::CudaIpc);
    read.post().unwrap().wait().unwrap();
    let got = mine.release_blocking();
    assert!(got.to_vec().unwrap() == pattern(SIZE, 21));
    got.write(&pattern(SIZE, 22)).unwrap();
    let mine = me.register(got).unwrap();
    me.transfer(
        XferOp::Write,
        &mine.descs(),
        &peer.name,
        &peer.descs,
        Some(b"hello"),
    )
    .unwrap()
    .wait()
    .unwrap();
    // The peer echoes every notification: the WRITE's comes back first, then the ping.
    me.send_notification(&peer.name, b"ping").unwrap();
    let n = me.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(n.msg, b"hello");
    let n = me.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(n.msg, b"ping");
    peer.stop();
    drop(mine);
}

/// Splits a one-descriptor list into `n` equal pieces, in reverse order when `reverse`.
fn pieces(list: &DescList, n: u64, reverse: bool) -> DescList {
    let d = list.descs[0];
    let step = d.len / n;
    let mut v: Vec<_> = (0..n)
        .map(|i| gpuio::agent::Desc::new(d.addr + i * step, step, d.dev))
        .collect();
    if reverse {
        v.reverse();
    }
    DescList::new(list.mem, v)
}

/// Local device memory over UCX staged through host memory (what a UCX without CUDA support
/// gets, forced here with `stage_device_memory`): READ and WRITE in four descriptors mapped
/// in reverse order, the notification after the data, and the device bytes checked.
#[test]
fn device_memory_staged_through_host_over_ucx() {
    if ucx_and_gpu_or_skip().is_none() {
        return;
    }
    let e = Engine::new().unwrap();
    let cfg = AgentConfig {
        ucx: UcxMode::Required,
        same_host_ipc: false,
        stage_device_memory: true,
    };
    let me = Agent::with_config(&e, "parent", cfg).unwrap();
    let peer = Peer::start("target", 31, &me);
    let mine = me
        .register(gpuio::agent::DeviceBuffer::new(0, SIZE).unwrap())
        .unwrap();
    let (local, remote) = (
        pieces(&mine.descs(), 4, false),
        pieces(&peer.descs, 4, true),
    );
    let read = me
        .request(XferOp::Read, &local, &peer.name, &remote, Some(b"read"))
        .unwrap();
    assert_eq!(read.path(), XferPath::UcxStaged);
    read.post().unwrap().wait().unwrap();
    // The READ's notification goes once the bytes are in the GPU; the peer echoes it.
    let echo = me.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(echo.msg, b"read");
    let got = mine.release_blocking();
    let want: Vec<u8> = pattern(SIZE, 31)
        .chunks(SIZE / 4)
        .rev()
        .flatten()
        .copied()
        .collect();
    assert!(got.to_vec().unwrap() == want, "staged READ misplaced bytes");
    // WRITE the peer's own pattern back through the same reversed mapping: its memory then
    // holds pattern 31 again only if every piece went where it should.
    got.write(&want).unwrap();
    let mine = me.register(got).unwrap();
    let (local, remote) = (
        pieces(&mine.descs(), 4, false),
        pieces(&peer.descs, 4, true),
    );
    let write = me
        .request(
            XferOp::Write,
            &local,
            &peer.name,
            &remote,
            Some(b"written:31"),
        )
        .unwrap();
    assert_eq!(write.path(), XferPath::UcxStaged);
    write.post().unwrap().wait().unwrap();
    let answer = me.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(
        answer.msg, b"landed",
        "the staged WRITE's bytes or order are wrong"
    );
    peer.stop();
    drop(mine);
}
