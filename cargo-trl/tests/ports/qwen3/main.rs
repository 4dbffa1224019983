//! The scaffold's main (`cargo trl new --model plain-candle`), training the ported Qwen3.
//! With PORT_PARITY=FILE it instead prints the largest difference between the port's logits
//! (the training path, and the cached forward's last position) and transformers' in FILE.

use qwen3_port::models::qwen3::ModelForCausalLM;
use std::process::ExitCode;
use trl_runtime::dist::DistContext;
use trl_runtime::train::{SFTConfig, SftCli, TrainerConfig, Trainer};

fn run() -> trl_runtime::Result<()> {
    // TRL's flags over sft.yaml (or --config FILE); keys without effect are named on rank 0.
    let mut cli = SftCli::parse_trl();
    cli.config.get_or_insert("sft.yaml".into());
    let config = SFTConfig::from_cli(&cli)?;
    if let Ok(file) = std::env::var("PORT_PARITY") {
        return parity(&config, &file);
    }
    let ctx = DistContext::from_env()?;
    trl_runtime::train::logging::init(ctx.rank());
    let mut trainer = Trainer::<ModelForCausalLM>::load(config, &ctx)?;
    trainer.train()?;
    Ok(())
}

fn parity(config: &SFTConfig, file: &str) -> trl_runtime::Result<()> {
    use trl_runtime::candle_core::{DType, Device, Tensor};
    let dev = Device::Cpu;
    let model = trl_runtime::parallel::Model::<ModelForCausalLM>::from_pretrained(
        &config.training.model_name_or_path,
        DType::F32,
        &dev,
    )?;
    let want = trl_runtime::candle_core::safetensors::load(file, &dev)?;
    let ids = want["input_ids"].to_dtype(DType::U32)?;
    let (b, s) = ids.dims2()?;
    let pos = Tensor::arange(0i64, s as i64, &dev)?
        .unsqueeze(0)?
        .repeat((b, 1))?;
    let logits = &want["logits"];
    let diff = |a: &Tensor, b: &Tensor| -> trl_runtime::Result<f32> {
        Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
    };
    let train = diff(&model.forward(&ids, &pos)?, logits)?;
    // The cached forward as written upstream: last position's logits, row by row.
    let mut cached = model.net().clone();
    let mut worst = 0f32;
    for r in 0..b {
        let last = cached.forward(&ids.narrow(0, r, 1)?, 0)?;
        cached.clear_kv_cache();
        let want = logits.narrow(0, r, 1)?.narrow(1, s - 1, 1)?;
        worst = worst.max(diff(&last, &want)?);
    }
    println!("parity: training path {train:e}, cached forward {worst:e}");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
