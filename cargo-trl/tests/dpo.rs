//! DPO through the real `cargo trl launch` and the `dpo` example: its logged loss and metrics
//! equal TRL 1.16's DPOTrainer's on the same model and pairs (when TRL is installed), and
//! under every CPU profile a run equals one process: every step's loss within 1e-5 and
//! gradient norm within 1e-5 relative (1e-4 for adapters), weights after 5 steps within 2e-4. The weights' bound
//! is wider than SFT's (2e-5): a DPO gradient is the difference of two nearly equal ones
//! (chosen and rejected share their prompt), so many of its elements are rounding-level and
//! Adam, which divides by their size, turns that rounding into steps of up to the learning
//! rate (1e-3 here); the gradient norm (Adam ignores a gradient's scale) is checked apart.

mod common;

use common::{max_diff, metrics, off, run_trl, Run};
use std::path::{Path, PathBuf};
use std::process::Command;

const STEPS: usize = 5;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn dpo(launch_args: &[&str], per_device: usize, out: &Path, extra: &[&str]) -> String {
    let args = [
        &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"][..],
        extra,
    ]
    .concat();
    let cmd = common::trainer_launch("dpo", launch_args, &args);
    common::run_launch(cmd, STEPS, per_device, out)
}

#[test]
fn dpo_under_every_cpu_profile_equals_one_process() {
    profiles_equal_one_process(&[], None);
}

/// DPO on a mixture of experts (Qwen3-MoE) with the router's load-balancing loss added to the
/// policy's (weighted 0.1): one pair per micro-batch, so that a rank's micro-batches are some
/// of one process's (the router loss is per micro-batch, TRL's average, not a sum over rows).
#[test]
fn dpo_on_a_mixture_of_experts_under_split_profiles_equals_one_process() {
    mixture_of_experts_equals_one_process(
        "qwen3-moe",
        &[],
        &[
            "zero3_cpu",
            "fsdp2_tp_cpu",
            "context_parallel_cpu",
            "alst_ulysses_cpu",
        ],
    );
}

/// [`profiles_equal_one_process`] on assets/tiny-`kind` with `extra` flags, the router loss
/// weighted 0.1 and one pair per micro-batch.
fn mixture_of_experts_equals_one_process(kind: &str, extra: &[&str], cases: &[&str]) {
    let model = root().join(format!("assets/tiny-{kind}/model"));
    let model = ["--model_name_or_path", model.to_str().unwrap()];
    let router = ["--router_aux_loss_coef", "0.1", MICRO_BATCH_PER_PAIR];
    profiles_equal_one_process(&[&model[..], extra, &router[..]].concat(), Some(cases));
}

/// DPO with LoRA on gpt-oss's experts and router as parameters (peft's target_parameters, the
/// gpt-oss recipe's adapters): the reference is the policy without its adapters; under ZeRO-3
/// (base experts sharded in their units, adapters whole) and FSDP2 x tp (each expert adapter's
/// half along the split features cut) the adapters equal one process's.
#[test]
fn dpo_with_adapters_on_gpt_oss_parameters_equals_one_process() {
    mixture_of_experts_equals_one_process(
        "gpt-oss",
        &[
            "--use_peft",
            "--lora_target_parameters",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "mlp.router.weight",
            "--lora_dropout",
            "0",
        ],
        &["zero3_cpu", "fsdp2_tp_cpu"],
    );
}

/// In `profiles_equal_one_process`'s extra flags: one pair per micro-batch, the rows of a
/// step accumulated.
const MICRO_BATCH_PER_PAIR: &str = "MICRO_BATCH_PER_PAIR";

/// WPO (`--use_weighting`): each token's log sum p^2 from the tiled head (one process), the
/// vocabulary-parallel logits (tp: maxima and sums all-reduced), whole logits (ZeRO-3) and
/// sequences split over ranks (Ulysses, ring: sums joined before the weights).
#[test]
fn wpo_weights_under_split_profiles_equal_one_process() {
    profiles_equal_one_process(
        &["--use_weighting", "true"],
        Some(&[
            "zero3_cpu",
            "tp_cpu",
            "fsdp2_tp_cpu",
            "alst_ulysses_cpu",
            "context_parallel_cpu",
        ]),
    );
}

