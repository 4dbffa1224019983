//! SLURM for real, on the two-node cluster `.ci/slurm-cluster` starts on this machine (nodes
//! n1 and n2): hostlists expand as `scontrol show hostnames` does; `cargo trl launch` under
//! srun on one and on two nodes; `cargo trl slurm` writes an sbatch script that runs the job
//! on both nodes with the right machine ranks.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};
use trl_runtime::dist::hostlist::expand;
use trl_tests::text;

const WORKER: &str = env!("CARGO_BIN_EXE_comm_worker");

fn launcher() -> PathBuf {
    trl_tests::launcher(WORKER)
}

fn cluster_up() {
    let out = Command::new("sinfo")
        .args(["-h", "-N", "-o", "%N %T"])
        .output();
    let text = out
        .as_ref()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    assert!(
        text.contains("n1") && text.contains("n2"),
        "the local SLURM cluster is not running ({text:?}): start it with .ci/slurm-cluster (as .ci/run does)"
    );
}

#[test]
#[ignore = "needs the local two-node SLURM cluster: run .ci/slurm-cluster as root, then `cargo test -- --include-ignored`"]
fn hostlists_expand_like_scontrol() {
    cluster_up();
    for list in [
        "n[1-2]",
        "gpu[01-04,07],cpu3",
        "r[1-2]n[08-10]",
        "node9,node[10-11]",
        "a[009-011]",
    ] {
        let out = Command::new("scontrol")
            .args(["show", "hostnames", list])
            .output()
            .unwrap();
        let theirs: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        assert_eq!(expand(list).unwrap(), theirs, "{list}");
    }
}

fn srun(nodes: &str, extra: &[&str], port: &str) -> Output {
    Command::new("srun")
        .args([
            "-N",
            nodes,
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            "--time=2",
        ])
        .arg(launcher())
        .args([
            "launch",
            "--profile",
            "multi_cpu",
            "--main_process_port",
            port,
        ])
        .args(extra)
        .args([WORKER, "--", "collectives"])
        .env("TRL_JOB_TOKEN", "slurm-test-token")
        .env("TRL_COMM_TIMEOUT", "60")
        .output()
        .unwrap()
}

#[test]
#[ignore = "needs the local two-node SLURM cluster: run .ci/slurm-cluster as root, then `cargo test -- --include-ignored`"]
fn launch_under_srun_on_one_and_two_nodes() {
    cluster_up();
    // One node, two processes on it.
    let o = srun("1", &[], "0");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("collectives ok on rank 0") && t.contains("collectives ok on rank 1"),
        "{t}"
    );
    // Two nodes, one process each: machine ranks from SLURM_NODEID, master = first node.
    let port = trl_tests::listen_port().to_string();
    let o = srun("2", &["--num_processes", "2"], &port);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("machine 0 of 2, master n1") && t.contains("machine 1 of 2, master n1"),
        "{t}"
    );
    assert!(
        t.contains("[rank 0] collectives ok on rank 0")
            && t.contains("[rank 1] collectives ok on rank 1"),
        "{t}"
    );
}

fn wait_for_job(id: &str) {
    let start = Instant::now();
    loop {
        let out = Command::new("squeue")
            .args(["-h", "-j", id])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "job {id} still queued or running"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
#[ignore = "needs the local two-node SLURM cluster: run .ci/slurm-cluster as root, then `cargo test -- --include-ignored`"]
fn sbatch_script_runs_on_both_nodes() {
    cluster_up();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("job.sbatch");
    let run = |print: bool| {
        let mut c = Command::new(launcher());
        c.current_dir(dir.path())
            .args([
                "slurm",
                "--nodes",
                "2",
                "--job-name",
                "trltest",
                "--time",
                "5",
                "--script",
            ])
            .arg(&script);
        if print {
            c.arg("--print");
        }
        c.args([
            "--profile",
            "multi_cpu",
            "--num_processes",
            "2",
            WORKER,
            "--",
            "collectives",
        ]);
        c.env("TRL_COMM_TIMEOUT", "60").output().unwrap()
    };
    let printed = run(true);
    let s = text(&printed);
    assert!(printed.status.success(), "{s}");
    assert!(
        s.contains("#SBATCH --nodes=2") && s.contains("#SBATCH --ntasks-per-node=1"),
        "{s}"
    );
    // Nothing rank-specific is expanded in the batch script (the classic every-node-is-0 bug).
    assert!(
        s.contains("srun --ntasks-per-node=1")
            && !s.contains("$SLURM_NODEID")
            && !s.contains("--machine_rank"),
        "{s}"
    );
    let submitted = run(false);
    let s = text(&submitted);
    assert!(submitted.status.success(), "{s}");
    let id = s
        .split_whitespace()
        .find(|w| w.chars().all(|c| c.is_ascii_digit()))
        .expect("a job id")
        .to_string();
    wait_for_job(&id);
    let log =
        std::fs::read_to_string(dir.path().join(format!("trltest-{id}.out"))).unwrap_or_default();
    assert!(
        log.contains("[rank 0] collectives ok on rank 0")
            && log.contains("[rank 1] collectives ok on rank 1"),
        "{log}"
    );
    assert!(Path::new(&script).exists());
}
