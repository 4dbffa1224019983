//! The CPU and CUDA kernels behind the layers of `crate::nn`: fused element-wise ops (RMSNorm,
//! SwiGLU, rotary, bias) with their backward passes, the flash attention kernels (CPU, and
//! CUDA from flash.cu), the gated delta rule, the causal softmax, GEMM helpers and the dtype rules of mixed
//! precision. Kernels know tensors and storage, never layers or strategies.

pub mod cpu_flash;
pub(crate) mod cpu_gemm;
#[cfg(feature = "cuda")]
pub mod cuda_decode;
#[cfg(feature = "cuda")]
pub mod cuda_flash;
#[cfg(feature = "cuda")]
pub mod cuda_fused;
#[cfg(feature = "cuda")]
pub mod cuda_gated_delta;
pub mod decode;
pub mod divergence;
pub mod fused;
pub mod gated_delta;
pub mod grouped;
pub(crate) mod op;
pub(crate) mod precision;
mod simd;
pub mod sinks;
pub mod skinny;
/// The Hopper attention kernels' index arithmetic, proven on the CPU (test only).
#[cfg(test)]
mod sm90_layout;
pub mod softmax;
#[cfg(test)]
pub(crate) mod testing;
