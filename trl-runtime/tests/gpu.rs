//! The GPU path, on a real GPU (built with `--features cuda,nccl`; skipped with a message when
//! no GPU is visible):
//! - NCCL at world size 1: every collective of the trait, in f32 and bf16, against the values
//!   the definitions give;
//! - the host and in-process backends moving CUDA tensors between several ranks on one GPU
//!   (one GPU cannot host several NCCL ranks);
//! - the trainer on the GPU: bf16 DDP over 2 ranks (in-process, sharing the GPU) equal to one
//!   process within the bf16 tolerances of the CPU test, and fp32 on the GPU equal to fp32 on
//!   the CPU.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor};
use common::{max_abs_diff, run, Backend};
use std::path::{Path, PathBuf};
use trl_runtime::comm::{InProcessWorld, ReduceOp};
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::dist::{DeviceMesh, DistContext};
use trl_runtime::train::{SFTConfig, Strategy, Trainer};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no GPU ({e}): GPU test skipped");
            None
        }
    }
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_collectives_at_world_size_one() {
    use trl_runtime::comm::nccl::NcclBackend;
    let Some(dev) = gpu() else { return };
    let backend =
        NcclBackend::new(None, 0, std::time::Duration::from_secs(60), &dev).expect("libnccl");
    let c = backend.group("world", &[0]).unwrap();
    assert_eq!((c.backend(), c.rank(), c.size()), ("nccl", 0, 1));
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::arange(0f32, 24.0, &dev)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let same = |y: Tensor, what: &str| {
            assert!(y.device().is_cuda(), "{what} left the GPU");
            assert_eq!(y.dims(), x.dims(), "{what}");
            assert_eq!(max_abs_diff(&y, &x), 0.0, "{what} in {dtype:?}");
        };
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            same(c.all_reduce(&x, op).unwrap(), "all_reduce");
        }
        same(c.all_gather(&x, 1).unwrap(), "all_gather");
        same(
            c.reduce_scatter(&x, 2, ReduceOp::Sum).unwrap(),
            "reduce_scatter",
        );
        same(c.broadcast(&x, 0).unwrap(), "broadcast");
        same(c.send_recv(&x, 0, 0).unwrap(), "send_recv");
        same(c.all_to_all(&x, 1, 2).unwrap(), "all_to_all");
        // A strided view and a CPU tensor work too (CPU data comes back on the CPU).
        same(
            c.all_reduce(&x.t().unwrap(), ReduceOp::Sum)
                .unwrap()
                .t()
                .unwrap(),
            "all_reduce of a transposed view",
        );
        let host = x.to_device(&Device::Cpu).unwrap();
        let back = c.all_reduce(&host, ReduceOp::Sum).unwrap();
        assert!(back.device().is_cpu());
    }
    c.barrier().unwrap();
}

/// Several ranks on one GPU exchange CUDA tensors through the host and in-process backends:
/// sums, gathers and all-to-all come back on the GPU with the values the definitions give.
#[test]
fn cpu_backends_carry_cuda_tensors_between_ranks() {
    let Some(dev) = gpu() else { return };
    for backend in [Backend::InProcess, Backend::Host] {
        let n = 4;
        let results = run(backend, n, |rank, c| {
            let x = (Tensor::ones((3, 8), DType::F32, &dev).unwrap() * (rank + 1) as f64).unwrap();
            let sum = c.all_reduce(&x, ReduceOp::Sum).unwrap();
            let gathered = c.all_gather(&x, 0).unwrap();
            let swapped = c.all_to_all(&x, 1, 0).unwrap();
            for t in [&sum, &gathered, &swapped] {
                assert!(t.device().is_cuda(), "{backend:?}: result left the GPU");
            }
            let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (v(&sum), v(&gathered), swapped.dims().to_vec())
        });
        for (sum, gathered, swapped) in results {
            assert!(sum.iter().all(|&s| s == 10.0), "{backend:?}: {sum:?}");
            for (r, chunk) in gathered.chunks(24).enumerate() {
                assert!(chunk.iter().all(|&v| v == (r + 1) as f32));
            }
            assert_eq!(swapped, vec![12, 2]);
        }
    }
}

