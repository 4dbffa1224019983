//! `cargo bench -p trl-runtime --bench memory`: model-state bytes per rank for ddp, zero1 and
//! zero2 on 1, 2 and 4 processes with a 24M-parameter Qwen2, against the ZeRO formula for fp32
//! AdamW with master weights (ddp 20P, zero1 8P + 12P/N, zero2 4P + 16P/N bytes), and the peak
//! resident memory of a rank over one training step. One JSON object per line on stdout.
//! (zero3 comes with parameter sharding.)

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use trl_runtime::config::launch::DistributedType;
use trl_runtime::config::parallelism::ParallelismConfig;
use trl_runtime::dist::{spawn, DistContext};
use trl_runtime::models::{ModelConfig, Params};
use trl_runtime::parallel::ZeroStage;
use trl_runtime::train::{peak_rss_bytes, SFTConfig, Strategy, Trainer};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn prepare(dir: &Path) -> usize {
    let cfg = ModelConfig::from_json(
        &serde_json::json!({
            "model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
            "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
            "max_position_embeddings": 1024, "tie_word_embeddings": true,
        })
        .to_string(),
        "memory bench model",
    )
    .unwrap();
    let model = dir.join("model");
    Params::init(&cfg, 0, candle_core::DType::F32, &candle_core::Device::Cpu)
        .unwrap()
        .save(&model, &cfg, None)
        .unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(repo().join("assets/tiny/model").join(f), model.join(f)).unwrap();
    }
    let rows: String = (0..16)
        .map(|r| serde_json::json!({ "input_ids": (0..64).map(|i| (r * 31 + i * 17) % 8000 + 3).collect::<Vec<_>>() }).to_string() + "\n")
        .collect();
    std::fs::write(dir.join("train.jsonl"), rows).unwrap();
    cfg.num_parameters()
}

fn strategy(name: &str) -> Strategy {
    match name {
        "zero1" => Strategy::Zero(ZeroStage::One),
        "zero2" => Strategy::Zero(ZeroStage::Two),
        _ => Strategy::Ddp,
    }
}

fn worker(name: &str, dir: &Path) {
    let ctx = DistContext::init(&ParallelismConfig::default(), DistributedType::MultiCpu).unwrap();
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
    trainer.train_step().unwrap();
    let mem = trainer.memory();
    let peak = peak_rss_bytes().unwrap_or(0);
    if ctx.is_main_process() {
        println!("report {} {peak}", mem.total());
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
    let exe = std::env::current_exe().unwrap();
    for name in ["ddp", "zero1", "zero2"] {
        for world in [1usize, 2, 4] {
            let port = spawn::free_port().unwrap();
            let mut children: Vec<_> = (0..world)
                .map(|rank| {
                    Command::new(&exe)
                        .env("TRL_BENCH_WORKER", name)
                        .env("TRL_BENCH_DIR", tmp.path())
                        .env("RAYON_NUM_THREADS", "1")
                        .envs(spawn::local_rank_env(rank, world, port, "memory"))
                        .stdout(if rank == 0 {
                            Stdio::piped()
                        } else {
                            Stdio::null()
                        })
                        .spawn()
                        .unwrap()
                })
                .collect();
            let mut report = None;
            for line in BufReader::new(children[0].stdout.take().unwrap())
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.strip_prefix("report ") {
                    let v: Vec<usize> = rest.split(' ').map(|x| x.parse().unwrap()).collect();
                    report = Some((v[0], v[1]));
                }
            }
            for c in &mut children {
                assert!(
                    c.wait().unwrap().success(),
                    "{name} on {world} ranks failed"
                );
            }
            let (state, peak) = report.expect("no report");
            let formula = match name {
                "zero1" => 8 * p + 12 * p / world,
                "zero2" => 4 * p + 16 * p / world,
                _ => 20 * p,
            };
            println!(
                "{{\"bench\":\"memory\",\"strategy\":\"{name}\",\"world\":{world},\"params\":{p},\"model_state_bytes_per_rank\":{state},\"formula_bytes\":{formula},\"state_over_formula\":{:.3},\"peak_bytes_per_rank\":{peak}}}",
                state as f64 / formula as f64
            );
        }
    }
}
