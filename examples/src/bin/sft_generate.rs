//! SFT steps, then generation from the model under the run's strategy, in the training
//! process: what an online trainer (GRPO) does between its steps. The tests launch it under
//! every CPU profile and compare each rank's tokens with one process's.
//!
//! Flags are `sft`'s (TRL's). `TRL_GENERATE_JOB` names a JSON file: `{"prompts": [[ids]],
//! "max_new_tokens": n, "eos_token_id": id or null, "steps": training steps first,
//! "gather": "auto" | "whole" | "per_unit"}`. Each data-parallel rank takes every dp-th
//! prompt (tensor- and sequence-parallel ranks of one replica take the same ones: generation
//! runs whole rows on each), greedy, and writes `OUTPUT_DIR/generated-rank{RANK}.json`:
//! `{"rows": [prompt index], "tokens": [[prompt, left-padded, and what follows]]}`.

use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::generation::GenerationConfig;
use trl_runtime::parallel::GatherMode;
use trl_runtime::train::{SFTConfig, Trainer};
use trl_runtime::{Error, Result};

#[derive(serde::Deserialize)]
struct Job {
    prompts: Vec<Vec<u32>>,
    max_new_tokens: usize,
    eos_token_id: Option<u32>,
    #[serde(default)]
    steps: usize,
    #[serde(default)]
    gather: Option<String>,
}

fn main() -> ExitCode {
    trl_examples::launch::<SFTConfig>(trl_examples::sft::embedded_defaults, run)
}

fn run(config: SFTConfig) -> Result<()> {
    let path = std::env::var("TRL_GENERATE_JOB").map_err(|_| Error::Env {
        var: "TRL_GENERATE_JOB".into(),
        message: "not set: name the JSON file of the prompts to generate from".into(),
    })?;
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(path.clone(), e))?;
    let job: Job = serde_json::from_str(&text)
        .map_err(|e| Error::config(&path, "<document>", e.to_string()))?;
    let gather = match job.gather.as_deref().unwrap_or("auto") {
        "auto" => GatherMode::Auto,
        "whole" => GatherMode::Whole,
        "per_unit" => GatherMode::PerUnit,
        other => {
            return Err(Error::config(
                &path,
                "gather",
                format!("{other:?}: one of auto, whole, per_unit"),
            ))
        }
    };
    let ctx = DistContext::from_env()?;
    let _rank = trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<trl_runtime::models::AutoModelForCausalLM>::load(config, &ctx)?;
    for _ in 0..job.steps {
        trainer.train_step()?;
    }
    let (dp_rank, dp) = (trainer.dp.rank(), trainer.dp.size());
    let rows: Vec<usize> = (dp_rank..job.prompts.len()).step_by(dp).collect();
    let pad = trainer.tokenizer.pad_token_id;
    let asked: Vec<&[u32]> = rows.iter().map(|&r| &job.prompts[r][..]).collect();
    let (ids, mask) = trl_runtime::generation::left_pad(&asked, pad)?;
    let cfg = GenerationConfig {
        max_new_tokens: job.max_new_tokens,
        eos_token_id: job.eos_token_id.into_iter().collect(),
        pad_token_id: Some(pad),
        ..GenerationConfig::default()
    };
    let out = trainer.model.generate(&ids, &mask, &cfg, gather)?;
    let file = trainer
        .config
        .training
        .output_dir
        .join(format!("generated-rank{}.json", ctx.rank()));
    std::fs::create_dir_all(file.parent().unwrap_or(std::path::Path::new(".")))
        .map_err(|e| Error::io("creating the output directory", e))?;
    let written = serde_json::json!({"rows": rows, "tokens": out.to_vec2::<u32>()?});
    std::fs::write(&file, written.to_string())
        .map_err(|e| Error::io(file.display().to_string(), e))?;
    Ok(())
}
