//! SFT's logged figures through the real `cargo trl launch` and the `sft` example: TRL 1.16's
//! `entropy` and `mean_token_accuracy` (training and evaluation) beside the loss, gradient
//! norm and token count, with the nll and the DFT loss, equal to TRL's SFTTrainer on the same
//! model and rows (when TRL is installed), and under every way of splitting the work as in
//! one process.

mod common;

use common::{metrics, off, run_trl};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The first 8 chat rows of the bundled data, in `dir`.
fn eight_rows(dir: &Path) -> PathBuf {
    common::first_rows("assets/tiny/data/train.jsonl", dir, 8)
}

/// TRL's SFT script (None: the test skips), a temporary directory and 8 chat rows in it.
fn trl_and_eight_rows() -> Option<(common::TrlScript, tempfile::TempDir, PathBuf)> {
    let trl = common::trl_script("trl_sft.py")?;
    let tmp = tempfile::tempdir().unwrap();
    let rows = eight_rows(tmp.path());
    Some((trl, tmp, rows))
}

/// Three steps on the 8 rows (`per_device` rows per data-parallel rank of the launch `args`,
/// fp32, AdamW at a constant 1e-3), evaluated on the same rows in batches of 4 after the
/// last; its metrics lines.
fn ours(
    rows: &Path,
    (launch, per_device): (&[&str], usize),
    (assistant_only, loss_type): (bool, &str),
    out: &Path,
) -> Vec<serde_json::Value> {
    let per_device = per_device.to_string();
    let cmd = common::trainer_launch(
        "sft",
        launch,
        &[
            &["--dataset_name", rows.to_str().unwrap()][..],
            &["--eval_dataset_name", rows.to_str().unwrap()],
            &["--model_name_or_path"],
            &[root().join("assets/tiny/model").to_str().unwrap()],
            &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
            &[
                "--weight_decay",
                "0",
                "--max_length",
                "64",
                "--packing",
                "false",
            ],
            &["--gradient_checkpointing", "false"],
            &[
                "--assistant_only_loss",
                if assistant_only { "true" } else { "false" },
            ],
            &["--max_steps", "3", "--seed", "7", "--logging_steps", "1"],
            &["--loss_type", loss_type],
            &["--per_device_train_batch_size", &per_device],
            &["--per_device_eval_batch_size", "4"],
            &["--eval_strategy", "steps", "--eval_steps", "3"],
            &[
                "--save_steps",
                "1000",
                "--output_dir",
                out.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    metrics(&common::metrics_of(cmd, out))
}

const KEYS: &[&str] = &[
    "loss",
    "grad_norm",
    "num_tokens",
    "entropy",
    "mean_token_accuracy",
];
const EVAL_KEYS: &[&str] = &["eval_loss", "eval_entropy", "eval_mean_token_accuracy"];

/// Whether `got` is `want` within `tol` relative (at a floor of 1e-3).
fn close(got: &serde_json::Value, want: &serde_json::Value, tol: f64) -> bool {
    off(got, want, 1e-3) < tol
}

const ONE: (&[&str], usize) = (&["--num_processes", "1"], 8);

/// Two data-parallel ranks of 4 rows, tensor parallelism (the vocabulary split: its
/// collectives give the figures), and sequences split by ring attention and by Ulysses log
/// what one process of 8 rows does: each step's entropy and accuracy are its targets' over
/// every rank (as TRL gathers them), not one rank's or one chunk's.
#[test]
fn token_figures_under_every_split_equal_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = eight_rows(tmp.path());
    let layouts: [(&str, &[&str], usize); 4] = [
        ("ddp", &["--num_processes", "2"], 4),
        ("fsdp2_tp", &["--profile", "fsdp2_tp_cpu"], 4),
        ("ring", &["--profile", "context_parallel_cpu"], 8),
        ("ulysses", &["--profile", "alst_ulysses_cpu"], 4),
    ];
    // DFT runs per position (the path DPO takes): under tp and a split sequence too.
    for (loss, which) in [
        ("nll", &["ddp", "fsdp2_tp", "ring", "ulysses"][..]),
        ("dft", &["fsdp2_tp", "ulysses"]),
    ] {
        let one = ours(
            &rows,
            ONE,
            (true, loss),
            &tmp.path().join(format!("one-{loss}")),
        );
        for (name, launch, per_device) in layouts.iter().filter(|l| which.contains(&l.0)) {
            let out = tmp.path().join(format!("{name}-{loss}"));
            let split = ours(&rows, (launch, *per_device), (true, loss), &out);
            check_equal(&format!("{name} {loss}"), &split, &one);
        }
    }
}

/// `split`'s three steps and evaluation log `one`'s figures within 1e-5 relative.
fn check_equal(name: &str, split: &[serde_json::Value], one: &[serde_json::Value]) {
    assert_eq!((one.len(), split.len()), (3, 3), "{name}");
    for (step, (a, b)) in split.iter().zip(one).enumerate() {
        for key in KEYS {
            assert!(
                close(&a[key], &b[key], 1e-5),
                "{name} step {step} {key}: {a} vs {b}"
            );
        }
        // A real distribution over 512 tokens, and a share of hits: the tiny model's argmax
        // already hits some of the targets (1 in 26 at step 1, as TRL counts).
        let entropy = b["entropy"].as_f64().unwrap();
        let accuracy = b["mean_token_accuracy"].as_f64().unwrap();
        assert!(entropy > 1.0 && entropy < 512f64.ln(), "{b}");
        assert!(accuracy > 0.0 && accuracy <= 1.0, "{b}");
    }
    for key in EVAL_KEYS {
        assert!(close(&split[2][key], &one[2][key], 1e-5), "{name} {key}");
    }
}

/// Asserts every step's `keys` and the last step's evaluation figures (with `eval_aux_loss`
/// when `keys` hold `aux_loss`) are TRL's within 1e-4 relative; returns the largest
/// difference.
fn assert_like_trl(
    label: &str,
    (ours, theirs): (&[serde_json::Value], &[serde_json::Value]),
    their_eval: &serde_json::Value,
    keys: &[&str],
) -> f64 {
    let mut worst = 0f64;
    let our_eval = ours.last().expect("logged steps");
    let steps = ours.iter().zip(theirs).enumerate();
    let pairs = steps.flat_map(|(step, (a, b))| {
        keys.iter()
            .map(move |k| (format!("step {} {k}", step + 1), &a[*k], &b[*k]))
    });
    // A mixture of experts' router loss is logged in evaluation too.
    let aux = keys.contains(&"aux_loss").then_some("eval_aux_loss");
    let evals = EVAL_KEYS
        .iter()
        .chain(&aux)
        .map(|k| (k.to_string(), &our_eval[*k], &their_eval[*k]));
    for (what, a, b) in pairs.chain(evals) {
        worst = worst.max(off(a, b, 1e-3));
        assert!(close(a, b, 1e-4), "{label}, {what}: {a} vs TRL's {b}");
    }
    worst
}

/// Three steps and an evaluation on 8 chat rows: the loss, gradient norm, tokens, entropy
/// and mean token accuracy of every step, and the evaluation's loss, entropy and accuracy,
/// equal TRL's SFTTrainer's within 1e-4 relative, on the assistant's tokens and on all, and
/// with TRL's DFT loss (loss_type dft).
#[test]
fn sft_figures_match_trl() {
    let Some((trl, tmp, rows)) = trl_and_eight_rows() else {
        return;
    };
    for (assistant_only, loss_type) in [(true, "nll"), (false, "nll"), (true, "dft")] {
        let (theirs, their_eval, stdout) = run_trl(
            trl.command("tiny", &rows, &tmp.path().join("trl"), 1)
                .args(["3", "8", "1e-3", "eval_batch=4"])
                .arg(format!("assistant_only_loss={assistant_only}"))
                .arg(format!("loss_type={loss_type}")),
        );
        let out = tmp
            .path()
            .join(format!("ours-{assistant_only}-{loss_type}"));
        let ours = ours(&rows, ONE, (assistant_only, loss_type), &out);
        assert_eq!((ours.len(), theirs.len()), (3, 3), "{stdout}");
        let label = format!("{loss_type}, assistant_only {assistant_only}");
        let worst = assert_like_trl(&label, (&ours, &theirs), &their_eval, KEYS);
        eprintln!("{loss_type}, assistant_only {assistant_only}: every figure within {worst:.1e} of TRL's");
    }
}

/// Each epoch's rows as transformers' Trainer and accelerate deal them. With
/// dataloader_drop_last true the rows past the last micro-batch every rank fills are left
/// out, and named at launch; with false, its default, two processes fill their last
/// micro-batches with rows from the epoch's start (named too), and a single process trains the
/// last rows in a smaller micro-batch.
#[test]
fn each_epochs_rows_are_dealt_as_accelerate_deals_them() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = eight_rows(tmp.path());
    let run = |processes: &str, drop_last: &str| {
        let out = tmp.path().join(format!("out-{processes}-{drop_last}"));
        let o = common::trainer_launch(
            "sft",
            &["--num_processes", processes],
            &[
                "--dataset_name",
                rows.to_str().unwrap(),
                "--eval_dataset_name",
                "none",
                "--dataloader_drop_last",
                drop_last,
                "--per_device_train_batch_size",
                "3",
                "--num_train_epochs",
                "1",
                "--logging_steps",
                "1",
                "--save_steps",
                "1000",
                "--output_dir",
                out.to_str().unwrap(),
            ],
        )
        .output()
        .unwrap();
        let text = String::from_utf8_lossy(&o.stdout) + String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{text}");
        let steps = metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap());
        (text.to_string(), steps)
    };
    // 1 process: 2 micro-batches of 3, the last 2 rows left out; or 3, the last of 2 rows.
    let (text, steps) = run("1", "true");
    assert!(
        text.contains("2 of 8 training rows are left out of each epoch"),
        "{text}"
    );
    assert_eq!(steps.len(), 2);
    let (text, steps) = run("1", "false");
    assert!(!text.contains("left out"), "{text}");
    assert_eq!(steps.len(), 3);
    let tokens = |s: &[serde_json::Value]| s.last().unwrap()["num_tokens"].as_f64().unwrap();
    let all_rows = tokens(&steps);
    // 2 processes: 3 micro-batches of 3 rows do not share out evenly, so each rank reads 2,
    // the last filled with the epoch's first 4 rows again.
    let (text, steps) = run("2", "false");
    assert!(
        text.contains("4 rows of each epoch's start are trained twice"),
        "{text}"
    );
    assert_eq!(steps.len(), 2);
    assert!(
        tokens(&steps) > all_rows,
        "{} vs {all_rows}",
        tokens(&steps)
    );
    let (text, steps) = run("2", "true");
    assert!(text.contains("2 of 8 training rows are left out"), "{text}");
    assert_eq!(steps.len(), 1);
}

