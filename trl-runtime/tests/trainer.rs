//! The trainer's numbers: data parallelism and gradient accumulation change nothing (DDP 2 x 2
//! == 1 x 4 == 1 x 2 accumulation x 2, losses and weights after 5 steps), and a resumed run
//! continues exactly like the uninterrupted one.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use trl_runtime::comm::{Communicator, InProcessWorld};
use trl_runtime::config::parallelism::ParallelDims;
use trl_runtime::dist::{DeviceMesh, DistContext};
use trl_runtime::nn::AttentionImpl;
use trl_runtime::parallel::{WrapPolicy, ZeroStage};
use trl_runtime::train::{
    CheckpointFormat, Optimizer, SFTConfig, Strategy, Trainer, TrainerConfig,
};

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny")
}

fn config(out: &Path, batch: usize, accumulation: usize, steps: i64) -> SFTConfig {
    SFTConfig {
        training: trl_runtime::train::TrainingArguments {
            model_name_or_path: assets().join("model"),
            dataset_name: assets().join("data/train.jsonl"),
            output_dir: out.to_path_buf(),
            per_device_train_batch_size: batch,
            gradient_accumulation_steps: accumulation,
            learning_rate: 3e-3,
            lr_scheduler_type: "cosine".into(),
            warmup_steps: 2.0,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            max_steps: steps,
            max_length: 64,
            logging_steps: 1.0,
            save_steps: 3.0,
            disable_tqdm: true,
            // The plain run each strategy is compared with; checkpointing has its own test.
            gradient_checkpointing: false,
            ..Default::default()
        },
        assistant_only_loss: true,
        ..SFTConfig::default()
    }
}

/// Losses of every step and the final weights (by name) of a run on `world` in-process ranks.
fn run(world: usize, cfg: SFTConfig) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
    run_with(world, cfg, Strategy::Ddp)
}

/// DDP replicates over `world` ranks; sharding strategies shard over all of them.
fn run_with(
    world: usize,
    cfg: SFTConfig,
    strategy: Strategy,
) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
    let (replicate, shard) = match strategy {
        Strategy::Ddp => (world, 1),
        _ => (1, world),
    };
    run_mesh(replicate, shard, cfg, strategy)
}

fn run_mesh(
    dp_replicate: usize,
    dp_shard: usize,
    cfg: SFTConfig,
    strategy: Strategy,
) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
    run_saving(
        dp_replicate,
        dp_shard,
        cfg,
        strategy,
        CheckpointFormat::Full,
    )
}

fn run_saving(
    dp_replicate: usize,
    dp_shard: usize,
    cfg: SFTConfig,
    strategy: Strategy,
    format: CheckpointFormat,
) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
    run_dims(dims(dp_replicate, dp_shard, 1), cfg, strategy, format)
}

fn dims(dp_replicate: usize, dp_shard: usize, tp: usize) -> ParallelDims {
    ParallelDims {
        dp_replicate,
        dp_shard,
        cp: 1,
        sp: 1,
        tp,
    }
}

fn run_dims(
    dims: ParallelDims,
    cfg: SFTConfig,
    strategy: Strategy,
    format: CheckpointFormat,
) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
    let world = dims.dp_replicate * dims.dp_shard * dims.cp * dims.sp * dims.tp;
    let w = InProcessWorld::new(world);
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (w, cfg) = (&w, cfg.clone());
                s.spawn(move || {
                    let ctx =
                        DistContext::in_process(w, rank, DeviceMesh::new(dims, world).unwrap())
                            .unwrap();
                    let attention =
                        AttentionImpl::parse(&cfg.training.attn_implementation).unwrap();
                    let (tiled_loss, tiled_mlp) =
                        (cfg.training.use_liger_kernel, cfg.training.tiled_mlp);
                    let checkpointing = cfg.training.gradient_checkpointing;
                    let mut trainer = Trainer::with_strategy(cfg, &ctx, strategy).unwrap();
                    // The model really is split as the mesh says (an unsplit run on the same
                    // ranks would compute the same numbers), and runs as configured.
                    let model = &trainer.model;
                    let size = |g: Option<&Arc<dyn Communicator>>| g.map_or(1, |g| g.size());
                    assert_eq!(size(model.tp()), dims.tp, "tensor-parallel split");
                    assert_eq!(size(model.sp()), dims.sp, "sequence-parallel split");
                    assert_eq!(size(model.cp()), dims.cp, "context-parallel split");
                    if dims.tp > 1 && model.sharding.is_none() {
                        assert!(model.params.num_elements() < model.num_parameters());
                    }
                    assert_eq!(model.attention, attention);
                    assert_eq!((model.tiled_loss, model.tiled_mlp), (tiled_loss, tiled_mlp));
                    assert_eq!(model.checkpointing.is_some(), checkpointing);
                    trainer.checkpoint_format = format;
                    let outcome = trainer.train().unwrap();
                    // Checkpointing really ran: every layer of every step was recomputed.
                    if let Some(c) = &trainer.model.checkpointing {
                        let layers = trainer.model.config.num_hidden_layers();
                        assert!(
                            c.recomputed() >= layers * outcome.losses.len(),
                            "{}",
                            c.recomputed()
                        );
                    }
                    let weights: Vec<(String, Vec<f32>)> = trainer
                        .gather_weights()
                        .unwrap()
                        .into_iter()
                        .map(|(n, t)| {
                            let t = t.to_dtype(candle_core::DType::F32).unwrap();
                            (n, t.flatten_all().unwrap().to_vec1().unwrap())
                        })
                        .collect();
                    (outcome.losses, weights)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Every rank ends with the same weights.
    for r in &results[1..] {
        assert_eq!(r.1, results[0].1, "ranks disagree on the weights");
    }
    results.into_iter().next().unwrap()
}

fn assert_close(
    a: &(Vec<f64>, Vec<(String, Vec<f32>)>),
    b: &(Vec<f64>, Vec<(String, Vec<f32>)>),
    what: &str,
) {
    assert_eq!(a.0.len(), b.0.len());
    for (i, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1e-3),
            "{what}: step {} loss {x} vs {y}",
            i + 1
        );
    }
    let mut worst = 0f32;
    for ((n, x), (_, y)) in a.1.iter().zip(&b.1) {
        // The key bias gets a gradient that is exactly zero in exact arithmetic (a shift of all
        // scores of a row leaves the softmax unchanged), so AdamW's m / sqrt(v) turns rounding
        // noise into full-size updates: it cannot match to 1e-5 and is only bounded.
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let diff = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        if n.ends_with("k_proj.bias") {
            // Still bounded by AdamW's step size: lr x steps.
            assert!(diff <= 2.0 * 3e-3 * 5.0, "{what}: {n} moved by {diff}");
            continue;
        }
        worst = worst.max(diff / scale);
        assert!(
            diff <= 1e-5 * scale,
            "{what}: weights of {n} differ by {diff} (scale {scale})"
        );
    }
    eprintln!("{what}: worst relative weight difference {worst:e}");
}

#[test]
fn data_parallel_and_accumulation_match_one_big_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let big = run(1, config(&tmp.path().join("a"), 4, 1, 5));
    let ddp = run(2, config(&tmp.path().join("b"), 2, 1, 5));
    let accum = run(1, config(&tmp.path().join("c"), 2, 2, 5));
    assert!(big.0[4] < big.0[0], "the loss goes down: {:?}", big.0);
    assert_close(&ddp, &big, "2 ranks x batch 2 vs 1 x 4");
    assert_close(&accum, &big, "1 rank x 2 accumulation x batch 2 vs 1 x 4");
    let ddp_accum = run(2, config(&tmp.path().join("d"), 1, 2, 5));
    assert_close(
        &ddp_accum,
        &big,
        "2 ranks x 2 accumulation x batch 1 vs 1 x 4",
    );
}

/// Why a one-rank trainer refuses `cfg` at load.
fn refused(cfg: SFTConfig) -> String {
    let w = InProcessWorld::new(1);
    let ctx = DistContext::in_process(&w, 0, DeviceMesh::new(dims(1, 1, 1), 1).unwrap()).unwrap();
    match Trainer::new(cfg, &ctx) {
        Ok(_) => panic!("the trainer loaded"),
        Err(e) => e.to_string(),
    }
}

