//! Hub names read from the Hugging Face cache, as transformers and datasets read them offline
//! (`HF_HUB_OFFLINE=1`): `--model_name_or_path Qwen/Qwen2.5-0.5B` is the snapshot that
//! `hf download Qwen/Qwen2.5-0.5B` (or an earlier `from_pretrained`) left under
//! `$HF_HUB_CACHE/models--Qwen--Qwen2.5-0.5B/snapshots/<commit of refs/main>`, a dataset's
//! under `datasets--ORG--NAME`. Nothing is downloaded here.
//!
//! Written by hand: hf-hub's `Cache`, even without default features, pulls in an HTTP stack
//! (over 300 crates) for what is a path lookup.

use std::path::{Path, PathBuf};

/// What a hub name names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoKind {
    Model,
    Dataset,
}

impl RepoKind {
    fn folder_prefix(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }

    fn download_command(self, id: &str) -> String {
        match self {
            RepoKind::Model => format!("hf download {id}"),
            RepoKind::Dataset => format!("hf download --repo-type dataset {id}"),
        }
    }
}

/// Hugging Face's home (its cache, Accelerate's default config): HF_HOME, else
/// $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface. `get` reads a variable.
pub fn hf_home(get: impl Fn(&str) -> Option<String>) -> PathBuf {
    let var = |k: &str| get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("HF_HOME").unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .or_else(|| var("HOME").map(|h| h.join(".cache")))
            .unwrap_or_else(|| PathBuf::from("."))
            .join("huggingface")
    })
}

/// The hub cache directory as huggingface_hub finds it: HF_HUB_CACHE (or its older name
/// HUGGINGFACE_HUB_CACHE), else [`hf_home`]/hub.
pub fn cache_dir(get: impl Fn(&str) -> Option<String>) -> PathBuf {
    let var = |k: &str| get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .unwrap_or_else(|| hf_home(get).join("hub"))
}

/// Whether `name` reads as a hub repository id (`ORG/NAME`, or a bare `NAME`, of the
/// characters the hub allows) rather than a path: not a file name with a data or config
/// extension, no `./`, `..` or absolute start.
fn repo_id(name: &Path) -> Option<&str> {
    let s = name.to_str()?;
    let parts: Vec<&str> = s.split('/').collect();
    let allowed = |p: &&str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let file_like = [
        ".json",
        ".jsonl",
        ".parquet",
        ".csv",
        ".txt",
        ".yaml",
        ".safetensors",
    ]
    .iter()
    .any(|e| s.ends_with(e));
    (parts.len() <= 2 && parts.iter().all(allowed) && !file_like).then_some(s)
}

/// The local directory `name` stands for: itself when it exists; else, when it reads as a
/// hub id, the snapshot of its `main` revision in the process's cache ([`cache_dir`]), or
/// why there is none and how to fetch it (the caller names its setting); else itself (the
/// reader says it is missing).
pub fn resolve(kind: RepoKind, name: &Path) -> std::result::Result<PathBuf, String> {
    resolve_in(kind, name, &cache_dir(|k| std::env::var(k).ok()))
}

/// [`resolve`] against the cache directory `cache`.
pub fn resolve_in(
    kind: RepoKind,
    name: &Path,
    cache: &Path,
) -> std::result::Result<PathBuf, String> {
    if name.as_os_str().is_empty() || name.exists() {
        return Ok(name.to_path_buf());
    }
    let Some(id) = repo_id(name) else {
        return Ok(name.to_path_buf());
    };
    let repo = cache.join(format!(
        "{}--{}",
        kind.folder_prefix(),
        id.replace('/', "--")
    ));
    // refs/main holds the commit the snapshot folder is named after.
    let snapshot = std::fs::read_to_string(repo.join("refs/main"))
        .ok()
        .map(|commit| repo.join("snapshots").join(commit.trim()))
        .filter(|dir| dir.is_dir());
    snapshot.ok_or_else(|| {
        format!(
            "'{id}' is not a local path, and the Hugging Face cache ({}) holds no snapshot of it: nothing is downloaded here; fetch it first (`{}`, or set HF_HUB_CACHE / HF_HOME to the cache that has it), or pass a local directory",
            cache.display(),
            kind.download_command(id)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_found_as_huggingface_hub_finds_it() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            cache_dir(env(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h")])),
            PathBuf::from("/c")
        );
        assert_eq!(
            cache_dir(env(&[("HF_HOME", "/h"), ("HOME", "/u")])),
            PathBuf::from("/h/hub")
        );
        assert_eq!(
            cache_dir(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/u")])),
            PathBuf::from("/x/huggingface/hub")
        );
        assert_eq!(
            cache_dir(env(&[("HOME", "/u")])),
            PathBuf::from("/u/.cache/huggingface/hub")
        );
    }

    #[test]
    fn hub_ids_are_told_from_paths() {
        for id in ["Qwen/Qwen2.5-0.5B", "trl-lib/Capybara", "gpt2"] {
            assert_eq!(repo_id(Path::new(id)), Some(id));
        }
        for path in [
            "data/train.jsonl",
            "./model",
            "../m",
            "/abs/m",
            "a/b/c",
            "x.parquet",
        ] {
            assert_eq!(repo_id(Path::new(path)), None, "{path}");
        }
    }

    /// A snapshot laid out as huggingface_hub lays it out is found; a missing one is an
    /// error naming the command that fetches it.
    #[test]
    fn snapshots_of_main_are_read_from_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache.path().join("models--Org--Tiny-1B");
        let snapshot = repo.join("snapshots/0123abcd");
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
        let found = resolve_in(RepoKind::Model, Path::new("Org/Tiny-1B"), cache.path());
        assert_eq!(found.unwrap(), snapshot);
        let e = resolve_in(RepoKind::Dataset, Path::new("Org/Tiny-1B"), cache.path()).unwrap_err();
        assert!(
            e.contains("hf download --repo-type dataset Org/Tiny-1B"),
            "{e}"
        );
        // A path that is not an id is left to its reader.
        let file = Path::new("no/such/file.jsonl");
        assert_eq!(
            resolve_in(RepoKind::Dataset, file, cache.path()).unwrap(),
            file
        );
    }
}