/// TR-DPO (`--sync_ref_model`): the reference's own weights, held as each strategy holds the
/// policy's (whole, ZeRO-2's gathered parameters, ZeRO-3 / FSDP units, tp slices), mixed after
/// steps 2 and 4 and swapped in for the reference's forward of steps 3 and 5. The synced run
/// equals plain DPO until the first mix and parts from it after (so the sync ran).
#[test]
fn synced_reference_under_split_profiles_equals_one_process() {
    let synced = profiles_equal_one_process(
        &[
            "--sync_ref_model",
            "true",
            "--ref_model_sync_steps",
            "2",
            "--ref_model_mixup_alpha",
            "0.5",
        ],
        // One case per way of holding the weights (all nine pass; these keep CI short).
        Some(&[
            "multi_cpu",
            "zero2_cpu",
            "zero3_cpu",
            "fsdp2_tp_cpu",
            "context_parallel_cpu",
            "alst_ulysses_cpu",
        ]),
    );
    let tmp = tempfile::tempdir().unwrap();
    dpo(&["--num_processes", "1"], 8, tmp.path(), &[]);
    let plain = Run::read(tmp.path(), STEPS).losses;
    for step in 0..STEPS {
        let d = (synced[step] - plain[step]).abs();
        match step < 2 {
            true => assert!(d < 1e-9, "step {}: synced {d:e} off before a mix", step + 1),
            false => assert!(
                d > 1e-4,
                "step {}: the mixed reference changed nothing ({d:e})",
                step + 1
            ),
        }
    }
}

/// DPO with `extra` flags under the CPU cases (`only` those named) equals one process; the
/// one-process run's losses (8 rows per step).
fn profiles_equal_one_process(extra: &[&str], only: Option<&[&str]>) -> Vec<f64> {
    let tmp = tempfile::tempdir().unwrap();
    let out = |name: &str| tmp.path().join(name);
    let one = ["--num_processes", "1"];
    let per_pair = extra.contains(&MICRO_BATCH_PER_PAIR);
    let extra: Vec<&str> = extra
        .iter()
        .copied()
        .filter(|a| *a != MICRO_BATCH_PER_PAIR)
        .collect();
    // `rows` pairs per rank per step: one micro-batch of them, or one micro-batch per pair.
    let dpo = |launch_args: &[&str], rows: usize, out: &Path, extra: &[&str]| {
        let steps = rows.to_string();
        match per_pair {
            true => {
                let ga = ["--gradient_accumulation_steps", steps.as_str()];
                dpo(launch_args, 1, out, &[extra, &ga[..]].concat())
            }
            false => dpo(launch_args, rows, out, extra),
        }
    };
    let extra = &extra[..];
    // A LoRA run's checkpoint holds its adapters (peft's names).
    let lora = extra.contains(&"--use_peft");
    // An adapter's gradient is a small part of a MoE layer's: the 2-rank sum's rounding shows
    // in its norm at about 1e-5 relative (1.07e-5 measured under ZeRO-3).
    let norm_tolerance = if lora { 1e-4 } else { 1e-5 };
    let read = |out: &Path| match lora {
        true => Run::read_adapter(out, STEPS),
        false => Run::read(out, STEPS),
    };
    dpo(&one, 8, &out("one8"), extra);
    dpo(&one, 4, &out("one4"), extra);
    let (one8, one4) = (read(&out("one8")), read(&out("one4")));
    // Adapters start with B at zero: every one of them trained.
    for (param, b) in one8.weights.iter().filter(|(n, _)| n.contains("lora_B")) {
        let moved = max_diff(b, &b.zeros_like().unwrap());
        assert!(moved > 1e-4, "{param} did not move ({moved})");
    }
    // The policy moved away from the reference.
    assert!(
        one8.losses[STEPS - 1] < one8.losses[0] - 1e-3,
        "{:?}",
        one8.losses
    );
    for (name, args, two_dp) in common::CPU_CASES {
        if only.is_some_and(|o| !o.contains(name)) {
            continue;
        }
        dpo(args, 4, &out(name), extra);
        let want = if *two_dp { "one8" } else { "one4" };
        let (got, one) = (read(&out(name)), if *two_dp { &one8 } else { &one4 });
        let (g, w) = (grad_norms(&out(name)), grad_norms(&out(want)));
        let mut worst = [0f64; 3];
        for step in 0..STEPS {
            let dl = (got.losses[step] - one.losses[step]).abs();
            let dg = (g[step] - w[step]).abs() / w[step];
            assert!(dl < 1e-5, "{name} step {}: loss {dl:e} off", step + 1);
            assert!(
                dg < norm_tolerance,
                "{name} step {}: grad_norm {dg:e} off",
                step + 1
            );
            worst = [worst[0].max(dl), worst[1].max(dg), worst[2]];
        }
        // TRL's token figures are per micro-batch over every rank: one pair per micro-batch
        // on two data-parallel ranks makes micro-batches of two pairs, one process's of one.
        if !(per_pair && *two_dp) {
            for key in ["entropy", "mean_token_accuracy"] {
                for (step, (g, w)) in logged(&out(name), key)
                    .iter()
                    .zip(logged(&out(want), key))
                    .enumerate()
                {
                    let d = (g - w).abs() / w.abs().max(1e-3);
                    assert!(d < 1e-5, "{name} step {}: {key} {g} vs {w}", step + 1);
                }
            }
        }
        for (param, w) in &one.weights {
            let d = max_diff(&got.weights[param], w) as f64;
            assert!(d < 2e-4, "{name}: {param} differs by {d}");
            worst[2] = worst[2].max(d);
        }
        eprintln!(
            "dpo {name}: losses within {:.1e}, gradient norms {:.1e} relative, weights {:.1e}",
            worst[0], worst[1], worst[2]
        );
    }
    one8.losses
}

