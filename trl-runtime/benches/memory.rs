//! `cargo bench -p trl-runtime --bench memory`: model-state bytes per rank for ddp, zero1,
//! zero2 and zero3 on 1, 2 and 4 processes with a 24M-parameter Qwen2, against the ZeRO formula
//! for fp32 AdamW with master weights (ddp 20P, zero1 8P + 13P/N, zero2 4P + 17P/N; zero3 17P/N,
//! the fp32 parameters being their own master copy; a sharded slice's decay mask is the 1
//! byte over 12 and 16), the peak resident memory of a rank while
//! loading the model and setting up its strategy, during one training step (peak count
//! restarted after start-up) and over the whole run; ZeRO-3 also with zero3_init_flag (each
//! rank reads only its slices), every strategy with offload_optimizer_device: cpu, and ZeRO-3 /
//! FSDP with the parameters offloaded too (`+offparam`; on the CPU host and device memory are
//! one: the state offload keeps is reported apart, `host_bytes_per_rank`, against its formula,
//! and the predicted peak adds it). Every
//! run enters through its launch plan, as under `cargo trl launch`. With LoRA (`+lora`:
//! use_peft, all-linear, r 16) against its formula: the frozen base B in the compute dtype
//! (4B; 4B/N sharded under zero3) plus the adapters A as full fine-tuning keeps parameters
//! (ddp 20A, zero1 8A + 13A/N, zero2 and zero3 4A + 17A/N: under ZeRO-3 the adapters stay
//! whole and ZeRO-2 shards their gradients and optimizer state). ZeRO-3 and FSDP also save a
//! full checkpoint after the measured step, streamed a unit at a time: its peak
//! (`save_peak_bytes_per_rank`, freed memory returned to the OS first) must stay within the
//! largest unit held whole (its parameters and optimizer state, 16 bytes per element) of the
//! training step's peak. Each line also has `predicted_peak_mib` (`parallel::estimate`, what
//! `cargo trl plan` shows) beside `measured_peak_mib`, the heap the trainer allocated at the
//! step's peak (counted by this binary's allocator; the resident peak is the `*_bytes_per_rank`
//! fields). Then `memory_plan` lines: every CPU profile, with and without checkpointing and
//! LoRA, at three lengths on the tiny model (64/128/256) and the reference shape
//! (128/512/1024), predicted against measured (ZeRO-3's prefetched unit, in memory at the
//! peak or not by timing, makes the prediction a range: `prefetch_mib` below the peak), and a
//! summary line (`--plan-only` runs just that part; `--only PATTERN` the runs whose
//! `profile/PROFILE/MODEL/SEQ/CKPT/LORA` contains it; `--runs PATTERN` only the model-state
//! runs whose name contains it). `+generate` runs add a generation round after the step
//! (ZeRO-3 gathering the whole model once): the heap it adds against the KV cache and the
//! gathered weights the plan counts (`memory_generation` lines). One JSON object per line on
//! stdout.

use std::path::Path;
use trl_runtime::config::{
    DeepSpeedConfig, DistributedType, FsdpConfig, LaunchConfig, LaunchPlan, OffloadDevice,
};
use trl_runtime::dist::DistContext;
use trl_runtime::train::{peak_rss_bytes, reset_peak_rss, SFTConfig, Trainer};

mod support;

// The heap the trainer allocated, counted (the resident peak is the `*_bytes_per_rank` fields).
#[path = "support/counting.rs"]
mod counting;

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

const LORA_R: usize = 16;

/// Elements of the bench model's largest wrap unit: the root, with the (tied) embedding and
/// the final norm.
const UNIT: usize = 8192 * 512 + 512;

/// Adapter parameters of the bench model at rank `LORA_R` on every linear layer but the head:
/// r (in + out) per projection.
fn adapter_params() -> usize {
    let (h, kv, i, layers) = (512, 256, 1536, 6);
    let per_layer = (h + h) + (h + kv) * 2 + (h + h) + (h + i) * 3;
    per_layer * LORA_R * layers
}

