//! A sparse mixture-of-experts MLP as transformers' Qwen3-MoE and Mixtral write it: a router
//! (`mlp.gate`) picks each token's top-k experts by softmax probability (renormalised over
//! the k when `norm_topk_prob`), and each expert (`mlp.experts.{e}`, a SwiGLU MLP) runs once
//! on the tokens routed to it (its rows gathered: one GEMM per projection and expert, no
//! per-token loop); their outputs, weighted, are added back at the tokens' rows. The routing
//! itself, [`routed`], is every mixture's (gpt-oss's grouped experts too).
//!
//! Strategies: experts are parameters of their layer like any other (ZeRO and FSDP shard
//! them, each layer one unit); under tensor parallelism each expert's MLP is split as a dense
//! one (gate/up column, down row) and the router stays whole. Under expert parallelism each
//! rank of the ep group keeps `experts / ep` of every layer's experts ([`Experts`], fused
//! stacks by their rows) and [`dispatch`] moves the routed rows to the rank holding their
//! expert and the outputs back (two uneven all-to-alls, their counts exchanged first). An
//! expert no token reached in a step gets a zero gradient ([`crate::nn::lora::is_routed_expert`]
//! tells the trainer's unused-parameter check so).

use super::blocks::{Activation, GatedMlp};
use crate::comm::autograd::{self as comm_grad, copy_to_group, reduce_from_group};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::kernels::grouped::ExpertLayout;
use crate::models::causal::LayerInputs;
use crate::models::config::ModelConfig;
use crate::nn::grouped::grouped_linear;
use crate::nn::module::TpContext;
use crate::nn::module::{child_name, EpShard, ExpertFn, ExpertHold, LinearFn, ParamFn, WeightFn};
use crate::nn::Linear;
use crate::nn::Param;
use crate::Parallelize;
use candle_core::{DType, Tensor, D};
use std::sync::Arc;

/// One expert's MLP, on the tokens routed to it ([1, tokens, hidden]).
pub trait Expert: Parallelize + Send + Sync {
    fn forward(&self, cx: &LayerInputs, x: &Tensor) -> Result<Tensor>;
}

impl Expert for GatedMlp {
    fn forward(&self, cx: &LayerInputs, x: &Tensor) -> Result<Tensor> {
        GatedMlp::forward(self, cx, x)
    }
}

/// A mixture's experts, each its own module (`experts.{e}`), named by their index among
/// all of the layer's: under expert parallelism a rank keeps a run of them
/// ([`Parallelize::shard_experts`]), `first` the index of its first.
#[derive(Debug, Clone)]
pub struct Experts<E> {
    list: Vec<E>,
    first: usize,
}

impl<E> Experts<E> {
    /// Every expert of a layer, in order.
    pub fn new(list: Vec<E>) -> Self {
        Experts { list, first: 0 }
    }

    /// The experts this rank holds, in order.
    pub fn local(&self) -> &[E] {
        &self.list
    }
}

impl<E> From<Vec<E>> for Experts<E> {
    fn from(list: Vec<E>) -> Self {
        Experts::new(list)
    }
}

