//! The main job with your own model: the Phi-style decoder of `trl_examples::phi` (written
//! the plain Candle way, annotated) fine-tuned by the same SFT trainer, under any profile:
//! `cargo trl launch --profile fsdp2_cpu sft_phi`. Without a launcher it spawns 2 local ranks.

use std::process::ExitCode;
use trl_examples::phi::Phi;
use trl_examples::sft;
use trl_runtime::train::SFTConfig;

/// The embedded job on the bundled tiny Phi (same tokenizer and data).
fn defaults() -> trl_runtime::Result<SFTConfig> {
    let mut config = sft::embedded_defaults()?;
    config.training.model_name_or_path =
        trl_examples::assets::default_dir().join("../tiny-phi/model");
    config.training.output_dir = "output/sft-tiny-phi".into();
    Ok(config)
}

fn main() -> ExitCode {
    sft::main::<Phi>(defaults)
}
