//! The distillation trainer through the real `cargo trl launch` and the `distillation`
//! example: every figure TRL 1.16's DistillationTrainer logs equals ours on the same prompts
//! and completions (completions fixed by scripts/fixed_rollout.py's rule; TRL run when
//! installed, skipped with a message when not), for each kind of divergence; under every CPU
//! profile a run equals one process (the teacher held as the student is); the bundled job's
//! command runs as the docs write it and its checkpoint opens in transformers.

mod common;

use std::path::{Path, PathBuf};

const STEPS: usize = 3;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The tests' flags: `data`, a constant 1e-3, 4-token completions from
/// scripts/fixed_rollout.py, no checkpointing, then `flags`.
fn fixed(data: &Path, flags: &[&str]) -> Vec<String> {
    let rollout = format!(
        "python3 {}",
        root().join("scripts/fixed_rollout.py").display()
    );
    let args = [
        &["--dataset_name", data.to_str().unwrap()][..],
        &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
        &["--max_completion_length", "4", "--shuffle_dataset", "false"],
        &["--gradient_checkpointing", "false"],
        &["--rollout_command", rollout.as_str()],
        flags,
    ]
    .concat();
    args.iter().map(|a| a.to_string()).collect()
}

/// Our run of `STEPS` steps of `per_device` prompts per rank of `data` under `launch`, with
/// the tests' flags and `flags`; its metrics lines.
fn ours(
    launch: &[&str],
    data: &Path,
    per_device: usize,
    flags: &[&str],
    out: &Path,
) -> Vec<serde_json::Value> {
    let args = fixed(data, flags);
    ours_logged(launch, &args, per_device, out).0
}

/// A run of the distillation example with `args`: its metrics lines and its output.
fn ours_logged(
    launch: &[&str],
    args: &[String],
    per_device: usize,
    out: &Path,
) -> (Vec<serde_json::Value>, String) {
    let cmd = common::trainer_launch("distillation", launch, args);
    let text = common::run_launch(cmd, STEPS, per_device, out);
    let metrics = common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap());
    (metrics, text)
}

/// How the run's log says the teacher is held.
fn teacher_held(text: &str) -> &str {
    let line = text
        .lines()
        .find(|l| l.contains("distillation: teacher"))
        .unwrap_or_else(|| panic!("no teacher line in {text}"));
    let start = line.find('(').unwrap() + 1;
    &line[start..line.find("), beta").unwrap()]
}

/// TRL's DistillationTrainer (scripts/trl_distillation.py) with the bundled student and
/// teacher on `data`, `per_device` prompts a step, with `keys`: each step's line and the
/// evaluation (eval_batch among the keys).
fn theirs(
    trl: &common::TrlScript,
    data: &Path,
    per_device: usize,
    keys: &[String],
    out: &Path,
) -> (Vec<serde_json::Value>, Option<serde_json::Value>) {
    let (steps, batch) = (STEPS.to_string(), per_device.to_string());
    let teacher = format!("teacher={}", root().join("assets/tiny/teacher").display());
    let mut cmd = trl.command("tiny", data, out, 1);
    cmd.args([steps.as_str(), batch.as_str(), "1e-3", teacher.as_str()])
        .args(["max_completion_length=4", "rows=8"])
        .args(keys);
    common::trl_steps(&mut cmd, STEPS)
}

