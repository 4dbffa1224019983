//! The module layering of docs/architecture.md, checked from the sources: a top-level module
//! of trl-runtime uses (`crate::NAME`, outside comments) only modules of lower layers, so no
//! two modules import each other and the low layers (comm, nn) never reach the strategies
//! (parallel) or the trainer (train).

use std::collections::BTreeSet;
use std::path::Path;

/// Lowest first; a module may use those of the layers before its own.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["alloc", "hub", "precomputed", "progress"],
    &["config"],
    &["comm"],
    &["dist"],
    &["kernels"],
    &["nn"],
    &["data"],
    &["context_parallel"],
    &["generation"],
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

/// Every .rs file under trl-runtime's `src/{sub}`, and that directory.
fn sources(sub: &str) -> (std::path::PathBuf, Vec<std::path::PathBuf>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../src")
        .join(sub);
    let mut files = Vec::new();
    visit(&dir, &mut files);
    (dir, files)
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
    let (src, files) = sources("");
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
        // A file's unit tests (its `#[cfg(test)]` module, at the end) may check it against
        // higher layers (a kernel against the layer's plain Candle reference).
        let code = code.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        for used in crate_paths(code) {
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

/// The sibling files (modules of one folder) that `code`, a file of folder `dir`, uses:
/// `super::NAME`, `self::NAME` or `crate::<path of dir>::NAME` for a sibling NAME, or an item
/// the folder's mod.rs re-exports from NAME (`pub use NAME::...`).
fn sibling_uses(
    code: &str,
    module_path: &str,
    siblings: &BTreeSet<String>,
    reexports: &[(String, String)],
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let prefixes = [
        "super::".to_string(),
        "self::".to_string(),
        format!("crate::{module_path}::"),
    ];
    for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
        for prefix in &prefixes {
            for (i, _) in line.match_indices(prefix.as_str()) {
                let before = line[..i].chars().next_back();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                let rest = &line[i + prefix.len()..];
                // `super::{a, b::C}`: every name in the braces.
                let names: Vec<String> = match rest.strip_prefix('{') {
                    Some(inner) => inner
                        .split('}')
                        .next()
                        .unwrap_or("")
                        .split(',')
                        .map(|n| n.trim().split("::").next().unwrap_or("").to_string())
                        .collect(),
                    None => vec![rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect()],
                };
                for name in names {
                    if siblings.contains(&name) {
                        out.insert(name.clone());
                    }
                    for (item, from) in reexports {
                        if *item == name {
                            out.insert(from.clone());
                        }
                    }
                }
            }
        }
    }
    out
}

/// Items a mod.rs re-exports from its files: (item, file) for `pub use NAME::{A, B}` and
/// `pub use NAME::A`.
fn reexports(mod_rs: &str, siblings: &BTreeSet<String>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let text = mod_rs.replace('\n', " ");
    for stmt in text.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((from, items)) = rest.split_once("::") else {
            continue;
        };
        if !siblings.contains(from.trim()) {
            continue;
        }
        let items = items.trim().trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let item = item.trim().rsplit("::").next().unwrap_or("").trim();
            let item = item.split(" as ").last().unwrap_or(item).trim();
            if !item.is_empty() {
                out.push((item.to_string(), from.trim().to_string()));
            }
        }
    }
    out
}

