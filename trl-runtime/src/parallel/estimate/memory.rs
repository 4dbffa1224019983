//! Per-rank memory: model state by strategy, activations per token, the step's buffers.

use super::*;
use super::{Strategy, WrapPolicy, ZeroStage};
use crate::config::parallelism::ParallelDims;
use crate::nn::lora::is_routed_expert;

/// Elements per token that backward keeps of one decoder layer (no checkpointing), in the
/// compute dtype, for hidden size `h`, query width `q` (heads x head_dim), key/value width `kv`
/// and MLP width `i` on this rank (measured; see the module docs).
pub(super) fn layer_elements(
    h: f64,
    q: f64,
    kv: f64,
    i: f64,
    lora: bool,
    (tp, sp): (usize, usize),
) -> f64 {
    // Tensor parallelism keeps each block's input and its all-reduced output once more.
    let tp_copies = if tp > 1 { 12.0 * h } else { 0.0 };
    // Ulysses keeps q, k, v and the attention output in both layouts of its all-to-alls
    // (measured: 4 h-wide and 4 kv-wide tensors more per layer at h = q = 2 kv).
    let sp_copies = if sp > 1 {
        2.0 * (2.0 * q + 2.0 * kv)
    } else {
        0.0
    };
    tp_copies
        + sp_copies
        + match lora {
            // Norm outputs and residuals (h), q/k/v with their rotated copies and the attention
            // output, gate/up/activation products (i).
            false => 4.07 * h + 5.79 * q + 7.22 * kv + 3.70 * i,
            // The adapters add their inputs and their outputs summed to every target (since
            // the scale goes on the rank-r input, each target's output once: q, k, v, o,
            // gate, up and down, one output width each less than the 11.25 h + 8.09 q +
            // 11.16 kv + 10.03 i measured before).
            true => 9.25 * h + 7.09 * q + 9.16 * kv + 8.03 * i,
        }
}

/// Elements per token a sparse MLP keeps beyond its experts' MLPs: the tokens gathered for
/// each of their `top_k` experts, the weighted outputs and their concatenation added back
/// (4 k h), the sum (h), and the router's f32 logits, probabilities and choices (20 f32 per
/// expert). Measured on 4 expert counts / widths (trl-runtime/tests/memory_plan.rs).
pub(super) fn routing_elements(h: f64, experts: usize, top_k: usize, dsz: usize) -> f64 {
    4.0 * top_k as f64 * h + h + 80.0 * experts as f64 / dsz as f64
}

/// Elements per token outside the layers (embedding output, final norm, the fused loss's
/// hidden-state gradient).
pub(super) fn outside_elements(h: f64, lora: bool) -> f64 {
    match lora {
        false => 11.12 * h,
        true => 12.32 * h,
    }
}

/// Elements per token kept per checkpointed layer: its input.
pub(super) fn checkpoint_elements(h: f64) -> f64 {
    h
}

/// Whether the layers run on wrap units' ops (ZeRO-3 / FSDP, and ZeRO-2's resident units
/// without LoRA), which keep different intermediates from ops on whole weights.
pub(super) fn unit_ops(setup: &Setup) -> bool {
    match setup.strategy {
        Strategy::Fsdp(..) => true,
        Strategy::Zero(ZeroStage::Two) => setup.lora.is_none(),
        _ => false,
    }
}

/// Whether a step's gradients stay in the compute dtype, as Candle's backward makes them:
/// one micro-batch per step on a GPU with nothing to all-reduce (`Core::accumulate`; the
/// GPU optimizer reads them as they are, in f32 math). Otherwise they are summed in fp32.
pub fn native_gradients(gpu: bool, micro_batches: usize, single_replica: bool) -> bool {
    gpu && micro_batches == 1 && single_replica
}

pub(super) fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

/// What the parts of an estimate share: this rank's shapes, what trains, the wrap units.
struct Counts<'a> {
    tp: usize,
    d: ParallelDims,
    /// Ranks ZeRO and FSDP shard over: dp_shard and the ranks holding the rows' other chunks
    /// (a flat optimizer's state, under expert parallelism, over those holding the same
    /// experts).
    n: usize,
    /// Bytes per element of the compute dtype, and of a gradient as the step holds it.
    dsz: usize,
    gsz: usize,
    /// This rank's parameters (tp slices).
    shapes: Vec<(&'a str, usize)>,
    /// LoRA's adapters, and the modules it trains whole beside them.
    adapters: Option<Vec<(String, usize)>>,
    trained: Vec<(String, usize)>,
    /// Trainable elements, and the frozen base.
    p: usize,
    frozen: usize,
    /// The wrap units on this rank (frozen ones under LoRA; ZeRO-2's resident ones), each
    /// whole with its experts' unit.
    units: Vec<usize>,
    /// Elements of this rank's slices of them, and of them whole with their padding: a layer
    /// unit over all of dp_shard (with the chunks' ranks), its experts' unit (expert
    /// parallelism) over the ranks holding the same experts.
    unit_slices: usize,
    units_padded: usize,
    /// The ranks a layer unit is sharded over.
    unit_ranks: usize,
    lora: bool,
    /// ZeRO-2 of the whole model: resident units.
    resident: bool,
    /// peft's ensure_weight_tying: a tied pair trained as one.
    tied_as_one: bool,
    /// Ranks that hold a replica of a gradient (data-parallel and sequence chunks).
    replicas: usize,
}

