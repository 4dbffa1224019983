//! `tracing` output for training processes: every line carries the rank (`RUST_LOG` filters,
//! default info).

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// The rank in front of every line.
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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .with_writer(std::io::stderr);
    // Under our launcher every line already shows `[rank N]` in front.
    let _ = if std::env::var(crate::dist::spawn::PREFIXED_VAR).is_ok() {
        builder.without_time().try_init()
    } else {
        builder.with_timer(RankStamp(rank)).try_init()
    };
    rank
}
