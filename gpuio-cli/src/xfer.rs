//! `gpuio xfer`: transfers between two agents, nixlbench-style. Two agents in this process
//! (`--procs 1`, the shape of NIXL's two-agent example) or an initiator here and a target in a
//! child process it starts itself (`--procs 2`, over UCX); host or device memory on either
//! side; READ or WRITE; GB/s, descriptors/s, latency percentiles, CPU and the path served.
//! `--notif` measures a notification's one-way latency instead (half a ping-pong).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use gpuio::Engine;
use gpuio::agent::{Agent, AgentConfig, Desc, DescList, XferOp};

use crate::CliResult;
use crate::size::{ByteSize, fmt_bytes, short_size};
use crate::stdout::outln;
use crate::validate;

#[derive(Args, Debug, Clone)]
pub struct XferArgs {
    /// Bytes per descriptor.
    #[arg(long, default_value = "16M", value_parser = validate::positive_size)]
    size: ByteSize,
    /// Descriptors per transfer.
    #[arg(long, default_value_t = 64)]
    descs: usize,
    /// READ (initiator pulls from the target) or WRITE (initiator pushes).
    #[arg(long, default_value = "read")]
    op: XferOp,
    /// The initiator's memory: dram, or vram:N (GPU N).
    #[arg(long, default_value = "dram")]
    initiator: MemSpec,
    /// The target's memory: dram, or vram:N.
    #[arg(long, default_value = "dram")]
    target: MemSpec,
    /// 1: both agents in this process; 2: the target in a child process (over UCX).
    #[arg(long, default_value_t = 1)]
    procs: u8,
    /// Transfers per round.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Timed rounds (after one warm-up round); the median round is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Measure a notification's one-way latency (ping-pong) instead of transfers.
    #[arg(long)]
    notif: bool,
    /// Reach a peer process's device memory through UCX instead of CUDA IPC.
    #[arg(long)]
    no_ipc: bool,
    /// Device memory over UCX passes through host memory (as with a UCX without CUDA).
    #[arg(long)]
    stage: bool,
    /// One JSON object per result line as well.
    #[arg(long)]
    json: bool,
    /// Also run NIXL (its UCX backend, through gpuio-py/bench/nixl_xfer.py and python3) on the
    /// same case, alternating rounds, and print both medians and the ratio. The script is
    /// found through $GPUIO_NIXL_XFER, next to this binary, or under gpuio-py/bench/.
    #[arg(long, value_parser = ["nixl"])]
    compare: Option<String>,
    /// Run as the target of another `gpuio xfer --procs 2` (internal).
    #[arg(long, hide = true)]
    serve: bool,
}

/// Host memory or GPU N's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemSpec {
    Dram,
    Vram(usize),
}

impl std::str::FromStr for MemSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<MemSpec, String> {
        let l = s.to_ascii_lowercase();
        match l.split_once(':') {
            None if l == "dram" || l == "host" => Ok(MemSpec::Dram),
            None if l == "vram" || l == "gpu" => Ok(MemSpec::Vram(0)),
            Some(("vram" | "gpu", n)) => n
                .parse()
                .map(MemSpec::Vram)
                .map_err(|_| format!("{s:?}: the GPU number is not a number")),
            _ => Err(format!("{s:?}: want dram, vram or vram:N")),
        }
    }
}

impl std::fmt::Display for MemSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemSpec::Dram => f.write_str("DRAM"),
            MemSpec::Vram(n) => write!(f, "VRAM:{n}"),
        }
    }
}

/// A registration of either kind, kept until the run ends.
enum Held {
    Host(gpuio::agent::Registration<Vec<u8>>),
    Device(gpuio::agent::Registration<gpuio::agent::DeviceBuffer>),
}

impl Held {
    fn descs(&self) -> DescList {
        match self {
            Held::Host(r) => r.descs(),
            Held::Device(r) => r.descs(),
        }
    }
}

