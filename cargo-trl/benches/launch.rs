//! `cargo bench -p cargo-trl --bench launch`: time from starting `cargo trl launch` of an
//! already built trivial program with 2 processes to both workers running (their first line of
//! output arrives), against starting the same 2 programs directly in the same run.
//! One JSON object per line on stdout; prose on stderr.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const RUNS: usize = 10;

fn exe_dir() -> PathBuf {
    // target/release/deps/launch-xxxx -> target/release
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Milliseconds until two "rank=" lines arrived from `cmd`'s output.
fn until_two_running(mut cmd: Command) -> f64 {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut seen = 0;
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        if line.contains("rank=") {
            seen += 1;
            if seen == 2 {
                break;
            }
        }
    }
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let _ = child.wait();
    ms
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let dir = exe_dir();
    let launcher = PathBuf::from(env!("CARGO_BIN_EXE_cargo-trl"));
    let worker = dir.join("examples/launch_worker");
    if !worker.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let built = Command::new(cargo)
            .args([
                "build",
                "--release",
                "-p",
                "cargo-trl",
                "--example",
                "launch_worker",
            ])
            .status()
            .is_ok_and(|s| s.success());
        assert!(built, "cannot build the launch_worker example");
    }
    for (what, path) in [("cargo-trl", &launcher), ("launch_worker", &worker)] {
        if !Path::new(path).exists() {
            eprintln!("{what} is not built at {}: run `cargo build --release -p cargo-trl --all-targets` first", path.display());
            std::process::exit(1);
        }
    }
    eprintln!("launch bench: {RUNS} runs of `cargo trl launch --profile multi_cpu launch_worker` vs 2 direct starts");
    let launched: Vec<f64> = (0..RUNS)
        .map(|_| {
            let mut c = Command::new(&launcher);
            c.args([
                "launch",
                "--profile",
                "multi_cpu",
                "--main_process_port",
                "0",
            ])
            .arg(&worker)
            .args(["--", "ok"]);
            until_two_running(c)
        })
        .collect();
    let direct: Vec<f64> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            let children: Vec<_> = (0..2)
                .map(|r| {
                    Command::new(&worker)
                        .env("RANK", r.to_string())
                        .stdout(Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            for mut c in children {
                let mut line = String::new();
                BufReader::new(c.stdout.take().unwrap())
                    .read_line(&mut line)
                    .unwrap();
                let _ = c.wait();
            }
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let (l, d) = (median(launched), median(direct));
    println!("{{\"bench\":\"launch\",\"world\":2,\"spawn_ms\":{l:.2},\"direct_spawn_ms\":{d:.2},\"overhead_ratio\":{:.2}}}", l / d);
}