/// Per token, what the layers keep, for the buffers that share memory with them.
#[derive(Clone, Copy)]
struct Activations {
    tokens: usize,
    h: f64,
    layers: f64,
    /// One layer's elements per token (as the strategy runs it), and without adapters.
    layer: f64,
    plain_layer: f64,
}

/// The per-rank memory of `setup` for the model `cfg`: model state ([`model_state`]),
/// activations ([`activations`]) and the step's buffers ([`buffers`]).
pub fn estimate(model: &ModelShapes, setup: &Setup) -> Estimate {
    let c = counts(model, setup);
    let mut e = Estimate::default();
    let mut why = Vec::new();
    model_state(&c, setup, &mut e, &mut why);
    let act = activations(&c, model, setup, &mut e, &mut why);
    buffers(&c, model, setup, act, &mut e, &mut why);
    e.explain = why;
    e
}

fn counts<'a>(model: &'a ModelShapes, setup: &Setup) -> Counts<'a> {
    let d = setup.dims;
    let tp = d.tp.max(1);
    // Under expert parallelism a rank holds 1 / ep of every routed expert's parameters.
    let ep = setup.ep.max(1);
    // ZeRO and FSDP shard over dp_shard and the ranks holding the other chunks of the rows;
    // under ep an experts' unit, and ZeRO-1's flat state, over those holding the same experts.
    let unit_ranks = (d.dp_shard * d.cp * d.sp).max(1);
    let n = (unit_ranks / ep).max(1);
    let dsz = setup.dtype.size_in_bytes();
    let shapes = model.local_ep(tp, ep);
    let base: usize = shapes.iter().map(|(_, n)| n).sum();

    // Trainable elements (all weights, or the adapters), and the frozen base.
    let per_rank = |named: Vec<(String, usize)>| -> Vec<(String, usize)> {
        named
            .into_iter()
            .map(|(name, n)| match is_routed_expert(&name) {
                true => (name, n / ep),
                false => (name, n),
            })
            .collect()
    };
    let adapters = setup.lora.as_ref().map(|l| per_rank(model.adapters(l, tp)));
    // Modules trained whole leave the frozen base (but a tied head's copy: its table stays).
    let trained = setup
        .lora
        .as_ref()
        .map_or(Vec::new(), |l| per_rank(model.saved(l, tp)));
    // A tied head trained apart from its embedding's copy (peft's default) still reads the
    // base table, which then stays.
    let tied_as_one = setup.lora.as_ref().is_some_and(|l| l.ensure_weight_tying);
    let head_reads_base = model.tied
        && !tied_as_one
        && !setup
            .lora
            .as_ref()
            .is_some_and(|l| l.saves("lm_head.weight"));
    let kept: usize = shapes
        .iter()
        .filter(|(n, _)| trained.iter().any(|(t, _)| t == n))
        .filter(|(n, _)| !(head_reads_base && n.ends_with("embed_tokens.weight")))
        .map(|(_, n)| n)
        .sum();
    let whole: usize = trained.iter().map(|(_, n)| n).sum();
    // ZeRO-2 without LoRA keeps its parameters whole in resident units, reducing each
    // unit's gradients as backward finishes it.
    let resident = setup.strategy == Strategy::Zero(ZeroStage::Two) && setup.lora.is_none();
    // The wrap units on this rank (frozen ones under LoRA).
    let parts = match setup.strategy {
        Strategy::Fsdp(policy, _) => model.unit_sizes((tp, ep), policy, &trained),
        _ if resident => model.unit_sizes((tp, ep), setup.reduce_units.0, &[]),
        _ => Vec::new(),
    };
    let units = parts.iter().map(|(u, e)| u + e).collect();
    let unit_slices = parts
        .iter()
        .map(|(u, e)| u.div_ceil(unit_ranks) + e.div_ceil(n))
        .sum();
    let units_padded = parts
        .iter()
        .map(|(u, e)| u.div_ceil(unit_ranks) * unit_ranks + e.div_ceil(n) * n)
        .sum();
    let (p, frozen) = match &adapters {
        Some(a) => (a.iter().map(|(_, n)| n).sum::<usize>() + whole, base - kept),
        None => (base, 0),
    };
    // Bytes per gradient element: fp32 sums, or as the backward makes them (DDP alone).
    let replicas = d.dp_replicate * d.dp_shard * d.cp * d.sp;
    let gsz = match setup.strategy == Strategy::Ddp
        && native_gradients(setup.gpu, setup.micro_batches, replicas == 1)
    {
        true => dsz,
        false => 4,
    };
    Counts {
        tp,
        d,
        n,
        dsz,
        gsz,
        shapes,
        adapters,
        trained,
        p,
        frozen,
        units,
        unit_slices,
        units_padded,
        unit_ranks,
        lora: setup.lora.is_some(),
        resident,
        tied_as_one,
        replicas,
    }
}

