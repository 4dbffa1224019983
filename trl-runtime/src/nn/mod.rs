//! Differentiable building blocks of the decoder models. Everything here is made of Candle ops
//! that have a backward pass (Candle's fused `softmax_last_dim`, `rms_norm` and `rope` kernels
//! silently drop gradients, so they are not used).

pub mod attention;
pub mod cpu_flash;
pub(crate) mod cpu_gemm;
#[cfg(feature = "cuda")]
pub mod cuda_flash;
#[cfg(feature = "cuda")]
pub mod cuda_fused;
pub mod embedding;
pub mod flash;
pub mod fused;
pub mod layernorm;
pub mod linear;
pub mod loss;
pub mod mask;
pub(crate) mod memo;
pub mod module;
pub(crate) mod precision;
pub mod ring;
pub mod rmsnorm;
pub mod rope;
pub mod rotary_emb;
pub mod seq_attention;
pub mod sharded;
mod simd;
pub mod softmax;
#[cfg(test)]
pub(crate) mod testing;
pub mod tiled_loss;
pub mod tiled_mlp;
pub mod ulysses;
pub mod utils;
pub mod weight;
pub mod with_tracing;

pub use attention::{attention, AttentionImpl};
pub use embedding::{embedding, Embedding};
pub use flash::flash_attention;
pub use layernorm::{layer_norm, LayerNorm};
pub use linear::{linear, linear_no_bias, Linear};
pub use loss::{causal_lm_loss, LossSum, IGNORE_INDEX};
pub use mask::AttentionMask;
pub use module::Parallelize;
pub use rmsnorm::{rms_norm, RmsNorm};
pub use rope::{RopeScaling, RotaryEmbedding};
pub use seq_attention::flash_attn;
pub use tiled_loss::tiled_linear_cross_entropy;
pub use weight::Weight;
