//! How fast a step runs: compute, data- and model-parallel collectives, offload.

use super::Strategy;
use super::*;

/// Seconds of one optimizer step (one micro-batch per rank), by where they go.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTime {
    pub compute: f64,
    /// Data-parallel reductions and gathers (where they overlap compute, only what exceeds
    /// it counts).
    pub data_parallel: f64,
    /// Tensor- and sequence-parallel collectives, on the critical path.
    pub model_parallel: f64,
    /// Tokens of the whole job per second.
    pub tokens_per_second: f64,
}

/// The step time of `setup` on `hw`: 6 FLOP per parameter per token (8 with checkpointing's
/// second forward) plus causal attention's 6 s q per layer, at the rank's rate; ring
/// all-reduce volumes 2 (n-1)/n of the buffer, gathers and reduce-scatters (n-1)/n;
/// data-parallel time hidden behind compute or added to it ([`Hardware::comm_overlaps`]).
pub fn step_time(model: &ModelShapes, setup: &Setup, hw: &Hardware) -> StepTime {
    let cfg = &model.dims;
    let d = setup.dims;
    let world = d.dp_replicate * d.dp_shard * d.cp * d.sp * d.tp;
    let dsz = setup.dtype.size_in_bytes() as f64;
    let seq = setup.seq as f64;
    // LoRA: ~10% more on the reference shape at r 16, every linear layer.
    let adapters = setup.lora.as_ref().map_or(0, |l| {
        model.adapters(l, 1).iter().map(|(_, n)| *n).sum::<usize>()
    });
    let flops_per_token = model.matmul_flops_per_token(setup.seq, setup.checkpointing, adapters);
    let dp = (d.dp_replicate * d.dp_shard) as f64;
    let tokens = dp * setup.batch as f64 * seq;
    // The matmuls split over every rank; the rest over all ranks but, for its passes over
    // the whole hidden state, the tp ranks.
    let matmuls = tokens * flops_per_token / world as f64 / hw.flops;
    let tp = d.tp as f64;
    let replicated = cfg.replicated_elementwise_share();
    let mut compute =
        matmuls * (1.0 + (1.0 / hw.matmul_share - 1.0) * (replicated * tp + 1.0 - replicated));
    // A loss over whole logits: the log-softmax's passes over this rank's tokens and
    // vocabulary entries (memory-bound, beside the matmuls).
    let rank_tokens = setup.batch as f64 * seq / (d.cp * d.sp) as f64;
    // LoRA's dropout, rank-r products and sums, per input and output feature of each adapted
    // layer (this rank's part of it under tp).
    if let Some(l) = &setup.lora {
        compute += rank_tokens * model.adapted_features(l, d.tp) * hw.adapter_element_seconds;
    }
    if whole_logits(model, setup) {
        compute += rank_tokens * (cfg.vocab_size / d.tp) as f64 * hw.logit_seconds;
    }

    let link = |group: usize, span: usize| match group * span > hw.per_machine {
        true => hw.inter,
        false => hw.intra,
    };
    let ring = |n: usize| (n as f64 - 1.0) / n as f64;
    // Under expert parallelism a rank holds 1 / ep of the routed experts: their gradients are
    // reduced over the dp / ep ranks holding the same ones, ZeRO-3 / FSDP's units sharded there.
    let ep = setup.ep.max(1);
    let (mut experts, mut dense) = (0.0, 0.0);
    match &setup.lora {
        Some(l) => {
            dense = model
                .adapters(l, d.tp)
                .iter()
                .map(|(_, n)| *n)
                .sum::<usize>() as f64
        }
        None => {
            for (name, n) in model.local_ep(d.tp, ep) {
                match crate::nn::lora::is_routed_expert(name) {
                    true => experts += n as f64,
                    false => dense += n as f64,
                }
            }
        }
    }
    let trainable = dense + experts;
    let n_shard = d.dp_shard * d.cp * d.sp;
    let inner = d.tp * d.cp * d.sp;
    let shard = link(n_shard, d.tp);
    // Data-parallel traffic is a few large buckets: its bandwidth term.
    let mut dp_seconds = match setup.strategy {
        Strategy::Ddp => {
            let all = n_shard * d.dp_replicate;
            let reduce =
                |n: usize, elems: f64| link(n, d.tp).seconds(1.0, 2.0 * ring(n) * 4.0 * elems);
            match ep {
                1 => reduce(all, trainable),
                _ => reduce(all, dense) + reduce(all / ep, experts),
            }
        }
        Strategy::Zero(_) => shard.seconds(1.0, ring(n_shard) * (4.0 + dsz) * trainable),
        // Gathered for forward and again for backward; gradients reduce-scattered (under ep
        // the experts' units over the ranks holding the same experts, the rest over all).
        Strategy::Fsdp(..) => {
            let (mut base, mut base_experts) = (0.0, 0.0);
            for (name, n) in model.local_ep(d.tp, ep) {
                match ep > 1 && crate::nn::lora::is_routed_expert(name) {
                    true => base_experts += n as f64,
                    false => base += n as f64,
                }
            }
            let (trained, trained_experts) = match ep > 1 {
                true => (dense, experts),
                false => (trainable, 0.0),
            };
            let units = |n: usize, base: f64, trained: f64| {
                link(n, d.tp).seconds(1.0, ring(n) * (2.0 * dsz * base + 4.0 * trained))
            };
            units(n_shard, base, trained)
                + match ep > 1 {
                    true => units(n_shard / ep, base_experts, trained_experts),
                    false => 0.0,
                }
        }
    };
    if d.dp_replicate > 1 && !matches!(setup.strategy, Strategy::Ddp) {
        // HSDP: the slices are all-reduced across the replicas.
        dp_seconds += link(d.dp_replicate, inner * d.dp_shard).seconds(
            1.0,
            2.0 * ring(d.dp_replicate) * 4.0 * trainable / n_shard as f64,
        );
    }
    // Per layer: tp all-reduces the attention and MLP outputs (2 forward, 2 backward, 2 more
    // recomputed); Ulysses all-to-alls q, k, v and the output both ways; the ring passes k and
    // v around (cp - 1 hops forward, twice that backward).
    let q = (cfg.num_attention_heads * cfg.head_dim()) as f64;
    let kv = (cfg.num_kv_heads() * cfg.head_dim()) as f64;
    let layers = cfg.num_hidden_layers as f64;
    let h = cfg.hidden_size as f64;
    let recompute = if setup.checkpointing { 1.5 } else { 1.0 };
    // Each is on the critical path: a latency per collective plus its bytes.
    let mut mp = 0.0;
    if d.tp > 1 {
        let count = layers * 4.0 * recompute;
        let bytes = count * 2.0 * ring(d.tp) * rank_tokens * h * dsz;
        mp += link(d.tp, 1).seconds(count, bytes);
    }
    if d.sp > 1 {
        // q, k, v and the output, forward and backward.
        let count = layers * 2.0 * recompute * 4.0;
        let volume = rank_tokens * (q + 2.0 * kv + q) / d.tp as f64 * dsz;
        let bytes = layers * 2.0 * recompute * ring(d.sp) * volume;
        mp += link(d.sp, d.tp).seconds(count, bytes);
    }
    if d.cp > 1 {
        let count = layers * 3.0 * recompute * (d.cp as f64 - 1.0);
        let volume = rank_tokens * 2.0 * kv / d.tp as f64 * dsz;
        mp += link(d.cp, d.tp).seconds(count, count * volume);
    }
    if let Some(x) = ep_exchange(model, setup) {
        mp += link(ep, inner).seconds(x.count, x.bytes);
    }
    // An offloaded update runs after backward, on this rank's slice of the trainable state.
    let offload = match setup.offload_optimizer {
        true => trainable / n_shard as f64 / hw.offload_params_per_s,
        false => 0.0,
    };
    let busy = match hw.comm_overlaps {
        true => compute.max(dp_seconds),
        false => compute + dp_seconds,
    };
    let seconds = busy + mp + offload;
    StepTime {
        compute,
        data_parallel: dp_seconds,
        model_parallel: mp,
        tokens_per_second: tokens / seconds,
    }
}

