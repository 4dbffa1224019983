//! `cargo trl new NAME`: a training crate from templates/ (embedded in the binary), with the
//! bundled tiny model and data so that `cargo trl launch --profile multi_cpu` trains offline.

use std::path::{Path, PathBuf};

#[derive(Debug, clap::Args)]
#[command(rename_all = "snake_case")]
pub struct NewArgs {
    /// Directory (and crate name) to create.
    pub name: PathBuf,
    /// Project template.
    #[arg(long, default_value = "sft", value_parser = ["sft"])]
    pub template: String,
    /// The model: `qwen2`, the built-in Llama / Qwen2 decoder; `plain-candle`, a Phi-style
    /// decoder written the plain Candle way in src/model.rs, yours to change, trained under
    /// every strategy.
    #[arg(long, default_value = "qwen2", value_parser = ["qwen2", "plain-candle"])]
    pub model: String,
    /// Depend on trl-runtime at this path (default: the workspace around the current
    /// directory, else the source this cargo-trl was built from).
    #[arg(long, conflicts_with = "published")]
    pub trl_runtime_path: Option<PathBuf>,
    /// Depend on the published trl-runtime release instead of a local path.
    #[arg(long)]
    pub published: bool,
    /// Train LoRA adapters on a frozen base: sft.yaml gets TRL's PEFT keys (use_peft,
    /// lora_r, lora_target_modules, ...).
    #[arg(long)]
    pub peft: bool,
    /// The trainer (a registered one: `sft`, sft.yaml on the addition task; `dpo`, dpo.yaml
    /// and preference pairs on the same questions).
    #[arg(long, default_value = "sft", value_parser = clap::builder::PossibleValuesParser::new(trl_runtime::train::registry::names()))]
    pub trainer: String,
}

/// The LoRA keys `--peft` adds to sft.yaml. The bundled base is randomly initialised: the
/// adapters take its full width and the embedding and head train whole, as README explains.
const PEFT_KEYS: &str = "
# LoRA (TRL's ModelConfig keys): adapters on a frozen base, saved in peft's format
# (adapter_config.json + adapter_model.safetensors). On a pretrained base, r 16 is usual.
use_peft: true
lora_target_modules: all-linear
lora_modules_to_save: [embed_tokens, lm_head]
lora_r: 64
lora_alpha: 64
lora_dropout: 0.0
";

const CARGO_TOML: &str = include_str!("../../templates/sft/Cargo.toml.jinja");
const README: &str = include_str!("../../templates/sft/README.md.jinja");
const MAIN: &str = include_str!("../../templates/sft/src/main.rs.jinja");
/// Files copied as they are: (path in the new crate, contents).
const FILES: &[(&str, &[u8])] = &[(".gitignore", b"/target\n/output\n")];

/// The repository's files a trainer's scaffold may name (`trl_runtime::train::registry`), by
/// their path in this repository: its config and bundled data.
const EMBEDDED: &[(&str, &[u8])] = &[
    (
        "templates/sft/sft.yaml",
        include_bytes!("../../templates/sft/sft.yaml"),
    ),
    (
        "templates/sft/dpo.yaml",
        include_bytes!("../../templates/sft/dpo.yaml"),
    ),
    (
        "templates/sft/grpo.yaml",
        include_bytes!("../../templates/sft/grpo.yaml"),
    ),
    (
        "templates/sft/kto.yaml",
        include_bytes!("../../templates/sft/kto.yaml"),
    ),
    (
        "templates/sft/rloo.yaml",
        include_bytes!("../../templates/sft/rloo.yaml"),
    ),
    (
        "templates/sft/reward.yaml",
        include_bytes!("../../templates/sft/reward.yaml"),
    ),
    (
        "templates/sft/distillation.yaml",
        include_bytes!("../../templates/sft/distillation.yaml"),
    ),
    (
        "assets/tiny/data/grpo_train.jsonl",
        include_bytes!("../../assets/tiny/data/grpo_train.jsonl"),
    ),
    (
        "assets/tiny/data/grpo_eval.jsonl",
        include_bytes!("../../assets/tiny/data/grpo_eval.jsonl"),
    ),
    (
        "assets/tiny/data/train.jsonl",
        include_bytes!("../../assets/tiny/data/train.jsonl"),
    ),
    (
        "assets/tiny/data/eval.jsonl",
        include_bytes!("../../assets/tiny/data/eval.jsonl"),
    ),
    (
        "assets/tiny/data/pref_train.jsonl",
        include_bytes!("../../assets/tiny/data/pref_train.jsonl"),
    ),
    (
        "assets/tiny/data/pref_eval.jsonl",
        include_bytes!("../../assets/tiny/data/pref_eval.jsonl"),
    ),
    (
        "assets/tiny/teacher/config.json",
        include_bytes!("../../assets/tiny/teacher/config.json"),
    ),
    (
        "assets/tiny/teacher/model.safetensors",
        include_bytes!("../../assets/tiny/teacher/model.safetensors"),
    ),
    (
        "assets/tiny/teacher/tokenizer.json",
        include_bytes!("../../assets/tiny/teacher/tokenizer.json"),
    ),
    (
        "assets/tiny/teacher/tokenizer_config.json",
        include_bytes!("../../assets/tiny/teacher/tokenizer_config.json"),
    ),
];

