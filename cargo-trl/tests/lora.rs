//! LoRA (`--use_peft`, TRL's keys) through the real `cargo trl launch` and the `sft` example:
//! under every CPU profile the run equals one process (every step's loss within 1e-5, every
//! adapter weight and the LM head trained whole (lora_modules_to_save) within 2e-5 after 5
//! steps, fp32), the base stays frozen (checkpoints hold
//! only the adapters, in peft's format), and a run resumed from an adapter checkpoint goes on
//! as if never stopped.

mod common;

use common::{assert_equal, max_diff, Run};
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
}
