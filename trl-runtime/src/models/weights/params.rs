//! A model's parameters by HF name, as Candle `Var`s: random initialisation, loading from
//! `model.safetensors` or a sharded index, and saving back in the same layout (so a
//! checkpoint opens in transformers).

use super::composite;
use super::mxfp4;
pub use super::tensor_file::Others;
use super::tensor_file::{write_weights, TensorSpec};
use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::nn::module::Split;
use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use safetensors::slice::TensorIndexer;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

pub(crate) use super::tensor_file::write_atomic;
pub use super::tensor_file::{INDEX_FILE, SINGLE_FILE};
pub const CONFIG_FILE: &str = "config.json";

/// Parameters in HF naming order-independent storage (sorted by name).
#[derive(Debug, Clone, Default)]
pub struct Params {
    vars: BTreeMap<String, Var>,
}

fn is_norm(name: &str) -> bool {
    name.ends_with("layernorm.weight") || name.ends_with("norm.weight")
}

/// Buffers some checkpoints carry that are not parameters.
fn is_ignorable(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// The decoder layer a tensor belongs to (`model.layers.{i}.`), if any.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

impl Params {
    /// HF's initialisation: normal(0, initializer_range) for matrices, ones for norms, zeros
    /// for biases. Deterministic for a given seed.
    pub fn init(cfg: &ModelConfig, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        let std = cfg
            .extra
            .get("initializer_range")
            .and_then(|v| v.as_f64())
            .unwrap_or(0.02);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let normal = Normal::new(0f32, std as f32).expect("valid std");
        let mut vars = BTreeMap::new();
        for (name, shape) in cfg.parameter_shapes() {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if is_norm(&name) {
                vec![1.0; n]
            } else if name.ends_with(".bias") {
                vec![0.0; n]
            } else {
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            };
            let t = Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?;
            vars.insert(name, Var::from_tensor(&t)?);
        }
        Ok(Params { vars })
    }

    /// Parameters holding these tensors (as new variables).
    pub fn from_tensors(tensors: BTreeMap<String, Tensor>) -> Result<Self> {
        let vars = tensors
            .into_iter()
            .map(|(n, t)| Ok((n, Var::from_tensor(&t)?)))
            .collect::<Result<_>>()?;
        Ok(Params { vars })
    }

    /// Loads the weights in `dir` (single file or sharded index) and checks them against `cfg`:
    /// every parameter present with the right shape, nothing unexpected.
    pub fn load(
        dir: impl AsRef<Path>,
        cfg: &ModelConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let files = WeightFiles::open_for(dir.as_ref(), cfg)?;
        let mut vars = BTreeMap::new();
        for (name, _) in cfg.parameter_shapes() {
            let t = files.load(&name, dtype, device)?;
            vars.insert(name, Var::from_tensor(&t)?);
        }
        Ok(Params { vars })
    }

    /// Writes `config.json` and the weights into `dir` in HF layout. With `max_shard_bytes`,
    /// weights larger than that are split into `model-0000k-of-0000n.safetensors` files plus
    /// an index, as `save_pretrained` does. Each file is written whole, then renamed. A
    /// vision-language model's language model writes `others` too (models/composite.rs).
    pub fn save(
        &self,
        dir: impl AsRef<Path>,
        config_json: &str,
        max_shard_bytes: Option<usize>,
        others: Option<Others>,
    ) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
        write_atomic(&dir.join(CONFIG_FILE), config_json.as_bytes())?;
        let specs = self
            .vars
            .iter()
            .map(|(n, v)| TensorSpec::of(n.clone(), v.as_tensor()))
            .collect();
        let limit = max_shard_bytes.unwrap_or(usize::MAX);
        write_weights(dir, specs, limit, others, |n| {
            Ok(self.vars[n].as_tensor().clone())
        })?;
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.get(name)
    }

    /// The tensor of a parameter the model needs; a missing name is a bug in the caller.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        self.vars
            .get(name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| {
                Error::Candle(candle_core::Error::Msg(format!(
                    "no parameter named {name}"
                )))
            })
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Var)> {
        self.vars.iter()
    }

    pub fn len(&self) -> usize {
        self.vars.len()
    }

    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    pub fn num_elements(&self) -> usize {
        self.vars.values().map(|v| v.elem_count()).sum()
    }
}