/// The embedded file at `path` (in this repository).
fn embedded(path: &str) -> Result<&'static [u8], String> {
    EMBEDDED
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, c)| *c)
        .ok_or_else(|| format!("this cargo-trl carries no {path}: add it to new.rs's EMBEDDED"))
}

/// The built-in model's checkpoint.
const QWEN2_FILES: &[(&str, &[u8])] = &[
    (
        "model/config.json",
        include_bytes!("../../assets/tiny/model/config.json"),
    ),
    (
        "model/model.safetensors",
        include_bytes!("../../assets/tiny/model/model.safetensors"),
    ),
    (
        "model/tokenizer.json",
        include_bytes!("../../assets/tiny/model/tokenizer.json"),
    ),
    (
        "model/tokenizer_config.json",
        include_bytes!("../../assets/tiny/model/tokenizer_config.json"),
    ),
];

/// `--model plain-candle`: the Phi example's code (the one trained under every profile in
/// cargo-trl's tests) and its checkpoint.
const PLAIN_CANDLE_FILES: &[(&str, &[u8])] = &[
    ("src/model.rs", include_bytes!("../../examples/src/phi.rs")),
    (
        "model/config.json",
        include_bytes!("../../assets/tiny-phi/model/config.json"),
    ),
    (
        "model/model.safetensors",
        include_bytes!("../../assets/tiny-phi/model/model.safetensors"),
    ),
    (
        "model/tokenizer.json",
        include_bytes!("../../assets/tiny-phi/model/tokenizer.json"),
    ),
    (
        "model/tokenizer_config.json",
        include_bytes!("../../assets/tiny-phi/model/tokenizer_config.json"),
    ),
];

/// The trl-runtime of the workspace around the current directory, if any.
fn local_runtime() -> Option<PathBuf> {
    let meta = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .ok()?;
    meta.workspace_packages()
        .into_iter()
        .find(|p| p.name.as_str() == "trl-runtime")
        .and_then(|p| {
            p.manifest_path
                .parent()
                .map(|d| d.as_std_path().to_path_buf())
        })
}

/// The trl-runtime beside the source this cargo-trl was built from (`cargo install --path
/// cargo-trl` keeps it there); absent for a cargo-trl installed from crates.io.
fn own_source_runtime() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../trl-runtime");
    dir.join("Cargo.toml").is_file().then_some(dir)
}

fn crate_name(path: &Path) -> Result<String, String> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("the crate needs a directory name")?;
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid {
        return Err(format!("'{name}' is not a valid crate name: use letters, digits, - and _, starting with a letter"));
    }
    Ok(name.to_string())
}

