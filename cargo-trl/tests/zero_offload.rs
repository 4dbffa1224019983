//! ZeRO-2 as DeepSpeed runs it and offload as PyTorch and DeepSpeed define it, through the
//! real `cargo trl launch` on the bundled model, each equal to one process (fp32; every
//! step's loss within 1e-5, every weight within 2e-5): ZeRO-2 with small reduce buckets
//! (several resident units, reductions overlapped) from a DeepSpeed JSON, FSDP2 with
//! `fsdp_offload_params`, ZeRO-3 with `offload_param_device` and `offload_optimizer_device`.
//! Each rank's device and host state is what `cargo trl plan` predicts, byte for byte (on the
//! CPU host and device memory are one; the offload paths run and are counted apart), and a run
//! saved under one of them resumes under another.

mod common;

use common::{assert_equal, max_diff, Run};
use std::path::Path;

const STEPS: usize = 5;

/// ZeRO-3 with its parameter slices and optimizer state in host memory.
const ZERO3_OFFLOADED: [&str; 6] = [
    "--profile",
    "zero3_cpu",
    "--offload_param_device",
    "cpu",
    "--offload_optimizer_device",
    "cpu",
];

fn launch(launch_args: &[&str], rows: usize, out: &Path, extra: &[&str]) -> String {
    let cmd = common::sft_launch(launch_args, extra);
    common::run_launch(cmd, STEPS, rows, out)
}

/// A launch config: the zero2_cpu profile with its DeepSpeed settings in a JSON whose reduce
/// buckets (60,000 elements) hold one layer of the bundled model (49,408 parameters) each.
fn bucketed_zero2(dir: &Path) -> std::path::PathBuf {
    let json = dir.join("ds_zero2.json");
    std::fs::write(
        &json,
        r#"{"zero_optimization": {"stage": 2, "reduce_bucket_size": 60000, "overlap_comm": true}}"#,
    )
    .unwrap();
    let yaml = dir.join("zero2_buckets.yaml");
    std::fs::write(
        &yaml,
        format!(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n\
             deepspeed_config:\n  deepspeed_config_file: {}\n\
             num_machines: 1\nnum_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\n",
            json.display()
        ),
    )
    .unwrap();
    yaml
}

#[test]
fn bucketed_zero2_and_parameter_offload_equal_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = bucketed_zero2(tmp.path());
    let yaml = yaml.to_str().unwrap();
    let out = |name: &str| tmp.path().join(name);
    launch(&["--num_processes", "1"], 8, &out("one"), &[]);
    let one = Run::read(&out("one"), STEPS);
    let cases: [(&str, &[&str]); 3] = [
        ("zero2_buckets", &["--config_file", yaml]),
        (
            "fsdp2_offload_params",
            &["--profile", "fsdp2_cpu", "--fsdp_offload_params", "true"],
        ),
        ("zero3_offload_param", &ZERO3_OFFLOADED),
    ];
    for (name, args) in cases {
        let text = launch(args, 4, &out(name), &[]);
        let report = common::worker_report(&text);
        common::assert_model_state_predicted(name, &report);
        let offload = name != "zero2_buckets";
        assert_eq!(report["offload_params"], offload, "{name}: {report}");
        assert_eq!(report["offload_optimizer"], offload, "{name}: {report}");
        let host = report["host_state_bytes"].as_u64().unwrap();
        assert_eq!(
            Some(host),
            report["predicted_host_state_bytes"].as_u64(),
            "{name}: {report}"
        );
        assert_eq!(host > 0, offload, "{name}: {report}");
        // The offload path ran: parameter slices moved to the device, gradient slices back.
        let moved = text.contains("bytes moved between host and device memory");
        assert_eq!(moved, offload, "{name}: {text}");
        if name == "zero2_buckets" {
            assert_eq!(report["strategy"], "zero2", "{report}");
            // The root and one unit per layer: 60,000 elements take one layer each.
            assert!(
                text.contains("whole in 3 units") && text.contains("overlap_comm true"),
                "{text}"
            );
        }
        assert_equal(name, &Run::read(&out(name), STEPS), &one, &[], |_, g, w| {
            max_diff(g, w)
        });
    }
}

/// Saved at step 3 with parameters offloaded under ZeRO-3 (a sharded checkpoint, as DeepSpeed
/// writes ZeRO-3's), resumed from it into another directory under bucketed ZeRO-2: the same
/// weights at step 5 as the run that went straight through.
#[test]
fn a_run_resumes_across_zero2_and_offloaded_zero3() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = bucketed_zero2(tmp.path());
    let (first, resumed) = (tmp.path().join("first"), tmp.path().join("resumed"));
    let mut cmd = common::sft_launch::<&str>(&ZERO3_OFFLOADED, &[]);
    cmd.args(["--max_steps", "5", "--save_steps", "3", "--seed", "7"])
        .args(["--eval_dataset_name", "none", "--logging_steps", "1"])
        .args(["--per_device_train_batch_size", "4", "--output_dir"])
        .arg(&first);
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let checkpoint = first.join("checkpoint-3");
    assert!(checkpoint.join("sharded").exists(), "ZeRO-3 saves sharded");
    let zero2 = ["--config_file", yaml.to_str().unwrap()];
    let from = checkpoint.to_str().unwrap();
    let text = launch(&zero2, 4, &resumed, &["--resume_from_checkpoint", from]);
    assert!(text.contains("checkpoint-3"), "{text}");
    let (a, b) = (Run::read(&first, STEPS), Run::read(&resumed, STEPS));
    assert_eq!(b.losses.len(), 2, "steps 4 and 5 only");
    for (x, y) in a.losses[3..].iter().zip(&b.losses) {
        assert!(
            (x - y).abs() < 1e-5,
            "losses after the resume: {b:?} vs {a:?}",
            a = a.losses,
            b = b.losses
        );
    }
    for (name, w) in &a.weights {
        let d = max_diff(&b.weights[name], w);
        assert!(d < 2e-5, "{name}: resumed differs by {d}");
    }
}