fn prepare(dir: &Path) -> usize {
    let config = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
        "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 1024, "tie_word_embeddings": true,
    });
    support::write_model_and_rows(dir, config, 16, 64)
}

/// The launch plan of a bench run: `ddp` (DeepSpeed stage 0), `zero1`..`zero3`, with
/// `+init` (zero3_init_flag: each rank reads only its slices), `+offload`
/// (offload_optimizer_device: cpu) and `+offparam` (offload_param_device too; FSDP's
/// offload_params).
fn plan(name: &str) -> LaunchPlan {
    if name.starts_with("fsdp") {
        return LaunchPlan {
            distributed_type: DistributedType::Fsdp,
            fsdp: Some(FsdpConfig {
                version: 2,
                offload_params: name.contains("+offparam"),
                ..FsdpConfig::default()
            }),
            ..LaunchPlan::default()
        };
    }
    let stage = match name.split('+').next().unwrap() {
        "zero1" => 1,
        "zero2" => 2,
        "zero3" => 3,
        _ => 0,
    };
    LaunchPlan {
        distributed_type: DistributedType::DeepSpeed,
        deepspeed: Some(DeepSpeedConfig {
            zero_stage: stage,
            zero3_init_flag: name.contains("+init"),
            offload_optimizer_device: match name.contains("+off") {
                true => OffloadDevice::Cpu,
                false => OffloadDevice::None,
            },
            offload_param_device: match name.contains("+offparam") {
                true => OffloadDevice::Cpu,
                false => OffloadDevice::None,
            },
            ..DeepSpeedConfig::default()
        }),
        ..LaunchPlan::default()
    }
}

fn worker(name: &str, dir: &Path) {
    let ctx = DistContext::with_plan(plan(name)).unwrap();
    let config = SFTConfig {
        training: trl_runtime::train::TrainingArguments {
            model_name_or_path: dir.join("model"),
            dataset_name: dir.join("train.jsonl"),
            // Each run its own: a run refuses another run's checkpoints.
            output_dir: dir.join(format!("out-{name}")),
            per_device_train_batch_size: 1,
            max_length: 64,
            max_steps: 10,
            disable_tqdm: true,
            // Model state per strategy, not activations: measured without recompute.
            gradient_checkpointing: false,
            use_peft: name.contains("+lora"),
            lora_target_modules: Some(trl_runtime::train::args::NameList(
                vec!["all-linear".into()],
            )),
            lora_r: LORA_R,
            lora_dropout: 0.0,
            ..Default::default()
        },
        ..SFTConfig::default()
    };
    // Peak from here: loading the model and setting up the strategy.
    trl_runtime::alloc::release_freed_memory();
    reset_peak_rss();
    let base = counting::reset_peak();
    let mut trainer = Trainer::new(config, &ctx).unwrap();
    let load_peak = peak_rss_bytes().unwrap_or(0);
    let offloaded = trainer.report().unwrap()["offload_optimizer"] == true;
    // The first step allocates the optimizer's moments and warms the allocator; the second
    // is the steady state measured.
    trainer.train_step().unwrap();
    let run_peak = load_peak.max(peak_rss_bytes().unwrap_or(0));
    reset_peak_rss();
    counting::reset_peak();
    trainer.train_step().unwrap();
    let step_peak = peak_rss_bytes().unwrap_or(0);
    let heap_peak = counting::peak() - base;
    let mem = trainer.memory();
    // What `cargo trl plan` predicts for this rank, against the heap the trainer allocated
    // (on the CPU, what offload keeps in host memory is in the same heap).
    let predicted = trainer.memory_estimate().map_or(0, |e| e.peak() + e.host());
    if std::env::var("TRL_BENCH_EXPLAIN").is_ok() && ctx.is_main_process() {
        eprintln!("{name}: {:#?}", trainer.memory_estimate());
    }
    // A full checkpoint's peak on its own: what the step freed goes back to the OS first.
    trl_runtime::alloc::release_freed_memory();
    reset_peak_rss();
    trainer.save_checkpoint().unwrap();
    let save_peak = peak_rss_bytes().unwrap_or(0);
    if name.contains("+generate") {
        generation_round(&trainer, &ctx, dir);
    }
    if ctx.is_main_process() {
        println!(
            "report {} {step_peak} {run_peak} {load_peak} {} {save_peak} {predicted} {heap_peak} {}",
            mem.total(),
            offloaded as usize,
            mem.host
        );
    }
}

