//! scripts/compare-runs, which `scripts/gpu-run multi` trusts to say whether a multi-GPU run
//! equals one process: equal runs pass, and a run differing in one loss, one weight or a
//! missing tensor fails, naming it. Runs here because the script needs only python3.

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// A run directory as the trainer writes it: metrics.jsonl with `losses` and
/// checkpoint-2/model.safetensors with `weights` (bf16 and f32 tensors, as runs save).
fn write_run(dir: &Path, losses: &[f64], weights: &[(&'static str, Vec<f32>)]) {
    let lines: Vec<String> = losses
        .iter()
        .enumerate()
        .map(|(i, l)| format!("{{\"step\":{},\"loss\":{l}}}", i + 1))
        .collect();
    std::fs::create_dir_all(dir.join("checkpoint-2")).unwrap();
    std::fs::write(dir.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    let tensors: HashMap<String, Tensor> = weights
        .iter()
        .map(|(name, v)| {
            let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
            let t = match name.ends_with("bias") {
                true => t.to_dtype(DType::BF16).unwrap(),
                false => t,
            };
            (name.to_string(), t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("checkpoint-2/model.safetensors")).unwrap();
}

type Weights = Vec<(&'static str, Vec<f32>)>;

fn compare(reference: &Path, run: &Path) -> (bool, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/compare-runs");
    let o = Command::new("python3")
        .arg(script)
        .args([
            "--steps",
            "2",
            "--loss-rtol",
            "1e-4",
            "--weight-rtol",
            "1e-3",
        ])
        .args([reference, run])
        .output()
        .expect("python3 runs scripts/compare-runs");
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    (o.status.success(), text)
}

#[test]
fn compare_runs_passes_equal_runs_and_names_what_differs() {
    let tmp = tempfile::tempdir().unwrap();
    let weights = |w: f32, b: f32| vec![("w", vec![1.0, -2.0, w]), ("l.bias", vec![0.5, b])];
    let one = tmp.path().join("one");
    write_run(&one, &[2.0, 1.5], &weights(3.0, 0.25));

    let same = tmp.path().join("same");
    write_run(
        &same,
        &[2.0, 1.5 * (1.0 + 5e-5)],
        &weights(3.0 + 1e-3, 0.25),
    );
    let (ok, text) = compare(&one, &same);
    assert!(ok, "within both tolerances:\n{text}");

    let cases: [(&str, &[f64], Weights, &str); 4] = [
        ("loss", &[2.0, 1.6], weights(3.0, 0.25), "step 2: loss"),
        (
            "weight",
            &[2.0, 1.5],
            weights(3.1, 0.25),
            "w: max difference",
        ),
        (
            "bf16",
            &[2.0, 1.5],
            weights(3.0, 0.375),
            "l.bias: max difference",
        ),
        (
            "missing",
            &[2.0, 1.5],
            vec![("w", vec![1.0, -2.0, 3.0])],
            "l.bias: missing",
        ),
    ];
    for (name, losses, w, said) in cases {
        let run = tmp.path().join(name);
        write_run(&run, losses, &w);
        let (ok, text) = compare(&one, &run);
        assert!(
            !ok && text.contains(said),
            "{name}: expected '{said}':\n{text}"
        );
    }
    let short = tmp.path().join("short");
    write_run(&short, &[2.0], &weights(3.0, 0.25));
    let (ok, text) = compare(&one, &short);
    assert!(!ok && text.contains("1 losses logged"), "{text}");
}
