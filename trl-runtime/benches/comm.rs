//! `cargo bench -p trl-runtime --bench comm`: all_reduce, all_gather and reduce_scatter on
//! 2 processes of the host backend for 1, 16, 64 and 256 MiB of f32, next to a plain memcpy of
//! the same size measured in the same run; and the uneven all-to-all (expert parallelism's
//! dispatch: a quarter of each rank's rows kept, three quarters sent) against gloo's
//! `all_to_all_single` with the same splits (benches/torch_comm.py; PYTHON names a Python
//! with torch, else python3; skipped with a message without one). One JSON object per line
//! on stdout; prose on stderr.
//!
//! Bus bandwidth follows NCCL-tests: algbw = bytes / time; busbw = algbw x 2(n-1)/n for
//! all_reduce and algbw x (n-1)/n for all_gather and reduce_scatter, where bytes is the full
//! buffer (the gathered output, the scattered input).

use candle_core::{DType, Device, Tensor};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use trl_runtime::comm::{Communicator, ReduceOp};
use trl_runtime::dist::DistContext;

const WORLD: usize = 2;
const SIZES_MIB: [usize; 4] = [1, 16, 64, 256];
const OPS: [&str; 4] = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_v"];
/// f32 per row of the uneven all-to-all (as torch_comm.py).
const ROW: usize = 256;

fn iterations(mib: usize) -> usize {
    match mib {
        0..=1 => 40,
        2..=16 => 10,
        17..=64 => 5,
        _ => 3,
    }
}

/// Rows rank `rank` sends to ranks 0 and 1: a quarter kept, the rest to the other.
fn splits(rank: usize, rows: usize) -> Vec<usize> {
    let keep = rows / 4;
    match rank {
        0 => vec![keep, rows - keep],
        _ => vec![rows - keep, keep],
    }
}

fn run_op(comm: &dyn Communicator, op: &str, x: &Tensor) -> Tensor {
    match op {
        "all_reduce" => comm.all_reduce(x, ReduceOp::Sum),
        "all_gather" => comm.all_gather(x, 0),
        "all_to_all_v" => comm
            .all_to_all_v(x, &splits(comm.rank(), x.dim(0).unwrap()))
            .map(|(y, _)| y),
        _ => comm.reduce_scatter(x, 0, ReduceOp::Sum),
    }
    .expect("collective failed")
}

/// Time of one memcpy of `bytes`, best of a few (what the memory system gives one core).
fn memcpy_seconds(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    // Touch every page first: the reference is the copy, not the kernel's page faults.
    dst.fill(2);
    let reps = iterations(bytes >> 20).max(3);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn worker() {
    let ctx = DistContext::from_env().expect("init");
    let comm = ctx.world();
    let n = comm.size();
    for mib in SIZES_MIB {
        let bytes = mib << 20;
        let elems = bytes / 4;
        for op in OPS {
            // Input sized so that `bytes` is the full buffer: the gathered output of all_gather.
            let input_elems = if op == "all_gather" { elems / n } else { elems };
            let x = match op {
                "all_to_all_v" => Tensor::ones((elems / ROW, ROW), DType::F32, &Device::Cpu),
                _ => Tensor::ones(input_elems, DType::F32, &Device::Cpu),
            }
            .unwrap();
            run_op(comm.as_ref(), op, &x); // warm-up: page faults, socket buffers
            let iters = iterations(mib);
            comm.barrier().unwrap();
            let t = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(run_op(comm.as_ref(), op, &x));
            }
            let local = t.elapsed().as_secs_f64() / iters as f64;
            // The slowest rank defines the collective's time.
            let secs = comm
                .all_reduce(&Tensor::new(&[local], &Device::Cpu).unwrap(), ReduceOp::Max)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()[0];
            if ctx.is_main_process() {
                let algbw = bytes as f64 / secs / 1e9;
                let factor = match op {
                    "all_reduce" => 2.0 * (n - 1) as f64 / n as f64,
                    // Three quarters of each rank's rows cross.
                    "all_to_all_v" => 0.75,
                    _ => (n - 1) as f64 / n as f64,
                };
                let memcpy_gbps = bytes as f64 / memcpy_seconds(bytes) / 1e9;
                let busbw = algbw * factor;
                println!(
                    "{{\"bench\":\"comm\",\"op\":\"{op}\",\"backend\":\"{}\",\"world\":{n},\"bytes\":{bytes},\"time_ms\":{:.3},\"algbw_gbps\":{algbw:.3},\"busbw_gbps\":{busbw:.3},\"memcpy_gbps\":{memcpy_gbps:.3},\"busbw_over_memcpy\":{:.3}}}",
                    comm.backend(),
                    secs * 1e3,
                    busbw / memcpy_gbps
                );
            }
            comm.barrier().unwrap();
        }
    }
}

/// gloo's milliseconds per size (bytes) of the uneven all-to-all, from torch_comm.py; empty
/// (with a message) without a Python with torch.
fn gloo_all_to_all_v() -> Vec<(u64, f64)> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/torch_comm.py");
    let port = trl_runtime::dist::spawn::free_port().expect("free port");
    let out = Command::new(&python)
        .arg(script)
        .arg(port.to_string())
        .args(SIZES_MIB.map(|m| m.to_string()))
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| {
                (
                    v["bytes"].as_u64().unwrap_or(0),
                    v["time_ms"].as_f64().unwrap_or(0.0),
                )
            })
            .collect(),
        _ => {
            eprintln!("comm bench: no gloo reference ({python} with torch; set PYTHON)");
            Vec::new()
        }
    }
}

/// `line` with gloo's time and ours over it, for the uneven all-to-all.
fn with_gloo(line: &str, gloo: &[(u64, f64)]) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(line) else {
        return line.to_string();
    };
    if v["op"] != "all_to_all_v" {
        return line.to_string();
    }
    if let Some((_, ms)) = gloo.iter().find(|(b, _)| Some(*b) == v["bytes"].as_u64()) {
        let ours = v["time_ms"].as_f64().unwrap_or(f64::NAN);
        v["gloo_time_ms"] = (*ms).into();
        v["speedup_vs_gloo"] = (ms / ours).into();
    }
    v.to_string()
}

fn main() {
    // cargo passes `--bench`; there is nothing to select, so arguments are ignored.
    if std::env::var("TRL_BENCH_WORKER").is_ok() {
        worker();
        return;
    }
    let exe = std::env::current_exe().expect("current exe");
    let port = trl_runtime::dist::spawn::free_port().expect("free port");
    eprintln!(
        "comm bench: host backend, {WORLD} processes on 127.0.0.1:{port}, sizes {SIZES_MIB:?} MiB"
    );
    let mut children: Vec<_> = (0..WORLD)
        .map(|rank| {
            Command::new(&exe)
                .env("TRL_BENCH_WORKER", "1")
                .envs(trl_runtime::dist::spawn::local_rank_env(
                    rank,
                    WORLD,
                    port,
                    &format!("bench-{port}"),
                ))
                .stdout(if rank == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    // Rank 0's JSON lines pass through; the uneven all-to-all's gain gloo's time.
    let gloo = gloo_all_to_all_v();
    if let Some(out) = children[0].stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{}", with_gloo(&line, &gloo));
        }
    }
    let mut ok = true;
    for (rank, c) in children.iter_mut().enumerate() {
        let status = c.wait().expect("wait");
        if !status.success() {
            eprintln!("rank {rank} failed: {status}");
            ok = false;
        }
    }
    std::thread::sleep(Duration::from_millis(10));
    if !ok {
        std::process::exit(1);
    }
}