/// Weights, gradients and optimizer state as each strategy holds them, and what offload
/// moves to host memory.
fn model_state(c: &Counts, setup: &Setup, e: &mut Estimate, why: &mut Vec<String>) {
    let Counts {
        n,
        dsz,
        p,
        frozen,
        gsz,
        ..
    } = *c;
    let (units, slice) = (&c.units, |elems: usize| elems.div_ceil(n));
    // A flat slice spans parameters that decay and norms and biases that do not: ZeRO and
    // FSDP keep a byte per element saying which (`FlatLayout::shard_state`).
    const MASK: usize = 1;
    let opt_bytes;
    match (setup.strategy, setup.lora.is_some()) {
        (Strategy::Ddp, _) => {
            e.parameters = dsz * (p + frozen);
            e.gradients = gsz * p;
            opt_bytes = 12 * p;
            why.push(format!(
                "ddp: weights {dsz} x {} + gradients {gsz} x {p} + master and moments 12 x {p}",
                p + frozen
            ));
        }
        (Strategy::Zero(ZeroStage::Two), false) => {
            let s = c.unit_slices;
            // The whole parameters (each unit padded to the group), this rank's slice a view
            // of them (in host memory, a copy, under parameter offload); fp32 master weights
            // apart.
            e.parameters = dsz * c.units_padded + usize::from(setup.offload_params) * dsz * s;
            e.gradients = 4 * s;
            opt_bytes = (12 + MASK) * s;
            why.push(format!(
                "zero2: {} resident units, weights {dsz} x {} whole, gradients 4 x {s}, master, moments and decay mask 13 x {s} (each unit / {})",
                units.len(),
                c.units_padded,
                c.unit_ranks,
            ));
        }
        (Strategy::Zero(stage), _) => {
            e.parameters = dsz * (p + frozen);
            e.gradients = match stage {
                ZeroStage::One => 4 * p,
                ZeroStage::Two => (4 * p).div_ceil(n),
            };
            opt_bytes = (12 + MASK) * slice(p);
            why.push(format!(
                "{}: weights {dsz} x {} + gradients {} + master, moments and decay mask 13 x {} (the flat vector / {n})",
                setup.strategy.name(),
                p + frozen,
                mib(e.gradients),
                slice(p)
            ));
        }
        (Strategy::Fsdp(..), false) => {
            let s = c.unit_slices;
            // In fp32 the slice is its own master (but where the optimizer alone is offloaded:
            // its master in host memory); otherwise a compute-dtype copy beside it.
            let own_master = dsz == 4 && (setup.offload_params || !setup.offload_optimizer);
            e.parameters = dsz * s;
            e.gradients = 4 * s;
            opt_bytes = if own_master { 8 * s } else { 12 * s } + MASK * s;
            why.push(format!(
                "zero3: {} units, {s} elements per rank (each unit padded to {}): weights {dsz}, gradients 4, {} bytes of optimizer state each",
                units.len(),
                c.unit_ranks,
                opt_bytes / s.max(1)
            ));
        }
        (Strategy::Fsdp(..), true) => {
            // The frozen base is sharded in its units; the adapters stay whole, their
            // gradients and optimizer state sharded as ZeRO-2 does.
            let s = c.unit_slices;
            e.parameters = dsz * (s + p);
            e.gradients = (4 * p).div_ceil(n);
            opt_bytes = (12 + MASK) * slice(p);
            why.push(format!(
                "zero3 + LoRA: base slices {dsz} x {s} + adapters whole {dsz} x {p}, their gradients and state / {n}"
            ));
        }
    }
    if setup.reference_copy {
        e.reference = e.parameters;
        why.push(format!(
            "reference: a copy of the weights, {}",
            mib(e.reference)
        ));
    }
    if setup.side_parameters > 0 {
        let side = dsz * setup.side_parameters;
        e.reference += side;
        why.push(format!(
            "reward models held whole: {dsz} x {} = {}",
            setup.side_parameters,
            mib(side)
        ));
    }
    if setup.held_parameters > 0 {
        // Split over tp like the trained model; sharded over the units' ranks under ZeRO-3 /
        // FSDP (one layer's unit gathered at a time, counted with the activations' slack).
        let local = setup.held_parameters.div_ceil(c.tp);
        let held = match (&setup.strategy, units.is_empty()) {
            (Strategy::Fsdp(..), false) => dsz * local.div_ceil(c.unit_ranks),
            _ => dsz * local,
        };
        e.reference += held;
        why.push(format!(
            "frozen model held as the trained one ({} parameters): {}",
            setup.held_parameters,
            mib(held)
        ));
    }
    if setup.offload_optimizer {
        e.host_optimizer = opt_bytes;
        // The units' reduced gradient slices stream out as they arrive.
        if !units.is_empty() && !c.lora {
            e.host_gradients = std::mem::take(&mut e.gradients);
        }
    } else {
        e.optimizer = opt_bytes;
    }
    if setup.offload_params && !units.is_empty() {
        let slices = dsz * c.unit_slices;
        e.host_parameters = slices;
        e.parameters -= slices;
    }
}

