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

/// The files of `split` in the dataset directory `dir`; `key` is the setting that chose the
/// split (named in errors).
pub fn split_files(dir: &Path, split: &str, key: &str) -> Result<Vec<PathBuf>> {
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
