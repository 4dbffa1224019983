//! What the model tests share: reading a run's losses and final weights, and comparing a
//! launched run with one process.

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// Every CPU profile (and tensor parallelism alone, and FSDP with efficient loading and
/// activation checkpointing): (name, launch flags, whether 2 data-parallel ranks see
/// different rows; else the 2 ranks share each row).
#[allow(dead_code)]
pub const CPU_CASES: &[(&str, &[&str], bool)] = &[
    ("multi_cpu", &["--profile", "multi_cpu"], true),
    ("zero2_cpu", &["--profile", "zero2_cpu"], true),
    ("zero3_cpu", &["--profile", "zero3_cpu"], true),
    ("fsdp2_cpu", &["--profile", "fsdp2_cpu"], true),
    (
        // ZeRO-3 units read straight from the files, layers recomputed in backward.
        "fsdp2_cpu_efficient_loading",
        &[
            "--profile",
            "fsdp2_cpu",
            "--fsdp_cpu_ram_efficient_loading",
            "true",
            "--fsdp_activation_checkpointing",
            "true",
        ],
        true,
    ),
    ("fsdp2_tp_cpu", &["--profile", "fsdp2_tp_cpu"], true),
    (
        "tp_cpu",
        &[
            "--profile",
            "multi_cpu",
            "--parallelism_config_tp_size",
            "2",
        ],
        false,
    ),
    (
        "context_parallel_cpu",
        &["--profile", "context_parallel_cpu"],
        false,
    ),
    ("alst_ulysses_cpu", &["--profile", "alst_ulysses_cpu"], true),
];

#[allow(dead_code)]
pub const LOSS_TOLERANCE: f64 = 1e-5;
#[allow(dead_code)]
pub const WEIGHT_TOLERANCE: f32 = 2e-5;

/// A finished run: every step's loss (metrics.jsonl) and the weights of its checkpoint after
/// `steps` steps, with the optimizer state saved beside them (master weights and moments).
pub struct Run {
    pub losses: Vec<f64>,
    pub weights: HashMap<String, Tensor>,
    pub optimizer: HashMap<String, Tensor>,
}

impl Run {
    #[allow(dead_code)]
    pub fn read(out: &Path, steps: usize) -> Run {
        let mut run = Run::read_losses(out);
        let dir = out.join(format!("checkpoint-{steps}"));
        let load = |f: &str| candle_core::safetensors::load(dir.join(f), &Device::Cpu).unwrap();
        run.weights = load("model.safetensors");
        run.optimizer = load("optimizer.safetensors");
        run
    }
}

impl Run {
    /// A LoRA run: its losses and the adapters of its checkpoint (peft's names).
    #[allow(dead_code)]
    pub fn read_adapter(out: &Path, steps: usize) -> Run {
        let mut run = Run::read_losses(out);
        let file = out.join(format!("checkpoint-{steps}/adapter_model.safetensors"));
        run.weights = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
        run
    }

    fn read_losses(out: &Path) -> Run {
        let losses = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["loss"].as_f64())
            .collect();
        Run {
            losses,
            weights: HashMap::new(),
            optimizer: HashMap::new(),
        }
    }
}

pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Asserts that run `name` equals `want`: every step's loss within [`LOSS_TOLERANCE`], every
/// weight within [`WEIGHT_TOLERANCE`] as `diff` (param, got, want) measures it, and prints
/// the largest differences (those of parameters whose name contains one of `qk` apart).
#[allow(dead_code)]
pub fn assert_equal(
    name: &str,
    got: &Run,
    want: &Run,
    qk: &[&str],
    diff: impl Fn(&str, &Tensor, &Tensor) -> f32,
) {
    assert_equal_within(name, got, want, qk, WEIGHT_TOLERANCE, diff)
}

