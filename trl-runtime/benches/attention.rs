//! `cargo bench -p trl-runtime --bench attention`: causal attention forward + backward, ours
//! against torch's `scaled_dot_product_attention` (benches/torch_attention.py) measured in the
//! same run, one JSON object per line on stdout (prose on stderr).
//!
//! - CPU (always): the fused CPU kernel (kernels::cpu_flash) against the whole-matrix path it
//!   replaced and against torch on one thread, f32, 8 query / 2 key-value heads, head dim 64,
//!   sequence 1024; and a sliding window of 256 keys against full causal attention at sequence
//!   4096 (a window's cost is O(seq x window): the full / windowed ratio approaches
//!   seq / (2 x window) = 8).
//! - GPU (built with `--features cuda`, run by scripts/gpu-run): the fused CUDA kernel
//!   (kernels::cuda_flash) in bf16 at the Qwen2-0.5B shape (14 query / 2 key-value heads, head dim
//!   64): batch 2 x 2048, and 1 x 8192 and 1 x 32768; ms per layer and achieved TFLOP/s
//!   (causal: half the score matrix; forward 4 b h s^2 d / 2 FLOPs, backward 2.5 times that).

use candle_core::{DType, Device, Tensor, Var};
use std::time::Instant;
use trl_runtime::nn::attention::whole_matrix_attention;
use trl_runtime::nn::AttentionMask;

