//! Differentiable collectives: Candle custom ops whose backward pass is the adjoint collective,
//! so `Tensor::backward` carries gradients across ranks (Megatron's f and g, and the pairs that
//! sequence and context parallelism need).
//!
//! The forward collective runs eagerly on detached data; the result is attached to the input
//! through [`WithBackward`], a two-argument op that returns its second argument and, in
//! backward, maps the output gradient to the input gradient with the adjoint collective.
//! Every rank must run the same backward graph, so the adjoint collectives line up.

use super::{Communicator, ReduceOp};
use crate::error::Result;
use crate::precomputed::copy_storage;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, Layout, Shape, Tensor};
use std::sync::Arc;

/// The adjoint applied to the output gradient.
#[derive(Clone, Debug)]
enum Adjoint {
    Identity,
    AllReduce,
    ReduceScatter {
        dim: usize,
    },
    AllGather {
        dim: usize,
    },
    AllToAll {
        split_dim: usize,
        concat_dim: usize,
    },
    Shift {
        offset: isize,
    },
    /// The uneven all-to-all back: each rank's rows returned to it (`counts`: how many came
    /// from each rank).
    AllToAllV {
        counts: Vec<usize>,
    },
    /// Keep this rank's chunk along `dim` (the gradient of a gather whose result every rank
    /// uses whole, so every rank holds the same full gradient).
    Split {
        dim: usize,
    },
}

struct WithBackward {
    comm: Arc<dyn Communicator>,
    adjoint: Adjoint,
}

/// Sends to rank + offset and receives from rank - offset (modulo the group size).
fn shift(comm: &dyn Communicator, x: &Tensor, offset: isize) -> Result<Tensor> {
    let n = comm.size() as isize;
    let r = comm.rank() as isize;
    let dst = (r + offset).rem_euclid(n) as usize;
    let src = (r - offset).rem_euclid(n) as usize;
    if dst == comm.rank() {
        return Ok(x.clone());
    }
    comm.send_recv(x, dst, src)
}

impl CustomOp2 for WithBackward {
    fn name(&self) -> &'static str {
        "differentiable-collective"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        copy_storage(s2, l2)
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        copy_storage(s2, l2)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _value: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let c = self.comm.as_ref();
        let g = match &self.adjoint {
            Adjoint::Identity => Ok(grad.clone()),
            Adjoint::AllReduce => c.all_reduce(grad, ReduceOp::Sum),
            Adjoint::ReduceScatter { dim } => c.reduce_scatter(grad, *dim, ReduceOp::Sum),
            Adjoint::AllGather { dim } => c.all_gather(grad, *dim),
            Adjoint::AllToAll {
                split_dim,
                concat_dim,
            } => c.all_to_all(grad, *split_dim, *concat_dim),
            Adjoint::AllToAllV { counts } => c.all_to_all_v(grad, counts).map(|(g, _)| g),
            Adjoint::Shift { offset } => shift(c, grad, *offset),
            Adjoint::Split { dim } => {
                let chunk = grad.dim(*dim)? / c.size();
                Ok(grad.narrow(*dim, c.rank() * chunk, chunk)?)
            }
        }
        .map_err(|e| e.into_candle())?;
        Ok((Some(g), None))
    }
}

fn attach(
    x: &Tensor,
    value: Tensor,
    comm: &Arc<dyn Communicator>,
    adjoint: Adjoint,
) -> Result<Tensor> {
    // Candle records the op for backprop only when `x` is tracked; `value` never is.
    let op = WithBackward {
        comm: comm.clone(),
        adjoint,
    };
    Ok(x.apply_op2(&value, op)?)
}

/// Megatron's f: identity forward, all-reduce (sum) of the gradient backward. Put it where a
/// replicated activation enters tensor-parallel layers.
pub fn copy_to_group(x: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    attach(x, x.detach(), comm, Adjoint::AllReduce)
}

/// Megatron's g: all-reduce (sum) forward, identity backward. Put it where partial results of
/// tensor-parallel layers are combined.
pub fn reduce_from_group(x: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    let value = comm.all_reduce(&x.detach(), ReduceOp::Sum)?;
    attach(x, value, comm, Adjoint::Identity)
}

/// All-gather along `dim` forward; reduce-scatter (sum) of the gradient backward.
pub fn all_gather(x: &Tensor, comm: &Arc<dyn Communicator>, dim: usize) -> Result<Tensor> {
    let value = comm.all_gather(&x.detach(), dim)?;
    attach(x, value, comm, Adjoint::ReduceScatter { dim })
}

/// Megatron's gather: all-gather along `dim` forward; backward keeps this rank's chunk of the
/// gradient (the ranks compute the same thing from the gathered value, so the gradient is
/// already whole on each). Put it after a column-parallel layer whose output is needed whole.
pub fn gather_from_group(x: &Tensor, comm: &Arc<dyn Communicator>, dim: usize) -> Result<Tensor> {
    let value = comm.all_gather(&x.detach(), dim)?;
    attach(x, value, comm, Adjoint::Split { dim })
}

/// Reduce-scatter (sum) along `dim` forward; all-gather of the gradient backward.
pub fn reduce_scatter(x: &Tensor, comm: &Arc<dyn Communicator>, dim: usize) -> Result<Tensor> {
    let value = comm.reduce_scatter(&x.detach(), dim, ReduceOp::Sum)?;
    attach(x, value, comm, Adjoint::AllGather { dim })
}

/// All-to-all (split `split_dim`, concatenate `concat_dim`) forward; the inverse all-to-all of
/// the gradient backward.
pub fn all_to_all(
    x: &Tensor,
    comm: &Arc<dyn Communicator>,
    split_dim: usize,
    concat_dim: usize,
) -> Result<Tensor> {
    let value = comm.all_to_all(&x.detach(), split_dim, concat_dim)?;
    attach(
        x,
        value,
        comm,
        Adjoint::AllToAll {
            split_dim: concat_dim,
            concat_dim: split_dim,
        },
    )
}

/// Uneven all-to-all over rows forward ([`Communicator::all_to_all_v`]: the received rows and
/// how many came from each rank); each rank's rows back to it in backward (expert
/// parallelism's dispatch and combine).
pub fn all_to_all_v(
    x: &Tensor,
    comm: &Arc<dyn Communicator>,
    counts: &[usize],
) -> Result<(Tensor, Vec<usize>)> {
    let (value, recv) = comm.all_to_all_v(&x.detach(), counts)?;
    let adjoint = Adjoint::AllToAllV {
        counts: recv.clone(),
    };
    Ok((attach(x, value, comm, adjoint)?, recv))
}

/// Ring shift: rank r receives the `x` of rank r - offset forward; the gradient goes back the
/// other way (rank r + offset).
pub fn ring_shift(x: &Tensor, comm: &Arc<dyn Communicator>, offset: isize) -> Result<Tensor> {
    let value = shift(comm.as_ref(), &x.detach(), offset)?;
    attach(x, value, comm, Adjoint::Shift { offset: -offset })
}
