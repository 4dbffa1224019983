//! Collectives over Candle tensors.
//!
//! One [`Communicator`] trait; backends implement it for one group of ranks:
//! - [`inprocess`]: ranks are threads of one process (fast numerical tests);
//! - [`host`]: ranks are processes talking TCP (CPU training, multi-node capable);
//! - [`nccl`]: ranks are GPUs (feature `nccl`; libnccl is loaded at run time).
//!
//! Both CPU backends share the ring algorithms of [`ring`] over a byte [`transport`].
//! Every rank of a group must issue the same collectives in the same order, as with NCCL;
//! a mismatch is detected (operation and size travel with each message) and reported.

pub mod autograd;
mod elem;
pub mod host;
pub mod inprocess;
pub mod nccl;
mod queue;
mod ring;
mod shm;
pub mod store;
pub mod timed;
mod transport;

use crate::error::Result;
use candle_core::{DType, Device, Shape, Tensor};

pub use host::HostBackend;
pub use inprocess::InProcessWorld;
pub use queue::{CommQueue, Pending};
pub use shm::resident_bytes as shared_memory_bytes;
pub use timed::Timed;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size.
    Avg,
    Max,
    Min,
}

/// The collectives one group of ranks can run together. Ranks are numbered 0..size() inside
/// the group. Inputs may be any dtype the backend supports (f32, f64, bf16, f16, u8, u32, i64),
/// contiguous or not, on any device; outputs are on the input's device.
pub trait Communicator: Send + Sync {
    /// This process's rank inside the group.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Backend name for logs and benchmarks ("inprocess", "host", "nccl").
    fn backend(&self) -> &'static str;
    /// The group's name (which mesh axes and ranks), for messages.
    fn name(&self) -> &str;

    /// Element-wise reduction of `x` over all ranks; every rank gets the result.
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Concatenation of every rank's `x` along `dim`, in rank order (shapes must be equal).
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor>;
    /// Reduction of `x` over ranks, split along `dim` in size() equal chunks; rank r gets chunk r.
    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor>;
    /// `root`'s `x` on every rank; the others pass a tensor of the same shape and dtype.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor>;
    fn send(&self, x: &Tensor, dst: usize) -> Result<()>;
    fn recv(&self, shape: &Shape, dtype: DType, device: &Device, src: usize) -> Result<Tensor>;
    /// Sends `x` to `dst` while receiving a tensor of the same shape from `src` (ring shifts).
    fn send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor>;
    /// Splits `x` along `split_dim` into size() chunks, sends chunk j to rank j, and concatenates
    /// the chunks received along `concat_dim` in rank order. The inverse swaps the two dims.
    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor>;
    fn barrier(&self) -> Result<()>;
}
