//! `tracing` output for training processes: every line carries the rank (`RUST_LOG` filters,
//! default info).

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

struct RankStamp(usize);

impl FormatTime for RankStamp {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        write!(w, "[rank {}]", self.0)
    }
}

/// Installs the subscriber (once per process; later calls are no-ops). Rank 0 logs at info,
/// the others at warn, unless RUST_LOG says otherwise. Returns the rank.
pub fn init(rank: usize) -> usize {
    use std::io::IsTerminal;
    let default = if rank == 0 { "info" } else { "warn" };
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_timer(RankStamp(rank))
        .with_target(false)
        .with_writer(std::io::stderr)
        .try_init();
    rank
}
