//! The workspace's manifests keep what the build relies on: every file in trl-runtime/tests is
//! a test target of one of the two packages that share that folder (trl-runtime's tests/ is
//! not discovered, so a file named by neither would never build nor run), and every member but
//! trl-runtime is named in the dev profile at opt-level 0 (the profile itself is optimised for
//! the dependencies; an unnamed member would compile slowly and without line tables).

use std::collections::BTreeSet;
use std::path::Path;

fn manifest(path: &Path) -> toml::Table {
    let text = std::fs::read_to_string(path).unwrap();
    text.parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The files the [[test]] entries of `manifest` name, relative to trl-runtime/tests (their
/// paths with `from_tests` taken off; a name alone stands for tests/NAME.rs).
fn test_files(manifest: &toml::Table, from_tests: &str) -> BTreeSet<String> {
    let tests = manifest.get("test").and_then(|t| t.as_array());
    tests
        .into_iter()
        .flatten()
        .map(|t| {
            let name = t["name"].as_str().unwrap();
            match t.get("path").and_then(|p| p.as_str()) {
                Some(p) => p.strip_prefix(from_tests).unwrap_or(p).to_string(),
                None => format!("{name}.rs"),
            }
        })
        .collect()
}

#[test]
fn every_test_file_is_a_target_and_every_member_is_unoptimised() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let runtime = manifest(&here.join("../Cargo.toml"));
    assert_eq!(
        runtime["package"]["autotests"].as_bool(),
        Some(false),
        "trl-runtime/Cargo.toml"
    );
    let ours = manifest(&here.join("Cargo.toml"));
    let mut targets = test_files(&ours, "");
    let theirs = test_files(&runtime, "tests/");
    assert!(
        targets.is_disjoint(&theirs),
        "both packages build {:?}",
        targets.intersection(&theirs).collect::<Vec<_>>()
    );
    targets.extend(theirs);
    let files: BTreeSet<String> = std::fs::read_dir(here)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".rs"))
        .collect();
    assert_eq!(
        files, targets,
        "each .rs file in trl-runtime/tests needs a [[test]] entry in trl-runtime/tests/Cargo.toml"
    );

    let root = manifest(&here.join("../../Cargo.toml"));
    let profile = &root["profile"]["dev"];
    assert_eq!(profile["build-override"]["opt-level"].as_integer(), Some(0));
    let packages = profile["package"].as_table().unwrap();
    for member in root["workspace"]["members"].as_array().unwrap() {
        let dir = here.join("../..").join(member.as_str().unwrap());
        let name = manifest(&dir.join("Cargo.toml"))["package"]["name"]
            .as_str()
            .unwrap()
            .to_string();
        let own = packages
            .get(&name)
            .unwrap_or_else(|| panic!("Cargo.toml: no [profile.dev.package.{name}]"));
        assert_eq!(
            own.get("debug").and_then(|d| d.as_str()),
            Some("line-tables-only"),
            "[profile.dev.package.{name}]"
        );
        let opt = own.get("opt-level").and_then(|o| o.as_integer());
        let want = if name == "trl-runtime" { None } else { Some(0) };
        assert_eq!(opt, want, "[profile.dev.package.{name}] opt-level");
    }
}
