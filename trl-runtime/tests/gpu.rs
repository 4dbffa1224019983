//! The GPU path, on a real GPU (built with `--features cuda,nccl`; skipped with a message when
//! no GPU is visible):
//! - NCCL at world size 1: every collective of the trait, in f32 and bf16, against the values
//!   the definitions give;
//! - the host and in-process backends moving CUDA tensors between several ranks on one GPU
//!   (one GPU cannot host several NCCL ranks);
//! - the blockwise kernels (flash attention, the tiled loss and MLP) in bf16 on the GPU
//!   against the same computation in f32 on the CPU;
//! - the trainer on the GPU: bf16 DDP over 2 ranks (in-process, sharing the GPU) equal to one
//!   process within the bf16 tolerances of the CPU test, and fp32 on the GPU equal to fp32 on
//!   the CPU;
//! - ZeRO-3 with the optimizer state and the checkpointed layer inputs in host memory, equal to
//!   the plain run;
//! - the fused kernels (RMSNorm, SwiGLU, rotary, the fused loss, flash attention: causal, with
//!   key spans, and ring attention per chunk pair) against the CPU kernels in f32.
//! - on compute capability 9.0, the Hopper attention kernels' two wgmma operand forms alone
//!   against the same products on the CPU;
//! - generation: the decode kernel (flash-decoding) against the CPU's, and greedy generation
//!   on the GPU equal to the CPU's; decode steps captured once as a CUDA graph and replayed
//!   equal to eager steps (greedy and sampled, f32 and bf16, windows and soft-capping);
//! - the gated delta rule's kernels (Gated DeltaNet) against the CPU kernel, values and
//!   gradients.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device, Tensor, Var};
#[cfg(feature = "nccl")]
use common::collectives::check_collectives;
use common::{max_abs_diff, rel_diff, run, Backend};
use std::path::{Path, PathBuf};
use trl_runtime::comm::{InProcessWorld, ReduceOp};
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::dist::{DeviceMesh, DistContext};
use trl_runtime::nn::AttentionImpl;
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

/// NCCL between processes, each on its own GPU: every collective of the trait against the
/// serial computation (the check the CPU backends pass on 2-4 ranks), f32 contiguous and
/// transposed, bf16 and f16. `scripts/gpu-run multi` runs it on a machine with 2 or more GPUs
/// through `cargo trl launch --profile multi_gpu --num_processes N`; ignored otherwise (one GPU
/// cannot host several NCCL ranks).
#[cfg(feature = "nccl")]
#[test]
#[ignore = "needs 2+ GPUs and a launch: scripts/gpu-run multi"]
fn nccl_collectives_across_launched_processes() {
    let ctx = DistContext::from_env().expect("launched by `cargo trl launch`");
    let world = ctx.world();
    assert!(
        ctx.device().is_cuda(),
        "rank {} is not on a GPU",
        ctx.rank()
    );
    assert_eq!(world.backend(), "nccl", "{}", world.name());
    assert!(world.size() >= 2, "launch 2 or more processes");
    for (transposed, dtype) in [
        (false, DType::F32),
        (true, DType::F32),
        (true, DType::BF16),
        (false, DType::F16),
    ] {
        check_collectives(&*world, "nccl", transposed, dtype, ctx.device());
    }
    println!(
        "nccl between {} processes: every collective matches (rank {})",
        world.size(),
        ctx.rank()
    );
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
/// Seeded normal draws on the CPU, rounded to values bf16 holds exactly (so the bf16 and f32
/// runs start from the same inputs).
fn draws(shape: &[usize], std: f32, seed: u64) -> Tensor {
    use rand::SeedableRng;
    use rand_distr::Distribution;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = rand_distr::Normal::new(0f32, std).unwrap();
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| half::bf16::from_f32(normal.sample(&mut rng)).to_f32())
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `f` of `inputs` on `dev` in `dtype`: its output and the gradients of `<output, w>` with
/// respect to the f32 inputs, all as f32 on the CPU.
fn output_and_grads(
    inputs: &[&Tensor],
    w: &Tensor,
    dev: &Device,
    dtype: DType,
    f: impl Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(dev).unwrap()).unwrap())
        .collect();
    let cast: Vec<Tensor> = vars.iter().map(|v| v.to_dtype(dtype).unwrap()).collect();
    let out = f(&cast).to_dtype(DType::F32).unwrap();
    let loss = out
        .broadcast_mul(&w.to_device(dev).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    (
        cpu(&out),
        vars.iter().map(|v| cpu(grads.get(v).unwrap())).collect(),
    )
}

/// The blockwise kernels in bf16 on the GPU follow the same computation in f32 on the CPU
/// (flash attention over several GPU blocks of packed rows, masked and open; the tiled loss;
/// the tiled MLP): outputs and gradients within a few bf16 roundings of the largest value
/// (the CPU tests see up to 1.4e-2 between bf16 and f32 on the CPU).
#[test]
fn blockwise_kernels_in_bf16_on_gpu_follow_f32_on_cpu() {
    use trl_runtime::nn::{flash, loss, tiled_mlp, AttentionMask};
    let Some(dev) = gpu() else { return };
    let cpu = Device::Cpu;
    let check = |what: &str, got: (Tensor, Vec<Tensor>), want: (Tensor, Vec<Tensor>)| {
        let d = rel_diff(&got.0, &want.0);
        eprintln!("{what}: output differs by {d:e} of the largest");
        assert!(d < 2e-2, "{what}: output differs by {d:e} of the largest");
        for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
            let d = rel_diff(g, w);
            eprintln!("{what}: gradient {i} differs by {d:e} of the largest");
            assert!(
                d < 2e-2,
                "{what}: gradient {i} differs by {d:e} of the largest"
            );
        }
    };

    // Attention: 2 rows of 2304 tokens (3 GPU blocks), documents of 1500 + 804 and one whole.
    let s = 2304;
    let pos: Vec<i64> = (0..1500).chain(0..804).chain(0..s as i64).collect();
    let pos = Tensor::from_vec(pos, (2, s), &cpu).unwrap();
    let (q, k, v) = (
        draws(&[2, 4, s, 32], 1.0, 1),
        draws(&[2, 2, s, 32], 1.0, 2),
        draws(&[2, 2, s, 32], 1.0, 3),
    );
    let w = draws(&[2, 4, s, 32], 1.0, 4);
    let on_gpu = output_and_grads(&[&q, &k, &v], &w, &dev, DType::BF16, |t| {
        let mask = AttentionMask::causal(&pos, DType::BF16, &dev).unwrap();
        let block = flash::block_for(&dev);
        flash::flash_attention(&t[0], &t[1], &t[2], &mask, block).unwrap()
    });
    let on_cpu = output_and_grads(&[&q, &k, &v], &w, &cpu, DType::F32, |t| {
        let mask = AttentionMask::causal(&pos, DType::F32, &cpu).unwrap();
        trl_runtime::nn::attention(&t[0], &t[1], &t[2], &mask).unwrap()
    });
    check("flash attention", on_gpu, on_cpu);

    // The tiled loss: 1024 rows over a vocabulary of 32,000 (many tiles), some ignored.
    let (hidden, head) = (draws(&[1024, 64], 1.0, 5), draws(&[32_000, 64], 0.2, 6));
    let targets: Vec<i64> = (0..1024i64)
        .map(|i| {
            if i % 9 == 4 {
                -100
            } else {
                (i * 7919) % 32_000
            }
        })
        .collect();
    let targets = Tensor::new(targets.as_slice(), &cpu).unwrap();
    let one = Tensor::new(1f32, &cpu).unwrap();
    let on_gpu = output_and_grads(&[&hidden, &head], &one, &dev, DType::BF16, |t| {
        let targets = targets.to_device(&dev).unwrap();
        trl_runtime::nn::tiled_linear_cross_entropy(&t[0], &t[1], &targets)
            .unwrap()
            .sum
    });
    let on_cpu = output_and_grads(&[&hidden, &head], &one, &cpu, DType::F32, |t| {
        let logits = t[0].matmul(&t[1].t().unwrap()).unwrap();
        loss::cross_entropy_sum(&logits, &targets).unwrap().sum
    });
    check("tiled loss", on_gpu, on_cpu);

    // The tiled MLP: 3000 rows (three tiles, the last one short).
    let (x, gate_up, down) = (
        draws(&[3000, 64], 1.0, 7),
        draws(&[512, 64], 0.2, 8),
        draws(&[64, 256], 0.2, 9),
    );
    let w = draws(&[3000, 64], 1.0, 10);
    let on_gpu = output_and_grads(&[&x, &gate_up, &down], &w, &dev, DType::BF16, |t| {
        tiled_mlp::tiled_swiglu(&t[0], &t[1], &t[2]).unwrap()
    });
    let on_cpu = output_and_grads(&[&x, &gate_up, &down], &w, &cpu, DType::F32, |t| {
        let ab = t[0].matmul(&t[1].t().unwrap()).unwrap();
        let (a, b) = (
            ab.narrow(1, 0, 256).unwrap(),
            ab.narrow(1, 256, 256).unwrap(),
        );
        let h = (a.silu().unwrap() * b).unwrap();
        h.matmul(&t[2].t().unwrap()).unwrap()
    });
    check("tiled MLP", on_gpu, on_cpu);
}

fn assets() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("../assets/tiny")
}