/// The parameters of `net` by HF name: each distinct tensor's shape under the first name it
/// is visited under, and the other names a shared (tied) tensor also goes by.
pub fn shapes_and_aliases<N: crate::nn::module::Parallelize>(
    net: &N,
) -> (BTreeMap<String, Vec<usize>>, HashSet<String>) {
    let (mut shapes, mut aliases, mut seen) = (BTreeMap::new(), HashSet::new(), HashSet::new());
    net.visit_params("", &mut |name, t, _| match seen.insert(t.id()) {
        true => drop(shapes.insert(name.to_string(), t.dims().to_vec())),
        false => drop(aliases.insert(name.to_string())),
    });
    (shapes, aliases)
}

/// A checkpoint's weights (one file or a sharded index), memory-mapped and checked against a
/// config: tensors are read when asked for, whole or in parts.
pub struct WeightFiles {
    st: MmapedSafetensors,
    where_is: FileOf,
    /// A sharded index's tensor names: the checkpoint is what its index lists (a file may
    /// hold more, as a reward model's start links the causal LM's files, its head left out).
    listed: Option<std::collections::HashSet<String>>,
    dir: PathBuf,
    /// How a vision-language checkpoint whose language model is trained alone names the
    /// model's tensors (None: by their own names).
    layout: Option<composite::Layout>,
}

