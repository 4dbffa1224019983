//! `cargo bench -p trl-runtime --bench train`: DDP training throughput of the reference shape
//! (Qwen2 hidden 256, intermediate 768, 4 layers, 8/4 heads, vocab 4096, seq 512, batch 4 per
//! process, fp32, 1 compute thread per process) on 1 and 2 processes of the host backend, the
//! scaling ratio between them, ZeRO-3 (per-layer units) on 2 processes against DDP on 2 in the
//! same run and against itself without prefetching, tensor parallelism (tp = 2 on 2 processes:
//! every layer split, the same global batch as DDP on 1) against DDP on 1 and 2, and the time
//! from launching a process to its first finished step with the bundled tiny model. When
//! `python3` (or $PYTHON) imports torch, transformers (and TRL) train the same shape on one CPU
//! thread in the same run (hf_train.py --device cpu) and the ratio to ours is printed; GRPO
//! (generation + rewards + update) against TRL's GRPOTrainer likewise, with the share of
//! each step spent generating (`TRL_BENCH_ONLY=grpo` runs the GRPO lines alone). A
//! Qwen3-MoE step (the reference's attention, 16 experts of intermediate 384, 2 per token) on 2
//! ranks with expert parallelism (ep 2) against the same ranks without it, under DDP and
//! ZeRO-3: tokens/s and each rank's model-state bytes (`TRL_BENCH_ONLY=moe` runs those alone).
//! `comm_share` is the time a rank spent inside collectives (tensor-parallel and data-parallel
//! groups) over the step time; collectives queued in the background (DDP buckets, ZeRO-3
//! gathers) partly overlap compute, so for those it is an upper bound of the exposed share.
//! Built with `--features cuda` on a machine with a GPU it first prints `"device":"cuda"`
//! lines: a Qwen2-0.5B-shaped model trained in bf16 at sequence 2048 on one GPU, tokens/s and
//! MFU against the bf16 matmul rate measured in the same run, and the ratio to transformers
//! on the same GPU and shape (support/gpu.rs, hf_train.py).
//! The DDP, LoRA, tp and ZeRO-3 runs are made three times, each between two timings of this
//! CPU's step speed, and their lines carry the median tokens/s, `predicted_tokens_per_s` (what
//! `cargo trl plan` predicts from those timings, the median) and `predicted_over_measured`
//! (the median of the three runs' ratios, each run's in `predicted_over_measured_runs`).
//! One JSON object per line on stdout; prose on stderr.

use std::path::Path;
use std::time::Instant;

#[cfg(feature = "cuda")]
#[path = "support/gpu.rs"]
mod gpu;
mod support;
use trl_runtime::config::cli_value::EntryList;
use trl_runtime::config::cli_value::NameList;
use trl_runtime::config::launch::DistributedType;
use trl_runtime::config::parallelism::ParallelismConfig;
use trl_runtime::config::LaunchPlan;
use trl_runtime::dist::mesh::{Axis, DP};
use trl_runtime::dist::DistContext;
use trl_runtime::models::{AutoModelForCausalLM, CausalModel};
use trl_runtime::parallel::estimate;
use trl_runtime::parallel::{Prefetch, WrapPolicy};
use trl_runtime::train::{
    DPOConfig, Distillation, DistillationConfig, Dpo, GRPOConfig, Grpo, KTOConfig, Kto, RLOOConfig,
    Reward, RewardConfig, RewardModel, Rloo, SFTConfig, Strategy, Task, Trainer, TrainingArguments,
};

const SEQ: usize = 512;
const BATCH: usize = 4;
const MEASURED_STEPS: usize = 5;
/// DPO pairs per micro-batch: their chosen and rejected sequences make BATCH sequences.
const DPO_PAIRS: usize = BATCH / 2;
/// Enough pairs for TRL's warm-up and measured steps on 2 ranks.
const PREF_ROWS: usize = 32;
/// GRPO: completions per rank and step (groups of GRPO_GENERATIONS), each of GRPO_COMPLETION
/// sampled tokens after a prompt of ~64, one round per step; enough prompts for TRL's warm-up
/// and measured steps on 2 ranks.
const GRPO_BATCH: usize = 8;
const GRPO_GENERATIONS: usize = 4;
const GRPO_COMPLETION: usize = 64;
const GRPO_PROMPTS: usize = 64;

