//! `cargo bench -p trl-runtime --bench model`: forward+backward of the reference Qwen2 shape
//! (hidden 256, intermediate 768, 4 layers, 8 heads, 4 kv heads, vocab 4096, seq 512, batch 4,
//! fp32) and of a Qwen3-MoE shape of the same attention (8 experts of intermediate 384, top 2:
//! the same active MLP FLOPs), and that shape as gpt-oss lays it out (fused experts run as
//! grouped GEMMs, biases, sinks), and a DeepSeek-V3 shape (latent attention, a dense first
//! layer, then DeepSeek's routing over 8 experts, top 2, beside a shared expert) on one
//! thread, and a Qwen3.5 shape (three Gated DeltaNet layers of 4 key heads and 8 value heads
//! of 32 features, then one gated full-attention layer), each next to a plain 1024^3 f32
//! Candle matmul on
//! one thread measured in the same run (5 rounds of a step next to 3 matmuls; the median
//! round's ratio). Then a Gated DeltaNet layer split over two ranks (context parallelism's
//! state scan, Ulysses' head split) against one process (`split_gated_deltanet`). One JSON
//! object per line on stdout; prose on stderr. `TRL_BENCH_ONLY=hybrid` runs the lines whose
//! name holds it.
//!
//! FLOPs count the matmuls as computed: 2 per multiply-add for every projection, the LM head,
//! and the full (masked, not skipped) attention score and value products; backward = 2 x forward.

// Only its random-weights writer: the rest serves the training benches.
#[allow(dead_code)]
mod support;

use candle_core::{DType, Device, Tensor};
use std::time::Instant;
use trl_runtime::models::{ModelConfig, Params};
use trl_runtime::parallel::CausalLm;

const BATCH: usize = 4;
const SEQ: usize = 512;

fn config() -> ModelConfig {
    let json = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": true,
    });
    ModelConfig::from_json(&json.to_string(), "reference shape").unwrap()
}

/// The MoE shape: the reference's attention, 8 experts of intermediate 384, 2 per token.
fn moe_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 768, "moe_intermediate_size": 384, "num_local_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": true,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "tie_word_embeddings": true,
    })
}

/// gpt-oss's layout of the MoE shape: its experts fused and run as grouped GEMMs (with
/// biases, the clamped SwiGLU, a biased router, attention sinks), full attention.
fn gpt_oss_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "gpt_oss", "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 384, "num_local_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "attention_bias": true, "tie_word_embeddings": true,
        "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention"],
    })
}

/// DeepSeek-V3's layout at the reference's width: latent attention (8 heads, query latent 96,
/// key/value latent 64, 32 + 16 query/key features, 32 value features), a dense first layer
/// of the reference's MLP, then 8 experts of intermediate 384 in 4 groups (2 per token from 2
/// groups) beside a shared expert of 384.
fn deepseek_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "deepseek_v3", "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 768, "moe_intermediate_size": 384, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "tie_word_embeddings": true,
    })
}

/// Forward FLOPs of one token of [`deepseek_json`] at sequence length `seq`, as computed: the
/// latent projections, attention at the kernels' head width (the wider of the query's 48 and
/// the value's 32), and per layer the dense MLP or the router, 2 experts and the shared one.
fn deepseek_flops_per_token(seq: usize) -> f64 {
    let (h, n, layers, v) = (256.0, 8.0, 4.0, 4096.0);
    let (q_rank, kv_rank, nope, rope, value) = (96.0, 64.0, 32.0, 16.0, 32.0);
    let qk: f64 = nope + rope;
    let attention = h * q_rank
        + q_rank * n * qk
        + h * (kv_rank + rope)
        + kv_rank * n * (nope + value)
        + n * value * h;
    let scores = 2.0 * seq as f64 * n * qk.max(value);
    let dense = 3.0 * h * 768.0;
    let sparse = h * 8.0 + 3.0 * 3.0 * h * 384.0;
    2.0 * (layers * attention + dense + (layers - 1.0) * sparse)
        + 2.0 * layers * scores
        + 2.0 * h * v
}

/// Qwen3.5's hybrid layout at the reference's width: three Gated DeltaNet layers (4 key heads
/// and 8 value heads of 32 features, a 4-tap convolution) then one full-attention layer (the
/// reference's 8 heads and 4 kv heads of 32, its output gate, a quarter of each head rotated),
/// the reference's MLP on every layer.
fn hybrid_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 32,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "linear_value_head_dim": 32,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": true,
    })
}