/// TRL's dataset_text_field, given on the command line as with `trl sft`: rows whose text is
/// in another column train exactly like the same rows under `text`, and a row without that
/// column is an error naming the file, the line and the setting.
#[test]
fn dataset_text_field_names_the_text_column() {
    use trl_runtime::train::SftCli;
    let tmp = tempfile::tempdir().unwrap();
    let sums: Vec<String> = (0..24)
        .map(|i| format!("What is {i} + {}? {}", 2 * i, 3 * i))
        .collect();
    let write = |name: &str, row: &dyn Fn(&str) -> serde_json::Value| {
        let path = tmp.path().join(name);
        let lines: Vec<String> = sums.iter().map(|t| row(t).to_string()).collect();
        std::fs::write(&path, lines.join("\n")).unwrap();
        path
    };
    let plain = write("text.jsonl", &|t| serde_json::json!({ "text": t }));
    // Another string column beside it, as a dataset with several text columns has.
    let body = write(
        "body.jsonl",
        &|t| serde_json::json!({ "body": t, "title": "sums" }),
    );
    let with = |data: &Path, out: &str, field: &[&str]| {
        let args = ["sft", "--dataset_name", data.to_str().unwrap()];
        let cli = SftCli::parse_trl_from(args.iter().chain(field).map(|s| s.to_string()));
        let mut cfg = config(&tmp.path().join(out), 4, 1, 3);
        cfg.assistant_only_loss = false;
        cli.apply(&mut cfg).map(|_ignored| cfg)
    };
    let want = run(1, with(&plain, "a", &[]).unwrap());
    let got = run(
        1,
        with(&body, "b", &["--dataset_text_field", "body"]).unwrap(),
    );
    assert_eq!(want.0.len(), 3, "three steps: {:?}", want.0);
    assert_eq!(got.0, want.0, "losses");
    assert_eq!(got.1, want.1, "weights");

    let e = refused(with(&plain, "c", &["--dataset_text_field", "body"]).unwrap());
    assert!(
        e.contains("text.jsonl") && e.contains("line 1") && e.contains("body (dataset_text_field)"),
        "{e}"
    );
}

/// TRL's eos_token and chat_template_path, as `trl sft` flags: the run renders its rows with
/// the template and the token, its checkpoints carry both (transformers loads the tokenizer
/// that was trained with), and a template path that is neither a file nor a directory is
/// refused naming the setting.
#[test]
fn eos_token_and_chat_template_path_reach_training_and_checkpoints() {
    use trl_runtime::train::SftCli;
    let tmp = tempfile::tempdir().unwrap();
    let template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}\
                    {% endfor %}";
    let jinja = tmp.path().join("plain.jinja");
    std::fs::write(&jinja, template).unwrap();
    let with = |out: &str, flags: &[&str]| {
        let args = ["sft"].iter().chain(flags).map(|s| s.to_string());
        let mut cfg = config(&tmp.path().join(out), 4, 1, 3);
        cfg.assistant_only_loss = false;
        SftCli::parse_trl_from(args).apply(&mut cfg).unwrap();
        cfg
    };
    let plain = run(1, with("a", &[]));
    let flags = [
        "--eos_token",
        "<|endoftext|>",
        "--chat_template_path",
        jinja.to_str().unwrap(),
    ];
    let changed = run(1, with("b", &flags));
    assert_eq!(changed.0.len(), 3);
    assert_ne!(changed.0[0], plain.0[0], "the rows were rendered as before");
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("b/checkpoint-3/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (cfg["chat_template"].as_str(), cfg["eos_token"].as_str()),
        (Some(template), Some("<|endoftext|>"))
    );
    // config.json's eos id follows, as TRL mirrors it into the model's config.
    let tok =
        trl_runtime::data::TextTokenizer::from_dir(tmp.path().join("b/checkpoint-3")).unwrap();
    let model: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("b/checkpoint-3/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        model["eos_token_id"].as_u64(),
        tok.eos_token_id.map(u64::from)
    );
    assert_eq!(tok.eos_token.as_deref(), Some("<|endoftext|>"));

    let e = refused(with("c", &["--chat_template_path", "org/some-model"]));
    assert!(
        e.contains("chat_template_path") && e.contains("org/some-model"),
        "{e}"
    );
}

/// A recipe's `lr_scheduler_type: cosine_with_min_lr` with `lr_scheduler_kwargs` (a YAML
/// mapping, or JSON on the command line as with `trl sft`) sets the rate of every step: the
/// logged rates follow the schedule down to its floor, not to zero.
#[test]
fn lr_scheduler_kwargs_shape_the_logged_rates() {
    use trl_runtime::train::{SftCli, TrainerConfig};
    let tmp = tempfile::tempdir().unwrap();
    let yaml = tmp.path().join("recipe.yaml");
    std::fs::write(
        &yaml,
        "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs:\n  min_lr_rate: 0.1\n",
    )
    .unwrap();
    let (from_file, _) = SFTConfig::read(&yaml).unwrap();
    let mut cfg = config(&tmp.path().join("a"), 4, 1, 6);
    let flags = [
        "sft",
        "--lr_scheduler_type",
        "cosine_with_min_lr",
        "--lr_scheduler_kwargs",
        r#"{"min_lr_rate": 0.1}"#,
    ];
    SftCli::parse_trl_from(flags.iter().map(|s| s.to_string()))
        .apply(&mut cfg)
        .unwrap();
    assert_eq!(
        cfg.training.lr_scheduler_kwargs,
        from_file.training.lr_scheduler_kwargs
    );
    run(1, cfg.clone());
    let metrics = std::fs::read_to_string(tmp.path().join("a/metrics.jsonl")).unwrap();
    let logged: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|m| m["learning_rate"].as_f64())
        .collect();
    let schedule = cfg.training.schedule(6).unwrap();
    let want: Vec<f64> = (0..6).map(|step| schedule.lr(step)).collect();
    assert_eq!(logged.len(), 6, "{metrics}");
    for (got, want) in logged.iter().zip(&want) {
        assert!(
            (got - want).abs() <= 1e-12 * want.abs().max(1e-12),
            "{logged:?} vs {want:?}"
        );
    }
    // Warmup 2 of 6 steps, then cosine from 3e-3 down to its floor of 3e-4 (min_lr_rate
    // 0.1): at the last step, 3/4 of the way, 0.1 + 0.9 x (1 + cos(3 pi / 4)) / 2 of the
    // rate (without the floor it would be 0.146 of it).
    let floored = 0.1 + 0.9 * 0.5 * (1.0 + (0.75 * std::f64::consts::PI).cos());
    assert!(
        (logged[5] - 3e-3 * floored).abs() <= 1e-12 * logged[5],
        "{logged:?}"
    );
}

/// NEFTune (`--neftune_noise_alpha`, transformers' hook on the input embeddings): the noise
/// is uniform within alpha / sqrt(seq x hidden), the same for the same key on every device
/// path, and only in training forwards; it changes the training losses, and tensor-parallel
/// ranks (which hold the same rows) add the same noise, so tp 2 still equals one process.
#[test]
fn neftune_noise_is_bounded_keyed_and_the_same_across_tp_ranks() {
    use trl_runtime::kernels::fused::add_uniform_noise;
    use trl_runtime::nn::embedding::with_neftune;
    use trl_runtime::nn::Embedding;
    let cpu = candle_core::Device::Cpu;
    let zeros = candle_core::Tensor::zeros((2, 64, 8), candle_core::DType::F32, &cpu).unwrap();
    let noise = |seed| {
        add_uniform_noise(&zeros, seed, 0.5)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let a = noise(7);
    let mean = a.iter().sum::<f32>() / a.len() as f32;
    let var = a.iter().map(|v| v * v).sum::<f32>() / a.len() as f32;
    assert!(a.iter().all(|v| v.abs() <= 0.5), "within the bound");
    // Uniform on [-0.5, 0.5): mean 0, variance 1/12 (1,024 draws).
    assert!(
        mean.abs() < 0.05 && (var - 1.0 / 12.0).abs() < 0.015,
        "{mean} {var}"
    );
    assert_eq!(a, noise(7));
    assert_ne!(a, noise(8));

    // Through an embedding: only inside a training forward, scaled by seq x hidden.
    let table = candle_core::Tensor::zeros((10, 8), candle_core::DType::F32, &cpu).unwrap();
    let embed = Embedding::new(table, 8);
    let ids = candle_core::Tensor::zeros((2, 64), candle_core::DType::U32, &cpu).unwrap();
    assert_eq!(common::max_abs(&embed.forward(&ids).unwrap()), 0.0);
    let noisy = with_neftune(Some((5.0, 3)), || embed.forward(&ids)).unwrap();
    let largest = common::max_abs(&noisy);
    let bound = 5.0 / (64.0f64 * 8.0).sqrt();
    assert!(
        largest > 0.5 * bound && largest <= bound,
        "{largest} vs {bound}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let with_alpha = |out: &str, alpha: Option<f64>| {
        let mut cfg = config(&tmp.path().join(out), 4, 1, 3);
        cfg.training.neftune_noise_alpha = alpha;
        cfg
    };
    let plain = run(1, with_alpha("a", None));
    let noisy = run(1, with_alpha("b", Some(5.0)));
    assert_ne!(
        plain.0[0], noisy.0[0],
        "the noise reaches the training forward"
    );
    let tp = run_dims(
        dims(1, 1, 2),
        with_alpha("c", Some(5.0)),
        Strategy::Ddp,
        CheckpointFormat::Full,
    );
    assert_close(&tp, &noisy, "NEFTune under tp 2 vs one process");
}

#[test]
fn resume_continues_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let full_dir = tmp.path().join("full");
    let full = run(2, config(&full_dir, 2, 1, 6));
    // checkpoint-3 was written on the way; resume a fresh run from it.
    let mut cfg = config(&full_dir, 2, 1, 6);
    cfg.training.resume_from_checkpoint = Some(full_dir.join("checkpoint-3").display().to_string());
    cfg.training.output_dir = tmp.path().join("resumed");
    let resumed = run(2, cfg);
    assert_eq!(resumed.0.len(), 3, "steps 4..6 only");
    for (i, (x, y)) in resumed.0.iter().zip(&full.0[3..]).enumerate() {
        assert_eq!(x, y, "step {} after resume", i + 4);
    }
    assert_eq!(resumed.1, full.1, "final weights after resume");
    // `latest` finds the newest complete checkpoint.
    let latest = trl_runtime::train::checkpoint::resolve(&full_dir, "latest").unwrap();
    assert!(latest.ends_with("checkpoint-6"), "{}", latest.display());
    // So does a bare `--resume_from_checkpoint` (the flag's value is then `true`).
    let cli = <trl_runtime::train::SftCli as clap::Parser>::try_parse_from([
        "sft",
        "--resume_from_checkpoint",
    ])
    .unwrap();
    let mut bare = config(&full_dir, 2, 1, 6);
    cli.args.apply(&mut bare);
    let spec = bare.training.resume_from_checkpoint.unwrap();
    let found = trl_runtime::train::checkpoint::resolve(&full_dir, &spec).unwrap();
    assert_eq!(found, latest);
}

