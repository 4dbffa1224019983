//! LoRA (`--use_peft`, TRL's keys) through the real `cargo trl launch` and the `sft` example:
//! under every CPU profile the run equals one process (every step's loss within 1e-5, every
//! adapter weight and the LM head trained whole (lora_modules_to_save) within 2e-5 after 5
//! steps, fp32), the base stays frozen (checkpoints hold
//! only the adapters, in peft's format), and a run resumed from an adapter checkpoint goes on
//! as if never stopped.

mod common;

use common::{assert_equal, assert_equal_within, max_diff, Run};
use std::path::Path;

const STEPS: usize = 5;
/// Every linear layer adapted; rank 4; no dropout (its masks follow each rank's share of the
/// rows, so only a dropout-free run can equal one process exactly); a learning rate that
/// moves the adapters visibly in 5 steps, held constant (a run cut short keeps the same
/// schedule).
const LORA: &[&str] = &[
    "--use_peft",
    "--lora_target_modules",
    "all-linear",
    "--lora_r",
    "4",
    "--lora_alpha",
    "8",
    "--lora_dropout",
    "0",
    "--lora_modules_to_save",
    "lm_head",
    "--learning_rate",
    "2e-3",
    "--lr_scheduler_type",
    "constant",
];

fn launch(launch_args: &[&str], per_device: usize, out: &Path, extra: &[&str]) -> String {
    let cmd = common::sft_launch(launch_args, &[LORA, extra].concat());
    common::run_launch(cmd, STEPS, per_device, out)
}

#[test]
fn lora_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let out = |name: &str| tmp.path().join(name);
    let one = ["--num_processes", "1"];
    launch(&one, 8, &out("one8"), &[]);
    launch(&one, 4, &out("one4"), &[]);
    let (one8, one4) = (
        Run::read_adapter(&out("one8"), STEPS),
        Run::read_adapter(&out("one4"), STEPS),
    );
    // Only adapters are saved (2 layers x 7 projections x (A, B)) and the head trained whole
    // (tied to the frozen embedding in the base: a copy of its own, as peft makes).
    assert_eq!(one8.weights.len(), 29, "{:?}", one8.weights.keys());
    assert!(!out("one8").join("checkpoint-5/model.safetensors").exists());
    // The adapters moved (B starts at zero).
    let b = &one8.weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"];
    assert!(max_diff(b, &b.zeros_like().unwrap()) > 1e-3);
    for (name, args, two_dp) in common::CPU_CASES {
        launch(args, 4, &out(name), &[]);
        let want = if *two_dp { &one8 } else { &one4 };
        let got = Run::read_adapter(&out(name), STEPS);
        assert_equal(&format!("lora {name}"), &got, want, &[], |_, g, w| {
            max_diff(g, w)
        });
    }
}

/// DoRA (`--use_dora`) where its weight norm is computed differently: from ZeRO-3 / FSDP
/// units gathered per layer, from tensor-parallel row blocks summed over the group and column
/// blocks kept apart, with sequences split (Ulysses): each equals one process.
#[test]
fn dora_under_sharded_and_split_profiles_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let out = |name: &str| tmp.path().join(name);
    let one = ["--num_processes", "1"];
    let dora = ["--use_dora", "true"];
    launch(&one, 8, &out("one8"), &dora);
    launch(&one, 4, &out("one4"), &dora);
    let (one8, one4) = (
        Run::read_adapter(&out("one8"), STEPS),
        Run::read_adapter(&out("one4"), STEPS),
    );
    // The adapters of LoRA plus one magnitude per adapted layer (2 layers x 7).
    assert_eq!(one8.weights.len(), 29 + 14, "{:?}", one8.weights.keys());
    let config = std::fs::read_to_string(out("one8").join("checkpoint-5/adapter_config.json"));
    assert!(config.unwrap().contains("\"use_dora\": true"));
    for (name, args, two_dp) in common::CPU_CASES {
        if ![
            "zero3_cpu",
            "fsdp2_cpu_efficient_loading",
            "fsdp2_tp_cpu",
            "tp_cpu",
            "alst_ulysses_cpu",
        ]
        .contains(name)
        {
            continue;
        }
        launch(args, 4, &out(name), &dora);
        let want = if *two_dp { &one8 } else { &one4 };
        let got = Run::read_adapter(&out(name), STEPS);
        assert_equal(&format!("dora {name}"), &got, want, &[], |_, g, w| {
            max_diff(g, w)
        });
    }
    // Merged (each row rescaled to its magnitude), it gives the adapted base's logits.
    merges_into_its_base(
        &out("one8").join(format!("checkpoint-{STEPS}")),
        &out("merge"),
    );
}

