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

/// Our run of `STEPS` steps of `per_device` prompts per rank of `data` under `launch`, with
/// the completions of scripts/fixed_rollout.py and `flags`; its metrics lines.
fn ours(
    launch: &[&str],
    data: &Path,
    per_device: usize,
    flags: &[&str],
    out: &Path,
) -> Vec<serde_json::Value> {
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
    let cmd = common::trainer_launch("distillation", launch, &args);
    common::run_launch(cmd, STEPS, per_device, out);
    common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())
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
    let o = trl
        .command("tiny", data, out, 1)
        .args([steps.as_str(), batch.as_str(), "1e-3", teacher.as_str()])
        .args(["max_completion_length=4", "rows=8"])
        .args(keys)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let lines = common::metrics(&stdout);
    assert_eq!(lines.len(), STEPS, "{stdout}");
    let eval = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("eval").cloned());
    (lines, eval)
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
    for (case, settings, evaluate) in [
        ("forward KL", &[("beta", "0.0")][..], false),
        ("reverse KL", &[("beta", "1.0")][..], false),
        ("JSD", &[("beta", "0.3"), ("temperature", "0.8")][..], true),
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
        let (want, eval) = theirs(&trl, &data, 4, &keys, &dir.join("trl"));
        let got = ours(
            &["--num_processes", "1"],
            &data,
            4,
            &flags,
            &dir.join("ours"),
        );
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
    let flags = ["--beta", "0.5", "--temperature", "0.9"];
    let one = ["--num_processes", "1"];
    let one8 = ours(&one, &data, 8, &flags, &tmp.path().join("one8"));
    let one4 = ours(&one, &data, 4, &flags, &tmp.path().join("one4"));
    assert!(one8[0]["loss"].as_f64().unwrap() > 0.0);
    for (name, args, two_dp) in common::CPU_CASES {
        let got = ours(args, &data, 4, &flags, &tmp.path().join(name));
        let want = if *two_dp { &one8 } else { &one4 };
        let (worst, key) = common::assert_same_figures(name, &got, want, (1e-5, 1e-3));
        eprintln!("distillation {name}: every figure within {worst:.1e} relative (worst {key})");
    }
}
