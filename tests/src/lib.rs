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
