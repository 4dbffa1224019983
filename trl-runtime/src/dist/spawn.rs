//! Running the local ranks of a job and supervising them, as torchrun's agent does: one
//! process per local rank with its environment, output prefixed `[rank N]` (optionally teed to
//! per-rank log files), the first failure stops the others (SIGTERM, a grace period, SIGKILL)
//! and is reported with its rank, host, exit code or signal and last lines of output.
//! Workers run in their own process groups, so a terminal's Ctrl-C reaches only the supervisor:
//! the first SIGINT/SIGTERM is passed on as SIGTERM (the trainer saves a checkpoint and exits),
//! a second one kills them. Rank 0's progress events become one live bar (see
//! [`crate::progress`]).
//!
//! `cargo trl launch` builds the workers' environments; examples started by hand use
//! [`relaunch_unless_launched`].

use crate::comm::store::TOKEN_VAR;
use crate::progress::{self, Event, View};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Set for workers whose output the launcher shows with a `[rank N]` prefix (and writes
/// nowhere else), so that their logger does not add the rank again.
pub const PREFIXED_VAR: &str = "TRL_OUTPUT_PREFIXED";
/// Lines of output kept per rank for the failure report.
const TAIL_LINES: usize = 20;
/// Error lines remembered to show a line every rank prints once (bounded: a long run's
/// output is not kept).
const SAID_LINES: usize = 64;

/// One local worker: its global and local rank and its environment.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub rank: usize,
    pub local_rank: usize,
    pub env: Vec<(String, String)>,
}

#[derive(Debug, Clone)]
pub struct Job {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub workers: Vec<WorkerSpec>,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    /// How often worker states are polled.
    pub monitor_interval: Duration,
    /// Per-rank log files (`rank-N.log`) in this directory.
    pub log_dir: Option<PathBuf>,
    /// With a log dir: also print the output to the terminal.
    pub tee: bool,
}

/// The first worker that failed.
#[derive(Debug, Clone)]
pub struct Failure {
    pub rank: usize,
    pub local_rank: usize,
    pub host: String,
    pub status: ExitStatus,
    pub last_lines: Vec<String>,
    /// Its output was shown as it came (then the report does not repeat it).
    pub shown: bool,
}

impl Failure {
    pub fn describe_status(&self) -> String {
        match (self.status.code(), self.status.signal()) {
            (Some(code), _) => format!("exit code {code}"),
            (None, Some(sig)) => format!("signal {sig} ({})", signal_name(sig)),
            _ => "unknown status".into(),
        }
    }

    /// The root-cause report printed by the launcher.
    pub fn report(&self) -> String {
        let mut r = format!(
            "root cause: rank {} (local rank {}) on host {} failed with {}",
            self.rank,
            self.local_rank,
            self.host,
            self.describe_status()
        );
        if self.last_lines.is_empty() {
            r.push_str("\n  (no output)");
        } else if self.shown {
            // One message per failure: what the worker said is above, once.
            r.push_str(" (its output is above)");
        } else {
            r.push_str(&format!(
                "\n  last {} line(s) of its output:",
                self.last_lines.len()
            ));
            for l in &self.last_lines {
                r.push_str(&format!("\n  | {l}"));
            }
        }
        r
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL: killed, possibly by the out-of-memory killer",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV: segmentation fault",
        libc::SIGABRT => "SIGABRT: aborted",
        libc::SIGBUS => "SIGBUS",
        _ => "signal",
    }
}

/// What happened to the job.
#[derive(Debug)]
pub struct JobOutcome {
    pub statuses: Vec<Option<ExitStatus>>,
    pub failure: Option<Failure>,
    /// The supervisor was asked to stop (SIGINT/SIGTERM) and passed it on.
    pub interrupted: bool,
    /// The last checkpoint rank 0 reported saving (when rank 0 ran here).
    pub last_checkpoint: Option<String>,
}

impl JobOutcome {
    pub fn success(&self) -> bool {
        self.failure.is_none() && self.statuses.iter().all(|s| s.is_some_and(|s| s.success()))
    }
}

