//! Loads a `.safetensors` checkpoint into GPU memory (one allocation, one batch) and prints
//! what it loaded and how fast.
//!
//!     cargo run --release --example load_safetensors -- MODEL.safetensors [PREFIX]
//!     cargo run --release --example load_safetensors -- --make OUT.safetensors SIZE_MIB
//!
//!     cargo run --release --example load_safetensors -- MODEL.safetensors --gpus 2 [--replicas once|each]
//!     cargo run --release --example load_safetensors -- MODEL.safetensors --gpus 2 --tp
//!
//! With PREFIX only tensors whose names start with it are loaded. `--gpus N` loads the whole
//! checkpoint onto each of GPUs 0..N (replicated, as tensor-parallel ranks hold norms and
//! embeddings): read once and copied GPU to GPU where the GPUs reach each other directly, or
//! as `--replicas` says; `--repeat K` loads it K times in one process. With `--tp` the GPUs are
//! the ranks of a tensor-parallel group instead: weights whose name has `out` split along
//! dimension 1 (row-parallel: rows of a few KiB each), other 2-D weights along dimension 0
//! (column-parallel: one contiguous range), 1-D tensors replicated. With more ranks than GPUs,
//! rank r goes on GPU r mod the GPUs there are. `--make` writes a synthetic
//! checkpoint of about SIZE_MIB (layers of f32/bf16/f16/i64 tensors) to measure with. Without a
//! GPU the checkpoint goes to host memory, and the example says so. Every loaded tensor's
//! checksum is compared with the file's bytes read by `std::fs` (`--no-verify` skips that).

use std::time::Instant;

use gpuio::Engine;
use gpuio::safetensors::{Dtype, Replicas, SafetensorsFile, Shard};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--make") {
        let [_, out, mib] = &args[..] else {
            return Err("usage: --make OUT.safetensors SIZE_MIB".into());
        };
        let mib: usize = mib.parse()?;
        make(out.as_ref(), mib << 20)?;
        println!("wrote {out} ({mib} MiB of tensors)");
        return Ok(());
    }
    let verify = !args.iter().any(|a| a == "--no-verify");
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let gpus: usize = flag("--gpus").map_or(Ok(1), |v| v.parse())?;
    let replicas: Replicas = flag("--replicas")
        .map_or(Ok(Replicas::Auto), |v| v.parse())
        .map_err(|e| format!("--replicas {e}"))?;
    // The stream the copies are queued on: a new one (default), or the context's default
    // stream, as `gpuio load` and torch use.
    let default_stream = match flag("--stream").map(String::as_str) {
        None | Some("new") => false,
        Some("default") => true,
        Some(other) => return Err(format!("--stream {other}: use new or default").into()),
    };
    let values: Vec<&String> = ["--gpus", "--replicas", "--repeat", "--stream"]
        .iter()
        .filter_map(|f| flag(f))
        .collect();
    let positional: Vec<&String> = args
        .iter()
        .filter(|a| !a.starts_with("--") && !values.contains(a))
        .collect();
    let Some(path) = positional.first() else {
        return Err("usage: load_safetensors MODEL.safetensors [PREFIX] [--no-verify]".into());
    };
    let prefix = positional.get(1).map(|s| s.as_str()).unwrap_or("");

    let engine = Engine::new()?;
    let start = Instant::now();
    let st = SafetensorsFile::open(&engine, path).await?;
    let header = start.elapsed();
    let keep = |name: &str| name.starts_with(prefix);
    let tp = args.iter().any(|a| a == "--tp");
    if tp && gpuio::cuda::context(0).is_err() {
        return host_tp(&st, gpus, verify).await;
    }
    if gpus > 1 || tp || flag("--repeat").is_some() {
        let repeat: usize = flag("--repeat").map_or(Ok(1), |v| v.parse())?;
        return ranked(&engine, &st, gpus, tp, replicas, verify, repeat).await;
    }
    let occ_start = engine.occupancy();
    let (loaded, tensors, where_, bytes_of, occ) = match gpuio::cuda::context(0) {
        Ok(ctx) => {
            let stream = if default_stream {
                ctx.default_stream()
            } else {
                ctx.new_stream()?
            };
            // Pinning the bounce pool is start-up work, not the load's (a service does it
            // once): timed apart.
            let tp = Instant::now();
            let pinned = engine.prepare_device(&ctx);
            println!(
                "bounce pool pinned: {pinned} in {:.1} ms",
                tp.elapsed().as_secs_f64() * 1e3
            );
            let t0 = Instant::now();
            let ck = st.load_device(&stream, keep).await?;
            engine.synchronize(&stream).await?; // the copies have landed
            let secs = t0.elapsed();
            let occ = engine.occupancy().since(&occ_start);
            let sums = if verify {
                let host = stream.clone_dtoh(ck.buffer())?;
                ck.tensors()
                    .iter()
                    .map(|t| fnv1a(&host[t.buffer_range.clone()]))
                    .collect()
            } else {
                Vec::new()
            };
            let path = format!("GPU 0 via {}", st.file().gds_status());
            let (_, tensors) = ck.into_parts();
            (secs, tensors, path, sums, occ)
        }
        Err(no_gpu) => {
            println!("no GPU ({no_gpu}); loading into host memory instead");
            let t0 = Instant::now();
            let ck = st.load_host(keep).await?;
            let secs = t0.elapsed();
            let occ = engine.occupancy().since(&occ_start);
            let sums = ck.iter().map(|(_, bytes)| fnv1a(bytes)).collect();
            let (_, tensors) = ck.into_parts();
            (secs, tensors, "host memory".to_string(), sums, occ)
        }
    };
    let bytes: u64 = tensors.iter().map(|t| t.byte_len() as u64).sum();
    let mut by_dtype = std::collections::BTreeMap::<String, (usize, u64)>::new();
    for t in &tensors {
        let e = by_dtype.entry(format!("{:?}", t.dtype)).or_default();
        e.0 += 1;
        e.1 += t.byte_len() as u64;
    }
    for t in tensors.iter().take(3) {
        println!("  {:<40} {:?} {:?}", t.name, t.dtype, t.shape);
    }
    if tensors.len() > 3 {
        println!("  ... and {} more", tensors.len() - 3);
    }
    for (dt, (n, b)) in &by_dtype {
        println!(
            "  {dt}: {n} tensors, {:.1} MiB",
            *b as f64 / (1 << 20) as f64
        );
    }
    if verify {
        let data = std::fs::read(path)?;
        for (t, sum) in tensors.iter().zip(&bytes_of) {
            let at = t.file_range.start as usize;
            if fnv1a(&data[at..at + t.byte_len()]) != *sum {
                return Err(format!("tensor {} differs from the file", t.name).into());
            }
        }
        println!("verified {} tensors against the file", tensors.len());
    }
    // Where the load's pieces spent their time: fewer in the kernel than the queue depth means
    // they waited elsewhere (for copies, for memory).
    println!("  engine (queue depth {}): {occ}", engine.queue_depth());
    println!(
        "loaded {} tensors, {:.3} GiB into {where_} in {:.3} s (header {:.1} ms): {:.2} GB/s",
        tensors.len(),
        bytes as f64 / (1u64 << 30) as f64,
        loaded.as_secs_f64(),
        header.as_secs_f64() * 1e3,
        bytes as f64 / loaded.as_secs_f64() / 1e9
    );
    Ok(())
}

