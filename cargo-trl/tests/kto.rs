//! KTO through the real `cargo trl launch` and the `kto` example: every figure TRL 1.16's
//! KTOTrainer logs equals ours for 4 steps on the same rows (TRL run when installed, skipped
//! with a message when not); under every CPU profile a run equals one process.

mod common;

use std::path::{Path, PathBuf};

const PAIRS: &str = "assets/tiny/data/pref_train.jsonl";
const STEPS: usize = 4;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The first `n` pairs unpaired by hand and interleaved (a desirable row, then its
/// undesirable one), so that every batch holds both labels.
fn interleaved(dir: &Path, n: usize) -> PathBuf {
    let all = std::fs::read_to_string(root().join(PAIRS)).unwrap();
    let mut out = String::new();
    for line in all.lines().take(n) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for (key, label) in [("chosen", true), ("rejected", false)] {
            let row = serde_json::json!({
                "prompt": v["prompt"], "completion": v[key], "label": label,
            });
            out.push_str(&format!("{row}\n"));
        }
    }
    let path = dir.join("unpaired.jsonl");
    std::fs::write(&path, out).unwrap();
    path
}

/// Our run of `STEPS` steps on `rows` with `flags` (KTOConfig's, as TRL's command line
/// takes them) under `launch`; its metrics lines.
fn ours(
    launch: &[&str],
    rows: &Path,
    per_device: usize,
    flags: &[&str],
    out: &Path,
) -> Vec<serde_json::Value> {
    let args = [
        &["--dataset_name", rows.to_str().unwrap()][..],
        &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
        &["--max_length", "64", "--gradient_checkpointing", "false"],
        flags,
    ]
    .concat();
    let cmd = common::trainer_launch("kto", launch, &args);
    common::run_launch(cmd, STEPS, per_device, out);
    common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())
}

/// TRL's KTOTrainer for `STEPS` steps of `per_device` rows (scripts/trl_kto.py) on the first
/// `rows` rows of `data`, with `keys` (KEY=VALUE): each step's logged line, then (with
/// `eval_batch=N` among the keys) its evaluation on the same rows.
fn theirs(
    trl: &common::TrlScript,
    (data, rows): (&Path, usize),
    per_device: usize,
    keys: &[String],
    out: &Path,
) -> (Vec<serde_json::Value>, Option<serde_json::Value>) {
    let (steps, batch) = (STEPS.to_string(), per_device.to_string());
    let mut cmd = trl.command("tiny", data, out, 1);
    cmd.args([steps.as_str(), batch.as_str(), "1e-3"])
        .arg(format!("rows={rows}"))
        .args(keys);
    common::trl_steps(&mut cmd, STEPS)
}

/// Every figure of TRL's lines in ours within 1e-4 relative (at a floor of 2e-2); the worst,
/// and its key.
fn assert_matches(
    case: &str,
    ours: &[serde_json::Value],
    theirs: &[serde_json::Value],
) -> (f64, String) {
    let mut worst = (0f64, String::new());
    for (step, (o, t)) in ours.iter().zip(theirs).enumerate() {
        let mut checked = 0;
        for (key, v) in t.as_object().unwrap() {
            if ["step", "epoch", "learning_rate", "step_time"].contains(&key.as_str()) {
                continue;
            }
            assert!(
                o.get(key).is_some(),
                "{case} step {step}: TRL logs {key}, we do not: {o}"
            );
            // Rewards are beta x differences of f32 log-probability sums near -23, each good
            // to ~1e-5 once a synced reference mixed in f32 is involved (TRL's and ours round
            // the mix apart): 2e-6 absolute at margins near 1e-3, a floor of 2e-2.
            let d = common::off(&o[key], v, 2e-2);
            assert!(
                d < 1e-4,
                "{case} step {step}: {key} ours {} TRL {v}",
                o[key]
            );
            if d >= worst.0 {
                worst = (d, key.clone());
            }
            checked += 1;
        }
        assert!(checked >= 8, "{case} step {step}: {t}");
    }
    worst
}

