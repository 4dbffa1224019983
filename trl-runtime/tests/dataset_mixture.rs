//! TRL's dataset mixtures (`datasets:` in a config): the rows TRL's get_dataset gives for the
//! same local files (Python peer), and a mixture trained on through a `trl sft` config.

mod common;

use serde_json::{json, Value};
use std::path::Path;
use trl_runtime::data::dataset::OnBadRow;
use trl_runtime::data::mixture::Mixture;

/// `a.jsonl` (30 rows), and a dataset directory `dir/` with train (20) and test (8) splits and a
/// `dir/extra/` data_dir (12 rows); every row has `text` and `n`.
fn write_data(root: &Path) {
    let rows = |prefix: &str, n: usize| -> String {
        (0..n)
            .map(|i| json!({"text": format!("{prefix}{i}"), "n": i}).to_string() + "\n")
            .collect()
    };
    std::fs::create_dir_all(root.join("dir/extra")).unwrap();
    std::fs::write(root.join("a.jsonl"), rows("a", 30)).unwrap();
    std::fs::write(root.join("dir/train.jsonl"), rows("train", 20)).unwrap();
    std::fs::write(root.join("dir/test.jsonl"), rows("test", 8)).unwrap();
    std::fs::write(root.join("dir/extra/train.jsonl"), rows("extra", 12)).unwrap();
}

/// The mixtures compared: (datasets, test_split_size).
fn cases(root: &Path) -> Vec<(Value, Option<f64>)> {
    let a = root.join("a.jsonl").display().to_string();
    let dir = root.join("dir").display().to_string();
    let glob = root.join("dir/*.jsonl").display().to_string();
    vec![
        (json!([{"path": "json", "data_files": a}]), None),
        (json!([{"path": dir}, {"path": dir, "split": "test"}]), None),
        (json!([{"path": dir, "data_dir": "extra"}]), None),
        (
            json!([{"path": "json", "data_files": {"train": a, "test": [glob]}, "split": "test"}]),
            None,
        ),
        (
            json!([{"path": dir, "split": "train[:5]"}, {"path": dir, "split": "train[25%:50%]"}, {"path": dir, "split": "test[-3:]"}]),
            None,
        ),
        (
            json!([{"path": "json", "data_files": a, "columns": ["text"]}]),
            None,
        ),
        (
            json!([{"path": "json", "data_files": a, "fraction": 0.25}, {"path": dir, "fraction": 0.75}]),
            None,
        ),
        (
            json!([{"path": "json", "data_files": a, "fraction": 2}, {"path": dir, "data_dir": "extra", "fraction": 1}]),
            None,
        ),
        (
            json!([{"path": "json", "data_files": a}, {"path": dir}]),
            Some(0.2),
        ),
        (json!([{"path": dir}]), Some(0.5)),
    ]
}

