//! What a rank computes and communicates with: matmul rates, link speeds, the CPU probes.

use super::*;
use crate::config::parallelism::ParallelDims;
use crate::error::Result;
use crate::models::ModelConfig;
use crate::nn::lora::LoraConfig;
use candle_core::{DType, Device};

/// What a rank computes and communicates with: its sustained matmul rate and the bandwidth
/// of the links its groups use.
#[derive(Debug, Clone, Copy)]
pub struct Hardware {
    /// Sustained matmul rate of one rank in the compute dtype (FLOP/s).
    pub flops: f64,
    /// The share of a whole (unsplit) step's time its matmuls take; the rest (norms,
    /// element-wise ops, the optimizer) is not split by tensor parallelism. 1 where `flops`
    /// already folds it in (the GPU table's MFU).
    pub matmul_share: f64,
    /// Collectives within a machine.
    pub intra: LinkSpeed,
    /// Collectives across machines.
    pub inter: LinkSpeed,
    /// Processes per machine: a group larger than this crosses machines.
    pub per_machine: usize,
    /// Parameters per second one rank updates with its optimizer state in host memory
    /// (gradients copied down, AdamW on the host, weights copied back); infinite where the
    /// device is the host.
    pub offload_params_per_s: f64,
    /// Whether data-parallel collectives run beside compute (NCCL on its own stream) or take
    /// their time from it (the host backend copies and sums on the cores the ranks' compute
    /// threads already fill).
    pub comm_overlaps: bool,
    /// Seconds one rank spends per logit in a loss over whole logits, beyond the head's
    /// matmul ([`cpu_whole_logits_seconds`] on a CPU; 0 in the GPU table, where the step's
    /// MFU was measured and this cost is not yet).
    pub logit_seconds: f64,
    /// Seconds one rank spends per token and per input and output feature of each layer
    /// LoRA adapts (dropout, the rank-r products, the sums) beyond what the FLOP rule charges
    /// ([`cpu_step_rates`] on a CPU; 0 in the GPU table: not yet measured there).
    pub adapter_element_seconds: f64,
}

/// The unit of every CPU matmul rate here: 512-cube f32 matmuls on the calling thread.
pub(super) struct Gemm512 {
    a: Vec<f32>,
    c: Vec<f32>,
}

impl Gemm512 {
    const N: usize = 512;

    fn new() -> Self {
        let mut gemm = Gemm512 {
            a: vec![1f32; Self::N * Self::N],
            c: vec![0f32; Self::N * Self::N],
        };
        gemm.run(); // the pages touched and the caches warm before anything is timed
        gemm
    }

    fn run(&mut self) {
        use crate::kernels::cpu_gemm::{mm, Mat};
        let n = Self::N;
        mm(
            (n, n, n),
            &mut self.c,
            n,
            Mat::rows(&self.a, n),
            Mat::rows(&self.a, n),
            1.0,
            false,
        )
    }

    /// FLOP/s over `window` (at least two products).
    fn rate(&mut self, window: std::time::Duration) -> f64 {
        let start = std::time::Instant::now();
        let mut runs = 0u32;
        while start.elapsed() < window || runs < 2 {
            self.run();
            runs += 1;
        }
        2.0 * (Self::N as f64).powi(3) * runs as f64 / start.elapsed().as_secs_f64()
    }
}

/// FLOP/s of one rank's f32 matmuls while `ranks` ranks of `threads` compute threads each fill
/// this machine, as a launch runs them: every thread multiplies 512-cube matrices on its own,
/// all at once, over seven windows of a tenth of a second; the median window's total, shared
/// by the ranks. Timed with every rank's threads busy, so shared cores, memory bandwidth and a
/// loaded machine's clock are in it, and the median leaves out a window another process took.
pub fn cpu_rank_matmul_flops(ranks: usize, threads: usize) -> f64 {
    use std::sync::Barrier;
    use std::time::Duration;
    const WINDOWS: usize = 7;
    let ranks = ranks.max(1);
    let workers = ranks * threads.max(1);
    let barrier = Barrier::new(workers);
    let per_worker: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut gemm = Gemm512::new();
                    (0..WINDOWS)
                        .map(|_| {
                            barrier.wait();
                            gemm.rate(Duration::from_millis(100))
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let mut totals: Vec<f64> = (0..WINDOWS)
        .map(|w| per_worker.iter().map(|rates| rates[w]).sum())
        .collect();
    totals.sort_by(f64::total_cmp);
    match totals.get(WINDOWS / 2) {
        Some(&total) if total > 0.0 => total / ranks as f64,
        _ => 1e9,
    }
}

/// Seconds per logit of the loss over whole logits (forward and backward, fp32: the
/// log-softmax's passes over [tokens, vocabulary] that the fused loss never makes) on this CPU
/// with the threads candle's kernels use in this process (the best of three runs over
/// 1024 x 4096 logits). Memory-bound, so not in the matmul rate.
pub fn cpu_whole_logits_seconds() -> f64 {
    use candle_core::{Device, Tensor, Var};
    let (rows, vocab) = (1024, 4096);
    let run = || -> candle_core::Result<f64> {
        let logits = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, vocab), &Device::Cpu)?)?;
        let targets = Tensor::arange(0i64, rows as i64, &Device::Cpu)?;
        let start = std::time::Instant::now();
        // What training runs on whole logits: the loss with TRL's token figures.
        let loss = crate::nn::loss::cross_entropy_sum(logits.as_tensor(), &targets)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        loss.sum.backward()?;
        Ok(start.elapsed().as_secs_f64() / (rows * vocab) as f64)
    };
    let _ = run();
    (0..3)
        .filter_map(|_| run().ok())
        .fold(f64::INFINITY, f64::min)
        .min(1e-6)
}