fn config(out: &Path, batch: usize, bf16: bool) -> SFTConfig {
    SFTConfig {
        training: trl_runtime::train::TrainingArguments {
            model_name_or_path: assets().join("model"),
            dataset_name: assets().join("data/train.jsonl"),
            output_dir: out.to_path_buf(),
            per_device_train_batch_size: batch,
            learning_rate: 3e-3,
            warmup_steps: 2.0,
            max_steps: 5,
            max_length: 64,
            save_steps: 100.0,
            disable_tqdm: true,
            bf16,
            ..Default::default()
        },
        assistant_only_loss: true,
        ..SFTConfig::default()
    }
}

type Run = (Vec<f64>, Vec<f32>);

/// Losses and all final weights (f32, by name order) of in-process ranks laid out as `dims` on
/// `device`, each running the launch `plan` with the trainer `make` builds (and checks).
fn run_ranks(
    dims: ParallelDims,
    device: &Device,
    plan: trl_runtime::config::LaunchPlan,
    make: impl Fn(&DistContext) -> Trainer<'_> + Sync,
) -> Run {
    let world = dims.dp_replicate * dims.dp_shard * dims.cp * dims.sp * dims.tp;
    let w = InProcessWorld::new(world);
    let mut results: Vec<Run> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (w, device, plan, make) = (&w, device.clone(), plan.clone(), &make);
                s.spawn(move || {
                    let ctx =
                        DistContext::in_process(w, rank, DeviceMesh::new(dims, world).unwrap())
                            .unwrap()
                            .on_device(device)
                            .with_launch_plan(plan);
                    let mut trainer = make(&ctx);
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

/// DDP over `world` in-process ranks on `device`.
fn train(world: usize, cfg: SFTConfig, device: &Device) -> Run {
    let dims = ParallelDims {
        dp_replicate: world,
        dp_shard: 1,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    run_ranks(dims, device, Default::default(), |ctx| {
        let dtype = if cfg.training.bf16 {
            DType::BF16
        } else {
            DType::F32
        };
        let trainer = Trainer::with_strategy(cfg.clone(), ctx, Strategy::Ddp).unwrap();
        // TRL's default, sdpa, runs blockwise on a GPU (as PyTorch's does).
        if ctx.device().is_cuda() {
            assert_eq!(trainer.model.attention, AttentionImpl::Flash);
        }
        let (_, weight) = trainer.model.params.iter().next().unwrap();
        assert!(weight.device().same_device(ctx.device()));
        assert_eq!(weight.dtype(), dtype);
        trainer
    })
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

#[test]
fn builtin_models_and_lora_on_gpu_follow_the_cpu() {
    // The built-in architectures' own paths on a GPU (per-head q/k norms, whole-projection
    // norms, sliding windows, (1 + w) norms and final soft-capping, Gemma 2's soft-capped
    // attention scores (in the fused kernel), routers with top-k on the
    // host and experts gathered by index, gpt-oss's sinks and grouped fused experts, fused
    // qkv), with and without LoRA adapters on every
    // linear layer (experts included; gpt-oss's fused experts and router as parameters): 3
    // fp32 steps equal to the same on the CPU.
    let Some(dev) = gpu() else { return };
    let cases = [
        ("tiny-qwen3", false),
        ("tiny-olmo2", false),
        ("tiny-olmo3", false),
        ("tiny-gemma3", false),
        ("tiny-gemma2", true),
        ("tiny-phi3", true),
        ("tiny-qwen3-moe", false),
        ("tiny-qwen3-moe", true),
        ("tiny-mixtral", true),
        ("tiny-gpt-oss", false),
        ("tiny-gpt-oss", true),
    ];
    let mut failed = Vec::new();
    for (name, peft) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let make = |out: &str| {
            let mut c = config(&tmp.path().join(out), 4, false);
            c.training.model_name_or_path = assets().join(format!("../{name}/model"));
            c.training.max_steps = 3;
            c.training.use_peft = peft;
            if peft {
                c.training.lora_target_modules =
                    Some(trl_runtime::config::cli_value::NameList(vec![
                        "all-linear".into()
                    ]));
                c.training.lora_dropout = 0.0;
            }
            if peft && name == "tiny-gpt-oss" {
                // Its fused experts and router adapted as parameters: grouped GEMMs of rank r.
                let names = [
                    "mlp.experts.gate_up_proj",
                    "mlp.experts.down_proj",
                    "mlp.router.weight",
                ];
                c.training.lora_target_parameters = Some(trl_runtime::config::cli_value::NameList(
                    names.iter().map(|s| s.to_string()).collect(),
                ));
            }
            c
        };
        let cpu = train(1, make("cpu"), &Device::Cpu);
        let gpu = train(1, make("gpu"), &dev);
        let (loss, mean) = differences(&gpu, &cpu);
        eprintln!("{name} (LoRA {peft}) fp32 GPU vs CPU: loss {loss:e}, mean weight {mean:e}");
        if !(loss < 1e-4 && mean < 1e-4) {
            failed.push(format!(
                "{name} (LoRA {peft}): loss {loss:e}, weights {mean:e}"
            ));
        }
    }
    assert!(failed.is_empty(), "GPU differs from CPU: {failed:?}");
}

/// ZeRO-3 over `world` in-process ranks on `device`, entered through a launch plan as under
/// `cargo trl launch`; with `offload`, the plan keeps the optimizer state in host memory and the
/// run checkpoints activations, keeping the layer inputs in host memory too.
fn train_zero3(world: usize, cfg: SFTConfig, device: &Device, offload: bool) -> Run {
    use trl_runtime::config::{DeepSpeedConfig, DistributedType, LaunchPlan, OffloadDevice};
    let plan = LaunchPlan {
        distributed_type: DistributedType::DeepSpeed,
        deepspeed: Some(DeepSpeedConfig {
            zero_stage: 3,
            offload_optimizer_device: match offload {
                true => OffloadDevice::Cpu,
                false => OffloadDevice::None,
            },
            ..DeepSpeedConfig::default()
        }),
        ..LaunchPlan::default()
    };
    let cfg = {
        let base = cfg;
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                gradient_checkpointing: offload,
                activation_offloading: offload,
                ..base.training
            },
            ..base
        }
    };
    let dims = ParallelDims {
        dp_replicate: 1,
        dp_shard: world,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    run_ranks(dims, device, plan, |ctx| {
        let trainer = Trainer::new(cfg.clone(), ctx).unwrap();
        let report = trainer.report().unwrap();
        assert_eq!(report["strategy"], "zero3", "{report}");
        assert_eq!(report["offload_optimizer"], offload, "{report}");
        assert_eq!(report["activation_checkpointing"], offload, "{report}");
        trainer
    })
}

#[test]
fn offload_and_activation_checkpointing_on_gpu_match_the_plain_run() {
    // The optimizer update in host memory (offload_optimizer_device: cpu) and every decoder
    // layer recomputed from inputs kept in host memory (gradient_checkpointing +
    // activation_offloading), ZeRO-3 over 2 ranks sharing the GPU, fp32: the same run as
    // without them.
    let Some(dev) = gpu() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let plain = train_zero3(2, config(&tmp.path().join("plain"), 2, false), &dev, false);
    let offloaded = train_zero3(2, config(&tmp.path().join("offload"), 2, false), &dev, true);
    let (loss, mean) = differences(&offloaded, &plain);
    eprintln!(
        "ZeRO-3 offload + checkpointing vs plain on GPU: loss {loss:e}, mean weight {mean:e}"
    );
    assert!(
        loss < 1e-4 && mean < 1e-4,
        "offload + checkpointing on GPU: loss {loss:e}, weights {mean:e}"
    );
}

/// (name, inputs, the probe the output is dotted with, the op)
type FusedCase<'a> = (
    &'static str,
    Vec<&'a Tensor>,
    &'a Tensor,
    Box<dyn Fn(&[Tensor]) -> Tensor + 'a>,
);

/// The fused CUDA kernels (kernels/fused.cu: RMSNorm, SwiGLU, LoRA's dropout, rotary, forward
/// and backward) against the f32 CPU kernels on fresh random inputs: in f32 to 1e-5 (max
/// |difference| over max |reference|, outputs and every gradient), in bf16 within bf16 rounding
/// (2e-2), with hidden sizes that are not multiples of the block, one of whole 16-byte units
/// (1000) and one not (1003, the element-wise paths), and odd row counts.
/// NEFTune's noise kernel (`uniform_noise_*`) draws what the CPU op draws: the same hash, the
/// noise computed in f64 and rounded to f32, so f32 and bf16 outputs equal the CPU's exactly.
#[test]
fn fused_uniform_noise_on_gpu_equals_the_cpu() {
    use trl_runtime::kernels::fused::add_uniform_noise;
    let Some(dev) = gpu() else { return };
    let x = draws(&[3, 257, 96], 1.0, 61);
    for dtype in [DType::F32, DType::BF16] {
        let x = x.to_dtype(dtype).unwrap();
        let want = add_uniform_noise(&x, 0x5EED, 0.37).unwrap();
        let got = add_uniform_noise(&x.to_device(&dev).unwrap(), 0x5EED, 0.37)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let d = max_abs_diff(
            &got.to_dtype(DType::F32).unwrap(),
            &want.to_dtype(DType::F32).unwrap(),
        );
        assert_eq!(d, 0.0, "{dtype:?}");
    }
}

#[test]
fn fused_cuda_kernels_follow_the_cpu_kernels() {
    use trl_runtime::kernels::fused::{dropout, rms_norm, rotary, swiglu};
    let Some(dev) = gpu() else { return };
    // 1000: rows of whole 16-byte units (the wide paths); 1003: the element-wise ones.
    for (rows, h) in [(37usize, 1000usize), (37, 1003)] {
        let x = draws(&[rows, h], 1.0, 11);
        let g = draws(&[rows, h], 1.0, 12);
        let w_norm = draws(&[h], 0.5, 13).affine(1.0, 1.0).unwrap();
        let probe = draws(&[rows, h], 1.0, 14);
        // Rotary on head dim 64 (16-byte units) and, with 1003, 24 (pairs one by one in bf16).
        let (b, heads, s, d) = (2, 3, 17, if h == 1000 { 64 } else { 24 });
        let q = draws(&[b, heads, s, d], 1.0, 15);
        let angles = draws(&[b, s, d], 1.0, 16);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let probe4 = draws(&[b, heads, s, d], 1.0, 17);
        for (dtype, bound) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let (cos, sin) = (cos.clone(), sin.clone());
            let cases: Vec<FusedCase> = vec![
                (
                    "rms_norm",
                    vec![&x, &w_norm],
                    &probe,
                    Box::new(|t: &[Tensor]| rms_norm(&t[0], &t[1], 1e-6).unwrap()),
                ),
                (
                    "swiglu",
                    vec![&g, &x],
                    &probe,
                    Box::new(|t: &[Tensor]| swiglu(&t[0], &t[1]).unwrap()),
                ),
                (
                    // LoRA's dropout: the GPU draws the CPU's mask (a mask drawn otherwise
                    // would differ by ~0.6 of the norm).
                    "dropout",
                    vec![&x],
                    &probe,
                    Box::new(|t: &[Tensor]| dropout(&t[0], 0xfeed, 0.25).unwrap()),
                ),
                (
                    "rotary",
                    vec![&q],
                    &probe4,
                    Box::new(move |t: &[Tensor]| {
                        let (c, s) = (
                            cos.to_device(t[0].device())
                                .unwrap()
                                .to_dtype(t[0].dtype())
                                .unwrap(),
                            sin.to_device(t[0].device())
                                .unwrap()
                                .to_dtype(t[0].dtype())
                                .unwrap(),
                        );
                        rotary(&t[0], &c, &s).unwrap()
                    }),
                ),
            ];
            for (name, inputs, probe, f) in &cases {
                let (want, want_g) = output_and_grads(inputs, probe, &Device::Cpu, DType::F32, f);
                let (got, got_g) = output_and_grads(inputs, probe, &dev, dtype, f);
                let e = rel_diff(&got, &want);
                eprintln!("{name} {dtype:?}: output {e:e}");
                assert!(e < bound, "{name} {dtype:?}: output differs by {e}");
                for (i, (a, b)) in got_g.iter().zip(&want_g).enumerate() {
                    let e = rel_diff(a, b);
                    eprintln!("{name} {dtype:?}: gradient {i} {e:e}");
                    assert!(e < bound, "{name} {dtype:?}: gradient {i} differs by {e}");
                }
            }
        }
    }
}

/// Hidden states [n, 64], a head [vocab, 64] (std 0.1) drawn from `seed`, and targets spread
/// over the vocabulary, ignored (-100) at rows `i % every == at`.
fn head_inputs(
    n: usize,
    vocab: usize,
    seed: u64,
    (every, at): (i64, i64),
) -> (Tensor, Tensor, Tensor) {
    let hidden = draws(&[n, 64], 1.0, seed);
    let weight = draws(&[vocab, 64], 0.1, seed + 1);
    let targets: Vec<i64> = (0..n as i64)
        .map(|i| match i % every == at {
            true => -100,
            false => (i * 7919) % vocab as i64,
        })
        .collect();
    (
        hidden,
        weight,
        Tensor::new(targets.as_slice(), &Device::Cpu).unwrap(),
    )
}

/// The fused linear cross-entropy on the GPU (the LM head and the loss per tile, the CUDA
/// row pass in place) against the LM head followed by the cross-entropy in f32 on the CPU:
/// the loss and both gradients, in f32 (1e-4) and bf16 (3e-2), over several tiles, the last
/// one partial, with ignored targets.
#[test]
fn fused_linear_cross_entropy_on_gpu_follows_cpu() {
    use trl_runtime::nn::loss::cross_entropy_sum;
    use trl_runtime::nn::tiled_linear_cross_entropy;
    let Some(dev) = gpu() else { return };
    // 3000 rows: several 256 MiB logits tiles (3 in f32, 2 in bf16), each adding its weight
    // gradient into the f32 sum by one cuBLAS GEMM (beta = 1).
    let (n, vocab) = (3000, 50_000);
    let (hidden, weight, targets) = head_inputs(n, vocab, 21, (5, 2));
    let run = |device: &Device, dtype: DType, fused: bool| {
        let x = Var::from_tensor(&hidden.to_device(device).unwrap()).unwrap();
        let w = Var::from_tensor(&weight.to_device(device).unwrap()).unwrap();
        let (xc, wc) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
        let t = targets.to_device(device).unwrap();
        if fused {
            let on = trl_runtime::nn::tiled_loss::fused_applies(&xc, &wc);
            assert!(on, "the fused loss takes {dtype:?} on the GPU");
        }
        let ls = match fused {
            true => tiled_linear_cross_entropy(&xc, &wc, &t).unwrap(),
            false => cross_entropy_sum(&xc.matmul(&wc.t().unwrap()).unwrap(), &t).unwrap(),
        };
        let grads = ls.sum.backward().unwrap();
        let cpu = |t: &Tensor| {
            t.to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        };
        (
            ls.sum
                .to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64,
            cpu(grads.get(&x).unwrap()),
            cpu(grads.get(&w).unwrap()),
        )
    };
    let (want, want_dx, want_dw) = run(&Device::Cpu, DType::F32, false);
    for (dtype, bound) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        let (got, dx, dw) = run(&dev, dtype, true);
        let (e, ex, ew) = (
            (got - want).abs() / want.abs(),
            rel_diff(&dx, &want_dx),
            rel_diff(&dw, &want_dw),
        );
        eprintln!(
            "fused loss {dtype:?}: value {e:e}, hidden gradient {ex:e}, weight gradient {ew:e}"
        );
        assert!(
            e < bound && ex < bound && ew < bound,
            "{dtype:?}: {e} {ex} {ew}"
        );
    }
}

