//! Faults a long run meets, through the binaries a user runs (`cargo trl launch` and the
//! `sft` example): a learning rate that overflows stops the run with a message naming the
//! step, its update never applied and the checkpoints before it kept (or, with
//! `--on_nonfinite skip`, the step skipped and the run finished with finite weights).

mod common;

use std::path::Path;
use trl_runtime::candle_core::{safetensors, Device};

/// `cargo trl launch --profile multi_cpu sft -- ARGS` for `steps` steps into `out`, a
/// checkpoint and a metrics line every step, no evaluation.
fn sft(out: &Path, steps: usize, args: &[&str]) -> std::process::Output {
    let mut cmd = common::sft_launch(&["--profile", "multi_cpu"], args);
    cmd.args(["--max_steps", &steps.to_string(), "--save_steps", "1"])
        .args(["--logging_steps", "1", "--eval_dataset_name", "none"])
        .arg("--output_dir")
        .arg(out)
        .output()
        .unwrap()
}

fn finite_weights(checkpoint: &Path) -> bool {
    let w = safetensors::load(checkpoint.join("model.safetensors"), &Device::Cpu).unwrap();
    w.values().all(|t| {
        t.flatten_all()
            .unwrap()
            .to_dtype(trl_runtime::candle_core::DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite())
    })
}

#[test]
fn an_overflowing_learning_rate_stops_and_keeps_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("stop");
    let o = sft(&out, 20, &["--learning_rate", "1e9"]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "a non-finite run exited 0: {err}");
    assert!(
        err.contains("not finite") && err.contains("--learning_rate"),
        "{err}"
    );
    // The step named is the first non-finite one; every checkpoint before it holds finite
    // weights and the message names the latest.
    let step: usize = err
        .split("non-finite values: step ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step named: {err}"));
    let last = out.join(format!("checkpoint-{}", step - 1));
    assert!(last.join("model.safetensors").exists(), "{err}");
    assert!(err.contains(&last.display().to_string()), "{err}");
    assert!(finite_weights(&last));
    assert!(!out.join(format!("checkpoint-{step}")).exists());
    // metrics.jsonl keeps a line for it, its non-finite value as null.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let line: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(line["step"], step);
    assert!(
        line["grad_norm"].is_null() || line["loss"].is_null(),
        "{line}"
    );
    // The launcher's progress lines read it (no raw event line reaches the user).
    assert!(!err.contains("TRL_PROGRESS"), "{err}");
    eprintln!("stopped at step {step}, checkpoint-{} kept", step - 1);

    // Skipping instead: the run ends, its weights finite, every skipped step said.
    let out = tmp.path().join("skip");
    let o = sft(
        &out,
        6,
        &["--learning_rate", "1e9", "--on_nonfinite", "skip"],
    );
    let text = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{text}");
    assert!(text.contains("update was skipped"), "{text}");
    assert!(finite_weights(&out.join("checkpoint-6")));
}

/// The pid of the worker of `launcher` (a `cargo trl launch` process) whose RANK is `rank`.
fn worker_pid(launcher: u32, rank: usize) -> Option<u32> {
    let children = std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
        .unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .unwrap_or_default()
                .split(|b| *b == 0)
                .any(|kv| kv == format!("RANK={rank}").as_bytes())
        })
}

/// `--max_restarts 1` with rank 1 killed (SIGKILL) after checkpoint-100: the restart resumes
/// from the latest checkpoint and ends with the weights of a run never interrupted; the
/// checkpoints before the kill stay and metrics.jsonl holds every step once, the restart
/// marked. The same command with `--resume_from_checkpoint latest` starts a fresh directory
/// from scratch with a note (one command for the first start and every restart).
#[test]
fn a_restart_resumes_from_the_latest_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let args = |out: &Path| {
        let mut cmd = common::sft_launch(
            &["--profile", "multi_cpu", "--max_restarts", "1"],
            &["--resume_from_checkpoint", "latest"],
        );
        cmd.args([
            "--max_steps",
            "300",
            "--save_steps",
            "100",
            "--save_total_limit",
            "5",
        ])
        .args(["--logging_steps", "1", "--eval_dataset_name", "none"])
        .args(["--per_device_train_batch_size", "4", "--seed", "7"])
        .arg("--output_dir")
        .arg(out);
        cmd
    };
    let straight = tmp.path().join("straight");
    let o = args(&straight).output().unwrap();
    let text = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{text}");
    assert!(text.contains("no complete checkpoint"), "{text}");

    let out = tmp.path().join("killed");
    let child = args(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !out.join("checkpoint-100/trainer_state.json").exists() {
        assert!(start.elapsed().as_secs() < 300, "no checkpoint-100");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let pid = worker_pid(child.id(), 1).expect("rank 1's process");
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let o = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{text}");
    assert!(text.contains("restarting the group"), "{text}");
    assert!(text.contains("resumed from"), "{text}");
    for line in text.lines() {
        if line.contains("root cause") || line.contains("resumed from") {
            eprintln!("{line}");
        }
    }
    for step in [100, 200, 300] {
        assert!(
            out.join(format!("checkpoint-{step}")).exists(),
            "checkpoint-{step}"
        );
    }
    let a = common::Run::read(&straight, 300);
    let b = common::Run::read(&out, 300);
    for (name, w) in &a.weights {
        let d = common::max_diff(&b.weights[name], w);
        assert!(d < 2e-5, "{name}: the restarted run differs by {d}");
    }
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = lines.iter().filter_map(|v| v["step"].as_u64()).collect();
    assert_eq!(steps, (1..=300).collect::<Vec<u64>>());
    assert!(lines.iter().any(|v| v["restart"] == 1), "{metrics}");
}
