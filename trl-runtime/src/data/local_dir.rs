//! A local dataset directory read as `datasets.load_dataset(DIR)` reads it (what TRL's
//! scripts do with `--dataset_name DIR`): its data files are sorted into splits by
//! `datasets`' default patterns, tried in its order, the first that finds files winning:
//! 1. `data/{split}-NNNNN-of-NNNNN.*` (how the Hub and `push_to_hub` shard a split),
//! 2. a directory named by a split keyword (`train/`, `test-2024/`, `data/validation/`),
//! 3. a file name holding a split keyword between separators (`train.jsonl`,
//!    `my_test_0.parquet`),
//! 4. otherwise every file is the `train` split.
//!
//! The keywords are `datasets`' own: train, training / validation, valid, dev, val / test,
//! testing, eval, evaluation; separators are `-._ ` and digits. Hidden files and folders,
//! README.md and `datasets`' metadata files are skipped.
//!
//! A dataset card (README.md) whose YAML header declares `configs:` (as the Hub's datasets
//! do) is read first, as `datasets` reads it: the chosen configuration (TRL's
//! dataset_config; unset, the only one, the one named `default` or marked `default: true`)
//! gives its splits' `data_files` patterns, or a `data_dir` the rules above apply in.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The extensions the loaders read.
const READABLE: &[&str] = &["jsonl", "json", "parquet"];

/// `datasets`' FILES_TO_IGNORE.
const IGNORED: &[&str] = &[
    "README.md",
    "config.json",
    "dataset_info.json",
    "dataset_infos.json",
    "dummy_data.zip",
    "dataset_dict.json",
];

