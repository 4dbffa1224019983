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
    sft_on("multi_cpu", out, steps, args)
}

/// [`sft`] under `profile`.
fn sft_on(profile: &str, out: &Path, steps: usize, args: &[&str]) -> std::process::Output {
    let mut cmd = common::sft_launch(&["--profile", profile], args);
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

    // Skipping instead: the run ends, its weights finite, every skipped step said; under
    // DDP, ZeRO-2 and ZeRO-3 (each checks the global norm before its own update).
    for profile in ["multi_cpu", "zero2_cpu", "zero3_cpu"] {
        let out = tmp.path().join(format!("skip-{profile}"));
        let args = ["--learning_rate", "1e9", "--on_nonfinite", "skip"];
        let o = sft_on(profile, &out, 6, &args);
        let text = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{profile}: {text}");
        assert!(text.contains("update was skipped"), "{profile}: {text}");
        assert!(finite_weights(&out.join("checkpoint-6")), "{profile}");
    }
}

/// A LoRA run into the output_dir of a full run stops before training, naming the other
/// run's checkpoints; `--overwrite_output_dir true` writes there anyway, with a warning,
/// and the full run's checkpoint stays until rotated.
#[test]
fn another_runs_output_dir_is_refused_unless_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = sft(&out, 2, &["--save_total_limit", "5"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lora = ["--use_peft", "--save_total_limit", "5"];
    let o = sft(&out, 2, &lora);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success());
    assert!(
        err.contains("output_dir")
            && err.contains("another run")
            && err.contains("overwrite_output_dir"),
        "{err}"
    );
    assert!(!out.join("checkpoint-2/adapter_config.json").exists());
    let o = sft(
        &out,
        1,
        &[&lora[..], &["--overwrite_output_dir", "true"]].concat(),
    );
    let text = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{text}");
    assert!(text.contains("(overwrite_output_dir)"), "{text}");
    assert!(out.join("checkpoint-1/adapter_config.json").exists());
    assert!(out.join("checkpoint-2/model.safetensors").exists());
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

/// The last metrics line of a run in `out`.
fn last_line(out: &Path) -> serde_json::Value {
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last = metrics
        .lines()
        .rev()
        .find(|l| l.contains("\"step\""))
        .unwrap();
    serde_json::from_str(last).unwrap()
}

/// Resumed on another number of processes (2 -> 3, 2 -> 4, 4 -> 2) under DDP, ZeRO-3 and
/// FSDP2: the rest of the saved epoch is trained once, each of its rows (the epoch's input
/// tokens equal one process's over the same 96 rows, and it ends at the step the rest
/// takes on the new layout), and the new effective batch is said, with the accumulation
/// that keeps the old one when one does.
#[test]
fn a_run_resumes_on_any_number_of_processes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rows: Vec<String> = std::fs::read_to_string(root.join("assets/tiny/data/train.jsonl"))
        .unwrap()
        .lines()
        .take(96)
        .map(String::from)
        .collect();
    let data = tmp.path().join("rows.jsonl");
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let run = |launch: &[&str], out: &Path, extra: &[&str]| {
        let mut cmd = common::sft_launch(launch, extra);
        cmd.args([
            "--per_device_train_batch_size",
            "4",
            "--num_train_epochs",
            "1",
        ])
        .args(["--logging_steps", "1", "--eval_dataset_name", "none"])
        .args(["--save_total_limit", "5", "--seed", "7", "--dataset_name"])
        .arg(&data)
        .arg("--output_dir")
        .arg(out);
        let o = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{text}");
        text
    };
    let one = tmp.path().join("one");
    run(&["--num_processes", "1"], &one, &[]);
    let all_tokens = last_line(&one)["num_tokens"].as_u64().unwrap();
    assert_eq!(last_line(&one)["step"], 24);
    // FSDP2's intermediate checkpoints also as SHARDED_STATE_DICT (a file per rank, read
    // back resharded); a run's last checkpoint is always whole.
    let sharded: &[&str] = &["--fsdp_state_dict_type", "SHARDED_STATE_DICT"];
    for (name, profile, extra) in [
        ("multi_cpu", "multi_cpu", &[][..]),
        ("zero3_cpu", "zero3_cpu", &[][..]),
        ("fsdp2_cpu", "fsdp2_cpu", &[][..]),
        ("fsdp2_cpu sharded", "fsdp2_cpu", sharded),
    ] {
        for (from, to, saved_at) in [(2usize, 3usize, 6usize), (2, 4, 6), (4, 2, 3)] {
            let what = format!("{name} {from} -> {to}");
            let out = tmp
                .path()
                .join(format!("{profile}-{}-{from}-{to}", extra.len()));
            let procs = |n: usize| n.to_string();
            let (f, t) = (procs(from), procs(to));
            let (save, stop) = (saved_at.to_string(), (2 * saved_at).to_string());
            let launch = |n: &'static str| {
                [&["--profile", profile, "--num_processes", n][..], extra].concat()
            };
            let (f, t): (&'static str, &'static str) = (f.leak(), t.leak());
            run(
                &launch(f),
                &out,
                &["--max_steps", &stop, "--save_steps", &save],
            );
            let checkpoint = out.join(format!("checkpoint-{saved_at}"));
            // (ZeRO-3's are sharded as DeepSpeed writes them anyway.)
            if !extra.is_empty() || profile == "zero3_cpu" {
                assert!(checkpoint.join("sharded").exists(), "{what}: whole");
            }
            let text = run(
                &launch(t),
                &out,
                &["--resume_from_checkpoint", checkpoint.to_str().unwrap()],
            );
            // 96 rows, saved_at x from x 4 of them trained before; the rest in rounds of to x 4.
            let rest = (96 - saved_at * from * 4) / (to * 4);
            let last = last_line(&out);
            assert_eq!(last["step"], saved_at + rest, "{what}: {last}");
            assert_eq!(last["epoch"], 1.0, "{what}: {last}");
            assert_eq!(last["num_tokens"], all_tokens, "{what}: {last}");
            assert!(text.contains("effective batch"), "{what}: {text}");
            if from == 4 {
                assert!(
                    text.contains("--gradient_accumulation_steps 2 keeps it"),
                    "{what}: {text}"
                );
            }
            eprintln!(
                "{what}: the epoch's {all_tokens} input tokens once, ended at step {}",
                saved_at + rest
            );
        }
    }
}