impl WeightFiles {
    /// Opens the weights of `dir` (one file or a sharded index), memory-mapped.
    pub fn open(dir: &Path) -> Result<Self> {
        let (files, where_is, listed) = weight_files(dir)?;
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| Error::Config {
            file: files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            key: "<safetensors>".into(),
            message: format!("cannot read the weights: {e}"),
        })?;
        Ok(WeightFiles {
            st,
            where_is,
            listed,
            dir: dir.to_path_buf(),
            layout: composite::layout_of_dir(dir),
        })
    }

    /// The name in the files of the model's tensor `name`.
    fn at(&self, name: &str) -> String {
        match self.layout {
            Some(layout) => layout.stored(name),
            None => name.to_string(),
        }
    }

    /// Whether the files hold tensor `name` (stored, or packed as MXFP4).
    pub fn contains(&self, name: &str) -> bool {
        self.st.get(&self.at(name)).is_ok() || self.packed(name).is_some()
    }

    /// A vision-language checkpoint's tensors besides its language model's, copied unchanged
    /// into every full checkpoint written from it (None for any other).
    pub fn others(self: &std::sync::Arc<Self>) -> Option<Others> {
        let layout = self.layout?;
        let mut specs: Vec<TensorSpec> = self
            .st
            .tensors()
            .into_iter()
            .filter(|(name, _)| layout.text(name).is_none())
            .map(|(name, view)| {
                let dtype = DType::try_from(view.dtype()).unwrap_or(DType::F32);
                TensorSpec::new(name, dtype, view.shape())
            })
            .collect();
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        let files = self.clone();
        Some(Others {
            layout,
            specs,
            read: std::sync::Arc::new(move |name: &str| Ok(files.st.load(name, &Device::Cpu)?)),
        })
    }

    /// The blocks and scales of `name` when it is stored packed as MXFP4 (gpt-oss's experts
    /// on the hub) and not as itself.
    fn packed(&self, name: &str) -> Option<(String, String)> {
        if self.st.get(&self.at(name)).is_ok() {
            return None;
        }
        let (blocks, scales) = (
            format!("{name}{}", mxfp4::BLOCKS),
            format!("{name}{}", mxfp4::SCALES),
        );
        let here = self.st.get(&self.at(&blocks)).is_ok() && self.st.get(&self.at(&scales)).is_ok();
        here.then_some((blocks, scales))
    }

    /// Every tensor the files give with its dtype and shape: MXFP4 pairs as the dense bf16
    /// tensor they hold (transformers dequantizes to bf16: every value is exact there).
    fn stored(&self) -> Vec<(String, DType, Vec<usize>)> {
        let mut out = Vec::new();
        for (name, view) in self.st.tensors() {
            if self.listed.as_ref().is_some_and(|l| !l.contains(&name)) {
                continue;
            }
            // A composite's other tensors are not the model's (see `others`).
            let name = match self.layout {
                Some(layout) => match layout.text(&name) {
                    Some(text) => text,
                    None => continue,
                },
                None => name,
            };
            if name.ends_with(mxfp4::SCALES) {
                let base = &name[..name.len() - mxfp4::SCALES.len()];
                if self.packed(base).is_some() {
                    continue;
                }
            }
            if let Some(base) = name.strip_suffix(mxfp4::BLOCKS) {
                if let (Some(_), Some(shape)) =
                    (self.packed(base), mxfp4::dense_shape(view.shape()))
                {
                    out.push((base.to_string(), DType::BF16, shape));
                    continue;
                }
            }
            let dtype = DType::try_from(view.dtype()).unwrap_or(DType::F32);
            out.push((name, dtype, view.shape().to_vec()));
        }
        out
    }

    /// The number of values the files hold for the model (MXFP4 pairs as their dense tensors).
    pub fn parameter_count(&self) -> usize {
        self.stored()
            .iter()
            .map(|(_, _, s)| s.iter().product::<usize>())
            .sum()
    }

    /// Tensor `name` as stored, or dequantized (f32) when packed as MXFP4.
    fn read(&self, name: &str, device: &Device) -> Result<Tensor> {
        match self.packed(name) {
            Some((blocks, scales)) => {
                let cpu = &Device::Cpu;
                let (blocks, scales) = (
                    self.st.load(&self.at(&blocks), cpu)?,
                    self.st.load(&self.at(&scales), cpu)?,
                );
                Ok(mxfp4::dequantize(&blocks, &scales)?.to_device(device)?)
            }
            None => Ok(self.st.load(&self.at(name), device)?),
        }
    }

    /// Checks the files against the parameters a model expects: every one present with its
    /// shape, nothing unexpected but `aliases` (names a tied weight also goes by) and buffers
    /// that are not parameters.
    pub fn check(
        &self,
        expected: &BTreeMap<String, Vec<usize>>,
        aliases: &std::collections::HashSet<String>,
    ) -> Result<()> {
        let present: HashMap<String, Vec<usize>> = self
            .stored()
            .into_iter()
            .map(|(name, _, shape)| (name, shape))
            .collect();
        for (name, shape) in expected {
            let Some(found) = present.get(name) else {
                return Err(Error::Config {
                    file: self.dir.display().to_string(),
                    key: name.clone(),
                    message: format!("tensor missing from the checkpoint (expected shape {shape:?} from config.json)"),
                });
            };
            if found != shape {
                return Err(Error::Config {
                    file: self.file_of(name),
                    key: name.clone(),
                    message: format!("tensor has shape {found:?} but config.json implies {shape:?}: the weights and config.json do not belong together"),
                });
            }
        }
        let prediction = self.prediction_layers(expected);
        let mut unexpected: Vec<&String> = present
            .keys()
            .filter(|n| !expected.contains_key(*n) && !aliases.contains(*n) && !is_ignorable(n))
            .filter(|n| {
                !prediction
                    .as_ref()
                    .is_some_and(|r| r.contains(&layer_of(n)))
            })
            .collect();
        if let Some(layers) = &prediction {
            let skipped = present
                .keys()
                .filter(|n| layers.contains(&layer_of(n)))
                .count();
            if skipped > 0 {
                tracing::info!(
                    "{}: {skipped} tensors of the multi-token prediction layers {layers:?}                      (num_nextn_predict_layers) are not read, as transformers does not read them",
                    self.dir.display()
                );
            }
        }
        unexpected.sort();
        if let Some(name) = unexpected.first() {
            return Err(Error::Config {
                file: self.file_of(name),
                key: (*name).clone(),
                message: format!(
                    "unexpected tensor for this model and config.json ({} unexpected in all): \
                     the weights and config.json do not belong together",
                    unexpected.len()
                ),
            });
        }
        Ok(())
    }

    /// The layer indices after the model's own that hold DeepSeek-style multi-token
    /// prediction modules (config.json's `num_nextn_predict_layers`), which transformers'
    /// models neither build nor read; None when the config has none.
    fn prediction_layers(
        &self,
        expected: &BTreeMap<String, Vec<usize>>,
    ) -> Option<std::ops::Range<Option<usize>>> {
        let n = config_number(&read_config(&self.dir).ok()?.0, "num_nextn_predict_layers")?;
        let layers = expected.keys().filter_map(|k| layer_of(k)).max()? + 1;
        (n > 0).then_some(Some(layers)..Some(layers + n))
    }

    /// Opens the weights of `dir` and checks them against a Llama / Qwen2 `cfg`.
    pub fn open_for(dir: &Path, cfg: &ModelConfig) -> Result<Self> {
        let this = Self::open(dir)?;
        let expected: BTreeMap<String, Vec<usize>> = cfg.parameter_shapes().into_iter().collect();
        let aliases = match cfg.tie_word_embeddings {
            true => ["lm_head.weight".to_string()].into(),
            false => Default::default(),
        };
        this.check(&expected, &aliases)?;
        Ok(this)
    }

    /// Every stored tensor's name, dtype and shape, sorted by name.
    pub fn tensor_infos(&self) -> Result<Vec<TensorSpec>> {
        let mut infos: Vec<TensorSpec> = self
            .stored()
            .into_iter()
            .map(|(name, dtype, shape)| TensorSpec::new(name, dtype, &shape))
            .collect();
        infos.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(infos)
    }

    /// Tensor `name` as stored (its dtype; MXFP4 dequantized to bf16), on the CPU.
    pub fn load_stored(&self, name: &str) -> Result<Tensor> {
        match self.packed(name) {
            Some(_) => Ok(self.read(name, &Device::Cpu)?.to_dtype(DType::BF16)?),
            None => Ok(self.st.load(&self.at(name), &Device::Cpu)?),
        }
    }

    /// The shape of tensor `name` (dense, for an MXFP4 pair).
    fn shape_of(&self, name: &str) -> Result<Vec<usize>> {
        match self.packed(name) {
            Some((blocks, _)) => {
                let shape = self.st.get(&self.at(&blocks))?.shape().to_vec();
                Ok(mxfp4::dense_shape(&shape).unwrap_or_default())
            }
            None => Ok(self.st.get(&self.at(name))?.shape().to_vec()),
        }
    }

    fn file_of(&self, name: &str) -> String {
        (self.where_is)(&self.at(name))
            .unwrap_or_else(|| self.dir.join(SINGLE_FILE).display().to_string())
    }

    /// Tensor `name`, whole.
    pub fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        Ok(self.read(name, device)?.to_dtype(dtype)?)
    }

    /// Part `rank` of `parts` of tensor `name` as `split` cuts it (equal parts along its
    /// dimension, of each section), reading only the bytes of that part from the file (a
    /// tensor-parallel slice); the whole tensor when `split` keeps it whole.
    pub fn load_part(
        &self,
        name: &str,
        split: Split,
        rank: usize,
        parts: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = self.shape_of(name)?;
        let whence = format!("{name} in {}", self.file_of(name));
        let (Some(dim), Some(ranges)) = (split.dim, split.ranges(&whence, &shape, rank, parts)?)
        else {
            return self.load(name, dtype, device);
        };
        let pieces = ranges
            .into_iter()
            .map(|(start, len)| self.read_span(name, dim, start..start + len, dtype, device))
            .collect::<std::result::Result<Vec<_>, String>>()
            .map_err(|e| Error::Config {
                file: self.file_of(name),
                key: name.into(),
                message: format!("cannot read part {rank} of {parts} along dimension {dim}: {e}"),
            })?;
        Ok(Tensor::cat(&pieces, dim)?)
    }

    /// Elements `start..start + len` of tensor `name` in row-major order, flat, reading only
    /// the rows that hold them (a ZeRO-3 / FSDP shard).
    pub fn load_flat(
        &self,
        name: &str,
        start: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = self.shape_of(name)?;
        let row: usize = shape.iter().skip(1).product();
        let total = shape.first().copied().unwrap_or(1) * row;
        if start + len > total || shape.is_empty() {
            return Err(Error::Config {
                file: self.file_of(name),
                key: name.into(),
                message: format!(
                    "elements {start}..{} of a tensor of shape {shape:?}",
                    start + len
                ),
            });
        }
        let rows = start / row..(start + len).div_ceil(row);
        let first = rows.start * row;
        let part = self
            .read_span(name, 0, rows, dtype, device)
            .map_err(|e| Error::Config {
                file: self.file_of(name),
                key: name.into(),
                message: format!("cannot read elements {start}..{}: {e}", start + len),
            })?;
        Ok(part.flatten_all()?.narrow(0, start - first, len)?)
    }

    /// Indices `span` of tensor `name` along `dim` (everything along the others), read from
    /// the memory-mapped file without touching the rest.
    fn read_span(
        &self,
        name: &str,
        dim: usize,
        span: std::ops::Range<usize>,
        dtype: DType,
        device: &Device,
    ) -> std::result::Result<Tensor, String> {
        if self.packed(name).is_some() {
            // Packed: dequantized whole (one layer's expert tensor), then cut.
            let whole = self.read(name, device).map_err(|e| e.to_string())?;
            let part = whole
                .narrow(dim, span.start, span.len())
                .and_then(|t| t.to_dtype(dtype));
            return part.map_err(|e| e.to_string());
        }
        let view = self.st.get(&self.at(name)).map_err(|e| e.to_string())?;
        let index: Vec<TensorIndexer> = (0..view.shape().len())
            .map(|d| match d == dim {
                true => span.clone().into(),
                false => (..).into(),
            })
            .collect();
        let slices = view.sliced_data(&index).map_err(|e| e.to_string())?;
        let shape = slices.newshape();
        let mut bytes = Vec::with_capacity(slices.remaining_byte_len());
        for chunk in slices {
            bytes.extend_from_slice(chunk);
        }
        let part = safetensors::tensor::TensorView::new(view.dtype(), shape, &bytes)
            .map_err(|e| e.to_string())?;
        let t = part.load(device).map_err(|e| e.to_string())?;
        t.to_dtype(dtype).map_err(|e| e.to_string())
    }
}