#[test]
fn save_total_limit_keeps_the_newest() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(tmp.path(), 4, 1, 6);
    cfg.training.save_steps = 1.0;
    cfg.training.save_total_limit = Some(2);
    run(1, cfg);
    let kept: Vec<usize> = trl_runtime::train::checkpoint::list(tmp.path())
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(kept, vec![5, 6]);
    // No temporary directories are left behind.
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
}

#[test]
fn zero_stages_match_ddp() {
    let tmp = tempfile::tempdir().unwrap();
    let ddp = run(1, config(&tmp.path().join("ddp"), 4, 1, 5));
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let z = Strategy::Zero(stage);
        let two = run_with(
            2,
            config(&tmp.path().join(format!("z{}a", stage.number())), 2, 1, 5),
            z,
        );
        assert_close(
            &two,
            &ddp,
            &format!("zero{} 2 ranks x batch 2 vs DDP 1 x 4", stage.number()),
        );
        // With gradient accumulation, on 4 ranks (uneven flat shards: padding in the last one).
        let four = run_with(
            4,
            config(&tmp.path().join(format!("z{}b", stage.number())), 1, 1, 5),
            z,
        );
        assert_close(
            &four,
            &ddp,
            &format!("zero{} 4 ranks x batch 1 vs DDP", stage.number()),
        );
        let accum = run_with(
            2,
            config(&tmp.path().join(format!("z{}c", stage.number())), 1, 2, 5),
            z,
        );
        assert_close(
            &accum,
            &ddp,
            &format!(
                "zero{} 2 ranks x 2 accumulation x batch 1 vs DDP",
                stage.number()
            ),
        );
    }
}

#[test]
fn zero3_matches_ddp() {
    let tmp = tempfile::tempdir().unwrap();
    let ddp = run(1, config(&tmp.path().join("ddp"), 4, 1, 5));
    let per_layer = Strategy::fsdp(WrapPolicy::PerLayer);
    let cases = [
        ("2 ranks x batch 2", 2, 2, 1, per_layer),
        ("4 ranks x batch 1", 4, 1, 1, per_layer),
        ("2 ranks x 2 accumulation x batch 1", 2, 1, 2, per_layer),
        // Two layers per unit (the tiny model's layers are ~40k parameters each).
        (
            "SIZE_BASED_WRAP, 2 ranks",
            2,
            2,
            1,
            Strategy::fsdp(WrapPolicy::MinParams(50_000)),
        ),
        (
            "NO_WRAP, 2 ranks",
            2,
            2,
            1,
            Strategy::fsdp(WrapPolicy::Whole),
        ),
    ];
    for (i, (what, world, batch, accumulation, strategy)) in cases.into_iter().enumerate() {
        let cfg = config(&tmp.path().join(format!("z3-{i}")), batch, accumulation, 5);
        let got = run_with(world, cfg, strategy);
        assert_close(&got, &ddp, &format!("zero3 {what} vs DDP 1 x 4"));
    }
}

#[test]
fn hsdp_matches_ddp() {
    // dp_replicate 2 x dp_shard 2: shards within pairs, gradient slices summed across them.
    let tmp = tempfile::tempdir().unwrap();
    let ddp = run(1, config(&tmp.path().join("ddp"), 4, 1, 5));
    for (name, strategy) in [
        ("HYBRID_SHARD", Strategy::fsdp(WrapPolicy::PerLayer)),
        ("HYBRID_SHARD_ZERO2", Strategy::Zero(ZeroStage::Two)),
    ] {
        let got = run_mesh(2, 2, config(&tmp.path().join(name), 1, 1, 5), strategy);
        assert_close(&got, &ddp, &format!("{name} 2 x 2 vs DDP 1 x 4"));
    }
}

#[test]
fn zero_checkpoint_resumes_on_another_world_size_and_strategy() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("z4");
    // 4 ranks of ZeRO-2 write checkpoint-3 (state gathered per parameter) ...
    let full = run_with(4, config(&dir, 1, 1, 6), Strategy::Zero(ZeroStage::Two));
    // ... which 2 ranks of ZeRO-1 and 1 rank of DDP continue exactly.
    for (world, batch, strategy) in [
        (2, 2, Strategy::Zero(ZeroStage::One)),
        (1, 4, Strategy::Ddp),
    ] {
        let mut cfg = config(&dir, batch, 1, 6);
        cfg.training.resume_from_checkpoint = Some(dir.join("checkpoint-3").display().to_string());
        cfg.training.output_dir = tmp.path().join(format!("resumed-{world}"));
        let resumed = run_with(world, cfg, strategy);
        assert_close(
            &(resumed.0.clone(), resumed.1.clone()),
            &(full.0[3..].to_vec(), full.1.clone()),
            &format!("resume on {world} rank(s)"),
        );
    }
    // The checkpoint is a plain HF model for the loader.
    trl_runtime::parallel::CausalLm::from_pretrained(
        dir.join("checkpoint-6"),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
}

#[test]
fn sharded_checkpoints_reshard_across_world_sizes_and_strategies() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("z3");
    let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
    // 4 ranks of ZeRO-3 write checkpoint-3 as SHARDED_STATE_DICT (one file per rank) ...
    let full = run_saving(
        1,
        4,
        config(&dir, 1, 1, 6),
        zero3,
        CheckpointFormat::Sharded,
    );
    let ckpt = dir.join("checkpoint-3");
    assert!(ckpt
        .join("sharded/shard-00003-of-00004.safetensors")
        .exists());
    assert!(!ckpt.join("model.safetensors").exists(), "nothing gathered");
    // ... which 2 ranks of ZeRO-3 (resharding 4 -> 2), 2 of ZeRO-2 with a different layout,
    // and 1 rank of DDP (reassembling everything) continue exactly.
    for (world, batch, strategy) in [
        (2, 2, zero3),
        (2, 2, Strategy::Zero(ZeroStage::Two)),
        (1, 4, Strategy::Ddp),
    ] {
        let mut cfg = config(&dir, batch, 1, 6);
        cfg.training.resume_from_checkpoint = Some(ckpt.display().to_string());
        cfg.training.output_dir = tmp.path().join(format!("resumed-{world}-{strategy:?}"));
        let resumed = run_with(world, cfg, strategy);
        assert_close(
            &resumed,
            &(full.0[3..].to_vec(), full.1.clone()),
            &format!("sharded resume on {world} rank(s) of {strategy:?}"),
        );
    }
    // The final checkpoint is full: a plain HF model for the loader.
    trl_runtime::parallel::CausalLm::from_pretrained(
        dir.join("checkpoint-6"),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    // A missing rank file is named, with what it means.
    std::fs::remove_file(ckpt.join("sharded/shard-00001-of-00004.safetensors")).unwrap();
    let mut cfg = config(&dir, 4, 1, 6);
    cfg.training.resume_from_checkpoint = Some(ckpt.display().to_string());
    let w = InProcessWorld::new(1);
    let ctx = DistContext::in_process(&w, 0, DeviceMesh::new(ParallelDims::single(), 1).unwrap())
        .unwrap();
    let err = match Trainer::with_strategy(cfg, &ctx, Strategy::Ddp) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("resumed from an incomplete checkpoint"),
    };
    assert!(
        err.contains("shard-00001-of-00004.safetensors") && err.contains("written by 4 ranks"),
        "{err}"
    );
}