/// [`assert_equal`] with the weights' bound `weight_tolerance`.
#[allow(dead_code)]
pub fn assert_equal_within(
    name: &str,
    got: &Run,
    want: &Run,
    qk: &[&str],
    weight_tolerance: f32,
    diff: impl Fn(&str, &Tensor, &Tensor) -> f32,
) {
    assert_eq!(got.losses.len(), want.losses.len(), "{name}");
    let mut worst_loss = 0f64;
    for (step, (g, w)) in got.losses.iter().zip(&want.losses).enumerate() {
        worst_loss = worst_loss.max((g - w).abs());
        assert!(
            (g - w).abs() < LOSS_TOLERANCE,
            "{name}: step {} loss {g} vs one process {w}",
            step + 1
        );
    }
    assert_eq!(got.weights.len(), want.weights.len(), "{name}");
    let (mut worst, mut worst_qk) = (0f32, 0f32);
    for (param, w) in &want.weights {
        let d = diff(param, &got.weights[param], w);
        worst = worst.max(d);
        if qk.iter().any(|q| param.contains(q)) {
            worst_qk = worst_qk.max(d);
        }
        assert!(d < weight_tolerance, "{name}: {param} differs by {d}");
    }
    // A full checkpoint's optimizer state too (ZeRO and FSDP gather it from the shards).
    assert_eq!(got.optimizer.len(), want.optimizer.len(), "{name}");
    let mut worst_state = 0f32;
    for (key, w) in &want.optimizer {
        let g = got.optimizer.get(key);
        let g = g.unwrap_or_else(|| panic!("{name}: {key} missing from the optimizer state"));
        // Measured as the parameter itself is (`diff` knows which directions of a parameter
        // the model cannot see, e.g. a key norm's shift-invariant bias).
        let param = key.split("::").next().unwrap_or(key);
        let d = diff(param, g, w);
        worst_state = worst_state.max(d);
        assert!(
            d < weight_tolerance,
            "{name}: optimizer {key} differs by {d}"
        );
    }
    eprintln!(
        "{name}: losses within {worst_loss:.1e}, weights within {worst:.1e} (q/k norms \
         {worst_qk:.1e}), optimizer state within {worst_state:.1e}"
    );
}

/// `cargo trl launch LAUNCH_ARGS sft -- SFT_ARGS` from the workspace root, offline, tp
/// gradient checks at every step: add the run's flags and pass it to [`run_launch`].
#[allow(dead_code)]
pub fn sft_launch<S: AsRef<std::ffi::OsStr>>(launch_args: &[&str], sft_args: &[S]) -> Command {
    trainer_launch("sft", launch_args, sft_args)
}

/// How every test launch starts: the workers built in debug (trl-runtime is optimised there,
/// Cargo.toml's dev profile) so the suite builds no release copy of every dependency, on a
/// free port.
#[allow(dead_code)]
pub const LAUNCH: [&str; 4] = ["launch", "--debug", "--main_process_port", "0"];

/// The figure an examples binary prints before and after training, from its line
/// "held-out NAME: before B -> after A; ..." in `text` (a percentage sign dropped).
#[allow(dead_code)]
pub fn held_out_before_after(text: &str, name: &str) -> (f64, f64) {
    let line = text
        .lines()
        .find(|l| l.contains(&format!("held-out {name}")))
        .unwrap_or_else(|| panic!("no held-out {name}: {text}"));
    let number = |after: &str| -> f64 {
        let rest = &line[line.find(after).unwrap_or_else(|| panic!("{line}")) + after.len()..];
        let word = rest.split([' ', ';']).next().unwrap();
        word.trim_end_matches('%').parse().unwrap()
    };
    (number("before "), number("after "))
}

/// Examples binary `bin` built in debug (the README builds it with `cargo run --release`):
/// its path.
#[allow(dead_code)]
pub fn build_example(bin: &str) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let build = Command::new(env!("CARGO"))
        .current_dir(&root)
        .args(["build", "-q", "-p", "trl-examples", "--bin", bin])
        .status()
        .unwrap();
    assert!(build.success(), "cargo build --bin {bin}");
    root.join("target/debug").join(bin)
}