/// What backward keeps of the forward, per token and layer, times this rank's tokens.
fn activations(
    c: &Counts,
    model: &ModelShapes,
    setup: &Setup,
    e: &mut Estimate,
    why: &mut Vec<String>,
) -> Activations {
    let Counts {
        tp, d, dsz, lora, ..
    } = *c;
    let cfg = &model.dims;
    // Activations: the tokens this rank computes, times what each layer keeps per token.
    let tokens = setup.batch * setup.seq / (d.cp * d.sp).max(1);
    let (h, q, kv, i) = (
        cfg.hidden_size as f64,
        (cfg.num_attention_heads * cfg.head_dim()) as f64 / tp as f64,
        (cfg.num_kv_heads() * cfg.head_dim()) as f64 / tp as f64,
        cfg.intermediate_size as f64 / tp as f64,
    );
    let layers = cfg.num_hidden_layers as f64;
    // LoRA's dropped inputs, per layer (on average).
    let dropped = setup
        .lora
        .as_ref()
        .map_or(0.0, |l| model.dropped_inputs(l, tp) / layers);
    // One layer and all of them, per token (with or without adapters).
    let stack = |lora: bool| {
        // With adapters a dense MLP's gate and up run as chains (the unit's op under ZeRO-3
        // / FSDP), so neither the base's output nor the adapter's product is kept beside
        // their sum: 4 i fewer than the constants, measured before that, count.
        let (dropped, chained_mlp) = if lora { (dropped, 4.0 * i) } else { (0.0, 0.0) };
        // Weights held on this rank (whole or tp's split), no adapters: the gated MLP's two
        // ops keep (gate | up) and not SwiGLU's product (`nn::gated`), i fewer.
        let weights_held = !unit_ops(setup);
        let gated = |applies: bool, width: f64| match applies && weights_held && !lora {
            true => width,
            false => 0.0,
        };
        let dense = layer_elements(h, q, kv, i, lora, (tp, d.sp)) + dropped
            - chained_mlp
            - gated(model.gated_mlp, i);
        // A sparse layer: each token runs through `top_k` experts' MLPs, plus the router.
        match model.moe {
            None => (dense, layers * dense),
            Some((experts, top_k, inter, sparse)) => {
                // The router loss's copy of the probabilities: one f32 per expert.
                let router_loss = match setup.router_loss {
                    true => 4.0 * experts as f64 / dsz as f64,
                    false => 0.0,
                };
                let routed = layer_elements(
                    h,
                    q,
                    kv,
                    (top_k * inter) as f64 / tp as f64,
                    lora,
                    (tp, d.sp),
                ) + dropped
                    + routing_elements(h, experts, top_k, dsz)
                    + router_loss
                    - gated(model.gated_experts, (top_k * inter) as f64 / tp as f64);
                let sparse = sparse as f64;
                (
                    routed.max(dense),
                    sparse * routed + (layers - sparse) * dense,
                )
            }
        }
    };
    let (layer, kept) = stack(lora);
    // Projections run with the ops around them as one op (`nn::chain`), so the graph keeps
    // fewer of their intermediates than the constants (measured on Qwen2 before the chain)
    // count. `moe_down`: what a sparse MLP's residual add (outside the chain) still keeps.
    let row_split = tp > 1;
    let (chained, moe_down) = match (lora, unit_ops(setup)) {
        // Whole weights: instead of each output before its bias, after it, its split copy
        // and attention's output merged back (6 q, 4 kv for k, 3 for v: Qwen2 has biases) and
        // the outputs the residual adds took (2 h), the rotated q and k, v split and
        // attention's output (2 q + 2 kv), with q/k norms their inputs and outputs (2 q +
        // 2 kv more). A row-split output projection is not chained (q + 2 h stay).
        (false, false) => {
            let norms = if model.qk_norm { 2.0 * (q + kv) } else { 0.0 };
            let rows = if row_split { q + 2.0 * h } else { 0.0 };
            let kept = 2.0 * q + 2.0 * kv + norms + rows;
            (kept - (6.0 * q + 7.0 * kv + 2.0 * h), h)
        }
        // LoRA: the frozen base's output and its sum with the adapter's are no longer kept,
        // for q and k (and their split copies: 3 q, 3 kv), v (2 kv), o_proj and down_proj
        // (4 h; not when row-split); nor the adapter's product for q, k and v (q + 2 kv: the
        // chain takes the rank-r hidden and B instead).
        (true, false) => {
            let rows = if row_split { 4.0 * h } else { 0.0 };
            (rows - (4.0 * q + 7.0 * kv + 4.0 * h), 2.0 * h)
        }
        // ZeRO-3 / FSDP (no adapter): a unit's op takes the chain but the residual: q's and
        // k's outputs before and after the split (2 q + 2 kv), v's (kv) and attention's
        // output merged for o_proj (q; not when row-split).
        (false, true) => {
            let rows = if row_split { q } else { 0.0 };
            (rows - (3.0 * q + 3.0 * kv), 0.0)
        }
        // ZeRO-3 / FSDP with LoRA: the unit's adapted op chains q, k and v (measured 3 q +
        // 5 kv fewer); o_proj and down_proj (a residual) are not chained.
        (true, true) => (-(3.0 * q + 5.0 * kv), 0.0),
    };
    let unchained_moe = model
        .moe
        .map_or(0.0, |(.., sparse)| sparse as f64 * moe_down);
    let (layer, kept) = (
        layer + chained + unchained_moe.min(moe_down),
        kept + layers * chained + unchained_moe,
    );
    // ZeRO-3 / FSDP keep 2 h more per layer and token (measured, with and without
    // checkpointing): a norm whose weight is in a unit runs as Candle's normalize ops and a
    // unit op scaling by the weight (`nn::RmsNorm`), not the fused kernel, and the graph keeps
    // those ops' intermediates. (A fused unit op for it measured 14% less step memory; the
    // step buffers below then over-count by ~3 MB at the test shape: not yet re-derived.)
    let unit_extra = match (setup.strategy, lora) {
        _ if unit_ops(setup) && !lora => layers * 2.0 * h,
        _ => 0.0,
    };
    let per_token = unit_extra
        + outside_elements(h, lora)
        + match setup.checkpointing {
            false => kept,
            // The recomputed layer's backward holds 2 h more than its forward keeps (its norms'
            // input gradients beside the next; measured).
            true => layers * checkpoint_elements(h) + layer + if lora { 0.0 } else { 2.0 * h },
        };
    e.activations = (per_token * tokens as f64) as usize * dsz;
    let plain_layer = stack(false).0;
    why.push(format!(
        "activations: {tokens} tokens x {per_token:.0} elements x {dsz} bytes ({}; {} layers of {layer:.0} per token)",
        if setup.checkpointing { "checkpointed: layer inputs kept, one layer recomputed at a time" } else { "every layer kept" },
        cfg.num_hidden_layers
    ));
    Activations {
        tokens,
        h,
        layers,
        layer,
        plain_layer,
    }
}

