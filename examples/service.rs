//! An async service that answers "checksum bytes [offset, offset + len) of the file" by loading
//! the range onto the GPU with `.await`ed reads and checksumming it there with a kernel, plus a
//! load generator that reports latency percentiles and throughput and verifies every answer.
//!
//!     cargo run --release --example service                       # both, in one process
//!     cargo run --release --example service -- --serve 127.0.0.1:7070 --file F
//!     cargo run --release --example service -- --connect 127.0.0.1:7070 --file F
//!
//! Options: `--file F` (default: a 256 MiB sample file), `--clients N` (64), `--requests M`
//! (20000), `--max-len BYTES` (1048576), `--slots S` (device buffers, 64), `--seed X`.
//!
//! The protocol is one line per request, `READ <offset> <len>`, answered by
//! `OK <bytes> <checksum>` or `ERR <reason>`. The service runs on a multi-thread tokio runtime;
//! each request takes one of S device buffers and its CUDA stream, reads into it with
//! `read_into(..).on_stream(..)`, queues the checksum kernel behind the read, and waits with
//! `Engine::synchronize` (no worker thread is parked in `cuStreamSynchronize`). Without a
//! GPU the same service reads into host buffers and checksums on the CPU, and says so.

#[path = "common/checksum.rs"]
mod checksum;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use checksum::{KERNEL, PrefixChecksum, weighted_sum};
use gpuio::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Options {
    file: Option<PathBuf>,
    serve: Option<String>,
    connect: Option<String>,
    clients: usize,
    requests: usize,
    max_len: usize,
    slots: usize,
    seed: u64,
}

fn options() -> Result<Options, BoxError> {
    let mut o = Options {
        file: None,
        serve: None,
        connect: None,
        clients: 64,
        requests: 20_000,
        max_len: 1 << 20,
        slots: 64,
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--file" => o.file = Some(value()?.into()),
            "--serve" => o.serve = Some(value()?),
            "--connect" => o.connect = Some(value()?),
            "--clients" => o.clients = value()?.parse()?,
            "--requests" => o.requests = value()?.parse()?,
            "--max-len" => o.max_len = value()?.parse()?,
            "--slots" => o.slots = value()?.parse()?,
            "--seed" => o.seed = value()?.parse()?,
            other => {
                return Err(format!("unknown argument {other:?} (see the file's header)").into());
            }
        }
    }
    if o.clients == 0 || o.max_len == 0 || o.slots == 0 {
        return Err("--clients, --max-len and --slots must be positive".into());
    }
    Ok(o)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), BoxError> {
    let o = options()?;
    let path = match &o.file {
        Some(p) => p.clone(),
        None => sample_file(256 << 20)?,
    };
    match (&o.serve, &o.connect) {
        (Some(addr), None) => {
            let listener = TcpListener::bind(addr).await?;
            let service = Service::start(&path, o.max_len, o.slots)?;
            println!(
                "serving {} on {} ({})",
                path.display(),
                listener.local_addr()?,
                service.kind()
            );
            tokio::select! {
                r = service.serve(listener) => r,
                _ = tokio::signal::ctrl_c() => Ok(()),
            }
        }
        (None, Some(addr)) => load(addr, &path, &o).await,
        (None, None) => {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?.to_string();
            let service = Service::start(&path, o.max_len, o.slots)?;
            println!("service on {addr}: {} ({})", path.display(), service.kind());
            let server = tokio::spawn(service.serve(listener));
            let r = load(&addr, &path, &o).await;
            server.abort();
            r
        }
        (Some(_), Some(_)) => Err("give --serve or --connect, not both".into()),
    }
}

// ---------------------------------------------------------------------------------------------
// The service

/// A device buffer with its own stream and result word: one request's worth of GPU state.
struct GpuSlot {
    stream: Arc<CudaStream>,
    buf: CudaSlice<u8>,
    out: CudaSlice<u64>,
}

enum Memory {
    Gpu {
        ctx: Arc<CudaContext>,
        kernel: CudaFunction,
        slots: std::sync::Mutex<Vec<GpuSlot>>,
    },
    Host {
        why: String,
        slots: std::sync::Mutex<Vec<Vec<u8>>>,
    },
}

struct Service {
    engine: gpuio::Engine,
    file: gpuio::File,
    max_len: usize,
    /// One permit per buffer: a request holds one while it uses a buffer.
    permits: Semaphore,
    memory: Memory,
}

