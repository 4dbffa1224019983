//! Data-parallel training on CPU processes, end to end: a linear model trained by SGD where
//! each rank computes gradients on its shard of the data (Candle autograd) and the gradients
//! are averaged over the host backend. It ends by checking that every rank holds the same
//! weights and that they match the ones that generated the data.
//!
//! Run: `cargo run --release -p trl-examples --bin ddp_linear` (spawns 2 local ranks), or
//! launch it yourself with the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, ...).
//! This stands in for the SFT job until the trainer lands.

use candle_core::{Device, Tensor, Var};
use std::process::ExitCode;
use trl_runtime::comm::ReduceOp;
use trl_runtime::dist::{spawn, DistContext};

const FEATURES: usize = 16;
const SAMPLES: usize = 4096;
const STEPS: usize = 300;
const LR: f64 = 0.3;

fn train(ctx: &DistContext) -> trl_runtime::Result<f32> {
    let dp = ctx.world();
    let (rank, world) = (dp.rank(), dp.size());
    let dev = Device::Cpu;
    // The true weights and the data come from fixed formulas, so every
    // rank agrees on them; each rank keeps only its shard of the samples.
    let w_true: Vec<f32> = (0..FEATURES).map(|i| (i as f32 * 0.37).sin()).collect();
    let w_true = Tensor::from_vec(w_true, (FEATURES, 1), &dev)?;
    let shard = SAMPLES / world;
    let xs: Vec<f32> = (rank * shard * FEATURES..(rank + 1) * shard * FEATURES)
        .map(|i| ((i as f32 * 12.9898).sin() * 43758.545).fract())
        .collect();
    let x = Tensor::from_vec(xs, (shard, FEATURES), &dev)?;
    let y = x.matmul(&w_true)?;

    // Rank 0's initial weights reach everyone (as DDP does at start).
    let init = Tensor::randn(0f32, 1.0, (FEATURES, 1), &dev)?;
    let w = Var::from_tensor(&dp.broadcast(&init, 0)?)?;
    let mut loss_value = 0.0;
    for step in 0..STEPS {
        let err = (x.matmul(w.as_tensor())? - &y)?;
        let loss = err.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        let g = grads.get(w.as_tensor()).expect("gradient of w");
        let g = dp.all_reduce(g, ReduceOp::Avg)?;
        w.set(&(w.as_tensor() - (g * LR)?)?)?;
        loss_value = dp.all_reduce(&loss, ReduceOp::Avg)?.to_scalar::<f32>()?;
        if ctx.is_main_process() && (step % 50 == 0 || step == STEPS - 1) {
            println!("step {step:>3}  loss {loss_value:.6}");
        }
    }
    // Every rank must hold the same weights: max - min over ranks is zero.
    let hi = dp.all_reduce(w.as_tensor(), ReduceOp::Max)?;
    let lo = dp.all_reduce(w.as_tensor(), ReduceOp::Min)?;
    let spread = (hi - lo)?
        .abs()?
        .max_keepdim(0)?
        .flatten_all()?
        .to_vec1::<f32>()?[0];
    let err = (w.as_tensor() - w_true)?
        .abs()?
        .max_keepdim(0)?
        .flatten_all()?
        .to_vec1::<f32>()?[0];
    if ctx.is_main_process() {
        println!("ranks {world}: weight spread across ranks {spread:e}, max error vs true weights {err:.2e}");
    }
    if spread != 0.0 {
        return Err(trl_runtime::Error::Parallelism(format!(
            "ranks disagree on the weights by {spread}"
        )));
    }
    Ok(loss_value)
}

fn main() -> ExitCode {
    if let Some(code) = spawn::relaunch_unless_launched(2) {
        return code;
    }
    let result = DistContext::from_env().and_then(|ctx| train(&ctx));
    match result {
        Ok(loss) if loss < 1e-4 => ExitCode::SUCCESS,
        Ok(loss) => {
            eprintln!("training did not converge: final loss {loss}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