fn write_all(
    root: &Path,
    name: &str,
    dependency: &str,
    candle_core_patch: Option<&str>,
    (model, peft, trainer): (&str, bool, &str),
) -> Result<(), String> {
    let env = minijinja::Environment::new();
    let plain_candle = model == "plain-candle";
    let kind = trl_runtime::train::registry::find(trainer)
        .ok_or_else(|| format!("--trainer {trainer}: no such trainer"))?;
    let t = &kind.scaffold;
    let config_file = Path::new(t.config)
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .ok_or_else(|| format!("{}: not a file", t.config))?;
    let ctx = minijinja::context! {
        name => name,
        trl_runtime => dependency,
        candle_core_patch => candle_core_patch,
        plain_candle,
        config_file,
        summary => t.summary,
        config_type => t.config_type,
        cli_type => t.cli_type,
        task_type => t.task_type,
        model_wrapper => t.model_wrapper,
        example_flag => t.example_flag,
        data_note => t.data_note,
        formats => t.formats,
        metric => t.metric,
        items => t.items,
        setup => t.setup,
    };
    let render = |t: &str| {
        env.render_str(t, &ctx)
            .map_err(|e| format!("template error: {e}"))
    };
    let mut files: Vec<(String, Vec<u8>)> = vec![
        (
            "Cargo.toml".into(),
            (render(CARGO_TOML)? + "\n").into_bytes(),
        ),
        ("README.md".into(), (render(README)? + "\n").into_bytes()),
        ("src/main.rs".into(), (render(MAIN)? + "\n").into_bytes()),
        (config_file.clone(), embedded(t.config)?.to_vec()),
    ];
    for (dest, source) in t.data {
        files.push((dest.to_string(), embedded(source)?.to_vec()));
    }
    let model_files = match plain_candle {
        true => PLAIN_CANDLE_FILES,
        false => QWEN2_FILES,
    };
    files.extend(
        FILES
            .iter()
            .chain(model_files)
            .map(|(p, c)| (p.to_string(), c.to_vec())),
    );
    if peft {
        let yaml = files
            .iter_mut()
            .find(|(p, _)| **p == config_file)
            .expect("the trainer's config is a template file");
        yaml.1.extend_from_slice(PEFT_KEYS.as_bytes());
    }
    for (rel, contents) in files {
        let path = root.join(&rel);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        std::fs::write(&path, contents)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Creates the crate; refuses to touch an existing path.
pub fn run(args: &NewArgs) -> Result<String, String> {
    let name = crate_name(&args.name)?;
    if args.name.exists() {
        return Err(format!(
            "{} already exists: choose another name or remove it",
            args.name.display()
        ));
    }
    // Until trl-runtime is published, a project outside this repository depends on the
    // source the installed cargo-trl came from.
    let (runtime_dir, why) = if args.published {
        (None, "the published release (--published)")
    } else if let Some(p) = &args.trl_runtime_path {
        (Some(p.clone()), "--trl_runtime_path")
    } else if let Some(p) = local_runtime() {
        (Some(p), "the workspace around the current directory")
    } else if let Some(p) = own_source_runtime() {
        (
            Some(p),
            "the source this cargo-trl was built from, until trl-runtime is published; --trl_runtime_path or --published to choose",
        )
    } else {
        (None, "the published release")
    };
    let runtime_dir = match runtime_dir {
        Some(p) => Some(
            p.canonicalize()
                .map_err(|e| format!("--trl_runtime_path {}: {e}", p.display()))?,
        ),
        None => None,
    };
    let dependency = match &runtime_dir {
        Some(p) => format!("{{ path = {:?} }}", p.display().to_string()),
        None => format!("\"{}\"", env!("CARGO_PKG_VERSION")),
    };
    // A local trl-runtime builds with its workspace's patched candle-core (vendor/): the
    // project patches it the same way, or it would build with the unpatched release.
    let candle_core_patch = runtime_dir
        .as_ref()
        .map(|d| d.join("../vendor/candle-core"))
        .filter(|v| v.join("Cargo.toml").is_file())
        .and_then(|v| v.canonicalize().ok())
        .map(|v| format!("{{ path = {:?} }}", v.display().to_string()));
    if let Err(e) = write_all(
        &args.name,
        &name,
        &dependency,
        candle_core_patch.as_deref(),
        (&args.model, args.peft, &args.trainer),
    ) {
        let _ = std::fs::remove_dir_all(&args.name);
        return Err(e);
    }
    // With a local trl-runtime, start from its workspace's lock file and build in its target
    // directory: the same dependency versions build offline and what that workspace compiled
    // (Candle and the rest, 12-15 minutes on 2 cores) is reused.
    if let Some(dir) = &runtime_dir {
        let lock = dir.join("../Cargo.lock");
        if lock.exists() {
            let _ = std::fs::copy(&lock, args.name.join("Cargo.lock"));
        }
        if let Some(workspace) = dir.parent() {
            let config = format!(
                "# Builds in trl-runtime's workspace target directory, reusing what it compiled.\n\
                 [build]\ntarget-dir = {:?}\n",
                workspace.join("target").display().to_string()
            );
            let path = args.name.join(".cargo/config.toml");
            let written = std::fs::create_dir_all(args.name.join(".cargo"))
                .and_then(|_| std::fs::write(&path, config));
            if let Err(e) = written {
                let _ = std::fs::remove_dir_all(&args.name);
                return Err(format!("cannot write {}: {e}", path.display()));
            }
        }
    }
    Ok(format!(
        "created {} (trl-runtime = {dependency}: {why})\nnext: cd {} && cargo trl launch --profile multi_cpu",
        args.name.display(),
        args.name.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every registered trainer scaffolds: the files its entry names are carried.
    #[test]
    fn every_trainers_scaffold_is_carried() {
        for kind in trl_runtime::train::registry::all() {
            let t = &kind.scaffold;
            assert!(embedded(t.config).is_ok(), "{}: {}", kind.name, t.config);
            for (_, source) in t.data {
                assert!(embedded(source).is_ok(), "{}: {source}", kind.name);
            }
        }
    }
}