#[test]
fn zero3_full_checkpoint_resumes_on_more_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("z3full");
    let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
    let full = run_with(2, config(&dir, 2, 1, 6), zero3);
    assert!(dir.join("checkpoint-3/model.safetensors").exists());
    let mut cfg = config(&dir, 1, 1, 6);
    cfg.training.resume_from_checkpoint = Some(dir.join("checkpoint-3").display().to_string());
    cfg.training.output_dir = tmp.path().join("resumed");
    let resumed = run_with(4, cfg, zero3);
    assert_close(
        &resumed,
        &(full.0[3..].to_vec(), full.1.clone()),
        "zero3 full checkpoint from 2 ranks resumed on 4",
    );
}

#[test]
fn memory_accounting_follows_the_zero_formula() {
    // fp32 with AdamW master weights: DDP 4P + 4P + 12P, ZeRO-1 4P + 4P + 12P/N, ZeRO-2 4P + (4P + 12P)/N.
    // Sharding strategies shard over dp_shard.
    let w = InProcessWorld::new(2);
    let dims = ParallelDims {
        dp_replicate: 1,
        dp_shard: 2,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    let tmp = tempfile::tempdir().unwrap();
    let reports: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (w, out) = (&w, tmp.path().to_path_buf());
                s.spawn(move || {
                    let ctx = DistContext::in_process(w, rank, DeviceMesh::new(dims, 2).unwrap())
                        .unwrap();
                    [
                        Strategy::Ddp,
                        Strategy::Zero(ZeroStage::One),
                        Strategy::Zero(ZeroStage::Two),
                        Strategy::fsdp(WrapPolicy::PerLayer),
                    ]
                    .map(|st| {
                        Trainer::with_strategy(config(&out, 2, 1, 1), &ctx, st)
                            .unwrap()
                            .memory()
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let [ddp, z1, z2, z3] = reports[0];
    let p = ddp.parameters / 4;
    let close =
        |got: usize, want: usize| (got as f64 - want as f64).abs() <= 0.01 * want as f64 + 64.0;
    assert!(close(ddp.total(), 20 * p), "{ddp:?}");
    // Each ZeRO / FSDP slice keeps a byte per element saying where weight decay applies.
    assert!(close(z1.total(), 8 * p + 13 * p / 2), "{z1:?}");
    assert!(close(z2.total(), 4 * p + 17 * p / 2), "{z2:?}");
    // ZeRO-3: fp32 parameters are their own master copy, so 4P (params) + 4P (grads) + 8P
    // (moments), all over N: 16P/N, the figure the ZeRO paper gives for mixed precision, and
    // the decay mask's P/N.
    assert!(close(z3.total(), 17 * p / 2), "{z3:?}");
    assert_eq!(z3.parameters, z3.gradients, "{z3:?}");
    // HSDP (dp_replicate 2 x dp_shard 2 on 4 ranks) shards over the pair only: 17P/2, not 17P/4.
    let w = InProcessWorld::new(4);
    let dims = ParallelDims {
        dp_replicate: 2,
        dp_shard: 2,
        ..dims
    };
    let hsdp = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                let (w, out) = (&w, tmp.path().to_path_buf());
                s.spawn(move || {
                    let ctx = DistContext::in_process(w, rank, DeviceMesh::new(dims, 4).unwrap())
                        .unwrap();
                    let st = Strategy::fsdp(WrapPolicy::PerLayer);
                    Trainer::with_strategy(config(&out, 1, 1, 1), &ctx, st)
                        .unwrap()
                        .memory()
                })
            })
            .collect::<Vec<_>>();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(close(hsdp[0].total(), 17 * p / 2), "{:?}", hsdp[0]);
}

/// A random-init Qwen2 in `dir` that splits 4 ways (4 key/value heads) with q/k/v biases and
/// an untied LM head, beside the bundled tokenizer.
fn model_for_tp4(dir: &Path) -> PathBuf {
    let src = assets().join("model");
    let model = dir.join("model-tp4");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["num_key_value_heads"] = 4.into();
    cfg["attention_bias"] = true.into();
    cfg["tie_word_embeddings"] = false.into();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let cfg = trl_runtime::models::ModelConfig::from_file(model.join("config.json")).unwrap();
    trl_runtime::models::Params::init(&cfg, 7, candle_core::DType::F32, &candle_core::Device::Cpu)
        .unwrap()
        .save(&model, &cfg.to_json_pretty(), None, None)
        .unwrap();
    model
}

#[test]
fn tensor_parallel_matches_ddp() {
    // The bundled model (tied embeddings, grouped-query attention) split over tp = 2, alone,
    // beside data parallelism, and under ZeRO and FSDP over dp_shard (2-D FSDP x TP).
    let tmp = tempfile::tempdir().unwrap();
    let ddp = run(1, config(&tmp.path().join("ddp"), 4, 1, 5));
    let cases = [
        ("tp 2", dims(1, 1, 2), 4, Strategy::Ddp),
        ("DDP dp 2 x tp 2", dims(1, 2, 2), 2, Strategy::Ddp),
        (
            "ZeRO-2 dp_shard 2 x tp 2",
            dims(1, 2, 2),
            2,
            Strategy::Zero(ZeroStage::Two),
        ),
        (
            "FSDP dp_shard 2 x tp 2",
            dims(1, 2, 2),
            2,
            Strategy::fsdp(WrapPolicy::PerLayer),
        ),
    ];
    for (i, (what, dims, batch, strategy)) in cases.into_iter().enumerate() {
        let cfg = config(&tmp.path().join(format!("tp-{i}")), batch, 1, 5);
        let got = run_dims(dims, cfg, strategy, CheckpointFormat::Full);
        assert_close(&got, &ddp, &format!("{what} vs DDP 1 x 4"));
    }
}

#[test]
fn tensor_parallel_checkpoints_load_under_any_tp_size() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_for_tp4(tmp.path());
    let cfg = |out: &str, batch: usize, resume: Option<PathBuf>| {
        let base = config(&tmp.path().join(out), batch, 1, 6);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                model_name_or_path: model.clone(),
                resume_from_checkpoint: resume.map(|p| p.display().to_string()),
                ..base.training
            },
            ..base
        }
    };
    // tp = 2 under FSDP over 2 ranks writes checkpoint-3 (whole tensors) on the way ...
    let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
    let full = run_dims(
        dims(1, 2, 2),
        cfg("tp2", 2, None),
        zero3,
        CheckpointFormat::Sharded,
    );
    let ckpt = tmp.path().join("tp2/checkpoint-3");
    // ... a plain HF model with the full shapes ...
    let loaded = trl_runtime::parallel::CausalLm::from_pretrained(
        &ckpt,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(loaded.params.num_elements(), loaded.num_parameters());
    // ... which tp = 1 and tp = 4 continue exactly.
    for tp in [1, 4] {
        let resumed = run_dims(
            dims(1, 1, tp),
            cfg(&format!("tp{tp}"), 4, Some(ckpt.clone())),
            Strategy::Ddp,
            CheckpointFormat::Full,
        );
        assert_close(
            &resumed,
            &(full.0[3..].to_vec(), full.1.clone()),
            &format!("tp 2 checkpoint resumed under tp {tp}"),
        );
    }
}

#[test]
fn tensor_parallel_size_must_divide_the_heads() {
    // The bundled model has 2 key/value heads: tp = 4 cannot split them.
    let tmp = tempfile::tempdir().unwrap();
    let w = InProcessWorld::new(4);
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                let (w, cfg) = (&w, config(tmp.path(), 4, 1, 1));
                s.spawn(move || {
                    let mesh = DeviceMesh::new(dims(1, 1, 4), 4).unwrap();
                    let ctx = DistContext::in_process(w, rank, mesh).unwrap();
                    match Trainer::with_strategy(cfg, &ctx, Strategy::Ddp) {
                        Ok(_) => panic!("tp = 4 over 2 key/value heads was accepted"),
                        Err(e) => e.to_string(),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let e = &errors[0];
    assert!(
        e.contains("parallelism_config_tp_size") && e.contains("num_kv_heads") && e.contains("2"),
        "{e}"
    );
}

#[test]
fn activation_checkpointing_trains_like_the_plain_run() {
    // Each decoder layer recomputed in backward from its kept input: the same losses and
    // weights as without, alone and composed with every strategy that touches the layers
    // (ZeRO-3 units of one layer and of both layers, tensor and sequence parallelism), and
    // with the blockwise kernels inside the recomputed layers.
    let tmp = tempfile::tempdir().unwrap();
    let ddp = run(1, config(&tmp.path().join("ddp"), 4, 1, 5));
    let on = |out: &str, batch: usize| {
        let base = config(&tmp.path().join(out), batch, 1, 5);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                gradient_checkpointing: true,
                ..base.training
            },
            ..base
        }
    };
    let seq = |dp_shard: usize, cp: usize, sp: usize| ParallelDims {
        cp,
        sp,
        ..dims(1, dp_shard, 1)
    };
    let zero3 = Strategy::fsdp(WrapPolicy::PerLayer);
    let cases = [
        ("1 rank", dims(1, 1, 1), 4, Strategy::Ddp),
        ("DDP 2", dims(2, 1, 1), 2, Strategy::Ddp),
        (
            "ZeRO-2 dp_shard 2",
            dims(1, 2, 1),
            2,
            Strategy::Zero(ZeroStage::Two),
        ),
        ("ZeRO-3 dp_shard 2", dims(1, 2, 1), 2, zero3),
        (
            "ZeRO-3 dp_shard 2, both layers in one unit",
            dims(1, 2, 1),
            2,
            Strategy::fsdp(WrapPolicy::MinParams(1 << 20)),
        ),
        ("tp 2 x ZeRO-3 dp_shard 2", dims(1, 2, 2), 2, zero3),
        ("cp 2 x ZeRO-3 dp_shard 2", seq(2, 2, 1), 2, zero3),
        ("sp 2", seq(1, 1, 2), 4, Strategy::Ddp),
    ];
    for (i, (what, dims, batch, strategy)) in cases.into_iter().enumerate() {
        let got = run_dims(
            dims,
            on(&format!("ac-{i}"), batch),
            strategy,
            CheckpointFormat::Full,
        );
        assert_close(&got, &ddp, &format!("checkpointed {what} vs plain 1 x 4"));
    }
    let kernels = {
        let base = on("ac-kernels", 4);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                attn_implementation: "flash_attention_2".into(),
                use_liger_kernel: true,
                tiled_mlp: true,
                ..base.training
            },
            ..base
        }
    };
    assert_close(
        &run(1, kernels),
        &ddp,
        "checkpointed flash + tiled loss + tiled MLP vs plain",
    );
}