/// Where each tensor goes under `--tp` (see the module docs).
fn tp_rule(t: &gpuio::safetensors::FileTensor) -> Option<Shard> {
    Some(match t.shape.len() {
        2 if t.name.contains("out") => Shard::Split(1),
        2 => Shard::Split(0),
        _ => Shard::Replicate,
    })
}

/// `--tp` without a GPU: the ranks' shards into host memory.
async fn host_tp(
    st: &SafetensorsFile,
    ranks: usize,
    verify: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    println!("no GPU: {ranks} ranks in host memory");
    let t0 = Instant::now();
    let loaded = st.load_shards_host(ranks, tp_rule).await?;
    let secs = t0.elapsed().as_secs_f64();
    if verify {
        let data = std::fs::read(st.file().path())?;
        for (r, ck) in loaded.iter().enumerate() {
            for ft in st.tensors() {
                let (Some(shard), Ok(got)) = (tp_rule(ft), ck.bytes(&ft.name)) else {
                    continue;
                };
                if got != &expected(&data, ft, shard, r, ranks)[..] {
                    return Err(
                        format!("rank {r}: tensor {} differs from the file", ft.name).into(),
                    );
                }
            }
        }
        println!("verified every rank's tensors against the file");
    }
    let file_bytes: u64 = st.tensors().iter().map(|t| t.byte_len() as u64).sum();
    println!(
        "split over {ranks} host ranks: {:.3} GiB of the file in {secs:.3} s: {:.2} GB/s of the file",
        file_bytes as f64 / (1u64 << 30) as f64,
        file_bytes as f64 / secs / 1e9
    );
    Ok(())
}

