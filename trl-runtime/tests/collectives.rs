//! Every collective, on 2, 3 and 4 ranks of both CPU backends, against the same computation
//! done serially: f32 (contiguous and transposed inputs) and bf16.

mod common;

use candle_core::{DType, Device, Tensor, D};
use common::collectives::check_collectives;
use common::{run, Backend, BACKENDS};
use trl_runtime::comm::{CommQueue, ReduceOp};
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::dist::mesh::{Axis, DeviceMesh};
use trl_runtime::dist::DistContext;

fn check_all(backend: Backend, n: usize, transposed: bool, dtype: DType) {
    run(backend, n, |rank, comm| {
        assert_eq!((comm.rank(), comm.size()), (rank, n));
        let what = format!("{backend:?}");
        check_collectives(&*comm, &what, transposed, dtype, &Device::Cpu);
    });
}

#[test]
fn collectives_match_serial_computation() {
    for backend in BACKENDS {
        for n in [2, 3, 4] {
            for transposed in [false, true] {
                check_all(backend, n, transposed, DType::F32);
            }
            check_all(backend, n, true, DType::BF16);
            check_all(backend, n, false, DType::F16);
        }
    }
}

#[test]
fn large_all_reduce_uses_uneven_segments() {
    // 1_000_003 elements: not divisible by 3, several receive chunks per segment.
    for backend in BACKENDS {
        run(backend, 3, |rank, comm| {
            let x = Tensor::arange(0f32, 1_000_003f32, &Device::Cpu).unwrap();
            let x = (x + rank as f64).unwrap();
            let got = comm.all_reduce(&x, ReduceOp::Sum).unwrap();
            let want = ((Tensor::arange(0f32, 1_000_003f32, &Device::Cpu).unwrap() * 3.0).unwrap()
                + 3.0)
                .unwrap();
            let diff = (got - want)
                .unwrap()
                .abs()
                .unwrap()
                .max(D::Minus1)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0);
        });
    }
}

#[test]
fn integer_and_f64_reductions() {
    for backend in BACKENDS {
        run(backend, 2, |rank, comm| {
            let x = Tensor::new(&[rank as i64 + 1, 10], &Device::Cpu).unwrap();
            let got: Vec<i64> = comm
                .all_reduce(&x, ReduceOp::Sum)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(got, vec![3, 20]);
            let y = Tensor::new(&[rank as f64 * 0.5], &Device::Cpu).unwrap();
            let got: Vec<f64> = comm
                .all_reduce(&y, ReduceOp::Max)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(got, vec![0.5]);
        });
    }
}