/// LoRA on the other dense built-in architectures (their q/k norms, fused Phi-3 projections,
/// sliding windows, NoPE layers, the language models of Gemma 3's and Qwen3-VL's
/// vision-language checkpoints)
/// under FSDP2 x tp and Ulysses equals one process: losses
/// within 1e-5, adapters within 5e-5.
#[test]
fn lora_on_every_dense_built_in_model_equals_one_process() {
    lora_on_models_equals_one_process(
        &[
            "qwen3",
            "gemma3",
            "gemma3-vision",
            "qwen3-vl",
            "olmo2",
            "phi3",
            "smollm3",
            "mistral",
        ],
        &["fsdp2_tp_cpu", "alst_ulysses_cpu"],
        5e-5,
        (&[], 0),
    );
}

/// LoRA on the mixtures of experts as peft adapts transformers 5's fused experts (each
/// expert's gate and up sharing one A of rank 2r, its down, the router; all-linear) under
/// ZeRO-3 (experts in the frozen units), FSDP2 x tp (each expert's MLP and its adapters split,
/// the shared A's partial gradients summed over tp) and Ulysses equals one process. Adapters
/// within 1e-4: 2 of the 512 elements of the fused down A (experts few tokens reach) end
/// 6.6e-5 off under all three alike, the Adam effect below. gpt-oss: attention's adapters
/// (peft's all-linear there) over its frozen sinks and fused experts.
#[test]
fn lora_on_mixtures_of_experts_equals_one_process() {
    lora_on_models_equals_one_process(
        &["qwen3-moe", "mixtral", "gpt-oss"],
        &["zero3_cpu", "fsdp2_tp_cpu", "alst_ulysses_cpu"],
        1e-4,
        (&[], 0),
    );
}

/// gpt-oss's fused experts and router adapted as parameters (`--lora_target_parameters`,
/// peft's target_parameters, as the gpt-oss fine-tuning recipe does): each expert's adapter
/// through two grouped GEMMs, under ZeRO-3 (the base experts sharded in their units, the
/// adapters whole), FSDP2 x tp (gate_up's B split by its columns and down's A by its rows,
/// the other halves' partial gradients summed over tp) and Ulysses, equal to one process.
#[test]
fn lora_on_gpt_oss_parameters_equals_one_process() {
    lora_on_models_equals_one_process(
        &["gpt-oss"],
        &["zero3_cpu", "fsdp2_tp_cpu", "alst_ulysses_cpu"],
        1e-4,
        (
            &[
                "--lora_target_parameters",
                "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj",
                "mlp.router.weight",
            ],
            6,
        ),
    );
}

/// Llama 4's and Mistral 4's fused experts adapted as parameters: gate_up holds each
/// expert's gate and up projections as halves, so under FSDP2 x tp the half of its adapter
/// that shares its split features (Llama 4: A's inputs, as peft reads the tensor [experts,
/// out, in]; Mistral 4: B's outputs) is split by the same halves, equal to one process;
/// ZeRO-3 and Ulysses too.
#[test]
fn lora_on_llama4_and_mistral4_expert_parameters_equals_one_process() {
    lora_on_models_equals_one_process(
        &["llama4"],
        &["zero3_cpu", "fsdp2_tp_cpu", "alst_ulysses_cpu"],
        1e-4,
        (
            &[
                "--lora_target_parameters",
                "feed_forward.experts.gate_up_proj",
                "feed_forward.experts.down_proj",
            ],
            4,
        ),
    );
    lora_on_models_equals_one_process(
        &["mistral4"],
        &["zero3_cpu", "fsdp2_tp_cpu", "alst_ulysses_cpu"],
        1e-4,
        (
            &[
                "--lora_target_parameters",
                "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj",
            ],
            2,
        ),
    );
}