/// TRL's entropy and mean_token_accuracy from the CUDA row pass (`LossSum::stats`) against
/// the whole logits in f32 on the CPU: exact on hand-made ties (a tie before the target is not
/// a hit, after it is; bf16's 4-wide rows take the kernel's narrow loop, f32's the wide one),
/// and on random heads whose every third target is its row's argmax, the entropy sum within
/// 1e-4 (f32) / 1e-2 (bf16) and the hits within 1% / 5% (near-ties round differently).
#[test]
fn token_figures_on_gpu_follow_cpu() {
    use trl_runtime::nn::loss::cross_entropy_sum;
    use trl_runtime::nn::tiled_linear_cross_entropy;
    let Some(dev) = gpu() else { return };
    let stats = |ls: trl_runtime::nn::LossSum| -> Vec<f64> {
        let v = ls
            .stats
            .to_device(&Device::Cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        v.iter().map(|&x| x as f64).collect()
    };
    // logits = I . W^T = the rows: W is their transpose (exact in f32 and bf16).
    let (rows, ties) = common::tied_logits();
    let eye = Tensor::eye(5, DType::F32, &Device::Cpu).unwrap();
    let want = stats(cross_entropy_sum(&rows, &ties).unwrap());
    assert_eq!(want[1], 2.0, "the CPU reference's tie rule");
    for dtype in [DType::F32, DType::BF16] {
        let on = |t: &Tensor| t.to_device(&dev).unwrap().to_dtype(dtype).unwrap();
        let w = on(&rows.t().unwrap().contiguous().unwrap());
        let ls = tiled_linear_cross_entropy(&on(&eye), &w, &ties.to_device(&dev).unwrap()).unwrap();
        let got = stats(ls);
        eprintln!("ties {dtype:?}: {got:?} vs {want:?}");
        assert_eq!(got[1], want[1], "{dtype:?}: hits on ties");
        assert!(
            (got[0] - want[0]).abs() < 1e-5 * want[0],
            "{dtype:?}: entropy"
        );
    }
    for vocab in [50_000, 50_001] {
        let n = 1000;
        let (hidden, weight, targets) = head_inputs(n, vocab, 23, (5, 2));
        let logits = hidden.matmul(&weight.t().unwrap()).unwrap();
        let argmax: Vec<u32> = logits.argmax(1).unwrap().to_vec1().unwrap();
        let mut t: Vec<i64> = targets.to_vec1().unwrap();
        for (i, v) in t.iter_mut().enumerate() {
            if i % 3 == 0 && *v != -100 {
                *v = argmax[i] as i64;
            }
        }
        let targets = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
        let want = stats(cross_entropy_sum(&logits, &targets).unwrap());
        for (dtype, entropy_bound, hits_bound) in
            [(DType::F32, 1e-4, 0.01), (DType::BF16, 1e-2, 0.05)]
        {
            let on = |t: &Tensor| t.to_device(&dev).unwrap().to_dtype(dtype).unwrap();
            let ls = tiled_linear_cross_entropy(
                &on(&hidden),
                &on(&weight),
                &targets.to_device(&dev).unwrap(),
            )
            .unwrap();
            let got = stats(ls);
            let (de, dh) = (
                (got[0] - want[0]).abs() / want[0],
                (got[1] - want[1]).abs() / want[1],
            );
            eprintln!(
                "token figures {dtype:?} vocab {vocab}: entropy {de:e}, hits {got:?} vs {want:?}"
            );
            assert!(
                de < entropy_bound && dh < hits_bound,
                "{dtype:?} vocab {vocab}: {got:?} vs {want:?}"
            );
        }
    }
}

/// DPO's per-token losses on the GPU (`tiled_token_nll`: the one-pass row kernel writing each
/// row's loss, recomputed in backward with each row weighed by its own gradient) against the
/// whole logits in f32 on the CPU, rows and both gradients, in f32 (1e-4) and bf16 (3e-2);
/// with the head frozen (LoRA), no weight gradient and the same hidden gradient.
#[test]
fn per_row_losses_on_gpu_follow_cpu() {
    use trl_runtime::nn::loss::cross_entropy_tokens;
    use trl_runtime::nn::tiled_loss::tiled_token_nll;
    let Some(dev) = gpu() else { return };
    let (n, vocab) = (3000, 50_000);
    let (hidden, weight, targets) = head_inputs(n, vocab, 31, (7, 3));
    let row_weights: Vec<f32> = (0..n).map(|i| ((i % 11) as f32 - 5.0) / 5.0).collect();
    let row_weights = Tensor::new(row_weights.as_slice(), &Device::Cpu).unwrap();
    let cpu = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let run = |device: &Device, dtype: DType, tiled: bool, frozen: bool| {
        let x = Var::from_tensor(&hidden.to_device(device).unwrap()).unwrap();
        let w = Var::from_tensor(&weight.to_device(device).unwrap()).unwrap();
        let xc = x.to_dtype(dtype).unwrap();
        let wc = match frozen {
            true => w.as_tensor().detach().to_dtype(dtype).unwrap(),
            false => w.to_dtype(dtype).unwrap(),
        };
        let t = targets.to_device(device).unwrap();
        let rows = match tiled {
            true => tiled_token_nll(&xc, &wc, &t).unwrap().0,
            false => {
                let logits = xc.matmul(&wc.t().unwrap()).unwrap();
                cross_entropy_tokens(&logits, &t).unwrap().0
            }
        };
        let rows = rows.to_dtype(DType::F32).unwrap();
        let weights = row_weights.to_device(device).unwrap();
        let grads = (&rows * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        // A frozen head's gradient would be stored under the tensor the loss took.
        let head = if frozen { &wc } else { w.as_tensor() };
        (
            cpu(&rows),
            cpu(grads.get(&x).unwrap()),
            grads.get(head).map(cpu),
        )
    };
    let (want, want_dx, want_dw) = run(&Device::Cpu, DType::F32, false, false);
    for (dtype, bound) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        let (got, dx, dw) = run(&dev, dtype, true, false);
        let (e, ex, ew) = (
            rel_diff(&got, &want),
            rel_diff(&dx, &want_dx),
            rel_diff(&dw.unwrap(), want_dw.as_ref().unwrap()),
        );
        eprintln!(
            "per-row losses {dtype:?}: rows {e:e}, hidden gradient {ex:e}, weight gradient {ew:e}"
        );
        assert!(
            e < bound && ex < bound && ew < bound,
            "{dtype:?}: {e} {ex} {ew}"
        );
        let (frozen, fdx, fdw) = run(&dev, dtype, true, true);
        assert!(fdw.is_none(), "{dtype:?}: a frozen head has no gradient");
        assert!(
            rel_diff(&frozen, &got) < 1e-6 && rel_diff(&fdx, &dx) < 1e-6,
            "{dtype:?}: frozen"
        );
    }
}

/// The two wgmma operand forms of the Hopper kernels alone (kernels/flash_sm90.cu's probes), on
/// a GPU of compute capability 9.0, against the same product in f32 on the CPU: A B^T with both
/// operands in shared memory (B 32 or 64 rows) and P V with P in registers and V transposed, at
/// head dims 64 and 128. On a mismatch it says which rows and columns of the product landed
/// where, so that a first run tells a layout error from one in the kernels' logic.
#[test]
fn wgmma_operands_follow_the_cpu() {
    use trl_runtime::kernels::cuda_flash::wgmma_probe;
    let Some(dev) = gpu() else { return };
    let cc = dev
        .as_cuda_device()
        .unwrap()
        .cuda_stream()
        .context()
        .compute_capability()
        .unwrap();
    if cc != (9, 0) {
        eprintln!("compute capability {cc:?}, not 9.0: no wgmma to probe");
        return;
    }
    let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let mut failures = Vec::new();
    for d in [64, 128] {
        let a = bf16(&draws(&[64, d], 1.0, 51));
        let mut cases = Vec::new();
        for n in [32, 64] {
            let b = bf16(&draws(&[n, d], 1.0, 52));
            let want = a
                .to_dtype(DType::F32)
                .unwrap()
                .matmul(&b.to_dtype(DType::F32).unwrap().t().unwrap())
                .unwrap();
            cases.push((format!("A B^T, n {n}, d {d}"), a.clone(), b, want));
        }
        let p = draws(&[64, 64], 1.0, 53);
        let v = bf16(&draws(&[64, d], 1.0, 54));
        let want = bf16(&p)
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&v.to_dtype(DType::F32).unwrap())
            .unwrap();
        cases.push((format!("P V, d {d}"), p, v, want));
        for (what, a, b, want) in cases {
            let got = wgmma_probe(&a.to_device(&dev).unwrap(), &b.to_device(&dev).unwrap())
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            let e = rel_diff(&got, &want);
            eprintln!("wgmma {what}: {e:e}");
            if e > 1e-3 {
                failures.push(format!(
                    "{what}: differs by {e}; {}",
                    misplaced(&got, &want)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Where `got`'s rows and columns (of a matrix that should be `want`) came from: the wrong
/// elements, how many are zero (never written), and for the first wrong rows and columns the
/// rows and columns of `want` they equal.
fn misplaced(got: &Tensor, want: &Tensor) -> String {
    let (g, w) = (
        got.to_vec2::<f32>().unwrap(),
        want.to_vec2::<f32>().unwrap(),
    );
    let tol = 1e-3 * w.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(a, b)| (a - b).abs() <= tol);
    let col = |m: &[Vec<f32>], c: usize| m.iter().map(|r| r[c]).collect::<Vec<f32>>();
    let wrong: Vec<(usize, usize)> = (0..g.len())
        .flat_map(|r| (0..g[0].len()).map(move |c| (r, c)))
        .filter(|&(r, c)| (g[r][c] - w[r][c]).abs() > tol)
        .collect();
    let zeros = wrong.iter().filter(|&&(r, c)| g[r][c] == 0.0).count();
    let first: Vec<String> = wrong
        .iter()
        .take(4)
        .map(|&(r, c)| format!("({r},{c}) {} for {}", g[r][c], w[r][c]))
        .collect();
    let rows: Vec<String> = (0..g.len())
        .filter(|&r| !same(&g[r], &w[r]))
        .take(6)
        .map(|r| {
            let from = (0..w.len()).find(|&x| same(&g[r], &w[x]));
            format!(
                "row {r} = {}",
                from.map_or("none".into(), |x| format!("row {x}"))
            )
        })
        .collect();
    let cols: Vec<String> = (0..g[0].len())
        .filter(|&c| !same(&col(&g, c), &col(&w, c)))
        .take(6)
        .map(|c| {
            let from = (0..w[0].len()).find(|&x| same(&col(&g, c), &col(&w, x)));
            format!(
                "col {c} = {}",
                from.map_or("none".into(), |x| format!("col {x}"))
            )
        })
        .collect();
    format!(
        "{} wrong ({zeros} zero), first {}; {}; {}",
        wrong.len(),
        first.join(", "),
        rows.join(", "),
        cols.join(", ")
    )
}

/// The fused CUDA flash attention (kernels/flash.cu, tensor cores) against the whole score
/// matrix in f32 on the CPU, output and every gradient, in bf16 and f16: head dims 64 and
/// 128, grouped-query ratios 1, 2 and 4, lengths that leave partial blocks, packed rows
/// (documents restarting their positions). Bound: 2e-2 of the largest value (bf16 rounding).
#[test]
fn cuda_flash_attention_follows_the_f32_reference() {
    use trl_runtime::kernels::cuda_flash::{applies, flash_attention_cuda};
    use trl_runtime::nn::attention::whole_matrix_attention;
    use trl_runtime::nn::AttentionMask;
    let Some(dev) = gpu() else { return };
    let cpu = Device::Cpu;
    for (b, hq, hk, s, d) in [
        (2, 4, 2, 150, 64),
        (1, 4, 1, 300, 128),
        (2, 2, 2, 64, 64),
        (1, 8, 2, 1000, 128),
    ] {
        // Row 0 packs documents of 40 and the rest; other rows are one document.
        let pos: Vec<i64> = (0..b)
            .flat_map(|r| (0..s as i64).map(move |i| if r == 0 && i >= 40 { i - 40 } else { i }))
            .collect();
        let pos = Tensor::from_vec(pos, (b, s), &cpu).unwrap();
        let q = draws(&[b, hq, s, d], 1.0, 31);
        let k = draws(&[b, hk, s, d], 1.0, 32);
        let v = draws(&[b, hk, s, d], 1.0, 33);
        let w = draws(&[b, hq, s, d], 1.0, 34);
        let want = output_and_grads(&[&q, &k, &v], &w, &cpu, DType::F32, |t| {
            let mask = AttentionMask::causal(&pos, DType::F32, &cpu).unwrap();
            whole_matrix_attention(&t[0], &t[1], &t[2], &mask).unwrap()
        });
        for dtype in [DType::BF16, DType::F16] {
            let got = output_and_grads(&[&q, &k, &v], &w, &dev, dtype, |t| {
                assert!(applies(&t[0], &t[1]), "the fused kernel takes these inputs");
                let mask = AttentionMask::causal(&pos, dtype, &dev).unwrap();
                flash_attention_cuda((&t[0], &t[1], &t[2]), mask.key_spans(), None).unwrap()
            });
            let what = format!("b {b} heads {hq}/{hk} s {s} d {d} {dtype:?}");
            let e = rel_diff(&got.0, &want.0);
            eprintln!("cuda flash {what}: output {e:e}");
            assert!(e < 2e-2, "cuda flash {what}: output differs by {e}");
            for (name, (g, r)) in ["dq", "dk", "dv"].iter().zip(got.1.iter().zip(&want.1)) {
                let e = rel_diff(g, r);
                eprintln!("cuda flash {what}: {name} {e:e}");
                assert!(e < 2e-2, "cuda flash {what}: {name} differs by {e}");
            }
        }
    }
}

/// Attention sinks (gpt-oss) around the fused CUDA kernel (folded into its output and
/// log-sum-exp, kernels/sinks.rs) against transformers' way in f32 on the CPU (one more softmax
/// column): output and the gradients of q, k, v and the sinks, bf16, with packed rows.
#[test]
fn cuda_flash_attention_with_sinks_follows_the_f32_reference() {
    use trl_runtime::kernels::cuda_flash::flash_attention_cuda;
    use trl_runtime::nn::attention::whole_matrix_attention;
    use trl_runtime::nn::{AttentionMask, WithScoreMods};
    let Some(dev) = gpu() else { return };
    let cpu = Device::Cpu;
    let (b, hq, hk, s, d) = (2, 4, 2, 150, 64);
    let pos: Vec<i64> = (0..b)
        .flat_map(|r| (0..s as i64).map(move |i| if r == 0 && i >= 40 { i - 40 } else { i }))
        .collect();
    let pos = Tensor::from_vec(pos, (b, s), &cpu).unwrap();
    let (q, k, v) = (
        draws(&[b, hq, s, d], 1.0, 51),
        draws(&[b, hk, s, d], 1.0, 52),
        draws(&[b, hk, s, d], 1.0, 53),
    );
    let sinks = Tensor::new(&[0.5f32, 2.0, -1.0, 3.0], &cpu).unwrap();
    let w = draws(&[b, hq, s, d], 1.0, 54);
    let want = output_and_grads(&[&q, &k, &v, &sinks], &w, &cpu, DType::F32, |t| {
        let mask = AttentionMask::causal(&pos, DType::F32, &cpu)
            .unwrap()
            .with_sinks(Some(t[3].clone()));
        whole_matrix_attention(&t[0], &t[1], &t[2], &mask).unwrap()
    });
    let got = output_and_grads(&[&q, &k, &v, &sinks], &w, &dev, DType::BF16, |t| {
        let mask = AttentionMask::causal(&pos, DType::BF16, &dev).unwrap();
        flash_attention_cuda((&t[0], &t[1], &t[2]), mask.key_spans(), Some(&t[3])).unwrap()
    });
    let e = rel_diff(&got.0, &want.0);
    eprintln!("cuda flash with sinks: output {e:e}");
    assert!(e < 2e-2, "cuda flash with sinks: output differs by {e}");
    for (name, (g, r)) in ["dq", "dk", "dv", "dsinks"]
        .iter()
        .zip(got.1.iter().zip(&want.1))
    {
        let e = rel_diff(g, r);
        eprintln!("cuda flash with sinks: {name} {e:e}");
        assert!(e < 2e-2, "cuda flash with sinks: {name} differs by {e}");
    }
}

/// The kernels' general form, which ring attention runs per (query chunk, key chunk) pair:
/// queries and keys of different lengths, each query seeing a span of keys (here queries at
/// global 200.. over keys at 130.., documents starting at 0, 150 and 260), with the whole
/// attention's log-sum-exp given to the backward. bf16 and f16 on the GPU against the CPU
/// kernels in f32.
#[test]
fn cuda_flash_key_spans_follow_the_cpu_kernels() {
    use trl_runtime::kernels::cpu_flash::{self, KeySpans};
    use trl_runtime::kernels::cuda_flash;
    let Some(dev) = gpu() else { return };
    let (b, hq, hk, nq, nk, d) = (2, 4, 2, 100, 150, 64);
    let starts: Vec<Vec<usize>> = (0..b)
        .map(|row| {
            (200..200 + nq)
                .map(|g| match (row, g) {
                    (0, g) if g >= 260 => 260,
                    (0, g) if g >= 150 => 150,
                    _ => 0,
                })
                .collect()
        })
        .collect();
    let rows: Vec<&[usize]> = starts.iter().map(|r| r.as_slice()).collect();
    let base = KeySpans::shifted(&rows, 200, nq, 130, nk).expect("some keys visible");
    let q = draws(&[b, hq, nq, d], 1.0, 41);
    let k = draws(&[b, hk, nk, d], 1.0, 42);
    let v = draws(&[b, hk, nk, d], 1.0, 43);
    let dout = draws(&[b, hq, nq, d], 1.0, 44);
    // Plain, and with the scores soft-capped (Gemma 2): the CPU kernel, itself checked
    // against the definition, is the reference.
    for cap in [None, Some(2.0)] {
        let spans = base.clone().with_softcap(cap);
        let (want_o, want_l) = cpu_flash::forward(&q, &k, &v, &spans).unwrap();
        let want_g = cpu_flash::backward((&q, &k, &v), (&want_o, &want_l, &dout), &spans).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let on = |t: &Tensor| t.to_device(&dev).unwrap().to_dtype(dtype).unwrap();
            let cpu = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
            };
            let (o, l) = cuda_flash::forward(&on(&q), &on(&k), &on(&v), &spans).unwrap();
            let e = rel_diff(&cpu(&o), &want_o);
            let le = (cpu(&l) - &want_l)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            eprintln!("cuda flash spans {dtype:?} cap {cap:?}: output {e:e}, log-sum-exp {le:e}");
            assert!(
                e < 2e-2 && le < 2e-2,
                "{dtype:?}: output {e}, log-sum-exp {le}"
            );
            // The backward from the reference output and log-sum-exp, as a ring step gets them.
            let (dq, dk, dv) = cuda_flash::backward(
                (&on(&q), &on(&k), &on(&v)),
                (
                    &want_o.to_device(&dev).unwrap(),
                    &want_l.to_device(&dev).unwrap(),
                    &on(&dout),
                ),
                &spans,
            )
            .unwrap();
            for (name, (g, r)) in ["dq", "dk", "dv"]
                .iter()
                .zip([dq, dk, dv].iter().zip([&want_g.0, &want_g.1, &want_g.2]))
            {
                let e = rel_diff(&cpu(g), r);
                eprintln!("cuda flash spans {dtype:?} cap {cap:?}: {name} {e:e}");
                assert!(e < 2e-2, "{dtype:?}: {name} differs by {e}");
            }
        }
    }
}

/// Ring attention on the GPU (two in-process ranks, bf16 and f16) runs the fused kernel per
/// chunk pair and follows the fused ring on the CPU in f32, values and gradients.
#[test]
fn ring_attention_on_gpu_follows_the_cpu_ring() {
    use trl_runtime::context_parallel::ring::{ring_attention, RingMask};
    use trl_runtime::data::sequence::balanced_indices;
    let Some(dev) = gpu() else { return };
    let (ranks, chunk, d) = (2usize, 70usize, 64usize);
    let len = 2 * ranks * chunk;
    // Documents of 31, 100 and the rest, crossing chunk and rank boundaries.
    let global: Vec<i64> = (0..len as i64)
        .map(|i| match i {
            i if i < 31 => i,
            i if i < 131 => i - 31,
            i => i - 131,
        })
        .collect();
    let q = draws(&[1, 4, len, d], 1.0, 51);
    let k = draws(&[1, 2, len, d], 1.0, 52);
    let v = draws(&[1, 2, len, d], 1.0, 53);
    let w = draws(&[1, 4, len, d], 1.0, 54);
    let run = |device: &Device, dtype: DType| {
        InProcessWorld::run(ranks, |rank, cp| {
            let index: Vec<u32> = balanced_indices(rank, ranks, chunk)
                .into_iter()
                .map(|i| i as u32)
                .collect();
            let index = Tensor::new(index.as_slice(), &Device::Cpu).unwrap();
            let pos = Tensor::new(global.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap()
                .index_select(&index, 1)
                .unwrap();
            let mask = RingMask::new(&pos, &cp, None).unwrap();
            let mine = |t: &Tensor| t.index_select(&index, 2).unwrap();
            output_and_grads(
                &[&mine(&q), &mine(&k), &mine(&v)],
                &mine(&w),
                device,
                dtype,
                |t| {
                    // On the GPU the ring's pairs go to the fused kernel.
                    let fused = trl_runtime::kernels::cuda_flash::applies(&t[0], &t[1]);
                    assert_eq!(
                        fused,
                        t[0].device().is_cuda(),
                        "the fused kernel takes these"
                    );
                    ring_attention(&t[0], &t[1], &t[2], &mask).unwrap()
                },
            )
        })
    };
    let want = run(&Device::Cpu, DType::F32);
    for dtype in [DType::BF16, DType::F16] {
        let got = run(&dev, dtype);
        for (rank, ((o, g), (wo, wg))) in got.iter().zip(&want).enumerate() {
            let e = rel_diff(o, wo);
            eprintln!("ring on gpu {dtype:?} rank {rank}: output {e:e}");
            assert!(e < 2e-2, "{dtype:?} rank {rank}: output differs by {e}");
            for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(g.iter().zip(wg)) {
                let e = rel_diff(a, b);
                eprintln!("ring on gpu {dtype:?} rank {rank}: {name} {e:e}");
                assert!(e < 2e-2, "{dtype:?} rank {rank}: {name} differs by {e}");
            }
        }
    }
}

/// AdamW on the GPU (one kernel pass per parameter, in place, the gradient read in bf16 as
/// the model hands it over) follows the CPU's one-pass update in f32 on the same gradient
/// values (within 1e-5: the GPU contracts products into FMAs) over three steps: a decaying
/// weight, an exempt norm weight and a flat shard with a decay mask.
#[test]
fn fused_adamw_on_gpu_follows_the_cpu() {
    use std::collections::BTreeMap;
    use trl_runtime::optim::{AdamW, AdamWConfig};
    let Some(dev) = gpu() else { return };
    let names = [
        "layers.0.mlp.up_proj.weight",
        "layers.0.input_layernorm.weight",
        "flat",
    ];
    let params: Vec<(String, Tensor)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), draws(&[37, 29], 1.0, 60 + i as u64)))
        .collect();
    let config = AdamWConfig {
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let make = |device: &Device| {
        let on: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, t)| (n.clone(), t.to_device(device).unwrap()))
            .collect();
        let mut opt = AdamW::new(on.iter().map(|(n, t)| (n, t)), config).unwrap();
        let mask: Vec<u8> = (0..37 * 29).map(|i| (i % 3 != 0) as u8).collect();
        opt.states.get_mut("flat").unwrap().decay_mask =
            Some(Tensor::from_vec(mask, (37, 29), device).unwrap());
        opt
    };
    let (mut cpu_opt, mut gpu_opt) = (make(&Device::Cpu), make(&dev));
    // The in-place kernel keeps each state tensor (the op chain would replace them).
    let ids: Vec<_> = names
        .iter()
        .map(|n| {
            let s = &gpu_opt.states[*n];
            (s.master.id(), s.exp_avg.id(), s.exp_avg_sq.id())
        })
        .collect();
    for step in 0..3u64 {
        // bf16 gradients; the CPU gets the same values in f32.
        let grads: BTreeMap<String, Tensor> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let g = draws(&[37, 29], 0.1, 100 * step + i as u64).to_dtype(DType::BF16);
                (n.to_string(), g.unwrap())
            })
            .collect();
        let on_gpu = grads
            .iter()
            .map(|(n, g)| (n.clone(), g.to_device(&dev).unwrap()))
            .collect();
        let on_cpu = grads
            .iter()
            .map(|(n, g)| (n.clone(), g.to_dtype(DType::F32).unwrap()))
            .collect();
        cpu_opt.update(&on_cpu, 1e-2).unwrap();
        gpu_opt.update(&on_gpu, 1e-2).unwrap();
    }
    for (name, id) in names.iter().zip(&ids) {
        let name = *name;
        let (c, g) = (&cpu_opt.states[name], &gpu_opt.states[name]);
        assert_eq!(
            (g.master.id(), g.exp_avg.id(), g.exp_avg_sq.id()),
            *id,
            "{name}: the in-place kernel ran"
        );
        for (what, a, b) in [
            ("master", &c.master, &g.master),
            ("exp_avg", &c.exp_avg, &g.exp_avg),
            ("exp_avg_sq", &c.exp_avg_sq, &g.exp_avg_sq),
        ] {
            assert!(b.device().is_cuda(), "{name} {what} stays on the GPU");
            let d = max_abs_diff(a, &b.to_device(&Device::Cpu).unwrap());
            assert!(d < 1e-5, "{name} {what}: GPU and CPU differ by {d:e}");
        }
    }
}

