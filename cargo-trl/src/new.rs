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
    /// The trainer: `sft` (sft.yaml, the addition task) or `dpo` (dpo.yaml, preference pairs
    /// on the same questions).
    #[arg(long, default_value = "sft", value_parser = ["sft", "dpo"])]
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

/// The SFT trainer's config and data.
const SFT_FILES: &[(&str, &[u8])] = &[
    ("sft.yaml", include_bytes!("../../templates/sft/sft.yaml")),
    (
        "data/train.jsonl",
        include_bytes!("../../assets/tiny/data/train.jsonl"),
    ),
    (
        "data/eval.jsonl",
        include_bytes!("../../assets/tiny/data/eval.jsonl"),
    ),
];

/// The DPO trainer's config and preference pairs.
const DPO_FILES: &[(&str, &[u8])] = &[
    ("dpo.yaml", include_bytes!("../../templates/sft/dpo.yaml")),
    (
        "data/pref_train.jsonl",
        include_bytes!("../../assets/tiny/data/pref_train.jsonl"),
    ),
    (
        "data/pref_eval.jsonl",
        include_bytes!("../../assets/tiny/data/pref_eval.jsonl"),
    ),
];

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
    let dpo = trainer == "dpo";
    let config_file = format!("{trainer}.yaml");
    let ctx = minijinja::context! {
        name => name,
        trl_runtime => dependency,
        candle_core_patch => candle_core_patch,
        plain_candle,
        dpo,
        config_file
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
    ];
    let model_files = match plain_candle {
        true => PLAIN_CANDLE_FILES,
        false => QWEN2_FILES,
    };
    let trainer_files = match dpo {
        true => DPO_FILES,
        false => SFT_FILES,
    };
    files.extend(
        FILES
            .iter()
            .chain(trainer_files)
            .chain(model_files)
            .map(|(p, c)| (p.to_string(), c.to_vec())),
    );
    if peft {
        let yaml = files
            .iter_mut()
            .find(|(p, _)| *p == config_file)
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
    // With a local trl-runtime, start from its workspace's lock file: the same dependency
    // versions build offline and reuse artifacts already compiled for that workspace.
    if let Some(dir) = &runtime_dir {
        let lock = dir.join("../Cargo.lock");
        if lock.exists() {
            let _ = std::fs::copy(&lock, args.name.join("Cargo.lock"));
        }
    }
    Ok(format!(
        "created {} (trl-runtime = {dependency}: {why})\nnext: cd {} && cargo trl launch --profile multi_cpu",
        args.name.display(),
        args.name.display()
    ))
}
