//! The gated delta rule on CUDA (`kernels/gated_delta.cu`): the launches behind
//! `kernels::gated_delta`'s op on a GPU, with the CPU kernel's inputs, outputs and tiling (one
//! warp per block of 32 state columns, checkpoints every 16 tokens), f32 only (the layer runs
//! the rule in f32 for every model dtype). Compiled in CI, to be run on the first GPU
//! (scripts/gpu-run); the algorithm is the CPU kernel's, proven there against the recurrence,
//! and the kernels' own arrangement runs on the CPU lane by lane in
//! `gated_delta::cuda_emulation`, equal to the CPU kernel.

use super::cuda_fused::view;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gated_delta.ptx"));
const MODULE: &str = "trl_gated_delta";
/// The kernels' block of state columns, checkpoint interval and largest key dim.
const COLS: usize = 32;
const PAD: usize = 33;
const CK: usize = 16;
pub const MAX_DK: usize = 128;

/// One call's sizes: heads, tokens per row, key and value dims, and per row and token
/// whether a document starts there.
pub struct Sizes<'a> {
    pub heads: usize,
    pub seq: usize,
    pub dk: usize,
    pub dv: usize,
    pub starts: &'a [bool],
}

impl Sizes<'_> {
    fn check(&self, dtype: DType) -> Result<()> {
        if dtype != DType::F32 || self.dk > MAX_DK {
            bail!(
                "the CUDA gated delta rule takes f32 and key dims up to {MAX_DK} (got {dtype:?}, {})",
                self.dk
            );
        }
        Ok(())
    }

    fn ints(&self) -> [i32; 4] {
        [self.heads, self.seq, self.dk, self.dv].map(|n| n as i32)
    }

    fn blocks(&self) -> usize {
        self.dv.div_ceil(COLS)
    }
}

/// The forward: packed tokens `x` [bh, seq, 2 dk + dv + 2] and initial state `s0` [bh, dk,
/// dv] to the outputs then the final state, [bh, seq + dk, dv].
pub fn forward(
    sizes: &Sizes,
    (xs, xl): (&CudaStorage, &Layout),
    (ss, sl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    sizes.check(xs.dtype())?;
    let dev = xs.device().clone();
    let (x, s0) = (view::<f32>(xs, xl)?, view::<f32>(ss, sl)?);
    let tasks = xl.shape().elem_count() / (sizes.seq * (2 * sizes.dk + sizes.dv + 2));
    let starts: Vec<u8> = sizes.starts.iter().map(|&s| u8::from(s)).collect();
    let starts = dev.cuda_stream().clone_htod(&starts).w()?;
    // SAFETY: every element is written by the kernel (outputs and final state, live columns).
    let out = unsafe { dev.alloc::<f32>(tasks * (sizes.seq + sizes.dk) * sizes.dv)? };
    let f = dev.get_or_load_custom_func("gdr_fwd", MODULE, PTX)?;
    let mut lb = f.builder();
    lb.arg(&x).arg(&s0).arg(&starts).arg(&out);
    let ints = sizes.ints();
    for n in &ints {
        lb.arg(n);
    }
    let cfg = LaunchConfig {
        grid_dim: (tasks as u32, sizes.blocks() as u32, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match gdr_fwd's signature; dk <= MAX_DK (checked).
    unsafe { lb.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The backward: `x`, `s0` as [`forward`] and the outputs' gradient [bh, seq + dk, dv] to the
/// packed tokens' gradient then the initial state's, [bh, seq * w + dk * dv].
pub fn backward(
    sizes: &Sizes,
    (xs, xl): (&CudaStorage, &Layout),
    (ss, sl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    sizes.check(xs.dtype())?;
    let dev = xs.device().clone();
    let (x, s0, grad) = (
        view::<f32>(xs, xl)?,
        view::<f32>(ss, sl)?,
        view::<f32>(gs, gl)?,
    );
    let (seq, dk, dv) = (sizes.seq, sizes.dk, sizes.dv);
    let w = 2 * dk + dv + 2;
    let tasks = xl.shape().elem_count() / (seq * w);
    let blocks = sizes.blocks();
    let starts: Vec<u8> = sizes.starts.iter().map(|&s| u8::from(s)).collect();
    let starts = dev.cuda_stream().clone_htod(&starts).w()?;
    // SAFETY: gdr_bwd writes the initial state's gradient, gdr_sum every token's.
    let out = unsafe { dev.alloc::<f32>(tasks * (seq * w + dk * dv))? };
    // Zeroed: a block writes dv only for its own columns.
    let part = dev.alloc_zeros::<f32>(tasks * blocks * seq * w)?;
    // SAFETY: scratch, each element written before it is read.
    let ck = unsafe { dev.alloc::<f32>(tasks * blocks * seq.div_ceil(CK) * dk * PAD)? };
    let sp = unsafe { dev.alloc::<f32>(tasks * blocks * CK * dk * PAD)? };
    let f = dev.get_or_load_custom_func("gdr_bwd", MODULE, PTX)?;
    let mut lb = f.builder();
    lb.arg(&x)
        .arg(&s0)
        .arg(&grad)
        .arg(&starts)
        .arg(&out)
        .arg(&part)
        .arg(&ck)
        .arg(&sp);
    let ints = sizes.ints();
    for n in &ints {
        lb.arg(n);
    }
    let cfg = LaunchConfig {
        grid_dim: (tasks as u32, blocks as u32, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match gdr_bwd's signature; dk <= MAX_DK (checked).
    unsafe { lb.launch(cfg) }.w()?;
    let f = dev.get_or_load_custom_func("gdr_sum", MODULE, PTX)?;
    let mut lb = f.builder();
    let (tasks_i, blocks_i) = (tasks as i32, blocks as i32);
    let (seq_i, dk_i, dv_i) = (seq as i32, dk as i32, dv as i32);
    lb.arg(&part)
        .arg(&out)
        .arg(&tasks_i)
        .arg(&blocks_i)
        .arg(&seq_i)
        .arg(&dk_i)
        .arg(&dv_i);
    let n = (tasks * seq * w) as u32;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match gdr_sum's signature, one thread per element.
    unsafe { lb.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