/// Forward FLOPs of one token of [`hybrid_json`] at sequence length `seq`: per Gated DeltaNet
/// layer its projections, the convolution and the rule's three products per state element
/// (the prediction S^T k, the write k delta^T, the read S^T q: what the recurrence computes;
/// the chunked form computes more); the full-attention layer's projections (queries and their
/// gates), scores and values; the MLP on every layer; the LM head.
fn hybrid_flops_per_token(seq: usize) -> f64 {
    let (h, i, v, seq) = (256.0, 768.0, 4096.0, seq as f64);
    let (nk, nv, d, taps) = (4.0, 8.0, 32.0, 4.0);
    let channels = 2.0 * nk * d + nv * d;
    let linear = 2.0 * (h * channels + h * nv * d + 2.0 * h * nv + nv * d * h)
        + 2.0 * channels * taps
        + 2.0 * 3.0 * nv * d * d;
    let (q, kv) = (8.0 * 32.0, 4.0 * 32.0);
    let full = 2.0 * (h * 2.0 * q + 2.0 * h * kv + q * h) + 2.0 * 2.0 * seq * q;
    let mlp = 2.0 * 3.0 * h * i;
    3.0 * linear + full + 4.0 * mlp + 2.0 * h * v
}

/// A model of `json` with random weights (normal, std 0.02; norms 1), written to `dir` as a
/// checkpoint and loaded as the trainer loads one.
fn random_model(json: &serde_json::Value, dir: &std::path::Path) -> CausalLm {
    support::write_random_model(json, dir);
    CausalLm::from_pretrained(dir, DType::F32, &Device::Cpu).unwrap()
}

/// Forward FLOPs of one token at sequence length `seq`.
fn forward_flops_per_token(c: &ModelConfig, seq: usize) -> f64 {
    let (h, i, v) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.vocab_size as f64,
    );
    let q = (c.num_attention_heads * c.head_dim()) as f64;
    let kv = (c.num_key_value_heads.unwrap() * c.head_dim()) as f64;
    let per_layer = 2.0 * (h * q + 2.0 * h * kv + q * h + 3.0 * h * i) + 2.0 * 2.0 * seq as f64 * q;
    per_layer * c.num_hidden_layers as f64 + 2.0 * h * v
}

/// A plain 1024^3 f32 matmul: the reference rate.
struct Reference {
    a: Tensor,
    b: Tensor,
}

impl Reference {
    const N: usize = 1024;

    fn new() -> Self {
        let n = Self::N;
        let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu).unwrap();
        let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu).unwrap();
        a.matmul(&b).unwrap(); // warm-up
        Reference { a, b }
    }

    /// FLOP/s of the median of `reps` matmuls.
    fn flops_per_s(&self, reps: usize) -> f64 {
        let secs = median_secs(reps, || {
            std::hint::black_box(self.a.matmul(&self.b).unwrap());
        });
        2.0 * (Self::N * Self::N * Self::N) as f64 / secs
    }
}

/// The median time of `reps` runs of `f`.
fn median_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

fn main() {
    // One compute thread, for the model and the reference alike (read when the pool starts).
    std::env::set_var("RAYON_NUM_THREADS", "1");
    trl_runtime::alloc::keep_freed_memory();
    trl_runtime::dist::compute_on_this_thread();
    let cfg = config();
    let model = CausalLm::new(
        cfg.clone(),
        Params::init(&cfg, 0, DType::F32, &Device::Cpu).unwrap(),
    )
    .unwrap();
    eprintln!(
        "model bench: {} parameters, batch {BATCH} x seq {SEQ}, 1 thread",
        cfg.num_parameters()
    );
    let flops = 3.0 * forward_flops_per_token(&cfg, SEQ) * (BATCH * SEQ) as f64;
    measure("fwd_bwd", &model, flops);
    // The MoE shape does the dense one's FLOPs per token (2 of 8 experts of half the
    // intermediate size), plus its router.
    let dir = tempfile::tempdir().unwrap();
    let moe = random_model(&moe_json(), dir.path());
    let router = 2.0 * 2.0 * cfg.hidden_size as f64 * 8.0 * cfg.num_hidden_layers as f64;
    let flops = 3.0 * (forward_flops_per_token(&cfg, SEQ) + router) * (BATCH * SEQ) as f64;
    eprintln!("model bench: the MoE shape (8 experts, top 2)");
    measure("fwd_bwd_moe", &moe, flops);
    let dir = tempfile::tempdir().unwrap();
    let gpt_oss = random_model(&gpt_oss_json(), dir.path());
    eprintln!("model bench: the MoE shape as gpt-oss lays it out (fused experts, grouped GEMMs)");
    measure("fwd_bwd_moe_grouped", &gpt_oss, flops);
    let dir = tempfile::tempdir().unwrap();
    let deepseek = random_model(&deepseek_json(), dir.path());
    let flops = 3.0 * deepseek_flops_per_token(SEQ) * (BATCH * SEQ) as f64;
    eprintln!("model bench: the DeepSeek-V3 shape (latent attention, shared expert)");
    measure("fwd_bwd_mla_moe", &deepseek, flops);
    let dir = tempfile::tempdir().unwrap();
    let hybrid = random_model(&hybrid_json(), dir.path());
    let flops = 3.0 * hybrid_flops_per_token(SEQ) * (BATCH * SEQ) as f64;
    eprintln!("model bench: the Qwen3.5 shape (three Gated DeltaNet layers, one full attention)");
    measure("fwd_bwd_hybrid", &hybrid, flops);
    split_gated_deltanet();
}