/// Forward + backward milliseconds of `f` over fresh q, k, v (mean of `reps` after warm-up).
fn time_ms(
    dev: &Device,
    dtype: DType,
    (b, h, hk, s, d): (usize, usize, usize, usize, usize),
    (reps, window): (usize, Option<usize>),
    f: &dyn Fn(&Tensor, &Tensor, &Tensor, &AttentionMask) -> Tensor,
) -> f64 {
    let pos = Tensor::arange(0i64, s as i64, dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((b, 1))
        .unwrap();
    let mask = AttentionMask::windowed(
        &pos,
        window.map(trl_runtime::nn::Window::Sliding),
        dtype,
        dev,
    )
    .unwrap();
    let make = |heads: usize| {
        Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (b, heads, s, d), dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap()
    };
    let (q, k, v) = (make(h), make(hk), make(hk));
    let g = Tensor::randn(0f32, 1.0, (b, h, s, d), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let once = || {
        let y = f(&q, &k, &v, &mask);
        let grads = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        // Reading a value back waits for the device.
        let dq = grads.get(&q).unwrap();
        dq.flatten_all()
            .unwrap()
            .get(0)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
    };
    for _ in 0..2 {
        once();
    }
    let start = Instant::now();
    for _ in 0..reps {
        once();
    }
    start.elapsed().as_secs_f64() / reps as f64 * 1e3
}

/// torch's milliseconds per shape (`b,h,hk,s,d`), or nothing when torch is missing.
fn torch_ms(device: &str, dtype: &str, shapes: &[String]) -> Vec<Option<f64>> {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/torch_attention.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let mut c = std::process::Command::new(&python);
    c.arg(&script)
        .args(["--device", device, "--dtype", dtype, "--threads", "1"]);
    for s in shapes {
        c.arg("--shape").arg(s);
    }
    let out = match c.output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        Ok(o) => {
            eprintln!(
                "no torch peer: {}",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            String::new()
        }
        Err(e) => {
            eprintln!("no torch peer: cannot run {python}: {e}");
            String::new()
        }
    };
    let lines: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    shapes
        .iter()
        .map(|s| {
            lines
                .iter()
                .find(|l| l["shape"] == s.as_str())
                .and_then(|l| l["ms"].as_f64())
        })
        .collect()
}

fn shape_arg((b, h, hk, s, d): (usize, usize, usize, usize, usize)) -> String {
    format!("{b},{h},{hk},{s},{d}")
}

fn main() {
    // One compute thread on CPU, for ours and torch alike.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    trl_runtime::dist::compute_on_this_thread();
    #[cfg(feature = "cuda")]
    gpu();
    if std::env::var("TRL_BENCH_ONLY").is_ok_and(|v| v == "cuda") {
        return;
    }
    let cpu = Device::Cpu;
    let shape = (1, 8, 2, 1024, 64);
    let fused = time_ms(&cpu, DType::F32, shape, (3, None), &|q, k, v, m| {
        trl_runtime::nn::attention(q, k, v, m).unwrap()
    });
    let whole = time_ms(&cpu, DType::F32, shape, (3, None), &|q, k, v, m| {
        whole_matrix_attention(q, k, v, m).unwrap()
    });
    let torch = torch_ms("cpu", "fp32", &[shape_arg(shape)])[0];
    println!(
        "{{\"bench\":\"attention\",\"device\":\"cpu\",\"shape\":\"{}\",\"ms\":{fused:.2},\"whole_matrix_ms\":{whole:.2},\"ratio_whole_over_fused\":{:.3},\"torch_sdpa_ms\":{},\"ratio_torch_over_ours\":{}}}",
        shape_arg(shape),
        whole / fused,
        torch.map_or("null".into(), |t| format!("{t:.2}")),
        torch.map_or("null".into(), |t| format!("{:.3}", t / fused)),
    );
    // A sliding window: only the keys in each query's window are computed.
    let (long, window) = ((1, 8, 2, 4096, 64), 256);
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor, m: &AttentionMask| {
        trl_runtime::nn::attention(q, k, v, m).unwrap()
    };
    let full = time_ms(&cpu, DType::F32, long, (2, None), &attend);
    let windowed = time_ms(&cpu, DType::F32, long, (2, Some(window)), &attend);
    println!(
        "{{\"bench\":\"attention\",\"device\":\"cpu\",\"what\":\"sliding_window\",\"shape\":\"{}\",\"window\":{window},\"ms\":{windowed:.2},\"full_causal_ms\":{full:.2},\"ratio_full_over_windowed\":{:.3}}}",
        shape_arg(long),
        full / windowed,
    );
}

#[cfg(feature = "cuda")]
fn gpu() {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no GPU: the CUDA lines are skipped");
        return;
    };
    let shapes = [
        (2, 14, 2, 2048, 64),
        (1, 14, 2, 8192, 64),
        (1, 14, 2, 32768, 64),
    ];
    // The kernels the switches (TRL_FLASH_*) select on this GPU, as the library decides.
    let Device::Cuda(cuda) = &dev else {
        return;
    };
    let kernel = trl_runtime::kernels::cuda_flash::kernels_in_use(cuda, 64);
    let args: Vec<String> = shapes.iter().map(|s| shape_arg(*s)).collect();
    let torch = torch_ms("cuda", "bf16", &args);
    for (shape, theirs) in shapes.iter().zip(torch) {
        let reps = if shape.3 > 8192 { 3 } else { 10 };
        let ours = time_ms(&dev, DType::BF16, *shape, (reps, None), &|q, k, v, m| {
            trl_runtime::nn::attention(q, k, v, m).unwrap()
        });
        let (b, h, _, s, d) = *shape;
        let flops = 3.5 * 4.0 * (b * h * s * s * d) as f64 / 2.0;
        println!(
            "{{\"bench\":\"attention\",\"device\":\"cuda\",\"dtype\":\"bf16\",\"kernel\":\"{kernel}\",\"shape\":\"{}\",\"ms\":{ours:.3},\"tflops\":{:.1},\"torch_sdpa_ms\":{},\"ratio_ours_over_torch\":{}}}",
            shape_arg(*shape),
            flops / (ours * 1e-3) / 1e12,
            theirs.map_or("null".into(), |t| format!("{t:.3}")),
            theirs.map_or("null".into(), |t| format!("{:.3}", ours / t)),
        );
        // Soft-capped scores (Gemma 2's cap of 50): the `_cap_` kernels, against the uncapped
        // ones of this run (torch's SDPA cannot soft-cap).
        let capped = time_ms(&dev, DType::BF16, *shape, (reps, None), &|q, k, v, m| {
            use trl_runtime::nn::WithScoreMods;
            trl_runtime::nn::attention(q, k, v, &m.clone().with_softcap(Some(50.0))).unwrap()
        });
        println!(
            "{{\"bench\":\"attention\",\"device\":\"cuda\",\"dtype\":\"bf16\",\"kernel\":\"{kernel}-softcap\",\"shape\":\"{}\",\"ms\":{capped:.3},\"uncapped_ms\":{ours:.3},\"ratio_capped_over_uncapped\":{:.3}}}",
            shape_arg(*shape),
            capped / ours,
        );
    }
}