impl<E: Parallelize> Parallelize for Experts<E> {
    fn parallelize(&mut self, name: &str, tp: &TpContext) -> Result<()> {
        for (i, x) in self.list.iter_mut().enumerate() {
            x.parallelize(&child_name(name, &(self.first + i).to_string()), tp)?;
        }
        Ok(())
    }
    fn visit_params(&self, name: &str, f: &mut ParamFn) {
        for (i, x) in self.list.iter().enumerate() {
            x.visit_params(&child_name(name, &(self.first + i).to_string()), f);
        }
    }
    fn visit_weights_mut(&mut self, name: &str, f: &mut WeightFn) -> Result<()> {
        for (i, x) in self.list.iter_mut().enumerate() {
            x.visit_weights_mut(&child_name(name, &(self.first + i).to_string()), f)?;
        }
        Ok(())
    }
    fn visit_linears_mut(&mut self, name: &str, f: &mut LinearFn) -> Result<()> {
        for (i, x) in self.list.iter_mut().enumerate() {
            x.visit_linears_mut(&child_name(name, &(self.first + i).to_string()), f)?;
        }
        Ok(())
    }
    fn shard_experts(&mut self, name: &str, ep: EpShard, f: &mut ExpertFn) -> Result<()> {
        if self.first != 0 {
            return Err(Error::Parallelism(format!(
                "{name}: the experts are already kept per rank"
            )));
        }
        let range = ep.range(name, self.list.len())?;
        let per_rank = range.len();
        self.list = self.list.drain(range.clone()).collect();
        self.first = range.start;
        for (i, x) in self.list.iter().enumerate() {
            let index = self.first + i;
            let list = name.to_string();
            x.visit_params(&child_name(name, &index.to_string()), &mut |n, _, _| {
                let hold = ExpertHold::Listed {
                    list: list.clone(),
                    index,
                    per_rank,
                };
                f(n, hold)
            });
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Parallelize)]
pub struct SparseMoe<E: Expert> {
    /// The router: one logit per expert.
    #[parallel(tp = "replicate")]
    pub gate: Linear,
    pub experts: Experts<E>,
    #[parallel(skip)]
    pub top_k: usize,
    #[parallel(skip)]
    pub norm_topk_prob: bool,
}

impl<E: Expert> SparseMoe<E> {
    /// The block's output for `x` [batch, seq, hidden].
    pub fn forward(&self, cx: &LayerInputs, x: &Tensor) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let flat = x.reshape((b * s, h))?;
        let logits = self.gate.forward(&flat)?;
        let routing = (self.top_k, self.norm_topk_prob);
        let out = routed(cx, &flat, &logits, routing, |rows, index, counts| {
            run_experts(self.experts.local(), cx, rows, index, counts)
        })?;
        Ok(out.reshape((b, s, h))?)
    }
}

/// A mixture of experts' forward around its experts, as transformers routes: each token of
/// `flat` [tokens, hidden] goes to the top-k experts by its router `logits` [tokens, experts]
/// (probabilities in f32; `norm`: renormalised over the k), and `experts(rows, index,
/// counts)` runs this rank's experts ([`dispatch`]). The router loss, when collected, counts the choices.
pub fn routed(
    cx: &LayerInputs,
    flat: &Tensor,
    logits: &Tensor,
    routing: (usize, bool),
    experts: impl FnOnce(&Tensor, &Tensor, &[usize]) -> Result<Tensor>,
) -> Result<Tensor> {
    routed_scaled(cx, flat, logits, routing, None, experts)
}

/// [`routed`] with each chosen expert's weight multiplied, after the renormalisation, by its
/// entry of `per_expert` [experts] when given (Gemma 4's `router.per_expert_scale`).
pub fn routed_scaled(
    cx: &LayerInputs,
    flat: &Tensor,
    logits: &Tensor,
    (k, norm): (usize, bool),
    per_expert: Option<&Tensor>,
    experts: impl FnOnce(&Tensor, &Tensor, &[usize]) -> Result<Tensor>,
) -> Result<Tensor> {
    let n = flat.dim(0)?;
    let logits = logits.to_dtype(DType::F32)?;
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let exp = logits.broadcast_sub(&max)?.exp()?;
    let probs = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?;
    // The choice itself has no gradient: top-k on the host.
    let count = logits.dim(1)?;
    let host: Vec<f32> = probs.detach().flatten_all()?.to_vec1()?;
    let mut chosen = vec![0u32; n * k];
    for (t, row) in host.chunks(count).enumerate() {
        for (j, e) in top_k(row, k).into_iter().enumerate() {
            chosen[t * k + j] = e as u32;
        }
    }
    // The load-balancing loss counts the choices and adds its gradient to the probabilities.
    let probs = match &cx.router_loss {
        Some(loss) => loss.record(&probs, &host, &chosen)?,
        None => probs,
    };
    let index = Tensor::new(chosen.as_slice(), flat.device())?.reshape((n, k))?;
    let mut weights = probs.gather(&index, 1)?;
    if norm {
        weights = weights.broadcast_div(&weights.sum_keepdim(D::Minus1)?)?;
    }
    if let Some(scale) = per_expert {
        let scale = scale
            .to_dtype(DType::F32)?
            .index_select(&index.flatten_all()?, 0)?;
        weights = (weights * scale.reshape((n, k))?)?;
    }
    dispatch(cx, flat, (&chosen, count), &weights, experts)
}