fn grad_norms(out: &Path) -> Vec<f64> {
    logged(out, "grad_norm")
}

/// Each logged step's `key`.
fn logged(out: &Path, key: &str) -> Vec<f64> {
    metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())
        .iter()
        .map(|m| m[key].as_f64().unwrap())
        .collect()
}

/// The bundled preference pairs.
const PAIRS: &str = "assets/tiny/data/pref_train.jsonl";

/// A Python with TRL (None: the test skips), a temporary directory and the first 8
/// preference pairs in it.
fn trl_and_eight_pairs() -> Option<(std::path::PathBuf, tempfile::TempDir, std::path::PathBuf)> {
    let python = common::python_with(&["torch", "transformers", "trl", "datasets"])?;
    let tmp = tempfile::tempdir().unwrap();
    let pairs = common::first_rows(PAIRS, tmp.path(), 8);
    Some((python, tmp, pairs))
}

/// Evaluation after three steps on the same 8 pairs in batches of 4: the loss and every
/// eval_rewards / eval_logps / eval_logits figure TRL's DPOTrainer.evaluate gives, within 1e-4
/// relative (the mean logits averaged over the batches, as TRL averages them).
#[test]
fn dpo_evaluation_matches_trl() {
    let Some((python, tmp, pairs)) = trl_and_eight_pairs() else {
        return;
    };
    let model = root().join("assets/tiny/model");
    let o = Command::new(&python)
        .arg(root().join("scripts/trl_dpo.py"))
        .arg(&model)
        .arg(&pairs)
        .arg(tmp.path().join("trl"))
        .args(["3", "8", "1e-3", "sigmoid", "eval_batch=4"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let theirs: serde_json::Value = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("eval").cloned())
        .expect("TRL's evaluation");
    let out = tmp.path().join("ours");
    let p = pairs.to_str().unwrap();
    let cmd = common::trainer_launch(
        "dpo",
        &["--num_processes", "1"],
        &[
            "--dataset_name",
            p,
            "--eval_dataset_name",
            p,
            "--model_name_or_path",
            model.to_str().unwrap(),
            "--learning_rate",
            "1e-3",
            "--lr_scheduler_type",
            "constant",
            "--max_length",
            "64",
            "--gradient_checkpointing",
            "false",
            "--loss_type",
            "sigmoid",
            "--max_steps",
            "3",
            "--seed",
            "7",
            "--per_device_train_batch_size",
            "8",
            "--per_device_eval_batch_size",
            "4",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "3",
            "--save_steps",
            "1000",
            "--output_dir",
            out.to_str().unwrap(),
        ],
    );
    let text = common::metrics_of(cmd, &out);
    let ours: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let mut compared = 0;
    for (key, want) in theirs.as_object().unwrap() {
        let figure = [
            "eval_loss",
            "eval_rewards/",
            "eval_logps/",
            "eval_logits/",
            "eval_entropy",
            "eval_mean_token_accuracy",
        ];
        if !figure.iter().any(|f| key.starts_with(f)) {
            continue;
        }
        let (g, w) = (
            ours[key].as_f64().unwrap_or(f64::NAN),
            want.as_f64().unwrap(),
        );
        let floor = if key.contains("logits") { 1e-2 } else { 1e-3 };
        let d = (g - w).abs() / w.abs().max(floor);
        assert!(d < 1e-4, "{key}: {g} vs TRL's {w}");
        compared += 1;
    }
    assert_eq!(compared, 11, "{theirs}");
}

/// TRL's DPO figures of a step and an evaluation, besides the loss.
const FIGURES: &[&str] = &[
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
];

/// Seven pairs in stored order, an epoch in micro-batches of 4, then an evaluation of the
/// seven in batches of 3, dealt as accelerate deals them: one process (the step's second
/// micro-batch of 3 pairs, the evaluation's last batch of 1) and two (torchrun: one step,
/// rank 1's batch ending with the first pair again; the evaluation's second round filled from
/// the start, its refill cut from the loss and the token figures by `gather_for_metrics` but
/// kept in the rewards and log-probs, which TRL gathers whole). Two processes again on a
/// mixture of experts: each batch's router loss added to its loss, and `eval_aux_loss` the
/// mean over each round's kept ranks. Every step's figures and the evaluation's equal TRL's
/// DPOTrainer's within 1e-4 relative (when TRL is installed).
#[test]
fn partial_batches_match_trl() {
    let Some(trl) = common::trl_script("trl_dpo.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let pairs = common::first_rows(PAIRS, tmp.path(), 7);
    let p = pairs.to_str().unwrap();
    let shared = [
        ("num_train_epochs", "1"),
        ("train_sampling_strategy", "sequential"),
        ("dataloader_drop_last", "false"),
    ];
    for (processes, steps, model) in [(1, 2, "tiny"), (2, 1, "tiny"), (2, 1, "tiny-qwen3-moe")] {
        let moe = model.contains("moe");
        let router = [("router_aux_loss_coef", "0.1")];
        let shared = [&shared[..], if moe { &router } else { &[] }].concat();
        let (overrides, flags) = common::both_ways(&shared);
        let (theirs, their_eval, stdout) = run_trl(
            trl.command(model, &pairs, &tmp.path().join("trl"), processes)
                .args(["-1", "4", "1e-3", "sigmoid", "rows=7", "eval_batch=3"])
                .args(&overrides),
        );
        let out = tmp.path().join(format!("ours-{processes}-{model}"));
        let n = processes.to_string();
        let cmd = common::trainer_launch(
            "dpo",
            &["--num_processes", &n],
            &[
                &["--dataset_name", p, "--eval_dataset_name", p][..],
                &["--model_name_or_path"],
                &[common::model_dir(model).to_str().unwrap()],
                &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
                &["--max_length", "64", "--gradient_checkpointing", "false"],
                &["--loss_type", "sigmoid", "--seed", "0"],
                &["--per_device_train_batch_size", "4"],
                &[
                    "--per_device_eval_batch_size",
                    "3",
                    "--eval_strategy",
                    "epoch",
                ],
                &["--logging_steps", "1", "--save_steps", "1000"],
                &["--output_dir", out.to_str().unwrap()],
                &flags.iter().map(String::as_str).collect::<Vec<_>>(),
            ]
            .concat(),
        );
        let ours = metrics(&common::metrics_of(cmd, &out));
        assert_eq!((ours.len(), theirs.len()), (steps, steps), "{stdout}");
        let step_keys = ["grad_norm", "num_tokens", "learning_rate", "epoch"]
            .into_iter()
            .chain(["loss"])
            .chain(FIGURES.iter().copied())
            .chain(moe.then_some("aux_loss"))
            .map(String::from);
        let step_pairs = ours
            .iter()
            .zip(&theirs)
            .enumerate()
            .flat_map(|(i, (a, b))| {
                step_keys
                    .clone()
                    .map(move |k| (format!("step {} {k}", i + 1), &a[&k], &b[&k]))
            });
        let our_eval = ours.last().unwrap();
        let aux = moe.then_some("aux_loss");
        let eval_pairs = ["loss"].iter().chain(FIGURES).chain(&aux).map(|k| {
            let k = format!("eval_{k}");
            (k.clone(), &our_eval[&k], &their_eval[&k])
        });
        let mut worst = 0f64;
        for (what, a, b) in step_pairs.chain(eval_pairs) {
            // Mean logits (~1e-3) and rewards (beta x differences of f32 log-probs of ~25,
            // which TRL rounds at ~1e-6) are compared at their inputs' scale.
            let floor = match what.contains("logits") || what.contains("rewards") {
                true => 1e-2,
                false => 1e-3,
            };
            let d = off(a, b, floor);
            assert!(
                d < 1e-4,
                "{processes} process(es), {model}, {what}: {a} vs TRL's {b}"
            );
            worst = worst.max(d);
        }
        eprintln!(
            "{processes} process(es), {model}, partial batches: every figure within {worst:.1e} of TRL's"
        );
    }
}

/// Three steps of whole-dataset batches (8 pairs, AdamW, constant learning rate, fp32): the
/// logged loss, gradient norm, input tokens, rewards, log-probs and mean logits equal TRL's
/// within 1e-4 relative, for the default loss (also logged once for the three steps: their
/// means), IPO, a weighted list with RPO's SFT term, every other loss
/// type summed in one list, TR-DPO's synced reference, and EXO with LD-DPO and an
/// f-divergence.
#[test]
fn dpo_matches_trl() {
    let Some((python, tmp, pairs)) = trl_and_eight_pairs() else {
        return;
    };
    // Loss types, then other DPOConfig keys as KEY=VALUE.
    let runs: &[&[&str]] = &[
        &["sigmoid"],
        // One line for the three steps: every figure their mean, as TRL logs them.
        &["sigmoid", "logging_steps=3"],
        &["ipo"],
        &["sigmoid", "sft"],
        // WPO: each pair weighed by its sequences' probabilities (log sum p^2 per token).
        &["sigmoid", "ipo", "use_weighting=true"],
        &[
            "hinge",
            "nca_pair",
            "robust",
            "bco_pair",
            "sppo_hard",
            "aot",
            "aot_unpaired",
            "apo_zero",
            "apo_down",
            "discopop",
            "sigmoid_norm",
            "label_smoothing=0.1",
        ],
        // TR-DPO: the reference mixed with the policy after every step.
        &[
            "sigmoid",
            "sync_ref_model=true",
            "ref_model_sync_steps=1",
            "ref_model_mixup_alpha=0.5",
        ],
        &[
            "exo_pair",
            "label_smoothing=0.001",
            "ld_alpha=0.5",
            "f_divergence_type=js_divergence",
        ],
        // A mixture of experts: the router's load-balancing loss added to the policy's.
        &[
            "sigmoid",
            "model:tiny-qwen3-moe",
            "router_aux_loss_coef=0.1",
        ],
    ];
    for run in runs {
        let model = run
            .iter()
            .find_map(|a| a.strip_prefix("model:"))
            .unwrap_or("tiny");
        let model = root().join(format!("assets/{model}/model"));
        let run: Vec<&str> = run
            .iter()
            .copied()
            .filter(|a| !a.starts_with("model:"))
            .collect();
        let losses: Vec<&str> = run.iter().copied().filter(|a| !a.contains('=')).collect();
        let logging: usize = run
            .iter()
            .find_map(|a| a.strip_prefix("logging_steps="))
            .map_or(1, |n| n.parse().unwrap());
        let keys: Vec<String> = run
            .iter()
            .filter(|a| !a.starts_with("logging_steps="))
            .filter_map(|a| a.split_once('='))
            .flat_map(|(k, v)| [format!("--{k}"), v.to_string()])
            .collect();
        let out = tmp.path().join(run.join("-").replace('=', "_"));
        let o = Command::new(&python)
            .arg(root().join("scripts/trl_dpo.py"))
            .arg(&model)
            .arg(&pairs)
            .arg(tmp.path().join("trl"))
            .args(["3", "8", "1e-3"])
            .args(&run)
            .output()
            .unwrap();
        let theirs = metrics(&String::from_utf8_lossy(&o.stdout));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let cmd = common::trainer_launch(
            "dpo",
            &["--num_processes", "1"],
            &[
                &["--dataset_name", pairs.to_str().unwrap()][..],
                &["--model_name_or_path", model.to_str().unwrap()],
                &["--learning_rate", "1e-3", "--lr_scheduler_type", "constant"],
                &["--max_length", "64", "--gradient_checkpointing", "false"],
                &["--loss_type"][..],
                &losses,
                &keys.iter().map(String::as_str).collect::<Vec<_>>(),
            ]
            .concat(),
        );
        common::run_launch_logging(cmd, 3, 8, logging, &out);
        let ours = metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap());
        let lines = 3 / logging;
        assert_eq!((ours.len(), theirs.len()), (lines, lines), "{run:?}");
        let mut worst = 0f64;
        for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            let aux = b.get("aux_loss").map(|_| "aux_loss");
            let keys = ["loss", "grad_norm", "num_tokens"].into_iter();
            for key in keys.chain(FIGURES.iter().copied()).chain(aux) {
                let (g, w) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
                // `logits/*` average logits of ~0.1 over the vocabulary to ~1e-3, where f32's
                // rounding of two steps' weights moves them by ~1e-7: compared at the logits'
                // scale, not their mean's.
                let floor = if key.starts_with("logits/") {
                    1e-2
                } else {
                    1e-3
                };
                let d = (g - w).abs() / w.abs().max(floor);
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

/// What TR-DPO cannot do is refused with the key named, as TRL refuses it: a LoRA run (its
/// reference is the base with adapters off), precomputed reference log-probabilities (they
/// would go stale), no steps between syncs, an alpha outside [0, 1].
#[test]
fn synced_reference_refusals_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    for (extra, names) in [
        (&["--use_peft", "true"][..], "use_peft"),
        (
            &["--precompute_ref_log_probs", "true"],
            "precompute_ref_log_probs",
        ),
        (&["--ref_model_sync_steps", "0"], "ref_model_sync_steps"),
        (&["--ref_model_mixup_alpha", "1.5"], "ref_model_mixup_alpha"),
    ] {
        let err = refused(
            &[extra, &["--output_dir"]].concat(),
            &tmp.path().join(names),
        );
        assert!(err.contains(names), "{extra:?}: {err}");
    }
}

/// A TR-DPO run stopped after a mix resumes where it was: each rank's share of the mixed
/// reference is kept beside the checkpoint (`ref_model/checkpoint-N/rank-R.safetensors`), so
/// the resumed steps and weights equal the straight run's (ZeRO-3: the shares are unit
/// slices). Resuming under another layout is refused with the key named.
#[test]
fn a_synced_reference_resumes_from_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (straight, resumed) = (tmp.path().join("straight"), tmp.path().join("resumed"));
    let zero3 = ["--profile", "zero3_cpu"];
    let sync = [
        "--sync_ref_model",
        "true",
        "--ref_model_sync_steps",
        "2",
        "--learning_rate",
        "1e-3",
        "--lr_scheduler_type",
        "constant",
    ];
    let run = |steps: usize, out: &Path, extra: &[&str]| {
        let cmd = common::trainer_launch("dpo", &zero3, &[&sync[..], extra].concat());
        common::run_launch(cmd, steps, 4, out)
    };
    run(STEPS, &straight, &[]);
    run(3, &resumed, &[]);
    assert!(resumed
        .join("ref_model/checkpoint-3/rank-1.safetensors")
        .exists());
    let text = run(STEPS, &resumed, &["--resume_from_checkpoint", "latest"]);
    assert!(text.contains("checkpoint-3"), "{text}");
    let (a, b) = (Run::read(&straight, STEPS), Run::read(&resumed, STEPS));
    let losses = |out: &Path| -> Vec<f64> {
        metrics(&std::fs::read_to_string(out.join("metrics.jsonl")).unwrap())
            .iter()
            .map(|m| m["loss"].as_f64().unwrap())
            .collect()
    };
    let (la, lb) = (losses(&straight), losses(&resumed));
    // The resumed run's log holds steps 1-3, then 4-5 again from the checkpoint.
    for (x, y) in la[3..].iter().zip(&lb[lb.len() - 2..]) {
        assert!((x - y).abs() < 1e-6, "resumed loss {y} vs {x}");
    }
    for (name, w) in &a.weights {
        let d = max_diff(&b.weights[name], w);
        assert!(d < 1e-5, "{name}: resumed differs by {d}");
    }
    // One process cannot take two ranks' shares.
    let mut cmd = common::trainer_launch(
        "dpo",
        &["--num_processes", "1"],
        &[
            &sync[..],
            &["--resume_from_checkpoint", "latest", "--max_steps", "6"],
        ]
        .concat(),
    );
    let o = cmd.arg("--output_dir").arg(&resumed).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success() && err.contains("sync_ref_model"),
        "{err}"
    );
}

/// A `dpo` launch with `--sync_ref_model true` and `args` (ending in `--output_dir`) into
/// `out`, which must fail: its error output.
fn refused(args: &[&str], out: &Path) -> String {
    let mut cmd = common::trainer_launch(
        "dpo",
        &["--num_processes", "1"],
        &[&["--sync_ref_model", "true", "--max_steps", "2"][..], args].concat(),
    );
    let o = cmd.arg(out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "{args:?} was accepted: {err}");
    err
}
