//! Custom ops whose forward is computed outside them. FSDP units, the blockwise attention and
//! the tiled loss compute their result with ordinary tensor ops on detached inputs (so Candle's
//! graph keeps none of the intermediates) and hand it to a custom op, whose backward is theirs.
//! Candle asks the op for a fresh storage, so the result is copied once.

use candle_core::{CpuStorage, DType, Result, Shape, Tensor};
use std::sync::Mutex;

/// A result waiting for its op's `cpu_fwd`.
#[derive(Default)]
pub(crate) struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    pub(crate) fn new(t: Tensor) -> Self {
        Precomputed(Mutex::new(Some(t)))
    }

    /// The result as the op's output storage (once: a second call is an error naming `op`).
    pub(crate) fn take(&self, op: &str) -> Result<(CpuStorage, Shape)> {
        let t = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{op} was evaluated twice")))?;
        Ok((cpu_storage(&t)?, t.shape().clone()))
    }
}

/// Copies a tensor into a fresh CPU storage.
fn cpu_storage(t: &Tensor) -> Result<CpuStorage> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => CpuStorage::F32(flat.to_vec1()?),
        DType::F64 => CpuStorage::F64(flat.to_vec1()?),
        DType::BF16 => CpuStorage::BF16(flat.to_vec1()?),
        DType::F16 => CpuStorage::F16(flat.to_vec1()?),
        other => candle_core::bail!("custom op results in {other:?} are not supported"),
    })
}
