//! `cargo bench -p trl-runtime --bench memory`: model-state bytes per rank for ddp, zero1,
//! zero2 and zero3 on 1, 2 and 4 processes with a 24M-parameter Qwen2, against the ZeRO formula
//! for fp32 AdamW with master weights (ddp 20P, zero1 8P + 12P/N, zero2 4P + 16P/N; zero3 16P/N,
//! the fp32 parameters being their own master copy), the peak resident memory of a rank during
//! one training step (peak count restarted after start-up) and over the whole run including
//! loading the model. One JSON object per line on stdout.

use std::path::Path;
use trl_runtime::config::launch::DistributedType;
use trl_runtime::config::LaunchPlan;
use trl_runtime::dist::DistContext;
use trl_runtime::parallel::{WrapPolicy, ZeroStage};
use trl_runtime::train::{peak_rss_bytes, reset_peak_rss, SFTConfig, Strategy, Trainer};

mod support;

fn prepare(dir: &Path) -> usize {
    let config = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
        "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 1024, "tie_word_embeddings": true,
    });
    support::write_model_and_rows(dir, config, 16, 64)
}

fn strategy(name: &str) -> Strategy {
    match name {
        "zero1" => Strategy::Zero(ZeroStage::One),
        "zero2" => Strategy::Zero(ZeroStage::Two),
        "zero3" => Strategy::fsdp(WrapPolicy::PerLayer),
        _ => Strategy::Ddp,
    }
}

fn worker(name: &str, dir: &Path) {
    // Sharding strategies split over dp_shard, which the DeepSpeed type fills from the world.
    let kind = match strategy(name) {
        Strategy::Ddp => DistributedType::MultiCpu,
        _ => DistributedType::DeepSpeed,
    };
    let ctx = DistContext::with_plan(LaunchPlan {
        distributed_type: kind,
        ..LaunchPlan::default()
    })
    .unwrap();
    let config = SFTConfig {
        model_name_or_path: dir.join("model"),
        dataset_name: dir.join("train.jsonl"),
        output_dir: dir.join("out"),
        per_device_train_batch_size: 1,
        max_length: 64,
        max_steps: 10,
        disable_tqdm: true,
        ..SFTConfig::default()
    };
    let mut trainer = Trainer::with_strategy(config, &ctx, strategy(name)).unwrap();
    let run_peak = peak_rss_bytes().unwrap_or(0);
    // The first step allocates the optimizer's moments and warms the allocator; the second
    // is the steady state measured.
    trainer.train_step().unwrap();
    let run_peak = run_peak.max(peak_rss_bytes().unwrap_or(0));
    reset_peak_rss();
    trainer.train_step().unwrap();
    let step_peak = peak_rss_bytes().unwrap_or(0);
    let mem = trainer.memory();
    if ctx.is_main_process() {
        println!("report {} {step_peak} {run_peak}", mem.total());
    }
}

fn main() {
    if let Ok(name) = std::env::var("TRL_BENCH_WORKER") {
        worker(&name, Path::new(&std::env::var("TRL_BENCH_DIR").unwrap()));
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let p = prepare(tmp.path());
    eprintln!("memory bench: {p} parameters, fp32 AdamW, 1 step per run");
    for name in ["ddp", "zero1", "zero2", "zero3"] {
        for world in [1usize, 2, 4] {
            let mut report = None;
            support::run_ranks(name, world, tmp.path(), |line, _| {
                if let Some(rest) = line.strip_prefix("report ") {
                    let v: Vec<usize> = rest.split(' ').map(|x| x.parse().unwrap()).collect();
                    report = Some((v[0], v[1], v[2]));
                }
            });
            let (state, peak, run_peak) = report.expect("no report");
            let formula = match name {
                "zero1" => 8 * p + 12 * p / world,
                "zero2" => 4 * p + 16 * p / world,
                "zero3" => 16 * p / world,
                _ => 20 * p,
            };
            println!(
                "{{\"bench\":\"memory\",\"strategy\":\"{name}\",\"world\":{world},\"params\":{p},\"model_state_bytes_per_rank\":{state},\"formula_bytes\":{formula},\"state_over_formula\":{:.3},\"peak_bytes_per_rank\":{peak},\"run_peak_bytes_per_rank\":{run_peak}}}",
                state as f64 / formula as f64
            );
        }
    }
}
