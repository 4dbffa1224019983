//! GRPO through the real `cargo trl launch` and the `grpo` example: under every CPU profile a
//! run equals one process (completions fixed by a rollout program, rewards by their lengths,
//! a KL term, rounds reused; and completions sampled in the training processes, each row
//! drawing by its place in the round): every step's loss and metric within 1e-5 relative,
//! the gradient norm within 1e-5 relative; and the bundled job runs under ZeRO-3.

mod common;

use std::path::Path;

const STEPS: usize = 4;

fn grpo(
    launch_args: &[&str],
    per_device: usize,
    out: &Path,
    rollout: &Path,
) -> Vec<serde_json::Value> {
    grpo_with(launch_args, per_device, out, rollout, &[])
}

fn grpo_with(
    launch_args: &[&str],
    per_device: usize,
    out: &Path,
    rollout: &Path,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    let command = format!("python3 {}", rollout.display());
    let fixed = [
        "--rollout_command",
        &command,
        "--reward_funcs",
        "get_soft_overlong_punishment",
    ];
    grpo_run(launch_args, per_device, out, &[&fixed[..], extra].concat())
}

/// A GRPO run of `STEPS` steps with the tests' settings and `extra` flags; its metrics.
fn grpo_run(
    launch_args: &[&str],
    per_device: usize,
    out: &Path,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    online_run("grpo", launch_args, per_device, out, extra)
}

/// A run of examples binary `bin` (grpo or rloo: the keys below are both trainers') for
/// `STEPS` steps with the tests' settings and `extra` flags; its metrics.
fn online_run(
    bin: &str,
    launch_args: &[&str],
    per_device: usize,
    out: &Path,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    // The untrained tiny model on the 64 bundled prompts, as the rollout programs and
    // tolerances were set on (the bundled job starts from a trained policy).
    let args = [
        "--model_name_or_path",
        "assets/tiny/model",
        "--dataset_name",
        "assets/tiny/data/grpo_train.jsonl",
        "--learning_rate",
        "1e-3",
        "--lr_scheduler_type",
        "constant",
        "--num_generations",
        "4",
        "--max_completion_length",
        "4",
        "--beta",
        "0.04",
        "--num_iterations",
        "2",
        "--shuffle_dataset",
        "false",
    ];
    // An eval step of per_device rows per rank: as many rows as a training micro-batch over
    // the ranks, so layouts of the same global batch evaluate alike.
    let per_eval = per_device.to_string();
    let eval = ["--per_device_eval_batch_size", per_eval.as_str()];
    let all = [&args[..], &eval, extra].concat();
    let cmd = common::trainer_launch(bin, launch_args, &all);
    common::run_launch(cmd, STEPS, per_device, out);
    common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())
}

/// Every figure of `got` within `tolerance` of `want`'s, step by step; the worst.
fn assert_same(
    name: &str,
    got: &[serde_json::Value],
    want: &[serde_json::Value],
    tolerance: f64,
) -> f64 {
    common::assert_same_figures(name, got, want, (tolerance, 1e-3)).0
}

/// LoRA adapters with a KL term: the reference is the base (the adapters at their start),
/// held at the adapters' size; data-parallel and ZeRO-3 runs equal one process.
#[test]
fn grpo_with_adapters_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let rollout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fixed_rollout.py");
    // Dropout masks are drawn per micro-batch: off, as TRL turns them off with disable_dropout.
    let lora = [
        "--use_peft",
        "--lora_target_modules",
        "all-linear",
        "--disable_dropout",
        "true",
    ];
    let one = grpo_with(
        &["--num_processes", "1"],
        8,
        &tmp.path().join("one"),
        &rollout,
        &lora,
    );
    let kl = one[1]["kl"].as_f64().unwrap();
    assert!(
        kl > 0.0,
        "the adapters moved the policy off the base: kl {kl}"
    );
    for (name, args) in [
        ("multi_cpu", ["--profile", "multi_cpu"]),
        ("zero3_cpu", ["--profile", "zero3_cpu"]),
    ] {
        let got = grpo_with(&args, 4, &tmp.path().join(name), &rollout, &lora);
        let worst = assert_same(name, &got, &one, 1e-4);
        eprintln!("grpo + LoRA {name}: every figure within {worst:.1e} relative");
    }
}

