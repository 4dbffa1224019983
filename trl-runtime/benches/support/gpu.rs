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

/// `TRL_BENCH_GPU_PROFILE=1`: one warm-up and one measured step per run and no peers, for a
/// kernel profile of a step (`scripts/gpu-run profile` runs it under Nsight Compute).
fn profiling() -> bool {
    std::env::var("TRL_BENCH_GPU_PROFILE").is_ok_and(|v| v == "1")
}

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
/// the tied head included; under LoRA 4, the frozen weights getting no gradient and the
/// rank-16 adapters' few FLOPs left out) plus causal attention's 6 x layers x hidden x
/// sequence (scores and the weighted sum, half the square), as in the PaLM paper's MFU.
fn flops_per_token(params: usize, layers: usize, hidden: usize, seq: usize, lora: bool) -> f64 {
    let per_param = if lora { 4.0 } else { 6.0 };
    per_param * params as f64 + 6.0 * (layers * hidden * seq) as f64
}

/// One configuration of the comparison: batch per step, gradient checkpointing, and LoRA
/// (TRL's recipe: r 16, alpha 32, dropout 0.05 on every linear layer; its peer is TRL + peft).
#[derive(Clone, Copy, PartialEq)]
struct Run {
    batch: usize,
    gc: bool,
    lora: bool,
}

/// `TRL_BENCH_GPU_RUNS`: comma-separated `BATCH:on|off[:lora]` (gradient checkpointing, LoRA);
/// default batch 2 with and without checkpointing, batch 8 without, and batch 8 with LoRA.
fn runs() -> Vec<Run> {
    let spec = std::env::var("TRL_BENCH_GPU_RUNS")
        .unwrap_or_else(|_| "2:off,2:on,8:off,8:off:lora".into());
    spec.split(',')
        .map(|r| {
            let mut parts = r.split(':').map(str::trim);
            let batch = parts
                .next()
                .unwrap_or_default()
                .parse()
                .expect("TRL_BENCH_GPU_RUNS: BATCH:on|off[:lora], ... (e.g. 2:off,8:on:lora)");
            Run {
                batch,
                gc: parts.next() == Some("on"),
                lora: parts.next() == Some("lora"),
            }
        })
        .collect()
}