#[test]
fn flash_attention_and_tiled_loss_train_like_the_whole_matrices() {
    // Packed rows of 256 tokens: several documents per row and two attention blocks.
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |out: &str, attn: &str| {
        let base = config(&tmp.path().join(out), 2, 1, 3);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                max_length: 256,
                attn_implementation: attn.into(),
                ..base.training
            },
            packing: true,
            ..base
        }
    };
    let sdpa = run(1, cfg("sdpa", "sdpa"));
    let flash = run(1, cfg("flash", "flash_attention_2"));
    assert_close(&flash, &sdpa, "flash_attention_2 vs sdpa");
    // With the LM head and loss fused in tiles (use_liger_kernel) too.
    let tiled = run(1, {
        let base = cfg("tiled", "flash_attention_2");
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                use_liger_kernel: true,
                ..base.training
            },
            ..base
        }
    });
    assert_close(&tiled, &sdpa, "flash_attention_2 + tiled loss vs sdpa");
    // And the MLPs in tiles (tiled_mlp), also under tensor parallelism.
    let all = {
        let base = cfg("tiled-mlp", "flash_attention_2");
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                use_liger_kernel: true,
                tiled_mlp: true,
                ..base.training
            },
            ..base
        }
    };
    assert_close(
        &run(1, all.clone()),
        &sdpa,
        "flash + tiled loss + tiled MLP vs sdpa",
    );
    let tp2 = run_dims(dims(1, 1, 2), all, Strategy::Ddp, CheckpointFormat::Full);
    assert_close(&tp2, &sdpa, "tiled MLP at tp 2 vs sdpa");
    // A name transformers does not know is refused with the accepted ones.
    let e = cfg("bad", "flash")
        .validate("args")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("attn_implementation") && e.contains("flash_attention_2"),
        "{e}"
    );
}

#[test]
fn sequence_parallel_matches_ddp() {
    // Ulysses: every row's sequence split over sp ranks (the tiny model's 2 kv heads repeated
    // at sp 4), alone and beside ZeRO-3 over dp_shard as alst_ulysses_4gpu (dp_shard 2 x sp 2).
    let tmp = tempfile::tempdir().unwrap();
    let ddp = run(1, config(&tmp.path().join("ddp"), 4, 1, 5));
    let sp = |dp_shard: usize, sp: usize| ParallelDims {
        sp,
        ..dims(1, dp_shard, 1)
    };
    let cases = [
        ("sp 2", sp(1, 2), 4, Strategy::Ddp),
        ("sp 4", sp(1, 4), 4, Strategy::Ddp),
        (
            "ZeRO-3 dp_shard 2 x sp 2",
            sp(2, 2),
            2,
            Strategy::fsdp(WrapPolicy::PerLayer),
        ),
        (
            "ZeRO-2 dp_shard 2 x sp 2",
            sp(2, 2),
            2,
            Strategy::Zero(ZeroStage::Two),
        ),
    ];
    for (i, (what, dims, batch, strategy)) in cases.into_iter().enumerate() {
        let cfg = config(&tmp.path().join(format!("sp-{i}")), batch, 1, 5);
        let got = run_dims(dims, cfg, strategy, CheckpointFormat::Full);
        assert_close(&got, &ddp, &format!("{what} vs DDP 1 x 4"));
    }
}

#[test]
fn context_parallel_matches_ddp() {
    // Ring attention: rows cut into 2 x cp chunks, rank r holding chunks r and 2cp-1-r, alone
    // and beside ZeRO-3 / ZeRO-2 over dp_shard (dp_shard 2 x cp 2).
    let tmp = tempfile::tempdir().unwrap();
    let ddp = run(1, config(&tmp.path().join("ddp"), 4, 1, 5));
    let cp = |dp_shard: usize, cp: usize| ParallelDims {
        cp,
        ..dims(1, dp_shard, 1)
    };
    let cases = [
        ("cp 2", cp(1, 2), 4, Strategy::Ddp),
        ("cp 4", cp(1, 4), 4, Strategy::Ddp),
        (
            "ZeRO-3 dp_shard 2 x cp 2",
            cp(2, 2),
            2,
            Strategy::fsdp(WrapPolicy::PerLayer),
        ),
        (
            "ZeRO-2 dp_shard 2 x cp 2",
            cp(2, 2),
            2,
            Strategy::Zero(ZeroStage::Two),
        ),
    ];
    for (i, (what, dims, batch, strategy)) in cases.into_iter().enumerate() {
        let cfg = config(&tmp.path().join(format!("cp-{i}")), batch, 1, 5);
        let got = run_dims(dims, cfg, strategy, CheckpointFormat::Full);
        assert_close(&got, &ddp, &format!("{what} vs DDP 1 x 4"));
    }
}

/// How far apart two runs are: the largest relative loss difference, the mean absolute weight
/// difference relative to the mean absolute weight (over all weights), and the largest
/// absolute weight difference. Under bf16 single elements whose gradients sit at the rounding
/// noise can take opposite AdamW steps (each at most about the learning rate), so the
/// largest difference is only bounded and the mean says whether the runs agree.
fn differences(
    a: &(Vec<f64>, Vec<(String, Vec<f32>)>),
    b: &(Vec<f64>, Vec<(String, Vec<f32>)>),
) -> (f64, f64, f32) {
    let loss =
        a.0.iter()
            .zip(&b.0)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() / y.abs()));
    let (mut diff, mut size, mut largest) = (0f64, 0f64, 0f32);
    for ((_, x), (_, y)) in a.1.iter().zip(&b.1) {
        for (p, q) in x.iter().zip(y) {
            diff += (p - q).abs() as f64;
            size += q.abs() as f64;
            largest = largest.max((p - q).abs());
        }
    }
    (loss, diff / size, largest)
}

