//! The built-in architectures, one file each (Llama / Qwen2 / Mistral / ... in `llama`), and the
//! blocks they share: attention and MLP layers under a generic decoder (`blocks`), mixtures of
//! experts (`moe`) and their router loss.

pub mod blocks;
pub mod gemma3;
pub mod gpt_oss;
pub mod llama;
pub mod mixtral;
pub mod moe;
pub mod olmo2;
pub mod phi3;
pub mod qwen3_moe;
pub mod router_loss;
