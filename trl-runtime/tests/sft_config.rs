//! SFTConfig: TRL's names and defaults, YAML and TOML files, command-line overrides (HF-style
//! booleans, repeated flags), and errors naming the file and key.

use clap::Parser;
use trl_runtime::train::{SFTConfig, SftCli, TrainerConfig};

fn cli(args: &[&str]) -> Result<SFTConfig, String> {
    let cli = SftCli::try_parse_from(std::iter::once("sft").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    SFTConfig::from_cli(&cli).map_err(|e| e.to_string())
}

#[test]
fn defaults_follow_trl() {
    let c = SFTConfig::default();
    assert_eq!(
        (
            c.training.per_device_train_batch_size,
            c.training.gradient_accumulation_steps
        ),
        (8, 1)
    );
    assert_eq!(
        (
            c.training.learning_rate,
            c.training.lr_scheduler_type.as_str(),
            c.training.max_grad_norm
        ),
        (2e-5, "linear", 1.0)
    );
    assert_eq!(
        (
            c.training.max_length,
            c.packing,
            c.packing_strategy.as_str()
        ),
        (1024, false, "bfd")
    );
    assert_eq!(
        (
            c.training.num_train_epochs,
            c.training.max_steps,
            c.training.logging_steps,
            c.training.seed
        ),
        (3.0, -1, 10.0, 42)
    );
}

#[test]
fn file_then_flags() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("sft.yaml");
    std::fs::write(
        &yaml,
        "learning_rate: 1.0e-4\npacking: true\npad_to_multiple_of: 4\nsave_total_limit: 2\n",
    )
    .unwrap();
    let c = cli(&[
        "--config",
        yaml.to_str().unwrap(),
        "--learning_rate",
        "3e-4",
        "--packing",
        "False",
        "--gradient_accumulation_steps",
        "4",
    ])
    .unwrap();
    assert_eq!(
        (
            c.training.learning_rate,
            c.packing,
            c.pad_to_multiple_of.0,
            c.training.save_total_limit,
            c.training.gradient_accumulation_steps
        ),
        (3e-4, false, Some(4), Some(2), 4)
    );
    // A bare boolean flag means true; a repeated flag keeps the last value; `none` clears.
    let c = cli(&[
        "--packing",
        "--max_steps",
        "5",
        "--max_steps",
        "7",
        "--pad_to_multiple_of",
        "none",
    ])
    .unwrap();
    assert_eq!(
        (c.packing, c.training.max_steps, c.pad_to_multiple_of.0),
        (true, 7, None)
    );
    // TRL 1.16's default, `auto`, pads only on AWS Neuron: no padding here.
    let c = cli(&["--pad_to_multiple_of", "auto"]).unwrap();
    assert_eq!(c.pad_to_multiple_of.0, None);

    let toml = dir.path().join("sft.toml");
    std::fs::write(
        &toml,
        "learning_rate = 5e-4\nlr_scheduler_type = \"cosine\"\nwarmup_ratio = 0.1\n",
    )
    .unwrap();
    let c = SFTConfig::from_file(&toml).unwrap();
    assert_eq!(
        (
            c.training.learning_rate,
            c.training.lr_scheduler_type.as_str(),
            c.training.warmup_ratio
        ),
        (5e-4, "cosine", 0.1)
    );
}

/// transformers 5's `warmup_steps`: a whole number of steps, or below 1 a fraction of the run
/// (ceil(fraction x steps), as its `get_warmup_steps`); it replaces `warmup_ratio`, which is
/// still read, and wins over it. logging/save/eval steps take fractions too
/// (tests/training_flow.rs), and refuse what transformers refuses.
#[test]
fn step_counts_take_a_count_or_a_fraction() {
    let warmup = |args: &[&str]| {
        let c = cli(args).unwrap();
        c.training.validate("flags").unwrap();
        c.training.schedule(110).unwrap().warmup_steps
    };
    assert_eq!(warmup(&["--warmup_steps", "5"]), 5);
    // A negative number is a value (transformers' max_steps default).
    assert_eq!(cli(&["--max_steps", "-1"]).unwrap().training.max_steps, -1);
    assert_eq!(warmup(&["--warmup_steps", "0.05"]), 6);
    assert_eq!(warmup(&["--warmup_ratio", "0.1"]), 11);
    assert_eq!(warmup(&["--warmup_steps", "3", "--warmup_ratio", "0.1"]), 3);
    let e = cli(&["--warmup_steps=-1"])
        .and_then(|c| c.training.validate("flags").map_err(|e| e.to_string()))
        .unwrap_err();
    assert!(e.contains("warmup_steps"), "{e}");
    // Above 1 a whole number, as transformers requires.
    let e = cli(&["--logging_steps", "2.5"])
        .and_then(|c| c.training.validate("flags").map_err(|e| e.to_string()))
        .unwrap_err();
    assert!(e.contains("logging_steps") && e.contains("whole"), "{e}");
}

