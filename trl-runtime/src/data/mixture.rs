//! TRL's dataset mixtures: the `datasets:` list of a `trl sft` / `trl dpo` config
//! (DatasetMixtureConfig), read as TRL's `get_dataset` reads it, from local data. Each source
//! is `datasets.load_dataset(path, data_dir=, data_files=, split=)` with its `columns`
//! selected; with `fraction` on every source, the first `round(share x N)` rows of each are
//! kept, N the largest mixture no source is too small for; the sources are concatenated in
//! order; `test_split_size` holds a share of the rows out for evaluation
//! (`train_test_split`, here shuffled by the run's seed).

use super::dataset::{load_rows, Loaded, OnBadRow, RowParser, Split};
use crate::error::{Error, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// One file or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Files {
    One(String),
    Many(Vec<String>),
}

impl Files {
    fn list(&self) -> Vec<String> {
        match self {
            Files::One(f) => vec![f.clone()],
            Files::Many(fs) => fs.clone(),
        }
    }
}

/// `data_files`: files (the train split) or files by split, as `load_dataset` takes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataFiles {
    Files(Files),
    BySplit(BTreeMap<String, Files>),
}

fn train() -> String {
    "train".into()
}

/// One dataset of the mixture (TRL's DatasetConfig); a key left out is None.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSource {
    /// A local dataset file or directory; or `json` / `parquet` with `data_files`.
    pub path: String,
    /// A hub dataset's configuration: only `default` (local data has no other).
    pub name: Option<String>,
    /// A directory under `path` holding the data.
    pub data_dir: Option<String>,
    /// The files, relative to `path` (to the working directory for `json` / `parquet`); `*`
    /// patterns are expanded.
    pub data_files: Option<DataFiles>,
    /// The split, with `datasets`' slicing: `train[:1000]`, `train[10%:20%]`, `test[-50:]`.
    #[serde(default = "train")]
    pub split: String,
    /// The columns kept (the others are dropped before the row is read).
    pub columns: Option<Vec<String>>,
    /// Target share of the mixture (set on every source or none).
    pub fraction: Option<f64>,
}

/// The `datasets:` list (empty: the data is dataset_name).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Mixture(pub Vec<DatasetSource>);

impl crate::config::cli_value::CliValue for Mixture {
    /// A JSON list of sources (`[{"path": "data.jsonl", "fraction": 0.5}, ...]`).
    fn parse_cli(s: &str) -> std::result::Result<Self, String> {
        serde_json::from_str(s)
            .map_err(|e| format!("'{s}': expected a JSON list of {{\"path\": ...}} objects: {e}"))
    }
}

/// A split name and its `datasets` slice `[start:end]` (rows or percents; negative from the
/// end).
fn parse_split(spec: &str) -> std::result::Result<(String, Option<(Bound, Bound)>), String> {
    let Some((name, rest)) = spec.split_once('[') else {
        return Ok((spec.trim().to_string(), None));
    };
    let inner = rest
        .strip_suffix(']')
        .ok_or_else(|| format!("'{spec}': a slice is `split[start:end]`"))?;
    let (a, b) = inner
        .split_once(':')
        .ok_or_else(|| format!("'{spec}': a slice is `split[start:end]` (one row: `[n:n+1]`)"))?;
    let bound = |s: &str| -> std::result::Result<Bound, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(Bound::Open);
        }
        let bad = |_| format!("'{spec}': '{s}' is not a row number or a percent");
        Ok(match s.strip_suffix('%') {
            Some(p) => Bound::Percent(p.trim().parse().map_err(bad)?),
            None => Bound::Row(s.parse().map_err(bad)?),
        })
    };
    Ok((name.trim().to_string(), Some((bound(a)?, bound(b)?))))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Bound {
    Open,
    Row(i64),
    Percent(i64),
}

impl Bound {
    /// The row index of this bound in `n` rows (`open`: the side's end). Percents round to
    /// the closest row, as `datasets` does by default.
    fn index(self, n: usize, open: usize) -> usize {
        let at = |i: i64| match i < 0 {
            true => n.saturating_sub(i.unsigned_abs() as usize),
            false => (i as usize).min(n),
        };
        match self {
            Bound::Open => open,
            Bound::Row(i) => at(i),
            Bound::Percent(p) => at((p as f64 * n as f64 / 100.0).round_ties_even() as i64),
        }
    }
}