/// Each of assets/tiny-`kinds` trains its adapters under `cases` (of CPU_CASES, all with two
/// data-parallel ranks) as one process does.
fn lora_on_models_equals_one_process(
    kinds: &[&str],
    cases: &[&str],
    tolerance: f32,
    (parameters, expert_adapters): (&[&str], usize),
) {
    let tmp = tempfile::tempdir().unwrap();
    for &kind in kinds {
        let model = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../assets")
            .join(format!("tiny-{kind}/model"));
        let model = ["--model_name_or_path", model.to_str().unwrap()];
        let out = |name: &str| tmp.path().join(format!("{kind}-{name}"));
        // A mixture of experts' router loss (weighted 0.1 here) is per micro-batch, TRL's
        // average, not a sum over rows: with one row per micro-batch, a rank's micro-batches
        // are some of one process's.
        let moe = matches!(kind, "qwen3-moe" | "mixtral" | "gpt-oss");
        let launch = |args: &[&str], rows: usize, out: &Path| {
            let ga = rows.to_string();
            let router = ["--gradient_accumulation_steps", &ga];
            let router = [&router[..], &["--router_aux_loss_coef", "0.1"]].concat();
            let extra = [&model[..], if moe { &router[..] } else { &[] }, parameters].concat();
            launch(args, if moe { 1 } else { rows }, out, &extra)
        };
        launch(&["--num_processes", "1"], 8, &out("one8"));
        let one8 = Run::read_adapter(&out("one8"), STEPS);
        // The adapters trained (B starts at zero): equal runs that trained nothing would
        // prove nothing.
        let moved = one8
            .weights
            .iter()
            .filter(|(n, _)| n.contains("lora_B"))
            .map(|(_, b)| max_diff(b, &b.zeros_like().unwrap()))
            .fold(0f32, f32::max);
        assert!(moved > 1e-3, "{kind}: the adapters did not move ({moved})");
        // So did those on the experts (peft's names: `mlp.experts[.base_layer].lora_B`).
        if !parameters.is_empty() {
            let experts = one8
                .weights
                .iter()
                .filter(|(n, _)| n.contains(".experts.") && n.contains("lora_B"))
                .map(|(_, b)| max_diff(b, &b.zeros_like().unwrap()))
                .collect::<Vec<_>>();
            assert!(
                experts.len() == expert_adapters && experts.iter().all(|&m| m > 1e-3),
                "{kind}: the experts' adapters did not all move: {experts:?}"
            );
        }
        for (name, args, two_dp) in common::CPU_CASES {
            if !cases.contains(name) {
                continue;
            }
            assert!(two_dp);
            let text = launch(args, 4, &out(name));
            // Frozen base, adapters (an expert's shared A once) and their state, as planned.
            let what = format!("lora {kind} {name}");
            common::assert_model_state_predicted(&what, &common::worker_report(&text));
            let got = Run::read_adapter(&out(name), STEPS);
            // Adam turns the rounding of the 2-rank gradient sum into steps of up to the
            // learning rate (2e-3) on elements whose gradient is near zero: one qwen3 lora_B
            // element moves 2.6e-5 off (of 1e-2) under both FSDP2 x tp and Ulysses alike.
            assert_equal_within(
                &format!("lora {kind} {name}"),
                &got,
                &one8,
                &[],
                tolerance,
                |_, g, w| max_diff(g, w),
            );
        }
    }
}

#[test]
fn a_lora_run_resumes_from_its_adapter_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (straight, resumed) = (tmp.path().join("straight"), tmp.path().join("resumed"));
    let zero2 = ["--profile", "zero2_cpu"];
    launch(&zero2, 4, &straight, &[]);
    // The same run stopped after step 3, then resumed from its checkpoint.
    let cmd = common::sft_launch(&zero2, LORA);
    common::run_launch(cmd, 3, 4, &resumed);
    let text = launch(&zero2, 4, &resumed, &["--resume_from_checkpoint", "latest"]);
    assert!(text.contains("checkpoint-3"), "{text}");
    let (a, b) = (
        Run::read_adapter(&straight, STEPS),
        Run::read_adapter(&resumed, STEPS),
    );
    for (name, w) in &a.weights {
        let d = max_diff(&b.weights[name], w);
        assert!(d < 2e-5, "{name}: resumed differs by {d}");
    }
    merges_into_its_base(&straight.join(format!("checkpoint-{STEPS}")), tmp.path());
}