/// bf16 mixed precision (bf16 weights and compute; fp32 master weights, optimizer state and
/// gradient accumulation) trains on CPU: data parallelism and ZeRO-2 stay equal to one
/// process up to bf16 rounding, and the run follows the fp32 run closely.
#[test]
fn bf16_mixed_precision_matches_across_strategies_and_follows_fp32() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = |name: &str, batch, accumulation| {
        let base = config(&tmp.path().join(name), batch, accumulation, 5);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                bf16: true,
                ..base.training
            },
            ..base
        }
    };
    let one = run(1, bf16("one", 4, 1));
    let ddp = run(2, bf16("ddp", 2, 1));
    let accum = run(1, bf16("accum", 2, 2));
    let zero2 = run_with(2, bf16("zero2", 2, 1), Strategy::Zero(ZeroStage::Two));
    let fsdp = run_with(2, bf16("fsdp", 2, 1), Strategy::fsdp(WrapPolicy::PerLayer));
    let fp32 = run(1, config(&tmp.path().join("fp32"), 4, 1, 5));
    // The blockwise kernels in bf16: matmuls in bf16; softmax, loss and accumulators in f32.
    let flash = run(1, {
        let base = bf16("flash", 4, 1);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                attn_implementation: "flash_attention_2".into(),
                ..base.training
            },
            ..base
        }
    });
    let tiled = run(1, {
        let base = bf16("tiled", 4, 1);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                attn_implementation: "flash_attention_2".into(),
                use_liger_kernel: true,
                tiled_mlp: true,
                ..base.training
            },
            ..base
        }
    });
    let ring = run_dims(
        ParallelDims {
            cp: 2,
            ..dims(1, 1, 1)
        },
        bf16("cp", 4, 1),
        Strategy::Ddp,
        CheckpointFormat::Full,
    );
    assert!(one.0[4] < one.0[0], "the loss goes down: {:?}", one.0);
    for (what, run) in [
        ("flash_attention_2 1 x 4", &flash),
        ("flash_attention_2 + tiled loss and MLP 1 x 4", &tiled),
        ("ring attention cp 2", &ring),
        ("DDP 2 x 2", &ddp),
        ("1 x 2 accumulation x 2", &accum),
        ("ZeRO-2 2 x 2", &zero2),
        ("FSDP (ZeRO-3) 2 x 2", &fsdp),
    ] {
        let (loss, mean, largest) = differences(run, &one);
        eprintln!("bf16 {what} vs 1 x 4: loss {loss:e}, mean weight {mean:e}, largest {largest:e}");
        assert!(
            loss < 1e-3 && mean < 2e-3 && largest <= 2.0 * 3e-3 * 5.0,
            "bf16 {what} vs 1 x 4: loss {loss:e}, mean weight {mean:e}, largest {largest:e}"
        );
    }
    let (loss, mean, largest) = differences(&one, &fp32);
    eprintln!("bf16 vs fp32, 1 x 4: loss {loss:e}, mean weight {mean:e}, largest {largest:e}");
    assert!(
        loss < 1e-2 && mean < 1e-2 && largest <= 2.0 * 3e-3 * 5.0,
        "bf16 vs fp32: loss {loss:e}, mean weight {mean:e}, largest {largest:e}"
    );
    let ctx = DistContext::in_process(
        &InProcessWorld::new(1),
        0,
        DeviceMesh::new(ParallelDims::single(), 1).unwrap(),
    )
    .unwrap();
    // The runs above really were mixed precision: bf16 weights, fp32 master weights and
    // moments.
    let trainer = Trainer::with_strategy(bf16("dtypes", 4, 1), &ctx, Strategy::Ddp).unwrap();
    for (name, w) in trainer.model.params.iter() {
        assert_eq!(w.dtype(), candle_core::DType::BF16, "{name}");
    }
    let Optimizer::Replicated(adam, _) = &trainer.optimizer else {
        panic!("DDP keeps a replicated optimizer")
    };
    for (name, s) in &adam.states {
        for t in [&s.master, &s.exp_avg, &s.exp_avg_sq] {
            assert_eq!(t.dtype(), candle_core::DType::F32, "{name}");
        }
    }
    drop(trainer);
    let fp16 = {
        let base = config(&tmp.path().join("fp16"), 4, 1, 5);
        SFTConfig {
            training: trl_runtime::train::TrainingArguments {
                mixed_precision: Some("fp16".into()),
                ..base.training
            },
            ..base
        }
    };
    let e = fp16.validate("sft.yaml").unwrap_err().to_string();
    assert!(
        e.contains("sft.yaml") && e.contains("loss scaling") && e.contains("bf16"),
        "{e}"
    );
}

#[test]
fn efficient_loading_reads_the_same_shards() {
    // DeepSpeed's zero3_init_flag (FSDP's cpu_ram_efficient_loading): each rank reads only its
    // slices of the ZeRO-3 units from the checkpoint instead of loading the whole model and
    // cutting them. The strategy comes from the launch plan, as under `cargo trl launch`.
    use trl_runtime::config::{DeepSpeedConfig, DistributedType, LaunchPlan};
    let tmp = tempfile::tempdir().unwrap();
    let run_plan = |out: &str, zero3_init_flag: bool| {
        let plan = LaunchPlan {
            distributed_type: DistributedType::DeepSpeed,
            deepspeed: Some(DeepSpeedConfig {
                zero_stage: 3,
                zero3_init_flag,
                ..DeepSpeedConfig::default()
            }),
            ..LaunchPlan::default()
        };
        assert_eq!(plan.efficient_loading(), zero3_init_flag);
        let w = InProcessWorld::new(2);
        let out = tmp.path().join(out);
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (w, plan, out) = (&w, plan.clone(), out.clone());
                    s.spawn(move || {
                        let mesh = DeviceMesh::new(dims(1, 2, 1), 2).unwrap();
                        let ctx = DistContext::in_process(w, rank, mesh)
                            .unwrap()
                            .with_launch_plan(plan);
                        let mut trainer = Trainer::new(config(&out, 2, 1, 3), &ctx).unwrap();
                        assert_eq!(trainer.strategy, Strategy::fsdp(WrapPolicy::PerLayer));
                        assert!(trainer.model.params.is_empty(), "parameters are sharded");
                        assert_eq!(
                            trainer.read_shards, zero3_init_flag,
                            "the loading path taken"
                        );
                        let report = trainer.report().unwrap();
                        assert_eq!(report["read_shards"], zero3_init_flag, "{report}");
                        let losses = trainer.train().unwrap().losses;
                        let weights = trainer.gather_weights().unwrap();
                        (losses, weights)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        results.into_iter().next().unwrap()
    };
    let (read, read_w) = run_plan("read", true);
    let (cut, cut_w) = run_plan("cut", false);
    assert_eq!(read, cut, "losses");
    for (name, t) in &cut_w {
        assert_eq!(common::max_abs_diff(t, &read_w[name]), 0.0, "{name}");
    }
}

#[test]
fn deepspeed_values_must_match_the_training_arguments() {
    // As transformers refuses it: a DeepSpeed config fixing gradient accumulation or clipping
    // to another value than the training arguments is an error naming both.
    use trl_runtime::config::{DeepSpeedConfig, DistributedType, LaunchPlan};
    let tmp = tempfile::tempdir().unwrap();
    let w = InProcessWorld::new(1);
    for (ds, expect) in [
        (
            DeepSpeedConfig {
                gradient_accumulation_steps: Some(4),
                ..DeepSpeedConfig::default()
            },
            "gradient_accumulation_steps = 1",
        ),
        (
            DeepSpeedConfig {
                gradient_clipping: Some(0.5),
                ..DeepSpeedConfig::default()
            },
            "max_grad_norm = 1",
        ),
    ] {
        let plan = LaunchPlan {
            distributed_type: DistributedType::DeepSpeed,
            deepspeed: Some(ds),
            ..LaunchPlan::default()
        };
        let ctx = DistContext::in_process(&w, 0, DeviceMesh::new(dims(1, 1, 1), 1).unwrap())
            .unwrap()
            .with_launch_plan(plan);
        let e = match Trainer::new(config(tmp.path(), 2, 1, 1), &ctx) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{expect}: accepted"),
        };
        assert!(e.contains(expect) && e.contains("DeepSpeed"), "{e}");
    }
    // Equal values (and unset ones) are fine.
    let plan = LaunchPlan {
        distributed_type: DistributedType::DeepSpeed,
        deepspeed: Some(DeepSpeedConfig {
            gradient_accumulation_steps: Some(1),
            gradient_clipping: Some(1.0),
            ..DeepSpeedConfig::default()
        }),
        ..LaunchPlan::default()
    };
    let ctx = DistContext::in_process(&w, 0, DeviceMesh::new(dims(1, 1, 1), 1).unwrap())
        .unwrap()
        .with_launch_plan(plan);
    assert!(Trainer::new(config(tmp.path(), 2, 1, 1), &ctx).is_ok());
}

/// The built-in decoder with the first layer's output cut from the graph, as an op without a
/// backward (candle_nn's rope, say) would cut it: the embedding and layer 0 get no gradient.
#[derive(trl_runtime::Parallelize)]
struct Cut {
    #[parallel(name = "")]
    inner: trl_runtime::models::Llama,
}

impl trl_runtime::models::CausalModel for Cut {
    type Config = trl_runtime::models::ModelConfig;
    fn parse_config(text: &str, source: &str) -> trl_runtime::Result<Self::Config> {
        trl_runtime::models::Llama::parse_config(text, source)
    }
    fn new(cfg: &Self::Config, vb: candle_nn::VarBuilder) -> candle_core::Result<Self> {
        Ok(Cut {
            inner: trl_runtime::models::Llama::new(cfg, vb)?,
        })
    }
    fn embed(
        &self,
        ids: &candle_core::Tensor,
        cx: &trl_runtime::models::LayerInputs,
    ) -> candle_core::Result<candle_core::Tensor> {
        self.inner.embed(ids, cx)
    }
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    fn layer(
        &self,
        l: usize,
        x: &candle_core::Tensor,
        cx: &trl_runtime::models::LayerInputs,
    ) -> candle_core::Result<candle_core::Tensor> {
        let y = self.inner.layer(l, x, cx)?;
        Ok(if l == 0 { y.detach() } else { y })
    }
    fn final_norm(&self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        self.inner.final_norm(x)
    }
    fn lm_head(&self) -> &trl_runtime::nn::Linear {
        self.inner.lm_head()
    }
}

#[test]
fn parameters_without_a_gradient_stop_the_first_step() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("DDP", dims(2, 1, 1), Strategy::Ddp),
        ("ZeRO-2", dims(1, 2, 1), Strategy::Zero(ZeroStage::Two)),
        ("FSDP", dims(1, 2, 1), Strategy::fsdp(WrapPolicy::PerLayer)),
    ];
    for (what, dims, strategy) in cases {
        for find_unused in [None, Some(true)] {
            let cfg = {
                let base = config(&tmp.path().join(format!("{what}-{find_unused:?}")), 2, 1, 2);
                SFTConfig {
                    training: trl_runtime::train::TrainingArguments {
                        // Untied, so that the head (after the cut) still trains.
                        model_name_or_path: model_for_tp4(tmp.path()),
                        ddp_find_unused_parameters: find_unused,
                        save_steps: 1000.0,
                        ..base.training
                    },
                    ..base
                }
            };
            let w = InProcessWorld::new(2);
            let results: Vec<Result<usize, String>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..2)
                    .map(|rank| {
                        let (w, cfg) = (&w, cfg.clone());
                        s.spawn(move || {
                            let mesh = DeviceMesh::new(dims, 2).unwrap();
                            let ctx = DistContext::in_process(w, rank, mesh).unwrap();
                            let mut trainer =
                                Trainer::<Cut>::load_with_strategy(cfg, &ctx, strategy).unwrap();
                            trainer
                                .train()
                                .map(|o| o.losses.len())
                                .map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for r in results {
                match (find_unused, r) {
                    (None, Err(e)) => assert!(
                        // The embedding and layer 0's 12 tensors, named. (Under FSDP and
                        // ZeRO-2's units no parameter is a Candle variable: after the cut only
                        // the head is reached, the loss taking it whole from its unit, and
                        // every other parameter is unreached, and named.)
                        (e.contains("13 trainable parameter(s)")
                            || (what != "DDP"
                                && e.contains("26 trainable parameter(s)")
                                && !e.contains("lm_head")))
                            && e.contains("model.embed_tokens.weight")
                            && e.contains("model.layers.0.")
                            && e.contains("no gradient")
                            && e.contains("--ddp_find_unused_parameters true"),
                        "{what}: {e}"
                    ),
                    (Some(true), Ok(steps)) => assert_eq!(steps, 2, "{what}"),
                    (f, r) => panic!("{what}, ddp_find_unused_parameters {f:?}: {r:?}"),
                }
            }
        }
    }
}

/// A copy of the first `train` training and `eval` held-out rows of the tiny data in `dir`
/// (small epochs for the strategies' tests).
fn small_data(dir: &Path, train: usize, eval: usize) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let head = |name: &str, n: usize| {
        let text = std::fs::read_to_string(assets().join("data").join(name)).unwrap();
        let path = dir.join(name);
        let rows: Vec<&str> = text.lines().take(n).collect();
        std::fs::write(&path, rows.join("\n") + "\n").unwrap();
        path
    };
    (head("train.jsonl", train), head("eval.jsonl", eval))
}

/// The metrics.jsonl lines of a run: (step, whether it has eval_loss).
fn logged(dir: &Path) -> Vec<(usize, Option<f64>)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap() as usize,
                v["eval_loss"].as_f64(),
            )
        })
        .collect()
}