/// The `k` largest of `row`, highest first; ties to the lower index, as torch.topk on CPU.
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Runs the experts of a routing: token t of `flat` [tokens, hidden] chose experts
/// `chosen[t * k..(t + 1) * k]` (of `count`) with `weights` [tokens, k].
/// `experts(rows, index, counts)` runs this rank's experts on `rows.index_select(index)`,
/// sorted by expert (`counts[e]` rows for its expert e), and returns their outputs in that
/// order: `rows` is `flat` itself, or under expert parallelism the rows the ep group sent
/// here ([`EpExchange`]). The outputs, weighted, are added back at their tokens in one
/// index_add (a running sum per expert would keep one [tokens, hidden] copy per expert alive
/// in the graph).
pub fn dispatch(
    cx: &LayerInputs,
    flat: &Tensor,
    (chosen, count): (&[u32], usize),
    weights: &Tensor,
    experts: impl FnOnce(&Tensor, &Tensor, &[usize]) -> Result<Tensor>,
) -> Result<Tensor> {
    let sorted = Sorted::new(chosen, count, flat, weights)?;
    let ys = match cx.ep() {
        None => experts(flat, &sorted.tokens, &sorted.counts)?,
        Some(ep) => {
            let rows = flat.index_select(&sorted.tokens, 0)?;
            EpExchange::run(ep, &rows, &sorted.counts, experts)?
        }
    };
    let ys = ys.broadcast_mul(&sorted.weights)?;
    Ok(flat.zeros_like()?.index_add(&sorted.tokens, &ys, 0)?)
}

/// [`dispatch`] with the weights on the experts' inputs instead of their outputs (Llama 4):
/// `experts(rows, counts)` gets the routed tokens' rows of `flat`, each scaled by its weight,
/// sorted by expert (this rank's experts, under expert parallelism).
pub fn dispatch_scaled_inputs(
    cx: &LayerInputs,
    flat: &Tensor,
    (chosen, count): (&[u32], usize),
    weights: &Tensor,
    experts: impl FnOnce(&Tensor, &[usize]) -> Result<Tensor>,
) -> Result<Tensor> {
    let sorted = Sorted::new(chosen, count, flat, weights)?;
    // One gather: the experts' backward gives every row's gradient at once.
    let rows = flat.index_select(&sorted.tokens, 0)?;
    let rows = rows.broadcast_mul(&sorted.weights)?;
    let ys = match cx.ep() {
        None => experts(&rows, &sorted.counts)?,
        Some(ep) => EpExchange::run(ep, &rows, &sorted.counts, |rows, index, counts| {
            experts(&rows.index_select(index, 0)?, counts)
        })?,
    };
    Ok(flat.zeros_like()?.index_add(&sorted.tokens, &ys, 0)?)
}

/// Expert parallelism's dispatch and combine around this rank's experts: the rows routed
/// to each rank's experts go there (one uneven all-to-all, the per-expert counts exchanged
/// first), arrive grouped by sending rank, run grouped by local expert, and go back in their
/// sending order (the reverse all-to-all), so that the caller sees its own rows' outputs in
/// the order it sent them. Both exchanges are differentiable (backward is the reverse
/// exchange); every rank of the group takes part whatever it routed, even nothing.
struct EpExchange;