const KEYWORDS: &[(&str, &[&str])] = &[
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

fn is_separator(c: char) -> bool {
    matches!(c, '-' | '.' | '_' | ' ') || c.is_ascii_digit()
}

/// `name` is `keyword` followed by a separator (the `{keyword}[{sep}]*` pattern).
fn starts_with_keyword(name: &str, keyword: &str) -> bool {
    name.strip_prefix(keyword)
        .is_some_and(|rest| rest.chars().next().is_some_and(is_separator))
}

/// A file name holding `keyword` at its start or after a separator, followed by a separator.
fn names_keyword(file_name: &str, keyword: &str) -> bool {
    starts_with_keyword(file_name, keyword)
        || file_name
            .char_indices()
            .filter(|(_, c)| is_separator(*c))
            .any(|(i, c)| starts_with_keyword(&file_name[i + c.len_utf8()..], keyword))
}

/// A folder name ending in a separator and `keyword` (the `*[{sep}]{keyword}/` pattern).
fn ends_with_keyword(name: &str, keyword: &str) -> bool {
    name.strip_suffix(keyword)
        .and_then(|head| head.chars().last())
        .is_some_and(is_separator)
}

/// The split of a Hub shard name `{split}-00000-of-00001.ext` directly under `data/`.
fn sharded_split(relative: &Path) -> Option<String> {
    let mut parts = relative.iter().map(|p| p.to_str().unwrap_or(""));
    let (folder, name, rest) = (parts.next()?, parts.next()?, parts.next());
    if folder != "data" || rest.is_some() {
        return None;
    }
    let (split, tail) = name.split_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    let (a, tail) = tail.split_at_checked(5)?;
    let tail = tail.strip_prefix("-of-")?;
    let (b, tail) = tail.split_at_checked(5)?;
    (digits(a) && digits(b) && tail.contains('.') && !split.is_empty()).then(|| split.to_string())
}

/// Every data file under `dir` (relative paths, sorted), hidden and metadata files left out.
fn data_files(dir: &Path) -> Result<Vec<PathBuf>> {
    fn walk(root: &Path, at: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let entries = std::fs::read_dir(at)
            .map_err(|e| Error::io(format!("cannot list dataset directory {}", at.display()), e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(format!("cannot list {}", at.display()), e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name.starts_with("__") || IGNORED.contains(&name.as_str()) {
                continue;
            }
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, out)?;
            } else {
                out.push(path.strip_prefix(root).expect("under root").to_path_buf());
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

/// The files of every split, by the first of `datasets`' rules that finds any.
fn splits(files: &[PathBuf]) -> BTreeMap<String, Vec<PathBuf>> {
    let mut by_split: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for f in files {
        if let Some(split) = sharded_split(f) {
            by_split.entry(split).or_default().push(f.clone());
        }
    }
    if !by_split.is_empty() {
        return by_split;
    }
    let folders = |f: &PathBuf| -> Vec<String> {
        f.parent()
            .into_iter()
            .flat_map(|p| p.iter())
            .map(|c| c.to_string_lossy().into_owned())
            .collect()
    };
    type Rule<'a> = &'a dyn Fn(&PathBuf, &str) -> bool;
    let in_folder: Rule = &|f, k| {
        folders(f)
            .iter()
            .any(|d| d == k || starts_with_keyword(d, k) || ends_with_keyword(d, k))
    };
    let in_name: Rule = &|f, k| {
        f.file_name()
            .is_some_and(|n| names_keyword(&n.to_string_lossy(), k))
    };
    for rule in [in_folder, in_name] {
        for (split, keywords) in KEYWORDS {
            let matched: Vec<PathBuf> = files
                .iter()
                .filter(|f| keywords.iter().any(|k| rule(f, k)))
                .cloned()
                .collect();
            if !matched.is_empty() {
                by_split.insert(split.to_string(), matched);
            }
        }
        if !by_split.is_empty() {
            return by_split;
        }
    }
    if !files.is_empty() {
        by_split.insert("train".into(), files.to_vec());
    }
    by_split
}

/// Which split of a dataset directory to read, and the setting that names it (for errors);
/// with `config`, of that configuration among those its dataset card declares (TRL's
/// dataset_config, `load_dataset(DIR, name)`). A dataset file is read whole, whatever the
/// split.
#[derive(Debug, Clone, Copy)]
pub struct Split<'a> {
    pub name: &'a str,
    pub key: &'a str,
    pub config: Option<&'a str>,
    /// The setting that names the configuration.
    pub config_key: &'a str,
}

impl Split<'static> {
    /// `datasets`' training split, as TRL's dataset_train_split defaults to it.
    pub const TRAIN: Split<'static> = Split {
        name: "train",
        key: "dataset_train_split",
        config: None,
        config_key: "dataset_config",
    };
}

/// A `configs:` entry of a dataset card, as `datasets`' MetadataConfigs reads it.
#[derive(Debug, serde::Deserialize)]
struct CardConfig {
    config_name: String,
    /// Patterns by split: a pattern or a list (the train split), or `{split, path}` entries.
    #[serde(default)]
    data_files: Option<serde_yaml::Value>,
    #[serde(default)]
    data_dir: Option<String>,
    #[serde(default)]
    default: bool,
}

/// The `configs:` of `dir`'s dataset card (README.md's YAML header), none without one.
fn card_configs(dir: &Path) -> Result<Vec<CardConfig>> {
    #[derive(serde::Deserialize)]
    struct Card {
        #[serde(default)]
        configs: Vec<CardConfig>,
    }
    let card = dir.join("README.md");
    let Ok(text) = std::fs::read_to_string(&card) else {
        return Ok(Vec::new());
    };
    let header = text
        .strip_prefix("---")
        .and_then(|rest| rest.split_once("\n---"))
        .map(|(yaml, _)| yaml);
    let Some(yaml) = header else {
        return Ok(Vec::new());
    };
    match serde_yaml::from_str::<Card>(yaml) {
        Ok(parsed) => Ok(parsed.configs),
        // A header that declares no configs cannot change which files are read.
        Err(_) if !yaml.contains("\nconfigs:") => Ok(Vec::new()),
        Err(e) => Err(Error::Config {
            file: card.display().to_string(),
            key: "configs".into(),
            message: format!("the dataset card's configs do not read as datasets reads them: {e}"),
        }),
    }
}

/// The configuration `name` of `configs`, or without a name the default one as `datasets`
/// picks it: the only one, the one named `default`, or the one marked `default: true`.
fn chosen_config<'c>(
    configs: &'c [CardConfig],
    name: Option<&str>,
) -> std::result::Result<&'c CardConfig, String> {
    let names: Vec<&str> = configs.iter().map(|c| c.config_name.as_str()).collect();
    if let Some(name) = name {
        return configs
            .iter()
            .find(|c| c.config_name == name)
            .ok_or_else(|| {
                format!("no configuration '{name}' in the dataset card: it declares {names:?}")
            });
    }
    let defaults: Vec<&CardConfig> = configs
        .iter()
        .filter(|c| configs.len() == 1 || c.config_name == "default" || c.default)
        .collect();
    match defaults[..] {
        [one] => Ok(one),
        [] => Err(format!("the dataset card declares configurations {names:?} and none is the default: pick one with dataset_config")),
        _ => Err(format!("the dataset card marks several configurations default: {names:?}")),
    }
}