impl Run {
    fn spec(&self) -> String {
        format!("{}:{}", self.batch, if self.gc { "on" } else { "off" })
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Prints the `"device":"cuda"` lines, or says on stderr why there are none.
pub fn run(dir: &Path) {
    // The launcher's way in: the context picks the GPU by itself (dist::device); the matmul
    // rate is measured on the same device (and stream) the trainer uses.
    let ctx = DistContext::from_env().unwrap();
    let Device::Cuda(cuda) = ctx.device().clone() else {
        eprintln!("no GPU selected (see dist::device): the cuda lines are skipped");
        return;
    };
    let dev = ctx.device().clone();
    let rate = matmul_rate(&dev);
    eprintln!("bf16 matmul: {:.1} TFLOP/s", rate / 1e12);
    let runs = runs();
    let most = runs.iter().map(|r| r.batch).max().unwrap_or(2);
    let model_dir = dir.join("qwen2-0.5b");
    let params = crate::support::write_model_and_rows(
        &model_dir,
        qwen2_05b_config(),
        most * (WARMUP_STEPS + MEASURED_STEPS),
        SEQ,
    );
    let per_token = |lora: bool| flops_per_token(params, 24, 896, SEQ, lora);
    let (warmup, measured) = if profiling() {
        (1, 1)
    } else {
        (WARMUP_STEPS, MEASURED_STEPS)
    };
    let mut ours = Vec::new();
    for &run in &runs {
        let config = SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                model_name_or_path: model_dir.join("model"),
                dataset_name: model_dir.join("train.jsonl"),
                output_dir: dir.join("out-gpu"),
                per_device_train_batch_size: run.batch,
                max_length: SEQ,
                learning_rate: 1e-5,
                bf16: true,
                disable_tqdm: true,
                max_steps: 1000,
                gradient_checkpointing: run.gc,
                use_peft: run.lora,
                lora_target_modules: Some(trl_runtime::config::cli_value::NameList(vec![
                    "all-linear".into(),
                ])),
                ..Default::default()
            },
            ..SFTConfig::default()
        };
        trl_runtime::alloc::gpu::reset_peak(&cuda).unwrap();
        let result = (|| -> trl_runtime::Result<(f64, f64, String)> {
            let mut trainer = Trainer::with_strategy(config, &ctx, Strategy::Ddp)?;
            let attention = format!("{:?}", trainer.model.attention).to_lowercase();
            for _ in 0..warmup {
                trainer.train_step()?;
            }
            dev.synchronize()?;
            let start = Instant::now();
            let mut tokens = 0;
            // Under `ncu --profile-from-start off` only the measured steps are profiled.
            let profiler = |start: bool| {
                use candle_core::cuda_backend::cudarc::driver::sys;
                if profiling() {
                    // SAFETY: plain driver calls on the current context; failure is ignored
                    // (without a profiler attached they do nothing).
                    let _ = unsafe {
                        if start {
                            sys::cuProfilerStart()
                        } else {
                            sys::cuProfilerStop()
                        }
                    };
                }
            };
            profiler(true);
            for _ in 0..measured {
                tokens += trainer.train_step()?.tokens;
            }
            dev.synchronize()?;
            profiler(false);
            let secs = start.elapsed().as_secs_f64();
            Ok((tokens as f64 / secs, secs / measured as f64, attention))
        })();
        let peak = gib(trl_runtime::alloc::gpu::peak_bytes(&cuda).unwrap_or(0));
        let gc = if run.gc { "on" } else { "off" };
        match result {
            Ok((tokens_per_s, step_s, attention)) => {
                let mfu = tokens_per_s * per_token(run.lora) / rate;
                println!(
                    "{{\"bench\":\"train\",\"device\":\"cuda\",\"model\":\"qwen2-0.5b-shape\",\"params\":{params},\"dtype\":\"bf16\",\"attention\":\"{attention}\",\"seq\":{SEQ},\"batch\":{},\"gradient_checkpointing\":\"{gc}\",\"lora\":{},\"tokens_per_s\":{tokens_per_s:.1},\"step_s\":{step_s:.4},\"mfu\":{mfu:.4},\"peak_gpu_mem_gib\":{peak:.2},\"matmul_tflops\":{:.1}}}",
                    run.batch,
                    run.lora,
                    rate / 1e12
                );
                ours.push((run, tokens_per_s, peak));
            }
            // Out of memory at a batch is a result too (the issue asks whether batch 8 fits).
            Err(e) => println!(
                "{{\"bench\":\"train\",\"device\":\"cuda\",\"batch\":{},\"gradient_checkpointing\":\"{gc}\",\"lora\":{},\"error\":{:?},\"peak_gpu_mem_gib\":{peak:.2}}}",
                run.batch,
                run.lora,
                e.to_string()
            ),
        }
    }
    // TRL_BENCH_GPU_PEERS=0: ours only (a short check of our numbers); a comma list
    // (transformers, trl, trl_liger, trl_lora) runs only those peers.
    let chosen = std::env::var("TRL_BENCH_GPU_PEERS").ok();
    if profiling() || chosen.as_deref() == Some("0") {
        return;
    }
    let wanted = |peer: &str| {
        chosen
            .as_deref()
            .is_none_or(|list| list.split(',').any(|p| p.trim() == peer))
    };
    // The same shapes through transformers, TRL and TRL + Liger on this GPU's torch, which
    // needs the memory our pool keeps.
    if let Err(e) = trl_runtime::alloc::gpu::release_freed_memory(&cuda) {
        eprintln!("cannot release GPU memory for the peers: {e}");
    }
    // The full fine-tuning runs against transformers, TRL and TRL + Liger; the LoRA runs
    // against TRL + peft.
    // Each group's lines are printed as soon as it ends (a later group may run out of time).
    for (lora, peers) in [(false, "transformers,trl,trl_liger"), (true, "trl_lora")] {
        let peers = peers
            .split(',')
            .filter(|p| wanted(p))
            .collect::<Vec<_>>()
            .join(",");
        let spec = runs
            .iter()
            .filter(|r| r.lora == lora)
            .map(Run::spec)
            .collect::<Vec<_>>()
            .join(",");
        if spec.is_empty() || peers.is_empty() {
            continue;
        }
        for line in peer_lines(&spec, &peers) {
            let (Some(name), Some(theirs), Some(batch), Some(gc)) = (
                line["framework"].as_str(),
                line["tokens_per_s"].as_f64(),
                line["batch"].as_u64(),
                line["gradient_checkpointing"].as_bool(),
            ) else {
                continue;
            };
            let their_peak = line["peak_gpu_mem_gib"].as_f64().unwrap_or(f64::NAN);
            let run = Run {
                batch: batch as usize,
                gc,
                lora,
            };
            let Some(&(_, mine, my_peak)) = ours.iter().find(|(r, _, _)| *r == run) else {
                continue;
            };
            let hf_mfu = theirs * per_token(lora) / rate;
            println!(
                "{{\"bench\":\"train\",\"device\":\"cuda\",\"peer\":\"{name}\",\"seq\":{SEQ},\"batch\":{batch},\"gradient_checkpointing\":\"{}\",\"lora\":{lora},\"peer_tokens_per_s\":{theirs:.1},\"peer_mfu\":{hf_mfu:.4},\"peer_peak_gpu_mem_gib\":{their_peak:.2},\"tokens_per_s\":{mine:.1},\"peak_gpu_mem_gib\":{my_peak:.2},\"ratio_ours_over_peer\":{:.3}}}",
                if gc { "on" } else { "off" },
                mine / theirs
            );
        }
    }
}

/// The JSON lines benches/hf_train.py prints for `spec` (BATCH:on|off, ...) and `peers` (lines
/// printed before a failure still count).
fn peer_lines(spec: &str, peers: &str) -> Vec<serde_json::Value> {
    let script = crate::support::repo().join("trl-runtime/benches/hf_train.py");
    let out =
        std::process::Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
            .arg(&script)
            .args(["--seq", &SEQ.to_string(), "--runs", spec, "--peers", peers])
            .args([
                "--steps",
                &MEASURED_STEPS.to_string(),
                "--warmup",
                &WARMUP_STEPS.to_string(),
            ])
            .stderr(std::process::Stdio::inherit())
            .output();
    match out {
        Ok(o) => {
            if !o.status.success() {
                eprintln!("{} failed ({})", script.display(), o.status);
            }
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .collect()
        }
        Err(e) => {
            eprintln!("cannot run {}: {e}", script.display());
            Vec::new()
        }
    }
}
