//! The module layering of docs/architecture.md, checked from the sources: a top-level module
//! of trl-runtime uses (`crate::NAME`, outside comments) only modules of lower layers, so no
//! two modules import each other and the low layers (comm, nn) never reach the strategies
//! (parallel) or the trainer (train).

use std::collections::BTreeSet;
use std::path::Path;

/// Lowest first; a module may use those of the layers before its own.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["alloc", "precomputed", "progress"],
    &["config"],
    &["comm"],
    &["dist"],
    &["nn"],
    &["data"],
    &["context_parallel"],
    &["models"],
    &["optim"],
    &["tp"],
    &["parallel"],
    &["train"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// Every `crate::NAME` in `code` (comment lines skipped).
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
        for (i, _) in line.match_indices("crate::") {
            // `trl_runtime::crate::` does not occur; a preceding identifier char means
            // another path (`mycrate::`).
            let before = line[..i].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let name: String = line[i + 7..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            visit(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

#[test]
fn modules_use_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut wrong = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" {
            continue;
        }
        let Some(own) = layer_of(&top) else {
            wrong.push(format!(
                "{top}: not in LAYERS (add it to this test and docs/architecture.md)"
            ));
            continue;
        };
        let code = std::fs::read_to_string(&file).unwrap();
        for used in crate_paths(&code) {
            if used == top {
                continue;
            }
            match layer_of(&used) {
                Some(l) if l < own => {}
                // Crate-root re-exports (candle_core, Result) are not modules of ours.
                None if !src.join(&used).exists() && !src.join(format!("{used}.rs")).exists() => {}
                _ => wrong.push(format!("{} uses crate::{used}", rel.display())),
            }
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

#[test]
fn the_check_sees_a_use_upwards() {
    let code = "use crate::parallel::fsdp;\n// crate::train in a comment\nlet x = crate::nn::f();";
    let found = crate_paths(code);
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["nn".to_string(), "parallel".to_string()]
    );
}