/// A port nobody listens on right now (the OS picks it).
/// A listening socket on `addr` at a port the OS picks, inherited by the processes this one
/// starts: rank 0 serves the rendezvous store on it (its descriptor in
/// [`crate::comm::store::LISTEN_FD_VAR`]), so no other job can take the port between its
/// choice and its use, as a port found free and bound later could be.
pub fn inheritable_listener(addr: &str) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::AsRawFd;
    let listener = std::net::TcpListener::bind((addr, 0))?;
    // std opens sockets close-on-exec; this one is meant for a child.
    // SAFETY: F_SETFD on a descriptor this function owns.
    if unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_SETFD, 0) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(listener)
}

/// The environment entry that hands `listener` to rank 0.
pub fn listener_env(listener: &std::net::TcpListener) -> (String, String) {
    use std::os::fd::AsRawFd;
    (
        crate::comm::store::LISTEN_FD_VAR.to_string(),
        listener.as_raw_fd().to_string(),
    )
}

pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Where one worker stands in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankPlace {
    pub rank: usize,
    pub local_rank: usize,
    pub world: usize,
    pub local_world: usize,
    pub node_rank: usize,
    pub nodes: usize,
}

/// torchrun's environment contract for one worker (plus the job token): the one place that
/// spells it, for the launcher and the local spawner alike.
pub fn torchrun_env(
    p: RankPlace,
    master_addr: &str,
    master_port: u16,
    token: &str,
) -> Vec<(String, String)> {
    [
        ("RANK", p.rank.to_string()),
        ("LOCAL_RANK", p.local_rank.to_string()),
        ("WORLD_SIZE", p.world.to_string()),
        ("LOCAL_WORLD_SIZE", p.local_world.to_string()),
        ("GROUP_RANK", p.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", p.nodes.to_string()),
        ("MASTER_ADDR", master_addr.to_string()),
        ("MASTER_PORT", master_port.to_string()),
        (TOKEN_VAR, token.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The torchrun variables of local rank `rank` of `nproc` on a single machine whose store
/// listens on 127.0.0.1:`port`, plus the job token.
pub fn local_rank_env(rank: usize, nproc: usize, port: u16, token: &str) -> Vec<(String, String)> {
    let place = RankPlace {
        rank,
        local_rank: rank,
        world: nproc,
        local_world: nproc,
        node_rank: 0,
        nodes: 1,
    };
    torchrun_env(place, "127.0.0.1", port, token)
}

/// A fresh random job token.
pub fn new_token() -> String {
    format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}

pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into a valid buffer.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "localhost".into()
    }
}

fn signal_all(pids: &[u32], done: &[Option<ExitStatus>], sig: libc::c_int) {
    for (pid, status) in pids.iter().zip(done) {
        if status.is_none() {
            // SAFETY: kill(2) on a child we spawned whose exit has not been reported.
            unsafe { libc::kill(*pid as libc::pid_t, sig) };
        }
    }
}

/// How long after the first failure other failures still count for the root cause: a rank
/// that loses a killed peer exits within milliseconds, sometimes reported first.
const SETTLE: Duration = Duration::from_millis(300);

/// Runs the job once and supervises it until every worker has exited.
pub fn run_job(job: &Job) -> std::io::Result<JobOutcome> {
    let view = Arc::new(Mutex::new(View::for_this_terminal()));
    let interrupted = Arc::new(AtomicBool::new(false));
    let _ = signal_hook::flag::register(signal_hook::consts::SIGTERM, interrupted.clone());
    let _ = signal_hook::flag::register(signal_hook::consts::SIGINT, interrupted.clone());
    if let Some(dir) = &job.log_dir {
        std::fs::create_dir_all(dir)?;
    }
    let host = hostname();
    // The latest error lines shown, and the rank that said each first: the same line from
    // another rank (every rank refusing the same flag) is shown once.
    let said: Arc<Mutex<VecDeque<(String, usize)>>> = Default::default();
    let mut children = Vec::new();
    let mut tails: Vec<Arc<Mutex<VecDeque<String>>>> = Vec::new();
    let mut pumps = Vec::new();
    for w in &job.workers {
        let mut cmd = Command::new(&job.program);
        cmd.args(&job.args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &w.env {
            cmd.env(k, v);
        }
        if job.log_dir.is_none() {
            cmd.env(PREFIXED_VAR, "1");
        }
        cmd.env(progress::LINES_VAR, "1");
        // Its own process group: the terminal's Ctrl-C goes to the supervisor alone, which
        // asks the workers to save and stop.
        cmd.process_group(0);
        // SAFETY: prctl(2) is async-signal-safe; it only sets a flag of the child process.
        unsafe {
            cmd.pre_exec(|| {
                // Outside the terminal's group a worker would outlive a killed supervisor.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot start {}: {e}", job.program.display()),
            )
        })?;
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let log = match &job.log_dir {
            Some(dir) => Some(Arc::new(Mutex::new(std::fs::File::create(
                dir.join(format!("rank-{}.log", w.rank)),
            )?))),
            None => None,
        };
        let show = job.log_dir.is_none() || job.tee;
        let streams: [(Option<Box<dyn std::io::Read + Send>>, bool); 2] = [
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
        ];
        for (stream, is_err) in streams {
            let Some(stream) = stream else { continue };
            let sink = Sink {
                rank: w.rank,
                show,
                view: view.clone(),
                log: log.clone(),
                tail: tail.clone(),
                said: said.clone(),
            };
            pumps.push(std::thread::spawn(move || pump(stream, is_err, sink)));
        }
        children.push(child);
        tails.push(tail);
    }
    let n = children.len();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    // One waiter per worker reports its exit the moment it happens, so that the first to
    // fail is the first to die (a killed rank, not the rank that lost its peer a few
    // milliseconds later), whatever the ranks' order.
    let (exits, exited) = std::sync::mpsc::channel();
    for (i, mut child) in children.into_iter().enumerate() {
        let exits = exits.clone();
        std::thread::spawn(move || {
            let _ = exits.send((i, child.wait()));
        });
    }
    drop(exits);
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    // Failures in the order they were reported, until the root cause is chosen.
    let mut failures: Vec<(usize, ExitStatus)> = Vec::new();
    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut settle_until: Option<Instant> = None;
    let mut kill_at: Option<Instant> = None;
    let mut forwarded = false;
    let mut stopping = false;
    while statuses.iter().any(Option::is_none) {
        // Every exit already reported, in the order they happened, then the checks below at
        // least every monitor interval.
        let wait = settle_until.map_or(job.monitor_interval, |t| {
            t.saturating_duration_since(Instant::now())
                .min(job.monitor_interval)
        });
        let first = match exited.recv_timeout(wait) {
            Ok(exit) => Some(exit),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(std::io::Error::other("a worker's waiter stopped"))
            }
        };
        for (i, status) in first.into_iter().chain(exited.try_iter()) {
            let status = status?;
            statuses[i] = Some(status);
            if !status.success() && !stopping && !forwarded {
                failures.push((i, status));
                settle_until.get_or_insert(Instant::now() + SETTLE);
            }
        }
        let settled = settle_until.is_some_and(|t| Instant::now() >= t)
            || statuses.iter().all(Option::is_some);
        if !failures.is_empty() && settled && !stopping {
            // The root cause: a rank killed by a signal among the failures of the first
            // moments (a peer that lost it exits with an error a moment later, and can be
            // reported first), else the first to fail. Then the first failure stops the
            // rest: SIGTERM now, SIGKILL after the grace period.
            failure = failures
                .iter()
                .find(|(_, s)| s.signal().is_some())
                .or(failures.first())
                .copied();
            stopping = true;
            signal_all(&pids, &statuses, libc::SIGTERM);
            kill_at = Some(Instant::now() + job.grace);
        }
        if interrupted.swap(false, Ordering::Relaxed) {
            if !forwarded {
                // Pass the stop request on; workers save a checkpoint and exit.
                forwarded = true;
                view.lock().unwrap().println(
                    "interrupted: the workers save a checkpoint and stop (press Ctrl-C again to kill them)",
                    true,
                );
                signal_all(&pids, &statuses, libc::SIGTERM);
                kill_at.get_or_insert(Instant::now() + job.grace.max(Duration::from_secs(30)));
            } else {
                view.lock()
                    .unwrap()
                    .println("interrupted again: killing the workers", true);
                signal_all(&pids, &statuses, libc::SIGKILL);
            }
        }
        if kill_at.is_some_and(|t| Instant::now() > t) {
            signal_all(&pids, &statuses, libc::SIGKILL);
            kill_at = None;
        }
    }
    for p in pumps {
        let _ = p.join();
    }
    let view = view.lock().unwrap();
    view.finish();
    let failure = failure.map(|(i, status)| Failure {
        rank: job.workers[i].rank,
        local_rank: job.workers[i].local_rank,
        host: host.clone(),
        status,
        last_lines: tails[i].lock().unwrap().iter().cloned().collect(),
        shown: job.log_dir.is_none() || job.tee,
    });
    Ok(JobOutcome {
        statuses,
        failure,
        interrupted: forwarded,
        last_checkpoint: view.last_checkpoint.clone(),
    })
}

/// Where one worker's output goes: the launcher's view (prefixed with its rank), its log
/// file, the tail kept for a failure report.
struct Sink {
    rank: usize,
    show: bool,
    view: Arc<Mutex<View>>,
    log: Option<Arc<Mutex<std::fs::File>>>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// The latest error lines shown (at most [`SAID_LINES`]) and the rank that said each.
    said: Arc<Mutex<VecDeque<(String, usize)>>>,
}

/// Reads one of a worker's streams line by line into `sink`: progress events to the view
/// (rank 0's), and every other line shown (an error line another rank said first is not
/// shown again), logged and kept in the tail.
fn pump(stream: Box<dyn std::io::Read + Send>, is_err: bool, sink: Sink) {
    let rank = sink.rank;
    for line in BufReader::new(stream).lines().map_while(Result::ok) {
        if let Some(event) = Event::parse(&line) {
            if rank == 0 {
                sink.view.lock().unwrap().update(event);
            }
            continue;
        }
        let first = !is_err || {
            let mut said = sink.said.lock().unwrap();
            match said.iter().find(|(l, _)| *l == line) {
                Some((_, by)) => *by == rank,
                None => {
                    if said.len() == SAID_LINES {
                        said.pop_front();
                    }
                    said.push_back((line.clone(), rank));
                    true
                }
            }
        };
        if sink.show && first {
            sink.view
                .lock()
                .unwrap()
                .println(&format!("[rank {rank}] {line}"), is_err);
        }
        if let Some(f) = &sink.log {
            let _ = writeln!(f.lock().unwrap(), "{line}");
        }
        let mut t = sink.tail.lock().unwrap();
        if t.len() == TAIL_LINES {
            t.pop_front();
        }
        t.push_back(line);
    }
}

/// Runs `nproc` local ranks of `program args...` with the torchrun variables (and `env`).
pub fn run_local(
    program: &Path,
    args: &[String],
    nproc: usize,
    env: &[(String, String)],
    grace: Duration,
) -> std::io::Result<JobOutcome> {
    let listener = inheritable_listener("127.0.0.1")?;
    let port = listener.local_addr()?.port();
    let token = new_token();
    let threads = (std::thread::available_parallelism().map_or(1, |n| n.get()) / nproc)
        .max(1)
        .to_string();
    let workers = (0..nproc)
        .map(|rank| {
            let mut e = local_rank_env(rank, nproc, port, &token);
            if rank == 0 {
                e.push(listener_env(&listener));
            }
            e.push(("OMP_NUM_THREADS".into(), threads.clone()));
            e.push(("RAYON_NUM_THREADS".into(), threads.clone()));
            e.extend(env.iter().cloned());
            WorkerSpec {
                rank,
                local_rank: rank,
                env: e,
            }
        })
        .collect();
    run_job(&Job {
        program: program.to_path_buf(),
        args: args.to_vec(),
        workers,
        grace,
        monitor_interval: Duration::from_millis(20),
        log_dir: None,
        tee: false,
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
        // Stopped by SIGTERM / Ctrl-C (the ranks saved): 130, as the launcher exits, with
        // the command that goes on.
        // Stopped by SIGTERM / Ctrl-C (the ranks saved): 130, as the launcher exits, with
        // the command that goes on.
        Ok(o) if o.interrupted => {
            eprintln!("{}", o.interrupted_note(false));
            std::process::ExitCode::from(130)
        }
        Ok(o) if o.success() => std::process::ExitCode::SUCCESS,
        Ok(o) => {
            if let Some(f) = &o.failure {
                eprintln!("{}", f.report());
            }
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("cannot start the ranks: {e}");
            std::process::ExitCode::FAILURE
        }
    })
}

impl JobOutcome {
    /// What an interrupted job (SIGTERM / Ctrl-C passed on to its ranks) says: the checkpoint
    /// its ranks saved and the command that goes on from it (`separated`: the command passes
    /// the program's flags after a `--`, as `cargo trl launch` does).
    pub fn interrupted_note(&self, separated: bool) -> String {
        let clean = self.statuses.iter().all(|s| s.is_some_and(|s| s.success()));
        let argv: Vec<String> = std::env::args().collect();
        let again = |path: &str| resume_command(&argv, path, separated);
        match (&self.last_checkpoint, clean) {
            (Some(path), true) => format!(
                "interrupted: the workers saved {path} and stopped; go on with: {}",
                again(path)
            ),
            (Some(path), false) => format!(
                "interrupted: the workers were stopped before they finished saving; the last complete checkpoint is {path}; go on with: {}",
                again(path)
            ),
            (None, true) => "interrupted: the workers stopped".into(),
            (None, false) => "interrupted: the workers were stopped before they saved (no checkpoint was reported on this node)".into(),
        }
    }
}

/// The command that goes on from `checkpoint`: `argv` (the command as run, `cargo trl ...`
/// for the cargo subcommand) with `--resume_from_checkpoint checkpoint` for the program, set
/// where the program's flags are (after a `--` when `separated` and the command has one; an
/// existing value replaced), quoted for a POSIX shell.
pub fn resume_command(argv: &[String], checkpoint: &str, separated: bool) -> String {
    let mut words: Vec<String> = match argv {
        [exe, sub, rest @ ..] if sub == "trl" && exe.ends_with("cargo-trl") => {
            ["cargo".to_string(), "trl".to_string()]
                .into_iter()
                .chain(rest.iter().cloned())
                .collect()
        }
        _ => argv.to_vec(),
    };
    let program_flags = match separated {
        true => words.iter().position(|w| w == "--").map(|i| i + 1),
        false => Some(1),
    };
    let flag = "--resume_from_checkpoint";
    let existing = program_flags.and_then(|from| {
        (from..words.len()).find(|&i| words[i] == flag || words[i].starts_with(&format!("{flag}=")))
    });
    match (existing, program_flags) {
        (Some(i), _) if words[i] == flag && i + 1 < words.len() => words[i + 1] = checkpoint.into(),
        (Some(i), _) => words[i] = format!("{flag}={checkpoint}"),
        (None, Some(_)) => words.extend([flag.to_string(), checkpoint.to_string()]),
        (None, None) => words.extend(["--".into(), flag.to_string(), checkpoint.to_string()]),
    }
    words
        .iter()
        .map(|w| shell_quote(w))
        .collect::<Vec<_>>()
        .join(" ")
}

fn shell_quote(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    match plain {
        true => w.to_string(),
        false => format!("'{}'", w.replace('\'', "'\\''")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_resume_hint_is_a_valid_command() {
        let v = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let ck = "out/checkpoint-7";
        assert_eq!(
            resume_command(&v("/x/cargo-trl trl launch --profile multi_cpu sft -- --num_train_epochs 8"), ck, true),
            "cargo trl launch --profile multi_cpu sft -- --num_train_epochs 8 --resume_from_checkpoint out/checkpoint-7"
        );
        assert_eq!(
            resume_command(
                &v("/x/cargo-trl trl launch --profile multi_cpu sft"),
                ck,
                true
            ),
            "cargo trl launch --profile multi_cpu sft -- --resume_from_checkpoint out/checkpoint-7"
        );
        assert_eq!(
            resume_command(
                &v("/x/cargo-trl trl launch sft -- --resume_from_checkpoint latest"),
                ck,
                true
            ),
            "cargo trl launch sft -- --resume_from_checkpoint out/checkpoint-7"
        );
        assert_eq!(
            resume_command(&v("target/release/sft --learning_rate 1e-4"), "my dir/checkpoint-7", false),
            "target/release/sft --learning_rate 1e-4 --resume_from_checkpoint 'my dir/checkpoint-7'"
        );
    }

    /// The automatic port stays taken from its choice on (no other job can bind it), and its
    /// socket survives exec into the workers (not close-on-exec). That rank 0 serves on it is
    /// what every launch test does (they all use port 0; rank 0 could not bind the held port).
    #[test]
    fn an_automatic_port_is_held_and_inherited() {
        let listener = inheritable_listener("127.0.0.1").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_err());
        // SAFETY: F_GETFD on a descriptor the listener owns.
        let flags = unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, 0);
    }
}