/// Which file of a sharded index holds a tensor (None: the single file).
type FileOf = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The weight files of a checkpoint directory, a lookup from tensor name to its file, and the
/// names a sharded index lists.
type Listing = (
    Vec<PathBuf>,
    FileOf,
    Option<std::collections::HashSet<String>>,
);

fn weight_files(dir: &Path) -> Result<Listing> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| Error::io(format!("cannot read {}", index.display()), e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            file: index.display().to_string(),
            key: "<document>".into(),
            message: format!("not valid JSON: {e}"),
        })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Config {
                file: index.display().to_string(),
                key: "weight_map".into(),
                message: "missing: a sharded index maps every tensor name to its file".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !p.exists() {
                return Err(Error::Config {
                    file: index.display().to_string(),
                    key: "weight_map".into(),
                    message: format!("names {} which does not exist", p.display()),
                });
            }
        }
        let lookup: HashMap<String, String> = map
            .iter()
            .filter_map(|(k, v)| {
                v.as_str()
                    .map(|f| (k.clone(), dir.join(f).display().to_string()))
            })
            .collect();
        let listed = lookup.keys().cloned().collect();
        let file_of = Box::new(move |n: &str| lookup.get(n).cloned());
        return Ok((paths, file_of, Some(listed)));
    }
    let single = dir.join(SINGLE_FILE);
    if single.exists() {
        return Ok((vec![single], Box::new(|_: &str| None), None));
    }
    Err(Error::Config {
        file: dir.display().to_string(),
        key: "<weights>".into(),
        message: format!("no {SINGLE_FILE} or {INDEX_FILE} in this directory"),
    })
}

