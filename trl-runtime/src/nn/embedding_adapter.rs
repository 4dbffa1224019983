//! Adapters that change an embedding table, as peft makes them:
//! - LoRA on the embedding (peft's `lora.Embedding`): `lora_embedding_A` [r, vocab] (starts at
//!   zero) and `lora_embedding_B` [hidden, r] (starts standard normal); a row looked up gains
//!   `A^T[id] B^T * scale`, without dropout (peft applies none there);
//! - trainable tokens (peft's TrainableTokensLayer, `trainable_token_indices`): the rows of the
//!   chosen tokens trained whole (`token_adapter.trainable_tokens_delta` [n, hidden], which
//!   despite its name holds the rows themselves, starting as the table's), the rest frozen.
//!
//! An [`crate::nn::Embedding`] applies its adapter to the rows it looks up; an LM head tied to
//! that table (peft ties trainable tokens always, LoRA with `ensure_weight_tying`) holds the
//! same adapter (the same variables) and computes with the whole adapted [`Self::table`].

use super::lora::{fnv, uniform, LoraConfig};
use candle_core::{DType, Device, Result, Tensor, Var};

/// An embedding table's adapter (see the module docs).
#[derive(Clone, Debug)]
pub enum EmbeddingAdapter {
    Lora { a: Tensor, b: Tensor, scale: f64 },
    Tokens { indices: Vec<u32>, rows: Tensor },
}

/// peft's tensor names, under the embedding's (or head's) module name.
pub const LORA_A: &str = "lora_embedding_A";
pub const LORA_B: &str = "lora_embedding_B";
pub const TOKENS: &str = "token_adapter.trainable_tokens_delta";

