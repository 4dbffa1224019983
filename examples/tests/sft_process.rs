//! The main job as a real process: killed at random moments while it saves a checkpoint at
//! every step, the newest complete checkpoint always loads; SIGTERM saves and exits cleanly.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use trl_runtime::parallel::CausalLm;
use trl_runtime::train::{checkpoint, AdamW, AdamWConfig};

const SFT: &str = env!("CARGO_BIN_EXE_sft");

/// One rank with the torchrun variables, so this process is the whole job (no spawner).
fn start(out: &Path, extra: &[&str]) -> Child {
    let port = trl_runtime::dist::spawn::free_port().unwrap();
    Command::new(SFT)
        .args([
            "--output_dir",
            out.to_str().unwrap(),
            "--disable_tqdm",
            "--save_steps",
            "1",
            "--eval_steps",
            "100000",
        ])
        .args(extra)
        .envs(trl_runtime::dist::spawn::local_rank_env(0, 1, port, "t"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn checkpoint_loads(dir: &Path) {
    let model = CausalLm::from_pretrained(dir, candle_core::DType::F32, &candle_core::Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut opt = AdamW::for_params(&model.params, AdamWConfig::default()).unwrap();
    let state = checkpoint::load_training_state(dir, &mut opt).unwrap();
    assert!(dir.ends_with(format!("checkpoint-{}", state.global_step)));
    assert!(dir.join("tokenizer.json").exists());
}

fn wait_for_checkpoints(out: &Path, n: usize, timeout: Duration) {
    let start = Instant::now();
    while checkpoint::list(out).len() < n {
        assert!(
            start.elapsed() < timeout,
            "no checkpoint appeared in {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_kill_during_save_leaves_a_loadable_latest_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    for (round, delay_ms) in [(0, 7u64), (1, 23), (2, 41)] {
        let out = tmp.path().join(format!("run{round}"));
        let mut child = start(&out, &["--max_steps", "100000"]);
        wait_for_checkpoints(&out, 2, Duration::from_secs(120));
        // A checkpoint is written after every step: a kill now lands in or near a save.
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let complete = checkpoint::list(&out);
        assert!(!complete.is_empty());
        for (_, dir) in &complete {
            checkpoint_loads(dir);
        }
        let latest = checkpoint::resolve(&out, "latest").unwrap();
        checkpoint_loads(&latest);
        // Nothing half-written carries a checkpoint-N name.
        for entry in std::fs::read_dir(&out).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name.starts_with("checkpoint-") {
                assert!(
                    out.join(&name).join(checkpoint::STATE_FILE).exists(),
                    "{name} is incomplete"
                );
            }
        }
    }
}

#[test]
fn sigterm_saves_a_checkpoint_and_exits_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let child = start(&out, &["--max_steps", "100000", "--save_steps", "1000000"]);
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    unsafe { libc_kill(child.id() as i32, 15) };
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "exit {:?}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let saved = checkpoint::list(&out);
    assert_eq!(saved.len(), 1, "one checkpoint, written on SIGTERM");
    checkpoint_loads(&saved[0].1);
    assert!(stdout.contains("preempted by SIGTERM"), "{stdout}");
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// `sft` spawning its own ranks (no launcher, no torchrun variables), stopped by SIGTERM as a
/// preemption script stops it: the ranks save, the program exits 130 (not 0: the run is not
/// finished) and prints the command that goes on, which resumes from that checkpoint.
#[test]
fn a_self_launched_run_stopped_by_sigterm_exits_130_with_the_command_to_go_on() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
        "--output_dir",
        "run",
        "--max_steps",
        "400",
        "--save_steps",
        "1000000",
        "--eval_dataset_name",
        "none",
        "--per_device_train_batch_size",
        "4",
    ];
    let child = Command::new(SFT)
        .args(args)
        .current_dir(tmp.path())
        .env("TRL_LOCAL_PROCESSES", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !tmp.path().join("run/metrics.jsonl").exists() {
        assert!(start.elapsed().as_secs() < 120, "the run never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: signalling our own child.
    unsafe { libc_kill(child.id() as i32, 15) };
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    let hint = stderr
        .lines()
        .find_map(|l| l.split_once("go on with: ").map(|(_, c)| c.to_string()))
        .unwrap_or_else(|| panic!("no command to go on with: {stderr}"));
    let saved = checkpoint::list(&tmp.path().join("run"));
    assert_eq!(saved.len(), 1, "{stderr}");
    let step = saved[0].0;
    assert!(
        hint.ends_with(&format!("--resume_from_checkpoint run/checkpoint-{step}")),
        "{hint}"
    );
    // The command as printed, in the same directory, goes on from there to the end.
    let again = Command::new("sh")
        .args(["-c", &hint])
        .current_dir(tmp.path())
        .env("TRL_LOCAL_PROCESSES", "2")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&again.stderr);
    assert!(again.status.success(), "{text}");
    assert!(text.contains(&format!("at step {step}")), "{text}");
    assert!(tmp.path().join("run/checkpoint-400").exists());
}
