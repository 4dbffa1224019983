//! A worker for the launcher's end-to-end tests (no dependencies, builds in a moment):
//! `ok` prints its torchrun variables; `fail R CODE` makes rank R exit with CODE;
//! `kill R` makes rank R kill itself with SIGKILL; `flaky FILE` fails once (creating FILE)
//! and succeeds on the next attempt; `wait` runs until SIGTERM and reports it.

use std::time::Duration;

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

extern "C" fn on_term(_: i32) {
    println!("got SIGTERM, saving and exiting");
    std::process::exit(0);
}

extern "C" {
    fn signal(sig: i32, handler: extern "C" fn(i32)) -> usize;
    fn kill(pid: i32, sig: i32) -> i32;
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rank: usize = var("RANK").parse().unwrap_or(0);
    println!(
        "rank={} local_rank={} world={} local_world={} group_rank={} master={}:{} threads={} token_set={}",
        var("RANK"), var("LOCAL_RANK"), var("WORLD_SIZE"), var("LOCAL_WORLD_SIZE"), var("GROUP_RANK"),
        var("MASTER_ADDR"), var("MASTER_PORT"), var("OMP_NUM_THREADS"), !var("TRL_JOB_TOKEN").is_empty()
    );
    match args.first().map(String::as_str) {
        Some("fail") => {
            let (who, code): (usize, i32) = (args[1].parse().unwrap(), args[2].parse().unwrap());
            if rank == who {
                eprintln!("rank {rank}: something went wrong, exiting with {code}");
                std::process::exit(code);
            }
            std::thread::sleep(Duration::from_secs(30));
        }
        Some("kill") => {
            let who: usize = args[1].parse().unwrap();
            if rank == who {
                eprintln!("rank {rank}: about to be killed");
                // SAFETY: signalling ourselves.
                unsafe { kill(std::process::id() as i32, 9) };
            }
            std::thread::sleep(Duration::from_secs(30));
        }
        Some("flaky") => {
            let marker = std::path::Path::new(&args[1]).join(format!("failed-once-{rank}"));
            if rank == 1 && !marker.exists() {
                std::fs::write(&marker, b"1").unwrap();
                eprintln!("rank 1: failing on the first attempt");
                std::process::exit(3);
            }
            println!(
                "rank {rank}: attempt {} succeeded",
                var("TORCHELASTIC_RESTART_COUNT")
            );
        }
        Some("wait") => {
            // SAFETY: installing a handler that only prints and exits.
            unsafe { signal(15, on_term) };
            println!("waiting");
            std::thread::sleep(Duration::from_secs(60));
        }
        _ => {}
    }
}
