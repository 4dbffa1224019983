//! Scaled dot-product attention with grouped-query heads and a causal mask that respects the
//! document boundaries of packed sequences (a token attends only to earlier tokens of its own
//! document). Every model calls [`attention`]; the context- and sequence-parallel issues route
//! it to ring or Ulysses attention.

use candle_core::{DType, Device, Result, Tensor, D};

/// Which keys each query may see, derived from position ids: a position that does not follow
/// its predecessor (it restarts, typically at 0) opens a new document.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    /// Additive mask [batch, 1, 1, q_len, k_len]: 0 where allowed, the dtype's minimum elsewhere.
    bias: Tensor,
}

/// Document index of every token of one row of position ids.
pub fn document_ids(positions: &[i64]) -> Vec<u32> {
    let mut doc = 0u32;
    positions
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            if i > 0 && p != positions[i - 1] + 1 {
                doc += 1;
            }
            doc
        })
        .collect()
}

impl AttentionMask {
    /// Causal, document-aware mask for `position_ids` [batch, seq].
    pub fn causal(position_ids: &Tensor, dtype: DType, device: &Device) -> Result<Self> {
        let rows: Vec<Vec<i64>> = position_ids.to_dtype(DType::I64)?.to_vec2()?;
        let (b, s) = (rows.len(), rows.first().map_or(0, Vec::len));
        let mut bias = vec![f32::MIN; b * s * s];
        for (row_index, row) in rows.iter().enumerate() {
            let docs = document_ids(row);
            let base = row_index * s * s;
            for i in 0..s {
                for j in (0..=i).rev() {
                    if docs[j] != docs[i] {
                        break;
                    }
                    bias[base + i * s + j] = 0.0;
                }
            }
        }
        let bias = Tensor::from_vec(bias, (b, 1, 1, s, s), device)?.to_dtype(dtype)?;
        Ok(AttentionMask { bias })
    }

    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
}

/// Attention of `q` [batch, heads, seq, head_dim] over `k`, `v` [batch, kv_heads, seq, head_dim].
/// Query head h reads key/value head h / (heads / kv_heads), without copying the kv heads.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask) -> Result<Tensor> {
    let (b, heads, s, d) = q.dims4()?;
    let (_, kv_heads, k_len, _) = k.dims4()?;
    if heads % kv_heads != 0 {
        candle_core::bail!(
            "{heads} attention heads cannot share {kv_heads} key/value heads evenly"
        );
    }
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    // [b, kv, group*s, d]: the queries sharing one kv head become one longer matrix.
    let q = q.reshape((b, kv_heads, group * s, d))?;
    let scores = (q.matmul(&k.t()?)? * scale)?.reshape((b, kv_heads, group, s, k_len))?;
    let scores = scores.broadcast_add(mask.bias())?;
    let probs = softmax(&scores)?.reshape((b, kv_heads, group * s, k_len))?;
    probs.matmul(v)?.reshape((b, heads, s, d))
}

/// Softmax over the last dim with the max taken off the graph (it cancels in the gradient).
fn softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}
