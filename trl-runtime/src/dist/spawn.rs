//! A minimal local spawner: runs N copies of a program with the torchrun environment
//! contract, prefixes their output with `[rank N]`, and stops the others when one fails.
//! (`cargo trl launch` is the full launcher; this serves examples and tests meanwhile.)

use super::store::TOKEN_VAR;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What happened to the job: every rank's exit status, and the first failure if any.
#[derive(Debug)]
pub struct JobOutcome {
    pub statuses: Vec<Option<ExitStatus>>,
    pub first_failure: Option<(usize, ExitStatus)>,
}

impl JobOutcome {
    pub fn success(&self) -> bool {
        self.first_failure.is_none()
    }
}

/// A port nobody listens on right now (the OS picks it).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The torchrun variables of local rank `rank` of `nproc` on a single machine whose store
/// listens on 127.0.0.1:`port`, plus the job token.
pub fn local_rank_env(
    rank: usize,
    nproc: usize,
    port: u16,
    token: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("WORLD_SIZE", nproc.to_string()),
        ("LOCAL_WORLD_SIZE", nproc.to_string()),
        ("GROUP_RANK", "0".into()),
        ("GROUP_WORLD_SIZE", "1".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        (TOKEN_VAR, token.to_string()),
    ]
}

/// Runs `nproc` local ranks of `program args...` with RANK, WORLD_SIZE, ... set and waits.
/// `env` adds variables for every rank. On the first failure the others get SIGTERM, then
/// SIGKILL after `grace`.
pub fn run_local(
    program: &std::path::Path,
    args: &[String],
    nproc: usize,
    env: &[(String, String)],
    grace: Duration,
) -> std::io::Result<JobOutcome> {
    let port = free_port()?;
    let token = format!("{:016x}", rand::random::<u64>());
    let mut children: Vec<Child> = Vec::new();
    let mut pumps = Vec::new();
    for rank in 0..nproc {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(local_rank_env(rank, nproc, port, &token))
            .env("OMP_NUM_THREADS", "1")
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        for (stream, is_err) in [
            (
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                false,
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                true,
            ),
        ] {
            if let Some(stream) = stream {
                pumps.push(std::thread::spawn(move || {
                    for line in BufReader::new(stream).lines().map_while(Result::ok) {
                        if is_err {
                            eprintln!("[rank {rank}] {line}");
                        } else {
                            println!("[rank {rank}] {line}");
                        }
                    }
                }));
            }
        }
        children.push(child);
    }
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; nproc];
    let mut first_failure = None;
    let mut kill_at: Option<Instant> = None;
    let mut sent: Option<libc::c_int> = None;
    while statuses.iter().any(Option::is_none) {
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                statuses[rank] = Some(status);
                if !status.success() && first_failure.is_none() {
                    first_failure = Some((rank, status));
                    kill_at = Some(Instant::now() + grace);
                }
            }
        }
        if let Some(deadline) = kill_at {
            let signal = if Instant::now() < deadline {
                libc::SIGTERM
            } else {
                libc::SIGKILL
            };
            if sent != Some(signal) {
                sent = Some(signal);
                for (rank, child) in children.iter().enumerate() {
                    if statuses[rank].is_none() {
                        // SAFETY: kill(2) on a child we spawned and have not reaped.
                        unsafe { libc::kill(child.id() as libc::pid_t, signal) };
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pumps {
        let _ = p.join();
    }
    Ok(JobOutcome {
        statuses,
        first_failure,
    })
}

/// For programs that launch themselves when started by hand: unless the torchrun variables are
/// set, re-runs this executable (with its arguments) as `TRL_LOCAL_PROCESSES` local ranks
/// (default `default_ranks`) and returns the job's exit code; returns None inside a rank.
pub fn relaunch_unless_launched(default_ranks: usize) -> Option<std::process::ExitCode> {
    if std::env::var("WORLD_SIZE").is_ok() {
        return None;
    }
    let n = std::env::var("TRL_LOCAL_PROCESSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_ranks);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let outcome = std::env::current_exe()
        .and_then(|exe| run_local(&exe, &args, n, &[], Duration::from_secs(10)));
    Some(match outcome {
        Ok(o) if o.success() => std::process::ExitCode::SUCCESS,
        Ok(o) => {
            if let Some((rank, status)) = o.first_failure {
                eprintln!("job failed: rank {rank} exited with {status}");
            }
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("cannot start the ranks: {e}");
            std::process::ExitCode::FAILURE
        }
    })
}