/// The gradient norm's sums of squares on the GPU (one kernel pass per tensor, f32 and bf16
/// read as they are) equal the CPU's in f64 within 1e-5 relative, on sizes that leave partial
/// blocks and one that takes the whole grid.
#[test]
fn sums_of_squares_on_gpu_follow_the_cpu() {
    let Some(dev) = gpu() else { return };
    let shapes: [&[usize]; 3] = [&[37, 29], &[1], &[1 << 20, 3]];
    let host: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| draws(s, 1.0, 300 + i as u64))
        .collect();
    // One per dtype, then both dtypes in one call (f32 for the even tensors). The last tensor
    // is a view starting 3 elements into its buffer (not 16-byte aligned).
    for mix in [Some(DType::F32), Some(DType::BF16), None] {
        let dtype_of = |i: usize| {
            mix.unwrap_or(if i.is_multiple_of(2) {
                DType::F32
            } else {
                DType::BF16
            })
        };
        let mut on: Vec<Tensor> = host
            .iter()
            .enumerate()
            .map(|(i, t)| t.to_dtype(dtype_of(i)).unwrap().to_device(&dev).unwrap())
            .collect();
        let last = on.len() - 1;
        on[last] = on[last].narrow(0, 1, (1 << 20) - 1).unwrap();
        let got = trl_runtime::optim::sums_of_squares(on.iter()).unwrap();
        for (i, ((t, g), o)) in host.iter().zip(got).zip(&on).enumerate() {
            let dtype = dtype_of(i);
            let t = if i == last {
                t.narrow(0, 1, (1 << 20) - 1).unwrap()
            } else {
                t.clone()
            };
            assert_eq!(t.dims(), o.dims());
            let want: f64 = t
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            let rel = (g - want).abs() / want;
            eprintln!("sums of squares {dtype:?} {:?}: {rel:e}", t.dims());
            assert!(rel < 1e-5, "{dtype:?} {:?}: {g} against {want}", t.dims());
        }
    }
}