/// Rows and tokens (prompt + completion) of the generation round of `+generate` runs.
const GEN_ROWS: usize = 4;
const GEN_PROMPT: usize = 48;
const GEN_NEW: usize = 80;

/// One generation round from the trained model (ZeRO-3 gathering the whole model once):
/// the heap it adds at its peak against `estimate::generation_round` (the KV cache and the
/// gathered weights) plus the last position's logits; printed as a `generate` line.
fn generation_round(trainer: &Trainer, ctx: &DistContext, dir: &Path) {
    use trl_runtime::candle_core::{Device, Tensor};
    use trl_runtime::parallel::estimate::{self, ModelShapes, Setup};
    let config = std::fs::read_to_string(dir.join("model/config.json")).unwrap();
    let shapes = ModelShapes::of_json(&config, "bench model").unwrap();
    let plan = ctx.plan();
    let dims = plan
        .parallelism
        .resolve(ctx.world_size(), plan.distributed_type)
        .unwrap();
    let setup = Setup::new(
        trl_runtime::train::Strategy::from_plan(plan),
        dims,
        GEN_ROWS,
        GEN_PROMPT,
    );
    let tokens = GEN_PROMPT + GEN_NEW;
    let predicted = estimate::generation_round(&shapes, &setup, GEN_ROWS, (GEN_PROMPT, tokens));
    let vocab = shapes.dims.vocab_size;
    let ids: Vec<u32> = (0..GEN_ROWS * GEN_PROMPT)
        .map(|i| (3 + i * 7919 % (vocab - 8)) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (GEN_ROWS, GEN_PROMPT), &Device::Cpu).unwrap();
    let mask = Tensor::ones(
        (GEN_ROWS, GEN_PROMPT),
        trl_runtime::candle_core::DType::U32,
        &Device::Cpu,
    )
    .unwrap();
    let cfg = trl_runtime::generation::GenerationConfig {
        max_new_tokens: GEN_NEW,
        pad_token_id: Some(0),
        ..Default::default()
    };
    trl_runtime::alloc::release_freed_memory();
    let base = counting::reset_peak();
    let out = trainer
        .model
        .generate(&ids, &mask, &cfg, trl_runtime::parallel::GatherMode::Whole)
        .unwrap();
    assert_eq!(out.dim(1).unwrap(), tokens);
    let measured = counting::peak() - base;
    // Beside the cache, the gathered weights and the prefill's transient: a step's logits
    // [rows, vocab] in f32 and their copy read back.
    let logits = 2 * GEN_ROWS * vocab * 4;
    if ctx.is_main_process() {
        println!(
            "generate {measured} {} {} {} {logits}",
            predicted.kv_cache, predicted.gathered_weights, predicted.prefill
        );
    }
}

/// The CPU profiles, as `cargo trl launch --profile` runs them.
const PROFILES: [&str; 7] = [
    "multi_cpu",
    "zero2_cpu",
    "zero3_cpu",
    "fsdp2_cpu",
    "fsdp2_tp_cpu",
    "context_parallel_cpu",
    "alst_ulysses_cpu",
];

fn profile_config(name: &str) -> LaunchConfig {
    let path = support::repo().join(format!("templates/profiles/{name}.yaml"));
    LaunchConfig::from_file(&path).unwrap()
}