/// The reference model and a pre-tokenized dataset of full-length rows, written once.
fn prepare(dir: &Path) {
    let config = support::reference_config(4096);
    support::write_model_and_rows(dir, config, 64, SEQ);
    // Text pairs for DPO: a prompt of ~128 tokens and completions of ~384 (each sequence
    // about SEQ).
    support::write_pref_rows(&dir.join("pref.jsonl"), PREF_ROWS, 33, 100);
    // Text prompts of ~64 tokens for GRPO (the pairs' prompts, shorter).
    support::write_pref_rows(&dir.join("prompts.jsonl"), GRPO_PROMPTS, 16, 1);
}

/// The MoE shape of the expert-parallel lines: the reference's attention, 16 experts of
/// intermediate 384, 2 per token.
fn moe_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 768, "moe_intermediate_size": 384, "num_experts": 16,
        "num_experts_per_tok": 2, "norm_topk_prob": true,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "max_position_embeddings": SEQ, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "router_aux_loss_coef": 0.001,
    })
}

/// Writes `dir/moe` (random weights of [`moe_config`], the tiny tokenizer).
fn prepare_moe(dir: &Path) {
    let model = dir.join("moe");
    support::write_random_model(&moe_config(), &model);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            support::repo().join("assets/tiny/model").join(f),
            model.join(f),
        )
        .unwrap();
    }
}