/// The step's transient buffers: gradients before their reduction and the units in use,
/// the loss's logits, the update's flat copies, the runtime's own, a save's.
fn buffers(
    c: &Counts,
    model: &ModelShapes,
    setup: &Setup,
    act: Activations,
    e: &mut Estimate,
    why: &mut Vec<String>,
) {
    let Counts {
        tp,
        n,
        dsz,
        p,
        gsz,
        lora,
        resident,
        tied_as_one,
        replicas,
        ..
    } = *c;
    let (units, trained, cfg) = (&c.units, &c.trained, &model.dims);
    let Activations {
        tokens, h, layers, ..
    } = act;
    // During backward the whole gradients of what the rank computes with exist before their
    // reduction; under ZeRO-3 / FSDP only those of the units gathered.
    let largest_unit = units.iter().copied().max().unwrap_or(0);
    let root_unit = units.first().copied().unwrap_or(0);
    let layer_unit = units.iter().skip(1).copied().max().unwrap_or(0);
    // The head's gradient (fp32, the vocabulary's rows this rank holds), unless LoRA leaves
    // the head frozen (the loss skips it then).
    let head_trained = !lora
        || trained.iter().any(|(n, _)| {
            n.ends_with("lm_head.weight")
                || (model.tied && tied_as_one && n.ends_with("embed_tokens.weight"))
        });
    let head_grad = match head_trained {
        true => 4 * cfg.vocab_size * cfg.hidden_size / tp,
        false => 0,
    };
    // Gathered per use (ZeRO-3 / FSDP), not resident.
    let sharded = matches!(setup.strategy, Strategy::Fsdp(..));
    // ZeRO-3 / FSDP's gradient slices are taken by each update and come back as the layers
    // reduce: in a step's first micro-batch (the only one without accumulation) none exists
    // before the layers' backward.
    let first_micro_batch = setup.micro_batches <= 1;
    // The fused loss on a sharded head computes from a copy of it, held by the graph until the
    // backward ends: at the peak of a frozen base (LoRA); with the base trained, the step's
    // peak falls where the counts below have room for it (measured, tests/memory_plan.rs).
    let head_copy = match unit_ops(setup) && !whole_logits(model, setup) {
        true => dsz * cfg.vocab_size * cfg.hidden_size,
        false => 0,
    };
    // While the loss's backward runs (ZeRO-3 / FSDP): the root gathered, the head's gradient
    // and the last layer's unit arriving.
    let loss_buffers = dsz * (root_unit + layer_unit) + head_grad;
    e.step_buffers = match (setup.strategy, lora) {
        // Then, during the layers' backward: the root and the head's gradient (held until the
        // embedding's backward, the last), a layer's unit in use with its gradients, the next
        // one's weights arriving and the reduced slices of two units waiting to be added
        // (measured with gradients detached as they are deposited: `Unit::deposit`). Under
        // checkpointing the peak is a recomputed layer's backward: in a step's first
        // micro-batch the reduced slices are the step's gradient slices (`gradients` counts
        // them), and the root's and this layer's are still to come. Without it the peak is
        // the root's backward, last, beside every activation and every slice.
        (Strategy::Fsdp(..), false) => {
            let in_use = loss_buffers + (dsz + 4) * layer_unit;
            let layer_slice = (4 * layer_unit).div_ceil(n);
            match first_micro_batch && setup.checkpointing {
                true => in_use.saturating_sub(layer_slice + (4 * root_unit).div_ceil(n)),
                false => in_use + 2 * layer_slice,
            }
        }
        // ZeRO-2's resident units: the weights are held; during a unit's backward its
        // gradients as the ops make them, then their flat copy being reduce-scattered (with
        // overlap_comm, the previous unit's still in flight), beside the head's gradient
        // (held until the embedding's backward, the last).
        (Strategy::Zero(ZeroStage::Two), false) => {
            let overlap = usize::from(setup.reduce_units.1);
            head_grad + (dsz + 4 + 4 * overlap) * layer_unit
        }
        // A frozen base: the root (embedding, head) gathered while the loss runs, a layer's
        // unit in use and the next one's weights arriving; no gradients but the adapters'.
        (Strategy::Fsdp(..), true) => dsz * (root_unit + 2 * layer_unit) + head_copy + 4 * p,
        (_, true) => head_grad + gsz * p - e.gradients.min(gsz * p),
        (_, false) => gsz * p - e.gradients.min(gsz * p),
    };
    // Under checkpointing each layer's kept input is freed once its backward ran
    // (`parallel::checkpointing`), while the gradients of the layers done so far grow: the
    // inputs of the layers to come and the gradients of those done share the memory the
    // counts above give each in full (the larger of the two, per layer but the last).
    if setup.checkpointing {
        let in_layers = |n: &str| n.contains(".layers.");
        let layer_trainable: usize = match &c.adapters {
            Some(a) => a
                .iter()
                .chain(trained)
                .filter(|(n, _)| in_layers(n))
                .map(|(_, n)| n)
                .sum(),
            None => c
                .shapes
                .iter()
                .filter(|(n, _)| in_layers(n))
                .map(|(_, n)| n)
                .sum(),
        };
        // The gradients backward holds: as made (then reduced) but under ZeRO-3 / FSDP,
        // whose units reduce theirs to slices as they go.
        let held = match sharded || resident {
            true => e.gradients,
            false => e.gradients.max(gsz * p),
        };
        let per_layer_grads = held as f64 * layer_trainable as f64 / p.max(1) as f64 / layers;
        let per_layer_input = (checkpoint_elements(h) * tokens as f64) * dsz as f64;
        let shared = (layers - 1.0).max(0.0) * per_layer_grads.min(per_layer_input);
        e.activations = e.activations.saturating_sub(shared as usize);
    }
    let loss_buffers = match sharded && !lora {
        true => loss_buffers,
        false => e.step_buffers,
    };
    if whole_logits(model, setup) {
        let absent = match (sharded || resident) && first_micro_batch {
            true => e.gradients,
            false => 0,
        };
        logits(c, model, setup, &act, (loss_buffers, absent), e, why);
    }
    // Of the step buffers, the unit arriving ahead of its use: whether its all-gather has
    // landed at the peak depends on timing. So does whether the previous unit's flat
    // gradient, reduce-scattered in the background, is still held (trained weights only).
    if sharded {
        let reducing = match (setup.strategy, lora) {
            (Strategy::Fsdp(..), false) => 4 * layer_unit,
            _ => 0,
        };
        e.prefetch = dsz * layer_unit + reducing;
    }
    // The update, beyond the gradients: AdamW runs in place (`optim`), so one process adds
    // one fp32 copy of the largest gradient. DDP over several ranks all-reduces the gradients
    // in buckets, every bucket flattened before the first is waited on: a flat copy of all
    // the gradients and, while a bucket is reduced, its result beside its flat (at most one
    // bucket's bytes; measured, 2 and 4 ranks); AdamW's copy comes after they are freed. ZeRO-1
    // (and ZeRO-2 over LoRA adapters) reduces a bucket at a time (reduce_bucket_size), then
    // all-gathers the weights; ZeRO-2's resident units reduced theirs during backward.
    let largest = c.shapes.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let bucket = match setup.reduce_units.0 {
        WrapPolicy::Buckets(b) => b,
        _ => crate::parallel::DEEPSPEED_REDUCE_BUCKET,
    };
    e.update_buffers = match (setup.strategy, lora) {
        (Strategy::Ddp, false) if replicas > 1 => {
            4 * p + (4 * p).min(crate::parallel::ddp::BUCKET_BYTES)
        }
        (Strategy::Ddp, false) => 4 * largest,
        // A bucket flattened (and the host backend's copy of it) beside the reduced slices,
        // then the gathered weights (measured, 1-4 ranks).
        (Strategy::Zero(ZeroStage::One), false) => {
            let b = p.min(bucket);
            let host_copy = if setup.gpu { 0 } else { 4 * b };
            (4 * b + host_copy + (4 * p).div_ceil(n)).max(4 * p)
        }
        _ => 0,
    };
    // The tokenizer, the rows and the host backend's buffers (256 KiB, measured), and on the
    // CPU one GEMM packing buffer per compute thread (the training thread is one of them).
    let packing = match setup.gpu {
        true => 0,
        false => setup.threads * crate::kernels::cpu_gemm::packing_buffer_bytes(),
    };
    e.runtime = (1 << 18) + packing;
    if setup.strategy == Strategy::Zero(ZeroStage::Two) && !resident && n > 1 {
        e.comm_buffers = (4 * p).div_ceil(n);
    }
    why.push(format!(
        "step buffers: backward {}, update {}",
        mib(e.step_buffers),
        mib(e.update_buffers)
    ));
    // A full save streams one unit at a time: its gathered weights and state.
    e.save = 16 * largest_unit;
}

