//! `cargo trl new` then build and launch the scaffold, as a user would: it must train offline
//! out of the box. The scaffold shares this workspace's target directory so that its
//! dependencies are not compiled again.

mod common;

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");

/// `cargo trl new ARGS` in `dir`; asserts it succeeded and returns what it printed.
fn new(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .current_dir(dir)
        .arg("new")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `cargo trl launch ARGS` in the scaffold `krate` (offline; it builds in this workspace's
/// target directory, which its .cargo/config.toml names); asserts it succeeded and returns
/// its output.
fn launch_in(krate: &Path, args: &[&str]) -> String {
    let run = Command::new(BIN)
        .current_dir(krate)
        .env_remove("CARGO_TARGET_DIR")
        .env("CARGO_NET_OFFLINE", "true")
        .args(common::LAUNCH)
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "{text}");
    text
}

/// The scaffold `krate` launched on `multi_cpu` for `steps` steps, each logged: its output and
/// its metrics.jsonl.
fn launch_logging(krate: &Path, steps: usize) -> (String, String) {
    let steps = steps.to_string();
    let args = ["--profile", "multi_cpu", "--", "--max_steps", &steps];
    let text = launch_in(krate, &[&args[..], &["--logging_steps", "1"]].concat());
    let metrics = std::fs::read_to_string(krate.join("output/metrics.jsonl")).unwrap();
    (text, metrics)
}

#[test]
fn new_then_launch_the_scaffold() {
    // Outside any workspace, as after `cargo install --path cargo-trl`: until trl-runtime is
    // published, the scaffold depends on the source this cargo-trl was built from.
    let tmp = tempfile::tempdir().unwrap();
    let runtime = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../trl-runtime")
        .canonicalize()
        .unwrap();
    let said = new(tmp.path(), &["my-sft"]);
    assert!(
        said.contains("the source this cargo-trl was built from"),
        "{said}"
    );
    let krate = tmp.path().join("my-sft");
    for f in [
        "Cargo.toml",
        "src/main.rs",
        "sft.yaml",
        "README.md",
        "data/train.jsonl",
        "model/model.safetensors",
        "model/tokenizer.json",
    ] {
        assert!(krate.join(f).exists(), "{f} missing");
    }
    // It builds where this workspace built: nothing compiled twice.
    let config = std::fs::read_to_string(krate.join(".cargo/config.toml")).unwrap();
    let target = runtime.parent().unwrap().join("target");
    assert!(
        config.contains(&format!("target-dir = {:?}", target.display().to_string())),
        "{config}"
    );
    let toml = std::fs::read_to_string(krate.join("Cargo.toml")).unwrap();
    assert!(
        toml.contains("name = \"my-sft\"")
            && toml.contains(&format!("path = {:?}", runtime.display().to_string())),
        "{toml}"
    );

    // Refuses to overwrite.
    let again = Command::new(BIN)
        .current_dir(tmp.path())
        .args(["new", "my-sft"])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let bad = Command::new(BIN)
        .current_dir(tmp.path())
        .args(["new", "9lives"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));

    let text = launch_in(
        &krate,
        &[
            "--profile",
            "multi_cpu",
            "--",
            "--max_steps",
            "20",
            "--eval_steps",
            "20",
            "--eval_generation_samples",
            "4",
            "--save_steps",
            "20",
        ],
    );
    assert!(
        text.contains("[rank 0] held-out accuracy: before"),
        "{text}"
    );
    assert!(
        krate
            .join("output/checkpoint-20/model.safetensors")
            .exists(),
        "{text}"
    );
    // `--profile auto` plans what the program trains: its sft.yaml (read by default), which
    // the launcher learns by asking the built program.
    let auto = launch_in(&krate, &["--profile", "auto", "--use_cpu", "--dry_run"]);
    assert!(
        auto.contains("auto: planning model at max_length 64, per_device_train_batch_size 16"),
        "{auto}"
    );
}

#[test]
fn new_plain_candle_scaffold_trains_its_own_model_sharded() {
    // `--model plain-candle`: the model's code is in the project (src/model.rs) and trains
    // under FSDP + tensor parallelism like the built-in one.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-model", "--model", "plain-candle"]);
    let krate = tmp.path().join("my-model");
    let model_rs = std::fs::read_to_string(krate.join("src/model.rs")).unwrap();
    assert!(model_rs.contains("impl CausalModel for Phi"), "{model_rs}");
    let main_rs = std::fs::read_to_string(krate.join("src/main.rs")).unwrap();
    assert!(main_rs.contains("Trainer::<model::Phi>::load"), "{main_rs}");
    let config = std::fs::read_to_string(krate.join("model/config.json")).unwrap();
    assert!(config.contains("PhiForCausalLM"), "{config}");

    let text = launch_in(
        &krate,
        &[
            "--profile",
            "fsdp2_tp_cpu",
            "--",
            "--max_steps",
            "4",
            "--eval_steps",
            "4",
            "--eval_generation_samples",
            "2",
            "--save_steps",
            "4",
        ],
    );
    assert!(
        text.contains(r#""strategy":"zero3""#) && text.contains(r#""tp":2"#),
        "{text}"
    );
    assert!(
        krate.join("output/checkpoint-4/model.safetensors").exists(),
        "{text}"
    );
}

#[test]
fn new_with_peft_trains_adapters() {
    // `--peft`: sft.yaml carries TRL's LoRA keys; the launched run saves a peft adapter.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-lora", "--peft"]);
    let krate = tmp.path().join("my-lora");
    let yaml = std::fs::read_to_string(krate.join("sft.yaml")).unwrap();
    assert!(yaml.contains("use_peft: true"), "{yaml}");
    let text = launch_in(
        &krate,
        &[
            "--profile",
            "zero3_cpu",
            "--",
            "--max_steps",
            "5",
            "--eval_dataset_name",
            "none",
            "--save_steps",
            "5",
        ],
    );
    assert!(text.contains("trainable of"), "{text}");
    let ckpt = krate.join("output/checkpoint-5");
    assert!(ckpt.join("adapter_model.safetensors").exists(), "{text}");
    assert!(!ckpt.join("model.safetensors").exists(), "{text}");
}

#[test]
fn new_with_the_dpo_trainer_trains_on_preferences() {
    // `--trainer dpo`: dpo.yaml and the preference pairs; the launched run logs TRL's DPO
    // metrics.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-dpo", "--trainer", "dpo"]);
    let krate = tmp.path().join("my-dpo");
    let yaml = std::fs::read_to_string(krate.join("dpo.yaml")).unwrap();
    assert!(yaml.contains("beta: 0.1"), "{yaml}");
    assert!(!krate.join("sft.yaml").exists());
    let (text, metrics) = launch_logging(&krate, 3);
    assert!(text.contains("held-out reward accuracy"), "{text}");
    assert!(metrics.contains("rewards/accuracies"), "{metrics}");
}

#[test]
fn new_with_the_grpo_trainer_scores_with_its_rust_reward() {
    // `--trainer grpo`: grpo.yaml names `exact_sum`, a Rust function in src/main.rs registered
    // as a reward; the launched run samples completions and logs that reward under TRL's names.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-grpo", "--trainer", "grpo"]);
    let krate = tmp.path().join("my-grpo");
    let main = std::fs::read_to_string(krate.join("src/main.rs")).unwrap();
    assert!(
        main.contains("fn exact_sum") && main.contains("register_reward(\"exact_sum\""),
        "{main}"
    );
    let yaml = std::fs::read_to_string(krate.join("grpo.yaml")).unwrap();
    assert!(yaml.contains("reward_funcs: [exact_sum]"), "{yaml}");
    let (text, metrics) = launch_logging(&krate, 2);
    assert!(text.contains("held-out reward"), "{text}");
    assert!(metrics.contains("rewards/exact_sum/mean"), "{metrics}");
}

#[test]
fn new_with_the_rloo_trainer_trains_with_a_leave_one_out_baseline() {
    // `--trainer rloo`: rloo.yaml (TRL's RLOOConfig keys, the Rust reward of src/main.rs);
    // the launched run logs RLOO's figures, the KL to the reference among them.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-rloo", "--trainer", "rloo"]);
    let krate = tmp.path().join("my-rloo");
    let main = std::fs::read_to_string(krate.join("src/main.rs")).unwrap();
    assert!(main.contains("RlooCli") && main.contains("Rloo"), "{main}");
    let yaml = std::fs::read_to_string(krate.join("rloo.yaml")).unwrap();
    assert!(yaml.contains("beta: 0.05"), "{yaml}");
    let (text, metrics) = launch_logging(&krate, 2);
    assert!(text.contains("RLOO:"), "{text}");
    assert!(
        metrics.contains("rewards/exact_sum/mean") && metrics.contains("\"kl\""),
        "{metrics}"
    );
}

#[test]
fn new_with_the_kto_trainer_trains_on_unpaired_rows() {
    // `--trainer kto`: kto.yaml (TRL's KTOConfig keys) over the bundled pairs, which KTO
    // unpairs, and a src/main.rs that trains `Kto`; the launched run logs KTO's figures.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-kto", "--trainer", "kto"]);
    let krate = tmp.path().join("my-kto");
    let main = std::fs::read_to_string(krate.join("src/main.rs")).unwrap();
    assert!(main.contains("KtoCli") && main.contains("Kto>"), "{main}");
    let yaml = std::fs::read_to_string(krate.join("kto.yaml")).unwrap();
    assert!(yaml.contains("desirable_weight: 1.0"), "{yaml}");
    assert!(krate.join("data/pref_train.jsonl").exists());
    let (text, metrics) = launch_logging(&krate, 2);
    assert!(text.contains("KTO:"), "{text}");
    assert!(
        metrics.contains("rewards/chosen") && metrics.contains("\"kl\""),
        "{metrics}"
    );
}

#[test]
fn new_with_the_reward_trainer_trains_a_classifier() {
    // `--trainer reward`: reward.yaml (TRL's RewardConfig keys) over the bundled pairs, and a
    // src/main.rs that trains `Reward` on the tiny model read as a sequence classifier; the
    // launched run logs the reward figures and saves a ...ForSequenceClassification.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-rm", "--trainer", "reward"]);
    let krate = tmp.path().join("my-rm");
    let main = std::fs::read_to_string(krate.join("src/main.rs")).unwrap();
    assert!(
        main.contains("RewardCli") && main.contains("SequenceClassifier<"),
        "{main}"
    );
    assert!(krate.join("reward.yaml").exists() && krate.join("data/pref_train.jsonl").exists());
    let (text, metrics) = launch_logging(&krate, 2);
    assert!(text.contains("Reward:"), "{text}");
    assert!(
        metrics.contains("\"accuracy\"") && metrics.contains("mean_reward"),
        "{metrics}"
    );
    let config = std::fs::read_to_string(krate.join("output/checkpoint-2/config.json"))
        .unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(config.contains("ForSequenceClassification"), "{config}");
}

#[test]
fn new_with_the_distillation_trainer_distils_from_its_teacher() {
    // `--trainer distillation`: distillation.yaml (TRL's DistillationConfig keys), the prompts,
    // the bundled teacher, and a src/main.rs that trains `Distillation`; the launched run
    // holds the teacher, logs the divergence and the student's entropy, and saves the student.
    let tmp = tempfile::tempdir().unwrap();
    new(tmp.path(), &["my-distil", "--trainer", "distillation"]);
    let krate = tmp.path().join("my-distil");
    let main = std::fs::read_to_string(krate.join("src/main.rs")).unwrap();
    assert!(
        main.contains("DistillationCli") && main.contains("Distillation"),
        "{main}"
    );
    assert!(krate.join("distillation.yaml").exists());
    assert!(krate.join("teacher/model.safetensors").exists());
    let (text, metrics) = launch_logging(&krate, 2);
    assert!(text.contains("distillation: teacher teacher"), "{text}");
    assert!(
        metrics.contains("\"entropy\"") && metrics.contains("completions/mean_length"),
        "{metrics}"
    );
    assert!(
        krate.join("output/checkpoint-2/model.safetensors").exists(),
        "{text}"
    );
    // The held-out divergence, printed as a loss (no accuracy to show).
    assert!(
        text.contains("held-out loss: before 0.") && !text.contains("n/a"),
        "{text}"
    );
}
