//! `cargo trl merge ADAPTER --output_dir DIR`: a LoRA adapter (peft's format, e.g. a
//! `--use_peft` run's checkpoint) merged into its base as a plain transformers checkpoint,
//! as peft's `merge_and_unload()` + `save_pretrained()` write it.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct MergeArgs {
    /// The adapter directory (adapter_config.json + adapter_model.safetensors).
    pub adapter: PathBuf,
    /// Where the merged checkpoint goes (must not exist).
    #[arg(long = "output_dir", alias = "output-dir")]
    pub output_dir: PathBuf,
    /// The base model directory (default: the adapter config's base_model_name_or_path).
    #[arg(long = "model_name_or_path", alias = "model-name-or-path")]
    pub model_name_or_path: Option<PathBuf>,
    /// Largest weight file, as save_pretrained's max_shard_size: 5GB (10^9 bytes), 2GiB, 500MB.
    #[arg(
        long = "max_shard_size",
        alias = "max-shard-size",
        default_value = "5GB"
    )]
    pub max_shard_size: String,
}

/// Bytes of a size written as transformers writes them (`5GB`, `2GiB`, `500MB`, `1000`).
pub fn parse_size(flag: &str, s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{flag} '{s}': expected a size like 5GB or 2GiB"))?;
    let scale: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1048576.0,
        "GIB" => 1073741824.0,
        "TIB" => 1099511627776.0,
        other => {
            return Err(format!(
                "{flag} '{s}': unknown unit '{other}' (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    Ok((n * scale) as usize)
}

pub fn run(args: &MergeArgs) -> Result<String, String> {
    let limit = parse_size("--max_shard_size", &args.max_shard_size)?;
    let report = trl_runtime::models::merge::merge_adapter(
        &args.adapter,
        args.model_name_or_path.as_deref(),
        &args.output_dir,
        limit,
        // The base's parameters that take adapters directly, from its built-in model's
        // structure; a model type of the user's has none we know of (its weights merge as
        // linear layers' do).
        &|base| Ok(trl_runtime::parallel::CausalLm::parameter_sites_of(base).unwrap_or_default()),
    )
    .map_err(|e| e.to_string())?;
    Ok(format!(
        "merged {} into {}: {} weights took their adapter, {} were replaced by modules trained \
         whole, {} copied; {} weight file(s) in {}",
        args.adapter.display(),
        report.base.display(),
        report.merged,
        report.replaced,
        report.copied,
        report.files,
        args.output_dir.display()
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_as_transformers_reads_them() {
        assert_eq!(
            super::parse_size("--max_shard_size", "5GB"),
            Ok(5_000_000_000)
        );
        assert_eq!(super::parse_size("--max_shard_size", "2GiB"), Ok(2 << 30));
        assert_eq!(
            super::parse_size("--max_shard_size", "500MB"),
            Ok(500_000_000)
        );
        assert_eq!(super::parse_size("--max_shard_size", "1000"), Ok(1000));
        assert!(super::parse_size("--max_shard_size", "5 parsecs").is_err());
    }
}