/// The patterns of every split a configuration's `data_files` names (relative to the dataset
/// directory): a pattern or a list of them is the train split.
fn card_patterns(
    files: &serde_yaml::Value,
) -> std::result::Result<BTreeMap<String, Vec<String>>, String> {
    let patterns = |v: &serde_yaml::Value| -> Option<Vec<String>> {
        match v {
            serde_yaml::Value::String(p) => Some(vec![p.clone()]),
            serde_yaml::Value::Sequence(ps) => {
                ps.iter().map(|p| p.as_str().map(String::from)).collect()
            }
            _ => None,
        }
    };
    let bad = || {
        format!(
            "data_files {files:?}: expected a pattern, a list of them, or {{split, path}} entries"
        )
    };
    if let Some(train) = patterns(files) {
        return Ok(BTreeMap::from([("train".to_string(), train)]));
    }
    let mut by_split = BTreeMap::new();
    for entry in files.as_sequence().ok_or_else(bad)? {
        let split = entry
            .get("split")
            .and_then(|s| s.as_str())
            .unwrap_or("train");
        let paths = entry.get("path").and_then(patterns).ok_or_else(bad)?;
        by_split.insert(split.to_string(), paths);
    }
    Ok(by_split)
}

/// The files of `split` in the dataset directory `dir` (of its configuration `split.config`
/// when its card declares several); `split.key` is the setting that chose the split (named
/// in errors).
pub fn split_files(dir: &Path, split: Split) -> Result<Vec<PathBuf>> {
    let key = split.key;
    let err = |message: String| Error::Config {
        file: dir.display().to_string(),
        key: key.into(),
        message,
    };
    let configs = card_configs(dir)?;
    if configs.is_empty() {
        if let Some(name) = split.config.filter(|n| *n != "default") {
            return Err(Error::Config {
                file: dir.display().to_string(),
                key: split.config_key.into(),
                message: format!("'{name}': the directory's dataset card declares no configurations (only `default`): drop it"),
            });
        }
        return rule_split_files(dir, split.name, key);
    }
    let config = chosen_config(&configs, split.config).map_err(|message| Error::Config {
        file: dir.join("README.md").display().to_string(),
        key: split.config_key.into(),
        message,
    })?;
    let base = match &config.data_dir {
        Some(d) => dir.join(d),
        None => dir.to_path_buf(),
    };
    let Some(files) = &config.data_files else {
        return rule_split_files(&base, split.name, key);
    };
    let by_split = card_patterns(files).map_err(&err)?;
    let Some(patterns) = by_split.get(split.name) else {
        let found: Vec<&String> = by_split.keys().collect();
        return Err(err(format!(
            "no split '{}' in configuration '{}': it has {found:?}",
            split.name, config.config_name
        )));
    };
    let mut out = Vec::new();
    for pattern in patterns {
        out.extend(expand(&base.join(pattern)).map_err(&err)?);
    }
    Ok(out)
}

