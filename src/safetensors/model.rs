//! [`SafetensorsModel`]: a checkpoint kept as hubs keep models, a directory of `.safetensors`
//! shards with an index (`model.safetensors.index.json`, whose `weight_map` names the shard of
//! each tensor), loaded as one checkpoint: every selected tensor of every shard planned into
//! one batch, whose reads run concurrently across the files.
//!
//! Everything is checked before any tensor byte is read: the index parses, names only files
//! inside its directory, and every shard it names exists and parses; each tensor is in exactly
//! one shard, the one the index names; no shard holds a tensor the index does not name.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Checkpoint, FileTensor, SafetensorsFile, Tensor, plan_tensors};
use crate::batch::BatchPlan;
use crate::engine::Engine;
use crate::error::{Context, Error, OpKind, Result};

/// The index file a directory is opened through, where it has one.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The largest index file read (hub indices of the largest models are a few MB).
const MAX_INDEX: u64 = 256 << 20;

/// One or more `.safetensors` files loaded as one checkpoint ([`SafetensorsModel::open`]).
#[derive(Debug)]
pub struct SafetensorsModel {
    /// What was opened (a directory, an index file or the first file), for errors.
    path: Arc<Path>,
    shards: Vec<SafetensorsFile>,
    /// Every tensor: its shard and its place in that shard's listing.
    by_name: HashMap<String, (usize, usize)>,
    /// The index's `metadata`, as strings (`total_size` and the like); empty without an index.
    metadata: HashMap<String, String>,
    /// Where loads report the bytes they move ([`set_progress`](Self::set_progress)).
    pub(super) progress: Option<Arc<crate::op::progress::Progress>>,
}

/// What an index file says: each tensor's shard, and the metadata as strings.
struct IndexFile {
    metadata: HashMap<String, String>,
    weight_map: BTreeMap<String, String>,
}

impl IndexFile {
    /// Parses `{"metadata": {...}, "weight_map": {"tensor": "shard file", ...}}` (metadata
    /// optional; numbers kept as their JSON text); `Err` says what is wrong.
    fn parse(text: &[u8]) -> std::result::Result<Self, String> {
        let v: serde_json::Value = serde_json::from_slice(text).map_err(|e| e.to_string())?;
        let obj = v.as_object().ok_or("not a JSON object")?;
        let map = obj
            .get("weight_map")
            .ok_or("no weight_map")?
            .as_object()
            .ok_or("weight_map is not an object")?;
        let mut weight_map = BTreeMap::new();
        for (name, shard) in map {
            let shard = shard
                .as_str()
                .ok_or_else(|| format!("weight_map[{name:?}] is not a file name"))?;
            weight_map.insert(name.clone(), shard.to_string());
        }
        let mut metadata = HashMap::new();
        match obj.get("metadata") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(m)) => {
                for (k, v) in m {
                    let text = match v {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    metadata.insert(k.clone(), text);
                }
            }
            Some(_) => return Err("metadata is not an object".into()),
        }
        Ok(IndexFile {
            metadata,
            weight_map,
        })
    }
}