fn checkpoints(dir: &Path) -> Vec<usize> {
    trl_runtime::train::checkpoint::list(dir)
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

/// transformers' strategies decide when the trainer logs, evaluates and saves: by epoch (6
/// steps of 24 rows at batch 4), or never (the final model is still written, as TRL's scripts
/// save it), with logging_first_step.
#[test]
fn logging_eval_and_save_strategies_decide_the_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(&tmp.path().join("data"), 24, 8);
    let base = |out: &str| {
        let mut cfg = config(&tmp.path().join(out), 4, 1, -1);
        cfg.training.dataset_name = train.clone();
        cfg.training.eval_dataset_name = Some(eval.clone());
        cfg.training.num_train_epochs = 2.0;
        cfg
    };
    let mut cfg = base("epoch");
    for s in [
        &mut cfg.training.logging_strategy,
        &mut cfg.training.save_strategy,
    ] {
        *s = "epoch".into();
    }
    cfg.training.eval_strategy = Some("epoch".into());
    run(1, cfg);
    let dir = tmp.path().join("epoch");
    let lines = logged(&dir);
    assert_eq!(
        lines.iter().map(|l| l.0).collect::<Vec<_>>(),
        [6, 12],
        "{lines:?}"
    );
    assert!(lines.iter().all(|l| l.1.is_some()), "{lines:?}");
    assert_eq!(checkpoints(&dir), [6, 12]);

    let mut cfg = base("none");
    cfg.training.save_strategy = "no".into();
    cfg.training.logging_strategy = "no".into();
    cfg.training.logging_first_step = true;
    cfg.training.eval_strategy = Some("steps".into());
    cfg.training.eval_steps = Some(5.0);
    run(1, cfg);
    let dir = tmp.path().join("none");
    let lines = logged(&dir);
    let steps: Vec<usize> = lines.iter().map(|l| l.0).collect();
    // The first step, then the evaluations (every 5 steps and at the end) with their losses.
    assert_eq!(steps, [1, 5, 10, 12], "{lines:?}");
    assert!(lines[0].1.is_none() && lines[1..].iter().all(|l| l.1.is_some()));
    assert_eq!(checkpoints(&dir), [12], "only the final model");
}

/// metric_for_best_model tracks the best evaluation; save_total_limit keeps its checkpoint
/// beside the newest; load_best_model_at_end reads it back as the run's model (under ZeRO-3
/// too, whose parameters are sharded, and from a save_only_model checkpoint) and, with
/// save_total_limit 1, leaves only it. The
/// metric is eval_loss with greater_is_better, so that the best is an early step.
#[test]
fn the_best_checkpoint_is_kept_and_loaded_at_end() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, eval) = small_data(&tmp.path().join("data"), 400, 16);
    let cfg = |out: &str, load: bool, limit: usize| {
        let mut cfg = config(&tmp.path().join(out), 2, 1, 6);
        cfg.training.dataset_name = train.clone();
        cfg.training.eval_dataset_name = Some(eval.clone());
        cfg.training.eval_strategy = Some("steps".into());
        cfg.training.eval_steps = Some(2.0);
        cfg.training.save_steps = 2.0;
        cfg.training.save_total_limit = Some(limit);
        cfg.training.metric_for_best_model = Some("loss".into());
        cfg.training.greater_is_better = Some(true);
        cfg.training.load_best_model_at_end = load;
        cfg
    };
    let state = |dir: &Path, step: usize| {
        trl_runtime::train::checkpoint::read_trainer_state(&dir.join(format!("checkpoint-{step}")))
            .unwrap()
    };
    // Kept, not loaded: the best and the newest remain.
    let (_, mut last_weights) = run(1, cfg("kept", false, 1));
    last_weights.sort_by(|a, b| a.0.cmp(&b.0));
    let dir = tmp.path().join("kept");
    let evals: Vec<(usize, f64)> = logged(&dir)
        .into_iter()
        .filter_map(|(s, l)| l.map(|l| (s, l)))
        .collect();
    assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4, 6]);
    let (best_step, best_loss) = evals
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    assert!(
        best_step < 6,
        "the highest eval loss is not the last: {evals:?}"
    );
    eprintln!("evaluations (step, loss): {evals:?}");
    assert_eq!(checkpoints(&dir), [best_step, 6]);
    let s = state(&dir, 6);
    assert_eq!(s.best_global_step, Some(best_step));
    assert_eq!(s.best_metric, Some(best_loss));
    assert_eq!(
        s.best_model_checkpoint,
        Some(dir.join(format!("checkpoint-{best_step}")))
    );

    // Loaded: the run ends with the best checkpoint's weights, on one rank and under ZeRO-3.
    let best_weights = |dir: &Path| -> Vec<(String, Vec<f32>)> {
        let file = dir.join(format!("checkpoint-{best_step}/model.safetensors"));
        let mut w: Vec<(String, Vec<f32>)> =
            candle_core::safetensors::load(file, &candle_core::Device::Cpu)
                .unwrap()
                .into_iter()
                .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
                .collect();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w
    };
    for (out, world, strategy, model_only) in [
        ("loaded", 1, Strategy::Ddp, false),
        (
            "loaded-zero3",
            2,
            Strategy::fsdp(WrapPolicy::PerLayer),
            false,
        ),
        ("loaded-model-only", 1, Strategy::Ddp, true),
    ] {
        let mut c = cfg(out, true, 1);
        c.training.per_device_train_batch_size = 2 / world;
        c.training.save_only_model = model_only;
        let (_, mut weights) = run_with(world, c, strategy);
        let dir = tmp.path().join(out);
        assert_eq!(
            checkpoints(&dir),
            [best_step],
            "{out}: only the best is left"
        );
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        let best = best_weights(&dir);
        assert_eq!(weights.len(), best.len(), "{out}");
        for ((n, w), (m, b)) in weights.iter().zip(&best) {
            assert_eq!(n, m);
            assert_eq!(w, b, "{out}: {n} is not the best checkpoint's");
        }
        assert_ne!(
            weights, last_weights,
            "{out}: still the last step's weights"
        );
    }
}

