//! GRPO (train/grpo.rs) through the trainer, with completions fixed by a rollout program
//! (TRL's rollout_func over JSON lines) and rewards fixed by their lengths, a KL term and
//! rounds reused (num_iterations 2): every logged figure equals TRL 1.16's GRPOTrainer's on
//! the same rollouts for 4 steps (grpo, dapo, dr_grpo, bnpo, with the top entropy quantile,
//! GSPO, masked truncation, two-sided clipping and each reward scaling; TRL run when
//! installed, skipped with a message when not), and data parallelism on two in-process ranks
//! equals one process.

mod common;

use std::path::Path;
use trl_runtime::comm::InProcessWorld;
use trl_runtime::config::cli_value::{CliValue, NumberList};
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::dist::{DeviceMesh, DistContext};
use trl_runtime::models::AutoModelForCausalLM;
use trl_runtime::parallel::Strategy;
use trl_runtime::train::args::EntryList;
use trl_runtime::train::{
    EvalResult, GRPOConfig, Grpo, RLOOConfig, Rloo, Task, Trainer, TrainingArguments,
};

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn config(dir: &Path, per_device: usize, loss_type: &str) -> GRPOConfig {
    let script = repo().join("scripts/fixed_rollout.py");
    GRPOConfig {
        training: TrainingArguments {
            model_name_or_path: repo().join("assets/tiny/model"),
            dataset_name: repo().join("assets/tiny/data/grpo_train.jsonl"),
            output_dir: dir.join(format!("out-{per_device}")),
            per_device_train_batch_size: per_device,
            max_steps: 4,
            learning_rate: 1e-3,
            lr_scheduler_type: "constant".into(),
            disable_tqdm: true,
            gradient_checkpointing: false,
            save_strategy: "no".into(),
            ..Default::default()
        },
        reward_funcs: EntryList(vec!["get_soft_overlong_punishment(4, 2)".into()]),
        rollout_command: Some(format!("python3 {}", script.display())),
        num_generations: 4,
        max_completion_length: 4,
        beta: 0.04,
        num_iterations: 2,
        loss_type: loss_type.into(),
        shuffle_dataset: false,
        ..Default::default()
    }
}