impl EmbeddingAdapter {
    /// LoRA for a [vocab, hidden] table named `name`, initialised as peft does (`A` zeros,
    /// `B` standard normal, drawn from the config's seed and `name`, the same on every rank).
    pub fn lora(
        name: &str,
        (vocab, hidden): (usize, usize),
        config: &LoraConfig,
        (dtype, device): (DType, &Device),
    ) -> Result<Self> {
        let mut state = config.seed ^ fnv(name);
        // Box-Muller over splitmix64's uniforms.
        let b: Vec<f32> = (0..hidden * config.r)
            .map(|_| {
                let (u, v) = (
                    uniform(&mut state).max(f64::MIN_POSITIVE),
                    uniform(&mut state),
                );
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect();
        let b = Tensor::from_vec(b, (hidden, config.r), device)?.to_dtype(dtype)?;
        let a = Tensor::zeros((config.r, vocab), dtype, device)?;
        Ok(EmbeddingAdapter::Lora {
            a: Var::from_tensor(&a)?.as_tensor().clone(),
            b: Var::from_tensor(&b)?.as_tensor().clone(),
            scale: config.scale(),
        })
    }

    /// Trainable tokens: the rows `indices` of `table` [vocab, hidden], trained whole.
    pub fn tokens(table: &Tensor, indices: &[u32]) -> Result<Self> {
        let vocab = table.dim(0)?;
        if let Some(bad) = indices.iter().find(|&&i| i as usize >= vocab) {
            candle_core::bail!("trainable token {bad} is past the vocabulary ({vocab} rows)");
        }
        let index = Tensor::new(indices, table.device())?;
        let rows = table
            .detach()
            .contiguous()?
            .index_select(&index, 0)?
            .copy()?;
        Ok(EmbeddingAdapter::Tokens {
            indices: indices.to_vec(),
            rows: Var::from_tensor(&rows)?.as_tensor().clone(),
        })
    }

    /// `rows` [n, hidden], the base table's rows for `ids` [n] (u32), as the adapted table
    /// gives them.
    pub fn rows(&self, ids: &Tensor, rows: &Tensor) -> Result<Tensor> {
        match self {
            EmbeddingAdapter::Lora { a, b, scale } => {
                let down = a.index_select(ids, 1)?.t()?;
                rows + (down.matmul(&b.t()?)? * *scale)?.to_dtype(rows.dtype())?
            }
            EmbeddingAdapter::Tokens {
                indices,
                rows: trained,
            } => {
                // Each id's trained row (a zero row past them for the others), and a mask.
                let n = indices.len() as u32;
                let slot: Vec<u32> = ids
                    .to_device(&Device::Cpu)?
                    .to_vec1::<u32>()?
                    .iter()
                    .map(|id| indices.iter().position(|i| i == id).map_or(n, |p| p as u32))
                    .collect();
                let hidden = trained.dim(1)?;
                let mask: Vec<u8> = slot.iter().map(|&s| (s < n) as u8).collect();
                let device = rows.device();
                let slot = Tensor::from_vec(slot, ids.dims(), device)?;
                let mask = Tensor::from_vec(mask, (ids.elem_count(), 1), device)?
                    .broadcast_as(rows.shape())?;
                let padded = Tensor::cat(
                    &[
                        trained,
                        &Tensor::zeros((1, hidden), trained.dtype(), device)?,
                    ],
                    0,
                )?;
                let replaced = padded.index_select(&slot, 0)?.to_dtype(rows.dtype())?;
                mask.where_cond(&replaced, rows)
            }
        }
    }

    /// The whole adapted table from the base `w` [vocab, hidden] (what a head tied to it
    /// computes with); gradients reach the adapter, not `w`.
    pub fn table(&self, w: &Tensor) -> Result<Tensor> {
        match self {
            EmbeddingAdapter::Lora { .. } => w + self.table_delta()?.to_dtype(w.dtype())?,
            EmbeddingAdapter::Tokens { indices, rows } => {
                let index = Tensor::new(indices.as_slice(), w.device())?;
                let old = w.detach().index_select(&index, 0)?;
                w.index_add(&index, &(rows.to_dtype(w.dtype())? - old)?, 0)
            }
        }
    }

    /// LoRA's change to the table, [vocab, hidden]: `(B A)^T * scale`.
    pub fn table_delta(&self) -> Result<Tensor> {
        match self {
            EmbeddingAdapter::Lora { a, b, scale } => b.matmul(a)?.t()? * *scale,
            EmbeddingAdapter::Tokens { .. } => candle_core::bail!("trainable tokens replace rows"),
        }
    }

    /// The trained tensors by peft's names (under the embedding's module name).
    pub fn tensors(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            EmbeddingAdapter::Lora { a, b, .. } => vec![(LORA_A, a), (LORA_B, b)],
            EmbeddingAdapter::Tokens { rows, .. } => vec![(TOKENS, rows)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Tensor {
        let v: Vec<f32> = (0..24).map(|i| i as f32 * 0.1).collect();
        Tensor::from_vec(v, (6, 4), &Device::Cpu).unwrap()
    }

    /// The rows looked up equal the rows of the adapted table, and the gradient reaches the
    /// adapter alone.
    #[test]
    fn rows_are_the_adapted_tables() {
        let w = table();
        let ids = Tensor::new(&[5u32, 1, 3, 1], &Device::Cpu).unwrap();
        let mut lora = EmbeddingAdapter::lora(
            "e",
            (6, 4),
            &LoraConfig::new(2, 4.0, 0.0, super::super::lora::Targets::AllLinear),
            (DType::F32, &Device::Cpu),
        )
        .unwrap();
        if let EmbeddingAdapter::Lora { a, .. } = &mut lora {
            let v: Vec<f32> = (0..12).map(|i| (i as f32 - 5.0) * 0.03).collect();
            Var::from_tensor(a)
                .unwrap()
                .set(&Tensor::from_vec(v, (2, 6), &Device::Cpu).unwrap())
                .unwrap();
        }
        let tokens = EmbeddingAdapter::tokens(&w, &[1, 4]).unwrap();
        if let EmbeddingAdapter::Tokens { rows, .. } = &tokens {
            Var::from_tensor(rows)
                .unwrap()
                .set(&(rows.ones_like().unwrap() * -1.0).unwrap())
                .unwrap();
        }
        for adapter in [lora, tokens] {
            let looked_up = adapter
                .rows(&ids, &w.index_select(&ids, 0).unwrap())
                .unwrap();
            let from_table = adapter.table(&w).unwrap().index_select(&ids, 0).unwrap();
            let d = (looked_up.clone() - from_table)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-6, "{adapter:?}: {d}");
            let grads = looked_up.sum_all().unwrap().backward().unwrap();
            let reached = adapter
                .tensors()
                .iter()
                .filter(|(_, t)| grads.get(t).is_some())
                .count();
            assert!(reached > 0, "{adapter:?}: no gradient");
        }
    }
}