/// The embedding lookup on the GPU (a gather forward, a scatter-add backward with atomics in
/// f32, in column slabs of 128: here 128 and 72) equals the CPU's index_select in f32 and bf16:
/// rows and the table's gradient, with
/// ids repeated many times (a small vocabulary) and ids never used (zero gradient rows).
#[test]
fn embedding_on_gpu_follows_the_cpu() {
    use trl_runtime::nn::Embedding;
    let Some(dev) = gpu() else { return };
    let (vocab, hidden, n) = (300usize, 200usize, 2000usize);
    let table = draws(&[vocab, hidden], 1.0, 400);
    let ids: Vec<u32> = (0..n).map(|i| ((i * 7919) % 257) as u32).collect();
    let w = draws(&[n, hidden], 1.0, 401);
    let run = |dev: &Device, dtype: DType| {
        output_and_grads(&[&table], &w, dev, dtype, |t| {
            let ids = Tensor::new(ids.as_slice(), dev).unwrap();
            Embedding::new(t[0].clone(), hidden).forward(&ids).unwrap()
        })
    };
    let want = run(&Device::Cpu, DType::F32);
    for (dtype, bound) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        let got = run(&dev, dtype);
        let (e, eg) = (rel_diff(&got.0, &want.0), rel_diff(&got.1[0], &want.1[0]));
        eprintln!("embedding {dtype:?}: rows {e:e}, table gradient {eg:e}");
        assert!(
            e < bound && eg < bound,
            "{dtype:?}: rows {e}, gradient {eg}"
        );
    }
}

