//! Gradient checks of the differentiable collectives: autograd on every rank against central
//! finite differences of the total objective, in f64 on in-process ranks (and once over TCP).
//!
//! Objectives follow how each op is used: for most ops the total loss is the sum of the ranks'
//! local losses; Megatron's f (copy_to_group) takes an input replicated on all ranks, and g
//! (reduce_from_group) produces a replicated output whose loss counts once.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{run, Backend};
use std::sync::Arc;
use trl_runtime::comm::{autograd, Communicator, ReduceOp};

type Op = fn(&Tensor, &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor>;

#[derive(Clone, Copy, PartialEq)]
enum Objective {
    /// Total = sum over ranks of <w_r, y_r>; each rank owns its input.
    SumOfLocal,
    /// Input replicated: perturbing it perturbs every rank's copy.
    ReplicatedInput,
    /// Output replicated and w the same on all ranks: the loss counts once.
    ReplicatedOutput,
}

const SHAPE: (usize, usize) = (4, 6);
const EPS: f64 = 1e-6;

fn base_input(rank: usize, objective: Objective) -> Vec<f64> {
    let r = if objective == Objective::ReplicatedInput {
        0
    } else {
        rank
    };
    (0..24)
        .map(|i| ((i * 31 + r * 17) % 23) as f64 / 7.0 - 1.5)
        .collect()
}

fn weights(rank: usize, len: usize, objective: Objective) -> Vec<f64> {
    let r = if objective == Objective::ReplicatedOutput {
        0
    } else {
        rank
    };
    (0..len)
        .map(|i| ((i * 13 + r * 29 + 5) % 19) as f64 / 5.0 - 1.8)
        .collect()
}

/// Local loss <w_r, op(x)>, computed so that its total over ranks is the objective.
fn local_loss(
    op: Op,
    comm: &Arc<dyn Communicator>,
    x: &Tensor,
    objective: Objective,
) -> (Tensor, f64) {
    let y = op(x, comm).unwrap();
    let w = Tensor::from_vec(
        weights(comm.rank(), y.elem_count(), objective),
        y.shape(),
        &Device::Cpu,
    )
    .unwrap();
    let loss = (y * w).unwrap().sum_all().unwrap();
    let value = loss.to_scalar::<f64>().unwrap();
    (loss, value)
}

fn total(comm: &Arc<dyn Communicator>, value: f64, objective: Objective) -> f64 {
    let t = Tensor::new(&[value], &Device::Cpu).unwrap();
    let op = if objective == Objective::ReplicatedOutput {
        ReduceOp::Avg
    } else {
        ReduceOp::Sum
    };
    comm.all_reduce(&t, op).unwrap().to_vec1::<f64>().unwrap()[0]
}

fn grad_check(backend: Backend, n: usize, name: &str, op: Op, objective: Objective) {
    run(backend, n, |rank, comm| {
        let data = base_input(rank, objective);
        let x = Var::from_vec(data.clone(), SHAPE, &Device::Cpu).unwrap();
        let (loss, _) = local_loss(op, &comm, x.as_tensor(), objective);
        let grads = loss.backward().unwrap();
        let analytic: Vec<f64> = grads
            .get(x.as_tensor())
            .expect("gradient for x")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();

        // Finite differences: every rank walks the same list of (owner, index) perturbations.
        let owners: Vec<usize> = if objective == Objective::ReplicatedInput {
            vec![usize::MAX]
        } else {
            (0..n).collect()
        };
        for &owner in &owners {
            for i in 0..data.len() {
                let mut f = [0.0; 2];
                for (k, sign) in [1.0, -1.0].iter().enumerate() {
                    let mut d = data.clone();
                    if owner == usize::MAX || owner == rank {
                        d[i] += sign * EPS;
                    }
                    let xt = Tensor::from_vec(d, SHAPE, &Device::Cpu)
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap();
                    let (_, v) = local_loss(op, &comm, &xt, objective);
                    f[k] = total(&comm, v, objective);
                }
                let numeric = (f[0] - f[1]) / (2.0 * EPS);
                if owner == usize::MAX || owner == rank {
                    let a = analytic[i];
                    assert!(
                        (a - numeric).abs() < 1e-6 * numeric.abs().max(1.0),
                        "{name} on {n} ranks ({backend:?}): rank {rank} element {i}: autograd {a} vs finite difference {numeric}"
                    );
                }
            }
        }
    });
}

fn gather0(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    autograd::all_gather(x, c, 0)
}
fn gather1(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    autograd::all_gather(x, c, 1)
}
/// Reduce-scatter along dim 1 of a [4, 6*n]-shaped tensor built by repeating x (so any n divides).
fn scatter1(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    let xs = Tensor::cat(&vec![x.clone(); c.size()], 1)?;
    autograd::reduce_scatter(&(xs * 1.5)?, c, 1)
}
fn to_all(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    let xs = Tensor::cat(&vec![x.clone(); c.size()], 0)?;
    let y = autograd::all_to_all(&xs, c, 0, 1)?;
    Ok(y.sqr()?) // a non-linear consumer, so the adjoint routing matters
}
/// Uneven rows per rank (zeros among them): rank r sends (r + j) % 3 rows to rank j of
/// SHAPE's first dim repeated, the rest to the last rank.
fn to_all_v(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    let (n, r) = (c.size(), c.rank());
    let xs = Tensor::cat(&vec![x.clone(); n], 0)?;
    let rows = xs.dim(0)?;
    let mut counts: Vec<usize> = (0..n).map(|j| (r + j) % 3).collect();
    counts[n - 1] = rows - counts[..n - 1].iter().sum::<usize>();
    let (y, _) = autograd::all_to_all_v(&xs, c, &counts)?;
    Ok(y.sqr()?)
}
fn shift_fwd(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    autograd::ring_shift(&x.sqr()?, c, 1)
}
fn shift_back2(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    autograd::ring_shift(x, c, -2)
}
fn copy_to(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    // Each rank multiplies by its own factor, like a column-parallel shard.
    Ok((autograd::copy_to_group(x, c)? * (c.rank() as f64 + 1.0))?)
}
fn reduce_from(x: &Tensor, c: &Arc<dyn Communicator>) -> trl_runtime::Result<Tensor> {
    let y = autograd::reduce_from_group(&(x * (c.rank() as f64 + 0.5))?, c)?;
    Ok(y.sqr()?)
}

#[test]
fn differentiable_collectives_match_finite_differences() {
    let cases: [(&str, Op, Objective); 9] = [
        ("copy_to_group", copy_to, Objective::ReplicatedInput),
        ("all_to_all_v", to_all_v, Objective::SumOfLocal),
        (
            "reduce_from_group",
            reduce_from,
            Objective::ReplicatedOutput,
        ),
        ("all_gather dim 0", gather0, Objective::SumOfLocal),
        ("all_gather dim 1", gather1, Objective::SumOfLocal),
        ("reduce_scatter dim 1", scatter1, Objective::SumOfLocal),
        ("all_to_all", to_all, Objective::SumOfLocal),
        ("ring_shift +1", shift_fwd, Objective::SumOfLocal),
        ("ring_shift -2", shift_back2, Objective::SumOfLocal),
    ];
    for n in [2, 3] {
        for (name, op, objective) in cases {
            grad_check(Backend::InProcess, n, name, op, objective);
        }
    }
}

#[test]
fn differentiable_collectives_over_tcp() {
    grad_check(
        Backend::Host,
        2,
        "all_to_all over TCP",
        to_all,
        Objective::SumOfLocal,
    );
    grad_check(
        Backend::Host,
        2,
        "reduce_from_group over TCP",
        reduce_from,
        Objective::ReplicatedOutput,
    );
}
