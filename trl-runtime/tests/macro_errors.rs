//! Every misuse of #[derive(Parallelize)] is a compile error with a span and a message saying
//! what to do; each case in tests/ui has its expected compiler output beside it
//! (`TRYBUILD=overwrite cargo test -p trl-runtime --test macro_errors` regenerates them).

/// The compiler release the expected outputs were written with. Other releases word and place
/// their notes differently, so there the comparison is skipped with a message (the project
/// builds from the workspace's `rust-version` on). Not pinned in a rust-toolchain.toml: where
/// rustup cannot download (CI, offline machines) a pinned release it lacks would stop every
/// cargo command, not only this test.
const SNAPSHOT_RUSTC: &str = "1.95";

#[test]
fn misuses_are_compile_errors() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(&rustc)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let release = version.split_whitespace().nth(1).unwrap_or("");
    if !release.starts_with(&format!("{SNAPSHOT_RUSTC}.")) && std::env::var_os("TRYBUILD").is_none()
    {
        eprintln!(
            "skipped: tests/ui/*.stderr were written by rustc {SNAPSHOT_RUSTC}, this is `{}`; \
             TRYBUILD=overwrite rewrites them for this compiler",
            version.trim()
        );
        return;
    }
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