/// The rows each source keeps for `fractions` of the mixture over sources of `lens` rows
/// (TRL's get_dataset: shares normalized to one, the mixture as large as the sources allow).
pub fn fraction_rows(fractions: &[f64], lens: &[usize]) -> Vec<usize> {
    let sum: f64 = fractions.iter().sum();
    let shares: Vec<f64> = fractions.iter().map(|f| f / sum).collect();
    let total = shares
        .iter()
        .zip(lens)
        .filter(|(w, _)| **w > 0.0)
        .map(|(w, n)| *n as f64 / w)
        .fold(f64::INFINITY, f64::min);
    shares
        .iter()
        .map(|w| (w * total).round_ties_even() as usize)
        .collect()
}

/// How many of `n` rows `datasets`' train_test_split holds out for a `test_size` share in
/// (0, 1), rounded up (TRL's test_split_size is a float, which that function reads as a share
/// only).
pub fn test_rows(test_size: f64, n: usize) -> std::result::Result<usize, String> {
    if !(test_size > 0.0 && test_size < 1.0) {
        return Err(format!(
            "{test_size}: a share of the mixture between 0 and 1"
        ));
    }
    let rows = (test_size * n as f64).ceil() as usize;
    match rows < n {
        true => Ok(rows),
        false => Err(format!(
            "{test_size} holds out all of the mixture's {n} rows: both parts need at least one"
        )),
    }
}

impl Mixture {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The mixture's rows read by `parse`, and with `test_size` the held-out ones (shuffled
    /// by `seed`). `source` names the config in errors.
    pub fn load<R>(
        &self,
        test_size: Option<f64>,
        seed: u64,
        on_bad: OnBadRow,
        parse: RowParser<'_, R>,
        source: &str,
    ) -> Result<(Vec<R>, Option<Vec<R>>)> {
        let fractions: Vec<Option<f64>> = self.0.iter().map(|d| d.fraction).collect();
        let mut parts = Vec::with_capacity(self.0.len());
        for (i, d) in self.0.iter().enumerate() {
            parts.push(d.load(on_bad, parse, &format!("datasets[{i}]"), source)?);
        }
        if fractions.iter().any(Option::is_some) {
            let Some(fractions) = fractions.iter().copied().collect::<Option<Vec<f64>>>() else {
                return Err(Error::config(
                    source,
                    "datasets",
                    "fraction must be set for either all datasets in the mixture or none of them",
                ));
            };
            if fractions.iter().any(|f| !f.is_finite() || *f < 0.0)
                || fractions.iter().sum::<f64>() <= 0.0
            {
                return Err(Error::config(
                    source,
                    "datasets",
                    format!("fractions {fractions:?}: shares are >= 0 with a positive sum"),
                ));
            }
            let lens: Vec<usize> = parts.iter().map(Vec::len).collect();
            for (part, keep) in parts.iter_mut().zip(fraction_rows(&fractions, &lens)) {
                part.truncate(keep);
            }
        }
        let mut rows: Vec<R> = parts.into_iter().flatten().collect();
        if rows.is_empty() {
            return Err(Error::config(source, "datasets", "the mixture has no rows"));
        }
        let Some(size) = test_size else {
            return Ok((rows, None));
        };
        let n_test =
            test_rows(size, rows.len()).map_err(|m| Error::config(source, "test_split_size", m))?;
        rows.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let test = rows.split_off(rows.len() - n_test);
        Ok((rows, Some(test)))
    }
}