/// One run of the prediction section: `profile/PROFILE/MODEL/SEQ/CKPT/LORA`. Reports the
/// heap peak of the second step over the heap before loading, the prediction, and the
/// resident peak.
fn profile_worker(kind: &str, dir: &Path) {
    let f: Vec<&str> = kind.split('/').collect();
    let (profile, model, seq) = (f[1], f[2], f[3].parse::<usize>().unwrap());
    let ctx = DistContext::with_plan(LaunchPlan::from_config(&profile_config(profile))).unwrap();
    let dir = dir.join(model);
    let config = SFTConfig {
        training: trl_runtime::train::TrainingArguments {
            model_name_or_path: dir.join("model"),
            dataset_name: dir.join(format!("train_{seq}.jsonl")),
            output_dir: dir.join("out"),
            per_device_train_batch_size: 1,
            max_length: seq,
            max_steps: 10,
            disable_tqdm: true,
            gradient_checkpointing: f[4] == "true",
            use_peft: f[5] == "true",
            lora_target_modules: Some(trl_runtime::train::args::NameList(
                vec!["all-linear".into()],
            )),
            lora_r: LORA_R,
            // TRL's default: each adapted layer keeps its dropped input.
            lora_dropout: 0.05,
            ..Default::default()
        },
        ..SFTConfig::default()
    };
    let base = counting::reset_peak();
    let mut trainer = Trainer::new(config, &ctx).unwrap();
    trainer.train_step().unwrap();
    reset_peak_rss();
    counting::reset_peak();
    trainer.train_step().unwrap();
    let heap = counting::peak() - base;
    let rss = peak_rss_bytes().unwrap_or(0);
    let predicted = trainer.memory_estimate().map_or(0, |e| e.peak());
    let prefetch = trainer.memory_estimate().map_or(0, |e| e.prefetch);
    if ctx.is_main_process() {
        println!("report {heap} {predicted} {rss} {prefetch}");
    }
}

/// Every CPU profile, with and without checkpointing and LoRA, at three lengths on the tiny
/// model and the training benchmarks' reference shape: predicted against measured peaks.
fn profile_section(tmp: &Path, only: &str) {
    let tiny: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(support::repo().join("assets/tiny/model/config.json")).unwrap(),
    )
    .unwrap();
    let models = [
        ("tiny", tiny, [64, 128, 256]),
        (
            "reference",
            support::reference_config(1024),
            [128, 512, 1024],
        ),
    ];
    let (mut worst, mut runs, mut within) = (0f64, 0, 0);
    for (model, config, lengths) in models {
        let dir = tmp.join(model);
        for seq in lengths {
            support::write_model_and_rows(&dir, config.clone(), 16, seq);
            std::fs::rename(
                dir.join("train.jsonl"),
                dir.join(format!("train_{seq}.jsonl")),
            )
            .unwrap();
        }
        for profile in PROFILES {
            let world = profile_config(profile).num_processes.unwrap_or(1) as usize;
            for seq in lengths {
                for ckpt in [false, true] {
                    for lora in [false, true] {
                        let kind = format!("profile/{profile}/{model}/{seq}/{ckpt}/{lora}");
                        if !kind.contains(only) {
                            continue;
                        }
                        let mut report = None;
                        support::run_ranks(&kind, world, tmp, |line, _| {
                            if let Some(rest) = line.strip_prefix("report ") {
                                let v: Vec<usize> =
                                    rest.split(' ').map(|x| x.parse().unwrap()).collect();
                                report = Some((v[0], v[1], v[2], v[3]));
                            }
                        });
                        let (heap, predicted, rss, prefetch) = report.expect("no report");
                        // ZeRO-3's gathers that run ahead may or may not be in memory at the
                        // peak (timing): measured against that range, as tests/memory_plan.rs.
                        let low = predicted.saturating_sub(prefetch);
                        let ratio = match heap < low {
                            true => low as f64 / heap as f64,
                            false => (predicted as f64 / heap as f64).min(1.0),
                        };
                        worst = worst.max((ratio - 1.0).abs());
                        runs += 1;
                        within += usize::from((ratio - 1.0).abs() <= 0.10);
                        let mib = |b: usize| b as f64 / 1048576.0;
                        println!(
                            "{{\"bench\":\"memory_plan\",\"profile\":\"{profile}\",\"model\":\"{model}\",\"seq\":{seq},\"checkpointing\":{ckpt},\"lora\":{lora},\"world\":{world},\"predicted_peak_mib\":{:.2},\"prefetch_mib\":{:.2},\"measured_peak_mib\":{:.2},\"predicted_over_measured\":{ratio:.3},\"rss_peak_mib\":{:.1}}}",
                            mib(predicted),
                            mib(prefetch),
                            mib(heap),
                            mib(rss)
                        );
                    }
                }
            }
        }
    }
    println!(
        "{{\"bench\":\"memory_plan_summary\",\"runs\":{runs},\"within_10_percent\":{within},\"worst_deviation\":{worst:.3}}}"
    );
}