impl EpExchange {
    /// `rows` [pairs, hidden] sorted by expert, `counts[e]` of them for each of the layer's
    /// experts; `experts(received, index, local_counts)` as [`dispatch`]'s.
    fn run(
        ep: &Arc<dyn Communicator>,
        rows: &Tensor,
        counts: &[usize],
        experts: impl FnOnce(&Tensor, &Tensor, &[usize]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let size = ep.size();
        let per = counts.len() / size;
        // Each rank's experts are a run of `per`: their rows are one block of `rows`.
        let send: Vec<usize> = counts.chunks(per).map(|c| c.iter().sum()).collect();
        // How many rows each rank routed to each of this rank's experts ([size, per]).
        let table: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
        let table = Tensor::from_vec(table, (counts.len(), 1), &candle_core::Device::Cpu)?;
        let (from, _) = ep.all_to_all_v(&table, &vec![per; size])?;
        let from: Vec<u32> = from.flatten_all()?.to_vec1()?;
        let (received, _) = comm_grad::all_to_all_v(rows, ep, &send)?;
        // Received rows: sender-major, then by this rank's expert. Run them expert-major.
        let mut starts = vec![0usize; size * per];
        let mut offset = 0;
        for (slot, &c) in from.iter().enumerate() {
            starts[slot] = offset;
            offset += c as usize;
        }
        let mut order = Vec::with_capacity(offset);
        let mut local = vec![0usize; per];
        for (e, n) in local.iter_mut().enumerate() {
            for s in 0..size {
                let slot = s * per + e;
                let start = starts[slot] as u32;
                order.extend(start..start + from[slot]);
                *n += from[slot] as usize;
            }
        }
        let ys = match offset {
            // Nothing came: the received (empty) rows stand for the outputs, so that the
            // backward still takes part in both exchanges.
            0 => received,
            _ => {
                let device = rows.device();
                let index = Tensor::from_vec(order.clone(), offset, device)?;
                let ys = experts(&received, &index, &local)?;
                // Back to the order the rows came in.
                let mut back = vec![0u32; offset];
                for (i, &o) in order.iter().enumerate() {
                    back[o as usize] = i as u32;
                }
                ys.index_select(&Tensor::from_vec(back, offset, device)?, 0)?
            }
        };
        let sent_here: Vec<usize> = (0..size)
            .map(|s| {
                from[s * per..(s + 1) * per]
                    .iter()
                    .map(|&c| c as usize)
                    .sum()
            })
            .collect();
        let (out, _) = comm_grad::all_to_all_v(&ys, ep, &sent_here)?;
        Ok(out)
    }
}

/// A routing's (token, choice) pairs sorted by expert: token t of `flat` [tokens, hidden]
/// chose `chosen[t * k..(t + 1) * k]` of `count` experts, slot i being token i / k's choice
/// i % k.
struct Sorted {
    /// Each pair's token, expert by expert.
    tokens: Tensor,
    /// Each pair's weight [pairs, 1], from the routing's `weights` [tokens, k].
    weights: Tensor,
    /// Pairs per expert.
    counts: Vec<usize>,
}

impl Sorted {
    fn new(chosen: &[u32], count: usize, flat: &Tensor, weights: &Tensor) -> Result<Self> {
        let n = flat.dim(0)?;
        let k = chosen.len() / n.max(1);
        // Each expert's (token, slot) pairs in one pass.
        let mut by_expert: Vec<Vec<u32>> = vec![Vec::new(); count];
        for (i, &e) in chosen.iter().enumerate() {
            by_expert[e as usize].push(i as u32);
        }
        let counts: Vec<usize> = by_expert.iter().map(Vec::len).collect();
        let slots: Vec<u32> = by_expert.concat();
        let tokens: Vec<u32> = slots.iter().map(|&i| i / k as u32).collect();
        let slots = Tensor::from_vec(slots, n * k, flat.device())?;
        let weights = weights.to_dtype(flat.dtype())?.flatten_all()?;
        Ok(Sorted {
            tokens: Tensor::from_vec(tokens, n * k, flat.device())?,
            weights: weights.index_select(&slots, 0)?.unsqueeze(1)?,
            counts,
        })
    }
}

/// A mixture's experts fused as transformers 5 keeps them: `experts.gate_up_proj` holding
/// each expert's gate projection then its up projection (halves, not gpt-oss's interleaved
/// pairs), and `experts.down_proj`, laid out [experts, in, out] (Llama 4) or [experts, out,
/// in] (Mistral 4: each a linear layer's weight). Run as grouped GEMMs over rows sorted by
/// expert, down(silu(gate) * up); under tp each expert's MLP splits as a dense one, gate_up
/// by each half's output features, down by its input features.
#[derive(Debug, Clone, Parallelize)]
pub struct FusedExperts {
    gate_up_proj: Param,
    down_proj: Param,
    /// The gate's activation: SiLU, or Gemma 4's tanh GELU.
    #[parallel(skip)]
    act: Activation,
}

impl FusedExperts {
    /// `experts` experts of `inter` features over `hidden` from `vb` (the `experts` prefix),
    /// held in `layout`.
    pub fn new(
        vb: &candle_nn::VarBuilder,
        (experts, hidden, inter): (usize, usize, usize),
        layout: ExpertLayout,
    ) -> candle_core::Result<Self> {
        let (e, h, i) = (experts, hidden, inter);
        let halves = [i, i];
        Ok(match layout {
            ExpertLayout::InOut => FusedExperts {
                gate_up_proj: Param::new(vb, (e, h, 2 * i), "gate_up_proj")?
                    .split_column_sections(2, &halves)
                    .expert_stack(),
                down_proj: Param::new(vb, (e, i, h), "down_proj")?
                    .split_row(1)
                    .expert_stack(),
                act: Activation::Silu,
            },
            ExpertLayout::OutIn => FusedExperts {
                gate_up_proj: Param::new(vb, (e, 2 * i, h), "gate_up_proj")?
                    .out_in()
                    .split_column_sections(1, &halves)
                    .expert_stack(),
                down_proj: Param::new(vb, (e, h, i), "down_proj")?
                    .out_in()
                    .split_row(2)
                    .expert_stack(),
                act: Activation::Silu,
            },
        })
    }

