//! `cargo bench -p trl-runtime --bench generate`: greedy generation with the KV cache against
//! transformers' `generate` (KV cache, sdpa, float32, the same threads; benches/hf_generate.py)
//! on this CPU in the same run, on the same random-init checkpoints: the Qwen2-0.5B shape
//! (assets/configs/qwen2-0.5b.json), a SmolLM2-135M-like Llama, where per-token overhead
//! weighs most (GRPO on small models), and a Qwen3.5-like hybrid (Gated DeltaNet layers, whose
//! cache is a recurrent state, between full-attention layers), at batch 1 and 8, a 32-token
//! prompt and 32 new tokens (`--only NAME`: one shape, without the skinny lines; `--batch N`: one batch size).
//!
//! Per line: decode tokens/s (the new tokens past the first, over the time past the prefill),
//! ours over transformers'; at batch 1 the bytes read per token (every weight once, the LM
//! head included, plus the KV cache or recurrent state) over the time, as a fraction of this machine's memory
//! bandwidth measured in the same run (a multi-threaded read of 1 GiB); the decode rate that
//! bandwidth allows at all (`bandwidth_ceiling_tokens_per_s`: a step's bytes at that rate) and
//! its ratio to transformers' (`ceiling_over_transformers`: how far over transformers any
//! decode can go on this machine); at batch 8 on AVX-512 the same at the rate this machine
//! streams memory while doing the 8 multiply-adds per 64-byte line that 8 rows need at least
//! (`fma_stream_ceiling_tokens_per_s`, `of_fma_stream_ceiling`,
//! `fma_stream_ceiling_over_transformers`: where streaming and arithmetic do not overlap, the
//! tighter bound); and the prefill's FLOP/s (2 x parameters x tokens) over
//! this machine's f32 matmul rate measured in the same run. One JSON object per line on
//! stdout; prose on stderr.
//!
//! Built with `--features cuda` and run with `TRL_BENCH_ONLY=cuda` on a machine with a GPU
//! (`scripts/gpu-run generate`): the same in bf16 on the GPU, batch 1 and 32, a 128-token
//! prompt and 128 new tokens, against transformers' `generate` on the same GPU (KV cache,
//! sdpa, bf16), batch 1's bytes per token against the GPU's copy bandwidth measured in the
//! same run (`"device":"cuda"` lines), each with eager decode steps and with the steps
//! captured once as a CUDA graph and replayed (`"steps":"cuda_graph"`, what
//! `TRL_CUDA_GRAPHS=1` turns on; `graph_over_eager`: its rate over the eager line's).

mod support;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use std::path::Path;
use std::time::Instant;
use trl_runtime::generation::{generate_fixed, GenerationConfig};
use trl_runtime::models::{AutoModelForCausalLM, ModelConfig};

const PROMPT: usize = 32;
const NEW: usize = 32;
const REPS: usize = 3;