impl SafetensorsModel {
    /// Opens a checkpoint at `path`:
    /// - a directory: through its [`INDEX_FILE`] where it has one, else through its only
    ///   `*.safetensors.index.json`, else every `*.safetensors` file in it (sorted by name);
    /// - an index file (`*.json`);
    /// - a single `.safetensors` file.
    ///
    /// Every shard is opened and its header read and checked, concurrently; a bad index, a
    /// missing shard or a tensor that is not where the index says is an
    /// [`Error::InvalidInput`] (or the I/O error naming the missing file) before any tensor
    /// byte is read.
    pub async fn open(engine: &Engine, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(ctx(path), e))?;
        if meta.is_dir() {
            if let Some(index) = find_index(path)? {
                return Self::open_index(engine, &index).await;
            }
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(ctx(path), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.is_file())
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(invalid(
                    path,
                    "the directory holds no .safetensors file and no index".into(),
                ));
            }
            return Self::open_files_as(engine, path, &files).await;
        }
        if path.extension().is_some_and(|x| x == "json") {
            return Self::open_index(engine, path).await;
        }
        Self::open_files_as(engine, path, &[path]).await
    }

    /// Opens `files` as one checkpoint without an index: no tensor may be in two of them.
    pub async fn open_files<P: AsRef<Path>>(engine: &Engine, files: &[P]) -> Result<Self> {
        let first = files
            .first()
            .ok_or_else(|| invalid(Path::new(""), "a checkpoint needs at least one file".into()))?;
        Self::open_files_as(engine, first.as_ref(), files).await
    }

    async fn open_files_as<P: AsRef<Path>>(
        engine: &Engine,
        name: &Path,
        files: &[P],
    ) -> Result<Self> {
        let shards = open_all(engine, files.iter().map(|p| p.as_ref().to_path_buf())).await?;
        let mut by_name: HashMap<String, (usize, usize)> = HashMap::new();
        for (s, shard) in shards.iter().enumerate() {
            for (i, t) in shard.tensors().iter().enumerate() {
                if let Some((other, _)) = by_name.insert(t.name.clone(), (s, i)) {
                    return Err(invalid(
                        name,
                        format!(
                            "tensor {:?} is in both {} and {}",
                            t.name,
                            shards[other].file().path().display(),
                            shard.file().path().display()
                        ),
                    ));
                }
            }
        }
        Ok(SafetensorsModel {
            progress: None,
            path: Arc::from(name),
            shards,
            by_name,
            metadata: HashMap::new(),
        })
    }

    /// Opens the checkpoint an index file describes (its shards are in its directory).
    pub async fn open_index(engine: &Engine, index: impl AsRef<Path>) -> Result<Self> {
        let index = index.as_ref();
        let text = read_index(index)?;
        let parsed = IndexFile::parse(&text)
            .map_err(|e| invalid(index, format!("safetensors index: {e}")))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        // Shards in name order (hub shards are numbered), each once.
        let mut shard_names: Vec<&String> = parsed.weight_map.values().collect();
        shard_names.sort();
        shard_names.dedup();
        let mut shard_paths = Vec::with_capacity(shard_names.len());
        for n in &shard_names {
            // Only plain file names: an index must not reach outside its directory.
            let p = Path::new(n.as_str());
            let plain = p.components().count() == 1
                && matches!(p.components().next(), Some(std::path::Component::Normal(_)));
            if !plain {
                return Err(invalid(
                    index,
                    format!(
                        "the index names shard {n:?}, which is not a file name in its directory"
                    ),
                ));
            }
            let full = dir.join(p);
            if !full.is_file() {
                let tensors = parsed.weight_map.values().filter(|v| v == n).count();
                return Err(invalid(
                    index,
                    format!(
                        "the index names shard {n:?} (for {tensors} tensors), which is missing \
                         from {}",
                        dir.display()
                    ),
                ));
            }
            shard_paths.push(full);
        }
        if shard_paths.is_empty() {
            return Err(invalid(
                index,
                "the index's weight_map names no tensor".into(),
            ));
        }
        let shards = open_all(engine, shard_paths.into_iter()).await?;
        let shard_of: HashMap<&str, usize> = shard_names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let mut by_name: HashMap<String, (usize, usize)> = HashMap::new();
        for (s, shard) in shards.iter().enumerate() {
            for (i, t) in shard.tensors().iter().enumerate() {
                match parsed.weight_map.get(&t.name).map(|n| shard_of[n.as_str()]) {
                    Some(want) if want == s => {
                        by_name.insert(t.name.clone(), (s, i));
                    }
                    Some(want) => {
                        return Err(invalid(
                            index,
                            format!(
                                "tensor {:?} is in {}, but the index puts it in {}",
                                t.name, shard_names[s], shard_names[want]
                            ),
                        ));
                    }
                    None => {
                        return Err(invalid(
                            index,
                            format!(
                                "shard {} holds tensor {:?}, which the index does not name",
                                shard_names[s], t.name
                            ),
                        ));
                    }
                }
            }
        }
        if let Some((name, shard)) = parsed
            .weight_map
            .iter()
            .find(|(name, _)| !by_name.contains_key(*name))
        {
            return Err(invalid(
                index,
                format!("the index puts tensor {name:?} in {shard}, which does not hold it"),
            ));
        }
        Ok(SafetensorsModel {
            progress: None,
            path: Arc::from(index),
            shards,
            by_name,
            metadata: parsed.metadata,
        })
    }

    /// The shards, in the order their tensors are planned (the index's shard names sorted, or
    /// the files as given).
    pub fn shards(&self) -> &[SafetensorsFile] {
        &self.shards
    }

    /// Every tensor with its shard, shard by shard, each shard's in file order.
    pub fn tensors(&self) -> impl Iterator<Item = (&SafetensorsFile, &FileTensor)> {
        self.shards
            .iter()
            .flat_map(|s| s.tensors().iter().map(move |t| (s, t)))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether the checkpoint has no tensor.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// The tensor called `name` and the shard holding it.
    pub fn tensor(&self, name: &str) -> Option<(&SafetensorsFile, &FileTensor)> {
        let &(s, i) = self.by_name.get(name)?;
        Some((&self.shards[s], &self.shards[s].tensors()[i]))
    }

    /// The index's `metadata` (numbers as their JSON text); for a single file, its header's
    /// `__metadata__`; empty otherwise.
    pub fn metadata(&self) -> &HashMap<String, String> {
        match (self.metadata.is_empty(), &self.shards[..]) {
            (true, [only]) => only.metadata(),
            _ => &self.metadata,
        }
    }

    /// What was opened: the directory, index file or first file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One batch that reads the tensors `keep` selects from every shard (concurrently across
    /// files), and where each lands in its destination; as [`SafetensorsFile::plan`].
    pub fn plan(&self, mut keep: impl FnMut(&str) -> bool) -> (BatchPlan, Vec<Tensor>) {
        plan_tensors(
            self.shards
                .iter()
                .flat_map(|s| s.tensors().iter().map(move |t| (s.file(), t)))
                .filter(|(_, t)| keep(&t.name)),
        )
    }

    /// As [`SafetensorsFile::set_progress`], for loads of every shard.
    pub fn set_progress(&mut self, progress: Option<Arc<crate::op::progress::Progress>>) {
        self.progress = progress;
    }

    /// Loads the selected tensors of every shard into one host buffer.
    pub async fn load_host(&self, keep: impl FnMut(&str) -> bool) -> Result<Checkpoint<Vec<u8>>> {
        let (plan, tensors) = self.plan(keep);
        super::load_host(plan, tensors, &self.path, self.progress.as_ref()).await
    }

    /// Loads the selected tensors of every shard into one allocation on `stream`'s device, as
    /// [`SafetensorsFile::load_device`].
    #[cfg(feature = "cuda")]
    pub async fn load_device(
        &self,
        stream: &Arc<cudarc::driver::CudaStream>,
        keep: impl FnMut(&str) -> bool,
    ) -> Result<Checkpoint<cudarc::driver::CudaSlice<u8>>> {
        let (plan, tensors) = self.plan(keep);
        super::load_device(stream, plan, tensors, &self.path, self.progress.as_ref()).await
    }
}