/// The bytes rank `rank` of `ranks` should hold for `t` under `shard`.
fn expected(
    data: &[u8],
    t: &gpuio::safetensors::FileTensor,
    shard: Shard,
    rank: usize,
    ranks: usize,
) -> Vec<u8> {
    let whole = &data[t.file_range.start as usize..t.file_range.end as usize];
    let Shard::Split(d) = shard else {
        return whole.to_vec();
    };
    let outer: usize = t.shape[..d].iter().product();
    let inner = t.shape[d + 1..].iter().product::<usize>() * t.dtype.bitsize() / 8;
    let part = t.shape[d] / ranks;
    (0..outer)
        .flat_map(|o| {
            let at = (o * t.shape[d] + rank * part) * inner;
            whole[at..at + part * inner].to_vec()
        })
        .collect()
}

/// The checkpoint onto GPUs `0..gpus` as ranks: whole on each, or split (`tp`); checks every
/// rank's tensors against the file.
async fn ranked(
    engine: &Engine,
    st: &SafetensorsFile,
    gpus: usize,
    tp: bool,
    replicas: Replicas,
    verify: bool,
    repeat: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    // More ranks than GPUs: rank r on GPU r mod the GPUs there are, each on its own stream.
    let have = gpuio::cuda::probe().devices.len().max(1);
    let streams = (0..gpus)
        .map(|g| Ok(gpuio::cuda::context(g % have)?.new_stream()?))
        .collect::<Result<Vec<_>, Box<dyn std::error::Error>>>()?;
    let rule = |t: &gpuio::safetensors::FileTensor| {
        if tp {
            tp_rule(t)
        } else {
            Some(Shard::Replicate)
        }
    };
    // Later loads in one process skip one-time costs (peer access, the pools' first growth):
    // each load's time is printed, the last one's in the summary.
    let mut secs = 0.0;
    let mut ranks = Vec::new();
    for i in 0..repeat.max(1) {
        drop(ranks);
        let t0 = Instant::now();
        ranks = st.load_shards_device_with(&streams, rule, replicas).await?;
        for s in &streams {
            engine.synchronize(s).await?;
        }
        secs = t0.elapsed().as_secs_f64();
        if repeat > 1 {
            println!("load {}: {secs:.3} s", i + 1);
        }
    }
    if verify {
        let data = std::fs::read(st.file().path())?;
        for (g, ck) in ranks.iter().enumerate() {
            let host = streams[g].clone_dtoh(ck.buffer())?;
            for ft in st.tensors() {
                let (Some(t), Some(shard)) = (ck.tensor(&ft.name), rule(ft)) else {
                    continue;
                };
                if host[t.buffer_range.clone()] != expected(&data, ft, shard, g, gpus)[..] {
                    return Err(format!("GPU {g}: tensor {} differs from the file", t.name).into());
                }
            }
        }
        println!("verified every tensor on {gpus} GPUs against the file");
    }
    let bytes: u64 = ranks
        .iter()
        .flat_map(|r| r.tensors())
        .map(|t| t.byte_len() as u64)
        .sum();
    let file_bytes: u64 = st.tensors().iter().map(|t| t.byte_len() as u64).sum();
    let how = if tp { "split over" } else { "replicated onto" };
    println!(
        "{how} {gpus} GPU(s) ({replicas:?}): {} tensors, {:.3} GiB of the file, {:.3} GiB landed, in {secs:.3} s: {:.2} GB/s of the file",
        st.tensors().len(),
        file_bytes as f64 / (1u64 << 30) as f64,
        bytes as f64 / (1u64 << 30) as f64,
        file_bytes as f64 / secs / 1e9
    );
    Ok(())
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A synthetic checkpoint of about `size` bytes: transformer-like layers of mixed dtypes.
fn make(out: &std::path::Path, size: usize) -> Result<(), Box<dyn std::error::Error>> {
    use safetensors::tensor::TensorView;
    let layer: [(&str, Dtype, usize, usize); 5] = [
        ("attn.qkv.weight", Dtype::BF16, 3 * 1024, 1024),
        ("attn.out.weight", Dtype::BF16, 1024, 1024),
        ("mlp.up.weight", Dtype::F16, 4096, 1024),
        ("norm.weight", Dtype::F32, 1024, 1),
        ("rope.positions", Dtype::I64, 512, 1),
    ];
    let per_layer: usize = layer
        .iter()
        .map(|(_, dt, r, c)| r * c * dt.bitsize() / 8)
        .sum();
    let layers = size.div_ceil(per_layer).max(1);
    let mut rng = fastrand::Rng::with_seed(42);
    let mut specs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for l in 0..layers {
        for (name, dt, r, c) in layer {
            let mut b = vec![0u8; r * c * dt.bitsize() / 8];
            rng.fill(&mut b);
            let shape = if c == 1 { vec![r] } else { vec![r, c] };
            specs.push((format!("layers.{l}.{name}"), dt, shape, b));
        }
    }
    let views = specs
        .iter()
        .map(|(n, dt, shape, b)| Ok((n.clone(), TensorView::new(*dt, shape.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, out)?;
    Ok(())
}