fn worker(kind: &str, dir: &Path) {
    let zero3 = kind.starts_with("ref-zero3") || kind.starts_with("moe-zero3");
    // ZeRO-3 shards over dp_shard, which the DeepSpeed type fills from the world size.
    let dist = if zero3 {
        DistributedType::DeepSpeed
    } else {
        DistributedType::MultiCpu
    };
    let parallelism = ParallelismConfig {
        tp: if kind == "ref-tp" { 2 } else { 1 },
        ep: if kind.ends_with("-ep") { 2 } else { 1 },
        ..ParallelismConfig::default()
    };
    let ctx = DistContext::with_plan(LaunchPlan {
        distributed_type: dist,
        parallelism,
        ..LaunchPlan::default()
    })
    .unwrap();
    trl_runtime::train::logging::init(ctx.rank());
    let common = TrainingArguments {
        output_dir: dir.join(format!("out-{kind}")),
        disable_tqdm: true,
        max_steps: 1000,
        gradient_checkpointing: false,
        ..Default::default()
    };
    let training = match kind {
        _ if kind.starts_with("moe-") => TrainingArguments {
            model_name_or_path: dir.join("moe"),
            dataset_name: dir.join("train.jsonl"),
            per_device_train_batch_size: BATCH,
            max_length: SEQ,
            learning_rate: 1e-4,
            ..common
        },
        "tiny" => TrainingArguments {
            model_name_or_path: support::repo().join("assets/tiny/model"),
            dataset_name: support::repo().join("assets/tiny/data/train.jsonl"),
            max_length: 64,
            ..common
        },
        // Preference pairs of text (prompt ~128 tokens, completions ~384), as TRL reads them.
        "ref-dpo" | "ref-kto" | "ref-reward" => TrainingArguments {
            model_name_or_path: dir.join("model"),
            dataset_name: dir.join("pref.jsonl"),
            // A DPO row is two sequences, a KTO row one.
            per_device_train_batch_size: if kind == "ref-kto" { BATCH } else { DPO_PAIRS },
            max_length: 2 * SEQ,
            learning_rate: 1e-4,
            ..common
        },
        _ => TrainingArguments {
            model_name_or_path: dir.join("model"),
            dataset_name: dir.join("train.jsonl"),
            per_device_train_batch_size: BATCH,
            max_length: SEQ,
            learning_rate: 1e-4,
            // TRL's LoRA recipe: r 16 on every linear layer (peft's defaults otherwise).
            use_peft: kind == "ref-lora",
            lora_target_modules: Some(NameList(vec!["all-linear".into()])),
            ..common
        },
    };
    if kind == "ref-kto" {
        // TRL's KTOConfig samples in order (each row's mismatched pair is its neighbour's).
        let config = KTOConfig {
            training: TrainingArguments {
                train_sampling_strategy: "sequential".into(),
                ..training
            },
            ..KTOConfig::default()
        };
        let trainer =
            Trainer::<AutoModelForCausalLM, Kto>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .unwrap();
        return measure_steps(trainer, &ctx, MEASURED_STEPS, &|_| 0.0);
    }
    if kind == "ref-reward" {
        let config = RewardConfig {
            training,
            ..RewardConfig::default()
        };
        let trainer =
            Trainer::<RewardModel, Reward>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .unwrap();
        return measure_steps(trainer, &ctx, MEASURED_STEPS, &|_| 0.0);
    }
    if kind == "ref-dpo" {
        let config = DPOConfig {
            training,
            ..DPOConfig::default()
        };
        let trainer =
            Trainer::<AutoModelForCausalLM, Dpo>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .unwrap();
        return measure_steps(trainer, &ctx, MEASURED_STEPS, &|_| 0.0);
    }
    let online = TrainingArguments {
        dataset_name: dir.join("prompts.jsonl"),
        per_device_train_batch_size: GRPO_BATCH,
        learning_rate: 1e-6,
        ..training.clone()
    };
    let overlong = EntryList(vec![format!(
        "get_soft_overlong_punishment({GRPO_COMPLETION}, {})",
        GRPO_COMPLETION / 4
    )]);
    if kind == "ref-rloo" {
        // TRL's RLOO defaults (beta 0.05: a reference), GRPO's rounds and reward.
        let config = RLOOConfig {
            training: online,
            num_generations: GRPO_GENERATIONS,
            max_completion_length: GRPO_COMPLETION,
            reward_funcs: overlong,
            ..RLOOConfig::default()
        };
        let trainer =
            Trainer::<AutoModelForCausalLM, Rloo>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .unwrap();
        return measure_steps(trainer, &ctx, MEASURED_STEPS, &|r: &Rloo| {
            r.generation_seconds()
        });
    }
    if kind == "ref-distillation" {
        // TRL's defaults (reverse KL, temperature 1, a round per step), the teacher of the
        // student's shape (its weights: timing does not depend on them).
        let config = DistillationConfig {
            training: online,
            teacher_model_name_or_path: Some(dir.join("model")),
            max_completion_length: GRPO_COMPLETION,
            ..DistillationConfig::default()
        };
        let trainer = Trainer::<AutoModelForCausalLM, Distillation>::load_with_strategy(
            config,
            &ctx,
            Strategy::Ddp,
        )
        .unwrap();
        return measure_steps(trainer, &ctx, MEASURED_STEPS, &|d: &Distillation| {
            d.generation_seconds()
        });
    }
    if kind == "ref-grpo" {
        // TRL's defaults (beta 0, dapo, one iteration, a round per step), sampled at
        // temperature 1, the soft overlong punishment as the reward.
        let config = GRPOConfig {
            training: online,
            num_generations: GRPO_GENERATIONS,
            max_completion_length: GRPO_COMPLETION,
            reward_funcs: overlong,
            ..GRPOConfig::default()
        };
        let trainer =
            Trainer::<AutoModelForCausalLM, Grpo>::load_with_strategy(config, &ctx, Strategy::Ddp)
                .unwrap();
        return measure_steps(trainer, &ctx, MEASURED_STEPS, &|g: &Grpo| {
            g.generation_seconds()
        });
    }
    let config = SFTConfig {
        training,
        ..SFTConfig::default()
    };
    let strategy = match kind {
        "ref-zero3" | "moe-zero3" | "moe-zero3-ep" => Strategy::fsdp(WrapPolicy::PerLayer),
        "ref-zero3-no-prefetch" => Strategy::Fsdp(WrapPolicy::PerLayer, Prefetch::NONE),
        _ => Strategy::Ddp,
    };
    let trainer = Trainer::with_strategy(config, &ctx, strategy).unwrap();
    measure_steps(
        trainer,
        &ctx,
        if kind == "tiny" { 0 } else { MEASURED_STEPS },
        &|_| 0.0,
    );
}