fn ctx(path: &Path) -> Context {
    Context::op(OpKind::Open).with_path(&Arc::from(path))
}

fn invalid(path: &Path, why: String) -> Error {
    Error::invalid(ctx(path), why)
}

/// The index a directory is opened through: [`INDEX_FILE`], else its only
/// `*.safetensors.index.json`; `None` where it has none. Several other indices are ambiguous.
fn find_index(dir: &Path) -> Result<Option<PathBuf>> {
    let standard = dir.join(INDEX_FILE);
    if standard.is_file() {
        return Ok(Some(standard));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(ctx(dir), e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with(".safetensors.index.json"))
        })
        .collect();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => {
            found.sort();
            let names: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
            Err(invalid(
                dir,
                format!(
                    "the directory has several safetensors indices ({}): open one of them",
                    names.join(", ")
                ),
            ))
        }
    }
}

fn read_index(index: &Path) -> Result<Vec<u8>> {
    let len = std::fs::metadata(index)
        .map_err(|e| Error::io(ctx(index), e))?
        .len();
    if len > MAX_INDEX {
        return Err(invalid(
            index,
            format!("a {len}-byte index is past the {MAX_INDEX}-byte limit"),
        ));
    }
    std::fs::read(index).map_err(|e| Error::io(ctx(index), e))
}

/// Opens every file and reads its header, all at once.
async fn open_all(
    engine: &Engine,
    files: impl Iterator<Item = PathBuf>,
) -> Result<Vec<SafetensorsFile>> {
    futures::future::try_join_all(
        files.map(|p| async move { SafetensorsFile::open(engine, &p).await }),
    )
    .await
}