/// The trainer's loss path on the GPU (the fused LM head and loss, its weight gradient scaled
/// in place and completed by the tied embedding's lookup adding its rows into it) against the
/// plain path (logits, then the loss) in f32 on the CPU: loss and every parameter's gradient,
/// f32 and bf16, with a vocabulary of 3,000 (several ids repeated).
#[test]
fn tied_head_loss_path_on_gpu_follows_the_cpu() {
    use trl_runtime::models::{ModelConfig, Params};
    use trl_runtime::nn::causal_lm_loss;
    use trl_runtime::parallel::CausalLm;
    let Some(dev) = gpu() else { return };
    let json = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 3000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "initializer_range": 0.2,
    });
    let cfg = ModelConfig::from_json(&json.to_string(), "tied").unwrap();
    let params = Params::init(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    let (b, s) = (2usize, 96usize);
    let ids: Vec<u32> = (0..b * s).map(|i| ((i * 7919) % 2999) as u32).collect();
    let pos: Vec<i64> = (0..b * s).map(|i| (i % s) as i64).collect();
    let labels: Vec<i64> = (0..b * s)
        .map(|i| {
            if i % 11 == 0 {
                -100
            } else {
                ((i * 7919) % 2999) as i64
            }
        })
        .collect();
    let grads = |dev: &Device, dtype: DType, plain: bool| {
        let p = Params::from_tensors(
            params
                .iter()
                .map(|(n, v)| {
                    (
                        n.clone(),
                        v.as_tensor()
                            .to_dtype(dtype)
                            .unwrap()
                            .to_device(dev)
                            .unwrap(),
                    )
                })
                .collect(),
        )
        .unwrap();
        let m = CausalLm::new(cfg.clone(), p).unwrap();
        let ids = Tensor::from_vec(ids.clone(), (b, s), dev).unwrap();
        let pos = Tensor::from_vec(pos.clone(), (b, s), dev).unwrap();
        let labels = Tensor::from_vec(labels.clone(), (b, s), dev).unwrap();
        let (loss, store) = if plain {
            let loss = causal_lm_loss(&m.forward(&ids, &pos).unwrap(), &labels)
                .unwrap()
                .mean()
                .unwrap();
            let store = loss.backward().unwrap();
            (loss, store)
        } else {
            let targets = trl_runtime::nn::loss::shift_labels(&labels).unwrap();
            let ls = m.forward_targets(&ids, &pos, &targets).unwrap();
            let loss = (ls.sum / ls.count as f64).unwrap();
            let store = m.backward(&loss).unwrap();
            (loss, store)
        };
        let loss = loss
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let gs: Vec<(String, Tensor)> = m
            .params
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    store
                        .get(v.as_tensor())
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .to_device(&Device::Cpu)
                        .unwrap(),
                )
            })
            .collect();
        (loss, gs)
    };
    let (want_loss, want) = grads(&Device::Cpu, DType::F32, true);
    // bf16 is held to the CPU's own bf16 error against f32 (up to 5.7e-2 here, measured on
    // an H200 and the CPU: the GPU's was 5.2e-2 for the tied table): at most twice it.
    let (_, cpu_bf16) = grads(&Device::Cpu, DType::BF16, false);
    for dtype in [DType::F32, DType::BF16] {
        let (loss, got) = grads(&dev, dtype, false);
        let dl = ((loss - want_loss) / want_loss).abs();
        eprintln!("tied loss path {dtype:?}: loss {dl:e}");
        let loss_bound = if dtype == DType::F32 { 1e-4 } else { 1e-2 };
        assert!(dl < loss_bound, "{dtype:?}: loss {loss} vs {want_loss}");
        for (((name, g), (_, w)), (_, c)) in got.iter().zip(&want).zip(&cpu_bf16) {
            let e = rel_diff(g, w) as f32;
            let bound = match dtype {
                DType::F32 => 1e-4,
                _ => 2.0 * rel_diff(c, w) as f32 + 1e-3,
            };
            eprintln!("  {name}: {e:e} (bound {bound:e})");
            assert!(e < bound, "{dtype:?}: gradient of {name} differs by {e:e}");
        }
    }
}

