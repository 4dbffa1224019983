//! The launch contract end to end: every CPU profile launched with the real `cargo trl launch`
//! on the real SFT program (examples/src/bin/sft.rs), whose own report (distributed type,
//! mesh, strategy, model-state bytes per rank) must equal the dry-run plan; ZeRO-3's state per
//! rank is about half of DDP's on 2 ranks. The same program started torchrun-style with only
//! Accelerate's variables chooses the same strategy.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// One short training run's arguments: 1 step, no evaluation, output under `out`.
fn train_args(out: &Path) -> Vec<String> {
    [
        "--max_steps",
        "1",
        "--eval_dataset_name",
        "none",
        "--save_steps",
        "1000",
        "--output_dir",
        out.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// The tests of this file take turns: each launch builds the program and starts up to 4 ranks,
/// and two at once on CI's 2 cores only slow each other (and double the build's disk use).
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn launch(profile: &str, dry_run: bool, out: &Path) -> String {
    launch_with(profile, dry_run, out, &[])
}

/// As [`launch`], with `extra` training arguments.
fn launch_with(profile: &str, dry_run: bool, out: &Path, extra: &[&str]) -> String {
    let mut c = Command::new(BIN);
    c.current_dir(workspace())
        .env("CARGO_NET_OFFLINE", "true")
        .args(common::LAUNCH)
        .args(["--profile", profile]);
    if dry_run {
        c.arg("--dry-run");
    }
    let o = c
        .arg("sft")
        .arg("--")
        .args(train_args(out))
        .args(extra)
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{profile}: {t}");
    t
}

/// `key=value` pairs of the dry run's line that starts with `prefix`.
/// `cargo trl launch --profile auto` in the workspace, offline, on a free port.
fn launch_auto() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.current_dir(workspace())
        .env("CARGO_NET_OFFLINE", "true")
        .args(common::LAUNCH)
        .args(["--profile", "auto"]);
    cmd
}

fn plan_line(t: &str, prefix: &str) -> String {
    t.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{t}"))
        .to_string()
}

#[test]
fn every_cpu_profile_runs_the_plan_it_prints() {
    let _turn = turn();
    let tmp = tempfile::tempdir().unwrap();
    let mut state = std::collections::BTreeMap::new();
    for profile in [
        "multi_cpu",
        "zero2_cpu",
        "zero3_cpu",
        "fsdp2_cpu",
        "fsdp2_tp_cpu",
        "context_parallel_cpu",
        "alst_ulysses_cpu",
    ] {
        let out = tmp.path().join(profile);
        // Checkpointing is on by default (TRL's SFTConfig); one profile turns it off with the
        // HfArgumentParser spelling, and the plan must say so too.
        let extra: &[&str] = match profile {
            "zero2_cpu" => &["--gradient-checkpointing", "false"],
            _ => &[],
        };
        let plan = launch_with(profile, true, &out, extra);
        let ran = common::worker_report(&launch_with(profile, false, &out, extra));
        assert_eq!(
            ran["activation_checkpointing"].as_bool(),
            Some(profile != "zero2_cpu"),
            "{profile}: {ran}"
        );
        let m = &ran["mesh"];
        let mesh = format!(
            "mesh: dp_replicate={} dp_shard={} cp={} sp={} tp={}",
            m["dp_replicate"], m["dp_shard"], m["cp"], m["sp"], m["tp"]
        );
        assert_eq!(mesh, plan_line(&plan, "mesh:"), "{profile}");
        let strategy = plan_line(&plan, "strategy:");
        assert!(
            strategy.starts_with(&format!(
                "strategy: {} (activation_checkpointing={}",
                ran["strategy"].as_str().unwrap(),
                ran["activation_checkpointing"]
            )),
            "{profile}: the plan says `{strategy}`, the worker ran {ran}"
        );
        let kind = ran["distributed_type"].as_str().unwrap();
        assert!(
            plan_line(&plan, "plan:").contains(&format!("({kind})")),
            "{profile}: {kind}"
        );
        // The estimate `cargo trl plan` ranks layouts by is what every rank holds.
        let bytes = common::assert_model_state_predicted(profile, &ran);
        state.insert(profile, bytes);
    }
    // fp32 AdamW keeps per parameter: DDP 20 bytes (weights, gradients, master, two moments),
    // ZeRO-2 4 + 17/N, ZeRO-3 / FSDP FULL_SHARD 17/N (the fp32 weights are their own master;
    // a sharded slice adds its decay mask, a byte per element): on 2 ranks 0.625 and 0.425 of
    // DDP's (padding of each unit to the group size aside).
    let ddp = state["multi_cpu"][0] as f64;
    for (profile, expected) in [
        ("zero3_cpu", 0.425),
        ("fsdp2_cpu", 0.425),
        ("zero2_cpu", 0.625),
    ] {
        for &b in &state[profile] {
            let ratio = b as f64 / ddp;
            assert!(
                (ratio - expected).abs() < 0.02,
                "{profile}: {b} bytes per rank vs DDP's {ddp} (ratio {ratio:.3}, expected {expected})"
            );
        }
    }
}

#[test]
fn accelerate_variables_alone_choose_the_same_strategy() {
    // As `accelerate launch` (or torchrun with Accelerate's variables) starts a worker: no
    // PARALLELISM_CONFIG_*, FSDP's settings in Accelerate's spellings.
    let _turn = turn();
    let tmp = tempfile::tempdir().unwrap();
    // The launcher builds the program (the same launch as a user's).
    let launched = common::worker_report(&launch("fsdp2_cpu", false, &tmp.path().join("launched")));
    let program = workspace().join("target/debug/sft");
    assert!(program.exists(), "{}", program.display());
    let port = free_port_below_ephemeral();
    let out = tmp.path().join("accelerate");
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&program)
                .args(train_args(&out))
                .envs(trl_runtime::dist::spawn::local_rank_env(
                    rank,
                    2,
                    port,
                    "accelerate-test",
                ))
                .env("ACCELERATE_USE_FSDP", "true")
                .env("ACCELERATE_USE_CPU", "True")
                .env("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
                .env("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
                .env("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
                .env("FSDP_ACTIVATION_CHECKPOINTING", "true")
                .env("OMP_NUM_THREADS", "1")
                .env("TRL_COMM_TIMEOUT", "60")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        // Every rank is started before any is waited for (they meet at the rendezvous).
        .collect::<Vec<_>>()
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let all: String = children.iter().map(text).collect();
    for c in &children {
        assert!(c.status.success(), "{all}");
    }
    let ran = common::worker_report(&all);
    assert_eq!(ran["activation_checkpointing"], true, "{ran}");
    for key in ["distributed_type", "strategy", "mesh", "model_state_bytes"] {
        assert_eq!(ran[key], launched[key], "{key}: {ran} vs {launched}");
    }
    // A value Accelerate would not accept is an error naming the variable.
    let bad = Command::new(&program)
        .args(train_args(&tmp.path().join("bad")))
        .env("ACCELERATE_USE_FSDP", "ture")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(text(&bad).contains("ACCELERATE_USE_FSDP"), "{}", text(&bad));
}

/// A free port below the kernel's ephemeral range: a port from bind(0) can be handed to an
/// outgoing connection before rank 0 binds it.
fn free_port_below_ephemeral() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768)
        .max(20001);
    let span = u32::from(low - 20000);
    let start = 20000 + (std::process::id().wrapping_mul(7919) % span) as u16;
    (start..low)
        .chain(20000..start)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port below the ephemeral range")
}

#[test]
fn ctrl_c_saves_a_checkpoint_and_the_launcher_says_where() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let _turn = turn();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut args = train_args(&out);
    args[1] = "100000".into(); // --max_steps: far more than will run
    let mut child = Command::new(BIN)
        .current_dir(workspace())
        .env("CARGO_NET_OFFLINE", "true")
        // Not a terminal here: a plain progress line for every step.
        .env("TRL_PROGRESS_SECONDS", "0")
        .args(common::LAUNCH)
        .args(["--profile", "multi_cpu", "sft", "--"])
        .args(&args)
        // Its own process group, which receives the Ctrl-C as a terminal sends it.
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let stdout = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap());
    let mut stderr = String::new();
    let mut interrupted = false;
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if !interrupted && line.starts_with("progress: step 3/100000") {
            // SAFETY: signalling the process group of our own child, as a terminal's Ctrl-C.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGINT) };
            interrupted = true;
        }
        stderr.push_str(&line);
        stderr.push('\n');
    }
    let status = child.wait().unwrap();
    let all = format!("{}{stderr}", stdout.join().unwrap());
    assert!(interrupted, "no progress line for step 3:\n{all}");
    assert_eq!(status.code(), Some(130), "{all}");
    assert!(
        !all.contains("SIGINT"),
        "a worker got the Ctrl-C itself:\n{all}"
    );
    let said = all
        .lines()
        .find_map(|l| l.strip_prefix("interrupted: the workers saved "))
        .unwrap_or_else(|| panic!("no checkpoint named:\n{all}"));
    let path = said.split_once(" and stopped").unwrap().0;
    // The command to go on with is this one with the checkpoint for the program: one `--`.
    let again = said.split_once("go on with: ").unwrap().1;
    assert!(again.contains("cargo-trl launch "), "{again}");
    assert_eq!(again.matches(" -- ").count(), 1, "{again}");
    assert!(
        again.ends_with(&format!("--resume_from_checkpoint {path}")),
        "{again}"
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(path).join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert!(state["global_step"].as_u64().unwrap() >= 3, "{state}");
}