/// Each case against TRL 1.16's get_dataset (datasets 5): the same rows in the same order
/// (the whole row, so the column selection too); with test_split_size the same sizes (its
/// split is random, ours follows the seed) and every row in exactly one part. Skipped with a
/// message without trl and datasets.
#[test]
fn mixtures_give_the_rows_trl_get_dataset_gives() {
    let Some(python) = common::python_with(&["trl", "datasets"]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    write_data(tmp.path());
    let cases = cases(tmp.path());
    let spec = serde_json::to_string(&cases).unwrap();
    let script = format!(
        "import json\n\
         from trl.scripts.utils import DatasetMixtureConfig, DatasetConfig, get_dataset\n\
         out = []\n\
         for ds, test in json.loads({spec:?}):\n\
         \x20   cfg = DatasetMixtureConfig(datasets=[DatasetConfig(**d) for d in ds], test_split_size=test)\n\
         \x20   dd = get_dataset(cfg)\n\
         \x20   out.append({{k: [dict(r) for r in v] for k, v in dd.items()}})\n\
         print(json.dumps(out))\n"
    );
    let o = std::process::Command::new(&python)
        .args(["-c", &script])
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HOME", tmp.path().join("hf"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let theirs: Vec<serde_json::Map<String, Value>> =
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    for ((datasets, test), theirs) in cases.into_iter().zip(theirs) {
        let mixture: Mixture = serde_json::from_value(datasets.clone()).unwrap();
        let (train, held) = mixture
            .load(test, 42, OnBadRow::Fail, &|v| Ok(v.clone()), "test")
            .unwrap_or_else(|e| panic!("{datasets}: {e}"));
        match test {
            None => {
                assert_eq!(Value::Array(train), theirs["train"], "{datasets}: the rows");
                assert!(held.is_none());
            }
            Some(_) => {
                let held = held.unwrap();
                let len = |k: &str| theirs[k].as_array().unwrap().len();
                assert_eq!(
                    (train.len(), held.len()),
                    (len("train"), len("test")),
                    "{datasets}"
                );
                let mut all: Vec<String> =
                    train.iter().chain(&held).map(|r| r.to_string()).collect();
                let mut expected: Vec<String> = theirs["train"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .chain(theirs["test"].as_array().unwrap())
                    .map(|r| r.to_string())
                    .collect();
                all.sort();
                expected.sort();
                assert_eq!(all, expected, "{datasets}: every row once");
            }
        }
    }
}

/// What TRL refuses, or a local run cannot read, is refused naming the source and key.
#[test]
fn bad_mixtures_name_the_source_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    write_data(tmp.path());
    let dir = tmp.path().join("dir").display().to_string();
    let a = tmp.path().join("a.jsonl").display().to_string();
    let refused = |datasets: Value, test: Option<f64>, words: &[&str]| {
        let mixture: Mixture = serde_json::from_value(datasets.clone()).unwrap();
        let e = mixture
            .load(test, 42, OnBadRow::Fail, &|v| Ok(v.clone()), "cfg.yaml")
            .unwrap_err()
            .to_string();
        for w in words {
            assert!(e.contains(w), "{datasets}: {e}");
        }
    };
    refused(
        json!([{"path": dir, "fraction": 0.5}, {"path": dir, "split": "test"}]),
        None,
        &["cfg.yaml", "datasets", "all datasets"],
    );
    refused(
        json!([{"path": "trl-lib/Capybara"}]),
        None,
        &[
            "datasets[0].path",
            "hf download --repo-type dataset trl-lib/Capybara",
        ],
    );
    refused(
        json!([{"path": dir, "split": "validation"}]),
        None,
        &["validation"],
    );
    refused(
        json!([{"path": "json", "data_files": a, "columns": ["prompt"]}]),
        None,
        &["column `prompt`", "datasets[0].columns"],
    );
    refused(
        json!([{"path": dir, "name": "en"}]),
        None,
        &["datasets[0].name"],
    );
    refused(
        json!([{"path": dir}]),
        Some(6.0),
        &["test_split_size", "between 0 and 1"],
    );
    assert!(serde_json::from_value::<Mixture>(json!([{"path": dir, "weight": 1}])).is_err());
}

/// A `trl sft` config with a mixture trains on it: the rows are the mixture's (held-out rows
/// excluded), and test_split_size's rows are the evaluation set.
#[test]
fn an_sft_config_trains_on_its_mixture() {
    let tmp = tempfile::tempdir().unwrap();
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny");
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let text = std::fs::read_to_string(assets.join("data/train.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(data.join("one.jsonl"), lines[..40].join("\n")).unwrap();
    std::fs::write(data.join("two.jsonl"), lines[40..100].join("\n")).unwrap();
    let yaml = tmp.path().join("sft.yaml");
    std::fs::write(
        &yaml,
        format!(
            "model_name_or_path: {model}\noutput_dir: {out}\n\
             datasets:\n  - path: json\n    data_files: {one}\n    fraction: 0.5\n\
             \x20 - path: json\n    data_files: {two}\n    fraction: 0.5\n\
             test_split_size: 0.25\neval_strategy: steps\neval_steps: 2\n\
             max_steps: 2\nper_device_train_batch_size: 4\nmax_length: 64\nlearning_rate: 1.0e-3\n\
             gradient_checkpointing: false\ndisable_tqdm: true\n",
            model = assets.join("model").display(),
            out = tmp.path().join("out").display(),
            one = data.join("one.jsonl").display(),
            two = data.join("two.jsonl").display(),
        ),
    )
    .unwrap();
    let cli = trl_runtime::train::SftCli::parse_trl_from(
        ["sft", "--config", yaml.to_str().unwrap()].map(String::from),
    );
    let (config, _) = cli.resolve().unwrap();
    let world = trl_runtime::comm::InProcessWorld::new(1);
    let dims = trl_runtime::config::parallelism::ParallelDims {
        dp_replicate: 1,
        dp_shard: 1,
        cp: 1,
        sp: 1,
        tp: 1,
    };
    let mesh = trl_runtime::dist::DeviceMesh::new(dims, 1).unwrap();
    let ctx = trl_runtime::dist::DistContext::in_process(&world, 0, mesh).unwrap();
    let mut trainer = trl_runtime::train::Trainer::new(config, &ctx).unwrap();
    // 40 + 40 rows in the mixture (the second source's first 40), 20 held out.
    use trl_runtime::train::Task;
    let rows =
        <trl_runtime::train::Sft as Task<trl_runtime::models::AutoModelForCausalLM>>::num_rows(
            &trainer.task,
        );
    assert_eq!(rows, 60);
    let outcome = trainer.train().unwrap();
    assert!(
        outcome.final_eval.is_some(),
        "the held-out rows were evaluated"
    );
}

/// A dataset directory whose card (README.md) declares configurations, as the Hub's datasets
/// do, is read as `datasets.load_dataset(DIR, name)` reads it: the named configuration's
/// `data_files` by split, without a name the one marked default; a missing name where none is
/// default, or an unknown one, is refused naming dataset_config. The rows equal `datasets`'
/// (when it is installed).
#[test]
fn dataset_cards_configurations_are_read_as_datasets_reads_them() {
    use trl_runtime::data::dataset::{load, Split};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for (file, texts) in [
        ("data/all/train-00000-of-00001.jsonl", &["a1", "a2"][..]),
        ("data/all/test-00000-of-00001.jsonl", &["at"]),
        ("data/small/train-00000-of-00001.jsonl", &["s1"]),
    ] {
        let lines: Vec<String> = texts
            .iter()
            .map(|t| json!({ "text": t }).to_string())
            .collect();
        std::fs::create_dir_all(dir.join(file).parent().unwrap()).unwrap();
        std::fs::write(dir.join(file), lines.join("\n")).unwrap();
    }
    let card = |default: &str| {
        format!(
            "---\nconfigs:\n- config_name: all\n  data_files:\n  - split: train\n    path: data/all/train-*\n  - split: test\n    path: data/all/test-*\n- config_name: small\n  data_files: data/small/train-*\n{default}---\n# Card\n"
        )
    };
    std::fs::write(dir.join("README.md"), card("  default: true\n")).unwrap();
    let rows = |config: Option<&str>, split: &str| -> Result<Vec<String>, String> {
        let split = Split {
            name: split,
            key: "dataset_train_split",
            config,
            config_key: "dataset_config",
        };
        let loaded = load(dir, split, OnBadRow::Fail).map_err(|e| e.to_string())?;
        Ok(loaded.records.iter().map(|r| format!("{r:?}")).collect())
    };
    let texts = |config: Option<&str>, split: &str| -> Vec<String> {
        let got = rows(config, split).unwrap();
        ["a1", "a2", "at", "s1"]
            .into_iter()
            .filter(|t| got.iter().any(|r| r.contains(&format!("\"{t}\""))))
            .map(String::from)
            .collect()
    };
    assert_eq!(texts(None, "train"), ["s1"]);
    assert_eq!(texts(Some("all"), "train"), ["a1", "a2"]);
    assert_eq!(texts(Some("all"), "test"), ["at"]);
    let e = rows(Some("fr"), "train").unwrap_err();
    assert!(e.contains("dataset_config") && e.contains("'fr'"), "{e}");
    let e = rows(Some("small"), "test").unwrap_err();
    assert!(e.contains("no split 'test'"), "{e}");
    if let Some(python) = common::python_with(&["datasets"]) {
        let script = "import sys, json\nfrom datasets import load_dataset\n\
             d, name, split = sys.argv[1], sys.argv[2] or None, sys.argv[3]\n\
             print(json.dumps(list(load_dataset(d, name)[split]['text'])))";
        for (config, split) in [
            (None, "train"),
            (Some("all"), "train"),
            (Some("all"), "test"),
        ] {
            let o = std::process::Command::new(&python)
                .args(["-c", script])
                .arg(dir)
                .args([config.unwrap_or(""), split])
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let theirs: Vec<String> = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(texts(config, split), theirs, "{config:?} {split}");
        }
    }
    // No configuration is the default: a name is needed, as datasets asks for one.
    std::fs::write(dir.join("README.md"), card("")).unwrap();
    let e = rows(None, "train").unwrap_err();
    assert!(
        e.contains("dataset_config") && e.contains("\"all\", \"small\""),
        "{e}"
    );
}