/// Expert parallelism's all-to-alls in one step on a rank: how many, and the bytes it sends.
#[derive(Debug, Clone, Copy)]
pub struct EpExchange {
    /// Each sparse layer's routed experts this rank holds.
    pub experts_per_rank: usize,
    pub count: f64,
    pub bytes: f64,
}

/// Per sparse layer two all-to-alls forward (the routed rows out, the outputs back), two
/// backward, two more recomputed under checkpointing; each sends the (ep - 1) / ep of this
/// rank's routed rows bound for the other ranks. None without ep or experts.
pub fn ep_exchange(model: &ModelShapes, setup: &Setup) -> Option<EpExchange> {
    let (experts, top_k, _, sparse) = model.moe.filter(|_| setup.ep > 1)?;
    let ep = setup.ep as f64;
    let d = setup.dims;
    let rank_tokens = (setup.batch * setup.seq) as f64 / (d.cp * d.sp) as f64;
    let recompute = if setup.checkpointing { 1.5 } else { 1.0 };
    let count = sparse as f64 * 4.0 * recompute;
    let row = (top_k * model.dims.hidden_size * setup.dtype.size_in_bytes()) as f64;
    Some(EpExchange {
        experts_per_rank: experts / setup.ep,
        count,
        bytes: count * (ep - 1.0) / ep * rank_tokens * row,
    })
}