type Steps = Vec<(f64, f64, Vec<(&'static str, f64)>)>;

fn run(cfg: &GRPOConfig, ranks: usize) -> Steps {
    run_task::<Grpo>(cfg, ranks)
}

/// `ranks` in-process data-parallel ranks training task `T` for 4 steps: rank 0's (loss,
/// grad norm, metrics) per step.
fn run_task<T: Task<AutoModelForCausalLM>>(cfg: &T::Config, ranks: usize) -> Steps
where
    T::Config: Clone + Send + Sync,
{
    let w = InProcessWorld::new(ranks);
    let dims = ParallelDims {
        dp_replicate: ranks,
        dp_shard: 1,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    let mut out = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let (w, cfg) = (&w, cfg.clone());
                s.spawn(move || {
                    let ctx =
                        DistContext::in_process(w, rank, DeviceMesh::new(dims, ranks).unwrap())
                            .unwrap();
                    let mut t = Trainer::<AutoModelForCausalLM, T>::load_with_strategy(
                        cfg,
                        &ctx,
                        Strategy::Ddp,
                    )
                    .unwrap();
                    (0..4)
                        .map(|_| {
                            let s = t.train_step().unwrap();
                            let mut m = t.last_metrics().to_vec();
                            // The trainer's own count, logged beside the task's figures.
                            m.push(("num_tokens", t.state.num_input_tokens_seen as f64));
                            (s.loss, s.grad_norm, m)
                        })
                        .collect::<Steps>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    out.swap_remove(0)
}

/// The context of a one-process run in `w`.
fn one_rank(w: &InProcessWorld) -> DistContext {
    let dims = ParallelDims {
        dp_replicate: 1,
        dp_shard: 1,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    DistContext::in_process(w, 0, DeviceMesh::new(dims, 1).unwrap()).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs())) || (a.is_nan() && b.is_nan())
}

#[test]
fn data_parallel_grpo_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    for loss_type in ["dapo", "grpo"] {
        let one = run(&config(tmp.path(), 8, loss_type), 1);
        let two = run(&config(tmp.path(), 4, loss_type), 2);
        for (step, ((l1, _, m1), (l2, _, m2))) in one.iter().zip(&two).enumerate() {
            assert!(l1.is_finite(), "{loss_type} step {step}: loss {l1}");
            assert!(
                close(*l1, *l2),
                "{loss_type} step {step}: loss {l1} vs {l2}"
            );
            assert_eq!(
                m1.len(),
                m2.len(),
                "{loss_type} step {step}: {m1:?} vs {m2:?}"
            );
            for ((k1, v1), (k2, v2)) in m1.iter().zip(m2) {
                assert_eq!(k1, k2);
                assert!(
                    close(*v1, *v2),
                    "{loss_type} step {step}: {k1} {v1} vs {v2}"
                );
            }
        }
        // A round is generated every second step (num_iterations 2): its reward metrics are
        // logged then, and the reused round's ratios move off 1.
        let names = |s: usize| one[s].2.iter().map(|(k, _)| *k).collect::<Vec<_>>();
        assert!(
            names(0).contains(&"reward")
                && names(0).contains(&"rewards/soft_overlong_punishment_reward/mean")
        );
        assert!(!names(1).contains(&"reward"), "{:?}", names(1));
        assert!(names(1).contains(&"kl"));
        let kl = one[1].2.iter().find(|(k, _)| *k == "kl").unwrap().1;
        assert!(
            kl > 0.0,
            "the policy moved off the reference after a step: kl {kl}"
        );
    }
}

/// `cfg` with GRPOConfig keys given as TRL's script takes them (`KEY=VALUE`).
fn with_keys(mut cfg: GRPOConfig, keys: &[&str]) -> GRPOConfig {
    for kv in keys {
        let (k, v) = kv.split_once('=').unwrap();
        match k {
            "top_entropy_quantile" => cfg.top_entropy_quantile = v.parse().unwrap(),
            "importance_sampling_level" => cfg.importance_sampling_level = v.into(),
            "mask_truncated_completions" => cfg.mask_truncated_completions = v == "true",
            "delta" => cfg.delta = Some(v.parse().unwrap()),
            "epsilon_high" => cfg.epsilon_high = Some(v.parse().unwrap()),
            "scale_rewards" => cfg.scale_rewards = v.into(),
            "reward_model" => cfg.reward_funcs.0.push(v.into()),
            _ => panic!("with_keys: {k} not handled"),
        }
    }
    cfg
}

/// TRL's GRPOTrainer for 4 steps on the tiny model and prompts with fixed rollouts, beta 0.04
/// and num_iterations 2 (scripts/trl_grpo.py) and `args` (KEY=VALUE): its `n` logged lines
/// whose first key is `first`.
fn trl_logs(
    python: &Path,
    out_dir: &Path,
    args: &[String],
    first: &str,
    n: usize,
) -> Vec<serde_json::Value> {
    let out = common::stdout_of(
        std::process::Command::new(python)
            .arg(repo().join("scripts/trl_grpo.py"))
            .arg(repo().join("assets/tiny/model"))
            .arg(repo().join("assets/tiny/data/grpo_train.jsonl"))
            .arg(out_dir)
            .args(["4", "beta=0.04", "num_iterations=2"])
            .args(args),
    );
    let head = format!("{{\"{first}\"");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .filter(|l| l.starts_with(&head))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), n, "{out}");
    lines
}

/// Our figures for 4 steps equal TRL's GRPOTrainer's on the same prompts, completions and
/// rewards (scripts/trl_grpo.py), within 1e-4 relative: the loss, the gradient norm and every
/// metric TRL logs (clip fractions and lengths are counts: equal up to TRL's float32). The
/// three loss types, then the options that change which tokens count and how: the top
/// entropy quantile, sequence-level importance sampling (GSPO), masked truncated
/// completions, two-sided clipping with an upper epsilon, batch / no reward scaling, and a
/// reward model beside the reward function (a Qwen3ForSequenceClassification checkpoint named
/// by its path, scoring the conversations through its chat template); then TRL's newer loss
/// types, cispo, sapo, luspo and vespo.
#[test]
fn grpo_figures_match_trl() {
    let Some(python) = common::python_with(&["torch", "transformers", "trl"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let reward_model = format!(
        "reward_model={}",
        repo().join("assets/tiny-qwen3/reward").display()
    );
    let cases: &[(&str, &[&str])] = &[
        ("grpo", &[]),
        ("dapo", &[]),
        ("dr_grpo", &[]),
        ("dapo", &["top_entropy_quantile=0.5"]),
        ("grpo", &["importance_sampling_level=sequence"]),
        (
            "dapo",
            &["mask_truncated_completions=true", "scale_rewards=batch"],
        ),
        (
            "bnpo",
            &["delta=1.01", "epsilon_high=0.28", "scale_rewards=none"],
        ),
        ("dapo", &[reward_model.as_str()]),
        // TRL's newer types: cispo's cap (epsilon_high) below most ratios, sapo's
        // gate at its default temperatures, luspo at the sequence level its paper uses,
        // vespo's gamma weights.
        ("cispo", &["epsilon_high=0.9"]),
        ("sapo", &[]),
        ("luspo", &["importance_sampling_level=sequence"]),
        ("vespo", &[]),
    ];
    for (case, (loss_type, keys)) in cases.iter().enumerate() {
        let ours = run(&with_keys(config(tmp.path(), 8, loss_type), keys), 1);
        let mut args = vec![format!("loss_type={loss_type}")];
        args.extend(keys.iter().map(|k| k.to_string()));
        let theirs = trl_logs(
            &python,
            &tmp.path().join(format!("trl-{case}")),
            &args,
            "step",
            4,
        );
        assert_matches_trl(&format!("{loss_type} {keys:?}"), &theirs, &ours);
    }
}

/// Every figure TRL logged (`theirs`, one line per step) equals ours within 1e-4 relative.
fn assert_matches_trl(case: &str, theirs: &[serde_json::Value], ours: &Steps) {
    let mut worst = 0f64;
    for (step, (t, (loss, grad_norm, metrics))) in theirs.iter().zip(ours).enumerate() {
        let mut checked = 0;
        for (key, v) in t.as_object().unwrap() {
            let ours = match key.as_str() {
                "step" | "step_time" | "epoch" | "learning_rate" => continue,
                "loss" => *loss,
                "grad_norm" => *grad_norm,
                k => match metrics.iter().find(|(n, _)| *n == k) {
                    Some((_, v)) => *v,
                    None => panic!("{case} step {step}: TRL logs {k}, we do not: {metrics:?}"),
                },
            };
            let v = v.as_f64().unwrap();
            let off = (ours - v).abs() / v.abs().max(1e-3);
            assert!(off <= 1e-4, "{case} step {step}: {key} ours {ours} TRL {v}");
            worst = worst.max(off);
            checked += 1;
        }
        // At least the loss, the gradient norm, the KL and the entropy (a step that reuses a
        // round logs no reward figures; sapo logs no clip figures).
        assert!(checked >= 4, "{case} step {step}: {t}");
    }
    eprintln!(
        "{case}: every figure within {worst:.1e} relative of TRL's; last step {}",
        theirs[theirs.len() - 1]
    );
}

/// RLOO on GRPO's rounds: the shared keys of the fixed-rollout config, RLOO's defaults else.
fn rloo_config(dir: &Path, per_device: usize) -> RLOOConfig {
    let g = config(dir, per_device, "dapo");
    RLOOConfig {
        training: g.training,
        reward_funcs: g.reward_funcs,
        rollout_command: g.rollout_command,
        num_generations: 4,
        max_completion_length: 4,
        beta: 0.04,
        num_iterations: 2,
        shuffle_dataset: false,
        ..Default::default()
    }
}

/// Our RLOO equals TRL 1.16's RLOOTrainer for 4 steps on the same completions (its
/// generation replaced by the rollout's rule) and rewards: the KL in the reward (beta 0.04)
/// with the round reused (num_iterations 2); normalised advantages with clipped rewards, an
/// upper epsilon and masked truncation; each round trained on once, with and without a
/// reference (the old log-probabilities taken from the training forward here, from one of
/// their own in TRL). Every figure TRL logs within
/// 1e-4 relative. (Rounds over several micro-batches are shuffled by torch's generator in
/// TRL, so the micro-batches differ: not compared.)
#[test]
fn rloo_figures_match_trl() {
    let Some(python) = common::python_with(&["torch", "transformers", "trl"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[&[&str]] = &[
        &[],
        &[
            "normalize_advantages=true",
            "reward_clip_range=-0.8,-0.1",
            "epsilon_high=0.28",
            "mask_truncated_completions=true",
        ],
        &["beta=0", "num_iterations=1"],
        &["num_iterations=1"],
    ];
    for (case, keys) in cases.iter().enumerate() {
        let mut cfg = rloo_config(tmp.path(), 8);
        for kv in keys.iter() {
            let (k, v) = kv.split_once('=').unwrap();
            match k {
                "normalize_advantages" => cfg.normalize_advantages = v == "true",
                "reward_clip_range" => {
                    cfg.reward_clip_range = Some(NumberList::parse_cli(v).unwrap())
                }
                "epsilon_high" => cfg.epsilon_high = Some(v.parse().unwrap()),
                "mask_truncated_completions" => cfg.mask_truncated_completions = v == "true",
                "beta" => cfg.beta = v.parse().unwrap(),
                "num_iterations" => cfg.num_iterations = v.parse().unwrap(),
                _ => panic!("{k} not handled"),
            }
        }
        let ours = run_task::<Rloo>(&cfg, 1);
        let mut args = vec!["trainer=rloo".to_string()];
        args.extend(keys.iter().map(|k| k.to_string()));
        let theirs = trl_logs(
            &python,
            &tmp.path().join(format!("rloo-{case}")),
            &args,
            "step",
            4,
        );
        assert_matches_trl(&format!("rloo {keys:?}"), &theirs, &ours);
    }
}

/// Evaluation equals TRL's at steps 2 and 4 (eval_steps 2) on the same rollouts: two eval
/// steps of 4 completions (per_device_eval_batch_size 4), each step's figures averaged, the
/// loss at ratio 1 with the KL term (beta 0.04), every figure TRL logs within 1e-4 relative.
/// The held-out prompt is one row twice: TRL's eval sampler shuffles with torch's generator.
/// RLOO's evaluation likewise against TRL's RLOOTrainer (the KL in the reward).
#[test]
fn grpo_evaluation_matches_trl() {
    let Some(python) = common::python_with(&["torch", "transformers", "trl"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let eval_rows = tmp.path().join("eval.jsonl");
    let first = std::fs::read_to_string(repo().join("assets/tiny/data/grpo_eval.jsonl")).unwrap();
    let first = first.lines().next().unwrap();
    std::fs::write(&eval_rows, format!("{first}\n{first}\n")).unwrap();
    let mut cfg = config(tmp.path(), 8, "dapo");
    cfg.training.eval_dataset_name = Some(eval_rows.clone());
    cfg.training.per_device_eval_batch_size = 4;
    let mut rloo = rloo_config(tmp.path(), 8);
    rloo.training = cfg.training.clone();
    let ours = evaluations::<Grpo>(cfg);
    let args = [
        "loss_type=dapo".to_string(),
        format!("eval_data={}", eval_rows.display()),
        "eval_strategy=steps".into(),
        "eval_steps=2".into(),
        "per_device_eval_batch_size=4".into(),
    ];
    let theirs = trl_logs(&python, &tmp.path().join("trl"), &args, "eval_step", 2);
    assert_evaluations_match("grpo", &theirs, &ours);
    // RLOO's evaluation: the KL in the reward, the leave-one-out advantages, its loss.
    let ours = evaluations::<Rloo>(rloo);
    let mut args = args[1..].to_vec();
    args.push("trainer=rloo".into());
    let theirs = trl_logs(&python, &tmp.path().join("trl-rloo"), &args, "eval_step", 2);
    assert_evaluations_match("rloo", &theirs, &ours);
}

/// Task `T` trained 4 steps on one process, evaluated after steps 2 and 4.
fn evaluations<T: Task<AutoModelForCausalLM>>(cfg: T::Config) -> Vec<EvalResult> {
    let w = InProcessWorld::new(1);
    let ctx = one_rank(&w);
    let mut t =
        Trainer::<AutoModelForCausalLM, T>::load_with_strategy(cfg, &ctx, Strategy::Ddp).unwrap();
    let mut ours = Vec::new();
    for step in 1..=4 {
        t.train_step().unwrap();
        if step % 2 == 0 {
            ours.push(t.evaluate().unwrap().unwrap());
        }
    }
    ours
}

/// Every eval figure TRL logged (`theirs`) equals ours within 1e-4 relative.
fn assert_evaluations_match(case: &str, theirs: &[serde_json::Value], ours: &[EvalResult]) {
    for (t, e) in theirs.iter().zip(ours) {
        let mut checked = 0;
        for (key, v) in t.as_object().unwrap() {
            let skip = ["eval_step", "epoch", "eval_num_tokens"];
            if skip.contains(&key.as_str())
                || key.ends_with("runtime")
                || key.ends_with("_per_second")
            {
                continue;
            }
            let ours = e
                .metric(key, "eval_reward")
                .unwrap_or_else(|| panic!("{case}: TRL logs {key}, we do not: {e:?}"));
            let v = v.as_f64().unwrap();
            assert!(
                (ours - v).abs() <= 1e-4 * v.abs().max(1e-3),
                "{case} {key}: ours {ours} TRL {v} ({t})"
            );
            checked += 1;
        }
        eprintln!(
            "{case} eval at step {}: {checked} figures equal TRL's: {t}",
            t["eval_step"]
        );
        assert!(checked >= 15, "{t}");
        // GRPO's loss at ratio 1 has its KL term; RLOO's leave-one-out advantages sum to 0.
        assert!(
            case != "grpo" || e.loss != 0.0,
            "the loss at ratio 1 is computed: {e:?}"
        );
    }
}

/// Evaluation as TRL's: each held-out prompt `num_generations_eval` times, sampled, scored,
/// in eval steps of `per_device_eval_batch_size` rows whose figures are averaged. Rows draw
/// by their place, so the means do not depend on the step size, and repeat at the same step.
#[test]
fn evaluation_samples_num_generations_eval_per_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    // A reward program that scores each completion with how many it was handed.
    let count = tmp.path().join("count_reward.py");
    std::fs::write(
        &count,
        "import json, sys\nfor line in sys.stdin:\n    n = len(json.loads(line)[\"completions\"])\n    print(json.dumps([n] * n), flush=True)\n",
    )
    .unwrap();
    let eval = |per_eval: usize| {
        let mut cfg = config(tmp.path(), 8, "dapo");
        cfg.rollout_command = None;
        cfg.num_generations_eval = Some(3);
        cfg.reward_funcs = EntryList(vec![
            "accuracy_reward".into(),
            format!(
                "python3 {}",
                repo().join("scripts/parity_reward.py").display()
            ),
            format!("python3 {}", count.display()),
        ]);
        cfg.training.eval_dataset_name = Some(repo().join("assets/tiny/data/grpo_eval.jsonl"));
        cfg.training.per_device_eval_batch_size = per_eval;
        let w = InProcessWorld::new(1);
        let ctx = one_rank(&w);
        let t = Trainer::<AutoModelForCausalLM, Grpo>::load_with_strategy(cfg, &ctx, Strategy::Ddp)
            .unwrap();
        let first = t.evaluate().unwrap().unwrap();
        let again = t.evaluate().unwrap().unwrap();
        assert_eq!(
            first.figures, again.figures,
            "the same step draws the same rows"
        );
        first
    };
    let six = eval(6);
    let all = eval(48);
    let figure = |e: &EvalResult, k: &str| {
        e.figures
            .iter()
            .find(|(n, _)| *n == k)
            .unwrap_or_else(|| panic!("{k} missing: {:?}", e.figures))
            .1
    };
    // 16 held-out prompts, 3 completions each, in eval steps of per_device_eval_batch_size
    // rows: the counting reward sees each step's.
    assert_eq!(figure(&six, "rewards/count_reward/mean"), 6.0);
    assert_eq!(figure(&all, "rewards/count_reward/mean"), 48.0);
    // Rows draw by their place, not their step: the means over equal steps are the same.
    for k in ["rewards/parity_reward/mean", "completions/mean_length"] {
        let (a, b) = (figure(&six, k), figure(&all, k));
        assert!((a - b).abs() < 1e-9, "{k}: {a} vs {b}");
    }
    let parity = figure(&six, "rewards/parity_reward/mean");
    assert!((0.0..=1.0).contains(&parity) && parity > 0.0, "{parity}");
    assert!(figure(&six, "reward_std") > 0.0);
    assert!((0.0..=1.0).contains(&figure(&six, "frac_reward_zero_std")));
    assert!(six.accuracy.unwrap() > 0.0, "eval_reward: the rewards' sum");
    assert!(
        six.loss.is_finite() && six.loss != 0.0,
        "the loss at ratio 1: {}",
        six.loss
    );
    // Eval steps hold whole groups, as TRL requires.
    let mut cfg = config(tmp.path(), 8, "dapo");
    cfg.num_generations_eval = Some(3);
    cfg.training.eval_dataset_name = Some(repo().join("assets/tiny/data/grpo_eval.jsonl"));
    cfg.training.per_device_eval_batch_size = 5;
    let w = InProcessWorld::new(1);
    let ctx = one_rank(&w);
    let err = Trainer::<AutoModelForCausalLM, Grpo>::load_with_strategy(cfg, &ctx, Strategy::Ddp)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("per_device_eval_batch_size") && err.contains("(3"),
        "{err}"
    );
}

/// TRL's `rollout_func` in Rust: a function registered by name and named by `rollout_func`
/// gives the completions (here each prompt's last token, then EOS), which GRPO trains on.
#[test]
fn a_registered_rollout_function_gives_the_completions() {
    use trl_runtime::train::grpo_rewards::{register_rollout, RolloutAnswer};
    let eos = 2;
    register_rollout("last_token", move |req| {
        // Training rounds: 4 per prompt; held-out rows: num_generations_eval.
        assert!(req.num_generations == 4 || req.num_generations == 2);
        assert_eq!(req.prompts.len() % req.num_generations, 0);
        let completion_ids = req
            .prompt_ids
            .iter()
            .map(|p| vec![*p.last().unwrap(), eos])
            .collect();
        Ok(RolloutAnswer {
            prompt_ids: req.prompt_ids.to_vec(),
            completion_ids,
            logprobs: None,
            extra: Vec::new(),
        })
    });
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(tmp.path(), 8, "dapo");
    cfg.rollout_command = None;
    cfg.rollout_func = Some("last_token".into());
    let steps = run(&cfg, 1);
    let figure = |k: &str| steps[0].2.iter().find(|(n, _)| *n == k).unwrap().1;
    assert_eq!(figure("completions/mean_length"), 2.0);
    assert_eq!(figure("completions/max_length"), 2.0);
    assert_eq!(figure("completions/clipped_ratio"), 0.0);
    // Evaluation asks the rollout too, telling it num_generations_eval.
    let mut eval_cfg = cfg.clone();
    eval_cfg.num_generations_eval = Some(2);
    eval_cfg.training.eval_dataset_name = Some(repo().join("assets/tiny/data/grpo_eval.jsonl"));
    let w = InProcessWorld::new(1);
    let ctx = one_rank(&w);
    let t =
        Trainer::<AutoModelForCausalLM, Grpo>::load_with_strategy(eval_cfg, &ctx, Strategy::Ddp)
            .unwrap();
    let e = t.evaluate().unwrap().unwrap();
    let length = e
        .figures
        .iter()
        .find(|(n, _)| *n == "completions/mean_length");
    assert_eq!(length.map(|f| f.1), Some(2.0), "{e:?}");
    cfg.rollout_func = Some("no_such".into());
    let w = InProcessWorld::new(1);
    let ctx = one_rank(&w);
    let err = Trainer::<AutoModelForCausalLM, Grpo>::load_with_strategy(cfg, &ctx, Strategy::Ddp)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("rollout_func") && err.contains("last_token"),
        "{err}"
    );
}
