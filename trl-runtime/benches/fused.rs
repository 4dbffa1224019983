//! `cargo bench -p trl-runtime --bench fused`: the fused CPU ops (kernels::fused) against the same
//! math in Candle ops and against torch's own ops (benches/torch_ops.py, run in the same bench
//! when `python3` (or $PYTHON) imports torch), forward + backward at the reference training
//! shape (4 x 512 tokens, hidden 256, intermediate 768, fp32) on one thread. One JSON object
//! per line on stdout: milliseconds and the ratios `speedup_vs_candle_ops` and `vs_torch`
//! (torch's time / ours: above 1 is faster than torch). The output's gradient is all ones in
//! both, so only the op and its backward are timed. The LM head's loss (the reference shape's
//! vocabulary of 4096) against the logits and Candle's cross-entropy, for the SFT sum and DPO's
//! per-token losses, and with a frozen head (LoRA) against a trained one
//! (`speedup_vs_trained_head`: what skipping the head's gradient saves). A projection chained
//! with the ops around it (`nn::chain`) against those ops recorded one by one.

use candle_core::{Device, Result, Tensor, Var};
use std::time::Instant;
use trl_runtime::kernels::fused;

const TOKENS: usize = 4 * 512;
const HIDDEN: usize = 256;
const INTERMEDIATE: usize = 768;
const REPS: usize = 20;

/// Milliseconds of forward + backward of `f` on `a` and `b` (as variables), the output's
/// gradient all ones (torch_ops.py does the same), mean of REPS.
fn timed(f: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>, a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (Var::from_tensor(a).unwrap(), Var::from_tensor(b).unwrap());
    let once = || {
        let y = f(a.as_tensor(), b.as_tensor()).unwrap();
        std::hint::black_box(y.backward().unwrap());
    };
    for _ in 0..3 {
        once();
    }
    let start = Instant::now();
    for _ in 0..REPS {
        once();
    }
    start.elapsed().as_secs_f64() * 1e3 / REPS as f64
}

/// Torch's times per op, if a python with torch is there.
fn torch_ms() -> std::collections::HashMap<String, f64> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/torch_ops.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&python)
        .arg(&script)
        .args(["--tokens", &TOKENS.to_string()])
        .args(["--hidden", &HIDDEN.to_string()])
        .args(["--intermediate", &INTERMEDIATE.to_string()])
        .args(["--threads", "1", "--reps", &REPS.to_string()])
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| Some((v["op"].as_str()?.to_string(), v["torch_ms"].as_f64()?)))
            .collect(),
        Ok(o) => {
            eprintln!(
                "no torch reference ({python} {}): {}",
                script.display(),
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            Default::default()
        }
        Err(e) => {
            eprintln!("no torch reference: cannot run {python}: {e}");
            Default::default()
        }
    }
}

fn report(op: &str, shape: &str, ours: f64, ops: f64, torch: Option<&f64>) {
    let mut line = serde_json::json!({
        "bench": "fused", "op": op, "device": "cpu", "dtype": "f32", "threads": 1,
        "shape": shape, "ms": ours, "candle_ops_ms": ops,
        "speedup_vs_candle_ops": ops / ours,
    });
    if let Some(t) = torch {
        line["torch_ms"] = (*t).into();
        line["vs_torch"] = (t / ours).into();
    }
    println!("{line}");
}

fn main() {
    // One thread, as the model bench and a 1-thread-per-rank CPU job.
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()
        .ok();
    // As in a training process (DistContext does it): freed buffers are reused, not unmapped.
    trl_runtime::alloc::keep_freed_memory();
    let dev = Device::Cpu;
    let torch = torch_ms();
    let x = Tensor::randn(0f32, 1.0, (TOKENS, HIDDEN), &dev).unwrap();
    let w = Tensor::randn(0f32, 1.0, HIDDEN, &dev).unwrap();
    let eps = 1e-6;
    let ours = timed(&|x, w| fused::rms_norm(x, w, eps), &x, &w);
    let ops = timed(&|x, w| fused::rms_norm_reference(x, w, eps), &x, &w);
    report(
        "rms_norm",
        &format!("{TOKENS}x{HIDDEN}"),
        ours,
        ops,
        torch.get("rms_norm"),
    );
    // Rotary on the queries: 8 heads of 32 (the reference shape), angles per position.
    let (heads, d, seq) = (8, HIDDEN / 8, 512);
    let q = Tensor::randn(0f32, 1.0, (TOKENS / seq, heads, seq, d), &dev).unwrap();
    let ang = Tensor::randn(0f32, 3.0, (TOKENS / seq, seq, d), &dev).unwrap();
    let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
    // (The second input is unused: the angles are constants, as in the model.)
    let ours = timed(&|q, _| fused::rotary(q, &cos, &sin), &q, &q);
    let ops = timed(
        &|q, _| trl_runtime::nn::rope::apply_rotary(q, &cos, &sin),
        &q,
        &q,
    );
    report(
        "rotary",
        &format!("{}x{heads}x{seq}x{d}", TOKENS / seq),
        ours,
        ops,
        torch.get("rotary"),
    );
    head_losses(&dev);
    chains(&dev, (&cos, &sin));
    let g = Tensor::randn(0f32, 1.0, (TOKENS, INTERMEDIATE), &dev).unwrap();
    let u = Tensor::randn(0f32, 1.0, (TOKENS, INTERMEDIATE), &dev).unwrap();
    let ours = timed(&fused::swiglu, &g, &u);
    let ops = timed(&|g, u| g.silu()? * u, &g, &u);
    report(
        "swiglu",
        &format!("{TOKENS}x{INTERMEDIATE}"),
        ours,
        ops,
        torch.get("swiglu"),
    );
}