#[test]
fn profile_auto_launches_what_plan_picks() {
    let _turn = turn();
    let tmp = tempfile::tempdir().unwrap();
    let plan = Command::new(BIN)
        .current_dir(workspace())
        .args([
            "plan",
            "--model",
            "assets/tiny/model",
            "--seq",
            "64",
            "--batch",
            "2",
        ])
        .args(["--gradient_checkpointing", "true", "--explain"])
        .output()
        .unwrap();
    let plan = text(&plan);
    let pick = plan
        .lines()
        .find_map(|l| l.strip_prefix("pick: cargo trl launch --profile "))
        .unwrap_or_else(|| panic!("no pick in:\n{plan}"));
    let profile = pick.split_whitespace().next().unwrap();
    assert!(
        plan.contains("activations:"),
        "--explain shows the formulas:\n{plan}"
    );
    // The same work through the program's own flags: the launch picks the same layout.
    let out = tmp.path().join("auto");
    let o = launch_auto()
        .args(["sft", "--"])
        .args(train_args(&out))
        .args([
            "--max_length",
            "64",
            "--per_device_train_batch_size",
            "2",
            "--logging_steps",
            "1",
        ])
        .output()
        .unwrap();
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    assert!(
        all.contains(&format!("auto: {profile} over")),
        "plan picked {profile}:\n{all}"
    );
    let ran = common::worker_report(&all);
    // The worker runs the mesh the pick names (`--parallelism_config_AXIS_size N` flags).
    for axis in ["dp_replicate", "dp_shard", "tp", "cp", "sp"] {
        let flag = format!("--parallelism_config_{axis}_size ");
        let size: u64 = pick
            .split(&flag)
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            ran["mesh"][axis].as_u64(),
            Some(size),
            "{axis}: picked {pick}, ran {ran}"
        );
    }
    let predicted = ran["predicted_model_state_bytes"].as_u64();
    assert_eq!(ran["model_state_bytes"][0].as_u64(), predicted, "{ran}");
    // Every logged step carries the predicted peak beside the measured one (resident memory:
    // the plan's tensors over what the process held before the model and the host backend's
    // rings). Every CPU profile on the tiny model measured 0.92-1.09 of it until the projections
    // ran as chains (nn::chain), which lowered the tensors by ~0.6 MiB here while the resident
    // peak stayed at 26 MiB (the allocator keeps freed blocks; the binary's resident pages
    // vary with the code a run touches): 0.85-0.88 since. 20% here; the heap-counted check of
    // every profile is `bench memory` (within 10%).
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let line: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let predicted = line["predicted_peak_memory_mib"].as_f64().unwrap();
    let measured = line["peak_memory_mib"].as_f64().unwrap();
    assert!(
        (predicted / measured - 1.0).abs() < 0.20,
        "predicted {predicted} MiB, measured {measured} MiB: {line}"
    );
    // Where nothing fits, the plan says so and what to change.
    let none = Command::new(BIN)
        .current_dir(workspace())
        .args([
            "plan",
            "--model",
            "assets/tiny/model",
            "--gpus",
            "1",
            "--gpu_memory",
            "1GiB",
        ])
        .output()
        .unwrap();
    assert!(text(&none).contains("nothing fits"), "{}", text(&none));
    // Llama 3.1 70B on 8 x 80 GB fits only with the optimizer state in the host memory of a
    // 2 TiB machine: the plan says so, with the flag that does it and the memory it takes.
    let offload = Command::new(BIN)
        .current_dir(workspace())
        .args(["plan", "--model", "assets/configs/llama-3.1-70b.json"])
        .args([
            "--seq",
            "4096",
            "--batch",
            "1",
            "--gpus",
            "8",
            "--gpu_memory",
            "80GiB",
        ])
        .args(["--gradient_checkpointing", "true", "--host_memory", "2TiB"])
        .output()
        .unwrap();
    let said = text(&offload);
    let pick = plan_line(&said, "pick:");
    assert!(
        pick.contains("--fsdp_offload_params true")
            || pick.contains("--offload_optimizer_device cpu"),
        "{said}"
    );
    assert!(said.contains("live in host memory"), "{said}");
    // Llama 3.1 8B: ZeRO-2 reduces its gradients a bucket at a time during backward and keeps
    // only its slice, so it fits 8 x 80 GB at 4096 tokens (DeepSpeed's ZeRO-2 trains it there).
    let llama8 = Command::new(BIN)
        .current_dir(workspace())
        .args(["plan", "--model", "assets/configs/llama-3.1-8b.json"])
        .args(["--seq", "4096", "--batch", "1", "--gpus", "8"])
        .args(["--gpu_memory", "80GiB", "--gradient_checkpointing", "true"])
        .output()
        .unwrap();
    let said = text(&llama8);
    assert!(
        said.lines()
            .any(|l| l.starts_with("fits zero2 ") && l.split_whitespace().nth(3) == Some("8")),
        "{said}"
    );
    // gpt-oss-20b as the hub ships it (MXFP4 experts, trained dequantized): 20.9 B parameters,
    // which only a sharded layout fits on 8 x 80 GB (its 201k vocabulary's whole logits take
    // most of ZeRO-3's activations without tp).
    let gpt_oss = Command::new(BIN)
        .current_dir(workspace())
        .args([
            "plan",
            "--model",
            "assets/configs/gpt-oss-20b.json",
            "--seq",
            "4096",
        ])
        .args(["--batch", "1", "--gpus", "8", "--gpu_memory", "80GiB"])
        .args(["--gradient_checkpointing", "true"])
        .output()
        .unwrap();
    let said = text(&gpt_oss);
    assert!(said.contains("(20914757184 parameters)"), "{said}");
    let pick = plan_line(&said, "pick:");
    assert!(
        pick.contains("--profile zero3") || pick.contains("--profile fsdp2"),
        "{said}"
    );
    assert!(!said.contains("fits multi_gpu    8"), "{said}");
}