/// One step (warm-up; reported as `first_step_done`), then `timed` steps measured; `part`
/// counts the seconds the task spent in one part of its steps (GRPO's generation), reported
/// as a share of the timed steps.
fn measure_steps<N: CausalModel, T: Task<N>>(
    mut trainer: Trainer<'_, N, T>,
    ctx: &DistContext,
    timed: usize,
    part: &dyn Fn(&T) -> f64,
) {
    trainer.train_step().unwrap();
    if ctx.is_main_process() {
        println!("first_step_done");
    }
    if timed == 0 {
        return;
    }
    // Every group a strategy talks over (each communicator is timed on its own).
    let comm = || {
        [&[Axis::Tp][..], DP, &[Axis::DpShard], &[Axis::DpReplicate]]
            .iter()
            .map(|axes| ctx.comm_seconds(axes))
            .sum::<f64>()
            + ctx.ep_comm_seconds()
    };
    let (start, comm_start, part_start) = (Instant::now(), comm(), part(&trainer.task));
    let mut tokens = 0;
    for _ in 0..timed {
        tokens += trainer.train_step().unwrap().tokens;
    }
    let secs = start.elapsed().as_secs_f64();
    // Every rank's model state (weights, gradients, optimizer), the largest reported.
    let state = trainer.core.memory().total() as f64;
    let t = trl_runtime::candle_core::Tensor::new(&[state], &trl_runtime::candle_core::Device::Cpu)
        .unwrap();
    let most = ctx
        .world()
        .all_reduce(&t, trl_runtime::comm::ReduceOp::Max)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()[0];
    if ctx.is_main_process() {
        println!(
            "measured {} {} {} {} {}",
            secs / timed as f64,
            tokens as f64 / secs,
            (comm() - comm_start) / secs,
            (part(&trainer.task) - part_start) / secs,
            most
        );
    }
}

/// What the main rank measured: seconds per step, tokens per second, communication share,
/// and the share of one part of the step (GRPO's generation; 0 for the others).
struct Measured {
    step_s: f64,
    tokens_per_s: f64,
    comm_share: f64,
    part_share: f64,
    /// The largest model state (bytes) a rank held.
    state_bytes: f64,
}

/// Runs `world` ranks as `kind` workers; returns launch-to-first-step seconds and the
/// measurement.
fn launch(kind: &str, world: usize, dir: &Path) -> (f64, Option<Measured>) {
    let mut first = f64::NAN;
    let mut measured = None;
    support::run_ranks(kind, world, dir, |line, elapsed| {
        if line == "first_step_done" {
            first = elapsed;
        } else if let Some(rest) = line.strip_prefix("measured ") {
            let v: Vec<f64> = rest.split(' ').map(|x| x.parse().unwrap()).collect();
            measured = Some(Measured {
                step_s: v[0],
                tokens_per_s: v[1],
                comm_share: v[2],
                part_share: v[3],
                state_bytes: v[4],
            });
        }
    });
    (first, measured)
}

fn measure(kind: &str, world: usize, dir: &Path) -> Measured {
    launch(kind, world, dir)
        .1
        .unwrap_or_else(|| panic!("{kind} on {world}: the worker reported no measurement"))
}

/// Runs measured with the plan's prediction beside each.
struct Predicted {
    /// The run of median tokens/s.
    measured: Measured,
    /// The median of the runs' predicted tokens/s.
    predicted: f64,
    /// Each run's predicted over measured tokens/s.
    ratios: Vec<f64>,
}

/// Runs behind each line that compares strategies: this VM's speed moves by a fifth within
/// seconds and by more over a minute, which one run's figure carries and a median of three
/// much less.
const RUNS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The run of median tokens/s.
fn median_run(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    runs.swap_remove(runs.len() / 2)
}

/// [`measure`] [`RUNS`] times, each run between two timings of the step speed the plan
/// predicts it from (`cargo trl plan`'s probe, every rank of the run busy, one thread each; a
/// timing serves the runs on both sides of it) and predicted by `predict` from their mean.
fn measure_predicted(
    kind: &str,
    world: usize,
    dir: &Path,
    predict: &dyn Fn(estimate::CpuStepRates) -> f64,
) -> Predicted {
    let mut before = estimate::cpu_step_rates(world, 1);
    let (mut runs, mut predicted) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let m = measure(kind, world, dir);
        let after = estimate::cpu_step_rates(world, 1);
        let rates = estimate::CpuStepRates::mean(&[before, after]);
        eprintln!(
            "train bench: {kind} on {world} rank(s), {:.1} tokens/s, predicted from {:.1} GFLOP/s, matmul share {:.3}, LoRA {:.2} ns per token and feature",
            m.tokens_per_s,
            rates.rank_flops / 1e9,
            rates.matmul_share,
            rates.adapter_element_seconds * 1e9
        );
        predicted.push(predict(rates));
        runs.push(m);
        before = after;
    }
    let ratios = runs
        .iter()
        .zip(&predicted)
        .map(|(m, p)| p / m.tokens_per_s)
        .collect();
    Predicted {
        measured: median_run(runs),
        predicted: median(predicted),
        ratios,
    }
}