impl Service {
    fn start(path: &std::path::Path, max_len: usize, slots: usize) -> Result<Arc<Self>, BoxError> {
        let engine = gpuio::Engine::new()?;
        let file = engine.open(path)?;
        let memory = match gpuio::cuda::context(0) {
            Ok(ctx) => {
                let ptx = cudarc::nvrtc::compile_ptx(KERNEL)?;
                let kernel = ctx.load_module(ptx)?.load_function("weighted_sum")?;
                let mut v = Vec::with_capacity(slots);
                for _ in 0..slots {
                    let stream = ctx.new_stream()?;
                    let buf = stream.alloc_zeros::<u8>(max_len)?;
                    let out = stream.alloc_zeros::<u64>(1)?;
                    v.push(GpuSlot { stream, buf, out });
                }
                Memory::Gpu {
                    ctx,
                    kernel,
                    slots: std::sync::Mutex::new(v),
                }
            }
            Err(e) => Memory::Host {
                why: e.to_string(),
                slots: std::sync::Mutex::new((0..slots).map(|_| vec![0u8; max_len]).collect()),
            },
        };
        Ok(Arc::new(Service {
            engine,
            file,
            max_len,
            permits: Semaphore::new(slots),
            memory,
        }))
    }

    fn kind(&self) -> String {
        match &self.memory {
            Memory::Gpu { ctx, .. } => format!(
                "GPU {} via {}, checksums by a kernel",
                ctx.ordinal(),
                self.file.gds_status()
            ),
            Memory::Host { why, .. } => {
                format!("no GPU ({why}); host memory, checksums on the CPU")
            }
        }
    }

    async fn serve(self: Arc<Self>, listener: TcpListener) -> Result<(), BoxError> {
        loop {
            let (sock, _) = listener.accept().await?;
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.connection(sock).await {
                    eprintln!("connection ended: {e}");
                }
            });
        }
    }

    async fn connection(&self, sock: TcpStream) -> Result<(), BoxError> {
        sock.set_nodelay(true)?;
        let (rd, mut wr) = sock.into_split();
        let mut lines = BufReader::new(rd).lines();
        while let Some(line) = lines.next_line().await? {
            let reply = match self.answer(&line).await {
                Ok((n, sum)) => format!("OK {n} {sum}\n"),
                Err(e) => format!("ERR {}\n", e.to_string().replace('\n', " ")),
            };
            wr.write_all(reply.as_bytes()).await?;
        }
        Ok(())
    }

    /// Parses `READ <offset> <len>` and answers it: (bytes read, checksum).
    async fn answer(&self, line: &str) -> Result<(usize, u64), BoxError> {
        let mut it = line.split_ascii_whitespace();
        let (Some("READ"), Some(off), Some(len), None) =
            (it.next(), it.next(), it.next(), it.next())
        else {
            return Err(format!("expected `READ <offset> <len>`, got {line:?}").into());
        };
        let (off, len): (u64, usize) = (off.parse()?, len.parse()?);
        if len > self.max_len {
            return Err(
                format!("len {len} is over the service's limit of {}", self.max_len).into(),
            );
        }
        let _permit = self.permits.acquire().await?;
        match &self.memory {
            Memory::Gpu { kernel, slots, .. } => {
                let mut slot = take(slots)?;
                let r = self.on_gpu(kernel, &mut slot, off, len).await;
                // A slot whose request failed midway still has queued work ordered on its
                // stream; cudarc orders the next use after it, so it can go back as it is.
                put(slots, slot);
                r
            }
            Memory::Host { slots, .. } => {
                let mut buf = take(slots)?;
                let r = self.file.read_into(&mut buf[..len], off).await;
                let r = r
                    .map(|n| (n, weighted_sum(&buf[..n], off)))
                    .map_err(BoxError::from);
                put(slots, buf);
                r
            }
        }
    }

    async fn on_gpu(
        &self,
        kernel: &CudaFunction,
        slot: &mut GpuSlot,
        off: u64,
        len: usize,
    ) -> Result<(usize, u64), BoxError> {
        let GpuSlot { stream, buf, out } = slot;
        stream.memset_zeros(out)?;
        let mut view = buf.slice_mut(0..len);
        let n = self
            .file
            .read_into(&mut view, off)
            .on_stream(stream)
            .await?;
        if n > 0 {
            let (n64, base) = (n as u64, off);
            let mut b = stream.launch_builder(kernel);
            b.arg(&*buf).arg(&n64).arg(&base).arg(&mut *out);
            // SAFETY: the kernel reads n <= len bytes of a buffer of max_len >= len bytes and
            // adds into the one u64 of `out`.
            unsafe { b.launch(LaunchConfig::for_num_elems((n as u32).min(1 << 16)))? };
        }
        // Wait for the copies and the kernel without parking this worker thread.
        self.engine.synchronize(stream).await?;
        let sum = stream.clone_dtoh(&*out)?[0];
        Ok((n, sum))
    }
}

