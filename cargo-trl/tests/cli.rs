//! The real binary: profiles list, profile display, config checks with their exit codes.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn lists_every_profile_both_ways_of_calling() {
    for args in [&["profiles"][..], &["trl", "profiles"]] {
        let (code, out, _) = run(args);
        assert_eq!(code, 0);
        for name in ["zero3", "fsdp2", "alst_ulysses_4gpu", "multi_cpu"] {
            assert!(out.contains(name), "{out}");
        }
        assert!(!out.contains("invalid"), "{out}");
        assert!(out.contains("dp_shard=2") && out.contains("sp=2"), "{out}");
    }
    let (code, out, _) = run(&["profiles", "--show", "multi_cpu"]);
    assert_eq!(code, 0);
    assert!(out.contains("distributed_type: MULTI_CPU"));
    let (code, _, err) = run(&["profiles", "--show", "zero4"]);
    assert_eq!(code, 1);
    assert!(err.contains("zero3"), "{err}");
}

#[test]
fn check_reports_bad_files_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "distributed_type: MULTI_CPU\nnum_processes: 2\nnum_procs: 3\n",
    )
    .unwrap();
    let (code, out, err) = run(&["check", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("MULTI_CPU") && err.contains("num_procs"),
        "{out}{err}"
    );
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "distributed_type: MULTI_CPU\nmixed_precision: fp64\n").unwrap();
    let (code, _, err) = run(&["check", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.yaml") && err.contains("mixed_precision") && err.contains("bf16"),
        "{err}"
    );
    let (code, _, _) = run(&["no-such-command"]);
    assert_eq!(code, 2);
}

#[test]
fn every_profile_file_is_embedded() {
    let (_, out, _) = run(&["profiles"]);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../templates/profiles");
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry
            .unwrap()
            .path()
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name} is not embedded in cargo-trl"
        );
    }
}

#[test]
fn env_and_profiles_show() {
    let (code, out, _) = run(&["env"]);
    assert_eq!(code, 0);
    for field in [
        "cargo-trl:",
        "cpu cores:",
        "gpus:",
        "libnccl.so.2:",
        "default launch config:",
    ] {
        assert!(out.contains(field), "{out}");
    }
    let (code, out, _) = run(&["profiles", "show", "fsdp2"]);
    assert_eq!(code, 0);
    assert!(out.contains("fsdp_version: 2"));
    let (code, _, err) = run(&["profiles", "show"]);
    assert_eq!(code, 2);
    assert!(err.contains("needs a profile name"), "{err}");
}
