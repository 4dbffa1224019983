//! The built-in architectures, one file each (Llama / Qwen2 / Mistral / ... in `llama`), and the
//! blocks they share: attention and MLP layers under a generic decoder (`blocks`), mixtures of
//! experts (`moe`: softmax routers; `deepseek_moe`: DeepSeek's sigmoid, group-limited one)
//! and their router loss.

pub mod blocks;
pub mod deepseek_moe;
pub mod deepseek_v3;
pub mod gated_deltanet;
pub mod gemma3;
pub mod gemma4;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod llama;
pub mod llama4;
pub mod mistral4;
pub mod mixtral;
pub mod moe;
pub mod olmo2;
pub mod phi3;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod router_loss;