/// `cargo trl merge` on an adapter checkpoint (every linear layer adapted, the head trained
/// whole while tied to the frozen embedding): the merged checkpoint gives the logits of the
/// base with the adapter applied (within 1e-5), unties the head, and opens in transformers
/// with the same logits; a second merge to the same place is refused.
fn merges_into_its_base(checkpoint: &Path, tmp: &Path) {
    std::fs::create_dir_all(tmp).unwrap();
    use trl_runtime::candle_core::{DType, Device, Tensor};
    use trl_runtime::models::AutoModelForCausalLM;
    let merged = tmp.join("merged");
    let merge = || {
        // From the root, where the adapter config's base (assets/tiny/model, as the bundled
        // job's settings name it) lies, as a user merges where they trained.
        std::process::Command::new(env!("CARGO_BIN_EXE_cargo-trl"))
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
            .args(["trl", "merge"])
            .arg(checkpoint)
            .arg("--output_dir")
            .arg(&merged)
            .args(["--max_shard_size", "40KB"])
            .output()
            .unwrap()
    };
    let o = merge();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    // Every linear layer of 2 layers (7 each) took its adapter; the head was replaced.
    assert!(
        text.contains("14 weights took their adapter, 1 were replaced"),
        "{text}"
    );
    assert!(
        merged.join("model.safetensors.index.json").exists(),
        "{text}"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["tie_word_embeddings"], false);

    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny/model");
    let mut adapted =
        AutoModelForCausalLM::from_pretrained(&base, DType::F32, &Device::Cpu).unwrap();
    adapted.load_adapter(checkpoint).unwrap();
    let plain = AutoModelForCausalLM::from_pretrained(&merged, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::from_vec(
        (0..32u32).map(|i| (i * 37 + 5) % 280).collect(),
        (2, 16),
        &Device::Cpu,
    )
    .unwrap();
    let pos = Tensor::arange(0i64, 16, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((2, 1))
        .unwrap();
    let d = max_diff(
        &adapted.forward(&ids, &pos).unwrap(),
        &plain.forward(&ids, &pos).unwrap(),
    );
    eprintln!("merged checkpoint: max |logits - adapted base's| = {d:e}");
    assert!(
        d < 1e-5,
        "merged logits differ from the adapted base's by {d}"
    );
    common::opens_in_transformers(&merged);

    let again = merge();
    let text = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && text.contains("already exists"),
        "{text}"
    );
}

/// The README's LoRA command's flags (after `--`), read from README.md itself.
fn readme_lora_flags() -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let joined = readme.replace("\\\n", " ");
    let line = joined
        .lines()
        .find(|l| l.starts_with("cargo run --release -p trl-examples --bin sft -- --use_peft"))
        .expect("README.md shows the LoRA command");
    let (_, flags) = line.split_once(" -- ").unwrap();
    flags.split_whitespace().map(String::from).collect()
}

/// The held-out accuracy scripts/score_task.py measures in transformers for `dir` (a merged
/// checkpoint, or an adapter loaded by peft) over the bundled eval rows: (correct, total).
fn transformers_score(python: &Path, dir: &Path, rows: usize) -> (u64, u64) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let o = std::process::Command::new(python)
        .arg(root.join("scripts/score_task.py"))
        .arg(dir)
        .arg(root.join("assets/tiny/data/eval.jsonl"))
        .arg(rows.to_string())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "score_task.py: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    let json: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    (
        json["correct"].as_u64().unwrap(),
        json["total"].as_u64().unwrap(),
    )
}