/// Cycles among the files of every folder of trl-runtime/src: no two files of a module (nor a
/// longer ring of them) may use each other, so each file reads on top of the ones it uses.
#[test]
fn no_file_uses_a_sibling_that_uses_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../src");
    let mut dirs = vec![src.clone()];
    let mut cycles = Vec::new();
    while let Some(dir) = dirs.pop() {
        let mut siblings = BTreeSet::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let stem = p.file_stem().unwrap().to_string_lossy().to_string();
                if stem != "mod" && stem != "lib" {
                    siblings.insert(stem);
                }
            }
        }
        let module_path = dir
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('/', "::");
        let mod_rs = std::fs::read_to_string(dir.join("mod.rs")).unwrap_or_default();
        let reexported = reexports(&mod_rs, &siblings);
        let mut edges: std::collections::BTreeMap<String, BTreeSet<String>> = Default::default();
        for name in &siblings {
            let code = std::fs::read_to_string(dir.join(format!("{name}.rs"))).unwrap();
            // A file's unit tests (its `#[cfg(test)]` module, at the end) may use anything.
            let code = code.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
            let mut uses = sibling_uses(code, &module_path, &siblings, &reexported);
            uses.remove(name);
            edges.insert(name.clone(), uses);
        }
        // A file reaches itself through its uses: a cycle.
        for start in &siblings {
            let mut seen = BTreeSet::new();
            let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
            while let Some((at, path)) = stack.pop() {
                for next in &edges[&at] {
                    if next == start {
                        let mut ring = path.clone();
                        ring.push(start.clone());
                        cycles.push(format!(
                            "{}: {}",
                            dir.strip_prefix(&src).unwrap().display(),
                            ring.join(" -> ")
                        ));
                    } else if seen.insert(next.clone()) {
                        let mut p = path.clone();
                        p.push(next.clone());
                        stack.push((next.clone(), p));
                    }
                }
            }
        }
    }
    // Each ring is found once per member: keep the one starting at its smallest name.
    cycles.retain(|c| {
        let ring = c.split(": ").nth(1).unwrap();
        let names: Vec<&str> = ring.split(" -> ").collect();
        names[0] == *names.iter().min().unwrap()
    });
    assert!(
        cycles.is_empty(),
        "files that use each other:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_file_check_sees_siblings_through_every_path() {
    let siblings: BTreeSet<String> = ["flash", "mask", "linear", "sharded"]
        .into_iter()
        .map(String::from)
        .collect();
    let reexported = reexports(
        "pub mod mask;\npub use mask::{AttentionMask, document_ids as docs};\npub use linear::Linear;",
        &siblings,
    );
    assert_eq!(
        reexported,
        [
            ("AttentionMask".to_string(), "mask".to_string()),
            ("docs".to_string(), "mask".to_string()),
            ("Linear".to_string(), "linear".to_string()),
        ]
    );
    let code = "use super::{flash, other::X};\n\
                // super::sharded in a comment\n\
                let y = crate::nn::linear::f();\n\
                let m: super::AttentionMask = todo!();";
    let found = sibling_uses(code, "nn", &siblings, &reexported);
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["flash", "linear", "mask"]
    );
}

/// The functions of `code` (by brace matching from each `fn` with a body) with their length
/// in lines.
fn function_lengths(code: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        // `fn`, after any visibility and qualifiers (`pub(crate) const unsafe fn`).
        let qualifier = |w: &str| w.starts_with("pub") || ["const", "unsafe", "async"].contains(&w);
        let is_fn = t.split_whitespace().find(|w| !qualifier(w)) == Some("fn");
        if !is_fn || t.ends_with(';') {
            i += 1;
            continue;
        }
        let name = t
            .split("fn ")
            .nth(1)
            .unwrap_or("")
            .split(['(', '<'])
            .next()
            .unwrap_or("");
        let (mut depth, mut opened, mut j) = (0i32, false, i);
        while j < lines.len() {
            for c in lines[j].chars() {
                match c {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth == 0 {
                break;
            }
            j += 1;
        }
        out.push((name.to_string(), j - i + 1));
        i = j + 1;
    }
    out
}

/// The trainers keep data, schedule and loop: no function of train/ runs over 120 lines
/// (a long one is where strategy decisions crept back in before).
#[test]
fn no_function_in_train_is_over_120_lines() {
    let (_, files) = sources("train");
    let mut long = Vec::new();
    for file in files {
        let code = std::fs::read_to_string(&file).unwrap();
        for (name, n) in function_lengths(&code) {
            if n > 120 {
                long.push(format!("{}: {name} ({n} lines)", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "split these: {long:?}");
    // The counter sees a long function.
    let body = "    let x = 1;\n".repeat(130);
    let long_fn = format!("fn f() {{\n{body}}}\nfn g() {{}}\n");
    assert_eq!(
        function_lengths(&long_fn),
        [("f".to_string(), 132), ("g".to_string(), 1)]
    );
}
