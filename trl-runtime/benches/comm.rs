//! `cargo bench -p trl-runtime --bench comm`: all_reduce, all_gather and reduce_scatter on
//! 2 processes of the host backend for 1, 16, 64 and 256 MiB of f32, next to a plain memcpy of
//! the same size measured in the same run. One JSON object per line on stdout; prose on stderr.
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
const OPS: [&str; 3] = ["all_reduce", "all_gather", "reduce_scatter"];

fn iterations(mib: usize) -> usize {
    match mib {
        0..=1 => 40,
        2..=16 => 10,
        17..=64 => 5,
        _ => 3,
    }
}

fn run_op(comm: &dyn Communicator, op: &str, x: &Tensor) -> Tensor {
    match op {
        "all_reduce" => comm.all_reduce(x, ReduceOp::Sum),
        "all_gather" => comm.all_gather(x, 0),
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
            let x = Tensor::ones(input_elems, DType::F32, &Device::Cpu).unwrap();
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
                let factor = if op == "all_reduce" {
                    2.0 * (n - 1) as f64 / n as f64
                } else {
                    (n - 1) as f64 / n as f64
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
    // Rank 0's JSON lines pass through unchanged.
    if let Some(out) = children[0].stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{line}");
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
