//! The reward trainer through the real `cargo trl launch` and the `reward` example: every
//! figure TRL 1.16's RewardTrainer logs equals ours on the same pairs (TRL run when installed,
//! skipped with a message when not); under every CPU profile a run equals one process; a
//! trained reward model scores as transformers' AutoModelForSequenceClassification on its
//! checkpoint and drives a GRPO run as its reward.

mod common;

use std::path::{Path, PathBuf};

const PAIRS: &str = "assets/tiny/data/pref_train.jsonl";
const STEPS: usize = 3;
/// TRL's RewardConfig learning rate: at 1e-3 Adam's sign-like steps on near-zero gradients
/// carry f32 differences into the rewards (~1e-5 after 3 steps).
const LR: &str = "1e-4";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The first `n` pairs rewritten by `f` (a row in, a row out) into `dir/name`.
fn rows(
    dir: &Path,
    name: &str,
    n: usize,
    f: impl Fn(usize, serde_json::Value) -> serde_json::Value,
) -> PathBuf {
    let all = std::fs::read_to_string(root().join(PAIRS)).unwrap();
    let out: Vec<String> = all
        .lines()
        .take(n)
        .enumerate()
        .map(|(i, l)| f(i, serde_json::from_str(l).unwrap()).to_string())
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, out.join("\n")).unwrap();
    path
}

/// The classifier a run in `out` started from (`reward-model-start-HASH`).
fn start_dir(out: &Path) -> PathBuf {
    std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("reward-model-start-")
        })
        .unwrap_or_else(|| panic!("no reward-model-start-* in {}", out.display()))
}

/// A conversational pair as standard text: the prompt's and each answer's content.
fn as_text(v: serde_json::Value) -> serde_json::Value {
    let text = |k: &str| v[k][0]["content"].as_str().unwrap().to_string();
    serde_json::json!({"prompt": format!("{} ", text("prompt")), "chosen": text("chosen"), "rejected": text("rejected")})
}

/// Our run of `steps` steps on `data` with `flags` under `launch`; its metrics lines.
fn ours(
    launch: &[&str],
    data: &Path,
    per_device: usize,
    flags: &[&str],
    out: &Path,
) -> Vec<serde_json::Value> {
    let args = [
        &["--dataset_name", data.to_str().unwrap()][..],
        &["--learning_rate", LR, "--lr_scheduler_type", "constant"],
        &["--max_length", "64", "--gradient_checkpointing", "false"],
        flags,
    ]
    .concat();
    let cmd = common::trainer_launch("reward", launch, &args);
    common::run_launch(cmd, STEPS, per_device, out);
    common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())
}

/// TRL's RewardTrainer (scripts/trl_reward.py) from the classifier our run in `start` started
/// from, for `STEPS` steps of `per_device` pairs of `data`, with `keys`: each step's line,
/// and its evaluation with `eval_batch=N` among the keys.
fn theirs(
    trl: &common::TrlScript,
    start: &Path,
    data: &Path,
    per_device: usize,
    keys: &[String],
    out: &Path,
) -> (Vec<serde_json::Value>, Option<serde_json::Value>) {
    let (steps, batch) = (STEPS.to_string(), per_device.to_string());
    let mut cmd = trl.command_with(start, data, out, 1);
    cmd.args([steps.as_str(), batch.as_str(), LR]).args(keys);
    common::trl_steps(&mut cmd, STEPS)
}

