//! Differentiable building blocks of the decoder models: the layers a model is written with
//! (linear, embedding, norms, rotary, attention's API, the loss), built on `crate::kernels`. Everything here is made of Candle ops
//! that have a backward pass (Candle's fused `softmax_last_dim`, `rms_norm` and `rope` kernels
//! silently drop gradients, so they are not used).

pub mod attention;
pub mod chain;
pub mod divergence;
pub mod embedding;
pub mod embedding_adapter;
pub mod flash;
pub mod flash_attn;
pub mod gated;
pub mod gated_delta;
pub mod grouped;
pub mod kv_cache;
pub mod layernorm;
pub mod linear;
pub mod lora;
pub mod loss;
pub mod mask;
pub(crate) mod memo;
pub mod module;
pub mod param;
pub mod rmsnorm;
pub mod rope;
pub mod rotary_emb;
pub mod sharded;
pub mod tiled_loss;
pub mod tiled_mlp;
pub mod utils;
pub mod weight;
pub mod with_tracing;

pub use attention::{attention, AttentionImpl};
pub use embedding::{embedding, Embedding};
pub use flash::flash_attention;
pub use flash_attn::flash_attn;
pub use kv_cache::KvCache;
pub use layernorm::{layer_norm, LayerNorm};
pub use linear::{linear, linear_no_bias, Linear};
pub use loss::{causal_lm_loss, LossSum, IGNORE_INDEX};
pub use mask::{AttentionMask, Window, WithScoreMods};
pub use module::Parallelize;
pub use param::Param;
pub use rmsnorm::{rms_norm, RmsNorm};
pub use rope::{RopeScaling, RotaryEmbedding};
pub use tiled_loss::tiled_linear_cross_entropy;
pub use weight::Weight;
