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
//! round's ratio). One JSON object per line on stdout; prose on stderr. `TRL_BENCH_ONLY=hybrid`
//! runs the lines whose name holds it.
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