/// `cargo trl launch LAUNCH_ARGS BIN -- ARGS` for an examples binary (`sft`, `dpo`), on the
/// bundled job's settings (`--config assets/tiny/sft.yaml` or dpo.yaml: the programs read
/// them only while a command names no model and no dataset) under `args`.
#[allow(dead_code)]
pub fn trainer_launch<S: AsRef<std::ffi::OsStr>>(
    bin: &str,
    launch_args: &[&str],
    args: &[S],
) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cargo-trl"));
    cmd.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .env("CARGO_NET_OFFLINE", "true")
        .env("TRL_CHECK_TP_GRADS", "1")
        .args(LAUNCH)
        .args(launch_args)
        .args([bin, "--"])
        .args(bundled_job(bin))
        .args(args);
    cmd
}

/// Examples binary `bin` with `args` under `launch` (4 rows per rank), run 5 steps straight,
/// and 3 steps then resumed from its checkpoint to 5: the resumed steps 4 and 5 log `keys`
/// within 1e-5 relative (at a floor of `floor`) of the straight run's.
#[allow(dead_code)]
pub fn assert_resume_continues(
    bin: &str,
    launch: &[&str],
    args: &[&str],
    keys: &[&str],
    floor: f64,
) {
    let tmp = tempfile::tempdir().unwrap();
    let (straight, resumed) = (tmp.path().join("straight"), tmp.path().join("resumed"));
    let run = |steps: usize, out: &Path, extra: &[&str]| {
        let cmd = trainer_launch(bin, launch, &[args, extra].concat());
        run_launch(cmd, steps, 4, out)
    };
    run(5, &straight, &[]);
    run(3, &resumed, &[]);
    let text = run(5, &resumed, &["--resume_from_checkpoint", "latest"]);
    assert!(text.contains("checkpoint-3"), "{text}");
    let lines = |out: &Path| metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap());
    let (a, b) = (lines(&straight), lines(&resumed));
    // The resumed run's log holds steps 1-3, then 4 and 5 from the checkpoint: a run that
    // started over would log 5 more (whose last two equal the straight run's as well).
    let steps = |m: &[serde_json::Value]| -> Vec<u64> {
        m.iter().map(|l| l["step"].as_u64().unwrap()).collect()
    };
    assert_eq!(steps(&a), [1, 2, 3, 4, 5], "{text}");
    assert_eq!(steps(&b), [1, 2, 3, 4, 5], "{text}");
    for (x, y) in a[3..].iter().zip(&b[3..]) {
        for key in keys {
            let d = off(&y[key], &x[key], floor);
            assert!(d < 1e-5, "{bin} {key}: resumed {} vs {}", y[key], x[key]);
        }
    }
}

/// `--config` with the bundled job's settings for examples binary `bin`.
#[allow(dead_code)]
pub fn bundled_job(bin: &str) -> [&'static str; 2] {
    match bin {
        "dpo" => ["--config", "assets/tiny/dpo.yaml"],
        "grpo" => ["--config", "assets/tiny/grpo.yaml"],
        "rloo" => ["--config", "assets/tiny/rloo.yaml"],
        "kto" => ["--config", "assets/tiny/kto.yaml"],
        "reward" => ["--config", "assets/tiny/reward.yaml"],
        "distillation" => ["--config", "assets/tiny/distillation.yaml"],
        _ => ["--config", "assets/tiny/sft.yaml"],
    }
}

/// Runs a `cargo trl launch` command for `steps` fp32 steps (seed 7, no evaluation unless it
/// names `--eval_dataset_name`, a metrics line per step, the checkpoint at the end) of `per_device` rows per rank into `out`;
/// asserts it succeeded and returns its output.
#[allow(dead_code)]
pub fn run_launch(cmd: Command, steps: usize, per_device: usize, out: &Path) -> String {
    run_launch_logging(cmd, steps, per_device, 1, out)
}

