//! Trainable decoder-only models in Hugging Face formats, loaded from and saved to
//! `model.safetensors` or a sharded `model.safetensors.index.json` with HF tensor names:
//! any model implementing [`CausalModel`] (trained as a `crate::parallel::Model`), and the built-in Llama /
//! Qwen2 decoder (one implementation, the differences are configuration).

pub mod auto;
pub mod blocks;
pub mod causal;
pub mod composite;
pub mod config;
pub mod gemma3;
pub mod gpt_oss;
pub mod llama;
pub mod merge;
pub mod mixtral;
pub mod moe;
pub mod mxfp4;
pub mod olmo2;
pub mod params;
pub mod peft;
pub mod peft_experts;
pub mod phi3;
pub mod qwen3_moe;
pub mod router_loss;
pub mod tensor_file;

pub use auto::{model_types, AutoModelForCausalLM};
pub use causal::{CausalModel, LayerInputs};
pub use config::{Architecture, ModelConfig};
pub use gemma3::Gemma3;
pub use llama::Llama;
pub use params::Params;