/// The GPU layout and bias kernels (heads swapped by whole rows, a linear layer's bias added
/// in one pass) against the CPU's transpose and broadcast add in f32, values and gradients:
/// f32 and bf16, a row of 64 (16-byte units) and of 5 (2- and 4-byte units).
#[test]
fn swap_heads_and_bias_on_gpu_follow_the_cpu() {
    use trl_runtime::kernels::fused::{add_bias, swap_heads};
    let Some(dev) = gpu() else { return };
    for d in [64usize, 5] {
        let x = draws(&[2, 7, 3, d], 1.0, 500);
        let w = draws(&[2, 3, 7, d], 1.0, 501);
        let want = output_and_grads(&[&x], &w, &Device::Cpu, DType::F32, |t| {
            t[0].transpose(1, 2).unwrap().contiguous().unwrap()
        });
        for dtype in [DType::F32, DType::BF16] {
            let got = output_and_grads(&[&x], &w, &dev, dtype, |t| swap_heads(&t[0]).unwrap());
            let (e, eg) = (rel_diff(&got.0, &want.0), rel_diff(&got.1[0], &want.1[0]));
            eprintln!("swap heads d {d} {dtype:?}: {e:e}, gradient {eg:e}");
            assert!(
                e < 1e-2 && eg < 1e-2,
                "swap heads d {d} {dtype:?}: {e} {eg}"
            );
        }
    }
    let y = draws(&[37, 29], 1.0, 502);
    let bias = draws(&[29], 1.0, 503);
    let w = draws(&[37, 29], 1.0, 504);
    let want = output_and_grads(&[&y, &bias], &w, &Device::Cpu, DType::F32, |t| {
        t[0].broadcast_add(&t[1]).unwrap()
    });
    for (dtype, bound) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        let got = output_and_grads(&[&y, &bias], &w, &dev, dtype, |t| {
            add_bias(&t[0], &t[1]).unwrap()
        });
        let e = rel_diff(&got.0, &want.0);
        let (ey, eb) = (
            rel_diff(&got.1[0], &want.1[0]),
            rel_diff(&got.1[1], &want.1[1]),
        );
        eprintln!("bias {dtype:?}: {e:e}, gradients {ey:e} {eb:e}");
        assert!(
            e < bound && ey < bound && eb < bound,
            "bias {dtype:?}: {e} {ey} {eb}"
        );
    }
}

/// A projection with its bias, head split, rotary and scale as one op, and an output
/// projection with the heads merged and the residual added (`nn::chain`), on the GPU in f32
/// and bf16, against the same ops recorded one by one in f32 on the CPU.
#[test]
fn linear_chains_on_gpu_follow_the_cpu() {
    let Some(dev) = gpu() else { return };
    let (b, s, n, d, hidden) = CHAIN_DIMS;
    let x = draws(&[b, s, hidden], 1.0, 511);
    let w = draws(&[n * d, hidden], 0.1, 512);
    let bias = draws(&[n * d], 1.0, 513);
    let dout = draws(&[b, n, s, d], 1.0, 514);
    let a = draws(&[b, n, s, d], 1.0, 515);
    let wo = draws(&[hidden, n * d], 0.1, 516);
    let resid = draws(&[b, s, hidden], 1.0, 517);
    let dout_o = draws(&[b, s, hidden], 1.0, 518);
    type Case<'a> = (
        &'a str,
        Vec<&'a Tensor>,
        &'a Tensor,
        fn(&[Tensor], bool) -> Tensor,
    );
    let cases: [Case; 2] = [
        ("split", vec![&x, &w, &bias], &dout, split_chain),
        ("merge", vec![&a, &wo, &resid], &dout_o, merge_chain),
    ];
    for (name, inputs, g, f) in cases {
        let want = output_and_grads(&inputs, g, &Device::Cpu, DType::F32, |t| f(t, false));
        for (dtype, bound) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let got = output_and_grads(&inputs, g, &dev, dtype, |t| f(t, true));
            assert_follows(&format!("chain {name} {dtype:?}"), &got, &want, bound);
        }
    }
}

/// The gated MLP's two ops (`nn::gated`: one GEMM for gate and up, SwiGLU on each row's
/// halves, its gradient written over its input) on the GPU follow Candle's ops in f32 on the
/// CPU: output and the gradients of x, the three weights and the residual. Intermediate width
/// 200 takes the kernels' 16-byte paths, 203 the element-wise ones.
#[test]
fn gated_mlp_on_gpu_follows_the_cpu() {
    use trl_runtime::nn::gated::gated_mlp;
    let Some(dev) = gpu() else { return };
    let (b, s, hidden) = (2, 33, 96);
    for inter in [200usize, 203] {
        let x = draws(&[b, s, hidden], 1.0, 611);
        let wg = draws(&[inter, hidden], 0.1, 612);
        let wu = draws(&[inter, hidden], 0.1, 613);
        let wd = draws(&[hidden, inter], 0.1, 614);
        let resid = draws(&[b, s, hidden], 1.0, 615);
        let probe = draws(&[b, s, hidden], 1.0, 616);
        let inputs = [&x, &wg, &wu, &wd, &resid];
        let plain = |t: &[Tensor]| {
            let a = t[0].broadcast_matmul(&t[1].t().unwrap()).unwrap();
            let u = t[0].broadcast_matmul(&t[2].t().unwrap()).unwrap();
            let y = (a.silu().unwrap() * u).unwrap();
            let y = y.broadcast_matmul(&t[3].t().unwrap()).unwrap();
            (&t[4] + y).unwrap()
        };
        let want = output_and_grads(&inputs, &probe, &Device::Cpu, DType::F32, plain);
        for (dtype, bound) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let got = output_and_grads(&inputs, &probe, &dev, dtype, |t| {
                gated_mlp(&t[0], (&t[1], &t[2], &t[3]), Some(&t[4])).unwrap()
            });
            assert_follows(&format!("gated mlp {inter} {dtype:?}"), &got, &want, bound);
        }
    }
}

/// `got` (output, gradients) within `bound` of `want`, each relative to its largest value.
fn assert_follows(
    what: &str,
    got: &(Tensor, Vec<Tensor>),
    want: &(Tensor, Vec<Tensor>),
    bound: f64,
) {
    let e = rel_diff(&got.0, &want.0);
    let eg: Vec<f64> = got
        .1
        .iter()
        .zip(&want.1)
        .map(|(a, b)| rel_diff(a, b))
        .collect();
    eprintln!("{what}: output {e:e}, gradients {eg:?}");
    assert!(
        e < bound && eg.iter().all(|&x| x < bound),
        "{what}: {e} {eg:?}"
    );
}

/// (batch, seq, heads, head_dim, hidden) of the chain test.
const CHAIN_DIMS: (usize, usize, usize, usize, usize) = (2, 33, 3, 64, 96);