/// The kto loss on interleaved unpaired rows (its KL from mismatched pairs), the
/// apo_zero_unpaired loss with uneven weights, preference pairs TRL unpairs (each batch's
/// chosen rows, then its rejected ones), and the reference synced with the policy every 2
/// steps (TR-DPO): TRL's figures for 4 steps, every one.
#[test]
fn kto_figures_match_trl() {
    let Some(trl) = common::trl_script("trl_kto.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let unpaired = interleaved(tmp.path(), 16);
    let pairs = common::first_rows(PAIRS, tmp.path(), 8);
    let apo = [
        ("loss_type", "apo_zero_unpaired"),
        ("desirable_weight", "1.33"),
        ("undesirable_weight", "0.8"),
    ];
    type Case<'a> = (&'a str, &'a Path, usize, &'a [(&'a str, &'a str)]);
    let sync = [("sync_ref_model", "true"), ("ref_model_sync_steps", "2")];
    let cases: [Case; 4] = [
        ("kto", &unpaired, 32, &[]),
        ("apo_zero_unpaired", &unpaired, 32, &apo),
        ("kto on pairs", &pairs, 8, &[]),
        ("kto with a synced reference", &unpaired, 32, &sync),
    ];
    for (i, (case, data, rows, settings)) in cases.into_iter().enumerate() {
        let (mut overrides, mut flags) = common::both_ways(settings);
        // The first case evaluates too, on its 32 rows in batches of 4, after the last step.
        if i == 0 {
            overrides.push("eval_batch=4".into());
            let eval = ["--eval_dataset_name", data.to_str().unwrap()];
            flags.extend(eval.iter().map(|s| s.to_string()));
            flags.extend(["--per_device_eval_batch_size".into(), "4".into()]);
        }
        let out = tmp.path().join(format!("trl-{i}"));
        let (want, eval) = theirs(&trl, (data, rows), 4, &overrides, &out);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let got = ours(
            &["--num_processes", "1"],
            data,
            4,
            &flags,
            &tmp.path().join(format!("ours-{i}")),
        );
        let (worst, key) = assert_matches(case, &got, &want);
        eprintln!("kto {case}: every figure TRL logs within {worst:.1e} relative ({key})");
        if let Some(eval) = eval {
            let last = &got[STEPS - 1];
            let mut checked = 0;
            for (key, v) in eval.as_object().unwrap() {
                // eval_num_tokens is TRL's count of training tokens, logged again.
                if !key.starts_with("eval_")
                    || key == "eval_num_tokens"
                    || key.ends_with("runtime")
                    || key.ends_with("_second")
                {
                    continue;
                }
                let d = common::off(&last[key], v, 1e-2);
                assert!(d < 1e-4, "{case} {key}: ours {} TRL {v}", last[key]);
                checked += 1;
            }
            assert!(checked >= 8, "{case}: {eval} vs {last}");
            eprintln!("kto {case}: {checked} eval figures equal TRL's");
        }
    }
}

/// Under every CPU profile a run equals one process: the apo_zero_unpaired loss (a mean over
/// rows, so two ranks of 4 rows equal one of 8), and the kto loss where the data-parallel
/// batch is one rank's (its KL estimate is a mean over a batch, as TRL's); LoRA under ZeRO-3.
#[test]
fn kto_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let unpaired = interleaved(tmp.path(), 32);
    let apo = ["--loss_type", "apo_zero_unpaired"];
    let one = ["--num_processes", "1"];
    let run = |launch: &[&str], per_device: usize, flags: &[&str], name: &str| {
        ours(launch, &unpaired, per_device, flags, &tmp.path().join(name))
    };
    let one8 = run(&one, 8, &apo, "one8");
    let one4 = run(&one, 4, &apo, "one4");
    let one4_kto = run(&one, 4, &[], "one4-kto");
    assert!(one4_kto[0]["kl"].as_f64().is_some(), "{}", one4_kto[0]);
    // Rewards are beta x differences of f32 log-probabilities near -20, whose rounding (~2e-6
    // x beta, more with a vocabulary split over tp) is all there is at margins near 1e-3: 1e-4
    // relative at a floor of 1e-2.
    let compare = |name: &str, got: &[serde_json::Value], want: &[serde_json::Value]| {
        let (d, key) = common::assert_same_figures(name, got, want, (1e-4, 1e-2));
        eprintln!("kto {name}: every figure within {d:.1e} relative ({key})");
    };
    // LoRA adapters: the reference is the base (the adapters start at zero).
    let lora = [
        &apo[..],
        &["--use_peft", "--lora_target_modules", "all-linear"],
    ]
    .concat();
    let one8_lora = run(&one, 8, &lora, "one8-lora");
    let got = run(&["--profile", "zero3_cpu"], 4, &lora, "zero3-lora");
    compare("zero3_cpu lora", &got, &one8_lora);
    for (name, args, two_dp) in common::CPU_CASES {
        let got = run(args, 4, &apo, name);
        compare(name, &got, if *two_dp { &one8 } else { &one4 });
        if !*two_dp {
            let got = run(args, 4, &[], &format!("{name}-kto"));
            compare(&format!("{name} kto"), &got, &one4_kto);
        }
    }
}

/// A KTO run resumed from its checkpoint continues as the straight run: the reference
/// log-probabilities it computed before training are read back (the resumed policy is no
/// longer the reference), so the resumed steps log the same losses and KL.
#[test]
fn a_resumed_run_keeps_its_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let unpaired = interleaved(tmp.path(), 16);
    let args = [
        &["--dataset_name", unpaired.to_str().unwrap()][..],
        &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
    ]
    .concat();
    let keys = ["loss", "kl", "rewards/chosen", "logps/rejected"];
    common::assert_resume_continues("kto", &["--profile", "multi_cpu"], &args, &keys, 1e-2);
}

/// docs/kto.md's command, as written, from the repository root (`cargo` finding this
/// `cargo-trl` first on PATH): it trains, logs KTO's figures, and its checkpoint opens in
/// transformers with our logits.
#[test]
fn the_docs_command_runs_as_written() {
    let lines = common::docs_launches("docs/kto.md");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let (dir, m, text) = common::run_docs_command(&lines[0]);
    assert!(
        m.last().unwrap()["rewards/chosen"].as_f64().is_some(),
        "{text}"
    );
    let checkpoint = trl_runtime::train::checkpoint::resolve(&dir, "latest").unwrap();
    common::opens_in_transformers(&checkpoint);
    let _ = std::fs::remove_dir_all(dir);
}
