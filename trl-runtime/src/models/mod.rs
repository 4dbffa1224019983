//! Trainable decoder-only models in Hugging Face formats: Llama and Qwen2 (one implementation,
//! the differences are configuration), built from `config.json`, loaded from and saved to
//! `model.safetensors` or a sharded `model.safetensors.index.json` with HF tensor names.

pub mod config;
pub mod decoder;
pub mod params;

pub use config::{Architecture, ModelConfig};
pub use decoder::CausalLm;
pub use params::Params;
