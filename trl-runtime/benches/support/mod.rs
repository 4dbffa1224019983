//! What the training benchmarks share: a random-init model and token rows written to a
//! directory, and ranks of the benchmark program itself started as workers.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;
use trl_runtime::dist::spawn;
use trl_runtime::models::{ModelConfig, Params};

/// The repository root. Read at run time first (cargo sets CARGO_MANIFEST_DIR when it runs a
/// bench) so a bench binary carried to another machine (scripts/gpu-run) finds that checkout.
pub fn repo() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("..")
}

/// The reference shape of the training benchmarks: Qwen2 with hidden 256, intermediate 768,
/// 4 layers, 8 query / 4 key-value heads, vocabulary 4096, tied embeddings.
#[allow(dead_code)] // the memory bench uses a larger shape
pub fn reference_config(max_positions: usize) -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": max_positions, "rope_theta": 1000000.0,
        "tie_word_embeddings": true,
    })
}

/// Writes `dir/model` (random init from `config`, plus the tiny tokenizer's files: only its
/// pad and eos tokens matter here) and `rows` pre-tokenized rows of `len` ids to
/// `dir/train.jsonl`. Returns the parameter count.
pub fn write_model_and_rows(
    dir: &Path,
    config: serde_json::Value,
    rows: usize,
    len: usize,
) -> usize {
    let cfg = ModelConfig::from_json(&config.to_string(), "benchmark model").unwrap();
    let model = dir.join("model");
    // `Params::init` knows a dense decoder's parameters; a mixture of experts' and a hybrid's
    // come from its skeleton (transformers' names, per-expert or fused as the model type keeps them).
    let experts = trl_runtime::models::moe::EXPERT_COUNT_KEYS
        .iter()
        .any(|k| config.get(k).is_some_and(|v| !v.is_null()));
    // So do a hybrid's Gated DeltaNet layers'.
    let linear = config["layer_types"]
        .as_array()
        .is_some_and(|t| t.iter().any(|t| t == "linear_attention"));
    let params = match experts || linear {
        true => write_random_model(&config, &model),
        false => {
            Params::init(&cfg, 0, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap()
                .save(&model, &cfg.to_json_pretty(), None, None)
                .unwrap();
            cfg.num_parameters()
        }
    };
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(repo().join("assets/tiny/model").join(f), model.join(f)).unwrap();
    }
    let vocab = cfg.vocab_size - 8;
    let text: String = (0..rows)
        .map(|r| {
            let ids: Vec<usize> = (0..len)
                .map(|i| (r * 7919 + i * 104729) % vocab + 3)
                .collect();
            serde_json::json!({ "input_ids": ids }).to_string() + "\n"
        })
        .collect();
    std::fs::write(dir.join("train.jsonl"), text).unwrap();
    params
}

/// Writes `rows` preference pairs of text to `path` (jsonl of prompt / chosen / rejected, as
/// TRL reads them): numbers the tiny tokenizer splits into about 4 tokens each, `prompt`
/// numbers in a prompt and `completion` in each completion.
/// Writes `dir/model.safetensors` and `dir/config.json`: every parameter of the model `json`
/// describes (a built-in type's skeleton), random N(0, 0.02), norms at 1. Returns the number
/// of parameters.
pub fn write_random_model(json: &serde_json::Value, dir: &Path) -> usize {
    use candle_core::{DType, Device, Tensor};
    let skeleton =
        trl_runtime::parallel::CausalLm::skeleton_of(json.to_string(), DType::F32, &Device::Cpu)
            .unwrap();
    let tensors: std::collections::HashMap<String, Tensor> = skeleton
        .parameter_shapes()
        .iter()
        .map(|(name, shape)| {
            let t = match name.contains("norm") {
                true => Tensor::ones(shape.as_slice(), DType::F32, &Device::Cpu),
                false => Tensor::randn(0f32, 0.02, shape.as_slice(), &Device::Cpu),
            };
            (name.clone(), t.unwrap())
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    tensors.values().map(|t| t.elem_count()).sum()
}

#[allow(dead_code)] // the memory bench trains no pairs
pub fn write_pref_rows(path: &Path, rows: usize, prompt: usize, completion: usize) {
    let numbers = |seed: usize, n: usize| {
        (0..n)
            .map(|i| ((seed * 7919 + i * 104729) % 1000).to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let text: String = (0..rows)
        .map(|r| {
            serde_json::json!({
                "prompt": numbers(3 * r, prompt),
                "chosen": format!(" {}", numbers(3 * r + 1, completion)),
                "rejected": format!(" {}", numbers(3 * r + 2, completion)),
            })
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(path, text).unwrap();
}

/// Runs `world` ranks of this program with TRL_BENCH_WORKER=`kind` and TRL_BENCH_DIR=`dir`
/// (one compute thread each), handing rank 0's output lines and the seconds since the start
/// to `on_line`. Panics if a rank fails.
#[allow(dead_code)] // the generate bench runs one process
pub fn run_ranks(kind: &str, world: usize, dir: &Path, mut on_line: impl FnMut(&str, f64)) {
    let exe = std::env::current_exe().unwrap();
    let port = spawn::free_port().unwrap();
    let start = Instant::now();
    let mut children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env("TRL_BENCH_WORKER", kind)
                .env("TRL_BENCH_DIR", dir)
                .env("RAYON_NUM_THREADS", "1")
                .envs(spawn::local_rank_env(rank, world, port, "bench"))
                .stdout(if rank == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .spawn()
                .unwrap()
        })
        .collect();
    for line in BufReader::new(children[0].stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        on_line(&line, start.elapsed().as_secs_f64());
    }
    for c in &mut children {
        assert!(
            c.wait().unwrap().success(),
            "a {kind} worker on {world} rank(s) failed"
        );
    }
}

/// A Qwen3.5 hybrid of `layers` layers: three Gated DeltaNet layers (16 key and 16 value heads
/// of 128, a 4-tap convolution) to each gated full-attention layer (8 heads and 2 kv heads of
/// `head_dim`, a quarter of each rotated), `hidden` wide with MLPs of `intermediate`, a
/// `vocab`-entry tied vocabulary.
#[allow(dead_code)] // the generate bench's and the GPU train bench's
pub fn qwen3_5_hybrid(
    layers: usize,
    hidden: usize,
    intermediate: usize,
    vocab: usize,
    head_dim: usize,
) -> serde_json::Value {
    let types: Vec<&str> = (0..layers)
        .map(|i| match i % 4 {
            3 => "full_attention",
            _ => "linear_attention",
        })
        .collect();
    serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": head_dim,
        "layer_types": types, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_value_head_dim": 128,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
    })
}