/// q's chain on `t` = [x, W, bias]: as one op (`fused`) or recorded op by op.
fn split_chain(t: &[Tensor], fused: bool) -> Tensor {
    use trl_runtime::kernels::fused::apply_rotary;
    use trl_runtime::nn::chain::{Chain, SplitHeads};
    let (b, s, n, d, _) = CHAIN_DIMS;
    let on = |c: Tensor| {
        c.to_device(t[0].device())
            .unwrap()
            .to_dtype(t[0].dtype())
            .unwrap()
    };
    let half = draws(&[b, s, d / 2], 1.0, 510);
    let angles = Tensor::cat(&[&half, &half], 2).unwrap();
    let chain = Chain::split(SplitHeads {
        batch: b,
        seq: s,
        heads: n,
        head_dim: d,
        rotary: Some((on(angles.cos().unwrap()), on(angles.sin().unwrap()))),
        scale: Some(0.125),
    });
    match fused {
        true => chain.linear(&t[0], &t[1], Some(&t[2])).unwrap(),
        // The same math in plain Candle ops (none of the chain's own steps).
        false => {
            let y = t[0].broadcast_matmul(&t[1].t().unwrap()).unwrap();
            let y = y
                .broadcast_add(&t[2])
                .unwrap()
                .reshape((b, s, n, d))
                .unwrap();
            let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
            let y = apply_rotary(&y.transpose(1, 2).unwrap(), &on(cos), &on(sin)).unwrap();
            (y * 0.125).unwrap()
        }
    }
}

/// o_proj's chain on `t` = [attention output, W, residual].
fn merge_chain(t: &[Tensor], fused: bool) -> Tensor {
    let chain = trl_runtime::nn::chain::Chain::merge_and_add(true, Some(&t[2]));
    match fused {
        true => chain.linear(&t[0], &t[1], None).unwrap(),
        false => {
            let (b, n, s, d) = t[0].dims4().unwrap();
            let a = t[0]
                .transpose(1, 2)
                .unwrap()
                .reshape((b, s, n * d))
                .unwrap();
            (&t[2] + a.broadcast_matmul(&t[1].t().unwrap()).unwrap()).unwrap()
        }
    }
}

/// Generation on the GPU: the decode kernel (kernels/decode.cu, flash-decoding) against the
/// CPU's on fresh random inputs (f32 and bf16, grouped heads, left-padded rows, a window,
/// soft-capping, keys long enough to split), and greedy generation of two left-padded prompts
/// on the GPU in f32 equal to the CPU's token for token.
#[test]
fn generation_on_gpu_follows_the_cpu() {
    use trl_runtime::kernels::cpu_flash::KeySpans;
    use trl_runtime::kernels::{cuda_decode, decode};
    let Some(dev) = gpu() else { return };
    for (b, heads, kv_heads, sq, keys, d, cap) in [
        (2, 14, 2, 1, 1500, 64, None),
        (3, 8, 8, 2, 600, 128, Some(30.0f32)),
    ] {
        let capacity = keys + 5;
        let q = draws(&[b, heads, sq, d], 1.0, 1);
        let k = draws(&[b, kv_heads, capacity, d], 1.0, 2);
        let v = draws(&[b, kv_heads, capacity, d], 1.0, 3);
        let (mut lo, mut hi) = (Vec::new(), Vec::new());
        for bi in 0..b {
            for i in 0..sq {
                let at = keys - sq + i;
                let start = 7 * bi;
                let first = if bi == 1 {
                    (at + 1).saturating_sub(256).max(start)
                } else {
                    start
                };
                lo.push(first as u32);
                hi.push(at as u32 + 1);
            }
        }
        let mut spans = KeySpans::new(sq, lo, hi);
        spans.softcap = cap;
        let (want, want_lse) = decode::attention(&q, (&k, &v), keys, &spans).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            let (got, lse) =
                cuda_decode::attention(&on(&q), (&on(&k), &on(&v)), keys, &spans).unwrap();
            let got = got.to_device(&Device::Cpu).unwrap();
            let lse = lse.to_device(&Device::Cpu).unwrap();
            let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
            let diff = max_abs_diff(&got, &want);
            assert!(
                diff < tol,
                "{dtype:?} {keys} keys: output differs by {diff}"
            );
            let diff = max_abs_diff(&lse, &want_lse);
            assert!(
                diff < tol * 10.0,
                "{dtype:?}: log-sum-exp differs by {diff}"
            );
        }
    }
    let dir = assets().join("model");
    let ids = Tensor::new(
        &[[0u32, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26]],
        &Device::Cpu,
    )
    .unwrap();
    let mask = Tensor::new(&[[0u32, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], &Device::Cpu).unwrap();
    let cfg = trl_runtime::generation::GenerationConfig {
        max_new_tokens: 12,
        pad_token_id: Some(0),
        ..Default::default()
    };
    let on = |device: &Device| {
        trl_runtime::models::AutoModelForCausalLM::from_pretrained(&dir, DType::F32, device)
            .unwrap()
            .generate(&ids, &mask, &cfg)
            .unwrap()
            .to_vec2::<u32>()
            .unwrap()
    };
    assert_eq!(on(&dev), on(&Device::Cpu));
}

/// Decode steps as a CUDA graph (`generation::generate_fixed`, what `TRL_CUDA_GRAPHS=1`
/// turns on): the first step after the prompt eager with Candle's upload cache, the second
/// captured, the rest replayed with their inputs, length, positions and key spans written
/// into the buffers the captured kernels read. Their tokens equal eager steps' on the same
/// GPU over 40 new tokens (greedy picked on the device, and sampled: the logits read back),
/// in f32 and bf16, for plain attention and for windows with soft-capping (Gemma 2), and the
/// graph was not given up.
#[test]
fn decode_graph_replays_equal_eager_steps() {
    use trl_runtime::generation::{generate_fixed, GenerationConfig};
    let Some(dev) = gpu() else { return };
    let ids = Tensor::new(
        &[[0u32, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26]],
        &Device::Cpu,
    )
    .unwrap();
    let mask = Tensor::new(&[[0u32, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], &Device::Cpu).unwrap();
    let greedy = GenerationConfig {
        max_new_tokens: 40,
        pad_token_id: Some(0),
        ..Default::default()
    };
    let sampled = GenerationConfig {
        do_sample: true,
        seed: 7,
        ..greedy.clone()
    };
    for kind in ["tiny", "tiny-gemma2"] {
        let dir = assets().join("..").join(kind).join("model");
        for dtype in [DType::F32, DType::BF16] {
            let model =
                trl_runtime::models::AutoModelForCausalLM::from_pretrained(&dir, dtype, &dev)
                    .unwrap();
            for cfg in [&greedy, &sampled] {
                let run = |fixed| generate_fixed(&model, &ids, &mask, cfg, fixed).unwrap();
                let (want, _) = run(false);
                let (got, gave_up) = run(true);
                let what = format!("{kind} {dtype:?} sampled {}", cfg.do_sample);
                assert_eq!(gave_up, None, "{what}: the graph was given up");
                assert_eq!(
                    got.to_vec2::<u32>().unwrap(),
                    want.to_vec2::<u32>().unwrap(),
                    "{what}: replayed steps differ from eager ones"
                );
            }
        }
    }
}

/// The gated delta rule's CUDA kernels (`kernels/gated_delta.cu`) follow the CPU kernel in
/// f32: outputs, final state and the gradients of q, k, v, the decays, the strengths and the
/// initial state, on packed rows (documents starting mid-row, inside and on the 16-token
/// checkpoints), 128 key features (the kernels' most) and 70 value columns (three blocks,
/// the last partial); and one decoded token from a state.
#[test]
fn gated_delta_rule_on_gpu_follows_the_cpu() {
    use trl_runtime::kernels::gated_delta::delta_rule;
    let Some(dev) = gpu() else { return };
    for (s, dk, dv) in [(45usize, 128usize, 70usize), (1, 64, 32)] {
        let (b, h) = (2, 3);
        let scale = 1.0 / (dk as f32).sqrt();
        let inputs = [
            draws(&[b, h, s, dk], scale, 701),
            draws(&[b, h, s, dk], scale, 702),
            draws(&[b, h, s, dv], 1.0, 703),
            draws(&[b, h, s], 1.0, 704),
            draws(&[b, h, s], 1.0, 705),
            draws(&[b, h, dk, dv], 0.3, 706),
        ];
        let mut starts = vec![vec![false; s]; b];
        if s > 32 {
            starts[0][0] = true;
            starts[0][16] = true;
            starts[1][23] = true;
        }
        let probe = draws(&[b, h, s + dk, dv], 1.0, 707);
        // The op itself (on a GPU the layers take it with TRL_DELTA_RULE=fused).
        let rule = |t: &[Tensor]| {
            // Log decays in (-inf, 0], strengths in (0, 1), as the layer makes them.
            let g = (t[3].abs().unwrap().neg().unwrap() * 0.3).unwrap();
            let beta = candle_nn::ops::sigmoid(&t[4]).unwrap();
            let (out, state) =
                delta_rule(&t[0], &t[1], &t[2], &g, &beta, &starts, Some(&t[5])).unwrap();
            Tensor::cat(&[out, state], 2).unwrap()
        };
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let want = output_and_grads(&refs, &probe, &Device::Cpu, DType::F32, rule);
        let got = output_and_grads(&refs, &probe, &dev, DType::F32, rule);
        assert_follows(
            &format!("gated delta rule s {s} dk {dk} dv {dv}"),
            &got,
            &want,
            1e-5,
        );
    }
}
