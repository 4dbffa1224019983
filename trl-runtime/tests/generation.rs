//! Generation's logits processors against transformers' own (scripts/generation_processors.py,
//! when a Python with torch and transformers is there; skipped with a message otherwise), and
//! sampling following the processed distribution over thousands of draws of one next token.

mod common;

use rand::{Rng, SeedableRng};
use trl_runtime::generation::processors::softmax;
use trl_runtime::generation::{process, GenerationConfig, Sampler};

const VOCAB: usize = 64;

/// Three rows of random logits (a spread like a model's), each with a history of tokens.
fn rows() -> Vec<(Vec<u32>, Vec<f32>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    (0..3)
        .map(|r| {
            let history = (0..5 + 3 * r)
                .map(|_| rng.random_range(0..VOCAB as u32))
                .collect();
            let logits = (0..VOCAB).map(|_| rng.random_range(-4.0f32..4.0)).collect();
            (history, logits)
        })
        .collect()
}

fn configs() -> Vec<GenerationConfig> {
    let sample = |f: fn(&mut GenerationConfig)| {
        let mut c = GenerationConfig {
            do_sample: true,
            ..GenerationConfig::default()
        };
        f(&mut c);
        c
    };
    vec![
        GenerationConfig {
            repetition_penalty: 1.3,
            ..GenerationConfig::default()
        },
        sample(|_| {}),
        sample(|c| c.temperature = 0.7),
        sample(|c| (c.top_k, c.top_p) = (0, 0.8)),
        sample(|c| (c.top_k, c.min_p) = (0, Some(0.1))),
        sample(|c| {
            (
                c.temperature,
                c.top_k,
                c.top_p,
                c.min_p,
                c.repetition_penalty,
            ) = (0.6, 20, 0.9, Some(0.05), 1.2)
        }),
    ]
}

#[test]
fn processors_equal_transformers() {
    let Some(python) = common::python_with(&["torch", "transformers"]) else {
        return;
    };
    let rows = rows();
    let job = serde_json::json!({
        "configs": configs().iter().map(|c| serde_json::json!({
            "repetition_penalty": c.repetition_penalty, "temperature": c.temperature,
            "top_k": c.top_k, "top_p": c.top_p, "min_p": c.min_p, "do_sample": c.do_sample,
        })).collect::<Vec<_>>(),
        "rows": rows.iter().map(|(h, l)| serde_json::json!({"history": h, "logits": l}))
            .collect::<Vec<_>>(),
    });
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts/generation_processors.py");
    let tmp = tempfile::tempdir().unwrap();
    let job_file = tmp.path().join("job.json");
    std::fs::write(&job_file, job.to_string()).unwrap();
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(&job_file)
        .output()
        .unwrap();
    assert!(out.status.success());
    let want: Vec<Vec<Vec<Option<f32>>>> = serde_json::from_slice(&out.stdout).unwrap();
    for (ci, cfg) in configs().iter().enumerate() {
        for (ri, (history, logits)) in rows.iter().enumerate() {
            let mut got = logits.clone();
            process(cfg, history, &mut got);
            for (v, (g, w)) in got.iter().zip(&want[ci][ri]).enumerate() {
                match w {
                    None => assert!(
                        g.is_infinite(),
                        "config {ci} row {ri} token {v}: {g}, transformers removed it"
                    ),
                    Some(w) => assert!(
                        (g - w).abs() < 1e-5,
                        "config {ci} row {ri} token {v}: {g} vs {w}"
                    ),
                }
            }
        }
    }
}

/// 40,000 draws of one next token follow the processed distribution: every token's frequency
/// within 5 standard errors of its probability, and no removed token drawn.
#[test]
fn draws_follow_the_processed_distribution() {
    let (history, logits) = rows().remove(1);
    let cfg = configs().pop().unwrap();
    let mut processed = logits.clone();
    process(&cfg, &history, &mut processed);
    let probs = softmax(&processed);
    let n = 40_000;
    let mut counts = vec![0usize; VOCAB];
    let mut sampler = Sampler::new(3);
    for _ in 0..n {
        counts[sampler.draw(&probs) as usize] += 1;
    }
    for (t, (&c, &p)) in counts.iter().zip(&probs).enumerate() {
        let freq = c as f64 / n as f64;
        let p = p as f64;
        if p == 0.0 {
            assert_eq!(c, 0, "token {t} was removed but drawn");
            continue;
        }
        let se = (p * (1.0 - p) / n as f64).sqrt();
        assert!(
            (freq - p).abs() <= 5.0 * se + 1e-4,
            "token {t}: drawn {freq:.4}, probability {p:.4}"
        );
    }
    assert!(
        probs.iter().filter(|p| **p > 0.0).count() > 1,
        "the test samples among several"
    );
}