/// transformers' and TRL's tokens/s on this CPU at the reference shape, fp32, one thread per
/// process, without gradient checkpointing (benches/hf_train.py; nothing when torch is
/// missing): `peers` (hf_train.py's names) at `batch` rows per process, with `extra`
/// arguments. On `world` > 1 processes only TRL runs, as DDP over gloo under torchrun.
fn cpu_peers(world: usize, peers: &str, batch: usize, extra: &[&str]) -> Vec<serde_json::Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/hf_train.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let mut command = std::process::Command::new(&python);
    if world > 1 {
        command
            .args(["-m", "torch.distributed.run", "--standalone"])
            .arg(format!("--nproc_per_node={world}"));
    }
    let out = command
        .arg(&script)
        .args([
            "--device",
            "cpu",
            "--shape",
            "ref",
            "--dtype",
            "fp32",
            "--threads",
            "1",
        ])
        .args(["--seq", &SEQ.to_string(), "--batch", &batch.to_string()])
        .args(["--steps", &MEASURED_STEPS.to_string(), "--warmup", "2"])
        .args(["--peers", peers])
        .args(extra)
        .output();
    match out {
        Ok(o) => {
            // A peer that failed or was skipped says so; the others still report.
            for l in String::from_utf8_lossy(&o.stderr).lines() {
                if l.contains(" failed:") || l.contains(" skipped: ") {
                    eprintln!("CPU peer: {l}");
                }
            }
            if !o.status.success() {
                eprintln!(
                    "no CPU peers ({python} {}): {}",
                    script.display(),
                    String::from_utf8_lossy(&o.stderr)
                        .lines()
                        .last()
                        .unwrap_or("")
                );
            }
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect()
        }
        Err(e) => {
            eprintln!("no CPU peers: cannot run {python}: {e}");
            Vec::new()
        }
    }
}

/// One line per peer: its tokens/s beside ours (`ours`) for the same `task` on `world` ranks.
fn peer_lines(task: &str, world: usize, ours: f64, peers: &[serde_json::Value]) {
    for peer in peers {
        let (name, theirs) = (
            &peer["framework"],
            peer["tokens_per_s"].as_f64().unwrap_or(0.0),
        );
        println!(
            "{{\"bench\":\"train\",\"device\":\"cpu\",\"task\":\"{task}\",\"peer\":{name},\"world\":{world},\"peer_tokens_per_s\":{theirs:.1},\"tokens_per_s\":{ours:.1},\"ratio_ours_over_peer\":{:.3},\"gradient_checkpointing\":false}}",
            ours / theirs
        );
    }
}

/// KTO (kto loss, beta 0.1, the pairs unpaired) against TRL's KTOTrainer with its reference
/// model and with the reference precomputed, on 1 and 2 ranks.
fn kto_lines(dir: &Path) {
    let peers = "trl_kto,trl_kto_precompute";
    preference_lines(dir, ("ref-kto", "ddp_kto", "kto"), peers, BATCH);
}

/// The reward trainer (pairs of text, the model read as a classifier) against TRL's
/// RewardTrainer, on 1 and 2 ranks.
fn reward_lines(dir: &Path) {
    preference_lines(
        dir,
        ("ref-reward", "ddp_reward", "reward"),
        "trl_reward",
        DPO_PAIRS,
    );
}

/// A trainer on the preference pairs (its run `kind`, logged as `strategy`, and as `task`
/// beside its TRL `peers`, `batch` rows per process), on 1 and 2 ranks.
fn preference_lines(
    dir: &Path,
    (kind, strategy, task): (&str, &str, &str),
    peers: &str,
    batch: usize,
) {
    let pref = dir.join("pref.jsonl");
    for world in [1, 2] {
        let m = measure(kind, world, dir);
        println!(
            "{{\"bench\":\"train\",\"device\":\"cpu\",\"strategy\":\"{strategy}\",\"world\":{world},\"tokens_per_s\":{:.1},\"step_s\":{:.4},\"comm_share\":{:.3}}}",
            m.tokens_per_s, m.step_s, m.comm_share
        );
        let extra = ["--pref_data", pref.to_str().unwrap()];
        let peers = cpu_peers(world, peers, batch, &extra);
        peer_lines(task, world, m.tokens_per_s, &peers);
    }
}

