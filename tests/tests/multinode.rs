//! Two "machines" on one host: two network namespaces joined by a veth pair, each with its own
//! address, and one `cargo trl launch` in each (--num_machines 2 --machine_rank R
//! --main_process_ip of the first). The workers run real collectives across them over TCP.

use std::path::PathBuf;
use std::process::Command;
use trl_tests::text;

const WORKER: &str = env!("CARGO_BIN_EXE_comm_worker");

fn sh(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces with addresses 10.77.N.1 and 10.77.N.2; removed on drop.
struct Machines {
    a: String,
    b: String,
}

impl Machines {
    fn new() -> Self {
        let id = std::process::id() % 200 + 20;
        let (a, b) = (format!("trl{id}a"), format!("trl{id}b"));
        let (va, vb) = (format!("v{id}a"), format!("v{id}b"));
        let _ = Command::new("ip").args(["netns", "del", &a]).output();
        let _ = Command::new("ip").args(["netns", "del", &b]).output();
        sh(&["ip", "netns", "add", &a]);
        sh(&["ip", "netns", "add", &b]);
        sh(&[
            "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
        ]);
        sh(&["ip", "link", "set", &va, "netns", &a]);
        sh(&["ip", "link", "set", &vb, "netns", &b]);
        for (ns, dev, ip) in [
            (&a, &va, format!("10.77.{id}.1/24")),
            (&b, &vb, format!("10.77.{id}.2/24")),
        ] {
            sh(&["ip", "-n", ns, "addr", "add", &ip, "dev", dev]);
            sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        Machines { a, b }
    }

    fn master_ip(&self) -> String {
        format!("10.77.{}.1", std::process::id() % 200 + 20)
    }
}

impl Drop for Machines {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.a]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.b]).output();
    }
}

fn launcher() -> PathBuf {
    trl_tests::launcher(WORKER)
}

#[test]
#[ignore = "needs root and iproute2 (network namespaces): run with `cargo test -- --include-ignored` as root"]
fn two_machines_over_two_network_namespaces() {
    let m = Machines::new();
    let ip = m.master_ip();
    let launch = |ns: &str, machine_rank: &str| {
        Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(launcher())
            .args([
                "launch",
                "--profile",
                "multi_cpu",
                "--num_processes",
                "4",
                "--num_machines",
                "2",
            ])
            .args([
                "--machine_rank",
                machine_rank,
                "--main_process_ip",
                &ip,
                "--main_process_port",
                "29555",
            ])
            .args([WORKER, "--", "collectives"])
            .env("TRL_JOB_TOKEN", "shared-secret-of-this-job")
            .env("TRL_HOST_SHM", "0") // data over TCP, as between machines
            .env("TRL_COMM_TIMEOUT", "30")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = launch(&m.a, "0");
    let second = launch(&m.b, "1");
    let (a, b) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    assert!(a.status.success(), "machine 0:\n{}", text(&a));
    assert!(b.status.success(), "machine 1:\n{}", text(&b));
    // Global ranks 0-1 ran on the first machine, 2-3 on the second, and all checked their results.
    for r in [0, 1] {
        assert!(
            text(&a).contains(&format!("[rank {r}] collectives ok on rank {r}")),
            "{}",
            text(&a)
        );
    }
    for r in [2, 3] {
        assert!(
            text(&b).contains(&format!("[rank {r}] collectives ok on rank {r}")),
            "{}",
            text(&b)
        );
    }
}
