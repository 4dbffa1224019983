//! `cargo trl launch` end to end with the real binary and a real worker program
//! (examples/launch_worker.rs): success, a failing rank, a killed rank, a restart that
//! recovers, SIGTERM passed on to the workers, the dry-run plan, and every validation error.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");

fn worker() -> PathBuf {
    let p = PathBuf::from(BIN)
        .parent()
        .unwrap()
        .join("examples/launch_worker");
    assert!(p.exists(), "{} is built by cargo test", p.display());
    p
}

fn launch(args: &[&str]) -> Output {
    Command::new(BIN).arg("launch").args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `launch --profile multi_cpu` on a free port of the worker with `extra` launcher flags and
/// `worker_args` for the worker.
fn launch_worker(extra: &[&str], worker_args: &[&str]) -> Output {
    let w = worker();
    let mut args = vec![
        "--profile",
        "multi_cpu",
        "--main_process_port",
        "0",
        "--stop_grace",
        "2",
    ];
    args.extend_from_slice(extra);
    args.push(w.to_str().unwrap());
    args.push("--");
    args.extend_from_slice(worker_args);
    launch(&args)
}

#[test]
fn two_processes_get_the_torchrun_contract() {
    let o = launch_worker(&[], &["ok"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("[rank 0] rank=0 local_rank=0 world=2 local_world=2 group_rank=0"),
        "{t}"
    );
    assert!(t.contains("[rank 1] rank=1 local_rank=1 world=2"), "{t}");
    assert!(t.contains("threads=1 token_set=true"), "{t}");
}

#[test]
fn a_failing_rank_stops_the_others_and_is_reported() {
    let start = Instant::now();
    let o = launch_worker(&[], &["fail", "1", "7"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("root cause: rank 1 (local rank 1)") && t.contains("exit code 7"),
        "{t}"
    );
    // Its message once, as it came; the report points at it instead of repeating it.
    let said = "rank 1: something went wrong, exiting with 7";
    assert_eq!(t.matches(said).count(), 1, "{t}");
    assert!(t.contains("(its output is above)"), "{t}");
    // Rank 0 sleeps 30 s unless stopped.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

/// A program refusing its flags (clap's exit 2, every rank alike) makes the launch exit 2,
/// with the refusal printed once, as `cargo run` does.
#[test]
fn a_mistyped_program_flag_exits_2_and_says_so_once() {
    let o = Command::new(BIN)
        .current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
        .env("CARGO_NET_OFFLINE", "true")
        .args(["launch", "--debug", "--main_process_port", "0"])
        .args([
            "--profile",
            "multi_cpu",
            "sft",
            "--",
            "--learning_rat",
            "1e-3",
        ])
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert_eq!(
        t.matches("unexpected argument '--learning_rat' found")
            .count(),
        1,
        "{t}"
    );
    assert!(t.contains("refused its arguments"), "{t}");
}

#[test]
fn a_killed_rank_is_reported_with_its_signal() {
    let o = launch_worker(&[], &["kill", "0"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("root cause: rank 0") && t.contains("signal 9"),
        "{t}"
    );
}

/// Rank 1 killed, rank 0 exiting with 1 a moment later when it loses its peer: the root cause
/// is rank 1 with its signal (and the out-of-memory hint) every time, whatever the ranks'
/// order in the supervisor's loop.
#[test]
fn the_first_rank_to_die_is_the_root_cause() {
    for run in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let o = launch_worker(&[], &["kill-peer", dir.path().to_str().unwrap()]);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{t}");
        assert!(
            t.contains("root cause: rank 1")
                && t.contains("signal 9")
                && t.contains("out-of-memory"),
            "run {run}: {t}"
        );
    }
}

#[test]
fn max_restarts_recovers_from_a_one_time_failure() {
    let dir = tempfile::tempdir().unwrap();
    let o = launch_worker(
        &["--max_restarts", "1"],
        &["flaky", dir.path().to_str().unwrap()],
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("restarting the group (restart 1 of 1)") && t.contains("attempt 1 succeeded"),
        "{t}"
    );
    // Without restarts the same failure ends the job.
    let dir = tempfile::tempdir().unwrap();
    let o = launch_worker(&[], &["flaky", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn sigterm_to_the_launcher_reaches_every_worker() {
    let w = worker();
    let child = Command::new(BIN)
        .args([
            "launch",
            "--profile",
            "multi_cpu",
            "--main_process_port",
            "0",
            w.to_str().unwrap(),
            "--",
            "wait",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    let t = text(&o);
    assert!(
        t.contains("[rank 0] got SIGTERM") && t.contains("[rank 1] got SIGTERM"),
        "{t}"
    );
}

#[test]
fn dry_run_prints_the_plan_without_building() {
    let o = launch(&[
        "--profile",
        "alst_ulysses_cpu",
        "--dry-run",
        "launch_worker",
        "--",
        "ok",
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("world 4 = 1 machine(s) x 4 process(es)"), "{t}");
    assert!(
        t.contains("mesh: dp_replicate=1 dp_shard=2 cp=1 sp=2 tp=1"),
        "{t}"
    );
    assert!(
        t.contains("build: cargo build -p cargo-trl --example launch_worker --release"),
        "{t}"
    );
    assert!(
        t.contains("rank 3 (local 3): coordinate dp_replicate=0 dp_shard=1 cp=0 sp=1 tp=0"),
        "{t}"
    );
    assert!(
        t.contains("ACCELERATE_DEEPSPEED_ZERO_STAGE=3")
            && t.contains("PARALLELISM_CONFIG_SP_SIZE=2"),
        "{t}"
    );
    assert!(t.contains("TRL_JOB_TOKEN=<secret>"), "{t}");

    // FSDP's settings travel as Accelerate names them (prefetch included).
    let o = launch(&["--profile", "fsdp2_cpu", "--dry-run", "launch_worker"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for var in [
        "ACCELERATE_USE_FSDP=true",
        "FSDP_VERSION=2",
        "FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP",
        "FSDP_BACKWARD_PREFETCH=BACKWARD_PRE",
        "FSDP_FORWARD_PREFETCH=false",
    ] {
        assert!(t.contains(var), "{var} missing from\n{t}");
    }
}

#[test]
fn dry_run_shows_the_tensor_parallel_plan() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/tiny/model");
    // The plan comes from the worker itself: built (in debug, as the other tests build
    // workers) and asked.
    let o = launch(&[
        "--debug",
        "--profile",
        "fsdp2_tp_cpu",
        "--dry-run",
        "launch_worker",
        "--",
        "--model_name_or_path",
        model,
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for want in [
        "mesh: dp_replicate=1 dp_shard=2 cp=1 sp=1 tp=2",
        "tensor-parallel plan (tp = 2)",
        "[284, 64] -> [142, 64] per rank",
        "(layers 1 and up are split as layer 0)",
        "rank 1 (local 1): coordinate dp_replicate=0 dp_shard=0 cp=0 sp=0 tp=1",
    ] {
        assert!(t.contains(want), "{want} missing from\n{t}");
    }
    let line = |name: &str| {
        t.lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no line for {name} in\n{t}"))
            .to_string()
    };
    let q = line("model.layers.0.self_attn.q_proj.weight");
    assert!(
        q.contains("column") && q.contains("[64, 64] -> [32, 64]"),
        "{q}"
    );
    let o_proj = line("model.layers.0.self_attn.o_proj.weight");
    assert!(
        o_proj.contains("row") && o_proj.contains("dim 1"),
        "{o_proj}"
    );
    assert!(line("model.norm.weight").contains("whole"));
    assert!(!t.contains("model.layers.1."), "{t}");

    // A tp size the model cannot take is refused before anything starts.
    let o = launch(&[
        "--debug",
        "--profile",
        "fsdp2_tp_cpu",
        "--parallelism_config_tp_size",
        "4",
        "--parallelism_config_dp_shard_size",
        "1",
        "launch_worker",
        "--",
        "--model_name_or_path",
        model,
    ]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("parallelism_config_tp_size = 4") && t.contains("num_kv_heads"),
        "{t}"
    );
}

#[test]
fn invalid_launches_fail_before_starting_anything() {
    let w = worker();
    let w = w.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--profile", "zero3", w], "0 GPU(s) are present"),
        (
            vec![
                "--profile",
                "multi_cpu",
                "--num_processes",
                "3",
                "--num_machines",
                "2",
                w,
            ],
            "must divide evenly by num_machines 2",
        ),
        (
            vec![
                "--profile",
                "multi_cpu",
                "--parallelism_config_tp_size",
                "3",
                w,
            ],
            "tp=3",
        ),
        (vec!["--profile", "no_such_profile", w], "use one of"),
        (
            vec!["--profile", "multi_cpu", "--mixed_precision", "fp64", w],
            "--mixed_precision 'fp64'",
        ),
        (
            vec![
                "--profile",
                "multi_cpu",
                "--main_process_port",
                "0",
                "/no/such/program",
            ],
            "no such executable",
        ),
        (
            vec!["--profile", "multi_cpu", "--machine_rank", "1", w],
            "machine_rank 1 must be below num_machines 1",
        ),
    ];
    for (args, want) in cases {
        let o = launch(&args);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains(want), "{args:?}: expected '{want}' in {t}");
    }
    // A port already taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let o = launch(&["--profile", "multi_cpu", "--main_process_port", &port, w]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains(&format!("main_process_port {port}")) && t.contains("--main_process_port 0"),
        "{t}"
    );
}

#[test]
fn inside_slurm_machines_and_master_come_from_slurm() {
    let slurm = |extra: &[(&str, &str)]| {
        let mut c = Command::new(BIN);
        c.args([
            "launch",
            "--profile",
            "multi_cpu",
            "--num_processes",
            "4",
            "--dry-run",
            "launch_worker",
        ])
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_NODEID", "1")
        .env("SLURM_NNODES", "2")
        .env("SLURM_JOB_NODELIST", "gpu[07-08]")
        .env("SLURM_STEP_ID", "0")
        .env("SLURM_LOCALID", "0");
        for (k, v) in extra {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let o = slurm(&[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("SLURM job 4242: machine 1 of 2, master gpu07:19242"),
        "{t}"
    );
    assert!(
        t.contains("rank 2 (local 0)")
            && t.contains("rank 3 (local 1)")
            && t.contains("GROUP_RANK=1"),
        "{t}"
    );
    // Flags still win.
    let o = Command::new(BIN)
        .args([
            "launch",
            "--profile",
            "multi_cpu",
            "--dry-run",
            "--machine_rank",
            "0",
            "--num_machines",
            "1",
            "launch_worker",
        ])
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_NODEID", "1")
        .env("SLURM_NNODES", "1")
        .env("SLURM_JOB_NODELIST", "n1")
        .output()
        .unwrap();
    assert!(text(&o).contains("this is machine 0"), "{}", text(&o));
    // The classic mistakes are refused with the fix.
    let mut c = Command::new(BIN);
    c.args([
        "launch",
        "--profile",
        "multi_cpu",
        "--dry-run",
        "launch_worker",
    ])
    .env("SLURM_JOB_ID", "7")
    .env("SLURM_NODEID", "0")
    .env("SLURM_NNODES", "2")
    .env("SLURM_JOB_NODELIST", "n[1-2]")
    .env_remove("SLURM_STEP_ID");
    let o = c.output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("srun --ntasks-per-node=1"),
        "{}",
        text(&o)
    );
    let o = slurm(&[("SLURM_LOCALID", "1")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("more than one"), "{}", text(&o));
}