fn take<T>(slots: &std::sync::Mutex<Vec<T>>) -> Result<T, BoxError> {
    slots
        .lock()
        .map_err(|_| "slot list poisoned")?
        .pop()
        .ok_or_else(|| "no free slot although a permit was held".into())
}

fn put<T>(slots: &std::sync::Mutex<Vec<T>>, v: T) {
    if let Ok(mut s) = slots.lock() {
        s.push(v);
    }
}

// ---------------------------------------------------------------------------------------------
// The load generator

/// `clients` connections, each sending requests one after another (closed loop) for random
/// ranges; every answer is checked against the file's prefix checksums.
async fn load(addr: &str, path: &std::path::Path, o: &Options) -> Result<(), BoxError> {
    let reference = Arc::new(PrefixChecksum::new(std::fs::read(path)?));
    let file_len = reference.len();
    if file_len == 0 {
        return Err("the file is empty".into());
    }
    let per_client = o.requests.div_ceil(o.clients);
    println!(
        "load: {} clients x {per_client} requests, ranges of 1..={} bytes at random offsets",
        o.clients, o.max_len
    );
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..o.clients {
        let (addr, reference, max_len) = (addr.to_string(), reference.clone(), o.max_len);
        let mut rng = fastrand::Rng::with_seed(o.seed ^ (c as u64).wrapping_mul(0x9e37_79b9));
        tasks.push(tokio::spawn(async move {
            let sock = TcpStream::connect(&addr).await?;
            sock.set_nodelay(true)?;
            let (rd, mut wr) = sock.into_split();
            let mut lines = BufReader::new(rd).lines();
            let mut st = ClientStats::default();
            for _ in 0..per_client {
                // Mostly inside the file; about 1 in 16 runs past its end (short answers).
                let len = rng.usize(1..=max_len);
                let off = rng.usize(0..file_len + file_len / 16) as u64;
                let t0 = Instant::now();
                wr.write_all(format!("READ {off} {len}\n").as_bytes())
                    .await?;
                let reply = lines
                    .next_line()
                    .await?
                    .ok_or("the service closed the connection")?;
                st.lat_ns.push(t0.elapsed().as_nanos() as u64);
                let want_n = (file_len as u64).saturating_sub(off).min(len as u64) as usize;
                match reply.split_ascii_whitespace().collect::<Vec<_>>()[..] {
                    ["OK", n, sum] => {
                        let (n, sum): (usize, u64) = (n.parse()?, sum.parse()?);
                        let start = off as usize;
                        if n != want_n || (n > 0 && sum != reference.range(start, start + n)) {
                            st.mismatches += 1;
                            eprintln!("MISMATCH at {off}+{len}: got {n} bytes, sum {sum}");
                        }
                        st.bytes += n as u64;
                    }
                    _ => {
                        st.errors += 1;
                        eprintln!("ERROR at {off}+{len}: {reply}");
                    }
                }
            }
            Ok::<ClientStats, BoxError>(st)
        }));
    }
    let mut all = ClientStats::default();
    for t in tasks {
        let st = t.await??;
        all.lat_ns.extend(st.lat_ns);
        all.bytes += st.bytes;
        all.errors += st.errors;
        all.mismatches += st.mismatches;
    }
    let secs = start.elapsed().as_secs_f64();
    all.lat_ns.sort_unstable();
    let pct = |p: f64| {
        let i = ((all.lat_ns.len() - 1) as f64 * p).round() as usize;
        Duration::from_nanos(all.lat_ns[i]).as_secs_f64() * 1e6
    };
    let n = all.lat_ns.len();
    println!(
        "{n} requests in {secs:.2} s: {:.0} req/s, {:.2} GB/s of payload\n\
         latency us: p50 {:.0}  p90 {:.0}  p99 {:.0}  p99.9 {:.0}  max {:.0}\n\
         verified {n} answers against the CPU: {} mismatches, {} errors",
        n as f64 / secs,
        all.bytes as f64 / secs / 1e9,
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(0.999),
        pct(1.0),
        all.mismatches,
        all.errors,
    );
    if all.mismatches + all.errors > 0 {
        return Err(format!("{} mismatches, {} errors", all.mismatches, all.errors).into());
    }
    Ok(())
}

#[derive(Default)]
struct ClientStats {
    lat_ns: Vec<u64>,
    bytes: u64,
    errors: u64,
    mismatches: u64,
}

fn sample_file(len: usize) -> std::io::Result<PathBuf> {
    let p = std::env::temp_dir().join("gpuio-service.bin");
    if std::fs::metadata(&p).map(|m| m.len() as usize).ok() != Some(len) {
        let data: Vec<u8> = (0..len as u64)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        std::fs::write(&p, data)?;
    }
    Ok(p)
}