/// What the loss over whole logits adds: its backward's 6 fp32 copies beside the step buffers
/// it needs (`loss_buffers`; `absent`: gradient slices not yet there), or what the forward
/// keeps of them beside the layers' backward, whichever is larger.
fn logits(
    c: &Counts,
    model: &ModelShapes,
    setup: &Setup,
    act: &Activations,
    (loss_buffers, absent): (usize, usize),
    e: &mut Estimate,
    why: &mut Vec<String>,
) {
    let Counts { tp, dsz, lora, .. } = *c;
    let cfg = &model.dims;
    let Activations {
        tokens,
        layer,
        plain_layer,
        ..
    } = *act;
    // The loss's backward holds 6 fp32 copies (measured), beside the step buffers it
    // needs (`loss_buffers`) and, under checkpointing, no recomputed layer (`activations`
    // counts one). Then it frees all but what the forward graph holds until the backward
    // ends, beside each layer's backward and the step buffers: the logits add whichever
    // phase is larger. What stays is measured: 3 copies; with LoRA under checkpointing
    // about 0.6 of an adapter-free layer more (fitted: 0.3-0.85 across the bench's
    // shapes; not traced to its tensors).
    let copy = 4 * tokens * cfg.vocab_size / tp;
    let per_layer = |elements: f64| (elements * tokens as f64) as usize * dsz;
    let recomputed = if setup.checkpointing {
        per_layer(layer)
    } else {
        0
    };
    let kept = match setup.checkpointing && lora {
        true => 3 * copy + per_layer(0.6 * plain_layer),
        false => 3 * copy,
    };
    let loss_phase = (6 * copy + loss_buffers).saturating_sub(recomputed + absent);
    e.logits = loss_phase.saturating_sub(e.step_buffers).max(kept);
    why.push(format!(
        "logits: 6 fp32 copies x {tokens} tokens x {} vocabulary entries in the loss's backward, or what the forward keeps beside the layers' backward: {}",
        cfg.vocab_size / tp,
        mib(e.logits)
    ));
}