/// `config.json` of model directory `dir` as a model is built from it, and its path for
/// errors: MXFP4 experts are read dequantized ([`mxfp4::dense_config`]), so what is built,
/// saved and merged from it is dense.
pub fn read_config(dir: &Path) -> Result<(String, String)> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    Ok((mxfp4::dense_config(&text), path.display().to_string()))
}

/// Whole number `key` of a config.json's `text` (a composite's text_config's when the top
/// level has none).
pub fn config_number(text: &str, key: &str) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let read = |v: &serde_json::Value| v.get(key).and_then(|x| x.as_u64());
    read(&v)
        .or_else(|| v.get("text_config").and_then(read))
        .map(|n| n as usize)
}

/// Weights a model reads by name while it is built (a VarBuilder's source, through
/// [`Checked`]), in the dtype and on the device they come in.
pub trait Weights: Send + Sync {
    fn read(&self, name: &str) -> candle_core::Result<Tensor>;
    fn has(&self, name: &str) -> bool;
}

/// A VarBuilder backend over [`Weights`]: every weight the model asks for must have the shape
/// it asks for (the VarBuilder's dtype and device are ignored: the loader decides them).
pub struct Checked<W>(pub W);

impl<W: Weights> SimpleBackend for Checked<W> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        _: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.0.read(name)?;
        if t.shape() != &s {
            candle_core::bail!(
                "{name} has shape {:?} but the model expects {:?}: the weights and config.json \
                 do not belong together",
                t.dims(),
                s.dims()
            );
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.0.read(name)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.has(name)
    }
}