/// An epoch of 8 rows in micro-batches of 3, in stored order, under a linear schedule, as
/// transformers' Trainer and accelerate deal it: one process in steps of 2 micro-batches
/// (the last micro-batch of 2 rows, the epoch's last step of 1 micro-batch) for 2 epochs,
/// and two processes (torchrun) in steps of 1, each rank's last micro-batch filled with the
/// epoch's first rows; then an evaluation of the 8 rows in batches of 3, dealt the same way
/// (the padded rows' values cut as accelerate's gather_for_metrics cuts them). Two processes
/// again on a mixture of experts: each batch's router loss added to its loss and
/// `eval_aux_loss` the mean over each round's kept ranks, as TRL adds and gathers them. Every
/// step's figures, learning rate and epoch, and the evaluation's, equal TRL's SFTTrainer's
/// (when TRL is installed).
#[test]
fn partial_batches_and_steps_match_trl() {
    let Some((trl, tmp, rows)) = trl_and_eight_rows() else {
        return;
    };
    for (processes, accumulation, model) in [
        (1, "2", "tiny"),
        (2, "1", "tiny"),
        (2, "1", "tiny-qwen3-moe"),
    ] {
        let moe = model.contains("moe");
        let shared = [
            ("per_device_train_batch_size", "3"),
            ("gradient_accumulation_steps", accumulation),
            ("num_train_epochs", "2"),
            ("lr_scheduler_type", "linear"),
            ("train_sampling_strategy", "sequential"),
            ("dataloader_drop_last", "false"),
            ("assistant_only_loss", "true"),
        ];
        let router = [("router_aux_loss_coef", "0.1")];
        let shared = [&shared[..], if moe { &router } else { &[] }].concat();
        let (overrides, flags) = common::both_ways(&shared);
        let (theirs, their_eval, stdout) = run_trl(
            trl.command(model, &rows, &tmp.path().join("trl"), processes)
                .args(["-1", "8", "1e-3", "rows=8", "eval_batch=3"])
                .args(&overrides),
        );
        let out = tmp.path().join(format!("ours-{processes}-{model}"));
        let launch = ["--num_processes", &processes.to_string()].map(String::from);
        let cmd = common::trainer_launch(
            "sft",
            &launch.iter().map(String::as_str).collect::<Vec<_>>(),
            &[
                &["--dataset_name", rows.to_str().unwrap()][..],
                &["--eval_dataset_name", rows.to_str().unwrap()],
                &[
                    "--per_device_eval_batch_size",
                    "3",
                    "--eval_strategy",
                    "steps",
                ],
                &["--eval_steps", "4"],
                &["--model_name_or_path"],
                &[common::model_dir(model).to_str().unwrap()],
                &["--learning_rate", "1e-3", "--max_length", "64"],
                &["--packing", "false", "--gradient_checkpointing", "false"],
                &["--warmup_steps", "0", "--weight_decay", "0", "--seed", "0"],
                &["--logging_steps", "1", "--save_steps", "1000"],
                &["--output_dir", out.to_str().unwrap()],
                &flags.iter().map(String::as_str).collect::<Vec<_>>(),
            ]
            .concat(),
        );
        let ours = metrics(&common::metrics_of(cmd, &out));
        assert_eq!((ours.len(), theirs.len()), (4, 4), "{stdout}");
        let aux: &[&str] = if moe { &["aux_loss"] } else { &[] };
        let keys = [KEYS, &["learning_rate", "epoch"], aux].concat();
        let label = format!("{processes} process(es), {model}");
        let worst = assert_like_trl(&label, (&ours, &theirs), &their_eval, &keys);
        eprintln!(
            "{label}, partial micro-batches and steps: every figure within {worst:.1e} of TRL's"
        );
    }
}

