//! GRPO through the real `cargo trl launch` and the `grpo` example: under every CPU profile a
//! run equals one process (completions fixed by a rollout program, rewards by their lengths,
//! a KL term, rounds reused): every step's loss and metric within 1e-5 relative, the gradient
//! norm within 1e-5 relative; and the bundled job runs with completions sampled in the
//! training processes under ZeRO-3.

mod common;

use std::path::Path;

const STEPS: usize = 4;

/// Answers each row with the prompt's last 1-4 tokens (by row), EOS after it on even rows.
const ROLLOUT: &str = r#"
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    eos = r["eos_token_id"][0]
    out = []
    for i, p in enumerate(r["prompt_ids"]):
        n = 1 + (p[-1] + i) % 4
        c = p[-n:]
        out.append(c + [eos] if i % 2 == 0 else c)
    print(json.dumps({"prompt_ids": r["prompt_ids"], "completion_ids": out}), flush=True)
"#;

fn grpo(
    launch_args: &[&str],
    per_device: usize,
    out: &Path,
    rollout: &Path,
) -> Vec<serde_json::Value> {
    let command = format!("python3 {}", rollout.display());
    let args = [
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
        "--reward_funcs",
        "get_soft_overlong_punishment",
        "--rollout_command",
        &command,
    ];
    let cmd = common::trainer_launch("grpo", launch_args, &args);
    common::run_launch(cmd, STEPS, per_device, out);
    common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())
}

#[test]
fn grpo_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let rollout = tmp.path().join("rollout.py");
    std::fs::write(&rollout, ROLLOUT).unwrap();
    let one = ["--num_processes", "1"];
    let one8 = grpo(&one, 8, &tmp.path().join("one8"), &rollout);
    let one4 = grpo(&one, 4, &tmp.path().join("one4"), &rollout);
    assert_eq!(one8.len(), STEPS);
    for (name, args, two_dp) in common::CPU_CASES {
        let got = grpo(args, 4, &tmp.path().join(name), &rollout);
        let want = if *two_dp { &one8 } else { &one4 };
        let mut worst = 0f64;
        for (step, (g, w)) in got.iter().zip(want).enumerate() {
            for (key, wv) in w.as_object().unwrap() {
                if [
                    "tokens_per_s",
                    "peak_memory_mib",
                    "predicted_peak_memory_mib",
                    "epoch",
                ]
                .contains(&key.as_str())
                {
                    continue;
                }
                let d = common::off(&g[key], wv, 1e-3);
                assert!(
                    d < 1e-5,
                    "{name} step {}: {key} {} vs {wv}",
                    step + 1,
                    g[key]
                );
                worst = worst.max(d);
            }
        }
        eprintln!("grpo {name}: every figure within {worst:.1e} relative");
    }
}

/// The bundled job (assets/tiny/grpo.yaml) with completions sampled in the training
/// processes, ZeRO-3 on two ranks: it logs TRL's figures and ends with a checkpoint.
#[test]
fn the_bundled_job_samples_in_process_under_zero3() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let cmd = common::trainer_launch("grpo", &["--profile", "zero3_cpu"], &["--beta", "0.04"]);
    let text = common::run_launch(cmd, STEPS, 8, &out);
    assert!(
        text.contains("completions sampled in this process"),
        "{text}"
    );
    let m = common::metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap());
    for key in [
        "reward",
        "kl",
        "entropy",
        "completions/mean_length",
        "clip_ratio/region_mean",
    ] {
        assert!(m[0][key].as_f64().is_some(), "{key} missing: {}", m[0]);
    }
    assert!(out
        .join(format!("checkpoint-{STEPS}/model.safetensors"))
        .is_file());
}