/// How fast a link moves a collective: a fixed cost per collective and the bus bandwidth
/// beyond it (the time of an all-reduce of `b` bytes over `n` ranks is
/// `latency + 2 (n - 1) / n * b / bandwidth`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpeed {
    /// Seconds per collective, whatever its size.
    pub latency: f64,
    /// Bus bytes per second.
    pub bandwidth: f64,
}

impl LinkSpeed {
    /// Seconds of `count` collectives moving `bus_bytes` in all.
    pub fn seconds(&self, count: f64, bus_bytes: f64) -> f64 {
        count * self.latency + bus_bytes / self.bandwidth
    }
}

/// The host backend's all-reduce between `ranks` threads of this process, over the
/// shared-memory rings same-machine ranks use: timed at 64 KiB and 16 MiB of f32 (the best of
/// five after a warm-up, by the slowest rank), the latency and bandwidth that fit both.
pub fn host_all_reduce_speed(ranks: usize) -> Result<LinkSpeed> {
    use crate::comm::host::HostBackend;
    use crate::comm::store::{Store, StoreServer};
    use crate::comm::ReduceOp;
    use std::time::{Duration, Instant};
    let ranks = ranks.max(2);
    let sizes = [64usize << 10, 16 << 20];
    let token = "trl-bandwidth";
    let timeout = Duration::from_secs(30);
    let server = StoreServer::bind("127.0.0.1:0", token)?;
    let addr = server.addr().to_string();
    let per_rank = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let addr = &addr;
                s.spawn(move || -> Result<Vec<f64>> {
                    let store = std::sync::Arc::new(Store::connect(addr, token, timeout)?);
                    let host = HostBackend::new(store, token, rank, timeout);
                    let all: Vec<usize> = (0..ranks).collect();
                    let comm = host.group("bandwidth", &all)?;
                    let mut times = Vec::new();
                    for bytes in sizes {
                        let x = candle_core::Tensor::ones(bytes / 4, DType::F32, &Device::Cpu)?;
                        comm.all_reduce(&x, ReduceOp::Sum)?;
                        let mut best = f64::MAX;
                        for _ in 0..5 {
                            let start = Instant::now();
                            comm.all_reduce(&x, ReduceOp::Sum)?;
                            best = best.min(start.elapsed().as_secs_f64());
                        }
                        times.push(best);
                    }
                    Ok(times)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect::<Result<Vec<Vec<f64>>>>()
    })?;
    let slowest = |i: usize| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max);
    let (small, large) = (slowest(0), slowest(1));
    let n = ranks as f64;
    let bus = |bytes: usize| 2.0 * (n - 1.0) / n * bytes as f64;
    let bandwidth = (bus(sizes[1]) - bus(sizes[0])) / (large - small).max(1e-9);
    let latency = (small - bus(sizes[0]) / bandwidth).max(0.0);
    Ok(LinkSpeed { latency, bandwidth })
}

/// What a CPU training process holds before its model and rings (binary, libraries,
/// runtime: the tiny model's workers read ~13 MiB of RssFile and ~10 MiB of RssAnon there).
/// The trainer measures its own instead; `cargo trl plan` adds this.
pub const CPU_PROCESS_RSS: usize = 24 << 20;