/// GRPO, RLOO and distillation (generation + rewards or the teacher + update, one round per
/// step) against TRL's GRPOTrainer, RLOOTrainer and DistillationTrainer without vLLM
/// (transformers' generate with its KV cache), on 1 and 2 ranks; the share of the step each
/// spends generating. `only`: one of them.
fn grpo_lines(dir: &Path, only: Option<&str>) {
    for task in ["grpo", "rloo", "distillation"] {
        if only.is_none_or(|o| o == task) {
            online_lines(dir, task);
        }
    }
}

/// `task`'s lines (grpo, rloo or distillation): ours against TRL's trainer of that name.
fn online_lines(dir: &Path, task: &str) {
    let prompts = dir.join("prompts.jsonl");
    for world in [1, 2] {
        let grpo = measure(&format!("ref-{task}"), world, dir);
        println!(
        "{{\"bench\":\"train\",\"device\":\"cpu\",\"strategy\":\"ddp_{task}\",\"world\":{world},\"tokens_per_s\":{:.1},\"step_s\":{:.4},\"comm_share\":{:.3},\"generation_share\":{:.3}}}",
        grpo.tokens_per_s, grpo.step_s, grpo.comm_share, grpo.part_share
    );
        let completion = GRPO_COMPLETION.to_string();
        let generations = GRPO_GENERATIONS.to_string();
        let extra = [
            "--prompt_data",
            prompts.to_str().unwrap(),
            "--completion_length",
            &completion,
            "--num_generations",
            &generations,
        ];
        let peers = cpu_peers(world, &format!("trl_{task}"), GRPO_BATCH, &extra);
        peer_lines(task, world, grpo.tokens_per_s, &peers);
        for peer in &peers {
            println!(
            "{{\"bench\":\"train\",\"device\":\"cpu\",\"task\":\"{task}\",\"what\":\"generation_share\",\"world\":{world},\"generation_share\":{:.3},\"peer\":{},\"peer_generation_share\":{:.3}}}",
            grpo.part_share,
            peer["framework"],
            peer["generation_share"].as_f64().unwrap_or(f64::NAN)
        );
        }
    }
}