/// Whether the loss runs over whole logits: where the fused loss cannot, the head split (tp),
/// or off the one-pass kernel (bf16 on the CPU) a sharded head (ZeRO-3 / FSDP) or
/// soft-capped logits.
pub(super) fn whole_logits(model: &ModelShapes, setup: &Setup) -> bool {
    let sharded = unit_ops(setup);
    let one_pass = crate::nn::tiled_loss::one_pass_dtype(setup.dtype, setup.gpu);
    setup.dims.tp > 1 || (!one_pass && (sharded || model.logits_loss))
}

/// What one generation round adds on a rank (an online trainer's sampling between steps,
/// `parallel::generate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenerationRound {
    /// The KV cache, allocated whole for the round: rows x tokens (prompt and completion) x
    /// layers x this rank's key/value heads x head dim x 2 (keys and values) x dtype bytes,
    /// each layer's own where they differ (`ModelShapes::kv_layers`); a Gated DeltaNet
    /// layer's recurrent state per row instead (`Dims::recurrent_state`).
    pub kv_cache: usize,
    /// ZeRO-3 / FSDP gathering the whole model once for the round: every weight, gathered
    /// into buffers of its own beside the rank's slices (0 where parameters are not sharded).
    pub gathered_weights: usize,
    /// The prefill's transient heap (a layer's buffers over the prompts, freed as it goes):
    /// per prompt token 3 hidden-size buffers (norms, residuals, attention's output), 3 MLP
    /// intermediates (gate, up, their product; a token's routed experts' for a mixture of
    /// experts) and a quarter of the key/value width, in the dtype (measured with a counting
    /// allocator, tests/memory_plan.rs: 5 hidden-size buffers until generation's MLP freed its
    /// gate and up outputs as soon as their product is formed, 2 hidden sizes a token less
    /// at the peak on both measured shapes).
    pub prefill: usize,
}

