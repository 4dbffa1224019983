//! Every collective against the same computation done serially: the check the CPU backends
//! run on 2-4 ranks (collectives.rs) and NCCL between launched GPU processes (gpu.rs).

use candle_core::{DType, Device, Tensor};
use trl_runtime::comm::{Communicator, ReduceOp};

/// Rank r's input: a seeded random [4, 6] tensor (or a transposed [6, 4] view of one).
pub fn input(rank: usize, transposed: bool, dtype: DType) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + rank as u64);
    // Random multiples of 1/4 in [-4, 4]: sums over 4 ranks are exact in bf16 and f16, so
    // every dtype compares against the serial result without rounding slack.
    let vals: Vec<f32> = (0..24)
        .map(|_| rng.random_range(-16i32..=16) as f32 / 4.0)
        .collect();
    let t = Tensor::from_vec(vals, (4, 6), &Device::Cpu).unwrap();
    let t = if transposed { t.t().unwrap() } else { t };
    assert_eq!(t.is_contiguous(), !transposed);
    t.to_dtype(dtype).unwrap()
}

pub fn assert_same(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let values = |t: &Tensor| -> Vec<f32> {
        let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        t.to_vec1().unwrap()
    };
    let (g, w) = (values(got), values(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what}: element {i}: {a} != {b}"
        );
    }
}

fn serial_sum(n: usize, transposed: bool, dtype: DType) -> Tensor {
    let mut acc = input(0, transposed, DType::F32);
    for r in 1..n {
        acc = (acc + input(r, transposed, DType::F32)).unwrap();
    }
    acc.to_dtype(dtype).unwrap()
}

/// Every collective of `comm` (this rank's view of a group of `n`) against the same
/// computation done serially, on inputs on `device`; `what` names the backend in messages.
pub fn check_collectives(
    comm: &dyn Communicator,
    what: &str,
    transposed: bool,
    dtype: DType,
    device: &Device,
) {
    let (rank, n) = (comm.rank(), comm.size());
    let ctx = format!("{what} n={n} transposed={transposed} {dtype:?}");
    let x = input(rank, transposed, dtype).to_device(device).unwrap();
    let all: Vec<Tensor> = (0..n).map(|r| input(r, transposed, dtype)).collect();
    let all_f32: Vec<Tensor> = (0..n).map(|r| input(r, transposed, DType::F32)).collect();

    // all_reduce: sum, avg, max, min
    let sum = serial_sum(n, transposed, dtype);
    assert_same(
        &comm.all_reduce(&x, ReduceOp::Sum).unwrap(),
        &sum,
        &format!("{ctx} all_reduce sum"),
    );
    let avg = (serial_sum(n, transposed, DType::F32) / n as f64)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    assert_same(
        &comm.all_reduce(&x, ReduceOp::Avg).unwrap(),
        &avg,
        &format!("{ctx} all_reduce avg"),
    );
    let stacked = Tensor::stack(&all_f32, 0).unwrap();
    let max = stacked.max(0).unwrap().to_dtype(dtype).unwrap();
    assert_same(
        &comm.all_reduce(&x, ReduceOp::Max).unwrap(),
        &max,
        &format!("{ctx} all_reduce max"),
    );
    let min = stacked.min(0).unwrap().to_dtype(dtype).unwrap();
    assert_same(
        &comm.all_reduce(&x, ReduceOp::Min).unwrap(),
        &min,
        &format!("{ctx} all_reduce min"),
    );

    // all_gather on both dims
    for dim in 0..2 {
        let want = Tensor::cat(&all, dim).unwrap();
        assert_same(
            &comm.all_gather(&x, dim).unwrap(),
            &want,
            &format!("{ctx} all_gather dim {dim}"),
        );
    }

    // reduce_scatter on a dim divisible by n: concatenate n copies along it first
    for dim in 0..2 {
        let xs = Tensor::cat(&vec![x.clone(); n], dim).unwrap();
        let sum_n = Tensor::cat(&vec![sum.clone(); n], dim).unwrap();
        let c = sum_n.dim(dim).unwrap() / n;
        let want = sum_n.narrow(dim, rank * c, c).unwrap();
        let got = comm.reduce_scatter(&xs, dim, ReduceOp::Sum).unwrap();
        assert_same(&got, &want, &format!("{ctx} reduce_scatter dim {dim}"));
    }

    // broadcast from every root
    for (root, want) in all.iter().enumerate() {
        assert_same(
            &comm.broadcast(&x, root).unwrap(),
            want,
            &format!("{ctx} broadcast root {root}"),
        );
    }

    // ring shift forward and back
    let prev = (rank + n - 1) % n;
    let next = (rank + 1) % n;
    assert_same(
        &comm.send_recv(&x, next, prev).unwrap(),
        &all[prev],
        &format!("{ctx} send_recv"),
    );
    assert_same(
        &comm.send_recv(&x, prev, next).unwrap(),
        &all[next],
        &format!("{ctx} send_recv reverse"),
    );

    // plain send/recv between rank 0 and the last rank
    if rank == 0 {
        comm.send(&x, n - 1).unwrap();
    } else if rank == n - 1 {
        let got = comm.recv(x.shape(), dtype, device, 0).unwrap();
        assert_same(&got, &all[0], &format!("{ctx} recv"));
    }

    // all_to_all: split along one dim, concatenate along the other (inputs padded to n)
    let xs = Tensor::cat(&vec![x.clone(); n], 0).unwrap(); // [n*a, b]
    let all_s: Vec<Tensor> = all
        .iter()
        .map(|t| Tensor::cat(&vec![t.clone(); n], 0).unwrap())
        .collect();
    for (split, concat) in [(0usize, 1usize), (0, 0)] {
        let c = xs.dim(split).unwrap() / n;
        let parts: Vec<Tensor> = all_s
            .iter()
            .map(|t| t.narrow(split, rank * c, c).unwrap())
            .collect();
        let want = Tensor::cat(&parts, concat).unwrap();
        let got = comm.all_to_all(&xs, split, concat).unwrap();
        assert_same(&got, &want, &format!("{ctx} all_to_all {split}->{concat}"));
        // and the inverse gives back the input
        let back = comm.all_to_all(&got, concat, split).unwrap();
        assert_same(&back, &xs, &format!("{ctx} all_to_all inverse"));
    }

    comm.barrier().unwrap();
}