fn register(
    agent: &Agent,
    spec: MemSpec,
    bytes: usize,
    fill: u8,
) -> Result<Held, Box<dyn std::error::Error + Send + Sync>> {
    match spec {
        MemSpec::Dram => Ok(Held::Host(agent.register(vec![fill; bytes])?)),
        MemSpec::Vram(n) => {
            let b = gpuio::agent::DeviceBuffer::new(n, bytes)?;
            b.write(&vec![fill; bytes])?;
            Ok(Held::Device(agent.register(b)?))
        }
    }
}

/// `descs` pieces of `size` bytes each, side by side in `whole`.
fn split(whole: &DescList, descs: usize, size: u64) -> DescList {
    let base = whole.descs[0];
    DescList::new(
        whole.mem,
        (0..descs as u64)
            .map(|i| Desc::new(base.addr + i * size, size, base.dev))
            .collect(),
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    let s = s.trim();
    if s.len() % 2 != 0 {
        return Err("odd-length hex".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

pub async fn run(a: XferArgs) -> CliResult {
    if a.serve {
        return serve(&a);
    }
    if a.descs == 0 || a.iters == 0 || a.rounds == 0 {
        return Err("--descs, --iters and --rounds must be at least 1".into());
    }
    if !(1..=2).contains(&a.procs) {
        return Err(format!("--procs {}: want 1 or 2", a.procs).into());
    }
    let engine = Engine::new()?;
    let bytes = a.size.0 as usize * a.descs;
    let config = AgentConfig {
        same_host_ipc: !a.no_ipc,
        stage_device_memory: a.stage,
        ..AgentConfig::default()
    };
    let initiator = Agent::with_config(&engine, "initiator", config.clone())?;
    let mine = register(&initiator, a.initiator, bytes, 0)?;
    // The target: an agent here, or a child process running `--serve`.
    let mut child: Option<Child> = None;
    let mut _target_here = None;
    let mut local_echo = None;
    let theirs = if a.procs == 1 {
        let target = Agent::with_config(&engine, "target", config)?;
        let reg = register(&target, a.target, bytes, 0x5a)?;
        initiator.add_peer(&target.metadata())?;
        target.add_peer(&initiator.metadata())?;
        let d = reg.descs();
        if a.notif {
            local_echo = Some(start_local_echo(&target));
        }
        _target_here = Some((target, reg));
        d
    } else {
        let mut c = Command::new(std::env::current_exe()?)
            .args([
                "xfer",
                "--serve",
                "--size",
                &a.size.0.to_string(),
                "--descs",
                &a.descs.to_string(),
                "--target",
                &a.target.to_string().to_ascii_lowercase(),
            ])
            .args(a.no_ipc.then_some("--no-ipc"))
            .args(a.stage.then_some("--stage"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut out = BufReader::new(c.stdout.take().ok_or("no child stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        let meta = unhex(
            line.strip_prefix("META ")
                .ok_or("the target sent no metadata")?,
        )?;
        line.clear();
        out.read_line(&mut line)?;
        let d = DescList::deserialize(&unhex(
            line.strip_prefix("DESCS ")
                .ok_or("the target sent no descriptors")?,
        )?)?;
        initiator.add_peer(&meta)?;
        let stdin = c.stdin.as_mut().ok_or("no child stdin")?;
        writeln!(stdin, "META {}", hex(&initiator.metadata()))?;
        stdin.flush()?;
        child = Some(c);
        d
    };
    let result = match &a.compare {
        None if a.notif => notif_latency(&a, &initiator).map(|_| ()),
        None => transfers(&a, &initiator, &mine, &theirs).await.map(|_| ()),
        Some(peer) => compare(&a, peer, &initiator, &mine, &theirs).await,
    };
    if let Some((stop, t)) = local_echo {
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = t.join();
    }
    if let Some(mut c) = child {
        drop(c.stdin.take()); // EOF: the target exits.
        c.wait()?;
    }
    result
}

async fn transfers(
    a: &XferArgs,
    initiator: &Agent,
    mine: &Held,
    theirs: &DescList,
) -> Result<f64, Box<dyn std::error::Error + Send + Sync>> {
    let size = a.size.0;
    let local = split(&mine.descs(), a.descs, size);
    let remote = split(theirs, a.descs, size);
    let req = initiator.request(a.op, &local, "target", &remote, None)?;
    let bytes = req.bytes();
    let mut rounds = Vec::new();
    let mut hist = hdrhistogram::Histogram::<u64>::new(3)?;
    for round in 0..=a.rounds {
        let cpu0 = crate::bench::process_cpu_seconds();
        let t = Instant::now();
        for _ in 0..a.iters {
            let t1 = Instant::now();
            req.post()?.await?;
            if round > 0 {
                hist.record(t1.elapsed().as_nanos() as u64)?;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        if round > 0 {
            rounds.push((secs, crate::bench::process_cpu_seconds() - cpu0));
        }
    }
    rounds.sort_by(|x, y| x.0.total_cmp(&y.0));
    let (secs, cpu) = rounds[rounds.len() / 2];
    let gbs = (bytes * a.iters as u64) as f64 / secs / 1e9;
    let dps = (a.descs * a.iters) as f64 / secs;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    outln!(
        "{:?} {} x {} {} (initiator) {} {} (target), {} process{}: {:.2} GB/s, {:.0} descriptors/s, \
         per transfer p50 {:.1} us p99 {:.1} us, {:.2} cores here; path: {}",
        a.op,
        a.descs,
        short_size(size),
        a.initiator,
        if a.op == XferOp::Read { "<-" } else { "->" },
        a.target,
        a.procs,
        if a.procs == 1 { "" } else { "es" },
        gbs,
        dps,
        us(0.5),
        us(0.99),
        cpu / secs,
        req.path()
    )?;
    if a.json {
        outln!(
            "{}",
            serde_json::json!({
                "op": format!("{:?}", a.op), "size": size, "descs": a.descs,
                "initiator": a.initiator.to_string(), "target": a.target.to_string(),
                "procs": a.procs, "gbps": gbs, "descs_per_s": dps,
                "p50_us": us(0.5), "p99_us": us(0.99), "cores": cpu / secs,
                "path": req.path().to_string(), "bytes": fmt_bytes(bytes),
            })
        )?;
    }
    Ok(gbs)
}

fn notif_latency(
    a: &XferArgs,
    initiator: &Agent,
) -> Result<f64, Box<dyn std::error::Error + Send + Sync>> {
    let mut hist = hdrhistogram::Histogram::<u64>::new(3)?;
    let n = a.iters.max(1000);
    for i in 0..n + 100 {
        let t = Instant::now();
        initiator.send_notification("target", b"ping")?;
        let back = initiator
            .wait_notification(Duration::from_secs(10))
            .ok_or("no answer to a ping within 10 s")?;
        if back.msg != b"ping" {
            return Err(format!("unexpected notification {:?}", back.msg).into());
        }
        if i >= 100 {
            hist.record(t.elapsed().as_nanos() as u64 / 2)?;
        }
    }
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    outln!(
        "notification one way ({} process{}): p50 {:.1} us, p99 {:.1} us over {n} round trips",
        a.procs,
        if a.procs == 1 { "" } else { "es" },
        us(0.5),
        us(0.99)
    )?;
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"notif_one_way_p50_us": us(0.5), "p99_us": us(0.99), "procs": a.procs})
        )?;
    }
    Ok(us(0.5))
}

/// The target side of `--procs 1` pings, run on a thread: echoes every notification.
fn echo(target: Agent, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if let Some(n) = target.wait_notification(Duration::from_millis(50)) {
            let _ = target.send_notification(&n.from, &n.msg);
        }
    }
}

/// `--serve`: register the target's memory, print its metadata and descriptors, load the
/// initiator's metadata, echo notifications until stdin closes.
fn serve(a: &XferArgs) -> CliResult {
    let engine = Engine::new()?;
    let config = AgentConfig {
        same_host_ipc: !a.no_ipc,
        stage_device_memory: a.stage,
        ..AgentConfig::default()
    };
    let target = Agent::with_config(&engine, "target", config)?;
    let reg = register(&target, a.target, a.size.0 as usize * a.descs, 0x5a)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "META {}", hex(&target.metadata()))?;
    writeln!(out, "DESCS {}", hex(&reg.descs().serialize()))?;
    out.flush()?;
    drop(out);
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let meta = unhex(line.strip_prefix("META ").ok_or("no initiator metadata")?)?;
    target.add_peer(&meta)?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let echoer = {
        let (t, s) = (target.clone(), stop.clone());
        std::thread::spawn(move || echo(t, s))
    };
    // Until the initiator closes stdin.
    let mut rest = String::new();
    while std::io::stdin().lock().read_line(&mut rest)? > 0 {}
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = echoer.join();
    drop(reg);
    Ok(())
}

/// The target's echo thread for `--procs 1 --notif`.
fn start_local_echo(
    target: &Agent,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (t, s) = (target.clone(), stop.clone());
    (stop, std::thread::spawn(move || echo(t, s)))
}

/// The NIXL peer script, where one is found.
fn nixl_script() -> Option<std::path::PathBuf> {
    if let Ok(p) = std::env::var("GPUIO_NIXL_XFER") {
        return Some(p.into());
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join("nixl_xfer.py"),
        dir.join("../nixl_xfer.py"),
        dir.join("../py/bench/nixl_xfer.py"),
        "gpuio-py/bench/nixl_xfer.py".into(),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// One NIXL round of the same case: its JSON line's `key`, or why there is none.
fn nixl_round(a: &XferArgs, script: &std::path::Path, key: &str) -> Result<f64, String> {
    let py = std::env::var("GPUIO_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(py);
    cmd.arg(script).args([
        "--size",
        &a.size.0.to_string(),
        "--descs",
        &a.descs.to_string(),
        "--op",
        if a.op == XferOp::Read {
            "read"
        } else {
            "write"
        },
        "--initiator",
        &a.initiator.to_string().to_ascii_lowercase(),
        "--target",
        &a.target.to_string().to_ascii_lowercase(),
        "--procs",
        &a.procs.to_string(),
        "--iters",
        &a.iters.to_string(),
        "--rounds",
        "1",
        "--json",
    ]);
    if a.notif {
        cmd.arg("--notif");
    }
    let out = cmd
        .output()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if let Some(l) = text.lines().find(|l| l.starts_with("SKIPPED")) {
        return Err(l.to_string());
    }
    let json = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .ok_or_else(|| {
            format!(
                "NIXL printed no result (exit {}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            )
        })?;
    json.get(key)
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| format!("NIXL's result has no {key}: {json}"))
}

/// `--compare nixl`: alternating rounds of gpuio and NIXL on the same case.
async fn compare(
    a: &XferArgs,
    _peer: &str,
    initiator: &Agent,
    mine: &Held,
    theirs: &DescList,
) -> CliResult {
    let script = nixl_script().ok_or(
        "--compare nixl: nixl_xfer.py not found (set GPUIO_NIXL_XFER to gpuio-py/bench/nixl_xfer.py)",
    )?;
    let key = if a.notif {
        "notif_one_way_p50_us"
    } else {
        "gbps"
    };
    let one = XferArgs {
        rounds: 1,
        json: false,
        ..a.clone()
    };
    let (mut ours, mut theirs_v) = (Vec::new(), Vec::new());
    for _ in 0..a.rounds {
        ours.push(if a.notif {
            notif_latency(&one, initiator)?
        } else {
            transfers(&one, initiator, mine, theirs).await?
        });
        match nixl_round(a, &script, key) {
            Ok(v) => theirs_v.push(v),
            Err(e) => {
                outln!("NIXL: {e}")?;
                return Ok(());
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (g, n) = (median(&mut ours), median(&mut theirs_v));
    let unit = if a.notif {
        "us one way (lower is better)"
    } else {
        "GB/s"
    };
    let ratio = if a.notif { n / g } else { g / n };
    outln!(
        "compare over {} alternating rounds: gpuio {g:.2} {unit}, NIXL {n:.2}; gpuio/NIXL {ratio:.2}x",
        a.rounds
    )?;
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"compare": "nixl", "gpuio": g, "nixl": n, "ratio": ratio,
                "metric": key, "rounds": a.rounds})
        )?;
    }
    Ok(())
}