#[test]
fn mismatched_collectives_are_reported() {
    for backend in BACKENDS {
        let results = run(backend, 2, |rank, comm| {
            let x = Tensor::zeros(if rank == 0 { 4 } else { 8 }, DType::F32, &Device::Cpu).unwrap();
            comm.all_reduce(&x, ReduceOp::Sum)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        let err = results
            .iter()
            .find_map(|r| r.as_ref().err())
            .expect("an error on some rank");
        assert!(
            err.contains("different order or with different shapes"),
            "{backend:?}: {err}"
        );
    }
}

#[test]
fn non_divisible_reduce_scatter_is_a_clear_error() {
    run(Backend::InProcess, 2, |_, comm| {
        let x = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        let err = comm
            .reduce_scatter(&x, 0, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not divisible by the group size 2"), "{err}");
    });
}

#[test]
fn queued_collectives_run_in_order_while_the_caller_computes() {
    for backend in BACKENDS {
        run(backend, 2, |rank, comm| {
            let queue = CommQueue::new(comm.clone()).unwrap();
            let x = Tensor::new(&[rank as f32 + 1.0; 8], &Device::Cpu).unwrap();
            let pending = queue.submit(move |c| c.all_reduce(&x, ReduceOp::Sum));
            let y = Tensor::new(&[rank as f32], &Device::Cpu).unwrap();
            let gathered = queue.submit(move |c| c.all_gather(&y, 0));
            // The caller keeps computing while the collective runs.
            let local = Tensor::ones(4, DType::F32, &Device::Cpu)
                .unwrap()
                .sum_all()
                .unwrap();
            // Waited out of order: each result is still its own collective's.
            let order: Vec<f32> = gathered.wait().unwrap().to_vec1().unwrap();
            assert_eq!(order, vec![0.0, 1.0]);
            let got: Vec<f32> = pending.wait().unwrap().to_vec1().unwrap();
            assert_eq!(got, vec![3.0; 8]);
            // `run` waits for its own result, after everything queued before it.
            let direct = queue
                .run(|c| c.all_reduce(&Tensor::new(&[1f32], &Device::Cpu)?, ReduceOp::Max))
                .unwrap();
            assert_eq!(direct.to_vec1::<f32>().unwrap(), vec![1.0]);
            assert_eq!(local.to_scalar::<f32>().unwrap(), 4.0);
        });
    }
}

#[test]
fn mesh_groups_communicate_within_their_axis() {
    // 2 (dp_shard) x 2 (tp) on in-process ranks: tp groups are {0,1},{2,3}; dp_shard {0,2},{1,3}.
    let world = trl_runtime::comm::InProcessWorld::new(4);
    let dims = ParallelDims {
        dp_replicate: 1,
        dp_shard: 2,
        cp: 1,
        sp: 1,
        tp: 2,
    };
    std::thread::scope(|s| {
        for rank in 0..4 {
            let world = &world;
            s.spawn(move || {
                let ctx = DistContext::in_process(world, rank, DeviceMesh::new(dims, 4).unwrap())
                    .unwrap();
                let x = Tensor::new(&[rank as f32], &Device::Cpu).unwrap();
                let tp: f32 = ctx
                    .group(&[Axis::Tp])
                    .all_reduce(&x, ReduceOp::Sum)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()[0];
                let dp: f32 = ctx
                    .group(&[Axis::DpShard])
                    .all_reduce(&x, ReduceOp::Sum)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()[0];
                let all: f32 = ctx
                    .world()
                    .all_reduce(&x, ReduceOp::Sum)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()[0];
                assert_eq!(tp, if rank < 2 { 1.0 } else { 5.0 });
                assert_eq!(dp, if rank % 2 == 0 { 2.0 } else { 4.0 });
                assert_eq!(all, 6.0);
            });
        }
    });
}

/// The uneven all-to-all (expert parallelism's dispatch): rank r sends (r + j) % 3 rows to
/// rank j (zeros among them), each row tagged with its sender and place; every rank gets its
/// rows from each sender in rank order, and the counts, on every backend.
#[test]
fn uneven_all_to_all_moves_each_row_to_its_rank() {
    let counts = |r: usize, n: usize| -> Vec<usize> { (0..n).map(|j| (r + j) % 3).collect() };
    for backend in BACKENDS {
        for n in [2, 3, 4] {
            run(backend, n, |rank, comm| {
                let mine = counts(rank, n);
                let rows = mine.iter().sum::<usize>();
                let x: Vec<f32> = (0..rows * 2)
                    .map(|i| (rank * 1000 + i / 2) as f32 + 0.5 * (i % 2) as f32)
                    .collect();
                let x = Tensor::from_vec(x, (rows, 2), &Device::Cpu).unwrap();
                let (y, got) = comm.all_to_all_v(&x, &mine).unwrap();
                let want: Vec<usize> = (0..n).map(|j| counts(j, n)[rank]).collect();
                assert_eq!(got, want, "{backend:?} {n} ranks: rank {rank}'s counts");
                let mut expect = Vec::new();
                for (j, &c) in want.iter().enumerate() {
                    let first: usize = counts(j, n)[..rank].iter().sum();
                    for row in first..first + c {
                        expect.extend([(j * 1000 + row) as f32, (j * 1000 + row) as f32 + 0.5]);
                    }
                }
                let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
                assert_eq!(y, expect, "{backend:?} {n} ranks: rank {rank}");
                // Counts that do not add up are named.
                let err = comm.all_to_all_v(&x, &[rows + 1]).unwrap_err().to_string();
                assert!(err.contains("counts"), "{err}");
            });
        }
    }
}
