//! The single-GPU part of `bench train` (built with `--features cuda`): training throughput of
//! random-init models in bf16 at sequence length 2048 (Qwen2-0.5B's shape, a Qwen3-MoE shape
//! for the grouped expert GEMMs, and a Qwen3.5 shape for the gated delta rule's kernels), by SFT, LoRA, DPO or GRPO, its MFU against the bf16
//! matmul rate measured on the same GPU in the same run (not GRPO's: generation is most of its
//! step), the peak memory against what the planner (`parallel::estimate`, `cargo trl plan`)
//! predicted for it, and the same run by transformers, TRL, TRL + Liger, TRL + peft, TRL's
//! DPOTrainer or TRL's GRPOTrainer without vLLM (benches/hf_train.py, on the torch of the GPU
//! machine) for the ratio.

use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};
use std::time::Instant;
use trl_runtime::dist::DistContext;
use trl_runtime::models::AutoModelForCausalLM;
use trl_runtime::parallel::estimate::ModelShapes;
use trl_runtime::train::{
    DPOConfig, Dpo, GRPOConfig, Grpo, SFTConfig, Sft, Strategy, Task, Trainer,
};

pub const SEQ: usize = 2048;
/// GRPO at TRL's defaults: groups of 8 completions of at most 256 sampled tokens, after
/// prompts of about 128 tokens.
const GRPO_GENERATIONS: usize = 8;
const GRPO_COMPLETION: usize = 256;
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

/// Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of 128, experts of width 768, 8 routed per
/// token, normalized) with 8 layers of 32 experts, so that it fits one GPU with its optimizer
/// state beside TRL's: 1.7B parameters, 0.8B active per token. The router loss is on
/// (`output_router_logits`) for both sides.
pub fn qwen3_moe_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 8,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 32, "num_experts_per_tok": 8, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": true,
        "output_router_logits": true, "router_aux_loss_coef": 0.001,
    })
}

/// Which model a run trains.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Shape {
    /// Qwen2-0.5B's.
    Dense,
    /// The Qwen3-MoE shape (grouped expert GEMMs).
    Moe,
    /// The Qwen3.5 shape (the gated delta rule's kernels).
    Hybrid,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Dense => "qwen2-0.5b",
            Shape::Moe => "qwen3-moe",
            Shape::Hybrid => "qwen3.5",
        }
    }
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

/// Model FLOPs per trained token: the planner's count (`ModelShapes::matmul_flops_per_token`:
/// 6 per parameter a token runs through, a mixture of experts' routed ones only, the tied
/// head included, and causal attention's 6 x sequence x heads x head dim per layer, as in
/// the PaLM paper's MFU); under LoRA 4 per base parameter, its frozen weights getting no
/// gradient (the rank-16 adapters' few FLOPs left out). DPO's reference pass is not counted
/// (ours computes it before training).
fn flops_per_token(shapes: &ModelShapes, lora: bool) -> f64 {
    let step = shapes.matmul_flops_per_token(SEQ, false, 0);
    // At sequence length 0 only the parameters' 6 per token remain: a third of it is the
    // weight gradients LoRA's frozen base skips.
    let frozen = match lora {
        true => shapes.matmul_flops_per_token(0, false, 0) / 3.0,
        false => 0.0,
    };
    step - frozen
}

/// What a run trains: every weight (SFT), LoRA adapters (TRL's recipe: r 16, alpha 32,
/// dropout 0.05 on every linear layer; its peer is TRL + peft), DPO pairs (sigmoid, beta
/// 0.1; its peer TRL's DPOTrainer, with and without precomputed reference log-probs) or GRPO
/// (TRL's defaults: beta 0, one round per step, sampled at temperature 1; the soft overlong
/// punishment as the reward; its peer TRL's GRPOTrainer generating with transformers'
/// `generate`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Sft,
    Lora,
    Dpo,
    Grpo,
}

/// One configuration of the comparison: sequences per step (a DPO step's pairs are half as
/// many), gradient checkpointing, what is trained, and of which model.
#[derive(Clone, Copy, PartialEq)]
struct Run {
    batch: usize,
    gc: bool,
    kind: Kind,
    model: Shape,
}

