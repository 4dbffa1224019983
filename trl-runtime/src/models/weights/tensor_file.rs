//! Tensors written as they come. A safetensors header only needs each tensor's name, dtype and
//! shape, so it is written first and the tensors are appended one at a time: nothing has to be
//! whole in memory. A sharded model's full checkpoint is written this way, one gathered wrap
//! unit at a time ([`WeightsWriter`] spreads the tensors over HF's `model-0000k-of-0000n`
//! files), and so are `Params::save`, `cargo trl merge` and the optimizer state.

use super::composite::Layout;
use crate::error::{Error, Result};
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A checkpoint's weights in one file, and the index of a sharded one (transformers' names).
pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Writes a small file whole, then renames it over the old one.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)
        .map_err(|e| Error::io(format!("cannot write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| Error::io(format!("cannot move {} into place", path.display()), e))
}

/// A tensor's entry in a file's header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dtype: DType, shape: &[usize]) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// The entry of tensor `t` under `name`.
    pub fn of(name: impl Into<String>, t: &Tensor) -> Self {
        Self::new(name, t.dtype(), t.dims())
    }

    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_in_bytes()
    }
}

/// One safetensors file: the header from the specs, then each tensor in their order. Written
/// to `<path>.tmp` and renamed into place by [`Self::finish`], so a reader never sees half a file.
pub struct TensorFile {
    path: PathBuf,
    tmp: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    specs: Vec<TensorSpec>,
    next: usize,
}

fn io_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::io(
        format!("cannot write {}", path.display()),
        std::io::Error::other(e.to_string()),
    )
}

impl TensorFile {
    pub fn create(
        path: &Path,
        specs: Vec<TensorSpec>,
        metadata: HashMap<String, String>,
    ) -> Result<Self> {
        let tmp = path.with_extension("safetensors.tmp");
        let mut offset = 0;
        let infos = specs
            .iter()
            .map(|s| {
                let info = safetensors::tensor::TensorInfo {
                    dtype: s.dtype.into(),
                    shape: s.shape.clone(),
                    data_offsets: (offset, offset + s.bytes()),
                };
                offset += s.bytes();
                (s.name.clone(), info)
            })
            .collect();
        let header = safetensors::tensor::Metadata::new(Some(metadata), infos)
            .map_err(|e| io_error(path, e))?;
        let mut header = serde_json::to_vec(&header).map_err(|e| io_error(path, e))?;
        // The data starts 8-byte aligned, as safetensors writes it.
        header.resize(header.len().next_multiple_of(8), b' ');
        let file = std::fs::File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&header))
            .map_err(|e| io_error(&tmp, e))?;
        Ok(TensorFile {
            path: path.to_path_buf(),
            tmp,
            out,
            specs,
            next: 0,
        })
    }

    /// The next tensor of the header, `name` (converted to the header's dtype if it differs).
    pub fn write(&mut self, name: &str, t: &Tensor) -> Result<()> {
        let Some(spec) = self.specs.get(self.next) else {
            return Err(io_error(&self.path, format!("{name} is not in the header")));
        };
        if spec.name != name || spec.shape != t.dims() {
            return Err(io_error(
                &self.path,
                format!(
                    "expected {} {:?} next, got {name} {:?}",
                    spec.name,
                    spec.shape,
                    t.dims()
                ),
            ));
        }
        let t = t.to_dtype(spec.dtype)?;
        self.out
            .write_all(&tensor_bytes(&t)?)
            .map_err(|e| io_error(&self.tmp, e))?;
        self.next += 1;
        Ok(())
    }

    /// Whether every tensor of the header has been written.
    pub fn is_complete(&self) -> bool {
        self.next == self.specs.len()
    }

    /// Checks every tensor was written, then renames the file into place.
    pub fn finish(mut self) -> Result<()> {
        if let Some(missing) = self.specs.get(self.next) {
            return Err(io_error(
                &self.path,
                format!("{} was never written", missing.name),
            ));
        }
        self.out.flush().map_err(|e| io_error(&self.tmp, e))?;
        drop(self.out);
        std::fs::rename(&self.tmp, &self.path)
            .map_err(|e| Error::io(format!("cannot move {} into place", self.path.display()), e))
    }
}