/// [`run_launch`] with a metrics line every `logging` steps (their means).
#[allow(dead_code)]
pub fn run_launch_logging(
    mut cmd: Command,
    steps: usize,
    per_device: usize,
    logging: usize,
    out: &Path,
) -> String {
    // No evaluation unless the command names its own held-out data.
    if !cmd.get_args().any(|a| a == "--eval_dataset_name") {
        cmd.args(["--eval_dataset_name", "none"]);
    }
    let o = cmd
        .args(["--max_steps", &steps.to_string(), "--seed", "7"])
        .args(["--save_steps", "1000"])
        .args(["--logging_steps", &logging.to_string()])
        .args(["--per_device_train_batch_size", &per_device.to_string()])
        .arg("--output_dir")
        .arg(out)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{cmd:?}: {text}");
    text
}

/// Runs a trainer launch that writes into `out`, asserts it succeeded and returns its
/// metrics.jsonl.
#[allow(dead_code)]
pub fn metrics_of(mut cmd: Command, out: &Path) -> String {
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out.join("metrics.jsonl")).unwrap()
}

/// The worker report (the JSON line rank 0 logs before training) in a launch's output.
#[allow(dead_code)]
pub fn worker_report(text: &str) -> serde_json::Value {
    let line = text
        .lines()
        .find_map(|l| l.split_once("worker report: ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("no worker report in:\n{text}"));
    serde_json::from_str(line).unwrap()
}

/// Asserts every rank holds the model state `cargo trl plan`'s estimate predicts for it
/// (byte for byte), from a launch's worker report; returns the bytes per rank.
#[allow(dead_code)]
pub fn assert_model_state_predicted(what: &str, report: &serde_json::Value) -> Vec<u64> {
    let bytes: Vec<u64> = report["model_state_bytes"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: no model_state_bytes in {report}"))
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    let predicted = report["predicted_model_state_bytes"].as_u64();
    for (rank, &b) in bytes.iter().enumerate() {
        assert_eq!(
            Some(b),
            predicted,
            "{what}: rank {rank} holds {b} bytes of model state, the estimate says {predicted:?}"
        );
    }
    bytes
}

/// A Python with torch and transformers (TRL_PYTHON, else `python3`), to check our outputs
/// against transformers; None, with the reason printed, when there is none.
// Each test binary compiles this module; not all of them check against transformers.
#[allow(dead_code)]
pub fn transformers_python() -> Option<std::path::PathBuf> {
    python_with(&["torch", "transformers", "safetensors"])
}

#[path = "../../../trl-runtime/tests/common/python.rs"]
mod python;
#[allow(unused_imports)]
pub use python::python_with;

/// Two rows of 24 ids below `vocab` with their positions, and the `logits` that
/// scripts/`script` writes for them when run with `args`, then the ids' and the output's
/// files (`what` names the checkpoint in a failure).
fn python_logits(
    python: &Path,
    script: &str,
    args: &[&std::ffi::OsStr],
    vocab: u32,
    what: &str,
) -> (Tensor, Tensor, Tensor) {
    use trl_runtime::candle_core::DType;
    let ids: Vec<u32> = (0..48u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let ids = Tensor::from_vec(ids, (2, 24), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0i64, 24, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((2, 1))
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (ids_file, out_file) = (
        tmp.path().join("ids.safetensors"),
        tmp.path().join("out.safetensors"),
    );
    trl_runtime::candle_core::safetensors::save(
        &std::collections::HashMap::from([(
            "input_ids".to_string(),
            ids.to_dtype(DType::I64).unwrap(),
        )]),
        &ids_file,
    )
    .unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(script);
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .args([&ids_file, &out_file])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = trl_runtime::candle_core::safetensors::load(&out_file, &Device::Cpu).unwrap();
    (ids, pos, want["logits"].clone())
}

/// Checks that peft loads the adapter checkpoint `adapter` we saved onto `base`
/// (`PeftModel.from_pretrained`, scripts/peft_logits.py) and computes the logits we do with it
/// (within 1e-4, f32) on two rows; skipped with a message without peft.
#[allow(dead_code)]
pub fn loads_in_peft(base: &Path, adapter: &Path) {
    use trl_runtime::candle_core::DType;
    use trl_runtime::models::AutoModelForCausalLM;
    let Some(python) = python_with(&["torch", "transformers", "peft", "safetensors"]) else {
        return;
    };
    let mut model = AutoModelForCausalLM::from_pretrained(base, DType::F32, &Device::Cpu).unwrap();
    model.load_adapter(adapter).unwrap();
    let what = format!("peft cannot load {}", adapter.display());
    let args = ["logits".as_ref(), base.as_os_str(), adapter.as_os_str()];
    let (ids, pos, want) = python_logits(&python, "peft_logits.py", &args, 200, &what);
    let diff = max_diff(&model.forward(&ids, &pos).unwrap(), &want);
    eprintln!("{} in peft: logits within {diff:.1e}", adapter.display());
    assert!(
        diff < 1e-4,
        "peft's logits with {} differ by {diff}",
        adapter.display()
    );
}

/// The `cargo trl launch` lines of docs page `doc` (a path from the repository root).
#[allow(dead_code)]
pub fn docs_launches(doc: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(doc))
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("cargo trl launch"))
        .map(String::from)
        .collect()
}

/// Runs a docs command `line` as written, from the repository root, `cargo` finding this
/// `cargo-trl` first on PATH; asserts it succeeded. Its `--output_dir` (from the root), its
/// metrics lines and its output.
#[allow(dead_code)]
pub fn run_docs_command(line: &str) -> (std::path::PathBuf, Vec<serde_json::Value>, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = Path::new(env!("CARGO_BIN_EXE_cargo-trl"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap()
    );
    let out = Command::new("sh")
        .args(["-c", line])
        .current_dir(&root)
        .env("PATH", &path)
        .env("CARGO_NET_OFFLINE", "true")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{line}: {text}");
    let dir = root.join(line.split("--output_dir ").nth(1).unwrap().trim());
    let m = metrics(&std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap());
    (dir, m, text)
}

/// Checks that peft loads the SEQ_CLS adapter checkpoint `adapter` we saved onto the
/// classifier `base` (`PeftModelForSequenceClassification`, scripts/peft_logits.py) and
/// scores two rows as we do with it (each read at its last token that is not the pad), within
/// 1e-4; skipped with a message without peft.
#[allow(dead_code)]
pub fn classifier_adapter_loads_in_peft(base: &Path, adapter: &Path) {
    use trl_runtime::candle_core::{DType, IndexOp};
    use trl_runtime::train::RewardModel;
    let Some(python) = python_with(&["torch", "transformers", "peft", "safetensors"]) else {
        return;
    };
    let mut model = trl_runtime::parallel::Model::<RewardModel>::from_pretrained(
        base,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    model.load_adapter(adapter).unwrap();
    let what = format!("peft cannot load {}", adapter.display());
    let args = ["logits".as_ref(), base.as_os_str(), adapter.as_os_str()];
    let (ids, pos, want) = python_logits(&python, "peft_logits.py", &args, 200, &what);
    let scores = model.forward(&ids, &pos).unwrap();
    let pad = model.config.pad_token_id.unwrap();
    let rows: Vec<Vec<u32>> = ids.to_vec2().unwrap();
    let read: Vec<Tensor> = rows
        .iter()
        .enumerate()
        .map(|(r, row)| {
            let at = trl_runtime::models::sequence_classification::read_position(row, pad);
            scores.i((r, at)).unwrap()
        })
        .collect();
    let got = Tensor::stack(&read, 0).unwrap();
    let diff = max_diff(&got, &want);
    eprintln!("{} in peft: scores within {diff:.1e}", adapter.display());
    assert!(
        diff < 1e-4,
        "peft's scores with {} differ by {diff}",
        adapter.display()
    );
}

/// Checks that transformers opens the checkpoint `dir` we saved and computes the logits we
/// do (within 1e-4, f32) on two random rows; skipped with a message without transformers.
#[allow(dead_code)]
pub fn opens_in_transformers(dir: &Path) {
    use trl_runtime::candle_core::DType;
    use trl_runtime::models::AutoModelForCausalLM;
    let Some(python) = transformers_python() else {
        return;
    };
    let model = AutoModelForCausalLM::from_pretrained(dir, DType::F32, &Device::Cpu).unwrap();
    let vocab = {
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        // A vision-language model's sizes are its language model's (text_config).
        let text = config.get("text_config").unwrap_or(&config);
        text["vocab_size"].as_u64().unwrap() as u32
    };
    let what = format!("transformers cannot open {}", dir.display());
    let (ids, pos, want) = python_logits(
        &python,
        "transformers_logits.py",
        &[dir.as_os_str()],
        vocab,
        &what,
    );
    let got = model.forward(&ids, &pos).unwrap();
    let diff = max_diff(&got, &want);
    eprintln!(
        "{}: transformers opens it, max |logits - ours| = {diff:e}",
        dir.display()
    );
    assert!(
        diff < 1e-4,
        "{}: logits differ from transformers' by {diff}",
        dir.display()
    );
}

/// Checks that transformers opens the sequence classifier (a reward model) we saved in `dir`
/// by its `architectures` class and scores two rows as our
/// `AutoModelForSequenceClassification` does (within 1e-4); skipped without transformers.
#[allow(dead_code)]
pub fn classifier_opens_in_transformers(dir: &Path) {
    use trl_runtime::models::AutoModelForSequenceClassification;
    let Some(python) = transformers_python() else {
        return;
    };
    let model = AutoModelForSequenceClassification::from_pretrained(
        dir,
        trl_runtime::candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap() as u32;
    let what = format!("transformers cannot open {}", dir.display());
    let (ids, _, want) = python_logits(
        &python,
        "transformers_logits.py",
        &[dir.as_os_str()],
        vocab,
        &what,
    );
    let mask = ids.ones_like().unwrap();
    let got = model.forward(&ids, &mask).unwrap();
    let diff = max_diff(&got, &want);
    eprintln!(
        "{}: transformers opens it as {}, max |scores - ours| = {diff:e}",
        dir.display(),
        config["architectures"][0]
    );
    assert!(
        diff < 1e-4,
        "{}: scores differ from transformers' by {diff}",
        dir.display()
    );
}

/// The lines of a metrics text (ours or a TRL script's output) that log a training loss
/// (and, last, the evaluation).
#[allow(dead_code)]
pub fn metrics(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .collect()
}

/// How far `got` is from `want`, relative (at a floor of `floor`).
#[allow(dead_code)]
pub fn off(got: &serde_json::Value, want: &serde_json::Value, floor: f64) -> f64 {
    let (g, w) = (got.as_f64().unwrap_or(f64::NAN), want.as_f64().unwrap());
    (g - w).abs() / w.abs().max(floor)
}

/// The bundled model `assets/NAME/model`.
#[allow(dead_code)]
pub fn model_dir(name: &str) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    root.join("assets").join(name).join("model")
}

/// A TRL parity script (scripts/trl_sft.py, trl_dpo.py) and the Python that runs it.
#[allow(dead_code)]
pub struct TrlScript {
    python: std::path::PathBuf,
    script: std::path::PathBuf,
}

/// `script` with a Python that has TRL; None, with a message, without one.
#[allow(dead_code)]
pub fn trl_script(script: &str) -> Option<TrlScript> {
    let python = python_with(&["torch", "transformers", "trl", "datasets"])?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    Some(TrlScript {
        python,
        script: root.join("scripts").join(script),
    })
}

impl TrlScript {
    /// The script on the bundled model `assets/MODEL/model`, `rows` and output directory
    /// `out` (its other arguments to add), in `processes` processes (torchrun's, over gloo,
    /// for more than one).
    #[allow(dead_code)]
    pub fn command(&self, model: &str, rows: &Path, out: &Path, processes: usize) -> Command {
        let mut cmd = Command::new(&self.python);
        if processes > 1 {
            let n = processes.to_string();
            cmd.args(["-m", "torch.distributed.run", "--standalone"])
                .args(["--nproc_per_node", &n]);
        }
        cmd.arg(&self.script)
            .arg(model_dir(model))
            .arg(rows)
            .arg(out);
        cmd
    }

    /// The script on the model in directory `model`, in `processes` processes.
    #[allow(dead_code)]
    pub fn command_with(&self, model: &Path, rows: &Path, out: &Path, processes: usize) -> Command {
        let mut cmd = Command::new(&self.python);
        if processes > 1 {
            let n = processes.to_string();
            cmd.args(["-m", "torch.distributed.run", "--standalone"])
                .args(["--nproc_per_node", &n]);
        }
        cmd.arg(&self.script).arg(model).arg(rows).arg(out);
        cmd
    }
}

/// Runs a TRL script that logs `steps` steps: its lines, and its evaluation when it printed
/// one.
#[allow(dead_code)]
pub fn trl_steps(
    cmd: &mut Command,
    steps: usize,
) -> (Vec<serde_json::Value>, Option<serde_json::Value>) {
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let lines = metrics(&stdout);
    assert_eq!(lines.len(), steps, "{stdout}");
    let eval = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("eval").cloned());
    (lines, eval)
}

/// Runs a TRL script: its logged steps, its evaluation and its output.
#[allow(dead_code)]
pub fn run_trl(cmd: &mut Command) -> (Vec<serde_json::Value>, serde_json::Value, String) {
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    let eval = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("eval").cloned())
        .expect("TRL's evaluation");
    (metrics(&stdout), eval, stdout)
}

/// Settings both runs of a comparison take: as a TRL script's `KEY=VALUE` overrides and as
/// our `--KEY VALUE` flags.
#[allow(dead_code)]
pub fn both_ways(settings: &[(&str, &str)]) -> (Vec<String>, Vec<String>) {
    let overrides = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let flags = settings
        .iter()
        .flat_map(|(k, v)| [format!("--{k}"), v.to_string()])
        .collect();
    (overrides, flags)
}

/// The first `n` rows of the repository's `data` file (JSON lines), written to `dir`.
#[allow(dead_code)]
pub fn first_rows(data: &str, dir: &Path, n: usize) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let all = std::fs::read_to_string(root.join(data)).unwrap();
    let rows = dir.join("rows.jsonl");
    std::fs::write(&rows, all.lines().take(n).collect::<Vec<_>>().join("\n")).unwrap();
    rows
}

/// Runs `cmd` with `stdin` as its input; its output (stdout and stderr captured).
#[allow(dead_code)]
pub fn output_with_stdin(cmd: &mut Command, stdin: &str) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A command that exits without reading its input closes the pipe: not an error here.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    child.wait_with_output().unwrap()
}

/// Every figure of `got` within `tolerance` relative (at a floor of `floor`) of `want`'s,
/// step by step, but the run's own measures (speed, memory, epoch); the worst, and its key.
#[allow(dead_code)]
pub fn assert_same_figures(
    name: &str,
    got: &[serde_json::Value],
    want: &[serde_json::Value],
    (tolerance, floor): (f64, f64),
) -> (f64, String) {
    let own = [
        "step_time",
        "tokens_per_s",
        "peak_memory_mib",
        "predicted_peak_memory_mib",
        "epoch",
    ];
    let mut worst = (0f64, String::new());
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        for (key, wv) in w.as_object().unwrap() {
            if own.contains(&key.as_str()) {
                continue;
            }
            let d = off(&g[key], wv, floor);
            assert!(
                d < tolerance,
                "{name} step {}: {key} {} vs {wv}",
                step + 1,
                g[key]
            );
            if d >= worst.0 {
                worst = (d, key.clone());
            }
        }
    }
    worst
}