/// A command that names a dataset (or a model) starts from TRL's defaults, as `trl sft
/// --dataset_name ...` does, not from the bundled job's (learning rate 2e-3 with warm-up,
/// 16 rows per device, max_length 64, evaluation on the bundled rows).
#[test]
fn naming_a_dataset_starts_from_trls_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = eight_rows(tmp.path());
    let out = tmp.path().join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_cargo-trl"))
        .current_dir(root())
        .env("CARGO_NET_OFFLINE", "true")
        .args(common::LAUNCH)
        .args(["--num_processes", "1", "sft", "--", "--dataset_name"])
        .arg(&rows)
        .args(["--max_steps", "1", "--logging_steps", "1", "--output_dir"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let step = &metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())[0];
    // TRL's 2e-5 (linear, no warm-up), and its 8 rows per device: the 8 rows in one step.
    assert_eq!(step["learning_rate"], 2e-5, "{step}");
    assert_eq!(step["epoch"], 1.0, "{step}");
    assert!(stdout.contains("held-out accuracy: before n/a"), "{stdout}");
}

/// A run resumed from the step after an epoch's partial last one (8 rows in micro-batches of
/// 3, steps of 2: 2 steps an epoch, the second of 1 micro-batch) logs the straight run's
/// next step.
#[test]
fn a_run_resumed_after_a_partial_step_equals_the_straight_one() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = eight_rows(tmp.path());
    let run = |out: &Path, resume: bool| {
        let mut args = vec![
            "--dataset_name",
            rows.to_str().unwrap(),
            "--eval_dataset_name",
            "none",
            "--per_device_train_batch_size",
            "3",
            "--gradient_accumulation_steps",
            "2",
            "--num_train_epochs",
            "2",
            "--logging_steps",
            "1",
            "--save_steps",
            "3",
            "--output_dir",
            out.to_str().unwrap(),
        ];
        if resume {
            args.extend(["--resume_from_checkpoint", "latest"]);
        }
        let cmd = common::trainer_launch("sft", &["--num_processes", "1"], &args);
        metrics(&common::metrics_of(cmd, out))
    };
    let straight = run(&tmp.path().join("straight"), false);
    let resumed_dir = tmp.path().join("resumed");
    std::fs::create_dir_all(&resumed_dir).unwrap();
    let checkpoint = tmp.path().join("straight/checkpoint-3");
    let copy = Command::new("cp")
        .arg("-r")
        .arg(&checkpoint)
        .arg(&resumed_dir)
        .status()
        .unwrap();
    assert!(copy.success());
    let resumed = run(&resumed_dir, true);
    assert_eq!(straight.len(), 4);
    let last = resumed.last().unwrap();
    assert_eq!(last["step"], 4, "{last}");
    for key in ["epoch", "loss", "grad_norm", "learning_rate", "num_tokens"] {
        assert_eq!(last[key], straight[3][key], "{key}");
    }
}