    /// The same experts with `act` on their gates.
    pub fn with_activation(self, act: Activation) -> Self {
        FusedExperts { act, ..self }
    }

    /// Rows `xs` [rows, hidden] sorted by expert (`counts[e]` for expert e) through their
    /// experts.
    pub fn forward(&self, cx: &LayerInputs, xs: &Tensor, counts: &[usize]) -> Result<Tensor> {
        // Under tp: Megatron's f before the split gate_up and g after the split down.
        let xs = match cx.tp() {
            Some(tp) => copy_to_group(xs, tp)?,
            None => xs.clone(),
        };
        let gate_up = grouped_linear(&xs, &self.gate_up_proj, None, counts)?;
        let i = gate_up.dim(1)? / 2;
        let (gate, up) = (gate_up.narrow(1, 0, i)?, gate_up.narrow(1, i, i)?);
        let act = self.act.gate(&gate, &up)?;
        let y = grouped_linear(&act, &self.down_proj, None, counts)?;
        Ok(match cx.tp() {
            Some(tp) => reduce_from_group(&y, tp)?,
            None => y,
        })
    }
}

/// One GEMM per projection and expert over its rows of `rows` (`index` [pairs], sorted by
/// expert, `counts[e]` for expert e; [`dispatch`]'s `experts`), gathered per expert:
/// slices of one gathered matrix would cost a whole-size gradient each in backward.
pub fn run_experts<E: Expert>(
    experts: &[E],
    cx: &LayerInputs,
    rows: &Tensor,
    index: &Tensor,
    counts: &[usize],
) -> Result<Tensor> {
    let h = rows.dim(1)?;
    let mut outputs = Vec::new();
    let mut start = 0;
    for (expert, &m) in experts.iter().zip(counts) {
        if m > 0 {
            let rows = rows.index_select(&index.narrow(0, start, m)?, 0)?;
            let ys = expert.forward(cx, &rows.reshape((1, m, h))?)?;
            outputs.push(ys.reshape((m, h))?);
        }
        start += m;
    }
    Ok(Tensor::cat(&outputs, 0)?)
}

/// The config.json keys that count a mixture of experts' experts, in the order they are read
/// (transformers 5 writes num_local_experts; Qwen3-MoE's older name is num_experts).
pub const EXPERT_COUNT_KEYS: [&str; 2] = ["num_local_experts", "num_experts"];

/// transformers' `router_aux_loss_coef` where a mixture of experts' config.json has none
/// (Qwen3-MoE's and Mixtral's default).
pub const DEFAULT_ROUTER_AUX_LOSS_COEF: f64 = 0.001;

/// The mixture-of-experts keys of a config.json (Qwen3-MoE's and Mixtral's names).
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    /// `moe_intermediate_size`, when the config has one.
    pub inter: Option<usize>,
    pub norm_topk_prob: bool,
    /// Whether each layer's MLP is sparse (`mlp_only_layers`, `decoder_sparse_step`).
    pub sparse: Vec<bool>,
}