/// Read at run time first (cargo sets CARGO_MANIFEST_DIR when it runs a test) so the test
/// binary carried to a GPU machine (scripts/gpu-run) finds that machine's checkout.
fn assets() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("../assets/tiny")
}

fn config(out: &Path, batch: usize, bf16: bool) -> SFTConfig {
    SFTConfig {
        model_name_or_path: assets().join("model"),
        dataset_name: assets().join("data/train.jsonl"),
        output_dir: out.to_path_buf(),
        per_device_train_batch_size: batch,
        learning_rate: 3e-3,
        warmup_steps: 2,
        max_steps: 5,
        max_length: 64,
        assistant_only_loss: true,
        save_steps: 100,
        disable_tqdm: true,
        bf16,
        ..SFTConfig::default()
    }
}

type Run = (Vec<f64>, Vec<f32>);

/// Losses and all final weights (f32, by name order) of `world` in-process ranks on `device`.
fn train(world: usize, cfg: SFTConfig, device: &Device) -> Run {
    let w = InProcessWorld::new(world);
    let dims = ParallelDims {
        dp_replicate: world,
        dp_shard: 1,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    let mut results: Vec<Run> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (w, cfg, device) = (&w, cfg.clone(), device.clone());
                let cfg_bf16 = cfg.bf16;
                s.spawn(move || {
                    let ctx =
                        DistContext::in_process(w, rank, DeviceMesh::new(dims, world).unwrap())
                            .unwrap()
                            .on_device(device);
                    let mut trainer = Trainer::with_strategy(cfg, &ctx, Strategy::Ddp).unwrap();
                    let (_, weight) = trainer.model.params.iter().next().unwrap();
                    assert!(weight.device().same_device(ctx.device()));
                    let dtype = if cfg_bf16 { DType::BF16 } else { DType::F32 };
                    assert_eq!(weight.dtype(), dtype);
                    let losses = trainer.train().unwrap().losses;
                    let mut weights = Vec::new();
                    for (_, t) in trainer.gather_weights().unwrap() {
                        let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                        weights.extend(t.to_vec1::<f32>().unwrap());
                    }
                    (losses, weights)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.swap_remove(0)
}

/// Largest relative loss difference and mean absolute weight difference relative to the mean
/// absolute weight (as in the CPU bf16 test).
fn differences(a: &Run, b: &Run) -> (f64, f64) {
    let loss =
        a.0.iter()
            .zip(&b.0)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() / y.abs()));
    let (diff, size) = a.1.iter().zip(&b.1).fold((0f64, 0f64), |(d, s), (x, y)| {
        (d + (x - y).abs() as f64, s + y.abs() as f64)
    });
    (loss, diff / size)
}

#[test]
fn trainer_on_gpu_matches_cpu_and_ddp_in_bf16() {
    let Some(dev) = gpu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cpu = train(1, config(&tmp.path().join("cpu"), 4, false), &Device::Cpu);
    let fp32 = train(1, config(&tmp.path().join("fp32"), 4, false), &dev);
    let (loss, mean) = differences(&fp32, &cpu);
    eprintln!("fp32 GPU vs CPU: loss {loss:e}, mean weight {mean:e}");
    assert!(
        loss < 1e-4 && mean < 1e-4,
        "fp32 GPU vs CPU: loss {loss:e}, weights {mean:e}"
    );
    let one = train(1, config(&tmp.path().join("one"), 4, true), &dev);
    let ddp = train(2, config(&tmp.path().join("ddp"), 2, true), &dev);
    assert!(one.0[4] < one.0[0], "the loss goes down: {:?}", one.0);
    let (loss, mean) = differences(&ddp, &one);
    eprintln!("bf16 GPU DDP 2 x 2 vs 1 x 4: loss {loss:e}, mean weight {mean:e}");
    assert!(
        loss < 1e-3 && mean < 2e-3,
        "bf16 DDP on GPU: loss {loss:e}, weights {mean:e}"
    );
    let (loss, mean) = differences(&one, &cpu);
    eprintln!("bf16 GPU vs fp32 CPU: loss {loss:e}, mean weight {mean:e}");
    assert!(
        loss < 1e-2 && mean < 1e-2,
        "bf16 GPU vs fp32: loss {loss:e}, weights {mean:e}"
    );
}
