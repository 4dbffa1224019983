//! cargo-trl's modules form no cycle: no file reaches, through the `crate::NAME` paths it uses,
//! a file that reaches it back (the launch <-> plan pair was one; `machine.rs` cut it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each module of cargo-trl/src and the modules its code names as `crate::NAME`.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut names = BTreeSet::new();
    let mut code = BTreeMap::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let stem = p.file_stem().unwrap().to_string_lossy().to_string();
        if p.extension().is_some_and(|x| x == "rs") && stem != "main" {
            names.insert(stem.clone());
            code.insert(stem, std::fs::read_to_string(&p).unwrap());
        }
    }
    code.into_iter()
        .map(|(module, text)| {
            let mut uses = BTreeSet::new();
            for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let name: String = line[i + 7..]
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if names.contains(&name) && name != module {
                        uses.insert(name);
                    }
                }
            }
            (module, uses)
        })
        .collect()
}

/// A cycle through `at`, if one leads back to `start`.
fn cycle(
    g: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    at: &str,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    for next in &g[at] {
        if next == start {
            let mut c = path.clone();
            c.push(start.to_string());
            return Some(c);
        }
        if !path.contains(next) {
            path.push(next.clone());
            if let Some(c) = cycle(g, start, next, path) {
                return Some(c);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn no_module_reaches_itself() {
    let g = graph();
    assert!(g.contains_key("launch") && g["launch"].contains("machine"));
    let cycles: Vec<String> = g
        .keys()
        .filter_map(|m| cycle(&g, m, m, &mut vec![m.clone()]))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(
        cycles.is_empty(),
        "modules that reach themselves: {cycles:?}"
    );
}