impl MoeConfig {
    /// Reads them from `c`; errors name `source` and the key.
    pub fn read(c: &ModelConfig, source: &str) -> Result<Self> {
        let err = |key: &str, message: String| Error::config(source, key, message);
        let get = |key: &str| c.extra.get(key).filter(|v| !v.is_null());
        let count = |key: &str| -> Result<Option<usize>> {
            match get(key).map(|v| v.as_u64()) {
                Some(Some(n)) => Ok(Some(n as usize)),
                Some(None) => Err(err(key, "is not a count".into())),
                None => Ok(None),
            }
        };
        // output_router_logits is not read: as TRL, the trainer adds the router loss when
        // its weight (router_aux_loss_coef) is not 0.
        let [key, older] = EXPERT_COUNT_KEYS;
        let experts = match count(key)? {
            Some(n) => n,
            None => count(older)?.ok_or_else(|| err(key, "missing".into()))?,
        };
        let top_k = count("num_experts_per_tok")?.unwrap_or(2);
        if top_k == 0 || top_k > experts {
            return Err(err(
                "num_experts_per_tok",
                format!("{top_k} is not between 1 and the {experts} experts"),
            ));
        }
        let step = count("decoder_sparse_step")?.unwrap_or(1).max(1);
        let dense: Vec<u64> = get("mlp_only_layers")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        Ok(MoeConfig {
            experts,
            top_k,
            inter: count("moe_intermediate_size")?,
            norm_topk_prob: get("norm_topk_prob")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            sparse: (0..c.num_hidden_layers)
                .map(|l| !dense.contains(&(l as u64)) && (l + 1) % step == 0)
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::max_abs_diff;
    use crate::models::blocks::Activation;
    use crate::nn::AttentionImpl;
    use candle_core::{Device, Var};

    fn var(shape: (usize, usize), seed: u64) -> Var {
        let dev = Device::Cpu;
        let n = shape.0 * shape.1;
        let v: Vec<f32> = (0..n)
            .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 1000.0 - 0.5) * 0.4)
            .collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &dev).unwrap()).unwrap()
    }

    /// The block equals a token-by-token reference (each token's top-2 experts, renormalised
    /// weights), and an expert no token is routed to gets no gradient while the others do.
    #[test]
    fn routes_each_token_to_its_top_k_and_leaves_unrouted_experts_without_gradient() {
        let dev = Device::Cpu;
        let (h, inter, experts, n) = (4, 6, 3, 5);
        let mlp = |e: u64| {
            let (g, u, d) = (
                var((inter, h), e),
                var((inter, h), e + 10),
                var((h, inter), e + 20),
            );
            let expert = GatedMlp {
                gate_proj: Linear::new(g.as_tensor().clone(), None),
                up_proj: Linear::new(u.as_tensor().clone(), None),
                down_proj: Linear::new(d.as_tensor().clone(), None),
                act: Activation::Silu,
            };
            (expert, [g, u, d])
        };
        let built: Vec<_> = (0..experts as u64).map(mlp).collect();
        // Expert 2's logit is far below the others for inputs with a positive sum.
        let router = Tensor::new(
            &[
                [1f32, 0.5, -0.2, 0.1],
                [-0.3, 0.8, 0.4, 0.2],
                [-50.0, -50.0, -50.0, -50.0],
            ],
            &dev,
        )
        .unwrap();
        let moe = SparseMoe {
            gate: Linear::new(router.clone(), None),
            experts: Experts::new(built.iter().map(|(e, _)| e.clone()).collect()),
            top_k: 2,
            norm_topk_prob: true,
        };
        let x: Vec<f32> = (0..n * h).map(|i| 0.1 + (i % 7) as f32 * 0.05).collect();
        let x = Tensor::from_vec(x, (1, n, h), &dev).unwrap();
        let pos = Tensor::arange(0i64, n as i64, &dev)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let cx = LayerInputs::new(&pos, None, AttentionImpl::Eager, DType::F32, &dev).unwrap();
        let y = moe.forward(&cx, &x).unwrap();
        // Reference: token by token, experts 0 and 1 (expert 2 is never in a top 2).
        let logits = x
            .reshape((n, h))
            .unwrap()
            .matmul(&router.t().unwrap())
            .unwrap();
        let logits: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        let rows: Vec<Tensor> = (0..n)
            .map(|t| {
                let xt = x.narrow(1, t, 1).unwrap();
                let l = &logits[t];
                let (p0, p1) = (l[0].exp(), l[1].exp());
                let (w0, w1) = (p0 / (p0 + p1), p1 / (p0 + p1));
                let y0 = built[0].0.forward(&cx, &xt).unwrap();
                let y1 = built[1].0.forward(&cx, &xt).unwrap();
                ((y0 * w0 as f64).unwrap() + (y1 * w1 as f64).unwrap()).unwrap()
            })
            .collect();
        let want = Tensor::cat(&rows, 1).unwrap();
        assert!(
            max_abs_diff(&y, &want) < 1e-6,
            "{}",
            max_abs_diff(&y, &want)
        );
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        for (e, (_, vars)) in built.iter().enumerate() {
            for v in vars {
                assert_eq!(grads.get(v.as_tensor()).is_some(), e != 2, "expert {e}");
            }
        }
        assert!(crate::nn::lora::is_routed_expert(
            "model.layers.0.mlp.experts.2.up_proj.weight"
        ));
        assert!(!crate::nn::lora::is_routed_expert(
            "model.layers.0.mlp.gate.weight"
        ));
    }
}