#[test]
fn grpo_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let rollout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fixed_rollout.py");
    let one = ["--num_processes", "1"];
    let one8 = grpo(&one, 8, &tmp.path().join("one8"), &rollout);
    let one4 = grpo(&one, 4, &tmp.path().join("one4"), &rollout);
    assert_eq!(one8.len(), STEPS);
    for (name, args, two_dp) in common::CPU_CASES {
        let got = grpo(args, 4, &tmp.path().join(name), &rollout);
        let want = if *two_dp { &one8 } else { &one4 };
        let worst = assert_same(name, &got, want, 1e-5);
        eprintln!("grpo {name}: every figure within {worst:.1e} relative");
    }
}

/// Completions sampled in the training processes (temperature 1.2, nucleus 0.95), scored by
/// a reward program (scripts/parity_reward.py, given as TRL's nargs) and a reward model (each
/// rank holds it whole and scores its own rows); evaluated as well: each row draws from a
/// seed of its place in the round, so every profile samples what one process does, and
/// every figure follows.
#[test]
fn grpo_sampled_in_process_under_every_cpu_profile_equals_one_process() {
    let sampling = ["--temperature", "1.2", "--top_p", "0.95"];
    let one8 = sampled_sweep("grpo", &sampling, 1e-3);
    // The sampled completions earn different rewards: the loss has advantages to weigh.
    let spread = one8[0]["reward_std"].as_f64().unwrap();
    assert!(spread > 0.0, "rewards vary: {}", one8[0]);
    assert!(
        one8[0]["rewards/reward/std"].as_f64().unwrap() > 0.0,
        "{}",
        one8[0]
    );
    // Evaluated after the last step (the default without eval_strategy), 16 held-out
    // prompts x 4 completions: its figures join the last step's line.
    for key in [
        "eval_loss",
        "eval_reward",
        "eval_kl",
        "eval_rewards/reward/mean",
    ] {
        assert!(
            one8[STEPS - 1].get(key).is_some(),
            "{key}: {}",
            one8[STEPS - 1]
        );
    }
}

/// Examples binary `bin` (grpo or rloo) sampling with the `sampling` flags, scored by
/// accuracy_reward, a reward program (scripts/parity_reward.py, given as TRL's nargs) and a
/// reward model, and evaluated: under every CPU profile every figure equals one process's.
/// The one-process run of 8 completions per rank. Figures within 5e-5 relative at a floor of
/// `floor`.
fn sampled_sweep(bin: &str, sampling: &[&str], floor: f64) -> Vec<serde_json::Value> {
    let tmp = tempfile::tempdir().unwrap();
    let rewards = [
        "--reward_funcs",
        "accuracy_reward",
        "python3 scripts/parity_reward.py",
        "assets/tiny-qwen3/reward",
        "--eval_dataset_name",
        "assets/tiny/data/grpo_eval.jsonl",
    ];
    let flags = [sampling, &rewards[..]].concat();
    let run = |args: &[&str], per_device: usize, name: &str| {
        online_run(bin, args, per_device, &tmp.path().join(name), &flags)
    };
    let one = ["--num_processes", "1"];
    let one8 = run(&one, 8, "one8");
    let one4 = run(&one, 4, "one4");
    assert_eq!(one8.len(), STEPS);
    for (name, args, two_dp) in common::CPU_CASES {
        let got = run(args, 4, name);
        let want = if *two_dp { &one8 } else { &one4 };
        // kl (~0.03) is a difference of f32 log-probabilities near -6, whose rounding
        // (~3e-7) is 1e-5 of it: 5e-5 relative.
        let worst = common::assert_same_figures(name, &got, want, (5e-5, floor)).0;
        eprintln!("{bin} sampled {name}: every figure within {worst:.1e} relative");
    }
    one8
}

