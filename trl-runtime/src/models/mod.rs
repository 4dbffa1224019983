//! Trainable decoder-only models in Hugging Face formats, loaded from and saved to
//! `model.safetensors` or a sharded `model.safetensors.index.json` with HF tensor names:
//! any model implementing [`CausalModel`] (trained as a `crate::parallel::Model`), and the built-in Llama /
//! Qwen2 decoder (one implementation, the differences are configuration).

pub mod adapters;
pub mod arch;
pub mod auto;
pub mod causal;
pub mod config;
pub mod generate;
pub mod sequence_classification;
pub mod weights;

// The catalogue by group (architectures, weights I/O, adapters), each module also where it
// always was.
pub use adapters::{merge, peft, peft_experts};
pub use arch::{
    blocks, deepseek_moe, deepseek_v3, gated_deltanet, gemma3, gemma4, glm4_moe, gpt_oss, llama,
    llama4, mistral4, mixtral, moe, olmo2, phi3, qwen3_moe, qwen3_next, router_loss,
};
pub use weights::{composite, mxfp4, params, tensor_file};

pub use auto::{model_types, AutoModelForCausalLM};
pub use causal::{CausalModel, LayerInputs};
pub use config::{Architecture, ModelConfig};
pub use gemma3::Gemma3;
pub use generate::Generate;
pub use llama::Llama;
pub use params::Params;
pub use sequence_classification::AutoModelForSequenceClassification;