/// A Gated DeltaNet layer's forward+backward (hidden 512; 4 key heads and 8 value heads of
/// 128 features, Qwen3.5's head size; convolution of 4; one packed row of 4096 tokens, two
/// documents), one process against two ranks in threads of this process, each with one
/// compute thread: context parallelism (`cp2`: ring attention's two head-tail chunks per rank,
/// the layer split by heads; `cp2_scan`: by tokens, the rule's state scanned over the ranks)
/// and Ulysses (`sp2`: the rows of half the heads per rank, two all-to-alls). The median of 3 rounds each; the ratio is one process's time over
/// a rank's (2 would be a perfect split of the work).
fn split_gated_deltanet() {
    use trl_runtime::comm::InProcessWorld;
    use trl_runtime::config::parallelism::ParallelDims;
    use trl_runtime::context_parallel::SeqSplit;
    use trl_runtime::data::sequence::split_columns;
    use trl_runtime::dist::{DeviceMesh, DistContext};
    use trl_runtime::models::gated_deltanet::{DeltaNetShape, GatedDeltaNet, Projections};
    use trl_runtime::models::LayerInputs;
    use trl_runtime::nn::AttentionImpl;
    if std::env::var("TRL_BENCH_ONLY").is_ok_and(|only| !"split_gated_deltanet".contains(&only)) {
        return;
    }
    let (hidden, nk, nv, d, seq) = (512, 4, 8, 128, 4096);
    let dev = Device::Cpu;
    let channels = 2 * nk * d + nv * d;
    // Trainable weights (the backward computes their gradients, as training does).
    let weight = |shape: &[usize], scale: f64| {
        let t = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() * scale).unwrap();
        candle_core::Var::from_tensor(&t)
            .unwrap()
            .as_tensor()
            .clone()
    };
    let tensors: std::collections::HashMap<String, Tensor> = [
        ("in_proj_qkv.weight", weight(&[channels, hidden], 0.04)),
        ("in_proj_z.weight", weight(&[nv * d, hidden], 0.04)),
        ("in_proj_b.weight", weight(&[nv, hidden], 0.04)),
        ("in_proj_a.weight", weight(&[nv, hidden], 0.04)),
        ("conv1d.weight", weight(&[channels, 1, 4], 0.5)),
        ("dt_bias", weight(&[nv], 0.3)),
        ("A_log", weight(&[nv], 0.5)),
        ("norm.weight", (weight(&[d], 0.1) + 1.0).unwrap()),
        ("out_proj.weight", weight(&[hidden, nv * d], 0.03)),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &dev);
    let shape = DeltaNetShape {
        hidden,
        key_heads: nk,
        value_heads: nv,
        key_dim: d,
        value_dim: d,
        conv_kernel: 4,
        eps: 1e-6,
        chunk: 64,
        projections: Projections::Apart,
    };
    let layer = GatedDeltaNet::new(shape, vb).unwrap();
    let x = Tensor::randn(0f32, 1.0, (1, seq, hidden), &dev).unwrap();
    let pos: Vec<i64> = (0..seq as i64 / 4).chain(0..3 * seq as i64 / 4).collect();
    let pos = Tensor::from_vec(pos, (1, seq), &dev).unwrap();
    let one_thread = || {
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
    };
    // One forward+backward of `layer` on `x` at `pos`, split as `split` says.
    let step = |x: &Tensor, pos: &Tensor, split: Option<&SeqSplit>| {
        let cx = LayerInputs::new(pos, split, AttentionImpl::Eager, DType::F32, &dev).unwrap();
        let x = candle_core::Var::from_tensor(x).unwrap();
        let y = layer.forward(x.as_tensor(), &cx).unwrap();
        std::hint::black_box(y.sqr().unwrap().sum_all().unwrap().backward().unwrap());
    };
    let pool = one_thread();
    let one = pool.install(|| {
        step(&x, &pos, None);
        median_secs(3, || step(&x, &pos, None))
    });
    let mut line = format!(
        "{{\"bench\":\"model\",\"what\":\"split_gated_deltanet\",\"tokens\":{seq},\"one_process_s\":{one:.4}"
    );
    for (name, cp, sp) in [("cp2", 2, 1), ("cp2_scan", 2, 1), ("sp2", 1, 2)] {
        // Context parallelism splits this layer by heads (they divide by 2) unless told to
        // scan the state over the ranks.
        match name {
            "cp2_scan" => std::env::set_var("TRL_LINEAR_CP", "scan"),
            _ => std::env::remove_var("TRL_LINEAR_CP"),
        }
        let world = InProcessWorld::new(2);
        let dims = ParallelDims {
            dp_replicate: 1,
            dp_shard: 1,
            cp,
            sp,
            tp: 1,
        };
        // Each rank's median round; a round ends when both ranks' have (they wait on each
        // other's collectives), so the slower rank's is the split's time.
        let ranks: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (world, step, x, pos) = (&world, &step, &x, &pos);
                    s.spawn(move || {
                        let mesh = DeviceMesh::new(dims, 2).unwrap();
                        let ctx = DistContext::in_process(world, rank, mesh).unwrap();
                        let split = SeqSplit::from_context(&ctx).unwrap().unwrap();
                        let mine = split_columns(seq, rank, 2, split.ring).unwrap();
                        let mine: Vec<u32> = mine.iter().map(|&i| i as u32).collect();
                        let mine = Tensor::new(mine.as_slice(), &Device::Cpu).unwrap();
                        let (x, pos) = (
                            x.index_select(&mine, 1).unwrap(),
                            pos.index_select(&mine, 1).unwrap(),
                        );
                        one_thread().install(|| {
                            step(&x, &pos, Some(&split));
                            median_secs(3, || step(&x, &pos, Some(&split)))
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let rank = ranks.iter().copied().fold(0.0, f64::max);
        line += &format!(
            ",\"{name}_rank_s\":{rank:.4},\"{name}_ratio\":{:.3}",
            one / rank
        );
    }
    println!("{line}}}");
}

/// Prints the median round of `model`'s forward+backward against the matmul rate.
fn measure(what: &str, model: &CausalLm, flops: f64) {
    // TRL_BENCH_ONLY=hybrid: the lines whose name holds it.
    if std::env::var("TRL_BENCH_ONLY").is_ok_and(|only| !what.contains(only.as_str())) {
        return;
    }
    let vocab = 4096;
    let ids: Vec<u32> = (0..BATCH * SEQ)
        .map(|i| (i * 7919 % vocab) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (BATCH, SEQ), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0i64, SEQ as i64, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((BATCH, 1))
        .unwrap();
    let labels = ids.to_dtype(DType::I64).unwrap();
    let step = || {
        // The trainer's path: the LM head fused with the loss where it applies.
        let loss = model
            .forward_loss(&ids, &pos, &labels)
            .unwrap()
            .mean()
            .unwrap();
        std::hint::black_box(loss.backward().unwrap());
    };
    // A warm-up step, then five rounds (TRL_BENCH_STEPS: more, for `perf record`), each a
    // step next to three reference matmuls: a slow spell of the shared machine then slows
    // both sides of that round's ratio, and the median round is reported.
    step();
    let rounds: usize = std::env::var("TRL_BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
        .max(1);
    let reference = Reference::new();
    let tokens = (BATCH * SEQ) as f64;
    let mut measured: Vec<(f64, f64)> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            step();
            (t.elapsed().as_secs_f64(), reference.flops_per_s(3))
        })
        .collect();
    measured.sort_by(|x, y| (flops / x.0 / x.1).total_cmp(&(flops / y.0 / y.1)));
    let (secs, matmul) = measured[rounds / 2];
    println!(
        "{{\"bench\":\"model\",\"what\":\"{what}\",\"tokens_per_s\":{:.1},\"step_s\":{secs:.4},\"flops_per_s\":{:.4e},\"matmul_flops_per_s\":{matmul:.4e},\"ratio_to_matmul\":{:.3}}}",
        tokens / secs,
        flops / secs,
        flops / secs / matmul
    );
}
