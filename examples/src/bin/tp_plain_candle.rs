//! Tensor parallelism for a model written the plain Candle way: a small decoder (VarBuilder
//! constructors, `forward` functions) trained with tp = 2 over two CPU processes, each holding
//! half of every layer. Rank 0 also trains the unsplit model on the same batches and prints
//! both losses: they agree to rounding.
//!
//! Run: `cargo run --release -p trl-examples --bin tp_plain_candle` (spawns 2 local ranks), or
//! `cargo trl launch --profile multi_cpu --parallelism_config_tp_size 2 tp_plain_candle`.
//!
//! What changed against the plain Candle model (everything else below is as it was):
//!
//! ```diff
//! -use candle_nn::{embedding, linear, linear_no_bias, rms_norm, Embedding, Linear, RmsNorm};
//! +use trl_runtime::nn::{embedding, linear, linear_no_bias, rms_norm, Embedding, Linear, RmsNorm};
//! +use trl_runtime::Parallelize;
//!
//! +#[derive(Parallelize)]
//!  struct Mlp {
//! +    #[parallel(tp = "column")]
//!      gate_proj: Linear,
//! +    #[parallel(tp = "column")]
//!      up_proj: Linear,
//! +    #[parallel(tp = "row")]
//!      down_proj: Linear,
//!  }
//! ```
//! and likewise q/k/v `column`, o `row`, `num_heads` `divide`, `head_dim` `skip`, the
//! embedding and LM head `vocab`. In the training code: `tp::parallelize(&mut model, ..)`
//! after building it, the optimizer over `tp::named_parameters(&model)`, and
//! `vocab_parallel_cross_entropy` for the loss (the logits stay split over the vocabulary).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use std::process::ExitCode;
use std::sync::Arc;
use trl_runtime::comm::Communicator;
use trl_runtime::config::LaunchPlan;
use trl_runtime::dist::mesh::Axis;
use trl_runtime::dist::{spawn, DistContext};
use trl_runtime::nn::{embedding, linear, linear_no_bias, rms_norm, Embedding, Linear, RmsNorm};
use trl_runtime::tp::{self, vocab_parallel_cross_entropy, TpContext};
use trl_runtime::Parallelize;

const VOCAB: usize = 64;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const FFN: usize = 128;
const LAYERS: usize = 2;
const SEQ: usize = 24;
const BATCH: usize = 8;
const STEPS: usize = 60;
const LR: f64 = 3e-3;

#[derive(Parallelize)]
struct Mlp {
    #[parallel(tp = "column")]
    gate_proj: Linear,
    #[parallel(tp = "column")]
    up_proj: Linear,
    #[parallel(tp = "row")]
    down_proj: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = (self.gate_proj.forward(x)?.silu()? * self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}

#[derive(Parallelize)]
#[parallel(fsdp_unit)]
struct Block {
    input_layernorm: RmsNorm,
    #[parallel(tp = "column", name = "self_attn.q_proj")]
    q_proj: Linear,
    #[parallel(tp = "column", name = "self_attn.k_proj")]
    k_proj: Linear,
    #[parallel(tp = "column", name = "self_attn.v_proj")]
    v_proj: Linear,
    #[parallel(tp = "row", name = "self_attn.o_proj")]
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    #[parallel(tp = "divide")]
    num_heads: usize,
    #[parallel(skip)]
    head_dim: usize,
}

impl Block {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let (attn, mlp) = (vb.pp("self_attn"), vb.pp("mlp"));
        Ok(Block {
            input_layernorm: rms_norm(HIDDEN, 1e-6, vb.pp("input_layernorm"))?,
            q_proj: linear(HIDDEN, HIDDEN, attn.pp("q_proj"))?,
            k_proj: linear_no_bias(HIDDEN, HIDDEN, attn.pp("k_proj"))?,
            v_proj: linear(HIDDEN, HIDDEN, attn.pp("v_proj"))?,
            o_proj: linear_no_bias(HIDDEN, HIDDEN, attn.pp("o_proj"))?,
            post_attention_layernorm: rms_norm(HIDDEN, 1e-6, vb.pp("post_attention_layernorm"))?,
            mlp: Mlp {
                gate_proj: linear_no_bias(HIDDEN, FFN, mlp.pp("gate_proj"))?,
                up_proj: linear_no_bias(HIDDEN, FFN, mlp.pp("up_proj"))?,
                down_proj: linear_no_bias(FFN, HIDDEN, mlp.pp("down_proj"))?,
            },
            num_heads: HEADS,
            head_dim: HIDDEN / HEADS,
        })
    }

    /// Causal self-attention and MLP, written against the block's own head count.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let h = self.input_layernorm.forward(x)?;
        let heads = |t: Tensor| -> candle_core::Result<Tensor> {
            t.reshape((b, s, self.num_heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = heads(self.q_proj.forward(&h)?)?;
        let k = heads(self.k_proj.forward(&h)?)?;
        let v = heads(self.v_proj.forward(&h)?)?;
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?.broadcast_add(mask)?;
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        let a = p
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, s, self.num_heads * self.head_dim))?;
        let x = (x + self.o_proj.forward(&a)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        x + self.mlp.forward(&h)?
    }
}

#[derive(Parallelize)]
struct TinyLm {
    #[parallel(tp = "vocab", name = "model.embed_tokens")]
    embed_tokens: Embedding,
    #[parallel(name = "model.layers")]
    layers: Vec<Block>,
    #[parallel(name = "model.norm")]
    norm: RmsNorm,
    #[parallel(tp = "vocab")]
    lm_head: Linear,
}

impl TinyLm {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let m = vb.pp("model");
        Ok(TinyLm {
            embed_tokens: embedding(VOCAB, HIDDEN, m.pp("embed_tokens"))?,
            layers: (0..LAYERS)
                .map(|l| Block::new(m.pp(format!("layers.{l}"))))
                .collect::<candle_core::Result<_>>()?,
            norm: rms_norm(HIDDEN, 1e-6, m.pp("norm"))?,
            lm_head: linear_no_bias(HIDDEN, VOCAB, vb.pp("lm_head"))?,
        })
    }

    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let s = ids.dim(1)?;
        let mask: Vec<f32> = (0..s * s)
            .map(|i| {
                if i % s > i / s {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (s, s), ids.device())?;
        let mut x = self.embed_tokens.forward(ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, &mask)?;
        }
        self.lm_head.forward(&self.norm.forward(&x)?)
    }
}

