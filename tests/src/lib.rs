//! End-to-end tests live in `tests/`; the worker programs they launch live in `src/bin/`.
//! Helpers the test files share are here.

use std::path::PathBuf;
use std::process::Output;

/// The `cargo-trl` binary next to a worker binary (`cargo test --workspace` builds both).
pub fn launcher(worker: &str) -> PathBuf {
    let p = PathBuf::from(worker).parent().unwrap().join("cargo-trl");
    assert!(
        p.exists(),
        "{} is built by `cargo test --workspace`",
        p.display()
    );
    p
}

/// A finished process's stdout and stderr, for assertions and failure messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A port free now for a job's rendezvous, below the kernel's ephemeral range: a port taken
/// from that range (bind to port 0) can be handed to some outgoing connection as its source
/// port between this check and the job's own bind, which then fails with "address in use".
/// Calls never return the same port twice in one process (tests run in parallel threads), and
/// processes start their search at different places.
pub fn listen_port() -> u16 {
    static NEXT: std::sync::Mutex<Option<u16>> = std::sync::Mutex::new(None);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (20000u16, ephemeral_low.max(20001));
    let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
    let start = next.unwrap_or_else(|| {
        let span = u32::from(high - low);
        low + (std::process::id().wrapping_mul(7919) % span) as u16
    });
    let start = start.clamp(low, high - 1);
    let port = (start..high)
        .chain(low..start)
        .find(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("no free port below the ephemeral range");
    *next = Some(if port + 1 < high { port + 1 } else { low });
    port
}
