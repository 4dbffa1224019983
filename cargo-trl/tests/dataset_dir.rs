//! A local dataset directory as `--dataset_name` (what `datasets.load_dataset(DIR)` reads):
//! through the real `cargo trl launch`, SFT and DPO train and evaluate on a directory's splits
//! exactly as on the files they came from, and a split that is not there is an error naming
//! the key and the splits found.

mod common;

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `bin` on one process for 2 steps, evaluating after each; returns the metrics lines' losses
/// and eval losses.
fn run(bin: &str, out: &Path, args: &[String]) -> Vec<(f64, f64)> {
    let o = common::trainer_launch(bin, &["--num_processes", "1"], args)
        .args(["--max_steps", "2", "--seed", "7", "--logging_steps", "1"])
        .args([
            "--eval_steps",
            "1",
            "--save_steps",
            "1000",
            "--disable_tqdm",
        ])
        .args(["--per_device_train_batch_size", "4"])
        .arg("--output_dir")
        .arg(out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{bin} {args:?}: {text}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v.get("loss").is_some())
        .collect();
    assert_eq!(lines.len(), 2, "{metrics}");
    lines
        .iter()
        .map(|v| {
            (
                v["loss"].as_f64().unwrap(),
                v["eval_loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Writes `lines` of `from` (a JSONL file) to `to`, creating its folders.
fn write_lines(from: &Path, range: std::ops::Range<usize>, to: &Path) -> usize {
    let text = std::fs::read_to_string(from).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let end = range.end.min(lines.len());
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::write(to, lines[range.start..end].join("\n") + "\n").unwrap();
    lines.len()
}

#[test]
fn dataset_directories_train_as_their_files_do() {
    let tmp = tempfile::tempdir().unwrap();
    let data = root().join("assets/tiny/data");
    let s = |p: &Path| p.to_str().unwrap().to_string();

    // SFT on the Hub's layout: the train split in two shards, a test split, a README.
    let hub = tmp.path().join("hub");
    let n = write_lines(
        &data.join("train.jsonl"),
        0..40,
        &hub.join("data/train-00000-of-00002.jsonl"),
    );
    write_lines(
        &data.join("train.jsonl"),
        40..n,
        &hub.join("data/train-00001-of-00002.jsonl"),
    );
    write_lines(
        &data.join("eval.jsonl"),
        0..usize::MAX,
        &hub.join("data/test-00000-of-00001.jsonl"),
    );
    std::fs::write(hub.join("README.md"), "---\nlicense: mit\n---\n").unwrap();
    let file_args = [
        "--dataset_name".to_string(),
        s(&data.join("train.jsonl")),
        "--eval_dataset_name".into(),
        s(&data.join("eval.jsonl")),
    ];
    let dir_args = [
        "--dataset_name".to_string(),
        s(&hub),
        "--eval_dataset_name".into(),
        s(&hub),
    ];
    let from_files = run("sft", &tmp.path().join("sft-files"), &file_args);
    let from_dir = run("sft", &tmp.path().join("sft-dir"), &dir_args);
    assert_eq!(from_files, from_dir);

    // DPO on split folders, evaluating on the `validation` split by dataset_test_split.
    let folders = tmp.path().join("folders");
    write_lines(
        &data.join("pref_train.jsonl"),
        0..usize::MAX,
        &folders.join("train/pairs.jsonl"),
    );
    write_lines(
        &data.join("pref_eval.jsonl"),
        0..usize::MAX,
        &folders.join("validation/pairs.jsonl"),
    );
    let file_args = [
        "--dataset_name".to_string(),
        s(&data.join("pref_train.jsonl")),
        "--eval_dataset_name".into(),
        s(&data.join("pref_eval.jsonl")),
    ];
    let dir_args = [
        "--dataset_name".to_string(),
        s(&folders),
        "--eval_dataset_name".into(),
        s(&folders),
        "--dataset_test_split".into(),
        "validation".into(),
    ];
    let from_files = run("dpo", &tmp.path().join("dpo-files"), &file_args);
    let from_dir = run("dpo", &tmp.path().join("dpo-dir"), &dir_args);
    assert_eq!(from_files, from_dir);

    // A split the directory does not have: the key, the directory and what it has.
    let o = common::trainer_launch("dpo", &["--num_processes", "1"], &dir_args[..4])
        .args(["--max_steps", "1", "--output_dir"])
        .arg(tmp.path().join("bad"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        text.contains("dataset_test_split")
            && text.contains("no split 'test'")
            && text.contains("[\"train\", \"validation\"]")
            && text.contains("folders"),
        "{text}"
    );
}