/// Bytes of the host backend's shared-memory rings a CPU rank has touched once training has
/// gone round them (`comm::shared_memory_bytes` counts them in a run): two rings per group
/// it talks over with ranks of its own machine (to the next rank and from the one before,
/// for ring collectives), 2 (n - 1) for Ulysses' all-to-all over n. The groups: the
/// data-parallel one (every rank sharing the gradients: replicas, shards, cp and sp ranks;
/// split in two for HSDP), and tp, cp and sp each on their own.
pub fn cpu_ring_bytes(dims: ParallelDims, per_machine: usize) -> usize {
    let ring = 2 * crate::comm::host::SHM_RING_BYTES;
    if per_machine < 2 {
        return 0;
    }
    let shard = dims.dp_shard * dims.cp * dims.sp;
    let data_parallel = match (dims.dp_replicate > 1, shard > 1) {
        (true, true) => 2,
        (false, false) => 0,
        _ => 1,
    };
    let ring_groups = data_parallel + (dims.tp > 1) as usize + (dims.cp > 1) as usize;
    let ulysses_peers = dims.sp.min(per_machine).saturating_sub(1);
    (ring_groups + ulysses_peers) * ring
}

/// Threads candle's CPU kernels use in this process (RAYON_NUM_THREADS, else the cores).
pub fn cpu_threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// How fast a CPU rank trains, as a launch runs `ranks` ranks of `threads` compute threads
/// each: its matmul rate and the share of a step its matmuls take.
#[derive(Debug, Clone, Copy)]
pub struct CpuStepRates {
    /// FLOP/s of the rank's 512-cube f32 matmuls (every thread multiplying on its own).
    pub rank_flops: f64,
    /// Of a step's time, the share its matmuls take at `rank_flops`. The rest (norms,
    /// rotary, softmax, the optimizer, copies) is memory-bound, and machines differ in how
    /// fast it runs beside their matmuls: `bench model` read 0.77-0.84 of the matmul rate on
    /// earlier machines and 0.56 on one with AVX-512, so this is measured, not a constant.
    pub matmul_share: f64,
    /// Seconds per token and per adapted feature that LoRA adds beyond its FLOPs
    /// ([`Hardware::adapter_element_seconds`]).
    pub adapter_element_seconds: f64,
}

impl CpuStepRates {
    /// Each figure's mean over `all` (one or more timings).
    pub fn mean(all: &[CpuStepRates]) -> CpuStepRates {
        let mean = |f: fn(&CpuStepRates) -> f64| all.iter().map(f).sum::<f64>() / all.len() as f64;
        CpuStepRates {
            rank_flops: mean(|r| r.rank_flops),
            matmul_share: mean(|r| r.matmul_share),
            adapter_element_seconds: mean(|r| r.adapter_element_seconds),
        }
    }
}

