//! Collectives across real processes of the host backend, started with the torchrun
//! environment, and a killed peer producing an error on the others instead of a hang.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const WORKER: &str = env!("CARGO_BIN_EXE_comm_worker");

fn launch(nproc: usize, rank: usize, port: u16, mode: &str, token: &str) -> Command {
    let mut c = Command::new(WORKER);
    c.arg(mode)
        .envs(trl_runtime::dist::spawn::local_rank_env(
            rank, nproc, port, token,
        ))
        .env("TRL_COMM_TIMEOUT", "20");
    c
}

#[test]
fn collectives_across_processes() {
    for nproc in [2, 3] {
        let outcome = trl_runtime::dist::spawn::run_local(
            Path::new(WORKER),
            &["collectives".to_string()],
            nproc,
            &[("TRL_COMM_TIMEOUT".into(), "20".into())],
            Duration::from_secs(2),
        )
        .unwrap();
        assert!(outcome.success(), "{nproc} processes: {outcome:?}");
    }
}

#[test]
fn a_killed_peer_is_reported_by_the_others() {
    let port = trl_tests::listen_port();
    let start = Instant::now();
    let mut children: Vec<_> = (0..3)
        .map(|r| launch(3, r, port, "crash", "tok").output_async())
        .collect();
    let outputs: Vec<_> = children.iter_mut().map(|c| c.wait()).collect();
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "took {:?}",
        start.elapsed()
    );
    assert!(!outputs[1].0.success(), "rank 1 aborts");
    for r in [0, 2] {
        let (status, stderr) = &outputs[r];
        assert_eq!(status.code(), Some(3), "rank {r}: {status:?}\n{stderr}");
        assert!(
            stderr.contains("closed its connection"),
            "rank {r}: {stderr}"
        );
    }
    // Rank 2 receives from rank 1 in the ring, so it names it; rank 0 then sees rank 2 leave
    // (the launcher's root-cause report picks the first failure).
    assert!(outputs[2].1.contains("rank 1 closed"), "{}", outputs[2].1);
}

#[test]
fn a_stray_process_with_another_token_cannot_join() {
    let port = trl_tests::listen_port();
    let mut rank0 = launch(2, 0, port, "collectives", "job-a")
        .env("TRL_COMM_TIMEOUT", "3")
        .output_async();
    std::thread::sleep(Duration::from_millis(300));
    let mut stray = launch(2, 1, port, "collectives", "job-b").output_async();
    let (s, err) = stray.wait();
    assert_eq!(s.code(), Some(2), "{err}");
    assert!(err.contains("token"), "{err}");
    let (s0, err0) = rank0.wait();
    assert!(!s0.success());
    assert!(
        err0.contains("[1]") && err0.contains("never arrived"),
        "{err0}"
    );
}

/// A running child whose stderr is collected.
struct Running(std::process::Child);

impl Running {
    fn wait(&mut self) -> (std::process::ExitStatus, String) {
        let out = std::mem::replace(&mut self.0, Command::new("true").spawn().unwrap())
            .wait_with_output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

trait OutputAsync {
    fn output_async(&mut self) -> Running;
}

impl OutputAsync for Command {
    fn output_async(&mut self) -> Running {
        Running(
            self.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        )
    }
}
