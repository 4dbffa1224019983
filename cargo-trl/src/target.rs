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
        /// The package's GPU features (`cuda`, `nccl`), switched on for a launch on GPUs.
        gpu_features: Vec<String>,
        on_gpu: bool,
    },
}

impl Target {
    /// Builds with the package's GPU features when `on_gpu` (a launch on GPUs). A package
    /// without them still builds and trains on CPU (the worker warns).
    pub fn for_gpu(mut self, gpu: bool) -> Self {
        if let Target::Cargo { on_gpu, .. } = &mut self {
            *on_gpu = gpu;
        }
        self
    }

    /// The cargo command that builds it (none for a path).
    pub fn build_command(&self, release: bool) -> Option<Vec<String>> {
        match self {
            Target::Path(_) => None,
            Target::Cargo {
                package,
                name,
                example,
                gpu_features,
                on_gpu,
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
                if *on_gpu && !gpu_features.is_empty() {
                    c.push("--features".into());
                    c.push(gpu_features.join(","));
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
                    gpu_features: ["cuda", "nccl"]
                        .into_iter()
                        .filter(|f| pkg.features.contains_key(*f))
                        .map(String::from)
                        .collect(),
                    on_gpu: false,
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

/// Builds a cargo target and returns its executable: the path cargo's own build messages
/// give for it (`--message-format=json-render-diagnostics`: warnings and errors still print
/// as cargo prints them, on stderr).
pub fn build(target: &Target, release: bool) -> Result<PathBuf, String> {
    use cargo_metadata::Message;
    use std::io::BufReader;
    use std::process::Stdio;
    match target {
        Target::Path(p) => Ok(p.clone()),
        Target::Cargo { name, example, .. } => {
            let cmd = target.build_command(release).unwrap();
            let mut child = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .args(&cmd[1..])
                .arg("--message-format=json-render-diagnostics")
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            let mut executable = None;
            let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
            for message in Message::parse_stream(stdout) {
                let message = message.map_err(|e| format!("cannot read cargo's output: {e}"))?;
                if let Message::CompilerArtifact(artifact) = message {
                    let ours = artifact.target.name == *name
                        && match example {
                            true => artifact.target.is_example(),
                            false => artifact.target.is_bin(),
                        };
                    if let (true, Some(exe)) = (ours, artifact.executable) {
                        executable = Some(exe.into_std_path_buf());
                    }
                }
            }
            let status = child.wait().map_err(|e| format!("cannot run cargo: {e}"))?;
            if !status.success() {
                return Err(format!("`{}` failed ({status})", cmd.join(" ")));
            }
            executable
                .ok_or_else(|| format!("`{}` built no executable named {name}", cmd.join(" ")))
        }
    }
}

#[cfg(test)]
mod gpu_build_tests {
    use super::Target;

    /// A launch on GPUs builds with the package's GPU features; on CPU, and for a package
    /// without them, the command is unchanged.
    #[test]
    fn gpu_launches_build_with_the_gpu_features() {
        let target = |features: &[&str]| Target::Cargo {
            package: "my-sft".into(),
            name: "my-sft".into(),
            example: false,
            gpu_features: features.iter().map(|f| f.to_string()).collect(),
            on_gpu: false,
        };
        let cmd = |t: Target| t.build_command(true).unwrap().join(" ");
        assert_eq!(
            cmd(target(&["cuda", "nccl"]).for_gpu(true)),
            "cargo build -p my-sft --bin my-sft --release --features cuda,nccl"
        );
        assert_eq!(
            cmd(target(&["cuda", "nccl"]).for_gpu(false)),
            "cargo build -p my-sft --bin my-sft --release"
        );
        assert_eq!(
            cmd(target(&[]).for_gpu(true)),
            "cargo build -p my-sft --bin my-sft --release"
        );
    }
}