/// data_seed orders the data apart from seed, as transformers' does: a full fine-tune (where
/// seed decides nothing else) with seed 7 equals one with seed 42 and data_seed 7, and
/// data_seed equal to seed changes nothing.
#[test]
fn data_seed_orders_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let with = |out: &str, seed: u64, data_seed: Option<u64>| {
        let mut cfg = config(&tmp.path().join(out), 2, 1, 4);
        cfg.training.seed = seed;
        cfg.training.data_seed = data_seed;
        run(1, cfg)
    };
    let plain = with("plain", 42, None);
    assert_eq!(with("same", 42, Some(42)), plain);
    let seven = with("seven", 7, None);
    assert_ne!(seven.0, plain.0, "another order");
    assert_eq!(with("data-seven", 42, Some(7)), seven);
}

/// save_only_model: checkpoints hold the model and trainer state but no optimizer state,
/// written full under ZeRO-3 and where sharded state is asked for; a run resumed from one
/// continues from its weights and step with AdamW afresh (as transformers resumes it), so
/// its first step equals a run started from those weights.
#[test]
fn save_only_model_writes_no_optimizer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let files = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    for (out, world, strategy, format) in [
        ("ddp", 1, Strategy::Ddp, CheckpointFormat::Full),
        (
            "zero3",
            2,
            Strategy::fsdp(WrapPolicy::PerLayer),
            CheckpointFormat::Full,
        ),
        (
            "zero3-sharded",
            2,
            Strategy::fsdp(WrapPolicy::PerLayer),
            CheckpointFormat::Sharded,
        ),
    ] {
        let mut cfg = config(&tmp.path().join(out), 4 / world, 1, 4);
        cfg.training.save_steps = 2.0;
        cfg.training.save_only_model = true;
        let (replicate, shard) = match strategy {
            Strategy::Ddp => (world, 1),
            _ => (1, world),
        };
        run_saving(replicate, shard, cfg, strategy, format);
        let ckpt = tmp.path().join(out).join("checkpoint-2");
        let names = files(&ckpt);
        assert!(
            names.contains(&"model.safetensors".to_string())
                && names.contains(&"trainer_state.json".to_string()),
            "{out}: {names:?}"
        );
        assert!(
            !names
                .iter()
                .any(|n| n.starts_with("optimizer") || n.contains("shard")),
            "{out}: {names:?}"
        );
    }
    // Resumed from checkpoint-2: steps 3 and 4 from its weights with AdamW afresh, which is a
    // fresh run from those weights (warmup and schedule at step 3, as the trainer state says).
    let ckpt = tmp.path().join("ddp/checkpoint-2");
    let mut cfg = config(&tmp.path().join("resumed"), 4, 1, 4);
    cfg.training.resume_from_checkpoint = Some(ckpt.display().to_string());
    let resumed = run(1, cfg);
    assert_eq!(resumed.0.len(), 2, "steps 3 and 4");
    let first = config(&tmp.path().join("ddp"), 4, 1, 4);
    let full = run(1, first);
    assert_eq!(
        resumed.0[0], full.0[2],
        "step 3 sees the same weights and data"
    );
    assert_ne!(resumed.1, full.1, "the moments started afresh");
}

/// num_tokens (TRL's metric) counts the input tokens of every rank, padding not counted: 2 ranks
/// x 2 rows log what 1 rank x 4 rows logs, and a resumed run carries the count on.
#[test]
fn num_tokens_counts_every_ranks_tokens_across_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let counts = |dir: &Path| -> Vec<u64> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["num_tokens"]
                    .as_u64()
                    .unwrap()
            })
            .collect()
    };
    run(1, config(&tmp.path().join("one"), 4, 1, 6));
    run(2, config(&tmp.path().join("two"), 2, 1, 6));
    let one = counts(&tmp.path().join("one"));
    assert_eq!(one.len(), 6);
    assert!(one.windows(2).all(|w| w[1] > w[0]) && one[0] > 4, "{one:?}");
    assert_eq!(counts(&tmp.path().join("two")), one);
    let mut cfg = config(&tmp.path().join("resumed"), 4, 1, 6);
    let ckpt = tmp.path().join("one/checkpoint-3");
    cfg.training.resume_from_checkpoint = Some(ckpt.display().to_string());
    run(1, cfg);
    assert_eq!(counts(&tmp.path().join("resumed")), one[3..]);
}

/// Logged lines average the loss over the steps since the last line, as transformers logs it
/// (with logging_steps 3, the mean of three steps' losses), and a run's steps are the same
/// whatever it logs.
#[test]
fn logged_losses_are_window_means() {
    let tmp = tempfile::tempdir().unwrap();
    let losses = |dir: &Path| -> Vec<(u64, f64)> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
            })
            .collect()
    };
    let every = run(1, config(&tmp.path().join("every"), 4, 1, 6)).0;
    let logged_every = losses(&tmp.path().join("every"));
    assert_eq!(logged_every.iter().map(|l| l.1).collect::<Vec<_>>(), every);
    let mut cfg = config(&tmp.path().join("three"), 4, 1, 6);
    cfg.training.logging_steps = 3.0;
    assert_eq!(run(1, cfg).0, every);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let expected = [(3, mean(&every[..3])), (6, mean(&every[3..]))];
    let got = losses(&tmp.path().join("three"));
    assert_eq!(got.len(), 2, "{got:?}");
    for ((s, l), (es, el)) in got.iter().zip(expected) {
        assert_eq!(*s, es);
        assert!((l - el).abs() <= 1e-12 * el.abs(), "step {s}: {l} vs {el}");
    }
}

/// SFT whose micro-batches hold each of their rows twice, in a row (as TRL's GRPO deals each
/// prompt `num_generations` times): a task deals its own rows.
struct Twice(trl_runtime::train::Sft);

impl<N: trl_runtime::models::CausalModel> trl_runtime::train::Task<N> for Twice {
    type Config = SFTConfig;
    fn load(
        config: &SFTConfig,
        tokenizer: &trl_runtime::data::TextTokenizer,
    ) -> trl_runtime::Result<Self> {
        Ok(Twice(
            <trl_runtime::train::Sft as trl_runtime::train::Task<N>>::load(config, tokenizer)?,
        ))
    }
    fn num_rows(&self) -> usize {
        trl_runtime::train::Task::<N>::num_rows(&self.0)
    }
    fn deal(&self, rows: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
        rows.into_iter()
            .map(|m| m.iter().flat_map(|&r| [r, r]).collect())
            .collect()
    }
    fn prepare(
        &mut self,
        config: &SFTConfig,
        core: &trl_runtime::train::Core<'_, N>,
    ) -> trl_runtime::Result<()> {
        self.0.prepare(config, core)
    }
    fn step(
        &mut self,
        core: &trl_runtime::train::Core<'_, N>,
        rows: &[Vec<usize>],
        grads: &mut trl_runtime::train::StepGrads,
    ) -> trl_runtime::Result<trl_runtime::train::TaskStep> {
        assert!(
            rows.iter().all(|m| m.chunks(2).all(|p| p[0] == p[1])),
            "{rows:?}"
        );
        self.0.step(core, rows, grads)
    }
    fn evaluate(
        &self,
        config: &SFTConfig,
        core: &trl_runtime::train::Core<'_, N>,
    ) -> trl_runtime::Result<Option<trl_runtime::train::EvalResult>> {
        self.0.evaluate(config, core)
    }
}

/// A task deals its own rows: each row twice in a micro-batch weighs as once in the token
/// mean, so the losses and weights are plain SFT's.
#[test]
fn a_task_deals_its_own_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = run(1, config(&tmp.path().join("plain"), 2, 1, 3));
    let w = InProcessWorld::new(1);
    let ctx = DistContext::in_process(&w, 0, DeviceMesh::new(dims(1, 1, 1), 1).unwrap()).unwrap();
    let cfg = config(&tmp.path().join("twice"), 2, 1, 3);
    let mut trainer =
        Trainer::<trl_runtime::models::AutoModelForCausalLM, Twice>::load(cfg, &ctx).unwrap();
    let out = trainer.train().unwrap();
    assert_eq!(out.losses.len(), plain.0.len());
    for (a, b) in out.losses.iter().zip(&plain.0) {
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", out.losses, plain.0);
    }
}