fn main() {
    if let Ok(name) = std::env::var("TRL_BENCH_WORKER") {
        let dir = std::env::var("TRL_BENCH_DIR").unwrap();
        match name.starts_with("profile/") {
            true => profile_worker(&name, Path::new(&dir)),
            false => worker(&name, Path::new(&dir)),
        }
        return;
    }
    // `--only PATTERN`: the prediction runs whose `profile/PROFILE/MODEL/SEQ/CKPT/LORA`
    // contains it.
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map_or("", |s| s.as_str());
    if std::env::args().any(|a| a == "--plan-only") || !only.is_empty() {
        profile_section(tempfile::tempdir().unwrap().path(), only);
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let p = prepare(tmp.path());
    eprintln!("memory bench: {p} parameters, fp32 AdamW, 1 step per run");
    let runs = ["ddp", "zero1", "zero2", "zero3"]
        .into_iter()
        .flat_map(|n| [1usize, 2, 4].map(|w| (n.to_string(), w)))
        .chain([2usize, 4].map(|w| ("zero3+init".to_string(), w)))
        .chain([2usize, 4].map(|w| ("fsdp".to_string(), w)))
        .chain(["ddp", "zero1", "zero2", "zero3"].map(|n| (format!("{n}+offload"), 2)))
        .chain(["zero3", "fsdp"].map(|n| (format!("{n}+offparam"), 2)))
        .chain(["ddp", "zero1", "zero2", "zero3"].map(|n| (format!("{n}+lora"), 2)))
        .chain(["ddp", "zero3"].map(|n| (format!("{n}+generate"), 2)));
    let a = adapter_params();
    // `--runs PATTERN`: the model-state runs whose name (`zero2+offload`, ...) contains it.
    let pick = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .cloned();
    for (name, world) in runs.filter(|(n, _)| pick.as_ref().is_none_or(|p| n.contains(p.as_str())))
    {
        let mut report = None;
        let mut generated = None;
        support::run_ranks(&name, world, tmp.path(), |line, _| {
            if let Some(rest) = line.strip_prefix("generate ") {
                let v: Vec<usize> = rest.split(' ').map(|x| x.parse().unwrap()).collect();
                generated = Some((v[0], v[1], v[2], v[3], v[4]));
            }
            if let Some(rest) = line.strip_prefix("report ") {
                let v: Vec<usize> = rest.split(' ').map(|x| x.parse().unwrap()).collect();
                report = Some((v[0], v[1], v[2], v[3], v[4] == 1, v[5], v[6], v[7], v[8]));
            }
        });
        let (state, peak, run_peak, load_peak, offloaded, save_peak, predicted, heap, host) =
            report.expect("no report");
        let strategy = name.split('+').next().unwrap();
        let streamed = matches!(strategy, "zero3" | "fsdp") && !name.contains("+lora");
        let save = match streamed {
            true => format!(
                ",\"save_peak_bytes_per_rank\":{save_peak},\"largest_unit_bytes\":{},\"save_within_a_unit_of_step\":{}",
                16 * UNIT,
                save_peak <= peak + 16 * UNIT
            ),
            false => String::new(),
        };
        let lora = name.contains("+lora");
        // A ZeRO / FSDP slice's state has a byte per element more: its decay mask. Under
        // offload, (device, host): the optimizer state and ZeRO-2/3's gradient slices in host
        // memory, with +offparam the parameter slices too (fp32: their own master weights).
        let (formula, host_formula) = match (strategy, lora, name.contains("+off")) {
            ("zero1", false, false) => (8 * p + 13 * p / world, 0),
            ("zero2", false, false) => (4 * p + 17 * p / world, 0),
            ("zero3" | "fsdp", false, false) => (17 * p / world, 0),
            (_, false, false) => (20 * p, 0),
            ("zero1", false, true) => (8 * p, 13 * p / world),
            ("zero2", false, true) => (4 * p, 17 * p / world),
            ("zero3" | "fsdp", false, true) if name.contains("+offparam") => (0, 17 * p / world),
            ("zero3", false, true) => (4 * p / world, 17 * p / world),
            (_, false, true) => (8 * p, 12 * p),
            ("zero1", true, _) => (4 * p + 8 * a + 13 * a / world, 0),
            ("zero2", true, _) => (4 * p + 4 * a + 17 * a / world, 0),
            ("zero3", true, _) => (4 * p / world + 4 * a + 17 * a / world, 0),
            (_, true, _) => (4 * p + 20 * a, 0),
        };
        // On a CPU run host and device memory are one: offload runs its paths, and the
        // report counts what it keeps in host memory apart (`host_bytes_per_rank`).
        println!(
            "{{\"bench\":\"memory\",\"strategy\":\"{strategy}\",\"efficient_loading\":{},\"offload_requested\":{},\"offload_params\":{},\"offloaded\":{offloaded},\"host_bytes_per_rank\":{host},\"host_formula_bytes\":{host_formula},\"lora\":{lora},\"trainable_params\":{},\"world\":{world},\"params\":{p},\"model_state_bytes_per_rank\":{state},\"formula_bytes\":{formula},\"state_over_formula\":{:.3},\"load_peak_bytes_per_rank\":{load_peak},\"step_peak_bytes_per_rank\":{peak},\"run_peak_bytes_per_rank\":{run_peak},\"predicted_peak_mib\":{:.1},\"measured_peak_mib\":{:.1},\"predicted_over_measured\":{:.3}{save}}}",
            name.contains("+init"),
            name.contains("+off"),
            name.contains("+offparam"),
            if lora { a } else { p },
            state as f64 / formula.max(1) as f64,
            predicted as f64 / 1048576.0,
            heap as f64 / 1048576.0,
            predicted as f64 / heap as f64
        );
        // A generation round after the step: the heap it added, against the KV cache, the
        // gathered weights and the prefill's transient the plan counts (plus the logits of a
        // step, read back).
        if let Some((measured, kv, gathered, prefill, logits)) = generated {
            let predicted = kv + gathered + prefill + logits;
            println!(
                "{}",
                serde_json::json!({
                    "bench": "memory_generation", "strategy": strategy, "world": world,
                    "rows": GEN_ROWS, "tokens": GEN_PROMPT + GEN_NEW,
                    "kv_cache_bytes": kv, "gathered_weights_bytes": gathered,
                    "prefill_bytes": prefill,
                    "measured_bytes": measured, "predicted_bytes": predicted,
                    "predicted_over_measured": predicted as f64 / measured.max(1) as f64,
                    "other_bytes": measured as i64 - predicted as i64,
                })
            );
        }
    }
    if pick.is_none() {
        profile_section(&tmp.path().join("plan"), "");
    }
}
