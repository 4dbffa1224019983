//! A worker launched by the end-to-end tests with the torchrun environment.
//!
//! `comm_worker collectives`: runs the collectives across real processes and checks them
//! against the serial result (exit 0 on success).
//! `comm_worker crash`: rank 1 dies (abort) between two all-reduces; the others must report
//! the failure (exit 3) rather than hang.

use candle_core::{DType, Device, Tensor};
use std::process::ExitCode;
use trl_runtime::comm::ReduceOp;
use trl_runtime::dist::mesh::Axis;
use trl_runtime::dist::DistContext;

fn input(rank: usize) -> Tensor {
    let v: Vec<f32> = (0..1000)
        .map(|i| ((i * 7 + rank * 3) % 17) as f32 - 8.0)
        .collect();
    Tensor::from_vec(v, (10, 100), &Device::Cpu).unwrap()
}

/// Sum of |a - b| over all elements.
fn abs_diff_sum(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

fn collectives(ctx: &DistContext) -> Result<(), String> {
    let world = ctx.world();
    let (rank, n) = (world.rank(), world.size());
    let x = input(rank);
    let mut want = input(0);
    for r in 1..n {
        want = (want + input(r)).unwrap();
    }
    let got = world
        .all_reduce(&x, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let diff = abs_diff_sum(&got, &want);
    if diff != 0.0 {
        return Err(format!("all_reduce differs by {diff}"));
    }
    let all: Vec<Tensor> = (0..n).map(input).collect();
    let gathered = world
        .all_gather(&x.t().unwrap(), 1)
        .map_err(|e| e.to_string())?;
    let want_g = Tensor::cat(&all.iter().map(|t| t.t().unwrap()).collect::<Vec<_>>(), 1).unwrap();
    let diff = abs_diff_sum(&gathered, &want_g);
    if diff != 0.0 {
        return Err(format!("all_gather differs by {diff}"));
    }
    let b = world
        .broadcast(&x.to_dtype(DType::BF16).unwrap(), n - 1)
        .map_err(|e| e.to_string())?;
    if b.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
        != all[n - 1].to_vec2::<f32>().unwrap()
    {
        return Err("broadcast differs".into());
    }
    // The mesh groups exist and have the right sizes.
    let dp = ctx.group(&[Axis::DpReplicate, Axis::DpShard]);
    if dp.size() != n {
        return Err(format!("dp group has {} ranks, expected {n}", dp.size()));
    }
    world.barrier().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let ctx = match DistContext::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("init failed: {e}");
            return ExitCode::from(2);
        }
    };
    match mode.as_str() {
        "collectives" => match collectives(&ctx) {
            Ok(()) => {
                println!("collectives ok on rank {}", ctx.rank());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("collectives failed: {e}");
                ExitCode::from(1)
            }
        },
        "crash" => {
            let world = ctx.world();
            let x = Tensor::ones(1 << 20, DType::F32, &Device::Cpu).unwrap();
            world.all_reduce(&x, ReduceOp::Sum).unwrap();
            if ctx.rank() == 1 {
                std::process::abort();
            }
            match world.all_reduce(&x, ReduceOp::Sum) {
                Ok(_) => {
                    eprintln!("all_reduce succeeded without rank 1");
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!("peer failure detected: {e}");
                    ExitCode::from(3)
                }
            }
        }
        other => {
            eprintln!("unknown mode '{other}': use collectives or crash");
            ExitCode::from(64)
        }
    }
}