/// `TRL_BENCH_GPU_RUNS`: comma-separated `BATCH:on|off[:lora|:dpo|:grpo][:moe|:hybrid]`
/// (gradient checkpointing; LoRA, DPO or GRPO instead of SFT, GRPO's batch counting
/// completions per step; the mixture-of-experts or the Qwen3.5 model instead of the dense
/// one); default batch 2 with and
/// without checkpointing, batch 8 without, and batch 8 with LoRA.
fn runs() -> Vec<Run> {
    let spec = std::env::var("TRL_BENCH_GPU_RUNS")
        .unwrap_or_else(|_| "2:off,2:on,8:off,8:off:lora".into());
    let usage =
        "TRL_BENCH_GPU_RUNS: BATCH:on|off[:lora|:dpo|:grpo][:moe|:hybrid], ... (e.g. 2:off,8:on:dpo:moe)";
    spec.split(',')
        .map(|r| {
            let mut parts = r.split(':').map(str::trim);
            let batch: usize = parts.next().unwrap_or_default().parse().expect(usage);
            let mut run = Run {
                batch,
                gc: parts.next() == Some("on"),
                kind: Kind::Sft,
                model: Shape::Dense,
            };
            for flag in parts {
                match flag {
                    "lora" => run.kind = Kind::Lora,
                    "dpo" => run.kind = Kind::Dpo,
                    "grpo" => run.kind = Kind::Grpo,
                    "moe" => run.model = Shape::Moe,
                    "hybrid" => run.model = Shape::Hybrid,
                    other => panic!("{usage}: unknown flag {other:?} in {r:?}"),
                }
            }
            assert!(
                run.kind != Kind::Dpo || run.batch.is_multiple_of(2),
                "{usage}: a DPO batch is pairs, even"
            );
            assert!(
                run.kind != Kind::Grpo || run.batch.is_multiple_of(GRPO_GENERATIONS),
                "{usage}: a GRPO batch is groups of {GRPO_GENERATIONS} completions"
            );
            run
        })
        .collect()
}

impl Run {
    /// Rows of one micro-batch as the trainers count them: DPO's are pairs.
    fn rows(&self) -> usize {
        match self.kind {
            Kind::Dpo => self.batch / 2,
            _ => self.batch,
        }
    }

    /// hf_train.py's `--runs` entry.
    fn spec(&self) -> String {
        format!("{}:{}", self.rows(), if self.gc { "on" } else { "off" })
    }

