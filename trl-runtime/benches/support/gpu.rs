//! The single-GPU part of `bench train` (built with `--features cuda`): training throughput of
//! a Qwen2-0.5B-shaped random-init model in bf16 at sequence length 2048, its MFU against the
//! bf16 matmul rate measured on the same GPU in the same run, and the same shape trained by
//! transformers (benches/hf_train.py, on the torch of the GPU machine) for the ratio.

use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::time::Instant;
use trl_runtime::dist::DistContext;
use trl_runtime::train::{SFTConfig, Strategy, Trainer};

pub const SEQ: usize = 2048;
const WARMUP_STEPS: usize = 2;
const MEASURED_STEPS: usize = 5;

/// Qwen2-0.5B's shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocabulary
/// 151936, tied embeddings).
pub fn qwen2_05b_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
    })
}

/// Dense bf16 matmul rate of this GPU in FLOP/s (8192^3, best of several).
fn matmul_rate(dev: &Device) -> f64 {
    let n = 8192;
    let a = Tensor::randn(0f32, 1.0, (n, n), dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let b = Tensor::randn(0f32, 1.0, (n, n), dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let mut best = f64::MAX;
    for _ in 0..10 {
        dev.synchronize().unwrap();
        let t = Instant::now();
        let c = a.matmul(&b).unwrap();
        dev.synchronize().unwrap();
        best = best.min(t.elapsed().as_secs_f64());
        drop(c);
    }
    2.0 * (n * n * n) as f64 / best
}

/// Model FLOPs per trained token: 6 per parameter (forward and backward of every matmul,
/// the tied head included) plus causal attention's 6 x layers x hidden x sequence (scores and
/// the weighted sum, half the square), as in the PaLM paper's MFU.
pub fn flops_per_token(params: usize, layers: usize, hidden: usize, seq: usize) -> f64 {
    6.0 * params as f64 + 6.0 * (layers * hidden * seq) as f64
}

/// Prints the `"device":"cuda"` lines, or says on stderr why there are none.
pub fn run(dir: &Path, batch: usize) {
    // The launcher's way in: the context picks the GPU by itself (dist::device); the matmul
    // rate is measured on the same device (and stream) the trainer uses.
    let ctx = DistContext::from_env().unwrap();
    if !ctx.device().is_cuda() {
        eprintln!("no GPU selected (see dist::device): the cuda lines are skipped");
        return;
    }
    let dev = ctx.device().clone();
    let rate = matmul_rate(&dev);
    eprintln!("bf16 matmul: {:.1} TFLOP/s", rate / 1e12);
    let model_dir = dir.join("qwen2-0.5b");
    let params = crate::support::write_model_and_rows(
        &model_dir,
        qwen2_05b_config(),
        4 * batch * (WARMUP_STEPS + MEASURED_STEPS),
        SEQ,
    );
    let per_token = flops_per_token(params, 24, 896, SEQ);
    let config = SFTConfig {
        model_name_or_path: model_dir.join("model"),
        dataset_name: model_dir.join("train.jsonl"),
        output_dir: dir.join("out-gpu"),
        per_device_train_batch_size: batch,
        max_length: SEQ,
        learning_rate: 1e-5,
        bf16: true,
        disable_tqdm: true,
        max_steps: 1000,
        ..SFTConfig::default()
    };
    let mut trainer = Trainer::with_strategy(config, &ctx, Strategy::Ddp).unwrap();
    // sdpa (the default, as in TRL) runs blockwise on a GPU.
    let attention = format!("{:?}", trainer.model.attention).to_lowercase();
    for _ in 0..WARMUP_STEPS {
        trainer.train_step().unwrap();
    }
    dev.synchronize().unwrap();
    let start = Instant::now();
    let mut tokens = 0;
    for _ in 0..MEASURED_STEPS {
        tokens += trainer.train_step().unwrap().tokens;
    }
    dev.synchronize().unwrap();
    let secs = start.elapsed().as_secs_f64();
    let tokens_per_s = tokens as f64 / secs;
    let mfu = tokens_per_s * per_token / rate;
    println!(
        "{{\"bench\":\"train\",\"device\":\"cuda\",\"model\":\"qwen2-0.5b-shape\",\"params\":{params},\"dtype\":\"bf16\",\"attention\":\"{attention}\",\"seq\":{SEQ},\"batch\":{batch},\"tokens_per_s\":{tokens_per_s:.1},\"step_s\":{:.4},\"mfu\":{mfu:.4},\"matmul_tflops\":{:.1}}}",
        secs / MEASURED_STEPS as f64,
        rate / 1e12
    );
    drop(trainer);
    // The same shape through transformers (and TRL when importable) on this GPU's torch.
    let script = crate::support::repo().join("trl-runtime/benches/hf_train.py");
    let out =
        std::process::Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
            .arg(&script)
            .args(["--seq", &SEQ.to_string(), "--batch", &batch.to_string()])
            .args([
                "--steps",
                &MEASURED_STEPS.to_string(),
                "--warmup",
                &WARMUP_STEPS.to_string(),
            ])
            .output();
    // Lines printed before a failure (transformers' before TRL's) still count.
    let hf = match out {
        Ok(o) => {
            if !o.status.success() {
                eprintln!(
                    "{} failed: {}",
                    script.display(),
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .collect::<Vec<_>>()
        }
        Err(e) => {
            eprintln!("cannot run {}: {e}", script.display());
            return;
        }
    };
    for line in hf {
        let (Some(name), Some(theirs)) =
            (line["framework"].as_str(), line["tokens_per_s"].as_f64())
        else {
            continue;
        };
        let hf_mfu = theirs * per_token / rate;
        println!(
            "{{\"bench\":\"train\",\"device\":\"cuda\",\"what\":\"vs_{name}\",\"seq\":{SEQ},\"batch\":{batch},\"{name}_tokens_per_s\":{theirs:.1},\"{name}_mfu\":{hf_mfu:.4},\"tokens_per_s_ratio_ours_over_{name}\":{:.3}}}",
            tokens_per_s / theirs
        );
    }
}
