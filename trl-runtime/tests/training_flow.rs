//! When the trainer logs, evaluates and saves (`train::flow`): the same steps as transformers'
//! DefaultFlowCallback for the same strategies, and the settings transformers refuses refused.

mod common;

use trl_runtime::train::TrainingArguments;

/// The strategies' cases: arguments, total steps, steps per epoch.
fn cases() -> Vec<(serde_json::Value, usize, usize)> {
    use serde_json::json;
    vec![
        (
            json!({"logging_steps": 3, "eval_strategy": "steps", "eval_steps": 4, "save_strategy": "steps", "save_steps": 5}),
            13,
            5,
        ),
        (
            json!({"logging_strategy": "epoch", "eval_strategy": "epoch", "save_strategy": "epoch"}),
            12,
            5,
        ),
        (
            json!({"logging_strategy": "no", "logging_first_step": true, "logging_steps": 4, "eval_strategy": "steps", "save_strategy": "no"}),
            10,
            4,
        ),
        (
            json!({"logging_steps": 5, "eval_strategy": "steps", "eval_steps": 2, "eval_delay": 5, "save_strategy": "epoch"}),
            11,
            3,
        ),
        (
            json!({"eval_strategy": "epoch", "eval_delay": 1.5, "save_steps": 4, "logging_first_step": true}),
            9,
            2,
        ),
        (
            json!({"eval_strategy": "no", "save_steps": 3, "logging_steps": 2}),
            9,
            9,
        ),
        (json!({"save_steps": 4, "logging_steps": 10}), 10, 3),
        (
            json!({"eval_strategy": "steps", "eval_steps": 3, "save_strategy": "best", "logging_steps": 1}),
            7,
            7,
        ),
        (
            json!({"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 4, "load_best_model_at_end": true, "metric_for_best_model": "loss"}),
            9,
            4,
        ),
        // Fractions of the run (rounded up), evaluation falling back to logging's.
        (
            json!({"logging_steps": 0.25, "eval_strategy": "steps", "eval_steps": 0.3, "save_steps": 0.5}),
            13,
            5,
        ),
        (
            json!({"logging_steps": 0.2, "eval_strategy": "steps", "save_steps": 0.4, "load_best_model_at_end": true}),
            10,
            10,
        ),
    ]
}

/// Steps at which our flow logs, evaluates and saves.
fn ours(args: &serde_json::Value, total: usize, per_epoch: usize) -> [Vec<usize>; 3] {
    let mut args: TrainingArguments = serde_json::from_value(args.clone()).unwrap();
    args.eval_dataset_name = Some("eval.jsonl".into());
    let flow = args
        .flow(&["eval_loss", "eval_accuracy"], "test", Some(total))
        .unwrap();
    let mut out: [Vec<usize>; 3] = Default::default();
    for step in 1..=total {
        let epoch = step as f64 / per_epoch as f64;
        let due = flow.due(step, total, epoch, step.is_multiple_of(per_epoch));
        for (list, on) in out.iter_mut().zip([due.log, due.evaluate, due.save]) {
            if on {
                list.push(step);
            }
        }
    }
    out
}

/// Every case against transformers 5's TrainingArguments (its defaults and checks) and
/// DefaultFlowCallback, called as its training loop calls it: on_step_end after every step,
/// on_epoch_end after an epoch's last step and after the step that stops training. Ours also
/// logs the last step (transformers logs its end-of-training summary there) unless logging
/// is off, and without eval_strategy evaluates after it. Skipped with a message without
/// transformers.
#[test]
fn log_eval_and_save_steps_equal_transformers_default_flow() {
    let Some(python) = common::python_with(&["torch", "transformers"]) else {
        return;
    };
    let cases = cases();
    let spec = serde_json::to_string(
        &cases
            .iter()
            .map(|(a, t, e)| serde_json::json!([a, t, e]))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let script = format!(
        "import json, tempfile\n\
         from transformers import TrainingArguments\n\
         from transformers.trainer_callback import DefaultFlowCallback, TrainerState, TrainerControl\n\
         out = []\n\
         for kw, total, per_epoch in json.loads({spec:?}):\n\
         \x20   args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to='none', max_steps=total, **kw)\n\
         \x20   state = TrainerState(); state.max_steps = total\n\
         \x20   state.compute_steps(args, total)\n\
         \x20   cb = DefaultFlowCallback(); got = [[], [], []]\n\
         \x20   for step in range(1, total + 1):\n\
         \x20       state.global_step = step; state.epoch = step / per_epoch\n\
         \x20       c = cb.on_step_end(args, state, TrainerControl())\n\
         \x20       flags = [c.should_log, c.should_evaluate, c.should_save]\n\
         \x20       if step % per_epoch == 0 or c.should_training_stop:\n\
         \x20           e = cb.on_epoch_end(args, state, TrainerControl())\n\
         \x20           flags = [a or b for a, b in zip(flags, [e.should_log, e.should_evaluate, e.should_save])]\n\
         \x20       for g, f in zip(got, flags):\n\
         \x20           if f: g.append(step)\n\
         \x20   out.append(got)\n\
         print(json.dumps(out))\n"
    );
    let o = std::process::Command::new(&python)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let theirs: Vec<[Vec<usize>; 3]> = serde_json::from_slice(&o.stdout).unwrap();
    for ((args, total, per_epoch), mut expected) in cases.into_iter().zip(theirs) {
        if args["logging_strategy"] != "no" && !expected[0].contains(&total) {
            expected[0].push(total);
        }
        // Without eval_strategy (transformers: no), ours evaluates after the last step.
        if args.get("eval_strategy").is_none() {
            expected[1].push(total);
        }
        assert_eq!(
            ours(&args, total, per_epoch),
            expected,
            "{args} ({total} steps, {per_epoch} per epoch): log, evaluate, save"
        );
    }
}

/// What transformers refuses is refused, naming the key; its defaults are applied.
#[test]
fn strategies_are_checked_and_defaulted_as_transformers_does() {
    let flow = |json: serde_json::Value| {
        let mut args: TrainingArguments = serde_json::from_value(json).unwrap();
        if args.eval_dataset_name.is_none() {
            args.eval_dataset_name = Some("eval.jsonl".into());
        }
        args.flow(&["eval_loss", "eval_accuracy"], "cfg.yaml", None)
            .map_err(|e| e.to_string())
    };
    use serde_json::json;
    let refused = |json: serde_json::Value, words: &[&str]| {
        let e = flow(json.clone()).unwrap_err();
        for w in words {
            assert!(e.contains(w), "{json}: {e}");
        }
    };
    refused(
        json!({"save_strategy": "sometimes"}),
        &["cfg.yaml", "save_strategy", "best"],
    );
    refused(
        json!({"eval_strategy": "best"}),
        &["eval_strategy", "no, steps or epoch"],
    );
    refused(json!({"logging_strategy": "always"}), &["logging_strategy"]);
    refused(
        json!({"load_best_model_at_end": true, "eval_strategy": "epoch"}),
        &[
            "load_best_model_at_end",
            "eval_strategy epoch and save_strategy steps",
        ],
    );
    refused(
        json!({"load_best_model_at_end": true, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 4}),
        &["load_best_model_at_end", "multiple"],
    );
    refused(
        json!({"load_best_model_at_end": true, "eval_strategy": "steps", "eval_steps": 0.1, "save_steps": 4}),
        &["load_best_model_at_end", "fraction"],
    );
    refused(
        json!({"load_best_model_at_end": true, "eval_strategy": "steps", "eval_steps": 0.2, "save_steps": 0.3}),
        &["load_best_model_at_end", "not a multiple"],
    );
    refused(
        json!({"metric_for_best_model": "bleu", "eval_strategy": "steps"}),
        &[
            "metric_for_best_model",
            "eval_bleu",
            "eval_loss, eval_accuracy",
        ],
    );
    refused(
        json!({"save_strategy": "best", "eval_strategy": "no"}),
        &["save_strategy", "does not evaluate"],
    );
    let mut no_data = TrainingArguments {
        eval_strategy: Some("steps".into()),
        ..Default::default()
    };
    no_data.eval_dataset_name = None;
    let e = no_data
        .flow(&["eval_loss", "eval_accuracy"], "cfg.yaml", None)
        .unwrap_err();
    assert!(e.to_string().contains("eval_dataset_name"), "{e}");

    // Defaults: steps evaluation every logging_steps; the best metric loss, lower is better
    // (an accuracy higher); save_strategy best over the default metric.
    let f = flow(json!({"eval_strategy": "steps", "logging_steps": 7})).unwrap();
    assert_eq!(f.eval, trl_runtime::train::flow::Interval::Steps(7));
    // Fractions of a 13-step run, rounded up as TrainerState.compute_steps rounds them (this
    // runs without Python; the comparison with transformers above covers more).
    let args: TrainingArguments = serde_json::from_value(
        json!({"logging_steps": 0.25, "eval_strategy": "steps", "eval_steps": 0.3, "save_steps": 0.5, "eval_dataset_name": "eval.jsonl"}),
    )
    .unwrap();
    let f = args.flow(&["eval_loss"], "cfg.yaml", Some(13)).unwrap();
    use trl_runtime::train::flow::Interval::Steps;
    assert_eq!((f.logging, f.eval, f.save), (Steps(4), Steps(4), Steps(7)));
    assert!(f.best.is_none() && !f.eval_on_start);
    let f = flow(json!({"eval_strategy": "steps", "save_strategy": "best"})).unwrap();
    let best = f.best.unwrap();
    assert_eq!(
        (best.key.as_str(), best.greater_is_better),
        ("eval_loss", false)
    );
    let f = flow(json!({"eval_strategy": "epoch", "metric_for_best_model": "accuracy"})).unwrap();
    assert!(f.best.unwrap().greater_is_better);
    // DPO's figures, by TRL's names (its accuracy is rewards/accuracies; a margin is better
    // higher, a loss lower).
    use trl_runtime::train::{DPOConfig, TrainerConfig};
    for (metric, greater) in [
        ("rewards/accuracies", true),
        ("eval_rewards/margins", true),
        ("loss", false),
    ] {
        let args: TrainingArguments = serde_json::from_value(
            json!({"eval_strategy": "steps", "eval_dataset_name": "e.jsonl", "metric_for_best_model": metric}),
        )
        .unwrap();
        let best = args
            .flow(DPOConfig::EVAL_METRICS, "dpo.yaml", None)
            .unwrap()
            .best
            .unwrap();
        assert_eq!(best.greater_is_better, greater, "{metric}");
        assert!(best.key.starts_with("eval_"));
    }
    // Our default without eval_strategy: before, every eval_steps, and after the last step.
    let f = flow(json!({})).unwrap();
    assert!(f.eval_on_start && f.eval_after_last);
    assert!(f.due(5, 5, 1.0, true).evaluate);
}