fn main() {
    if let Ok(kind) = std::env::var("TRL_BENCH_WORKER") {
        worker(&kind, Path::new(&std::env::var("TRL_BENCH_DIR").unwrap()));
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    #[cfg(feature = "cuda")]
    gpu::run(tmp.path());
    // TRL_BENCH_ONLY=cuda skips the CPU part (GPU sessions are short).
    if std::env::var("TRL_BENCH_ONLY").is_ok_and(|v| v == "cuda") {
        return;
    }
    prepare(tmp.path());
    // TRL_BENCH_ONLY=grpo (or rloo, distillation, online for the three, kto, reward) runs
    // those lines alone.
    match std::env::var("TRL_BENCH_ONLY").as_deref() {
        Ok("online") => return grpo_lines(tmp.path(), None),
        Ok("kto") => return kto_lines(tmp.path()),
        Ok("reward") => return reward_lines(tmp.path()),
        Ok(task @ ("grpo" | "rloo" | "distillation")) => return grpo_lines(tmp.path(), Some(task)),
        Ok("moe") => return moe_lines(tmp.path()),
        _ => {}
    }
    eprintln!(
        "train bench: reference shape, batch {BATCH} x seq {SEQ} per process, 1 thread per process"
    );
    // What `cargo trl plan` predicts for each run, from this CPU's step speed per thread
    // (measured here; every rank runs one thread).
    let cfg = trl_runtime::models::ModelConfig::from_json(
        &support::reference_config(4096).to_string(),
        "reference shape",
    )
    .unwrap();
    let model = estimate::ModelShapes::of_json(&cfg.to_json_pretty(), "reference shape").unwrap();
    let link = estimate::host_all_reduce_speed(2).unwrap();
    // The whole-logits loss (ZeRO-3, tp) on this CPU, per logit with every thread: ranks
    // sharing the machine share its memory bandwidth.
    let logit_seconds = estimate::cpu_whole_logits_seconds();
    let predict = |strategy: &str, world: usize, rates: estimate::CpuStepRates| {
        let (strategy_kind, tp) = match strategy {
            "zero3" => (Strategy::fsdp(WrapPolicy::PerLayer), 1),
            "tp" => (Strategy::Ddp, world),
            _ => (Strategy::Ddp, 1),
        };
        let dp = world / tp;
        let dims = trl_runtime::config::parallelism::ParallelDims {
            dp_replicate: if strategy == "zero3" { 1 } else { dp },
            dp_shard: if strategy == "zero3" { dp } else { 1 },
            cp: 1,
            sp: 1,
            tp,
        };
        let setup = estimate::Setup {
            lora: (strategy == "ddp_lora").then(|| {
                TrainingArguments {
                    use_peft: true,
                    lora_target_modules: Some(NameList(vec!["all-linear".into()])),
                    ..Default::default()
                }
                .lora("qwen2")
                .unwrap()
            }),
            ..estimate::Setup::new(strategy_kind, dims, BATCH, SEQ)
        };
        let hw = estimate::Hardware::cpu(rates, world, link, logit_seconds * world as f64);
        estimate::step_time(&model, &setup, &hw).tokens_per_second
    };
    // The measured line, with the plan's prediction where the runs' step speed was timed.
    let line = |strategy: &str, world: usize, m: &Measured, predicted: Option<&Predicted>| {
        let predicted = match predicted {
            Some(p) => {
                let runs: Vec<String> = p.ratios.iter().map(|r| format!("{r:.3}")).collect();
                format!(
                    ",\"predicted_tokens_per_s\":{:.1},\"predicted_over_measured\":{:.3},\"predicted_over_measured_runs\":[{}]",
                    p.predicted,
                    median(p.ratios.clone()),
                    runs.join(",")
                )
            }
            None => String::new(),
        };
        println!(
            "{{\"bench\":\"train\",\"device\":\"cpu\",\"strategy\":\"{strategy}\",\"world\":{world},\"tokens_per_s\":{:.1},\"step_s\":{:.4},\"comm_share\":{:.3}{predicted}}}",
            m.tokens_per_s, m.step_s, m.comm_share
        )
    };
    let mut per_world = Vec::new();
    for world in [1, 2] {
        let p = measure_predicted("ref", world, tmp.path(), &|r| predict("ddp", world, r));
        line("ddp", world, &p.measured, Some(&p));
        per_world.push(p.measured.tokens_per_s);
    }
    // The same shape through transformers and TRL on this CPU's torch (when importable), on
    // one process and (TRL, DDP) on two.
    for world in [1, 2] {
        let peers = cpu_peers(world, "transformers,trl", BATCH, &[]);
        peer_lines("sft", world, per_world[world - 1], &peers);
    }
    // LoRA (r 16, alpha 32, dropout 0.05, every linear layer) against TRL + peft, and DPO
    // (sigmoid, beta 0.1) against TRL's DPOTrainer, on 1 and 2 ranks.
    let pref = tmp.path().join("pref.jsonl");
    for world in [1, 2] {
        let p = measure_predicted("ref-lora", world, tmp.path(), &|r| {
            predict("ddp_lora", world, r)
        });
        line("ddp_lora", world, &p.measured, Some(&p));
        let lora = &p.measured;
        let peers = cpu_peers(world, "trl_lora", BATCH, &[]);
        peer_lines("sft_lora", world, lora.tokens_per_s, &peers);
        let dpo = measure("ref-dpo", world, tmp.path());
        line("ddp_dpo", world, &dpo, None);
        let extra = ["--pref_data", pref.to_str().unwrap()];
        let peers = cpu_peers(world, "trl_dpo,trl_dpo_precompute", DPO_PAIRS, &extra);
        peer_lines("dpo", world, dpo.tokens_per_s, &peers);
    }
    kto_lines(tmp.path());
    reward_lines(tmp.path());
    grpo_lines(tmp.path(), None);
    // Tensor parallelism: 2 ranks share every layer of one replica.
    let p = measure_predicted("ref-tp", 2, tmp.path(), &|r| predict("tp", 2, r));
    line("tp", 2, &p.measured, Some(&p));
    let tp = &p.measured;
    println!(
        "{{\"bench\":\"train\",\"strategy\":\"tp\",\"what\":\"vs_ddp\",\"world\":2,\"tokens_per_s_ratio_tp_over_ddp_1\":{:.3},\"tokens_per_s_ratio_tp_over_ddp_2\":{:.3}}}",
        tp.tokens_per_s / per_world[0],
        tp.tokens_per_s / per_world[1]
    );
    let p = measure_predicted("ref-zero3", 2, tmp.path(), &|r| predict("zero3", 2, r));
    line("zero3", 2, &p.measured, Some(&p));
    let tokens_per_s = p.measured.tokens_per_s;
    println!(
        "{{\"bench\":\"train\",\"strategy\":\"zero3\",\"what\":\"vs_ddp\",\"world\":2,\"tokens_per_s_ratio_zero3_over_ddp\":{:.3}}}",
        tokens_per_s / per_world[1]
    );
    // The same run without starting any all-gather ahead: what prefetching buys (the median
    // of as many runs as the ZeRO-3 line's).
    let none = median_run(
        (0..RUNS)
            .map(|_| measure("ref-zero3-no-prefetch", 2, tmp.path()))
            .collect(),
    );
    let (step_s, plain) = (none.step_s, none.tokens_per_s);
    println!("{{\"bench\":\"train\",\"strategy\":\"zero3\",\"prefetch\":false,\"world\":2,\"tokens_per_s\":{plain:.1},\"step_s\":{step_s:.4}}}");
    println!(
        "{{\"bench\":\"train\",\"strategy\":\"zero3\",\"what\":\"prefetch\",\"world\":2,\"tokens_per_s_ratio_prefetch_over_none\":{:.3}}}",
        tokens_per_s / plain
    );
    println!(
        "{{\"bench\":\"train\",\"strategy\":\"ddp\",\"what\":\"scaling\",\"world\":2,\"tokens_per_s_ratio_2_over_1\":{:.3}}}",
        per_world[1] / per_world[0]
    );
    moe_lines(tmp.path());
    let (first, _) = launch("tiny", 1, tmp.path());
    let (first2, _) = launch("tiny", 2, tmp.path());
    println!("{{\"bench\":\"train\",\"what\":\"launch_to_first_step\",\"model\":\"tiny\",\"world\":1,\"seconds\":{first:.3}}}");
    println!("{{\"bench\":\"train\",\"what\":\"launch_to_first_step\",\"model\":\"tiny\",\"world\":2,\"seconds\":{first2:.3}}}");
}

/// The MoE step with expert parallelism (ep 2) against the same 2 ranks without it, under DDP
/// and ZeRO-3 (the median of [`RUNS`] runs each): tokens/s and the largest per-rank model
/// state of each, and their ratios.
fn moe_lines(dir: &Path) {
    prepare_moe(dir);
    for (strategy, plain, ep) in [
        ("ddp", "moe-ddp", "moe-ddp-ep"),
        ("zero3", "moe-zero3", "moe-zero3-ep"),
    ] {
        let runs = |kind: &str| median_run((0..RUNS).map(|_| measure(kind, 2, dir)).collect());
        let (without, with) = (runs(plain), runs(ep));
        for (m, ep) in [(&without, 1), (&with, 2)] {
            println!(
                "{{\"bench\":\"train\",\"device\":\"cpu\",\"model\":\"qwen3_moe 16x384 top2\",\"strategy\":\"{strategy}\",\"ep\":{ep},\"world\":2,\"tokens_per_s\":{:.1},\"step_s\":{:.4},\"comm_share\":{:.3},\"model_state_bytes\":{:.0}}}",
                m.tokens_per_s, m.step_s, m.comm_share, m.state_bytes
            );
        }
        println!(
            "{{\"bench\":\"train\",\"strategy\":\"{strategy}\",\"what\":\"ep_vs_none\",\"world\":2,\"tokens_per_s_ratio_ep_over_none\":{:.3},\"model_state_ratio_ep_over_none\":{:.3}}}",
            with.tokens_per_s / without.tokens_per_s,
            with.state_bytes / without.state_bytes
        );
    }
}