/// The [`GenerationRound`] of `rows` sequences of `tokens` each (`prompt` of them prefilled)
/// under `setup`.
pub fn generation_round(
    model: &ModelShapes,
    setup: &Setup,
    rows: usize,
    (prompt, tokens): (usize, usize),
) -> GenerationRound {
    let d = &model.dims;
    let tp = setup.dims.tp.max(1);
    let size = setup.dtype.size_in_bytes();
    let kv_heads = d.num_kv_heads().div_ceil(tp);
    // Latent attention (DeepSeek-V3) holds each token's latent and rotary key, whole on
    // every tp rank.
    let per_layer = match (d.kv_lora_rank, d.qk_rope_head_dim) {
        (Some(rank), Some(rope)) => rank + rope,
        _ => kv_heads * d.head_dim() * 2,
    };
    // Layer by layer where layers differ: Gemma 4's full layers wider, its reusing layers
    // none.
    let keys = match (d.kv_lora_rank, model.kv_layers()) {
        (None, Some(layers)) => layers
            .iter()
            .map(|&(heads, width)| heads.div_ceil(tp) * width * 2)
            .sum(),
        _ => (d.num_hidden_layers - d.linear_attention_layers()) * per_layer,
    };
    // Gated DeltaNet layers hold a state per row instead, its rule's state in f32.
    let (conv, state) = d.recurrent_state();
    let wide = crate::kernels::precision::wide(setup.dtype).size_in_bytes();
    let kv_cache = rows * tokens * keys * size
        + rows * d.linear_attention_layers() * (conv * size + state * wide);
    let gathered_weights = match setup.strategy {
        Strategy::Fsdp(..) => model.local(tp).iter().map(|(_, n)| n).sum::<usize>() * size,
        _ => 0,
    };
    let mlp = match model.moe {
        Some((_, top_k, inter, sparse)) if sparse == d.num_hidden_layers => top_k * inter,
        Some((_, top_k, inter, _)) => (top_k * inter).max(d.intermediate_size),
        None => d.intermediate_size,
    };
    let kv_width = kv_heads * d.head_dim() * 2;
    let per_token = 3 * d.hidden_size + 3 * mlp.div_ceil(tp) + kv_width / 4;
    GenerationRound {
        kv_cache,
        gathered_weights,
        prefill: rows * prompt * per_token * size,
    }
}
