//! What `cargo trl launch TARGET` runs: a path to an executable, or a binary or example of
//! the current Cargo workspace (found with cargo_metadata, built with cargo, release by default).

use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Path(PathBuf),
    Cargo {
        package: String,
        name: String,
        example: bool,
    },
}

impl Target {
    /// The cargo command that builds it (none for a path).
    pub fn build_command(&self, release: bool) -> Option<Vec<String>> {
        match self {
            Target::Path(_) => None,
            Target::Cargo {
                package,
                name,
                example,
            } => {
                let mut c = vec!["cargo".into(), "build".into(), "-p".into(), package.clone()];
                c.push(if *example {
                    "--example".into()
                } else {
                    "--bin".into()
                });
                c.push(name.clone());
                if release {
                    c.push("--release".into());
                }
                Some(c)
            }
        }
    }
}

fn metadata() -> Result<cargo_metadata::Metadata, String> {
    cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .map_err(|e| format!("cannot read the Cargo workspace here ({e}): run inside a Cargo project or pass a path to an executable"))
}

/// Finds TARGET: an existing file path, or a bin/example name; with no name, the only binary
/// of the package in the current directory.
pub fn resolve(name: Option<&str>) -> Result<Target, String> {
    if let Some(n) = name {
        let p = Path::new(n);
        if p.is_file() || n.contains('/') {
            if !p.is_file() {
                return Err(format!("{n}: no such executable"));
            }
            return Ok(Target::Path(p.to_path_buf()));
        }
    }
    let meta = metadata()?;
    let mut found = Vec::new();
    let root = meta.root_package().map(|p| p.id.clone());
    for pkg in meta.workspace_packages() {
        for t in &pkg.targets {
            let is_bin = t.is_bin();
            let is_example = t.is_example();
            if !(is_bin || is_example) {
                continue;
            }
            let wanted = match name {
                Some(n) => t.name == n,
                None => is_bin && Some(&pkg.id) == root.as_ref(),
            };
            if wanted {
                found.push(Target::Cargo {
                    package: pkg.name.to_string(),
                    name: t.name.clone(),
                    example: is_example,
                });
            }
        }
    }
    match (found.len(), name) {
        (1, _) => Ok(found.remove(0)),
        (0, Some(n)) => Err(format!("no binary or example named '{n}' in this workspace, and no file by that name")),
        (0, None) => Err("no TARGET given and the package here has no binary: name one (a bin, an example, or a path)".into()),
        (_, Some(n)) => Err(format!("'{n}' names several targets ({found:?}): pass a path to the executable instead")),
        (_, None) => Err(format!("the package here has several binaries ({}): name one", found.iter().map(|t| match t { Target::Cargo { name, .. } => name.clone(), Target::Path(p) => p.display().to_string() }).collect::<Vec<_>>().join(", "))),
    }
}

/// Builds a cargo target and returns its executable.
pub fn build(target: &Target, release: bool) -> Result<PathBuf, String> {
    match target {
        Target::Path(p) => Ok(p.clone()),
        Target::Cargo { name, example, .. } => {
            let cmd = target.build_command(release).unwrap();
            let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .args(&cmd[1..])
                .status()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            if !status.success() {
                return Err(format!("`{}` failed ({status})", cmd.join(" ")));
            }
            let meta = metadata()?;
            let mut dir = meta.target_directory.into_std_path_buf().join(if release {
                "release"
            } else {
                "debug"
            });
            if *example {
                dir = dir.join("examples");
            }
            Ok(dir.join(name))
        }
    }
}