/// The little-endian bytes of `t` (any device), as safetensors stores them.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    fn bytes<T: candle_core::WithDType + bytemuck::Pod>(t: &Tensor) -> Result<Vec<u8>> {
        Ok(bytemuck::cast_slice(&t.flatten_all()?.to_vec1::<T>()?).to_vec())
    }
    match t.dtype() {
        DType::U8 => bytes::<u8>(t),
        DType::U32 => bytes::<u32>(t),
        DType::I64 => bytes::<i64>(t),
        DType::F16 => bytes::<half::f16>(t),
        DType::BF16 => bytes::<half::bf16>(t),
        DType::F32 => bytes::<f32>(t),
        DType::F64 => bytes::<f64>(t),
        other => Err(Error::Candle(candle_core::Error::Msg(format!(
            "cannot write {other:?} tensors"
        )))),
    }
}

/// Model weights in HF layout, written as they come: files of at most `max_shard_bytes` (a
/// larger tensor alone), `model-0000k-of-0000n.safetensors` plus an index when there is more
/// than one, as `save_pretrained` writes them. The tensors must come in the specs' order.
pub struct WeightsWriter {
    dir: PathBuf,
    files: Vec<(String, Vec<TensorSpec>)>,
    current: Option<TensorFile>,
    /// Files opened so far.
    opened: usize,
    total: usize,
    /// A vision-language checkpoint's: how the model's names are stored, and the tensors
    /// written after the model's.
    others: Option<Others>,
}

/// What a full checkpoint of a vision-language model's language model writes besides it
/// (models/composite.rs): the model's tensors go under the names `layout` gives, and `specs`,
/// read by `read` from the checkpoint it came from, after them, unchanged.
#[derive(Clone)]
pub struct Others {
    pub layout: Layout,
    pub specs: Vec<TensorSpec>,
    pub read: ReadTensor,
}

/// Reads a tensor by its name in the files.
pub type ReadTensor = std::sync::Arc<dyn Fn(&str) -> Result<Tensor> + Send + Sync>;

impl WeightsWriter {
    pub fn new(dir: &Path, specs: Vec<TensorSpec>, max_shard_bytes: usize) -> Self {
        Self::with_others(dir, specs, max_shard_bytes, None)
    }

    /// As [`Self::new`], the model's tensors (`specs`, pushed by their own names) written as
    /// `others` says, its tensors after them.
    pub fn with_others(
        dir: &Path,
        mut specs: Vec<TensorSpec>,
        max_shard_bytes: usize,
        others: Option<Others>,
    ) -> Self {
        if let Some(o) = &others {
            for s in &mut specs {
                s.name = o.layout.stored(&s.name);
            }
            specs.extend(o.specs.iter().cloned());
        }
        let total = specs.iter().map(TensorSpec::bytes).sum();
        let mut groups: Vec<Vec<TensorSpec>> = vec![Vec::new()];
        let mut filled = 0;
        for spec in specs {
            let last = groups.last_mut().expect("one group");
            if !last.is_empty() && filled + spec.bytes() > max_shard_bytes {
                groups.push(Vec::new());
                filled = 0;
            }
            filled += spec.bytes();
            groups.last_mut().expect("one group").push(spec);
        }
        let n = groups.len();
        let files = groups
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                let name = match n {
                    1 => SINGLE_FILE.to_string(),
                    n => format!("model-{:05}-of-{:05}.safetensors", i + 1, n),
                };
                (name, g)
            })
            .collect();
        WeightsWriter {
            dir: dir.to_path_buf(),
            files,
            current: None,
            opened: 0,
            total,
            others,
        }
    }

    /// The model's next tensor; the file it completes is closed at once.
    pub fn push(&mut self, name: &str, t: &Tensor) -> Result<()> {
        match &self.others {
            Some(o) => {
                let stored = o.layout.stored(name);
                self.write(&stored, t)
            }
            None => self.write(name, t),
        }
    }

    fn write(&mut self, name: &str, t: &Tensor) -> Result<()> {
        if self.current.is_none() {
            let Some((file, specs)) = self.files.get(self.opened) else {
                return Err(io_error(
                    &self.dir,
                    format!("{name}: every file is written"),
                ));
            };
            self.current = Some(TensorFile::create(
                &self.dir.join(file),
                specs.clone(),
                [("format".to_string(), "pt".to_string())].into(),
            )?);
            self.opened += 1;
        }
        let file = self.current.as_mut().expect("opened");
        file.write(name, t)?;
        if file.is_complete() {
            self.current.take().expect("opened").finish()?;
        }
        Ok(())
    }

    /// Writes the other tensors, if any, then the index (several files) or removes a stale
    /// one; returns the number of files.
    pub fn finish(mut self) -> Result<usize> {
        if let Some(o) = self.others.take() {
            for spec in &o.specs {
                self.write(&spec.name, &(o.read)(&spec.name)?)?;
            }
        }
        let n = self.files.len();
        if self.current.is_some() || self.opened < n {
            return Err(io_error(&self.dir, "not every tensor was written"));
        }
        if n == 1 {
            let _ = std::fs::remove_file(self.dir.join(INDEX_FILE));
            return Ok(1);
        }
        let weight_map: serde_json::Map<String, serde_json::Value> = self
            .files
            .iter()
            .flat_map(|(file, specs)| {
                specs
                    .iter()
                    .map(move |s| (s.name.clone(), serde_json::Value::String(file.clone())))
            })
            .collect();
        let index = serde_json::json!({
            "metadata": {"total_size": self.total}, "weight_map": weight_map,
        });
        write_atomic(
            &self.dir.join(INDEX_FILE),
            serde_json::to_string_pretty(&index)
                .expect("json")
                .as_bytes(),
        )?;
        let _ = std::fs::remove_file(self.dir.join(SINGLE_FILE));
        Ok(n)
    }
}

