//! The real binary: profiles list, profile display, config checks with their exit codes.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn lists_every_profile_both_ways_of_calling() {
    for args in [&["profiles"][..], &["trl", "profiles"]] {
        let (code, out, _) = run(args);
        assert_eq!(code, 0);
        for name in ["zero3", "fsdp2", "alst_ulysses_4gpu", "multi_cpu"] {
            assert!(out.contains(name), "{out}");
        }
        assert!(!out.contains("invalid"), "{out}");
        assert!(out.contains("dp_shard=2") && out.contains("sp=2"), "{out}");
    }
    let (code, out, _) = run(&["profiles", "--show", "multi_cpu"]);
    assert_eq!(code, 0);
    assert!(out.contains("distributed_type: MULTI_CPU"));
    let (code, _, err) = run(&["profiles", "--show", "zero4"]);
    assert_eq!(code, 1);
    assert!(err.contains("zero3"), "{err}");
}

#[test]
fn check_reports_bad_files_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "distributed_type: MULTI_CPU\nnum_processes: 2\nnum_procs: 3\n",
    )
    .unwrap();
    let (code, out, err) = run(&["check", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("MULTI_CPU") && err.contains("num_procs"),
        "{out}{err}"
    );
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "distributed_type: MULTI_CPU\nmixed_precision: fp64\n").unwrap();
    let (code, _, err) = run(&["check", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.yaml") && err.contains("mixed_precision") && err.contains("bf16"),
        "{err}"
    );
    let (code, _, _) = run(&["no-such-command"]);
    assert_eq!(code, 2);
}

#[test]
fn every_profile_file_is_embedded() {
    let (_, out, _) = run(&["profiles"]);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../templates/profiles");
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry
            .unwrap()
            .path()
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name} is not embedded in cargo-trl"
        );
    }
}

#[test]
fn env_and_profiles_show() {
    let (code, out, _) = run(&["env"]);
    assert_eq!(code, 0);
    for field in [
        "cargo-trl:",
        "cpu cores:",
        "cpu f32 matmul:",
        "gpus:",
        "nvidia driver:",
        "cuda driver api:",
        "nccl:",
        "default launch config:",
    ] {
        assert!(out.contains(field), "{out}");
    }
    // NCCL is reported by version where it loads, else with what to install.
    let nccl = out.lines().find(|l| l.starts_with("nccl:")).unwrap();
    assert!(
        nccl.contains("libnccl.so") && (nccl.contains("nvidia-nccl") || nccl.contains("nccl: 2.")),
        "{nccl}"
    );
    let (code, out, _) = run(&["profiles", "show", "fsdp2"]);
    assert_eq!(code, 0);
    assert!(out.contains("fsdp_version: 2"));
    let (code, _, err) = run(&["profiles", "show"]);
    assert_eq!(code, 2);
    assert!(err.contains("needs a profile name"), "{err}");
}