/// [`CpuStepRates`] timed on this machine: forward and backward of a 2-layer model of the
/// built-in layers (hidden 256, intermediate 768, vocab 4096, 2 x 512 tokens, the fused loss),
/// its matmul FLOPs as [`step_time`] counts them, in five rounds of a step beside a tenth of
/// a second of 512-cube matmuls on every thread; the medians. The rate and the share come
/// from the same rounds, so their product (what a prediction divides by) is the step's own
/// speed: a shared machine's rate moves by a quarter within seconds, and a rate timed apart
/// from the share carried that into every prediction. Without a probe (it cannot run, or a
/// debug build: the tests' `cargo trl`, whose dependencies keep their debug assertions, so
/// not the release program a launch runs) the share is 0.75 beside [`cpu_rank_matmul_flops`].
pub fn cpu_step_rates(ranks: usize, threads: usize) -> CpuStepRates {
    const FALLBACK: f64 = 0.75;
    // LoRA's extra per adapted feature, in FLOPs at the matmul rate: ~400 measured here
    // (r 16, dropout 0.05, one thread).
    const FALLBACK_ADAPTER_FLOPS: f64 = 400.0;
    let fallback = || {
        let rank_flops = cpu_rank_matmul_flops(ranks, threads);
        CpuStepRates {
            rank_flops,
            matmul_share: FALLBACK,
            adapter_element_seconds: FALLBACK_ADAPTER_FLOPS / rank_flops,
        }
    };
    if cfg!(debug_assertions) {
        return fallback();
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Every rank runs the probe at once, each on a pool of its threads: the memory-bound
    // part slows when ranks share the machine's bandwidth. More ranks than cores (one thread
    // each) only take turns: as many probes as cores show the same share.
    let probed: Vec<CpuStepRates> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks.clamp(1, cores))
            .map(|_| {
                s.spawn(|| {
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(threads.max(1))
                        .build()
                        .map_err(|e| crate::Error::from(candle_core::Error::Msg(e.to_string())))
                        .and_then(|pool| pool.install(step_speed_probe))
                        .inspect_err(|e| {
                            tracing::warn!("cannot time a training step's speed ({e}); taking a matmul share of {FALLBACK}")
                        })
                        .ok()
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok().flatten())
            .collect()
    });
    if probed.is_empty() {
        return fallback();
    }
    let mean = CpuStepRates::mean(&probed);
    CpuStepRates {
        matmul_share: mean.matmul_share.clamp(0.2, 1.0),
        adapter_element_seconds: mean.adapter_element_seconds.max(0.0),
        ..mean
    }
}

/// One rank's [`cpu_step_rates`] on the current thread pool: each round times the pool's
/// matmuls, a step of the probe model and a step of it with LoRA (r 16, alpha 32, dropout
/// 0.05 on every linear layer, TRL's recipe).
pub(super) fn step_speed_probe() -> Result<CpuStepRates> {
    use crate::models::Params;
    use crate::nn::lora::{with_dropout, Targets};
    use candle_core::Tensor;
    use std::time::Instant;
    let (batch, seq) = (2, 512);
    let json = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": seq, "rope_theta": 1000000.0, "tie_word_embeddings": true,
    })
    .to_string();
    let lora = LoraConfig::new(16, 32.0, 0.05, Targets::AllLinear);
    let source = "the step-speed probe";
    let cfg = ModelConfig::from_json(&json, source)?;
    let shapes = ModelShapes::of_json(&json, source)?;
    let tokens = (batch * seq) as f64;
    let adapters: usize = shapes.adapters(&lora, 1).iter().map(|(_, n)| *n).sum();
    let flops = shapes.matmul_flops_per_token(seq, false, 0) * tokens;
    let lora_flops = shapes.matmul_flops_per_token(seq, false, adapters) * tokens;
    let adapted_features = shapes.adapted_features(&lora, 1) * tokens;
    let new_model = || {
        crate::parallel::CausalLm::new(
            cfg.clone(),
            Params::init(&cfg, 0, DType::F32, &Device::Cpu)?,
        )
    };
    let model = new_model()?;
    let mut lora_model = new_model()?;
    lora_model.add_adapters(&lora)?;
    let ids: Vec<u32> = (0..batch * seq)
        .map(|i| (i * 7919 % cfg.vocab_size) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (batch, seq), &Device::Cpu)?;
    let pos = Tensor::arange(0i64, seq as i64, &Device::Cpu)?
        .unsqueeze(0)?
        .repeat((batch, 1))?;
    let labels = ids.to_dtype(DType::I64)?;
    let step = |model: &crate::parallel::CausalLm| -> Result<f64> {
        let start = Instant::now();
        with_dropout(7, || model.forward_loss(&ids, &pos, &labels))?
            .mean()?
            .backward()?;
        Ok(start.elapsed().as_secs_f64())
    };
    // The rank's rate as `cpu_rank_matmul_flops` takes it: every thread of the pool
    // multiplying on its own.
    let matmul = || -> f64 {
        rayon::broadcast(|_| Gemm512::new().rate(std::time::Duration::from_millis(100)))
            .iter()
            .sum()
    };
    step(&model)?;
    step(&lora_model)?;
    let (mut rates, mut shares, mut extra) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let rate = matmul();
        let (full, adapted) = (step(&model)?, step(&lora_model)?);
        shares.push(flops / rate / full);
        extra.push((adapted - full - (lora_flops - flops) / rate) / adapted_features);
        rates.push(rate);
    }
    Ok(CpuStepRates {
        rank_flops: median(&mut rates),
        matmul_share: median(&mut shares),
        adapter_element_seconds: median(&mut extra),
    })
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Hardware {
    /// CPU ranks training at `rates` ([`cpu_step_rates`]), `per_machine` on a machine, the
    /// host backend's collectives between them at `link` (as [`host_all_reduce_speed`]
    /// measures it; across machines taken as the same), `logit_seconds` per logit of a
    /// whole-logits loss on a rank (the machine's [`cpu_whole_logits_seconds`] times the
    /// ranks sharing its memory).
    pub fn cpu(
        rates: CpuStepRates,
        per_machine: usize,
        link: LinkSpeed,
        logit_seconds: f64,
    ) -> Self {
        Hardware {
            flops: rates.rank_flops,
            logit_seconds,
            matmul_share: rates.matmul_share,
            adapter_element_seconds: rates.adapter_element_seconds,
            intra: link,
            inter: link,
            per_machine,
            offload_params_per_s: f64::INFINITY,
            comm_overlaps: false,
        }
    }
}