/// Forward KL, reverse KL (TRL's default) and the JSD at beta 0.3 with a temperature, over 8
/// prompts, 4 a step; the last evaluated on the same prompts: every figure TRL logs for 3
/// steps within 1e-4 relative (at a floor of 1e-3).
#[test]
fn distillation_figures_match_trl() {
    let Some(trl) = common::trl_script("trl_distillation.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = common::first_rows("assets/tiny/data/grpo_train.jsonl", tmp.path(), 8);
    for (case, settings, evaluate, per_device) in [
        ("forward KL", &[("beta", "0.0")][..], false, 4),
        ("reverse KL", &[("beta", "1.0")][..], false, 4),
        (
            "JSD",
            &[("beta", "0.3"), ("temperature", "0.8")][..],
            true,
            4,
        ),
        // A round of 4 prompts trained on over 2 micro-batches of 2.
        (
            "2 accumulation steps",
            &[("beta", "0.5"), ("gradient_accumulation_steps", "2")][..],
            false,
            2,
        ),
    ] {
        let (mut keys, flags) = common::both_ways(settings);
        let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        if evaluate {
            keys.push("eval_batch=4".into());
            let data = data.to_str().unwrap();
            flags.extend([
                "--eval_dataset_name",
                data,
                "--per_device_eval_batch_size",
                "4",
            ]);
        }
        let dir = tmp.path().join(case.replace(' ', "-"));
        let (mut want, eval) = theirs(&trl, &data, per_device, &keys, &dir.join("trl"));
        let got = ours(
            &["--num_processes", "1"],
            &data,
            per_device,
            &flags,
            &dir.join("ours"),
        );
        if per_device == 2 {
            // Each side splits the round into its micro-batches in its own order (ours by
            // its seed; TRL's shuffle is off): the per-micro-batch entropy's mean differs, the
            // loss and the gradient (sums over the round) do not.
            for w in &mut want {
                w.as_object_mut().unwrap().remove("entropy");
            }
        }
        let (worst, key) = common::assert_same_figures(case, &got, &want, (1e-4, 1e-3));
        eprintln!(
            "distillation {case}: every TRL figure within {worst:.1e} relative (worst {key})"
        );
        if let Some(eval) = eval {
            let last = &got[STEPS - 1];
            for (k, v) in eval.as_object().unwrap() {
                if k.ends_with("_runtime")
                    || k.contains("per_second")
                    || k == "epoch"
                    || k == "eval_num_tokens"
                {
                    continue;
                }
                let d = common::off(&last[k], v, 1e-3);
                assert!(d < 1e-4, "{case} {k}: ours {} TRL's {v}", last[k]);
            }
        }
    }
}

/// Under every CPU profile (the teacher held as the student: sharded under ZeRO-3 / FSDP,
/// split under tp and the sequence ranks) a run equals one process: every figure within
/// 1e-5 relative.
#[test]
fn distillation_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::first_rows("assets/tiny/data/grpo_train.jsonl", tmp.path(), 32);
    let args = fixed(&data, &["--beta", "0.5", "--temperature", "0.9"]);
    let one = ["--num_processes", "1"];
    let (one8, _) = ours_logged(&one, &args, 8, &tmp.path().join("one8"));
    let (one4, _) = ours_logged(&one, &args, 4, &tmp.path().join("one4"));
    assert!(one8[0]["loss"].as_f64().unwrap() > 0.0);
    for (name, launch, two_dp) in common::CPU_CASES {
        let (got, text) = ours_logged(launch, &args, 4, &tmp.path().join(name));
        let want = if *two_dp { &one8 } else { &one4 };
        let (worst, key) = common::assert_same_figures(name, &got, want, (1e-5, 1e-3));
        let held = teacher_held(&text);
        eprintln!("distillation {name}: every figure within {worst:.1e} relative (worst {key}); teacher {held}");
        let expected = match *name {
            "zero3_cpu" | "fsdp2_cpu" | "fsdp2_cpu_efficient_loading" => {
                "sharded in 4 units over 2 ranks"
            }
            "fsdp2_tp_cpu" => "split over tp = 2",
            "tp_cpu" => "split over tp = 2",
            "context_parallel_cpu" | "alst_ulysses_cpu" => "sequences split over 2 ranks",
            _ => "whole on each rank",
        };
        assert!(
            held.contains(expected),
            "{name}: teacher {held}, expected {expected}"
        );
    }
}

