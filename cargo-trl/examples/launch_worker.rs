//! A worker for the launcher's end-to-end tests (no dependencies, builds in a moment):
//! `ok` prints its torchrun variables; `fail R CODE` makes rank R exit with CODE;
//! `kill R` makes rank R kill itself with SIGKILL; `kill-peer DIR` makes rank 1 do so while
//! rank 0 waits on a connection to it, then exits with 1; `flaky FILE` fails once (creating FILE)
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
        Some("kill-peer") => {
            // Rank 1 dies by SIGKILL holding a connection rank 0 reads: rank 0 sees it close
            // and exits with 1 a moment later, as a trainer whose peer died does.
            let port_file = std::path::Path::new(&args[1]).join("port");
            if rank == 1 {
                let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let port = listener.local_addr().unwrap().port();
                std::fs::write(&port_file, port.to_string()).unwrap();
                let _conn = listener.accept().unwrap();
                // SAFETY: signalling ourselves.
                unsafe { kill(std::process::id() as i32, 9) };
            } else {
                let port = loop {
                    match std::fs::read_to_string(&port_file).map(|p| p.parse::<u16>()) {
                        Ok(Ok(p)) => break p,
                        _ => std::thread::sleep(Duration::from_millis(1)),
                    }
                };
                let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                let _ = std::io::Read::read(&mut conn, &mut [0u8; 1]);
                eprintln!("rank {rank}: lost my peer, exiting with 1");
                std::process::exit(1);
            }
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