fn smollm2_like() -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "hidden_act": "silu",
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds to generate `new` tokens after `batch` prompts of PROMPT tokens (the median of
/// REPS runs).
fn ours(model: &AutoModelForCausalLM, vocab: usize, batch: usize, new: usize) -> f64 {
    ours_at(model, vocab, batch, (PROMPT, new), false)
}

/// Seconds to generate `new` tokens after `batch` prompts of `prompt` tokens (the median of
/// REPS runs; the output is read back to the host, so a GPU has finished).
/// `graph`: the decode steps as a CUDA graph (`generate_fixed`); a graph given up is said
/// on stderr (the steps then ran eagerly).
fn ours_at(
    model: &AutoModelForCausalLM,
    vocab: usize,
    batch: usize,
    (prompt, new): (usize, usize),
    graph: bool,
) -> f64 {
    let ids: Vec<u32> = (0..batch * prompt)
        .map(|i| (3 + (i * 104729) % (vocab - 8)) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (batch, prompt), &Device::Cpu).unwrap();
    let mask = Tensor::ones((batch, prompt), DType::U32, &Device::Cpu).unwrap();
    let cfg = GenerationConfig {
        max_new_tokens: new,
        pad_token_id: Some(0),
        ..GenerationConfig::default()
    };
    let run = || {
        let t = Instant::now();
        let (out, gave_up) = generate_fixed(model, &ids, &mask, &cfg, graph).unwrap();
        if let Some(why) = gave_up {
            eprintln!("the decode graph was given up: {why}");
        }
        let out = out.to_device(&Device::Cpu).unwrap();
        assert_eq!(out.dim(1).unwrap(), prompt + new);
        t.elapsed().as_secs_f64()
    };
    run();
    median((0..REPS).map(|_| run()).collect())
}

/// transformers' (prefill, total) seconds per batch, or None when it cannot run.
fn theirs(dir: &Path, batches: &[usize]) -> Option<Vec<(f64, f64)>> {
    theirs_on(dir, batches, PROMPT, NEW, "cpu")
        .map(|v| v.into_iter().map(|(p, t, _)| (p, t)).collect())
}

/// transformers' (prefill, total) seconds per batch on `device` ("cpu": float32; "cuda":
/// bfloat16) and, on a GPU, torch's device copy rate (bytes/s), or None when it cannot run.
fn theirs_on(
    dir: &Path,
    batches: &[usize],
    prompt: usize,
    new: usize,
    device: &str,
) -> Option<Vec<(f64, f64, Option<f64>)>> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let job = serde_json::json!({
        "cases": batches.iter().map(|&b| serde_json::json!({"batch": b, "prompt": prompt, "new": new})).collect::<Vec<_>>(),
        "threads": rayon::current_num_threads(), "reps": REPS, "device": device,
    });
    let job_file = dir.join("job.json");
    std::fs::write(&job_file, job.to_string()).unwrap();
    let script = support::repo().join("trl-runtime/benches/hf_generate.py");
    let out = std::process::Command::new(&python)
        .arg(script)
        .arg(dir.join("model"))
        .arg(&job_file)
        .output();
    match out {
        Ok(o) if o.status.success() => Some(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(|l| {
                    let v: serde_json::Value = serde_json::from_str(l).unwrap();
                    (
                        v["prefill_s"].as_f64().unwrap(),
                        v["total_s"].as_f64().unwrap(),
                        v["copy_bytes_per_s"].as_f64(),
                    )
                })
                .collect(),
        ),
        Ok(o) => {
            eprintln!(
                "no transformers ({python}): {}",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            None
        }
        Err(e) => {
            eprintln!("no transformers: cannot run {python}: {e}");
            None
        }
    }
}

/// Bytes one decode step reads at `batch`: every weight once (`dtype`'s bytes each) and the
/// generation cache at the step's average length (the prompt and half the new tokens) as the
/// planner counts it (`estimate::generation_round`: each layer's keys and values, or a Gated
/// DeltaNet layer's recurrent state).
fn step_bytes(
    config: &serde_json::Value,
    params: usize,
    batch: usize,
    (prompt, new): (usize, usize),
    dtype: DType,
) -> f64 {
    use trl_runtime::config::parallelism::ParallelDims;
    use trl_runtime::parallel::estimate::{generation_round, ModelShapes, Setup};
    let shapes = ModelShapes::of_json(&config.to_string(), "benchmark model").unwrap();
    let mut setup = Setup::new(
        trl_runtime::train::Strategy::Ddp,
        ParallelDims::single(),
        batch,
        prompt + new,
    );
    setup.dtype = dtype;
    let cache = generation_round(&shapes, &setup, batch, (prompt, prompt + new / 2)).kv_cache;
    (params * dtype.size_in_bytes() + cache) as f64
}

/// transformers' decode rate on `line` and ours over it, from its (prefill, total) seconds;
/// `(tokens, decode, prefill)`: the new tokens past the first, our decode tokens/s and
/// prefill seconds.
fn with_peer(
    line: &mut serde_json::Value,
    (tokens, decode, prefill): (usize, f64, f64),
    (p, t): (f64, f64),
) {
    let theirs = tokens as f64 / (t - p);
    line["transformers_decode_tokens_per_s"] = theirs.into();
    line["over_transformers"] = (decode / theirs).into();
    line["prefill_over_transformers"] = (p / prefill).into();
}

/// This machine's memory read bandwidth, bytes/s: the faster of every thread summing its
/// part of 1 GiB and the skinny kernel streaming a 1 GiB weight for one row (AVX-512 loads
/// where the CPU has them: the fastest read this process can make).
fn bandwidth() -> f64 {
    let data = vec![1f32; 1 << 28];
    let read = || {
        let t = Instant::now();
        // Sixteen lanes, so the sum vectorizes and the read, not the adds, bounds it.
        let s: f32 = data
            .par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0f32; 16];
                for x in c.chunks_exact(16) {
                    for l in 0..16 {
                        acc[l] += x[l];
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        assert!(s > 0.0);
        t.elapsed().as_secs_f64()
    };
    read();
    let summed = median((0..5).map(|_| read()).collect());
    let w = Tensor::from_vec(data, (1 << 18, 1 << 10), &Device::Cpu).unwrap();
    let x = Tensor::ones((1, 1 << 10), DType::F32, &Device::Cpu).unwrap();
    let stream = || {
        let t = Instant::now();
        trl_runtime::kernels::skinny::matmul_t(&x, &w).unwrap();
        t.elapsed().as_secs_f64()
    };
    stream();
    let streamed = median((0..5).map(|_| stream()).collect());
    (1usize << 30) as f64 / summed.min(streamed)
}

/// Bytes/s this machine streams when each 64-byte line read feeds 8 16-lane f32
/// multiply-adds (an 8-row decode step's least work: each weight times each row), every
/// thread reading its part of 1 GiB; None without AVX-512. The multiply-adds use the loaded
/// data, into accumulators of their own, and touch nothing else in memory: no kernel can read
/// the weights for 8 rows faster than this (on the Intel VM the two add: 8 of them per
/// line took the 2 threads' read from 30 to ~21 GB/s, whatever the prefetch).
fn streamed_with_eight_fmas() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        if !std::is_x86_feature_detected!("avx512f") {
            return None;
        }
        /// The sum of `v`'s lines, each multiplied into 8 accumulators on the way.
        #[target_feature(enable = "avx512f")]
        unsafe fn eight_per_line(v: &[f32]) -> f32 {
            let mut acc = [_mm512_setzero_ps(); 8];
            let m = _mm512_set1_ps(0.999);
            let p = v.as_ptr();
            let mut c = 0;
            while c + 16 <= v.len() {
                // The hardware prefetcher gets help 4 KiB ahead, as the skinny kernel does.
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(c + 1024).cast());
                let x = _mm512_loadu_ps(p.add(c));
                for a in acc.iter_mut() {
                    *a = _mm512_fmadd_ps(x, m, *a);
                }
                c += 16;
            }
            let mut s = _mm512_setzero_ps();
            for a in acc {
                s = _mm512_add_ps(s, a);
            }
            _mm512_reduce_add_ps(s)
        }
        let data = vec![1f32; 1 << 28];
        let part = data.len() / rayon::current_num_threads();
        let read = || {
            let t = Instant::now();
            // SAFETY: the CPU has AVX-512F (checked above).
            let s: f32 = data
                .par_chunks(part)
                .map(|c| unsafe { eight_per_line(c) })
                .sum();
            assert!(s > 0.0);
            t.elapsed().as_secs_f64()
        };
        read();
        Some((1usize << 30) as f64 / median((0..5).map(|_| read()).collect()))
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// This machine's f32 matmul rate through Candle, FLOP/s (1024 x 4096 by 4096 x 1024).
fn matmul_rate() -> f64 {
    let a = Tensor::randn(0f32, 1.0, (1024, 4096), &Device::Cpu).unwrap();
    let b = Tensor::randn(0f32, 1.0, (4096, 1024), &Device::Cpu).unwrap();
    let run = || {
        let t = Instant::now();
        let c = a.matmul(&b).unwrap();
        assert_eq!(c.dims(), &[1024, 1024]);
        t.elapsed().as_secs_f64()
    };
    run();
    2.0 * 1024.0 * 4096.0 * 1024.0 / median((0..5).map(|_| run()).collect())
}

/// The decode step's projections: the skinny kernel against Candle's matmul, `x` [m, k] by
/// `w` [n, k] transposed (the median of 20 runs each).
fn skinny_lines() {
    for (m, k, n) in [
        (1, 576, 1536),
        (8, 576, 1536),
        (8, 1536, 576),
        (1, 896, 151936),
        (8, 896, 4864),
    ] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        let time = |f: &dyn Fn() -> Tensor| {
            f();
            median(
                (0..20)
                    .map(|_| {
                        let t = Instant::now();
                        f();
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        };
        // Inside a generation forward, as decoding runs them (the pool's other threads spin
        // between ops instead of sleeping); outside it the 8-row calls ran at half the speed.
        let (ours, candle) = trl_runtime::kernels::skinny::generation_forward(&Device::Cpu, || {
            (
                time(&|| trl_runtime::kernels::skinny::matmul_t(&x, &w).unwrap()),
                time(&|| x.matmul(&w.t().unwrap()).unwrap()),
            )
        });
        println!(
            "{}",
            serde_json::json!({
                "bench": "skinny_matmul", "m": m, "k": k, "n": n,
                "weight_gb_per_s": (n * k * 4) as f64 / ours / 1e9,
                "over_candle_matmul": candle / ours,
            })
        );
    }
}

/// `"device":"cuda"` lines: bf16 generation on the first GPU against transformers' on it.
#[cfg(feature = "cuda")]
fn cuda_lines() {
    const GPU_PROMPT: usize = 128;
    const GPU_NEW: usize = 128;
    let dev = Device::new_cuda(0).unwrap();
    // Copy bandwidth: 1 GiB read and 1 GiB written per copy, the median of 5.
    let big = Tensor::zeros(1usize << 29, DType::BF16, &dev).unwrap();
    let copy = || {
        dev.synchronize().unwrap();
        let t = Instant::now();
        let c = big.copy().unwrap();
        dev.synchronize().unwrap();
        drop(c);
        t.elapsed().as_secs_f64()
    };
    copy();
    let candle_copy = 2.0 * (1usize << 30) as f64 / median((0..5).map(|_| copy()).collect());
    drop(big);
    let qwen: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(support::repo().join("assets/configs/qwen2-0.5b.json")).unwrap(),
    )
    .unwrap();
    for (name, config) in [("qwen2-0.5b", qwen), ("smollm2-135m-like", smollm2_like())] {
        let tmp = tempfile::tempdir().unwrap();
        let params = support::write_model_and_rows(tmp.path(), config.clone(), 0, 0);
        let cfg = ModelConfig::from_json(&config.to_string(), name).unwrap();
        let model =
            AutoModelForCausalLM::from_pretrained(tmp.path().join("model"), DType::BF16, &dev)
                .unwrap();
        let batches = [1usize, 32];
        let peers = theirs_on(tmp.path(), &batches, GPU_PROMPT, GPU_NEW, "cuda");
        // The faster of Candle's copy and torch's: the GPU's bandwidth as this run sees it.
        let torch_copy = peers.as_ref().and_then(|v| v[0].2).unwrap_or(0.0);
        let bandwidth = candle_copy.max(torch_copy);
        eprintln!(
            "GPU copy bandwidth {:.0} GB/s (Candle {:.0}, torch {:.0})",
            bandwidth / 1e9,
            candle_copy / 1e9,
            torch_copy / 1e9
        );
        // Eager steps, then the steps as a CUDA graph (TRL_CUDA_GRAPHS=1's), each a line.
        for (i, &batch) in batches.iter().enumerate() {
            let mut eager = None;
            for graph in [false, true] {
                let run = |new| ours_at(&model, cfg.vocab_size, batch, (GPU_PROMPT, new), graph);
                let (prefill, total) = (run(1), run(GPU_NEW + 1));
                let decode = (batch * GPU_NEW) as f64 / (total - prefill);
                let bytes = step_bytes(&config, params, batch, (GPU_PROMPT, GPU_NEW), DType::BF16);
                let mut line = serde_json::json!({
                    "bench": "generate", "device": "cuda", "dtype": "bf16", "shape": name,
                    "batch": batch, "prompt": GPU_PROMPT, "new": GPU_NEW,
                    "steps": if graph { "cuda_graph" } else { "eager" },
                    "decode_tokens_per_s": decode,
                    "ms_per_step": 1e3 * (total - prefill) / GPU_NEW as f64,
                    "bandwidth_fraction": bytes * (decode / batch as f64) / bandwidth,
                });
                if let Some(e) = eager {
                    line["graph_over_eager"] = serde_json::json!(decode / e);
                }
                eager = Some(decode);
                if let Some((p, t, _)) = peers.as_ref().map(|v| v[i]) {
                    with_peer(&mut line, (batch * GPU_NEW, decode, prefill), (p, t));
                }
                println!("{line}");
            }
        }
    }
}

fn main() {
    // TRL_BENCH_ONLY=cuda: the GPU lines alone (GPU sessions are short).
    if std::env::var("TRL_BENCH_ONLY").is_ok_and(|v| v == "cuda") {
        #[cfg(feature = "cuda")]
        cuda_lines();
        #[cfg(not(feature = "cuda"))]
        eprintln!("TRL_BENCH_ONLY=cuda: this bench was built without the cuda feature");
        return;
    }
    let arg = |flag: &str| std::env::args().skip_while(|a| a != flag).nth(1);
    let only = arg("--only");
    if only.is_none() {
        skinny_lines();
    }
    let bandwidth = bandwidth();
    let matmul = matmul_rate();
    let streamed8 = streamed_with_eight_fmas();
    eprintln!(
        "memory bandwidth {:.1} GB/s ({} with 8 multiply-adds per line), f32 matmul {:.1} GFLOP/s, {} threads",
        bandwidth / 1e9,
        streamed8.map_or("not measured".into(), |b| format!("{:.1} GB/s", b / 1e9)),
        matmul / 1e9,
        rayon::current_num_threads()
    );
    let qwen: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(support::repo().join("assets/configs/qwen2-0.5b.json")).unwrap(),
    )
    .unwrap();
    // `--batch N`: one batch size (to profile one case).
    let batches: Vec<usize> = match arg("--batch").map(|b| b.parse()) {
        Some(Ok(b)) => vec![b],
        _ => vec![1, 8],
    };
    let shapes = ["smollm2-135m-like", "qwen2-0.5b", "qwen3.5-hybrid-like"];
    if let Some(o) = only.as_deref().filter(|o| !shapes.contains(o)) {
        eprintln!("--only {o}: no such shape; one of {}", shapes.join(", "));
        std::process::exit(2);
    }
    for (name, config) in [
        ("smollm2-135m-like", smollm2_like()),
        ("qwen2-0.5b", qwen),
        (
            "qwen3.5-hybrid-like",
            support::qwen3_5_hybrid(12, 1024, 3072, 32000, 128),
        ),
    ] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let tmp = tempfile::tempdir().unwrap();
        let params = support::write_model_and_rows(tmp.path(), config.clone(), 0, 0);
        let cfg = ModelConfig::from_json(&config.to_string(), name).unwrap();
        let model = AutoModelForCausalLM::from_pretrained(
            tmp.path().join("model"),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let peers = theirs(tmp.path(), &batches);
        for (i, &batch) in batches.iter().enumerate() {
            let prefill = ours(&model, cfg.vocab_size, batch, 1);
            let total = ours(&model, cfg.vocab_size, batch, NEW + 1);
            let decode = (batch * NEW) as f64 / (total - prefill);
            let bytes = step_bytes(&config, params, batch, (PROMPT, NEW), DType::F32);
            let prefill_flops = 2.0 * params as f64 * (batch * PROMPT) as f64 / prefill;
            // The most a decode can reach here: each step's bytes read at the measured
            // bandwidth (a step reads every weight once and the rows' caches).
            let ceiling = batch as f64 * bandwidth / bytes;
            let mut line = serde_json::json!({
                "bench": "generate", "shape": name, "batch": batch, "prompt": PROMPT,
                "new": NEW, "decode_tokens_per_s": decode,
                "bandwidth_fraction": bytes * (decode / batch as f64) / bandwidth,
                "bandwidth_ceiling_tokens_per_s": ceiling,
                "prefill_over_matmul_rate": prefill_flops / matmul,
            });
            // At 8 rows: the step's bytes at the rate this machine streams them while doing
            // the least multiply-adds 8 rows need (`streamed_with_eight_fmas`), a ceiling for any
            // f32 kernel.
            let ceiling8 = streamed8
                .filter(|_| batch == 8)
                .map(|b| batch as f64 * b / bytes);
            if let Some(c) = ceiling8 {
                line["fma_stream_ceiling_tokens_per_s"] = c.into();
                line["of_fma_stream_ceiling"] = (decode / c).into();
            }
            if let Some(theirs) = peers.as_ref().map(|v| v[i]) {
                with_peer(&mut line, (batch * NEW, decode, prefill), theirs);
                // How far over transformers this machine's bandwidth lets any decode go.
                let theirs = line["transformers_decode_tokens_per_s"]
                    .as_f64()
                    .unwrap_or(0.0);
                line["ceiling_over_transformers"] = (ceiling / theirs).into();
                if let Some(c) = ceiling8 {
                    line["fma_stream_ceiling_over_transformers"] = (c / theirs).into();
                }
            }
            println!("{line}");
        }
    }
}