impl DatasetSource {
    /// This source's rows: its split's files read by `parse` (after the column selection),
    /// then its split's slice. `at` names it (`datasets[0]`).
    fn load<R>(
        &self,
        on_bad: OnBadRow,
        parse: RowParser<'_, R>,
        at: &str,
        source: &str,
    ) -> Result<Vec<R>> {
        let err =
            |key: &str, message: String| Error::config(source, format!("{at}.{key}"), message);
        let (split, slice) = parse_split(&self.split).map_err(|m| err("split", m))?;
        let columns = self.columns.clone();
        let select = |v: &Value| -> std::result::Result<R, String> {
            let Some(columns) = &columns else {
                return parse(v);
            };
            let row = v.as_object().ok_or("a row must be an object")?;
            let mut kept = serde_json::Map::new();
            for c in columns {
                let value = row.get(c).ok_or_else(|| {
                    format!(
                        "column `{c}` ({at}.columns) is not in the row: it has {:?}",
                        row.keys().collect::<Vec<_>>()
                    )
                })?;
                kept.insert(c.clone(), value.clone());
            }
            parse(&Value::Object(kept))
        };
        let (split_key, name_key) = (format!("{at}.split"), format!("{at}.name"));
        let split_of = Split {
            name: &split,
            key: &split_key,
            // A configuration its directory's dataset card declares.
            config: self.name.as_deref(),
            config_key: &name_key,
        };
        let builder = matches!(self.path.as_str(), "json" | "parquet");
        let base = match builder {
            true => PathBuf::from("."),
            // A hub id (`trl-lib/Capybara`) reads its snapshot in the Hugging Face cache.
            false => crate::hub::resolve(crate::hub::RepoKind::Dataset, self.path.as_ref())
                .map_err(|m| err("path", m))?,
        };
        if let Some(name) = self
            .name
            .as_deref()
            .filter(|n| *n != "default" && !base.is_dir())
        {
            return Err(err("name", format!("'{name}': a configuration of a dataset directory's card; {} is no directory: drop it", base.display())));
        }
        let base = match &self.data_dir {
            Some(d) => base.join(d),
            None => base,
        };
        let mut loaded = Loaded::default();
        match &self.data_files {
            Some(files) => {
                let files = match files {
                    DataFiles::Files(f) if split == "train" => f.list(),
                    DataFiles::Files(_) => {
                        return Err(err("split", format!("'{split}': data_files given as a list are the train split; name them by split ({{\"{split}\": [...]}}) or use split: train")));
                    }
                    DataFiles::BySplit(by) => match by.get(&split) {
                        Some(f) => f.list(),
                        None => {
                            return Err(err(
                                "split",
                                format!(
                                    "'{split}' is not among data_files' splits {:?}",
                                    by.keys().collect::<Vec<_>>()
                                ),
                            ));
                        }
                    },
                };
                for pattern in files {
                    for file in super::local_dir::expand(&base.join(&pattern))
                        .map_err(|m| err("data_files", m))?
                    {
                        let part = load_rows(&file, split_of, on_bad, &select)?;
                        loaded.records.extend(part.records);
                    }
                }
            }
            None if builder => {
                return Err(err(
                    "data_files",
                    format!(
                        "`path: {}` is a file builder: name the files in data_files",
                        self.path
                    ),
                ));
            }
            None if !base.exists() => {
                return Err(err("path", format!("{} is not here: give a local dataset file or directory (hub datasets are not fetched)", base.display())));
            }
            None => loaded = load_rows(&base, split_of, on_bad, &select)?,
        }
        let mut rows = loaded.records;
        if let Some((a, b)) = slice {
            let n = rows.len();
            let (start, end) = (a.index(n, 0), b.index(n, n));
            rows.truncate(end.max(start));
            rows.drain(..start);
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_slice_as_datasets_does() {
        let rows = |spec: &str, n: usize| {
            let (_, s) = parse_split(spec).unwrap();
            let (a, b) = s.unwrap();
            (a.index(n, 0), b.index(n, n))
        };
        assert_eq!(parse_split("test").unwrap(), ("test".into(), None));
        assert_eq!(rows("train[:10]", 100), (0, 10));
        assert_eq!(rows("train[10:20]", 100), (10, 20));
        assert_eq!(rows("train[-5:]", 100), (95, 100));
        assert_eq!(rows("train[:10%]", 35), (0, 4)); // 3.5 rounds to even
        assert_eq!(rows("train[25%:75%]", 10), (2, 8)); // 2.5 -> 2, 7.5 -> 8
        assert!(parse_split("train[5]").is_err());
        assert!(parse_split("train[a:]").is_err());
    }

    #[test]
    fn fractions_keep_the_first_rows_of_each_source() {
        // 0.25 / 0.75 of sources of 100 and 150 rows: the mixture is 200 (the second source
        // runs out first), 50 + 150.
        assert_eq!(fraction_rows(&[0.25, 0.75], &[100, 150]), [50, 150]);
        // Unnormalized shares; a zero share keeps no row.
        assert_eq!(fraction_rows(&[2.0, 2.0, 0.0], &[10, 40, 5]), [10, 10, 0]);
        assert_eq!(test_rows(0.1, 95).unwrap(), 10);
        assert!(test_rows(7.0, 95).is_err() && test_rows(0.99, 2).is_err());
    }
}