    /// hf_train.py's peers for this kind of run.
    fn peers(&self) -> &'static str {
        match self.kind {
            Kind::Sft => "transformers,trl,trl_liger",
            Kind::Lora => "trl_lora",
            Kind::Dpo => "trl_dpo,trl_dpo_precompute",
            Kind::Grpo => "trl_grpo",
        }
    }

    fn label(&self) -> String {
        let kind = match self.kind {
            Kind::Sft => "sft",
            Kind::Lora => "lora",
            Kind::Dpo => "dpo",
            Kind::Grpo => "grpo",
        };
        let model = format!("{}-shape", self.model.name());
        let grpo = match self.kind {
            Kind::Grpo => format!(
                ",\"num_generations\":{GRPO_GENERATIONS},\"max_completion_length\":{GRPO_COMPLETION}"
            ),
            _ => String::new(),
        };
        format!(
            "\"model\":\"{model}\",\"task\":\"{kind}\",\"seq\":{SEQ},\"batch\":{},\"gradient_checkpointing\":\"{}\",\"lora\":{}{grpo}",
            self.batch,
            if self.gc { "on" } else { "off" },
            self.kind == Kind::Lora
        )
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// A model written for the bench: its folder, shapes and parameter count.
struct BenchModel {
    dir: PathBuf,
    shapes: ModelShapes,
    params: usize,
}

/// One of ours: tokens/s, seconds a step, the attention implementation, and the peak the
/// planner predicted (GiB).
struct Measured {
    tokens_per_s: f64,
    step_s: f64,
    attention: String,
    predicted_peak: Option<f64>,
}

/// Times `trainer`'s steps (under `ncu --profile-from-start off` only the measured ones are
/// profiled).
fn measure<T: Task<AutoModelForCausalLM>>(
    mut trainer: Trainer<'_, AutoModelForCausalLM, T>,
    dev: &Device,
) -> trl_runtime::Result<Measured> {
    let (warmup, measured) = if profiling() {
        (1, 1)
    } else {
        (WARMUP_STEPS, MEASURED_STEPS)
    };
    let attention = format!("{:?}", trainer.model.attention).to_lowercase();
    let predicted_peak = trainer.memory_estimate().map(|e| gib(e.peak() as u64));
    for _ in 0..warmup {
        trainer.train_step()?;
    }
    dev.synchronize()?;
    let start = Instant::now();
    let mut tokens = 0;
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
    Ok(Measured {
        tokens_per_s: tokens as f64 / secs,
        step_s: secs / measured as f64,
        attention,
        predicted_peak,
    })
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
    // Each model its runs ask for, once, with rows for its largest batch (and text pairs
    // when a run trains DPO on it).
    let steps = WARMUP_STEPS + MEASURED_STEPS;
    let write = |shape: Shape, config: serde_json::Value| -> Option<BenchModel> {
        let name = shape.name();
        let most = runs
            .iter()
            .filter(|r| r.model == shape)
            .map(|r| r.batch)
            .max()?;
        let dir = dir.join(name);
        let shapes = ModelShapes::of_json(&config.to_string(), name).unwrap();
        let params = crate::support::write_model_and_rows(&dir, config, most * steps, SEQ);
        if runs.iter().any(|r| r.model == shape && r.kind == Kind::Dpo) {
            // A prompt of ~512 tokens and completions of ~1536: each sequence about SEQ.
            crate::support::write_pref_rows(&dir.join("pref.jsonl"), most / 2 * steps, 132, 400);
        }
        if runs
            .iter()
            .any(|r| r.model == shape && r.kind == Kind::Grpo)
        {
            // Prompts of ~128 tokens, one per group of completions (TRL's steps included).
            let prompts = most / GRPO_GENERATIONS * (steps + 2);
            crate::support::write_pref_rows(&dir.join("prompts.jsonl"), prompts, 33, 1);
        }
        Some(BenchModel {
            dir,
            shapes,
            params,
        })
    };
    let models = [
        (Shape::Dense, write(Shape::Dense, qwen2_05b_config())),
        (Shape::Moe, write(Shape::Moe, qwen3_moe_config())),
        // Of about Qwen2-0.5B's size.
        (
            Shape::Hybrid,
            write(
                Shape::Hybrid,
                crate::support::qwen3_5_hybrid(24, 1024, 3584, 151936, 256),
            ),
        ),
    ];
    let model_of = |run: &Run| {
        models
            .iter()
            .find(|(shape, _)| *shape == run.model)
            .and_then(|(_, m)| m.as_ref())
            .expect("written for its runs")
    };
    let mut ours = Vec::new();
    for &run in &runs {
        let model = model_of(&run);
        let dpo = run.kind == Kind::Dpo;
        let training = trl_runtime::train::TrainingArguments {
            model_name_or_path: model.dir.join("model"),
            dataset_name: model
                .dir
                .join(if dpo { "pref.jsonl" } else { "train.jsonl" }),
            output_dir: dir.join("out-gpu"),
            per_device_train_batch_size: run.rows(),
            // A DPO row is a prompt and a completion (both as TRL's peer is set).
            max_length: if dpo { 2 * SEQ } else { SEQ },
            learning_rate: 1e-5,
            bf16: true,
            disable_tqdm: true,
            max_steps: 1000,
            gradient_checkpointing: run.gc,
            use_peft: run.kind == Kind::Lora,
            lora_target_modules: Some(trl_runtime::config::cli_value::NameList(vec![
                "all-linear".into()
            ])),
            ..Default::default()
        };
        trl_runtime::alloc::gpu::reset_peak(&cuda).unwrap();
        let result = if dpo {
            let config = DPOConfig {
                training,
                ..DPOConfig::default()
            };
            Trainer::<AutoModelForCausalLM, Dpo>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .and_then(|t| measure(t, &dev))
        } else if run.kind == Kind::Grpo {
            let config = GRPOConfig {
                training: trl_runtime::train::TrainingArguments {
                    dataset_name: model.dir.join("prompts.jsonl"),
                    learning_rate: 1e-6,
                    ..training
                },
                num_generations: GRPO_GENERATIONS,
                max_completion_length: GRPO_COMPLETION,
                reward_funcs: trl_runtime::config::cli_value::EntryList(vec![format!(
                    "get_soft_overlong_punishment({GRPO_COMPLETION}, {})",
                    GRPO_COMPLETION / 4
                )]),
                ..GRPOConfig::default()
            };
            Trainer::<AutoModelForCausalLM, Grpo>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .and_then(|t| measure(t, &dev))
        } else {
            let config = SFTConfig {
                training,
                ..SFTConfig::default()
            };
            Trainer::<AutoModelForCausalLM, Sft>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .and_then(|t| measure(t, &dev))
        };
        let peak = gib(trl_runtime::alloc::gpu::peak_bytes(&cuda).unwrap_or(0));
        let label = run.label();
        match result {
            Ok(m) => {
                let lora = run.kind == Kind::Lora;
                // GRPO's step is mostly generation: no training MFU for it.
                let mfu = match run.kind {
                    Kind::Grpo => "null".to_string(),
                    _ => format!(
                        "{:.4}",
                        m.tokens_per_s * flops_per_token(&model.shapes, lora) / rate
                    ),
                };
                // The planner's prediction leaves the process's own memory out, as the pool's
                // high-water mark does.
                let predicted = m.predicted_peak.map_or(String::new(), |p| {
                    format!(
                        ",\"predicted_peak_gpu_mem_gib\":{p:.2},\"predicted_over_measured_peak\":{:.3}",
                        p / peak
                    )
                });
                println!(
                    "{{\"bench\":\"train\",\"device\":\"cuda\",{label},\"params\":{},\"dtype\":\"bf16\",\"attention\":\"{}\",\"tokens_per_s\":{:.1},\"step_s\":{:.4},\"mfu\":{mfu},\"peak_gpu_mem_gib\":{peak:.2}{predicted},\"matmul_tflops\":{:.1}}}",
                    model.params,
                    m.attention,
                    m.tokens_per_s,
                    m.step_s,
                    rate / 1e12
                );
                ours.push((run, m.tokens_per_s, peak));
            }
            // Out of memory at a batch is a result too (the issue asks whether batch 8 fits).
            Err(e) => println!(
                "{{\"bench\":\"train\",\"device\":\"cuda\",{label},\"error\":{:?},\"peak_gpu_mem_gib\":{peak:.2}}}",
                e.to_string()
            ),
        }
    }
    // TRL_BENCH_GPU_PEERS=0: ours only (a short check of our numbers); a comma list of
    // hf_train.py's peer names runs only those.
    let chosen = std::env::var("TRL_BENCH_GPU_PEERS").ok();
    if profiling() || chosen.as_deref() == Some("0") {
        return;
    }
    let wanted = |peer: &str| {
        chosen
            .as_deref()
            .is_none_or(|list| list.split(',').any(|p| p.trim() == peer))
    };
    // The same runs through the peers on this GPU's torch, which needs the memory our pool
    // keeps: one hf_train.py call per kind of run and model, whose lines are printed as soon
    // as it ends (a later one may run out of time).
    if let Err(e) = trl_runtime::alloc::gpu::release_freed_memory(&cuda) {
        eprintln!("cannot release GPU memory for the peers: {e}");
    }
    let mut groups: Vec<(Kind, Shape)> = Vec::new();
    for r in &runs {
        if !groups.contains(&(r.kind, r.model)) {
            groups.push((r.kind, r.model));
        }
    }
    for (kind, shape) in groups {
        let group: Vec<&Run> = runs
            .iter()
            .filter(|r| r.kind == kind && r.model == shape)
            .collect();
        let peers = group[0]
            .peers()
            .split(',')
            .filter(|p| wanted(p))
            .collect::<Vec<_>>()
            .join(",");
        if peers.is_empty() {
            continue;
        }
        let spec = group.iter().map(|r| r.spec()).collect::<Vec<_>>().join(",");
        let model = model_of(group[0]);
        let mut extra = vec!["--model_dir".into(), model.dir.join("model")];
        if kind == Kind::Dpo {
            extra.extend(["--pref_data".into(), model.dir.join("pref.jsonl")]);
        }
        if kind == Kind::Grpo {
            extra.extend(["--prompt_data".into(), model.dir.join("prompts.jsonl")]);
            extra.extend([
                "--completion_length".into(),
                GRPO_COMPLETION.to_string().into(),
            ]);
            extra.extend([
                "--num_generations".into(),
                GRPO_GENERATIONS.to_string().into(),
            ]);
        }
        for line in peer_lines(&spec, &peers, &extra) {
            let (Some(name), Some(theirs), Some(rows), Some(gc)) = (
                line["framework"].as_str(),
                line["tokens_per_s"].as_f64(),
                line["batch"].as_u64(),
                line["gradient_checkpointing"].as_bool(),
            ) else {
                continue;
            };
            let their_peak = line["peak_gpu_mem_gib"].as_f64().unwrap_or(f64::NAN);
            let Some(&(run, mine, my_peak)) = ours.iter().find(|(r, _, _)| {
                r.kind == kind && r.model == shape && r.rows() == rows as usize && r.gc == gc
            }) else {
                continue;
            };
            let lora = kind == Kind::Lora;
            let hf_mfu = match kind {
                Kind::Grpo => "null".to_string(),
                _ => format!(
                    "{:.4}",
                    theirs * flops_per_token(&model.shapes, lora) / rate
                ),
            };
            // TRL's share of its GRPO step spent in `generate`.
            let share = line["generation_share"]
                .as_f64()
                .map_or(String::new(), |g| {
                    format!(",\"peer_generation_share\":{g:.3}")
                });
            println!(
                "{{\"bench\":\"train\",\"device\":\"cuda\",\"peer\":\"{name}\",{}{share},\"peer_tokens_per_s\":{theirs:.1},\"peer_mfu\":{hf_mfu},\"peer_peak_gpu_mem_gib\":{their_peak:.2},\"tokens_per_s\":{mine:.1},\"peak_gpu_mem_gib\":{my_peak:.2},\"ratio_ours_over_peer\":{:.3}}}",
                run.label(),
                mine / theirs
            );
        }
    }
}

/// The JSON lines benches/hf_train.py prints for `spec` (BATCH:on|off, ...), `peers` and
/// `extra` arguments (lines printed before a failure still count).
fn peer_lines(spec: &str, peers: &str, extra: &[PathBuf]) -> Vec<serde_json::Value> {
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
            .args(extra)
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
