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
    /// Uneven all-to-all over rows (torch's `all_to_all_single` with split sizes): the first
    /// `counts[0]` rows of `x` [n, ...] go to rank 0, the next `counts[1]` to rank 1, ...
    /// (`counts` sums to n; zeros allowed). The counts are exchanged first. Returns the rows
    /// every rank sent here, concatenated in rank order, and how many came from each. By
    /// default one even [`Self::all_to_all`] of chunks padded to the largest count.
    fn all_to_all_v(&self, x: &Tensor, counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        padded_all_to_all_v(self, x, counts)
    }
}

/// Every rank's `counts` of an uneven all-to-all of `x`'s rows (checked: one per rank, summing
/// to the rows): entry j * size + k is what rank j sends rank k.
pub(crate) fn exchange_counts<C: Communicator + ?Sized>(
    comm: &C,
    x: &Tensor,
    counts: &[usize],
) -> Result<Vec<usize>> {
    let (n, rank) = (comm.size(), comm.rank());
    let rows = x.dim(0)?;
    if counts.len() != n || counts.iter().sum::<usize>() != rows {
        return Err(crate::error::Error::Parallelism(format!(
            "all_to_all_v on {}: rank {rank} gives counts {counts:?} for {rows} rows: give one count per rank ({n}), summing to the rows",
            comm.name()
        )));
    }
    let mine: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
    let all: Vec<u32> = comm
        .all_gather(&Tensor::new(mine, x.device())?, 0)?
        .to_vec1()?;
    Ok(all.into_iter().map(|c| c as usize).collect())
}

/// [`Communicator::all_to_all_v`] through an even all-to-all: every chunk padded with zeros to
/// the largest count of any rank, the padding dropped on arrival.
fn padded_all_to_all_v<C: Communicator + ?Sized>(
    comm: &C,
    x: &Tensor,
    counts: &[usize],
) -> Result<(Tensor, Vec<usize>)> {
    let (n, all) = (comm.size(), exchange_counts(comm, x, counts)?);
    let recv: Vec<usize> = (0..n).map(|j| all[j * n + comm.rank()]).collect();
    let chunk = all.iter().copied().max().unwrap_or(0);
    if chunk == 0 {
        return Ok((x.narrow(0, 0, 0)?, recv));
    }
    let mut tail = x.dims().to_vec();
    let mut parts = Vec::with_capacity(2 * n);
    let mut at = 0;
    for &c in counts {
        parts.push(x.narrow(0, at, c)?);
        tail[0] = chunk - c;
        parts.push(Tensor::zeros(tail.as_slice(), x.dtype(), x.device())?);
        at += c;
    }
    let out = comm.all_to_all(&Tensor::cat(&parts, 0)?, 0, 0)?;
    let kept: Vec<Tensor> = recv
        .iter()
        .enumerate()
        .map(|(j, &c)| out.narrow(0, j * chunk, c))
        .collect::<candle_core::Result<_>>()?;
    Ok((Tensor::cat(&kept, 0)?, recv))
}