/// Weights from a checkpoint's files, in the compute dtype and device of the load.
pub struct FilesBackend {
    pub files: std::sync::Arc<WeightFiles>,
    pub dtype: DType,
    pub device: Device,
}

impl FilesBackend {
    /// A VarBuilder reading `files` in `dtype` onto `device`, each weight checked against the
    /// shape the model asks for.
    pub fn var_builder(
        files: &std::sync::Arc<WeightFiles>,
        dtype: DType,
        device: &Device,
    ) -> candle_nn::VarBuilder<'static> {
        let backend = FilesBackend {
            files: files.clone(),
            dtype,
            device: device.clone(),
        };
        candle_nn::VarBuilder::from_backend(Box::new(Checked(backend)), dtype, device.clone())
    }
}

impl Weights for FilesBackend {
    fn read(&self, name: &str) -> candle_core::Result<Tensor> {
        self.files
            .load(name, self.dtype, &self.device)
            .map_err(Error::into_candle)
    }

    fn has(&self, name: &str) -> bool {
        self.files.contains(name)
    }
}

/// Weights already in memory (a model over given parameters).
impl Weights for std::collections::HashMap<String, Tensor> {
    fn read(&self, name: &str) -> candle_core::Result<Tensor> {
        match self.get(name) {
            Some(t) => Ok(t.clone()),
            None => candle_core::bail!("no parameter named {name}"),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.contains_key(name)
    }
}
