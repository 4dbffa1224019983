//! A sparse mixture-of-experts MLP as transformers' Qwen3-MoE and Mixtral write it: a router
//! (`mlp.gate`) picks each token's top-k experts by softmax probability (renormalised over
//! the k when `norm_topk_prob`), and each expert (`mlp.experts.{e}`, a SwiGLU MLP) runs once
//! on the tokens routed to it (gathered into one matrix: one GEMM per projection and expert,
//! no per-token loop); their outputs, weighted, are added back at the tokens' rows.
//!
//! Strategies: experts are parameters of their layer like any other (ZeRO and FSDP shard
//! them, each layer one unit); under tensor parallelism each expert's MLP is split as a dense
//! one (gate/up column, down row) and the router stays whole. An expert no token reached in a
//! step gets a zero gradient ([`SparseMoe::is_expert`] tells the trainer's unused-parameter
//! check so).

use super::blocks::GatedMlp;
use super::causal::LayerInputs;
use crate::error::Result;
use crate::nn::Linear;
use crate::Parallelize;
use candle_core::{DType, Tensor, D};

#[derive(Debug, Clone, Parallelize)]
pub struct SparseMoe {
    /// The router: one logit per expert.
    #[parallel(tp = "replicate")]
    pub gate: Linear,
    pub experts: Vec<GatedMlp>,
    #[parallel(skip)]
    pub top_k: usize,
    #[parallel(skip)]
    pub norm_topk_prob: bool,
}

impl SparseMoe {
    /// Whether the parameter `name` (a full HF name) belongs to a routed expert, which a step
    /// may leave without tokens.
    pub fn is_expert(name: &str) -> bool {
        name.contains(".mlp.experts.")
    }

    /// The block's output for `x` [batch, seq, hidden].
    pub fn forward(&self, cx: &LayerInputs, x: &Tensor) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let n = b * s;
        let flat = x.reshape((n, h))?;
        // Probabilities in f32, as transformers' router computes them.
        let logits = self.gate.forward(&flat)?.to_dtype(DType::F32)?;
        let max = logits.max_keepdim(D::Minus1)?.detach();
        let exp = logits.broadcast_sub(&max)?.exp()?;
        let probs = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?;
        // The choice itself has no gradient: top-k on the host.
        let experts = self.experts.len();
        let host: Vec<f32> = probs.detach().flatten_all()?.to_vec1()?;
        let k = self.top_k;
        let mut chosen = vec![0u32; n * k];
        for (t, row) in host.chunks(experts).enumerate() {
            let mut order: Vec<usize> = (0..experts).collect();
            // Highest first; ties to the lower index, as torch.topk on CPU.
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for (j, &e) in order.iter().take(k).enumerate() {
                chosen[t * k + j] = e as u32;
            }
        }
        let index = Tensor::from_vec(chosen.clone(), (n, k), x.device())?;
        let mut weights = probs.gather(&index, 1)?;
        if self.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(D::Minus1)?)?;
        }
        let weights = weights.to_dtype(x.dtype())?.flatten_all()?;
        let mut out = flat.zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            // The (token, slot) pairs routed to expert e.
            let slots: Vec<u32> = (0..n * k)
                .filter(|&i| chosen[i] == e as u32)
                .map(|i| i as u32)
                .collect();
            if slots.is_empty() {
                continue;
            }
            let tokens: Vec<u32> = slots.iter().map(|&i| i / k as u32).collect();
            let m = tokens.len();
            let tokens = Tensor::from_vec(tokens, m, x.device())?;
            let slots = Tensor::from_vec(slots, m, x.device())?;
            let xs = flat.index_select(&tokens, 0)?.reshape((1, m, h))?;
            let ys = expert.forward(cx, &xs)?.reshape((m, h))?;
            let ys = ys.broadcast_mul(&weights.index_select(&slots, 0)?.unsqueeze(1)?)?;
            out = out.index_add(&tokens, &ys, 0)?;
        }
        Ok(out.reshape((b, s, h))?)
    }
}