#[test]
fn config_wizard_and_flags_write_what_launch_reads() {
    use std::io::Write;
    let home = tempfile::tempdir().unwrap();
    // The wizard, answered on stdin (one re-ask for an invalid ZeRO stage).
    let mut child = Command::new(BIN)
        .arg("config")
        .env("XDG_CONFIG_HOME", home.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"1\nyes\nDEEPSPEED\n5\n3\n1\n1\n2\n4\nno\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("use 0, 1, 2 or 3"));
    let written = home.path().join("cargo-trl/default_config.yaml");
    let yaml = std::fs::read_to_string(&written).unwrap();
    assert!(
        yaml.contains("zero_stage: 3")
            && yaml.contains("parallelism_config_sp_size: 2")
            && yaml.contains("num_processes: 4"),
        "{yaml}"
    );
    // `launch` with nothing given reads it.
    let hf_home = home.path().join("hf");
    let plan = || {
        let o = Command::new(BIN)
            .args(["launch", "--dry-run", "launch_worker"])
            .env("XDG_CONFIG_HOME", home.path())
            .env("HF_HOME", &hf_home)
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let p = plan();
    assert!(
        p.contains("world 4") && p.contains("dp_shard=2 cp=1 sp=2"),
        "{p}"
    );
    // What `accelerate config` wrote ($HF_HOME/accelerate/default_config.yaml) comes first.
    std::fs::create_dir_all(hf_home.join("accelerate")).unwrap();
    std::fs::write(
        hf_home.join("accelerate/default_config.yaml"),
        "distributed_type: MULTI_CPU\nnum_processes: 3\nuse_cpu: true\n",
    )
    .unwrap();
    let p = plan();
    assert!(p.contains("world 3") && p.contains("MULTI_CPU"), "{p}");

    // The non-interactive form, from a profile plus flags.
    let file = home.path().join("fsdp.yaml");
    let (code, _, err) = run(&[
        "config",
        "--profile",
        "fsdp2_cpu",
        "--num_processes",
        "4",
        "--parallelism_config_tp_size",
        "2",
        "--parallelism_config_dp_shard_size",
        "2",
        "--output",
        file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = run(&["check", file.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(
        out.contains("FSDP") && out.contains("dp_shard=2") && out.contains("tp=2"),
        "{out}"
    );
    // An impossible shape is refused and nothing is written.
    let bad = home.path().join("bad.yaml");
    let (code, _, err) = run(&[
        "config",
        "--non_interactive",
        "--num_processes",
        "4",
        "--parallelism_config_tp_size",
        "3",
        "--output",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("tp=3") && !bad.exists(), "{err}");
}

#[test]
fn version_and_a_gpu_plan_on_a_machine_without_gpus() {
    let (code, out, _) = run(&["trl", "--version"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("cargo-trl "), "{out}");
    // A dry run prints a GPU profile's plan here too (with a warning), so a cluster config can
    // be checked on a laptop; a real launch refuses (launch.rs tests it).
    let gpus = std::fs::read_dir("/dev")
        .map(|d| d.filter_map(|e| e.ok()).any(|e| e.file_name() == "nvidia0"))
        .unwrap_or(false);
    if gpus {
        return;
    }
    let (code, out, err) = run(&["launch", "--profile", "multi_gpu", "--dry-run", "/bin/true"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning:") && err.contains("GPU(s) are present"),
        "{err}"
    );
    assert!(
        out.contains("mesh: dp_replicate=8") && out.contains("strategy: ddp"),
        "{out}"
    );
}

#[test]
fn accelerate_launch_flags_by_their_names() {
    // `accelerate launch`'s strategy flags, in either spelling, change the plan the workers get.
    let (code, out, err) = run(&[
        "launch",
        "--profile",
        "multi_cpu",
        "--use-fsdp",
        "--fsdp_activation_checkpointing",
        "--fsdp-state-dict-type",
        "SHARDED_STATE_DICT",
        "--num_cpu_threads_per_process",
        "1",
        "--dynamo_backend",
        "inductor",
        "--dry-run",
        "/bin/true",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("(FSDP)") && out.contains("dp_shard=2"),
        "{out}"
    );
    assert!(
        out.contains("strategy: zero3 (activation_checkpointing=true"),
        "{out}"
    );
    assert!(
        out.contains("FSDP_ACTIVATION_CHECKPOINTING=true")
            && out.contains("FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT")
            && out.contains("OMP_NUM_THREADS=1"),
        "{out}"
    );
    assert!(err.contains("--dynamo_backend inductor: ignored"), "{err}");
    let (code, out, err) = run(&[
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--use_deepspeed",
        "--zero_stage",
        "2",
        "--dry-run",
        "/bin/true",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("strategy: zero2") && out.contains("ACCELERATE_USE_CPU=true"),
        "{out}"
    );
    // Errors name the flag.
    for (args, expect) in [
        (
            &["--use_fsdp", "--fsdp_sharding_strategy", "FullShard"][..],
            "--fsdp_sharding_strategy: 'FullShard' is not accepted",
        ),
        (
            &["--zero_stage", "3"][..],
            "--zero_stage applies to DeepSpeed",
        ),
        (
            &["--use_fsdp", "--use_deepspeed"][..],
            "choose one distributed type",
        ),
    ] {
        let mut all = vec!["launch", "--profile", "multi_cpu"];
        all.extend_from_slice(args);
        all.extend(["--dry-run", "/bin/true"]);
        let (code, _, err) = run(&all);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

/// `cargo trl plan --trainer dpo` counts what a DPO worker holds (the worker's estimate uses
/// the same rule, `Setup::apply` of the trainer's `Workload`): twice the sequences per micro-batch, and
/// with `--sync_ref_model` a copy of the weights; TR-DPO without DPO is refused.
#[test]
fn the_plan_counts_preference_pairs() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny/model");
    let plan = |extra: &[&str]| {
        let base = ["plan", "--model", root, "--seq", "512", "--batch", "4"];
        let more = ["--gradient_checkpointing", "false", "--explain"];
        run(&[&base[..], &more, extra].concat())
    };
    let tokens = |out: &str| -> String {
        let line = out
            .lines()
            .find(|l| l.contains("activations:"))
            .unwrap_or("");
        line.split_whitespace().nth(1).unwrap_or("").to_string()
    };
    let (code, sft, err) = plan(&[]);
    assert_eq!(code, 0, "{err}");
    let (_, dpo, _) = plan(&["--trainer", "dpo"]);
    assert_eq!(tokens(&sft), "2048", "{sft}");
    assert_eq!(tokens(&dpo), "4096", "{dpo}");
    assert!(!dpo.contains("reference:"), "{dpo}");
    let (_, tr, _) = plan(&["--trainer", "dpo", "--sync_ref_model"]);
    assert!(tr.contains("reference: a copy of the weights"), "{tr}");
    let (code, _, err) = plan(&["--sync_ref_model"]);
    assert!(code != 0 && err.contains("--trainer dpo"), "{err}");
    // GRPO holds a reference only with a KL term (beta > 0; TRL's default is 0).
    let (code, grpo, err) = plan(&["--trainer", "grpo"]);
    assert_eq!(code, 0, "{err}");
    assert!(!grpo.contains("reference:"), "{grpo}");
    let (_, kl, _) = plan(&["--trainer", "grpo", "--beta", "0.04"]);
    assert!(kl.contains("reference: a copy of the weights"), "{kl}");
    let (code, _, err) = plan(&["--beta", "0.1"]);
    assert!(
        code != 0 && err.contains("--beta") && err.contains("--trainer grpo"),
        "{err}"
    );
    // A reward model named by its directory is held whole on every rank, in the compute dtype.
    let rm = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny-qwen3/reward");
    let args = ["--trainer", "grpo", "--reward_funcs", "accuracy_reward", rm];
    let (code, with_rm, err) = plan(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        with_rm.contains(&format!("reward models held whole: 4 x {RM_PARAMS}")),
        "{with_rm}"
    );
    let (code, _, err) = plan(&["--reward_funcs", rm]);
    assert!(code != 0 && err.contains("--trainer grpo"), "{err}");
    // Distillation's teacher is counted by its checkpoint's parameters (another size than the
    // student's; how each strategy holds it: the estimate's unit test); the flag is refused
    // for a trainer without a teacher.
    let teacher = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny/teacher");
    let args = [
        "--trainer",
        "distillation",
        "--teacher_model_name_or_path",
        teacher,
    ];
    let (code, distil, err) = plan(&args);
    assert_eq!(code, 0, "{err}");
    let held = format!("frozen model held as the trained one ({TEACHER_PARAMS} parameters)");
    assert!(distil.contains(&held), "{distil}");
    let (code, _, err) = plan(&["--teacher_model_name_or_path", teacher]);
    assert!(code != 0 && err.contains("--trainer distillation"), "{err}");
}

/// The parameters of assets/tiny/teacher (its safetensors header).
const TEACHER_PARAMS: usize = 359904;

/// The parameters of assets/tiny-qwen3/reward (its safetensors header).
const RM_PARAMS: usize = 92352;

/// `cargo trl plan --use_peft` counts the adapters its targets name (gpt-oss's fused experts
/// through `--lora_target_parameters`, one A and B per expert of rank r); a target the
/// model does not have is an error naming the flag, not a plan without adapters.
#[test]
fn the_plan_counts_adapters_on_parameters_and_refuses_unknown_targets() {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../assets/configs/gpt-oss-20b.json"
    );
    let plan = |extra: &[&str]| {
        let base = [
            "plan", "--model", config, "--seq", "4096", "--batch", "1", "--gpus", "8",
        ];
        run(&[&base[..], &["--use_peft"], extra].concat())
    };
    // The gradient column (fits, profile, 6 sizes, ckpt, params, grads): the adapters'.
    let grads = |out: &str| -> String {
        let line = out.lines().find(|l| l.starts_with("fits")).unwrap_or("");
        line.split_whitespace().nth(10).unwrap_or("").to_string()
    };
    let (code, attention, err) = plan(&[]);
    assert_eq!(code, 0, "{err}");
    let experts = [
        "--lora_target_parameters",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    ];
    // peft adapts parameters without dropout, and refuses TRL's default 0.05 there.
    let (code, _, err) = plan(&experts);
    assert!(code != 0 && err.contains("lora_dropout"), "{err}");
    let (code, both, err) = plan(&[&experts[..], &["--lora_dropout", "0"]].concat());
    assert_eq!(code, 0, "{err}");
    assert_ne!(grads(&attention), grads(&both), "{attention}\n{both}");
    let (code, _, err) = plan(&["--lora_target_parameters", "mlp.experts.nothing"]);
    assert!(
        code != 0
            && err.contains("lora_target_parameters")
            && err.contains("mlp.experts.gate_up_proj"),
        "{err}"
    );
}

/// `cargo trl plan` counts expert parallelism for a mixture of experts: layouts with an ep
/// size (dividing the 128 experts and the data-parallel ranks, out of dp_shard under ZeRO /
/// FSDP), each rank's share of the experts in its state; the pick names
/// `--parallelism_config_ep_size` when ep is fastest. A dense model plans ep 1 only.
#[test]
fn the_plan_counts_expert_parallelism() {
    let config = |name: &str| {
        format!(
            "{}/../assets/configs/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        )
    };
    let plan = |name: &str| {
        let model = config(name);
        let args = [
            "plan", "--model", &model, "--seq", "4096", "--batch", "1", "--gpus", "8",
        ];
        let (code, out, err) = run(&[&args[..], &["--gpu_memory", "80GiB", "--all"]].concat());
        assert_eq!(code, 0, "{err}");
        out
    };
    // (profile, dp_shard, ep, params) of every layout.
    let rows = |out: &str| -> Vec<(String, usize, usize, String)> {
        out.lines()
            .filter(|l| l.starts_with("fits") || l.starts_with("OOM"))
            .map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                (
                    w[1].to_string(),
                    w[3].parse().unwrap(),
                    w[7].parse().unwrap(),
                    w[9].to_string(),
                )
            })
            .collect()
    };
    let moe = plan("qwen3-30b-a3b");
    assert!(moe.lines().nth(1).unwrap().contains(" ep "), "{moe}");
    let all = rows(&moe);
    let eps: std::collections::BTreeSet<usize> = all.iter().map(|r| r.2).collect();
    assert!(eps.contains(&2) && eps.contains(&8), "{moe}");
    for (profile, shard, ep, _) in &all {
        assert!(128 % ep == 0, "{moe}");
        if ["zero", "fsdp"].iter().any(|p| profile.starts_with(p)) {
            assert!(shard % ep == 0, "{profile} dp_shard {shard} ep {ep}: {moe}");
        }
    }
    // DDP over 8 GPUs: each ep keeps a share of the experts, so the weights shrink with it.
    // GiB of weights per GPU (every row of this model's is in G).
    let ddp = |ep: usize| -> f64 {
        let found = all
            .iter()
            .find(|r| r.0 == "multi_gpu" && r.1 == 1 && r.2 == ep);
        let gib = found.and_then(|r| r.3.strip_suffix('G')?.parse().ok());
        gib.unwrap_or_else(|| panic!("no multi_gpu row of ep {ep} in GiB: {moe}"))
    };
    // The experts are about 95% of Qwen3-30B-A3B: ep 8 keeps about a sixth of the weights.
    let share = ddp(8) / ddp(1);
    assert!(
        share > 0.1 && share < 0.25,
        "ep 8 keeps {share:.3} of the weights: {moe}"
    );
    let pick = moe.lines().find(|l| l.starts_with("pick:")).unwrap();
    let best = moe.lines().find(|l| l.starts_with("fits")).unwrap();
    let best_ep: usize = best.split_whitespace().nth(7).unwrap().parse().unwrap();
    assert_eq!(
        pick.contains("--parallelism_config_ep_size"),
        best_ep > 1,
        "{moe}"
    );
    // --explain says what ep holds and moves.
    let model = config("qwen3-30b-a3b");
    let args = [
        "plan", "--model", &model, "--seq", "4096", "--batch", "1", "--gpus", "8",
    ];
    let (code, out, err) = run(&[&args[..], &["--gpu_memory", "80GiB", "--explain"]].concat());
    assert_eq!(code, 0, "{err}");
    if best_ep > 1 {
        let want = format!(
            "ep {best_ep}: {} of 128 experts per sparse layer",
            128 / best_ep
        );
        assert!(
            out.contains(&want) && out.contains("all-to-alls a step send"),
            "{out}"
        );
    }
    let dense = rows(&plan("llama-3.1-8b"));
    assert!(dense.iter().all(|r| r.2 == 1));
}

/// `cargo trl plan` reads TRL's LoRA flags as TRL does: `--use_peft` alone or with a value,
/// `--lora_dropout` 0.05 by default, whose copy of each adapted layer's input the plan counts.
#[test]
fn the_plan_reads_trls_lora_flags() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny/model");
    let plan = |extra: &[&str]| {
        let base = ["plan", "--model", root, "--seq", "512", "--batch", "4"];
        run(&[&base[..], &["--gradient_checkpointing", "false"], extra].concat())
    };
    // The first layout's row without its tokens/s (timed).
    let first = |out: &str| -> String {
        let line = out.lines().find(|l| l.starts_with("fits")).unwrap_or("");
        let cols: Vec<&str> = line.split_whitespace().collect();
        cols[..cols.len().saturating_sub(1)].join(" ")
    };
    let (code, bare, err) = plan(&["--use_peft"]);
    assert_eq!(code, 0, "{err}");
    let (code, valued, err) = plan(&["--use_peft", "true"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        bare.contains("LoRA r 16") && first(&bare) == first(&valued),
        "{bare}\n{valued}"
    );
    let (code, off, err) = plan(&["--use_peft", "false"]);
    assert!(code == 0 && !off.contains("LoRA"), "{err}");
    let (_, no_dropout, _) = plan(&["--use_peft", "--lora_dropout", "0"]);
    assert_ne!(first(&bare), first(&no_dropout), "{bare}\n{no_dropout}");
    let (code, _, err) = plan(&["--use_peft", "--lora_dropout", "1"]);
    assert!(code != 0 && err.contains("--lora_dropout"), "{err}");
}

/// The README's dry-run command, as written, from the repository root: the plan of the
/// bundled job without building it.
#[test]
fn the_readme_dry_run_prints_the_plan() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let line = "cargo trl launch --profile multi_cpu --dry-run sft";
    assert!(readme.contains(line), "README.md shows `{line}`");
    let out = Command::new(BIN)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .args(line.split_whitespace().skip(1))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("mesh: dp_replicate=2") && text.contains("strategy: ddp"),
        "{text}"
    );
}

/// A generation round in the plan: its KV cache (rows x tokens x layers x kv heads x head dim
/// x 2 x 2 bytes of bf16), and under ZeRO-3 whether the whole model can be gathered once.
#[test]
fn the_plan_counts_a_generation_round() {
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../assets/configs/qwen2-0.5b.json"
    );
    let (code, out, err) = run(&[
        "plan",
        "--model",
        model,
        "--seq",
        "512",
        "--batch",
        "4",
        "--gpus",
        "8",
        "--gpu_memory",
        "80GiB",
        "--max_completion_length",
        "1024",
        "--generation_batch_size",
        "32",
    ]);
    assert_eq!(code, 0, "{err}");
    // 32 x 1536 x 24 layers x 2 kv heads x 64 x 2 x 2 bytes = 576 MiB; the prefill of 32 x
    // 512 prompt tokens, (3 x 896 + 3 x 4864 + 256 / 4) x 2 bytes each: 542 MiB.
    assert!(
        out.contains(
            "generation round: 32 rows x 1536 tokens, KV cache 576M per rank, prefill transient 542M"
        ),
        "{out}"
    );
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../assets/configs/llama-3.1-70b.json"
    );
    let (code, out, err) = run(&[
        "plan",
        "--model",
        model,
        "--seq",
        "1024",
        "--batch",
        "1",
        "--gpus",
        "8",
        "--gpu_memory",
        "80GiB",
        "--max_completion_length",
        "1024",
        "--use_peft",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("would not fit: each unit is gathered per forward"),
        "{out}"
    );
}
