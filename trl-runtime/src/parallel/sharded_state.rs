//! SHARDED_STATE_DICT checkpoints: every rank writes the slices of the parameters and
//! optimizer state it owns, in parallel, and nobody gathers the model.
//!
//! `checkpoint-N/sharded/` holds `shard-RRRRR-of-NNNNN.safetensors` per rank (tensors
//! `{param}::master`, `{param}::exp_avg`, `{param}::exp_avg_sq`, each a 1-D piece of the
//! flattened parameter; the header metadata gives every piece's start) and `index.json`
//! (world size, parameter shapes, optimizer step). Pieces are addressed in the parameter's own
//! coordinates, so a reader with any world size, wrap policy or strategy takes exactly the
//! ranges it needs from the memory-mapped files (resharding).

use crate::error::{Error, Result};
use crate::optim::{decays, AdamW, AdamWConfig, ParamState, STATE_PARTS};
use candle_core::{DType, Device, Shape, Tensor};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

pub const DIR: &str = "sharded";
pub const INDEX: &str = "index.json";

/// This rank's part of one parameter: elements `start..start + len` of the flattened parameter.
pub struct Piece {
    pub name: String,
    pub start: usize,
    /// Master weights and the two moments of those elements (f32, 1-D).
    pub state: [Tensor; 3],
}