#[test]
fn bad_values_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("bad.yaml");
    std::fs::write(&yaml, "learning_rte: 1.0e-4\n").unwrap();
    let e = SFTConfig::from_file(&yaml).unwrap_err().to_string();
    assert!(
        e.contains("bad.yaml") && e.contains("learning_rte") && e.contains("learning_rate"),
        "{e}"
    );
    // A value of the wrong type names its key (serde alone does not, through the flattened
    // map of TRL's other keys), in YAML and TOML, for SFT and DPO.
    for (file, text, key) in [
        (
            "t.yaml",
            "num_train_epochs: 1\nlearning_rate: abc\n",
            "`learning_rate`",
        ),
        (
            "t.yml",
            "per_device_train_batch_size: [8]\n",
            "`per_device_train_batch_size`",
        ),
        (
            "t.toml",
            "beta = 0.1\nmax_length = \"long\"\n",
            "`max_length`",
        ),
    ] {
        let path = dir.path().join(file);
        std::fs::write(&path, text).unwrap();
        let e = trl_runtime::train::DPOConfig::from_file(&path)
            .unwrap_err()
            .to_string();
        assert!(e.contains(file) && e.contains(key), "{e}");
        if !text.contains("beta") {
            let e = SFTConfig::from_file(&path).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("invalid type"), "{e}");
        }
    }
    // transformers' sampling strategies are taken (those by length as random, warned at
    // launch); another value is refused with the list.
    let c = cli(&["--train_sampling_strategy", "group_by_length"]).unwrap();
    assert_eq!(c.training.train_sampling_strategy, "group_by_length");
    let e = cli(&["--train_sampling_strategy", "by_size"]).unwrap_err();
    assert!(
        e.contains("train_sampling_strategy") && e.contains("sequential"),
        "{e}"
    );
    let e = cli(&["--lr_scheduler_type", "exponential"]).unwrap_err();
    assert!(
        e.contains("lr_scheduler_type") && e.contains("cosine"),
        "{e}"
    );
    // A schedule's keyword arguments are checked at parse time, the key named.
    let e = cli(&["--lr_scheduler_type", "cosine_with_min_lr"]).unwrap_err();
    assert!(e.contains("lr_scheduler_kwargs.min_lr_rate"), "{e}");
    let e = cli(&["--lr_scheduler_kwargs", r#"{"num_cycles": 2}"#]).unwrap_err();
    assert!(
        e.contains("lr_scheduler_kwargs.num_cycles") && e.contains("linear"),
        "{e}"
    );
    let e = cli(&["--packing_strategy", "ffd"]).unwrap_err();
    assert!(
        e.contains("packing_strategy") && e.contains("bfd_split"),
        "{e}"
    );
    let e = cli(&["--mixed_precision", "fp16"]).unwrap_err();
    assert!(e.contains("mixed_precision") && e.contains("bf16"), "{e}");
    let e = cli(&["--mixed_precision", "fp64"]).unwrap_err();
    assert!(
        e.contains("mixed_precision") && e.contains("no or bf16"),
        "{e}"
    );
    // bf16 is accepted (on CPU too), by Accelerate's name or TRL's flag.
    for flags in [&["--mixed_precision", "bf16"][..], &["--bf16"][..]] {
        let c = cli(flags).unwrap();
        assert_eq!(
            c.training.compute_dtype().unwrap(),
            candle_core::DType::BF16,
            "{flags:?}"
        );
    }
    let e = cli(&["--per_device_train_batch_size", "0"]).unwrap_err();
    assert!(e.contains("per_device_train_batch_size"), "{e}");
    let e = cli(&["--packing", "maybe"]).unwrap_err();
    assert!(e.contains("packing") && e.contains("boolean"), "{e}");
}

/// Unset in the training arguments, the precision comes from the launcher's
/// ACCELERATE_MIXED_PRECISION, as transformers' Trainer defers to it; set, it wins. (The only
/// test of this binary that reads the variable.)
#[test]
fn mixed_precision_follows_the_launcher_unless_set() {
    use candle_core::DType;
    std::env::set_var("ACCELERATE_MIXED_PRECISION", "bf16");
    let unset = SFTConfig::default().training.compute_dtype();
    let explicit = cli(&["--mixed_precision", "no"])
        .unwrap()
        .training
        .compute_dtype();
    std::env::set_var("ACCELERATE_MIXED_PRECISION", "fp16");
    let refused = SFTConfig::default()
        .training
        .compute_dtype()
        .unwrap_err()
        .to_string();
    std::env::remove_var("ACCELERATE_MIXED_PRECISION");
    assert_eq!(unset.unwrap(), DType::BF16);
    assert_eq!(explicit.unwrap(), DType::F32);
    assert!(
        refused.contains("ACCELERATE_MIXED_PRECISION") && refused.contains("bf16"),
        "{refused}"
    );
    assert_eq!(
        SFTConfig::default().training.compute_dtype().unwrap(),
        DType::F32
    );
}

#[test]
fn trl_recipes_are_read_with_their_extra_keys() {
    // A YAML written for `trl sft`: keys we implement, aliases of them, keys without effect
    // here (named once), and keys whose absence would change what is trained (refused).
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("recipe.yaml");
    std::fs::write(
        &yaml,
        "model_name_or_path: assets/tiny/model\nlearning_rate: 2.0e-5\nbf16: true\n\
         report_to: wandb\nrun_name: sft-run\nevaluation_strategy: epoch\nlogging_first_step: true\n\
         eval_dataset_name: assets/tiny/data/eval.jsonl\n\
         dataset_text_field: text\noptim: adamw_torch_fused\nactivation_checkpointing: true\n\
         max_seq_length: 512\npush_to_hub: false\nuse_peft: false\nlora_r: 16\n",
    )
    .unwrap();
    let (c, ignored) = SFTConfig::read(&yaml).unwrap();
    assert!(
        c.training.bf16 && c.training.gradient_checkpointing,
        "aliases applied"
    );
    assert_eq!(c.training.max_length, 512);
    // transformers 4's name of eval_strategy; logging_first_step is a field.
    assert_eq!(c.training.eval_strategy.as_deref(), Some("epoch"));
    assert!(c.training.logging_first_step);
    assert!(c.other.is_empty());
    for key in ["report_to", "run_name", "push_to_hub"] {
        assert!(
            ignored.iter().any(|l| l.starts_with(&format!("{key}: "))),
            "{key} not named: {ignored:?}"
        );
    }
    // A value that says what training here does anyway (AdamW) is not called ignored.
    assert!(
        !ignored.iter().any(|l| l.starts_with("optim: ")),
        "{ignored:?}"
    );
    // peft's target_parameters, read as TRL's key (gpt-oss's fused experts).
    std::fs::write(
        &yaml,
        "lora_target_parameters: [mlp.experts.gate_up_proj]\n",
    )
    .unwrap();
    let (c, _) = SFTConfig::read(&yaml).unwrap();
    let lora = SFTConfig {
        training: trl_runtime::train::TrainingArguments {
            use_peft: true,
            ..c.training
        },
        ..c
    };
    let parameters = lora.training.lora("gpt_oss").unwrap().target_parameters;
    assert_eq!(parameters, ["mlp.experts.gate_up_proj"]);
    for (line, expect) in [
        ("load_in_4bit: true\n", "quantized"),
        ("fp16: true\n", "bf16"),
        ("optim: sgd\n", "AdamW"),
        ("learning_rat: 1.0\n", "did you mean `learning_rate`"),
        ("average_tokens_across_devices: false\n", "all ranks"),
    ] {
        std::fs::write(&yaml, line).unwrap();
        let e = SFTConfig::read(&yaml).unwrap_err().to_string();
        let key = line.split(':').next().unwrap();
        assert!(
            e.contains("recipe.yaml") && e.contains(key) && e.contains(expect),
            "{line}: {e}"
        );
    }
    // SFT reads its text from the column dataset_text_field names; DPO's rows have none.
    std::fs::write(&yaml, "dataset_text_field: content\n").unwrap();
    assert_eq!(
        SFTConfig::read(&yaml).unwrap().0.dataset_text_field,
        "content"
    );
    let e = trl_runtime::train::DPOConfig::read(&yaml)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("recipe.yaml") && e.contains("dataset_text_field") && e.contains("DPOConfig"),
        "{e}"
    );
}