/// Hub names are read from the Hugging Face cache, as transformers and datasets read them
/// offline: a model and a dataset laid out as `hf download` lays them out (files linked to
/// blobs, `refs/main` naming the snapshot) train as their local copies do, and a name the
/// cache lacks is refused before anything runs, with the command that fetches it.
#[test]
fn hub_names_are_read_from_the_hugging_face_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    // `repo` of kind `kind` with `files` (name in the repo, source), as huggingface_hub
    // caches it.
    let snapshot = |kind: &str, repo: &str, files: &[(&str, PathBuf)]| {
        let dir = cache.join(format!("{kind}--{}", repo.replace('/', "--")));
        let snap = dir.join("snapshots/5eed");
        for (i, (name, source)) in files.iter().enumerate() {
            let blob = dir.join(format!("blobs/{i}"));
            std::fs::create_dir_all(blob.parent().unwrap()).unwrap();
            std::fs::copy(source, &blob).unwrap();
            let link = snap.join(name);
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(&blob, &link).unwrap();
        }
        std::fs::create_dir_all(dir.join("refs")).unwrap();
        std::fs::write(dir.join("refs/main"), "5eed").unwrap();
    };
    let model = root().join("assets/tiny/model");
    let model_files: Vec<(&str, PathBuf)> = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .iter()
    .map(|f| (*f, model.join(f)))
    .collect();
    snapshot("models", "tiny-org/Tiny-Qwen2", &model_files);
    let rows = eight_rows(tmp.path());
    snapshot(
        "datasets",
        "tiny-org/addition",
        &[("train.jsonl", rows.clone())],
    );
    let run = |model: &str, data: &str, out: &Path| {
        let mut cmd = common::trainer_launch(
            "sft",
            &["--num_processes", "1"],
            &[
                &["--model_name_or_path", model, "--dataset_name", data][..],
                &["--eval_dataset_name", "none", "--max_steps", "2"],
                &["--per_device_train_batch_size", "4", "--logging_steps", "1"],
                &[
                    "--train_sampling_strategy",
                    "sequential",
                    "--save_steps",
                    "1000",
                ],
                &["--output_dir", out.to_str().unwrap()],
            ]
            .concat(),
        );
        cmd.env("HF_HUB_CACHE", &cache);
        cmd
    };
    let hub = common::metrics_of(
        run(
            "tiny-org/Tiny-Qwen2",
            "tiny-org/addition",
            &tmp.path().join("hub-run"),
        ),
        &tmp.path().join("hub-run"),
    );
    let local = common::metrics_of(
        run(
            model.to_str().unwrap(),
            rows.to_str().unwrap(),
            &tmp.path().join("local-run"),
        ),
        &tmp.path().join("local-run"),
    );
    let losses = |text: &str| -> Vec<f64> {
        metrics(text)
            .iter()
            .map(|m| m["loss"].as_f64().unwrap())
            .collect()
    };
    assert_eq!(losses(&hub).len(), 2, "{hub}");
    assert_eq!(losses(&hub), losses(&local));
    let o = run(
        "tiny-org/Absent",
        "tiny-org/addition",
        &tmp.path().join("absent"),
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("model_name_or_path") && err.contains("hf download tiny-org/Absent"),
        "{err}"
    );
}