/// The LM head and its loss at the reference shape (see the module docs).
fn head_losses(dev: &Device) {
    use trl_runtime::nn::loss::{cross_entropy_sum, cross_entropy_tokens};
    use trl_runtime::nn::tiled_loss::{tiled_linear_cross_entropy, tiled_token_nll};
    const VOCAB: usize = 4096;
    let x = Tensor::randn(0f32, 1.0, (TOKENS, HIDDEN), dev).unwrap();
    let w = Tensor::randn(0f32, 0.05, (VOCAB, HIDDEN), dev).unwrap();
    let targets: Vec<i64> = (0..TOKENS as i64)
        .map(|i| (i * 7919) % VOCAB as i64)
        .collect();
    let t = Tensor::new(targets.as_slice(), dev).unwrap();
    let shape = format!("{TOKENS}x{HIDDEN}, vocab {VOCAB}");
    let logits = |x: &Tensor, w: &Tensor| x.matmul(&w.t()?);
    let fused = timed(
        &|x, w| Ok(tiled_linear_cross_entropy(x, w, &t)?.sum),
        &x,
        &w,
    );
    let ops = timed(
        &|x, w| Ok(cross_entropy_sum(&logits(x, w)?, &t)?.sum),
        &x,
        &w,
    );
    report("linear_cross_entropy", &shape, fused, ops, None);
    let rows = timed(&|x, w| Ok(tiled_token_nll(x, w, &t)?.0), &x, &w);
    let ops = timed(
        &|x, w| Ok(cross_entropy_tokens(&logits(x, w)?, &t)?.0),
        &x,
        &w,
    );
    report("token_nll", &shape, rows, ops, None);
    let frozen = timed(
        &|x, w| Ok(tiled_linear_cross_entropy(x, &w.detach(), &t)?.sum),
        &x,
        &w,
    );
    let line = serde_json::json!({
        "bench": "fused", "op": "linear_cross_entropy_frozen_head", "device": "cpu",
        "dtype": "f32", "threads": 1, "shape": shape, "ms": frozen, "trained_head_ms": fused,
        "speedup_vs_trained_head": fused / frozen,
    });
    println!("{line}");
}

/// A projection with its head split, rotary and scale, and an output projection with the heads
/// merged and a residual added, each as one op (`nn::chain`) against the same ops recorded one
/// by one: forward + backward, x and W variables.
fn chains(dev: &Device, (cos, sin): (&Tensor, &Tensor)) {
    use trl_runtime::nn::chain::{Chain, SplitHeads};
    let (heads, d, seq) = (8, HIDDEN / 8, 512);
    let batch = TOKENS / seq;
    let split = Chain::split(SplitHeads {
        batch,
        seq,
        heads,
        head_dim: d,
        rotary: Some((cos.clone(), sin.clone())),
        scale: Some(0.5),
    });
    let x = Tensor::randn(0f32, 1.0, (batch, seq, HIDDEN), dev).unwrap();
    let w = Tensor::randn(0f32, 0.1, (HIDDEN, HIDDEN), dev).unwrap();
    let residual = Tensor::randn(0f32, 1.0, (batch, seq, HIDDEN), dev).unwrap();
    let merge = Chain::merge_and_add(true, Some(&residual));
    let a = Tensor::randn(0f32, 1.0, (batch, heads, seq, d), dev).unwrap();
    for (what, chain, input) in [
        ("linear_chain_split", &split, &x),
        ("linear_chain_merge_residual", &merge, &a),
    ] {
        let ours = timed(&|x, w| chain.linear(x, w, None), input, &w);
        let ops = timed(
            &|x, w| chain.around(x, |r| fused::linear(r, w, None)),
            input,
            &w,
        );
        report(what, &format!("{TOKENS}x{HIDDEN}"), ours, ops, None);
    }
}