fn file_name(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

/// Writes this rank's pieces into `dir/sharded/` (the file is renamed into place whole).
pub fn write_rank(dir: &Path, rank: usize, world: usize, pieces: &[Piece]) -> Result<()> {
    let dir = dir.join(DIR);
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    let mut tensors = Vec::with_capacity(pieces.len() * 3);
    let mut meta = HashMap::new();
    for p in pieces {
        meta.insert(p.name.clone(), p.start.to_string());
        for (kind, t) in STATE_PARTS.iter().zip(&p.state) {
            tensors.push((format!("{}::{kind}", p.name), t.clone()));
        }
    }
    let path = dir.join(file_name(rank, world));
    let tmp = path.with_extension("tmp");
    let data: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    safetensors::serialize_to_file(data, Some(meta), &tmp).map_err(|e| {
        Error::io(
            format!("cannot write {}", tmp.display()),
            std::io::Error::other(e.to_string()),
        )
    })?;
    std::fs::rename(&tmp, &path)
        .map_err(|e| Error::io(format!("cannot move {} into place", path.display()), e))
}

/// Written by rank 0 after every rank's file: what a reader needs to check and reassemble.
pub fn write_index(
    dir: &Path,
    world: usize,
    shapes: &BTreeMap<String, Vec<usize>>,
    optimizer_step: u64,
) -> Result<()> {
    let index = serde_json::json!({
        "world_size": world,
        "optimizer_step": optimizer_step,
        "shapes": shapes,
    });
    let path = dir.join(DIR).join(INDEX);
    std::fs::write(&path, serde_json::to_string_pretty(&index).expect("json"))
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

/// Whether `checkpoint` was written sharded.
pub fn is_sharded(checkpoint: &Path) -> bool {
    checkpoint.join(DIR).join(INDEX).exists()
}

struct RankFile {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Parameter name -> first element of its piece in this file.
    starts: HashMap<String, usize>,
    /// Tensor name -> byte range of its f32 data in `map` (the header is parsed once).
    data: HashMap<String, Range<usize>>,
}

/// The memory-mapped shard files of one sharded checkpoint.
pub struct ShardedReader {
    files: Vec<RankFile>,
    pub shapes: BTreeMap<String, Vec<usize>>,
    pub optimizer_step: u64,
}

impl ShardedReader {
    pub fn open(checkpoint: &Path) -> Result<Self> {
        let dir = checkpoint.join(DIR);
        let index_path = dir.join(INDEX);
        let bad = |file: &Path, key: &str, message: String| Error::Config {
            file: file.display().to_string(),
            key: key.into(),
            message,
        };
        let text = std::fs::read_to_string(&index_path)
            .map_err(|e| Error::io(format!("cannot read {}", index_path.display()), e))?;
        let index: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad(&index_path, "<document>", format!("not valid JSON: {e}")))?;
        let world = index["world_size"]
            .as_u64()
            .ok_or_else(|| bad(&index_path, "world_size", "missing".into()))?
            as usize;
        let shapes: BTreeMap<String, Vec<usize>> = serde_json::from_value(index["shapes"].clone())
            .map_err(|e| bad(&index_path, "shapes", e.to_string()))?;
        let optimizer_step = index["optimizer_step"].as_u64().unwrap_or(0);
        let mut files = Vec::with_capacity(world);
        for rank in 0..world {
            let path = dir.join(file_name(rank, world));
            let file = std::fs::File::open(&path).map_err(|e| {
                Error::io(
                    format!(
                        "cannot open {} (the checkpoint was written by {world} ranks: every rank's file must be there)",
                        path.display()
                    ),
                    e,
                )
            })?;
            // Safety: checkpoint files are written once and renamed into place, not modified.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| Error::io(format!("cannot map {}", path.display()), e))?;
            let (_, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| bad(&path, "<safetensors>", e.to_string()))?;
            let mut starts = HashMap::new();
            for (name, start) in meta.metadata().clone().unwrap_or_default() {
                let start = start.parse().map_err(|_| {
                    bad(
                        &path,
                        &name,
                        format!("piece start `{start}` is not a number"),
                    )
                })?;
                starts.insert(name, start);
            }
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| bad(&path, "<safetensors>", e.to_string()))?;
            let base = map.as_ptr() as usize;
            let mut data = HashMap::new();
            for (name, view) in st.tensors() {
                if view.dtype() != safetensors::Dtype::F32 {
                    return Err(bad(
                        &path,
                        &name,
                        format!("{:?}, expected F32", view.dtype()),
                    ));
                }
                let at = view.data().as_ptr() as usize - base;
                data.insert(name, at..at + view.data().len());
            }
            files.push(RankFile {
                path,
                map,
                starts,
                data,
            });
        }
        Ok(ShardedReader {
            files,
            shapes,
            optimizer_step,
        })
    }

    /// Elements `range` of parameter `name`'s flattened `kind` (0 master, 1 exp_avg,
    /// 2 exp_avg_sq), assembled from the pieces that cover them.
    pub fn read(&self, name: &str, kind: usize, range: Range<usize>) -> Result<Vec<f32>> {
        let mut out = vec![0f32; range.len()];
        let mut covered = 0;
        for f in &self.files {
            let Some(&start) = f.starts.get(name) else {
                continue;
            };
            let key = format!("{name}::{}", STATE_PARTS[kind]);
            let bytes = f.data.get(&key).ok_or_else(|| Error::Config {
                file: f.path.display().to_string(),
                key: key.clone(),
                message: "missing piece: the file does not match its metadata".into(),
            })?;
            let data = &f.map[bytes.clone()];
            let len = data.len() / 4;
            let (lo, hi) = (range.start.max(start), range.end.min(start + len));
            if lo >= hi {
                continue;
            }
            let bytes = &data[(lo - start) * 4..(hi - start) * 4];
            for (o, b) in out[lo - range.start..hi - range.start]
                .iter_mut()
                .zip(bytes.chunks_exact(4))
            {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            covered += hi - lo;
        }
        if covered != range.len() {
            return Err(Error::Config {
                file: self.files.first().map_or(String::new(), |f| {
                    f.path.parent().unwrap_or(&f.path).display().to_string()
                }),
                key: name.into(),
                message: format!(
                    "the shard files cover {covered} of the {} elements asked for: the checkpoint is incomplete",
                    range.len()
                ),
            });
        }
        Ok(out)
    }

    /// Whole parameters (master weights) and the whole optimizer state, for strategies that
    /// keep them unsharded.
    pub fn full_state(&self, config: AdamWConfig) -> Result<(BTreeMap<String, Tensor>, AdamW)> {
        let mut params = BTreeMap::new();
        let mut states = BTreeMap::new();
        for (name, shape) in &self.shapes {
            let n: usize = shape.iter().product();
            let t = |kind| -> Result<Tensor> {
                Ok(Tensor::from_vec(
                    self.read(name, kind, 0..n)?,
                    shape.as_slice(),
                    &Device::Cpu,
                )?)
            };
            let master = t(0)?;
            params.insert(name.clone(), master.clone());
            states.insert(
                name.clone(),
                ParamState {
                    master,
                    exp_avg: t(1)?,
                    exp_avg_sq: t(2)?,
                    decay: decays(name),
                    decay_mask: None,
                },
            );
        }
        Ok((
            params,
            AdamW {
                config,
                step: self.optimizer_step,
                states,
            },
        ))
    }
}

/// The parameters of a flat layout that overlap `range`: (name, the parameter's offset, and
/// the overlap `lo..hi`, all in flat coordinates).
fn overlaps<'a>(
    entries: &'a [(String, Shape, usize)],
    range: &'a Range<usize>,
) -> impl Iterator<Item = (&'a String, usize, usize, usize)> + 'a {
    entries.iter().filter_map(move |(name, shape, offset)| {
        let lo = range.start.max(*offset);
        let hi = range.end.min(offset + shape.elem_count());
        (lo < hi).then_some((name, *offset, lo, hi))
    })
}

/// Reads one flat slice: `entries` are (name, shape, offset in the flat vector), `range`
/// the slice of the flat vector this rank owns. Padding beyond the parameters stays zero.
pub fn read_flat_slice(
    reader: &ShardedReader,
    entries: &[(String, Shape, usize)],
    range: Range<usize>,
    kind: usize,
) -> Result<Tensor> {
    let mut out = vec![0f32; range.len()];
    for (name, offset, lo, hi) in overlaps(entries, &range) {
        let part = reader.read(name, kind, lo - offset..hi - offset)?;
        out[lo - range.start..hi - range.start].copy_from_slice(&part);
    }
    Ok(Tensor::from_vec(out, range.len(), &Device::Cpu)?.to_dtype(DType::F32)?)
}

/// The pieces of a flat slice: for each parameter overlapping `range` (in flat coordinates),
/// its piece of the slice's state tensors.
pub fn flat_pieces(
    entries: &[(String, Shape, usize)],
    range: Range<usize>,
    state: &ParamState,
) -> Result<Vec<Piece>> {
    let mut pieces = Vec::new();
    for (name, offset, lo, hi) in overlaps(entries, &range) {
        let cut = |t: &Tensor| t.narrow(0, lo - range.start, hi - lo);
        pieces.push(Piece {
            name: name.clone(),
            start: lo - offset,
            state: [
                cut(&state.master)?,
                cut(&state.exp_avg)?,
                cut(&state.exp_avg_sq)?,
            ],
        });
    }
    Ok(pieces)
}