/// `--profile auto` plans a DPO program as DPO: its micro-batch of pairs is twice as many
/// sequences, so the same flags predict a larger peak than for the sft program. Both plan
/// what the programs will train, which the launcher asks the built programs: named no model
/// or data, the bundled jobs' 16 rows per device (their assets/tiny/*.yaml), not TRL's 8.
#[test]
fn profile_auto_plans_a_dpo_program_as_dpo() {
    let plan = |target: &str| -> (String, f64) {
        let o = launch_auto()
            .args(["--dry_run", target, "--", "--max_length", "64"])
            .output()
            .unwrap();
        let all = text(&o);
        assert!(o.status.success(), "{all}");
        let peak = all
            .split("predicted peak ")
            .nth(1)
            .and_then(|r| r.split('M').next())
            .and_then(|m| m.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no predicted peak in:\n{all}"));
        (all, peak)
    };
    let (dpo, dpo_peak) = plan("dpo");
    let (sft, sft_peak) = plan("sft");
    assert!(
        dpo.contains("auto: planning for 16 rows = 32 sequences per micro-batch"),
        "{dpo}"
    );
    let settings = "at max_length 64, per_device_train_batch_size 16";
    assert!(dpo.contains(settings) && sft.contains(settings), "{sft}");
    assert!(!sft.contains("auto: planning for 16 rows"), "{sft}");
    assert!(dpo_peak > sft_peak, "dpo {dpo_peak}M, sft {sft_peak}M");
}