/// A LoRA student (adapters on every linear layer, dropout off) distilled under DDP and
/// ZeRO-3 equals one process; the adapter opens in peft.
#[test]
fn distillation_with_adapters_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::first_rows("assets/tiny/data/grpo_train.jsonl", tmp.path(), 32);
    let lora = [
        "--use_peft",
        "--lora_target_modules",
        "all-linear",
        "--disable_dropout",
        "true",
        "--beta",
        "0.0",
    ];
    let args = fixed(&data, &lora);
    let one_out = tmp.path().join("one");
    let (one, _) = ours_logged(&["--num_processes", "1"], &args, 8, &one_out);
    assert!(one[STEPS - 1]["loss"].as_f64().unwrap() < one[0]["loss"].as_f64().unwrap());
    for (name, launch) in [
        ("multi_cpu", ["--profile", "multi_cpu"]),
        ("zero3_cpu", ["--profile", "zero3_cpu"]),
    ] {
        let (got, _) = ours_logged(&launch, &args, 4, &tmp.path().join(name));
        let (worst, key) = common::assert_same_figures(name, &got, &one, (1e-5, 1e-3));
        eprintln!(
            "distillation + LoRA {name}: every figure within {worst:.1e} relative (worst {key})"
        );
    }
    let adapter = one_out.join(format!("checkpoint-{STEPS}"));
    common::loads_in_peft(&root().join("assets/tiny/model"), &adapter);
}

/// docs/distillation.md's command, as written, from the repository root: it distils the
/// bundled teacher under ZeRO-3 (the teacher sharded), the held-out divergence falls, and the
/// student's checkpoint opens in transformers.
#[test]
fn the_docs_command_runs_as_written() {
    let lines = common::docs_launches("docs/distillation.md");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let (dir, m, text) = common::run_docs_command(&lines[0]);
    assert!(
        text.contains("teacher assets/tiny/teacher (sharded in 4 units over 2 ranks)"),
        "{text}"
    );
    assert!(m.last().unwrap()["entropy"].as_f64().is_some(), "{text}");
    let (before, after) = common::held_out_before_after(&text, "divergence");
    assert!(after < before, "{before} -> {after}: {text}");
    eprintln!("docs command: held-out divergence {before} -> {after}");
    let checkpoint = trl_runtime::train::checkpoint::resolve(&dir, "latest").unwrap();
    common::opens_in_transformers(&checkpoint);
    let _ = std::fs::remove_dir_all(dir);
}

/// A run resumed from its checkpoint continues as the straight run, completions sampled in
/// the training processes (each row drawing from a seed of its place in its round): the
/// resumed steps' figures within 1e-5 relative.
#[test]
fn a_resumed_distillation_run_continues_the_straight_one() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::first_rows("assets/tiny/data/grpo_train.jsonl", tmp.path(), 32);
    let args = [
        &["--dataset_name", data.to_str().unwrap()][..],
        &["--learning_rate", "1e-3", "--max_completion_length", "6"],
        &["--beta", "0.5", "--temperature", "1.1"],
    ]
    .concat();
    let keys = ["loss", "entropy", "grad_norm", "completions/mean_length"];
    common::assert_resume_continues(
        "distillation",
        &["--profile", "zero3_cpu"],
        &args,
        &keys,
        1e-3,
    );
}

/// Completions with no token (a rollout answering every prompt with nothing): nothing to
/// distil, a zero loss and gradient, and no rank stops, under ZeRO-3 and with sequences split
/// over ranks (whose chunks then hold prompt positions only).
#[test]
fn empty_completions_train_nothing_and_stop_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::first_rows("assets/tiny/data/grpo_train.jsonl", tmp.path(), 16);
    let script = tmp.path().join("empty.py");
    std::fs::write(
        &script,
        "import json, sys\nfor line in sys.stdin:\n    r = json.loads(line)\n    print(json.dumps({'prompt_ids': r['prompt_ids'], 'completion_ids': [[] for _ in r['prompt_ids']]}), flush=True)\n",
    )
    .unwrap();
    let rollout = format!("python3 {}", script.display());
    for (name, launch) in [
        ("zero3_cpu", ["--profile", "zero3_cpu"]),
        (
            "context_parallel_cpu",
            ["--profile", "context_parallel_cpu"],
        ),
    ] {
        let args: Vec<String> = [
            "--dataset_name",
            data.to_str().unwrap(),
            "--rollout_command",
            rollout.as_str(),
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let (m, _) = ours_logged(&launch, &args, 4, &tmp.path().join(name));
        for line in &m {
            assert_eq!(line["loss"].as_f64(), Some(0.0), "{name}: {line}");
            assert_eq!(line["grad_norm"].as_f64(), Some(0.0), "{name}: {line}");
            assert_eq!(
                line["completions/max_length"].as_f64(),
                Some(0.0),
                "{name}: {line}"
            );
        }
    }
}
