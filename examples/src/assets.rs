//! The bundled tiny assets: an addition task whose answers can be checked exactly, a
//! byte-level BPE tokenizer trained on it (ChatML template with `{% generation %}` markers),
//! and a random-init Qwen2 sized for a 2-core CPU.

use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use trl_runtime::data::tokenize::train_bpe;
use trl_runtime::models::{ModelConfig, Params};

pub const TRAIN_ROWS: usize = 4000;
pub const EVAL_ROWS: usize = 200;
/// Preference pairs drawn from the first training questions.
pub const PREF_TRAIN_ROWS: usize = 2000;
pub const SEED: u64 = 20261122;

pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Where the shipped assets live in the repository.
pub fn default_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny")
}

/// One row of the task: "What is a + b?" -> "c".
pub fn problem(rng: &mut impl Rng) -> (String, String) {
    let a = rng.random_range(0..100u32);
    let b = rng.random_range(0..100u32);
    (format!("What is {a} + {b}?"), (a + b).to_string())
}

fn row(q: &str, a: &str) -> String {
    serde_json::json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}).to_string()
}

pub fn model_config(vocab_size: usize) -> ModelConfig {
    let json = serde_json::json!({
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "initializer_range": 0.02,
        "bos_token_id": null,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    });
    ModelConfig::from_json(&json.to_string(), "tiny model").expect("valid tiny config")
}

/// Writes `dir/data/{train,eval}.jsonl` and `dir/model/` (tokenizer + config + weights).
/// The same seed gives the same files.
pub fn write_all(dir: &Path) -> trl_runtime::Result<()> {
    let io = |what: &str, e: std::io::Error| trl_runtime::Error::Io {
        context: what.to_string(),
        source: e,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
    let mut seen = std::collections::HashSet::new();
    let mut problems = Vec::new();
    while problems.len() < TRAIN_ROWS + EVAL_ROWS {
        let p = problem(&mut rng);
        // Held-out questions never appear in training.
        if seen.insert(p.0.clone()) {
            problems.push(p);
        }
    }
    let (train, eval) = problems.split_at(TRAIN_ROWS);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).map_err(|e| io("create data dir", e))?;
    for (name, rows) in [("train.jsonl", train), ("eval.jsonl", eval)] {
        let text: String = rows.iter().map(|(q, a)| row(q, a) + "\n").collect();
        std::fs::write(data.join(name), text).map_err(|e| io(name, e))?;
    }

    // The tokenizer sees the rendered conversations, so the template's pieces get merges.
    let texts: Vec<String> = train
        .iter()
        .map(|(q, a)| {
            format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
        })
        .collect();
    let tok = train_bpe(
        &texts,
        384,
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )?;
    let model_dir = dir.join("model");
    std::fs::create_dir_all(&model_dir).map_err(|e| io("create model dir", e))?;
    tok.save(model_dir.join("tokenizer.json"), true)
        .map_err(|e| io("tokenizer.json", std::io::Error::other(e.to_string())))?;
    let tok_cfg = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    });
    std::fs::write(
        model_dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_cfg).unwrap(),
    )
    .map_err(|e| io("tokenizer_config.json", e))?;
    let cfg = model_config(tok.get_vocab_size(true));
    let params = Params::init(
        &cfg,
        SEED,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    params.save(&model_dir, &cfg.to_json_pretty(), None, None)?;
    write_preferences(&data, train, eval)
}

/// `dir/pref_{train,eval}.jsonl`: DPO pairs on the same questions, the right sum chosen and,
/// rejected, a near miss (half the pairs), an evasion or the sum repeated.
pub fn write_preferences(
    data: &Path,
    train: &[(String, String)],
    eval: &[(String, String)],
) -> trl_runtime::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED + 1);
    for (name, rows) in [
        ("pref_train.jsonl", &train[..PREF_TRAIN_ROWS]),
        ("pref_eval.jsonl", eval),
    ] {
        let mut text = String::new();
        for (q, a) in rows {
            let sum: i64 = a.parse().expect("a number");
            let rejected = match rng.random_range(0..4u32) {
                0 | 1 => {
                    let off =
                        rng.random_range(1..10i64) * if rng.random_bool(0.5) { 1 } else { -1 };
                    (sum + off).abs().to_string()
                }
                2 => "I don't know.".to_string(),
                _ => format!("{a} {a}"),
            };
            let msg =
                |role: &str, content: &str| serde_json::json!({"role": role, "content": content});
            let line = serde_json::json!({
                "prompt": [msg("user", q)],
                "chosen": [msg("assistant", a)],
                "rejected": [msg("assistant", &rejected)],
            });
            text.push_str(&format!("{line}\n"));
        }
        std::fs::write(data.join(name), text).map_err(|e| trl_runtime::Error::Io {
            context: name.to_string(),
            source: e,
        })?;
    }
    Ok(())
}