/// What a save killed mid-way leaves (a full-size hidden `.checkpoint-N.tmp`, a half-retired
/// `.retired-checkpoint-N`) is removed when the next run in that directory starts.
#[test]
fn an_interrupted_save_leaves_nothing_behind_at_the_next_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    for stale in [".checkpoint-7.tmp", ".retired-checkpoint-3"] {
        std::fs::create_dir_all(out.join(stale)).unwrap();
        std::fs::write(
            out.join(stale).join("model.safetensors"),
            vec![0u8; 1 << 20],
        )
        .unwrap();
    }
    let o = sft(&out, 2, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let left: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Rows that give nothing to train on (an empty conversation, a user-only one under the
/// bundled job's assistant_only_loss) are named by file and line, and skipped with a count
/// under `--skip_bad_rows true`.
#[test]
fn a_row_with_nothing_to_train_on_is_named_and_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut rows: Vec<String> = std::fs::read_to_string(root.join("assets/tiny/data/train.jsonl"))
        .unwrap()
        .lines()
        .take(40)
        .map(String::from)
        .collect();
    rows.insert(2, r#"{"messages": []}"#.into());
    rows.insert(
        4,
        r#"{"messages": [{"role": "user", "content": "What is 1 + 1?"}]}"#.into(),
    );
    let data = tmp.path().join("rows.jsonl");
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let data = data.to_str().unwrap();
    let out = tmp.path().join("out");
    let o = sft(&out, 2, &["--dataset_name", data]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success());
    assert!(
        err.contains(data) && err.contains("line 3") && err.contains("`messages` is empty"),
        "{err}"
    );
    assert!(!err.contains("chat_template"), "blames the template: {err}");
    assert!(err.contains("--skip_bad_rows true"), "{err}");
    let o = sft(
        &out,
        2,
        &["--dataset_name", data, "--skip_bad_rows", "true"],
    );
    let text = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{text}");
    assert!(text.contains("skipped 2 bad row(s)"), "{text}");
    assert!(
        text.contains("first at line 3: `messages` is empty"),
        "{text}"
    );
    // A line that is not JSON: the file's line number, the column, the flag that skips.
    let broken = tmp.path().join("broken.jsonl");
    let mut lines = rows[..2].to_vec();
    lines.extend(rows[3..4].iter().cloned());
    lines.extend(rows[5..].iter().cloned());
    lines.insert(4, r#"{"messages": [{"role": "user""#.into());
    std::fs::write(&broken, lines.join("\n") + "\n").unwrap();
    let o = sft(&out, 2, &["--dataset_name", broken.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        err.contains("line 5")
            && err.contains("not valid JSON at column")
            && !err.contains("line 1 column")
            && err.contains("--skip_bad_rows true"),
        "{err}"
    );
}
