//! DPO through the real `cargo trl launch` and the `dpo` example: its logged loss and metrics
//! equal TRL 1.16's DPOTrainer's on the same model and pairs (when TRL is installed), and
//! under every CPU profile a run equals one process.

mod common;

use common::{assert_equal, max_diff, Run};
use std::path::{Path, PathBuf};
use std::process::Command;

const STEPS: usize = 5;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn dpo(launch_args: &[&str], per_device: usize, out: &Path, extra: &[&str]) -> String {
    let args = [
        &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
        extra,
    ]
    .concat();
    let cmd = common::trainer_launch("dpo", launch_args, &args);
    common::run_launch(cmd, STEPS, per_device, out)
}

#[test]
fn dpo_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let out = |name: &str| tmp.path().join(name);
    let one = ["--num_processes", "1"];
    dpo(&one, 8, &out("one8"), &[]);
    dpo(&one, 4, &out("one4"), &[]);
    let (one8, one4) = (
        Run::read(&out("one8"), STEPS),
        Run::read(&out("one4"), STEPS),
    );
    // The policy moved away from the reference.
    assert!(
        one8.losses[STEPS - 1] < one8.losses[0] - 1e-3,
        "{:?}",
        one8.losses
    );
    for (name, args, two_dp) in common::CPU_CASES {
        dpo(args, 4, &out(name), &[]);
        let want = if *two_dp { &one8 } else { &one4 };
        let got = Run::read(&out(name), STEPS);
        assert_equal(&format!("dpo {name}"), &got, want, &[], |_, g, w| {
            max_diff(g, w)
        });
    }
}

/// A Python with TRL (TRL_PYTHON, else python3), or None with the reason printed.
fn trl_python() -> Option<PathBuf> {
    let python = std::env::var_os("TRL_PYTHON").map_or("python3".into(), PathBuf::from);
    let ok = Command::new(&python)
        .args(["-c", "import trl, datasets, transformers, torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "skipped: no Python with trl ({}; set TRL_PYTHON to one: \
             `python3 -m venv v && v/bin/pip install torch transformers trl datasets`)",
            python.display()
        );
    }
    ok.then_some(python)
}

fn metrics(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .collect()
}

/// Three steps of whole-dataset batches (8 pairs, AdamW, constant learning rate, fp32): the
/// logged loss, gradient norm, rewards, log-probs and mean logits equal TRL's within 1e-4
/// relative, for the default loss, IPO and a weighted list with RPO's SFT term.
#[test]
fn dpo_matches_trl() {
    let Some(python) = trl_python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let pairs = tmp.path().join("pairs.jsonl");
    let all = std::fs::read_to_string(root().join("assets/tiny/data/pref_train.jsonl")).unwrap();
    std::fs::write(&pairs, all.lines().take(8).collect::<Vec<_>>().join("\n")).unwrap();
    const KEYS: &[&str] = &[
        "loss",
        "grad_norm",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    ];
    for losses in [&["sigmoid"][..], &["ipo"], &["sigmoid", "sft"]] {
        let out = tmp.path().join(losses.join("-"));
        let o = Command::new(&python)
            .arg(root().join("scripts/trl_dpo.py"))
            .arg(root().join("assets/tiny/model"))
            .arg(&pairs)
            .arg(tmp.path().join("trl"))
            .args(["3", "8", "1e-3"])
            .args(losses)
            .output()
            .unwrap();
        let theirs = metrics(&String::from_utf8_lossy(&o.stdout));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let cmd = common::trainer_launch(
            "dpo",
            &["--num_processes", "1"],
            &[
                &["--dataset_name", pairs.to_str().unwrap()][..],
                &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
                &["--max_length", "64", "--gradient_checkpointing", "false"],
                &["--loss_type"][..],
                losses,
            ]
            .concat(),
        );
        common::run_launch(cmd, 3, 8, &out);
        let ours = metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap());
        assert_eq!((ours.len(), theirs.len()), (3, 3), "{losses:?}");
        let mut worst = 0f64;
        for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            for key in KEYS {
                let (g, w) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
                let d = (g - w).abs() / w.abs().max(1e-3);
                worst = worst.max(d);
                assert!(
                    d < 1e-4,
                    "{losses:?} step {}: {key} {g} vs TRL's {w}",
                    step + 1
                );
            }
        }
        eprintln!("{losses:?}: every metric within {worst:.1e} relative of TRL's");
    }
}