/// Writes the tensors `specs` into `dir` in HF layout, asking `tensor(name)` for each in
/// order, so only one tensor need exist at a time. Returns the number of files.
/// `others`: see [`WeightsWriter::with_others`].
pub fn write_weights(
    dir: &Path,
    specs: Vec<TensorSpec>,
    max_shard_bytes: usize,
    others: Option<Others>,
    mut tensor: impl FnMut(&str) -> Result<Tensor>,
) -> Result<usize> {
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let mut writer = WeightsWriter::with_others(dir, specs, max_shard_bytes, others);
    for name in &names {
        writer.push(name, &tensor(name)?)?;
    }
    writer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn streamed_files_read_back_as_written_and_shard_like_save_pretrained() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 6., &dev)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let b = Tensor::ones(4, DType::BF16, &dev).unwrap();
        let c = Tensor::new(&[7u32, 8], &dev).unwrap();
        let tensors = [("a", &a), ("b", &b), ("c", &c)];
        let specs = tensors.iter().map(|(n, t)| TensorSpec::of(*n, t)).collect();
        // 24 + 8 bytes fit in 32: a and b share the first file, c is alone.
        let files = write_weights(dir.path(), specs, 32, None, |n| {
            Ok(tensors.iter().find(|(m, _)| *m == n).unwrap().1.clone())
        })
        .unwrap();
        assert_eq!(files, 2);
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(INDEX_FILE)).unwrap()).unwrap();
        assert_eq!(index["weight_map"]["b"], "model-00001-of-00002.safetensors");
        assert_eq!(index["weight_map"]["c"], "model-00002-of-00002.safetensors");
        let first = candle_core::safetensors::load(
            dir.path().join("model-00001-of-00002.safetensors"),
            &dev,
        )
        .unwrap();
        assert_eq!(
            first["a"].to_vec2::<f32>().unwrap(),
            a.to_vec2::<f32>().unwrap()
        );
        assert_eq!(first["b"].dtype(), DType::BF16);
        let second = candle_core::safetensors::load(
            dir.path().join("model-00002-of-00002.safetensors"),
            &dev,
        )
        .unwrap();
        assert_eq!(second["c"].to_vec1::<u32>().unwrap(), [7, 8]);
    }

    #[test]
    fn a_tensor_out_of_order_or_missing_is_an_error_and_nothing_is_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let t = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let specs = vec![TensorSpec::of("a", &t), TensorSpec::of("b", &t)];
        let mut f = TensorFile::create(&path, specs.clone(), HashMap::new()).unwrap();
        assert!(f.write("b", &t).is_err());
        let mut f = TensorFile::create(&path, specs, HashMap::new()).unwrap();
        f.write("a", &t).unwrap();
        assert!(f.finish().is_err());
        assert!(!path.exists());
    }
}