/// Conversational pairs (evaluated after the last step), standard text pairs with margins and
/// center_rewards_coefficient, implicit-prompt text pairs over 2 accumulation steps: TRL's
/// figures for 3 steps, every one within 1e-4 relative (at a floor of 1e-2: margins of f32
/// rewards near 1e-3).
#[test]
fn reward_figures_match_trl() {
    let Some(trl) = common::trl_script("trl_reward.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let chat = rows(tmp.path(), "chat.jsonl", 4, |_, v| v);
    let margins = rows(tmp.path(), "margins.jsonl", 4, |i, v| {
        let mut t = as_text(v);
        t["margin"] = serde_json::json!(0.25 * i as f64 - 0.3);
        t
    });
    let implicit = rows(tmp.path(), "implicit.jsonl", 4, |_, v| {
        let t = as_text(v);
        let whole = |k: &str| {
            format!(
                "{}{}",
                t["prompt"].as_str().unwrap(),
                t[k].as_str().unwrap()
            )
        };
        serde_json::json!({"chosen": whole("chosen"), "rejected": whole("rejected")})
    });
    type Case<'a> = (&'a str, &'a Path, usize, &'a [(&'a str, &'a str)]);
    let cases: [Case; 3] = [
        ("conversational", &chat, 4, &[]),
        (
            "margins, centered",
            &margins,
            4,
            &[("center_rewards_coefficient", "0.01")],
        ),
        (
            "implicit prompts, accumulated",
            &implicit,
            2,
            &[
                ("gradient_accumulation_steps", "2"),
                ("train_sampling_strategy", "sequential"),
            ],
        ),
    ];
    for (i, (case, data, per_device, settings)) in cases.into_iter().enumerate() {
        let (mut keys, mut flags) = common::both_ways(settings);
        if i == 0 {
            keys.push("eval_batch=2".into());
            let eval = [
                "--eval_dataset_name",
                data.to_str().unwrap(),
                "--per_device_eval_batch_size",
                "2",
            ];
            flags.extend(eval.iter().map(|s| s.to_string()));
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mine = tmp.path().join(format!("ours-{i}"));
        let got = ours(&["--num_processes", "1"], data, per_device, &flags, &mine);
        if per_device == 2 {
            // TRL's rows= takes the first N rows: all 4 pairs, 2 per micro-batch.
            keys.push("rows=4".into());
        }
        let start = start_dir(&mine);
        let (want, eval) = theirs(
            &trl,
            &start,
            data,
            per_device,
            &keys,
            &tmp.path().join(format!("trl-{i}")),
        );
        let (worst, key) = common::assert_same_figures(case, &got, &want, (1e-4, 1e-2));
        eprintln!("reward {case}: every figure TRL logs within {worst:.1e} relative ({key})");
        if let Some(eval) = eval {
            let last = &got[STEPS - 1];
            let mut checked = 0;
            for (key, v) in eval.as_object().unwrap() {
                if !key.starts_with("eval_") || key.ends_with("runtime") || key.ends_with("_second")
                {
                    continue;
                }
                // The mean reward is a mean of rewards near +-0.7 that cancel to ~4e-3: their
                // f32 differences after 3 steps (~1e-5, Adam's) are measured at their size.
                let floor = if key == "eval_mean_reward" { 1.0 } else { 1e-2 };
                let d = common::off(&last[key], v, floor);
                assert!(d < 1e-4, "{case} {key}: ours {} TRL {v}", last[key]);
                checked += 1;
            }
            assert!(checked >= 7, "{case}: {eval} vs {last}");
            eprintln!("reward {case}: {checked} eval figures equal TRL's");
        }
    }
}

/// Seven pairs in batches of 4 for one epoch, evaluated in batches of 3, dealt as accelerate
/// deals them. On one process: the second micro-batch of 3 pairs, the evaluation's last batch
/// of one pair. On two under torchrun: one step, rank 1's batch ending with the first pair
/// again; the evaluation's second round filled from the start, its refill cut from the loss,
/// accuracy and margin by `gather_for_metrics` but kept in the rewards, which TRL gathers
/// whole. Every figure equals TRL's RewardTrainer's within 1e-4 relative.
#[test]
fn partial_batches_match_trl() {
    let Some(trl) = common::trl_script("trl_reward.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = rows(tmp.path(), "pairs.jsonl", 7, |_, v| v);
    let d = data.to_str().unwrap();
    let shared = [
        ("num_train_epochs", "1"),
        ("train_sampling_strategy", "sequential"),
        ("dataloader_drop_last", "false"),
    ];
    let (keys, flags) = common::both_ways(&shared);
    for (processes, steps) in [(1, 2), (2, 1)] {
        let out = tmp.path().join(format!("ours-{processes}"));
        let n = processes.to_string();
        let args = [
            &["--dataset_name", d, "--eval_dataset_name", d][..],
            &["--learning_rate", LR, "--lr_scheduler_type", "constant"],
            &[
                "--max_length",
                "64",
                "--gradient_checkpointing",
                "false",
                "--max_steps",
                "-1",
            ],
            &[
                "--per_device_train_batch_size",
                "4",
                "--per_device_eval_batch_size",
                "3",
            ],
            &[
                "--eval_strategy",
                "epoch",
                "--logging_steps",
                "1",
                "--save_steps",
                "1000",
            ],
            &["--output_dir", out.to_str().unwrap()],
            &flags.iter().map(String::as_str).collect::<Vec<_>>(),
        ]
        .concat();
        let cmd = common::trainer_launch("reward", &["--num_processes", &n], &args);
        let ours = common::metrics(&common::metrics_of(cmd, &out));
        let (theirs, their_eval, stdout) = common::run_trl(
            trl.command_with(
                &start_dir(&out),
                &data,
                &tmp.path().join(format!("trl-{n}")),
                processes,
            )
            .args(["-1", "4", LR, "rows=7", "eval_batch=3"])
            .args(&keys),
        );
        assert_eq!((ours.len(), theirs.len()), (steps, steps), "{stdout}");
        let (worst, key) =
            common::assert_same_figures(&format!("{n} process(es)"), &ours, &theirs, (1e-4, 1e-2));
        let last = ours.last().unwrap();
        let mut checked = 0;
        for (k, v) in their_eval.as_object().unwrap() {
            if !k.starts_with("eval_") || k.ends_with("runtime") || k.ends_with("_second") {
                continue;
            }
            let floor = if k == "eval_mean_reward" { 1.0 } else { 1e-2 };
            let d = common::off(&last[k], v, floor);
            assert!(d < 1e-4, "{n} process(es) {k}: ours {} TRL {v}", last[k]);
            checked += 1;
        }
        assert!(checked >= 7, "{their_eval} vs {last}");
        eprintln!("reward, {n} process(es), partial batches: every figure within {worst:.1e} of TRL's ({key}), {checked} eval figures");
    }
}

/// Under every CPU profile a run equals one process (its evaluation too): two data-parallel
/// ranks of 4 pairs are one process of 8.
#[test]
fn reward_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = rows(tmp.path(), "pairs.jsonl", 16, |_, v| v);
    let one = ["--num_processes", "1"];
    // Evaluation batches of the training batch's size: two ranks' batches of 4 are one
    // round of 8 pairs, whose extremes TRL takes over both.
    let run = |launch: &[&str], per_device: usize, name: &str| {
        let batch = per_device.to_string();
        let eval = [
            "--eval_dataset_name",
            data.to_str().unwrap(),
            "--per_device_eval_batch_size",
            &batch,
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "3",
        ];
        ours(launch, &data, per_device, &eval, &tmp.path().join(name))
    };
    let one8 = run(&one, 8, "one8");
    let one4 = run(&one, 4, "one4");
    assert!(
        one8[STEPS - 1]["eval_accuracy"].as_f64().is_some(),
        "{}",
        one8[STEPS - 1]
    );
    for (name, args, two_dp) in common::CPU_CASES {
        let got = run(args, 4, name);
        let (d, key) = common::assert_same_figures(
            name,
            &got,
            if *two_dp { &one8 } else { &one4 },
            (1e-4, 1e-2),
        );
        eprintln!("reward {name}: every figure within {d:.1e} relative ({key})");
    }
}

/// LoRA adapters (peft's SEQ_CLS: the score head trained whole) under ZeRO-3 and FSDP2 x tp
/// equal one process; the adapter loads in peft onto the classifier the run
/// started from and scores as ours; CAUSAL_LM adapters on a classifier are refused by name.
#[test]
fn lora_reward_models_equal_one_process_and_load_in_peft() {
    let tmp = tempfile::tempdir().unwrap();
    let data = rows(tmp.path(), "pairs.jsonl", 16, |_, v| v);
    let lora = ["--use_peft", "--lora_target_modules", "all-linear"];
    let run = |launch: &[&str], per_device: usize, name: &str| {
        ours(launch, &data, per_device, &lora, &tmp.path().join(name))
    };
    let one = ["--num_processes", "1"];
    let one8 = run(&one, 8, "one8");
    for name in ["zero3_cpu", "fsdp2_tp_cpu"] {
        let got = run(&["--profile", name], 4, name);
        let (d, key) = common::assert_same_figures(name, &got, &one8, (1e-4, 1e-2));
        eprintln!("reward lora {name}: every figure within {d:.1e} relative ({key})");
    }
    let out = tmp.path().join("one8");
    let adapter = trl_runtime::train::checkpoint::resolve(&out, "latest").unwrap();
    let config = std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap();
    assert!(
        config.contains("SEQ_CLS") && config.contains("\"score\""),
        "{config}"
    );
    common::classifier_adapter_loads_in_peft(&start_dir(&out), &adapter);
    // CAUSAL_LM adapters would put LoRA on the new score head and leave it frozen.
    let causal = tmp.path().join("causal");
    let args = [
        &[
            "--dataset_name",
            data.to_str().unwrap(),
            "--lora_task_type",
            "CAUSAL_LM",
        ][..],
        &lora,
        &["--max_steps", "1", "--output_dir", causal.to_str().unwrap()],
    ]
    .concat();
    let o = common::trainer_launch("reward", &one, &args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr).to_string() + &String::from_utf8_lossy(&o.stdout);
    assert!(
        !o.status.success() && text.contains("lora_task_type") && text.contains("SEQ_CLS"),
        "{text}"
    );
}

/// A run resumed from its checkpoint continues as the straight run (the resumed model is
/// the classifier the checkpoint holds).
#[test]
fn a_resumed_reward_run_continues_the_straight_one() {
    let tmp = tempfile::tempdir().unwrap();
    let data = rows(tmp.path(), "pairs.jsonl", 16, |_, v| v);
    let args = [
        "--dataset_name",
        data.to_str().unwrap(),
        "--learning_rate",
        "1e-3",
    ];
    let keys = ["loss", "accuracy", "margin", "mean_reward"];
    common::assert_resume_continues("reward", &["--profile", "multi_cpu"], &args, &keys, 1e-2);
}

/// docs/reward.md's command, as written, from the repository root: it trains a reward model
/// whose checkpoint transformers opens as a sequence classifier with our scores (within
/// 1e-4), and a GRPO run takes that checkpoint as its reward function.
#[test]
fn the_docs_command_trains_a_reward_model_that_drives_grpo() {
    let lines = common::docs_launches("docs/reward.md");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let (dir, m, text) = common::run_docs_command(&lines[0]);
    assert!(m.last().unwrap()["accuracy"].as_f64().is_some(), "{text}");
    let checkpoint = trl_runtime::train::checkpoint::resolve(&dir, "latest").unwrap();
    common::classifier_opens_in_transformers(&checkpoint);
    // The checkpoint as GRPO's reward function: its scores are the rewards.
    let tmp = tempfile::tempdir().unwrap();
    let grpo_out = tmp.path().join("grpo");
    let args = [
        "--reward_funcs",
        checkpoint.to_str().unwrap(),
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
    ];
    let cmd = common::trainer_launch("grpo", &["--num_processes", "1"], &args);
    common::run_launch(cmd, 2, 4, &grpo_out);
    let g = common::metrics(&std::fs::read_to_string(grpo_out.join("metrics.jsonl")).unwrap());
    let name = checkpoint.file_name().unwrap().to_str().unwrap();
    let key = format!("rewards/{name}/mean");
    assert!(
        g[0][&key].as_f64().is_some_and(f64::is_finite),
        "{key}: {}",
        g[0]
    );
    let _ = std::fs::remove_dir_all(dir);
}