/// The README's two jobs as a newcomer runs them, one after the other in one directory: the
/// full SFT job, then the LoRA command. Each keeps its own checkpoints (the LoRA job writes
/// output/sft-tiny-lora); pointed at the full run's directory the LoRA job stops before
/// training, naming output_dir and overwrite_output_dir, and the full run's checkpoints stay.
/// With peft and transformers from PyPI (skipped otherwise): the adapter checkpoint loads in
/// `PeftModel.from_pretrained` and scores in transformers what the run measured in training,
/// and so does its `cargo trl merge` (the bundled model ties its head: the merge writes both
/// trained copies).
#[test]
fn the_readme_full_and_lora_jobs_keep_their_checkpoints_and_score_as_trained() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let sft = common::build_example("sft");
    let tmp = tempfile::tempdir().unwrap();
    let run = |args: &[String]| {
        std::process::Command::new(&sft)
            .current_dir(tmp.path())
            .args(args)
            .output()
            .unwrap()
    };
    let full = run(&[]);
    assert!(
        full.status.success(),
        "{}",
        String::from_utf8_lossy(&full.stderr)
    );
    let full_dir = tmp.path().join("output/sft-tiny");
    let full_checkpoints = std::fs::read_dir(&full_dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("checkpoint-")
        })
        .count();
    assert!(full_checkpoints > 0);
    // The README's generation commands on the full run's checkpoint, as written.
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let trl = |line: &str, stdin: &str| {
        assert!(readme.contains(line), "README.md shows `{line}`");
        let args = shell_words(line);
        let o = common::output_with_stdin(
            std::process::Command::new(env!("CARGO_BIN_EXE_cargo-trl"))
                .current_dir(tmp.path())
                .args(&args[1..]),
            stdin,
        );
        assert!(
            o.status.success(),
            "{line}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let row = trl(
        "cargo trl generate output/sft-tiny/checkpoint-3000 --prompt \"What is 12 + 30?\" --max_new_tokens 8",
        "",
    );
    let row: serde_json::Value = serde_json::from_str(row.trim()).unwrap();
    let answer = row["completion"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    eprintln!("the trained model on 12 + 30: {answer:?}");
    assert!(
        !answer.is_empty() && answer.chars().all(|c| c.is_ascii_digit()),
        "a number: {answer:?}"
    );
    let chat = trl(
        "cargo trl chat output/sft-tiny/checkpoint-3000",
        "What is 12 + 30?\n",
    );
    assert_eq!(chat.trim(), answer, "chat answers as generate does");
    let weights =
        |dir: &Path| std::fs::read(dir.join("checkpoint-3000/model.safetensors")).unwrap();
    let before = weights(&full_dir);
    let flags = readme_lora_flags();
    let lora = run(&flags);
    let stdout = String::from_utf8_lossy(&lora.stdout).to_string();
    assert!(
        lora.status.success(),
        "{}",
        String::from_utf8_lossy(&lora.stderr)
    );
    let lora_dir = tmp.path().join("output/sft-tiny-lora");
    let checkpoint = lora_dir.join("checkpoint-3000");
    assert!(
        checkpoint.join("adapter_model.safetensors").exists(),
        "{stdout}"
    );
    // Written as the rest of the checkpoint: its mode, a plain base path.
    use std::os::unix::fs::PermissionsExt;
    let mode = |f: &str| {
        std::fs::metadata(checkpoint.join(f))
            .unwrap()
            .permissions()
            .mode()
    };
    assert_eq!(
        mode("adapter_model.safetensors"),
        mode("adapter_config.json")
    );
    let config = std::fs::read_to_string(checkpoint.join("adapter_config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    let base = config["base_model_name_or_path"].as_str().unwrap();
    assert!(!base.contains(".."), "{base}");
    assert_eq!(
        weights(&full_dir),
        before,
        "the full run's checkpoint changed"
    );
    // Into the full run's directory: refused, nothing touched.
    let into_full = [
        flags.clone(),
        vec!["--output_dir".into(), "output/sft-tiny".into()],
    ]
    .concat();
    let refused = run(&into_full);
    let err = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(!refused.status.success());
    assert!(
        err.contains("output_dir") && err.contains("overwrite_output_dir"),
        "{err}"
    );
    assert_eq!(weights(&full_dir), before);
    assert!(!full_dir
        .join("checkpoint-3000/adapter_config.json")
        .exists());
    // The accuracy the run measured (its last evaluation: 200 generated answers).
    let metrics = std::fs::read_to_string(lora_dir.join("metrics.jsonl")).unwrap();
    let trained = metrics
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v["eval_accuracy"].as_f64())
        .unwrap();
    eprintln!(
        "the README's LoRA job: held-out accuracy {:.1}% in training",
        100.0 * trained
    );
    common::loads_in_peft(&root.join("assets/tiny/model"), &checkpoint);
    let Some(python) = common::python_with(&["torch", "transformers", "peft"]) else {
        return;
    };
    let (correct, total) = transformers_score(&python, &checkpoint, 200);
    assert_eq!(total, 200);
    assert_eq!(
        correct as f64 / 200.0,
        trained,
        "the adapter in peft scores {correct}/200"
    );
    // The README's merge command, as written (checkpoint-N: the run's last, 3000).
    let merged = tmp.path().join("merged");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_cargo-trl"))
        .current_dir(tmp.path())
        .args(["trl", "merge", "output/sft-tiny-lora/checkpoint-3000"])
        .args(["--output_dir", "merged"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (merged_correct, _) = transformers_score(&python, &merged, 200);
    eprintln!("in transformers: the adapter (peft) {correct}/200, merged {merged_correct}/200");
    assert_eq!(
        merged_correct, correct,
        "the merged model scores {merged_correct}/200"
    );
}

/// Adapters on the tied embedding and head of the bundled model, through `cargo trl launch`:
/// LoRA on the embedding and on the head (peft's default: apart), the two as one
/// (`--lora_ensure_weight_tying`), and trainable tokens (the rows in the embedding and the tied
/// head). Under every CPU profile without tensor parallelism each equals one process (losses
/// within 1e-5, adapters within 2e-5 after 5 steps, fp32); under tp the launch stops naming
/// the embedding.
#[test]
fn embedding_and_head_adapters_under_every_cpu_profile_equal_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let base: &[&str] = &[
        "--use_peft",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--lora_dropout",
        "0",
        "--learning_rate",
        "2e-3",
        "--lr_scheduler_type",
        "constant",
    ];
    let setups: [(&str, &[&str], usize); 3] = [
        // q_proj's 2 x 2, the embedding's A and B, the head's A and B.
        (
            "lora",
            &["--lora_target_modules", "q_proj", "embed_tokens", "lm_head"],
            8,
        ),
        // The same tied: the head's A and B saved as the embedding's, transposed.
        (
            "tied",
            &[
                "--lora_target_modules",
                "q_proj",
                "embed_tokens",
                "--lora_ensure_weight_tying",
                "true",
            ],
            8,
        ),
        (
            "tokens",
            &[
                "--lora_target_modules",
                "q_proj",
                "--lora_trainable_token_indices",
                "5",
                "17",
                "42",
            ],
            5,
        ),
    ];
    for (setup, args, tensors) in setups {
        let run = |launch_args: &[&str], per_device: usize, name: &str| {
            let out = tmp.path().join(format!("{setup}-{name}"));
            let cmd = common::sft_launch(launch_args, &[base, args].concat());
            common::run_launch(cmd, STEPS, per_device, &out);
            Run::read_adapter(&out, STEPS)
        };
        let one = ["--num_processes", "1"];
        let (one8, one4) = (run(&one, 8, "one8"), run(&one, 4, "one4"));
        assert_eq!(
            one8.weights.len(),
            tensors,
            "{setup}: {:?}",
            one8.weights.keys()
        );
        // Every adapter trained: moved from its start (zero for A of an embedding's LoRA
        // and B of a linear layer's, the base table's rows for trainable tokens).
        let base = trl_runtime::candle_core::safetensors::load(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny/model/model.safetensors"),
            &trl_runtime::candle_core::Device::Cpu,
        )
        .unwrap();
        for (name, w) in &one8.weights {
            let start = match name {
                n if n.ends_with("trainable_tokens_delta") => {
                    let rows = trl_runtime::candle_core::Tensor::new(
                        &[5u32, 17, 42],
                        &trl_runtime::candle_core::Device::Cpu,
                    )
                    .unwrap();
                    base["model.embed_tokens.weight"]
                        .index_select(&rows, 0)
                        .unwrap()
                }
                n if n.ends_with("lora_embedding_A") || n.ends_with("lora_B.weight") => {
                    w.zeros_like().unwrap()
                }
                _ => continue,
            };
            assert!(max_diff(w, &start) > 1e-4, "{setup}: {name} did not train");
        }
        for (name, launch_args, two_dp) in common::CPU_CASES {
            if name.contains("tp") {
                continue;
            }
            let got = run(launch_args, 4, name);
            let want = if *two_dp { &one8 } else { &one4 };
            assert_equal(&format!("{setup} {name}"), &got, want, &[], |_, g, w| {
                max_diff(g, w)
            });
        }
    }
    // Tensor parallelism splits the table's rows: refused, naming the layer.
    let cmd = common::sft_launch(
        &[
            "--profile",
            "multi_cpu",
            "--parallelism_config_tp_size",
            "2",
        ],
        &[base, &["--lora_target_modules", "q_proj", "embed_tokens"]].concat(),
    );
    let o = {
        let mut cmd = cmd;
        cmd.args(["--max_steps", "1", "--output_dir"])
            .arg(tmp.path().join("tp"))
            .output()
            .unwrap()
    };
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("model.embed_tokens") && err.contains("vocab-parallel"),
        "{err}"
    );
}

/// A command line's words, double quotes grouping (the README's commands need no more).
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quoted) = (Vec::new(), String::new(), false);
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}
