//! Your own model under every strategy: the Phi-style decoder of examples/src/phi.rs (written
//! the plain Candle way, annotated, a `CausalModel`), with per-head q/k LayerNorms
//! (assets/tiny-phi-qk, passed by flag), fine-tuned by the SFT trainer through the real
//! `cargo trl launch` under every CPU profile, each equal to one process after 5 steps (fp32):
//! the loss of every step within 1e-5 and every updated weight, q/k norms included, within
//! 2e-5. Under tp the q/k norms' gradients are partial sums, found at the first step and
//! summed over the group; TRL_CHECK_TP_GRADS=1 checks the plan against every step's gradients.

mod common;

use candle_core::Tensor;
use common::{assert_equal, max_diff, Run};
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");
const STEPS: usize = 5;
/// The fixture's head size is 16, half of it rotated (partial_rotary_factor 0.5).
const ROTARY_DIM: usize = 8;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-phi-qk/model")
}

fn command(launch_args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .env("CARGO_NET_OFFLINE", "true")
        .env("TRL_CHECK_TP_GRADS", "1")
        .args(common::LAUNCH)
        .args(launch_args)
        .args(["sft_phi", "--"])
        .args(common::bundled_job("sft_phi"))
        .arg("--model_name_or_path")
        .arg(model_dir());
    c
}

/// Launches `sft_phi` with `launch_args` and `per_device` examples per data-parallel rank.
fn launch(launch_args: &[&str], per_device: usize, out: &Path) -> String {
    common::run_launch(command(launch_args), STEPS, per_device, out)
}

#[test]
fn phi_under_every_cpu_profile_equals_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let out = |name: &str| -> PathBuf { tmp.path().join(name) };
    // One process over the global batch: 2 data-parallel ranks x 4, and (under cp, whose two
    // ranks share each row) 4.
    launch(&["--num_processes", "1"], 8, &out("one8"));
    launch(&["--num_processes", "1"], 4, &out("one4"));
    let (one8, one4) = (
        Run::read(&out("one8"), STEPS),
        Run::read(&out("one4"), STEPS),
    );
    assert_eq!(one8.losses.len(), STEPS);
    for (name, args, two_dp) in common::CPU_CASES {
        let text = launch(args, 4, &out(name));
        if name.ends_with("efficient_loading") {
            assert!(
                text.contains(r#""activation_checkpointing":true,"read_shards":true"#),
                "{name}: {text}"
            );
        }
        if *name == "tp_cpu" {
            // The q/k norms were found to act on split heads (their gradients summed). (Under
            // FSDP each rank sees its slices of them, and only rank 0's log is shown.)
            assert!(
                text.contains("act on features split over tp")
                    && text.contains("model.layers.0.self_attn.q_layernorm.weight"),
                "{name}: {text}"
            );
        }
        let want = if *two_dp { &one8 } else { &one4 };
        let got = Run::read(&out(name), STEPS);
        let qk = ["q_layernorm", "k_layernorm"];
        assert_equal(name, &got, want, &qk, |param, g, w| {
            if !param.ends_with("k_layernorm.bias") {
                return max_diff(g, w);
            }
            // The key norm's bias adds the same vector to every key of a head; on the
            // features rotary leaves alone (the last ROTARY_DIM of each head) that shifts
            // every score of a row equally, so their gradient is zero in exact arithmetic and
            // AdamW turns rounding noise into updates (as for the built-in decoder's key bias
            // in trl-runtime's trainer tests): those are only bounded, by AdamW's step size x
            // steps; the rotated features must match.
            let part = |t: &Tensor, from: usize| t.narrow(0, from, ROTARY_DIM).unwrap();
            let noise = max_diff(&part(g, ROTARY_DIM), &part(w, ROTARY_DIM));
            assert!(
                noise <= 2.0 * 2e-3 * STEPS as f32,
                "{name}: {param} moved by {noise}"
            );
            max_diff(&part(g, 0), &part(w, 0))
        });
    }
}

#[test]
fn the_launcher_asks_the_program_for_its_models_plan() {
    // 2 key/value heads cannot split over tp = 4: the program's own model says so (the
    // built-in decoder cannot read a Phi config at all), before any worker starts.
    let o = command(&[
        "--profile",
        "fsdp2_tp_cpu",
        "--parallelism_config_tp_size",
        "4",
        "--parallelism_config_dp_shard_size",
        "1",
    ])
    .output()
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.status.code(), Some(2), "{text}");
    assert!(
        text.contains("parallelism_config_tp_size = 4 cannot split the model in")
            && text.contains("tiny-phi-qk")
            && text.contains("not divisible by tp = 4")
            && !text.contains("model_type 'phi' is not supported"),
        "{text}"
    );
}