/// The files of `split` in `dir` by `datasets`' default rules.
fn rule_split_files(dir: &Path, split: &str, key: &str) -> Result<Vec<PathBuf>> {
    let err = |message: String| Error::Config {
        file: dir.display().to_string(),
        key: key.into(),
        message,
    };
    if dir.join("dataset_dict.json").exists() || dir.join("state.json").exists() {
        return Err(err(
            "a directory written by `save_to_disk` (Arrow files, which `load_dataset` does not \
             read either): write the split as a file, e.g. \
             `load_from_disk(DIR)['train'].to_parquet('train.parquet')`"
                .into(),
        ));
    }
    let files = data_files(dir)?;
    let all = splits(&files);
    let Some(chosen) = all.get(split) else {
        let found: Vec<&str> = all.keys().map(String::as_str).collect();
        return Err(err(if found.is_empty() {
            "no data files in the directory (.jsonl, .json or .parquet)".into()
        } else {
            format!("no split '{split}' in the directory: it has {found:?}")
        }));
    };
    let unreadable: Vec<String> = chosen
        .iter()
        .filter(|f| {
            !f.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| READABLE.contains(&e))
        })
        .map(|f| f.display().to_string())
        .collect();
    if !unreadable.is_empty() {
        return Err(err(format!(
            "split '{split}' has files in a format not read here: {unreadable:?} (use .jsonl, \
             .json or .parquet)"
        )));
    }
    Ok(chosen.iter().map(|f| dir.join(f)).collect())
}

/// The files a `data_files` entry names: itself, or what its `*` pattern matches (sorted).
pub(super) fn expand(path: &Path) -> std::result::Result<Vec<PathBuf>, String> {
    let text = path.to_string_lossy();
    if !text.contains(['*', '?', '[']) {
        return match path.exists() {
            true => Ok(vec![path.to_path_buf()]),
            false => Err(format!("{} is not here", path.display())),
        };
    }
    let mut found: Vec<PathBuf> = glob::glob(&text)
        .map_err(|e| format!("'{text}': {e}"))?
        .filter_map(|p| p.ok())
        .collect();
    found.sort();
    match found.is_empty() {
        true => Err(format!("'{text}' matches no file")),
        false => Ok(found),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_of(paths: &[&str]) -> BTreeMap<String, Vec<String>> {
        let files: Vec<PathBuf> = paths.iter().map(PathBuf::from).collect();
        splits(&files)
            .into_iter()
            .map(|(k, v)| (k, v.iter().map(|p| p.display().to_string()).collect()))
            .collect()
    }

    #[test]
    fn hub_shards_win() {
        let s = split_of(&[
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/test-00000-of-00001.parquet",
            "extra/validation.jsonl",
        ]);
        assert_eq!(s["train"].len(), 2);
        assert_eq!(s["test"], ["data/test-00000-of-00001.parquet"]);
        assert!(!s.contains_key("validation"));
    }

    #[test]
    fn folders_before_file_names() {
        let s = split_of(&["my-train/a.jsonl", "dev/b.jsonl", "test.jsonl"]);
        assert_eq!(s["train"], ["my-train/a.jsonl"]);
        assert_eq!(s["validation"], ["dev/b.jsonl"]);
        assert!(!s.contains_key("test"));
    }

    #[test]
    fn file_names_then_everything() {
        let s = split_of(&["my_train_0.jsonl", "eval.jsonl", "trainer.jsonl"]);
        assert_eq!(s["train"], ["my_train_0.jsonl"]);
        assert_eq!(s["test"], ["eval.jsonl"]);
        let s = split_of(&["a.jsonl", "b.parquet"]);
        assert_eq!(s["train"], ["a.jsonl", "b.parquet"]);
    }
}