/// A batch of the task: each row counts up from a start by a stride (mod VOCAB), both chosen
/// by the step, so every rank builds the same batch. The next token follows from the last two.
fn batch(step: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let mut ids = Vec::with_capacity(BATCH * SEQ);
    for row in 0..BATCH {
        let start = (step * 7 + row * 13) % VOCAB;
        let stride = 1 + (step * 3 + row * 5) % 5;
        ids.extend((0..SEQ).map(|t| ((start + t * stride) % VOCAB) as u32));
    }
    let ids = Tensor::from_vec(ids, (BATCH, SEQ), &Device::Cpu)?;
    let inputs = ids.narrow(1, 0, SEQ - 1)?;
    let targets = ids.narrow(1, 1, SEQ - 1)?.to_dtype(DType::I64)?;
    Ok((inputs, targets))
}

/// The model and its optimizer. `tp` splits it (None: the plain single-process model).
struct Run {
    model: TinyLm,
    opt: candle_nn::AdamW,
    tp: Option<Arc<dyn Communicator>>,
}

impl Run {
    fn new(
        values: &[(String, Tensor)],
        tp: Option<Arc<dyn Communicator>>,
    ) -> trl_runtime::Result<Self> {
        let vm = VarMap::new();
        let mut model = TinyLm::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
        for (name, value) in values {
            vm.data().lock().expect("var map")[name].set(value)?;
        }
        if let Some(comm) = &tp {
            // The one line that splits it: each rank keeps its slices of every layer.
            tp::parallelize(&mut model, &TpContext::new(comm.clone()))?;
        }
        let vars = tp::named_parameters(&model)?
            .iter()
            .map(|(_, v)| v.clone())
            .collect();
        let opt = candle_nn::AdamW::new_lr(vars, LR)?;
        Ok(Run { model, opt, tp })
    }

    /// One AdamW step on `step`'s batch; returns the mean loss.
    fn step(&mut self, step: usize) -> trl_runtime::Result<f64> {
        let (inputs, targets) = batch(step)?;
        let logits = self.model.forward(&inputs)?;
        let loss = match &self.tp {
            // Logits split over the vocabulary: the loss never gathers them.
            Some(comm) => {
                let l = vocab_parallel_cross_entropy(&logits, &targets, comm)?;
                (l.sum / l.count as f64)?
            }
            None => candle_nn::loss::cross_entropy(
                &logits.flatten_to(1)?,
                &targets.flatten_all()?.to_dtype(DType::U32)?,
            )?,
        };
        self.opt.step(&loss.backward()?)?;
        Ok(loss.to_scalar::<f32>()? as f64)
    }
}

fn train(ctx: &DistContext) -> trl_runtime::Result<f64> {
    let tp = ctx.group(&[Axis::Tp]);
    // Random initial values, rank 0's on every rank.
    let vm = VarMap::new();
    TinyLm::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
    // In name order: collectives must come in the same order on every rank.
    let mut vars: Vec<_> = vm
        .data()
        .lock()
        .expect("var map")
        .clone()
        .into_iter()
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut values = Vec::new();
    for (name, var) in vars {
        values.push((name, ctx.world().broadcast(var.as_tensor(), 0)?));
    }
    let mut split = Run::new(&values, Some(tp.clone()))?;
    let mut single = match ctx.is_main_process() {
        true => Some(Run::new(&values, None)?),
        false => None,
    };
    let mut worst = 0f64;
    for step in 0..STEPS {
        let loss = split.step(step)?;
        if let Some(single) = single.as_mut() {
            let reference = single.step(step)?;
            worst = worst.max((loss - reference).abs() / reference);
            if step % 10 == 0 || step + 1 == STEPS {
                println!(
                    "step {step:3}: loss tp={} {loss:.5} | one process {reference:.5}",
                    tp.size()
                );
            }
        }
    }
    Ok(worst)
}

fn main() -> ExitCode {
    if let Some(code) = spawn::relaunch_unless_launched(2) {
        return code;
    }
    // All ranks split the model (tp = world size) unless the launcher says otherwise.
    let world = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let result = LaunchPlan::from_process_env(world)
        .map(|mut plan| {
            if std::env::var("PARALLELISM_CONFIG_TP_SIZE").is_err() {
                plan.parallelism.tp = world;
            }
            plan
        })
        .and_then(DistContext::with_plan)
        .and_then(|ctx| Ok((train(&ctx)?, ctx.is_main_process())));
    match result {
        Ok((worst, true)) if worst > 1e-4 => {
            eprintln!("error: the split model's losses drifted from one process's by {worst:e}");
            ExitCode::FAILURE
        }
        Ok((worst, true)) => {
            println!("losses of tp and one process agree within {worst:.1e} (relative)");
            ExitCode::SUCCESS
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