/// HfArgumentParser's `--no_KEY` for booleans that default to true, as TRL's scripts document
/// (`--no_remove_unused_columns` in dpo.py's example): KEY false, for our fields and for the
/// keys that have no field.
#[test]
fn no_prefixed_flags_set_booleans_false() {
    let flags = trl_runtime::train::SftCli::parse_trl_from(
        [
            "sft",
            "--no_gradient_checkpointing",
            "--no-remove-unused-columns",
            "--no_packing",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let mut c = SFTConfig {
        packing: true,
        ..SFTConfig::default()
    };
    let ignored = flags.apply(&mut c).unwrap();
    assert!(!c.training.gradient_checkpointing && !c.packing);
    assert!(
        ignored.iter().any(|l| l.contains("remove_unused_columns")),
        "{ignored:?}"
    );
    // A name that is no key stays an error.
    assert!(cli(&["--no_such_key"]).is_err());
}

/// TRL's example config's `env:` mapping: the variables are set in the process before
/// training, as `trl sft --config` sets them; anything but a mapping of scalars is refused.
#[test]
fn a_config_files_env_mapping_sets_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("example_config.yaml");
    std::fs::write(
        &yaml,
        "env:\n  TRL_TEST_CONFIG_ENV: 0\n  TRL_TEST_CONFIG_FLAG: true\nreport_to:\n  none\n\
         learning_rate:\n  0.0001\nlr_scheduler_type:\n  cosine\n",
    )
    .unwrap();
    let (c, _) = SFTConfig::read(&yaml).unwrap();
    assert_eq!(c.training.learning_rate, 1e-4);
    assert_eq!(std::env::var("TRL_TEST_CONFIG_ENV").as_deref(), Ok("0"));
    assert_eq!(std::env::var("TRL_TEST_CONFIG_FLAG").as_deref(), Ok("True"));
    std::fs::write(&yaml, "env: [CUDA_VISIBLE_DEVICES]\n").unwrap();
    let e = SFTConfig::read(&yaml).unwrap_err().to_string();
    assert!(e.contains("env") && e.contains("mapping"), "{e}");
}

#[test]
fn gradient_checkpointing_is_on_by_default_as_in_trl() {
    // TRL's SFTConfig turns it on; a recipe or flag turns it off.
    assert!(SFTConfig::default().training.gradient_checkpointing);
    for off in [
        &["sft", "--gradient_checkpointing", "false"][..],
        &["sft", "--gradient-checkpointing=False"][..],
    ] {
        let cli = trl_runtime::train::SftCli::parse_trl_from(off.iter().map(|s| s.to_string()));
        let mut c = SFTConfig::default();
        cli.apply(&mut c).unwrap();
        assert!(!c.training.gradient_checkpointing, "{off:?}");
    }
}

#[test]
fn trl_flags_without_a_field_are_taken_like_file_keys() {
    let cli = trl_runtime::train::SftCli::parse_trl_from(
        [
            "sft",
            "--report_to",
            "wandb",
            "--max-seq-length",
            "128",
            "--learning_rate",
            "1e-3",
            "--activation_checkpointing",
            "--eval_strategy=steps",
            "--eval_dataset_name=eval.jsonl",
            "--run_name",
            "sft-run",
        ]
        .map(String::from),
    );
    let mut c = SFTConfig::default();
    let ignored = cli.apply(&mut c).unwrap();
    assert_eq!(
        (c.training.max_length, c.training.learning_rate),
        (128, 1e-3)
    );
    assert!(c.training.gradient_checkpointing);
    assert_eq!(c.training.eval_strategy.as_deref(), Some("steps"));
    assert!(
        ignored.iter().any(|l| l.starts_with("report_to: "))
            && ignored.iter().any(|l| l.starts_with("run_name: ")),
        "{ignored:?}"
    );
    let cli =
        trl_runtime::train::SftCli::parse_trl_from(["sft", "--load_in_4bit"].map(String::from));
    let e = cli
        .apply(&mut SFTConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("load_in_4bit") && e.contains("quantized"), "{e}");
    // TRL's PEFT flags are fields; list flags take several values as TRL's argparse does.
    let args = [
        "sft",
        "--use_peft",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "--lora_r",
        "8",
    ];
    let (config, _) = trl_runtime::train::SftCli::parse_trl_from(args.map(String::from))
        .resolve()
        .unwrap();
    let t = &config.training;
    assert!(t.use_peft && t.lora_r == 8, "{t:?}");
    let targets = t.lora_target_modules.as_ref().unwrap();
    assert_eq!(targets.0, ["q_proj", "v_proj"]);
    let dora = ["sft", "--use_peft", "--use_dora"].map(String::from);
    let (config, _) = trl_runtime::train::SftCli::parse_trl_from(dora)
        .resolve()
        .unwrap();
    assert!(config.training.lora("qwen2").is_some_and(|l| l.dora));
}

/// A program's own defaults (the `sft` example's) stand without `--config`, under the flags;
/// with `--config` the file replaces them; keys without effect are named by source.
#[test]
fn flags_go_over_a_programs_own_defaults() {
    let mut defaults = SFTConfig::default();
    defaults.training.learning_rate = 2e-3;
    defaults.training.max_length = 64;
    let parse = |args: &[&str]| {
        SftCli::try_parse_trl_from(
            std::iter::once("sft")
                .chain(args.iter().copied())
                .map(String::from),
        )
        .unwrap()
    };
    let (c, ignored) = parse(&["--max_length", "32", "--report_to", "wandb"])
        .resolve_over(defaults.clone())
        .unwrap();
    assert_eq!(
        (c.training.learning_rate, c.training.max_length),
        (2e-3, 32)
    );
    assert!(
        ignored
            .iter()
            .any(|l| l.starts_with("command line: ignored: report_to")),
        "{ignored:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sft.yaml");
    std::fs::write(&file, "learning_rate: 1.0e-4\nlogging_dir: runs\n").unwrap();
    let (c, ignored) = parse(&["--config", file.to_str().unwrap()])
        .resolve_over(defaults)
        .unwrap();
    assert_eq!(
        (c.training.learning_rate, c.training.max_length),
        (1e-4, 1024)
    );
    let from_file = format!("{}: ignored: logging_dir", file.display());
    assert!(
        ignored.iter().any(|l| l.starts_with(&from_file)),
        "{ignored:?}"
    );
}

/// A dump of TRL 1.16's own SFTConfig and DPOConfig, every field at its default
/// (tests/fixtures/trl_defaults, scripts/make_trl_defaults_fixture.py), loads: `null` leaves a
/// key unset (bf16 among them, with a note that TRL turns it on), `pad_to_multiple_of: auto`
/// pads nothing off AWS Neuron, and every other key is applied or named.
#[test]
fn a_dump_of_trls_defaults_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/trl_defaults");
    let sft = SFTConfig::from_file(dir.join("sft.yaml")).unwrap();
    assert_eq!(sft.pad_to_multiple_of.0, None);
    assert!(!sft.training.bf16, "unset: the launch decides");
    assert_eq!(sft.loss_type, "nll");
    let dpo = trl_runtime::train::DPOConfig::from_file(dir.join("dpo.yaml")).unwrap();
    assert_eq!(dpo.pad_to_multiple_of.0, None);
}
