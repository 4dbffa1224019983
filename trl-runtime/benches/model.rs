//! `cargo bench -p trl-runtime --bench model`: forward+backward of the reference Qwen2 shape
//! (hidden 256, intermediate 768, 4 layers, 8 heads, 4 kv heads, vocab 4096, seq 512, batch 4,
//! fp32) on one thread, next to a plain 1024^3 f32 Candle matmul on one thread measured in
//! the same run (5 rounds of a step next to 3 matmuls; the median round's ratio). One JSON
//! object per line on stdout; prose on stderr.
//!
//! FLOPs count the matmuls as computed: 2 per multiply-add for every projection, the LM head,
//! and the full (masked, not skipped) attention score and value products; backward = 2 x forward.

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
    let cfg = config();
    let model = CausalLm::new(
        cfg.clone(),
        Params::init(&cfg, 0, DType::F32, &Device::Cpu).unwrap(),
    )
    .unwrap();
    let ids: Vec<u32> = (0..BATCH * SEQ)
        .map(|i| (i * 7919 % cfg.vocab_size) as u32)
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
    eprintln!(
        "model bench: {} parameters, batch {BATCH} x seq {SEQ}, 1 thread",
        cfg.num_parameters()
    );
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
    let flops = 3.0 * forward_flops_per_token(&cfg, SEQ) * tokens;
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
        "{{\"bench\":\"model\",\"what\":\"fwd_bwd\",\"tokens_per_s\":{:.1},\"step_s\":{secs:.4},\"flops_per_s\":{:.4e},\"matmul_flops_per_s\":{matmul:.4e},\"ratio_to_matmul\":{:.3}}}",
        tokens / secs,
        flops / secs,
        flops / secs / matmul
    );
}