/// RLOO (TRL's RLOOTrainer on GRPO's rounds) sampled in the training processes, with the
/// KL in the reward (beta 0.04), each round trained once, normalised advantages: every profile
/// equals one process, and the figures RLOO logs are there.
#[test]
fn rloo_sampled_under_every_cpu_profile_equals_one_process() {
    // Each round one micro-batch trained once (TRL's defaults; the tests' runs reuse rounds
    // otherwise): the old log-probabilities come from the training forward.
    let flags = [
        "--temperature",
        "1.2",
        "--normalize_advantages",
        "true",
        "--num_iterations",
        "1",
    ];
    // Its kl is a mean of old - reference near 1e-3 (rounds trained once move the policy
    // little), f32 log-probabilities near -6 whose rounding is ~1e-7 of it: a floor of 1e-2.
    let one8 = sampled_sweep("rloo", &flags, 1e-2);
    for key in ["reward_std", "kl", "clip_ratio/region_mean"] {
        assert!(one8[0].get(key).is_some(), "{key}: {}", one8[0]);
    }
    assert!(
        one8[STEPS - 1].get("eval_reward").is_some(),
        "{}",
        one8[STEPS - 1]
    );
    assert!(one8[0]["reward_std"].as_f64().unwrap() > 0.0, "{}", one8[0]);
}

/// The bundled job (assets/tiny/grpo.yaml) with completions sampled in the training
/// processes, ZeRO-3 on two ranks and a KL term: it logs TRL's figures at every step, its
/// policy moves off the reference (kl > 0 after the first update; a reward program that scores
/// any completion joins accuracy_reward, so every group's rewards differ), and its checkpoint
/// opens in transformers with our logits.
#[test]
fn the_bundled_job_samples_in_process_under_zero3() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = [
        "--beta",
        "0.04",
        "--learning_rate",
        "1e-3",
        "--reward_funcs",
        "accuracy_reward",
        "python3 scripts/parity_reward.py",
    ];
    let cmd = common::trainer_launch("grpo", &["--profile", "zero3_cpu"], &args);
    let text = common::run_launch(cmd, STEPS, 8, &out);
    assert!(
        text.contains("completions sampled in this process"),
        "{text}"
    );
    let m = common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap());
    assert_eq!(m.len(), STEPS, "a line per step: {m:?}");
    for key in [
        "reward",
        "kl",
        "entropy",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "num_tokens",
    ] {
        assert!(m[0][key].as_f64().is_some(), "{key} missing: {}", m[0]);
    }
    let kl = m[STEPS - 1]["kl"].as_f64().unwrap();
    assert!(
        kl > 0.0,
        "the policy moved off the reference: {}",
        m[STEPS - 1]
    );
    let ckpt = out.join(format!("checkpoint-{STEPS}"));
    assert!(ckpt.join("model.safetensors").is_file());
    common::opens_in_transformers(&ckpt);
}

/// docs/grpo.md's and docs/rloo.md's commands, as written, from the repository root (`cargo`
/// finding this `cargo-trl` first on PATH): each logs a reward, and its checkpoint opens in
/// transformers with our logits.
#[test]
fn the_docs_commands_run_as_written() {
    let (mut lines, more) = (
        common::docs_launches("docs/grpo.md"),
        common::docs_launches("docs/rloo.md"),
    );
    assert_eq!((lines.len(), more.len()), (2, 1), "{lines:?} {more:?}");
    lines.extend(more);
    for line in &lines {
        let (dir, m, text) = common::run_docs_command(line);
        assert!(
            m.last().unwrap()["reward"].as_f64().is_some(),
            "{line}: {text}"
        );
        let checkpoint = trl_runtime::train::checkpoint::resolve(&dir, "latest");
        common::opens_in_transformers(&checkpoint.unwrap());
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The README's GRPO command, `cargo run --release -p trl-examples --bin grpo`, as a newcomer
/// runs it (the debug build here): the bundled job (assets/tiny/grpo.yaml) raises the
/// held-out reward of a policy that mostly copies the question's first number by RL alone,
/// accuracy_reward its only signal, and its checkpoint opens in transformers.
#[test]
fn the_readme_grpo_job_raises_the_held_out_reward() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let line = "cargo run --release -p trl-examples --bin grpo";
    assert!(readme.contains(line), "README.md shows `{line}`");
    let grpo = common::build_example("grpo");
    let tmp = tempfile::tempdir().unwrap();
    let o = std::process::Command::new(grpo)
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (before, after) = common::held_out_before_after(&text, "reward");
    assert!(
        before < 20.0 && after > 60.0,
        "{before}% -> {after}%: {text}"
    );
    let checkpoint = tmp.path().join("output/grpo-tiny/checkpoint-800");
    common::opens_in_transformers(&checkpoint);
}
