//! Finding the Python the tests against the Python peers (transformers, peft, TRL) run; shared
//! by trl-runtime's and cargo-trl's tests (cargo-trl's include this file by path).

/// A Python with `packages` importable (TRL_PYTHON, else python3), for the tests against the
/// Python peers; None (the test skips) with a message saying how to get one.
#[allow(dead_code)]
pub fn python_with(packages: &[&str]) -> Option<std::path::PathBuf> {
    let python = std::env::var_os("TRL_PYTHON").map_or("python3".into(), std::path::PathBuf::from);
    let ok = std::process::Command::new(&python)
        .args(["-c", &format!("import {}", packages.join(", "))])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "skipped: no Python with {} ({}; set TRL_PYTHON to one: \
             `python3 -m venv v && v/bin/pip install {}`)",
            packages.join(", "),
            python.display(),
            packages.join(" ")
        );
    }
    ok.then_some(python)
}

/// The standard output of `cmd` (a peer's script), which must succeed: else the test fails
/// with its standard error.
#[allow(dead_code)]
pub fn stdout_of(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().expect("the command starts");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
