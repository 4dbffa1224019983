//! The docs say what the code does: every `cargo trl` subcommand and flag that README.md and
//! docs/*.md show is one the CLI accepts (its `--help` lists it), and every repository path
//! they name (links and `code` spans) exists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn docs() -> Vec<(PathBuf, String)> {
    let mut files = vec![repo().join("README.md")];
    for e in std::fs::read_dir(repo().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect()
}

/// (subcommand, flags) of every `cargo trl SUB ...` the docs show; flags after a bare `--`
/// belong to the launched program, not to cargo trl.
fn invocations(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for line in text.lines() {
        for (i, _) in line.match_indices("cargo trl ") {
            let rest = &line[i + "cargo trl ".len()..];
            let rest = rest.split('`').next().unwrap_or("");
            let rest = rest.split(" # ").next().unwrap_or("");
            let mut words = rest.split_whitespace();
            let Some(sub) = words.next() else { continue };
            if !sub.chars().all(|c| c.is_ascii_lowercase()) {
                continue;
            }
            let flags = words
                .take_while(|w| *w != "--" && *w != "&&" && *w != "|")
                .filter(|w| w.starts_with("--") && w.len() > 2)
                .map(|w| {
                    let w = w.split('=').next().unwrap_or(w);
                    w.trim_end_matches([',', '.', ')', ';', ':']).to_string()
                })
                .collect();
            out.push((sub.to_string(), flags));
        }
    }
    out
}

fn help(sub: &str) -> Option<String> {
    let o = Command::new(BIN).args([sub, "--help"]).output().unwrap();
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).to_string())
}

#[test]
fn every_cargo_trl_command_in_the_docs_is_accepted() {
    let mut wrong = BTreeSet::new();
    let mut checked = 0;
    for (file, text) in docs() {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        for (sub, flags) in invocations(&text) {
            let Some(help) = help(&sub) else {
                wrong.insert(format!("{name}: `cargo trl {sub}` is not a subcommand"));
                continue;
            };
            for flag in flags {
                checked += 1;
                // clap lists `--flag` (and its aliases) in --help.
                let listed = help
                    .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '=')
                    .any(|w| w == flag);
                if !listed {
                    wrong.insert(format!("{name}: `cargo trl {sub}` has no flag {flag}"));
                }
            }
        }
    }
    assert!(checked > 10, "only {checked} flags found in the docs");
    assert!(
        wrong.is_empty(),
        "the docs show what the CLI refuses:\n{}",
        wrong.iter().cloned().collect::<Vec<_>>().join("\n")
    );
}

/// Repository paths in `text`: link targets that are not URLs or anchors, and `code` spans
/// that start with a top-level folder of this repository.
fn paths(text: &str) -> Vec<String> {
    let tops = [
        "trl-runtime/",
        "trl-macros/",
        "cargo-trl/",
        "examples/",
        "assets/",
        "docs/",
        "scripts/",
        "templates/",
        "tests/",
        ".ci/",
        "vendor/",
    ];
    let mut out = Vec::new();
    for (i, _) in text.match_indices("](") {
        let target = text[i + 2..].split(')').next().unwrap_or("");
        let target = target.split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
            out.push(target.to_string());
        }
    }
    for span in text.split('`').skip(1).step_by(2) {
        let span = span.trim();
        if tops.iter().any(|t| span.starts_with(t))
            && !span.contains(' ')
            && !span.contains('*')
            && !span.contains('{')
            && !span.contains('<')
        {
            out.push(span.trim_end_matches([',', '.', ':']).to_string());
        }
    }
    out
}

#[test]
fn every_path_the_docs_name_exists() {
    let mut wrong = Vec::new();
    for (file, text) in docs() {
        let dir = file.parent().unwrap().to_path_buf();
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        for p in paths(&text) {
            // Links are relative to the file; code spans to the repository.
            let exists = dir.join(&p).exists() || repo().join(&p).exists();
            // A path:line reference names its file.
            let file_part = p.split(':').next().unwrap_or(&p);
            if !exists && !repo().join(file_part).exists() && !dir.join(file_part).exists() {
                wrong.push(format!("{name}: {p}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the docs name paths that do not exist:\n{}",
        wrong.join("\n")
    );
}
