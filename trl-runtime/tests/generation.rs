//! Generation's logits processors against transformers' own (scripts/generation_processors.py,
//! when a Python with torch and transformers is there; skipped with a message otherwise), and
//! sampling following the processed distribution over thousands of draws of one next token;
//! the decoding loop with its KV cache against whole forwards and against transformers'
//! `generate` (scripts/transformers_generate.py) on every built-in architecture.

mod common;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use trl_runtime::generation::processors::softmax;
use trl_runtime::generation::{process, GenerationConfig, Sampler};
use trl_runtime::models::AutoModelForCausalLM;

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
        .join("../../scripts/generation_processors.py");
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

/// Every built-in architecture's checkpoint (scripts/make_decoder_fixture.py; sliding windows
/// of 6-10 tokens, shorter than prompt + new tokens).
const ARCHITECTURES: &[&str] = &[
    "tiny",
    "qwen3",
    "mistral",
    "qwen2-sliding",
    "gemma3",
    "gemma2",
    "qwen3-vl",
    "gemma3-vision",
    "smollm3",
    "olmo2",
    "olmo3",
    "llama-longrope",
    "phi3",
    "qwen3-moe",
    "mixtral",
    "gpt-oss",
    "gpt-oss-mxfp4",
    "glm4-moe",
    "deepseek-v3",
    "glm4-moe-lite",
    "llama4",
    "llama4-vision",
    "mistral4",
    // Gated DeltaNet's recurrent state beside full attention's keys and values.
    "qwen3-next",
    "qwen3.5",
    "qwen3.5-moe-vision",
    // Gemma 4: the last layers attend over earlier layers' cached keys and values.
    "gemma4",
    "gemma4-moe-vision",
];

fn checkpoint(kind: &str) -> std::path::PathBuf {
    let name = match kind {
        "tiny" => "tiny".to_string(),
        k => format!("tiny-{k}"),
    };
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets")
        .join(name)
        .join("model")
}

/// Two prompts of different lengths (7 and 12 tokens), left-padded with `PAD`.
const PAD: u32 = 0;
fn prompts() -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    [7, 12]
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(3..250u32)).collect())
        .collect()
}

fn padded(prompts: &[Vec<u32>]) -> (Tensor, Tensor) {
    let w = prompts.iter().map(Vec::len).max().unwrap();
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for p in prompts {
        ids.extend(std::iter::repeat_n(PAD, w - p.len()).chain(p.iter().copied()));
        mask.extend((0..w).map(|i| u32::from(i >= w - p.len())));
    }
    let b = prompts.len();
    (
        Tensor::from_vec(ids, (b, w), &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, (b, w), &Device::Cpu).unwrap(),
    )
}

fn greedy(max_new_tokens: usize, eos: Option<u32>) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens,
        eos_token_id: eos.into_iter().collect(),
        pad_token_id: Some(PAD),
        ..GenerationConfig::default()
    }
}

/// Greedy tokens without a cache: every step a forward over the whole left-padded rows
/// (transformers' positions, the pads their own documents), the most likely last token.
fn greedy_uncached(model: &AutoModelForCausalLM, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let (ids, mask) = padded(prompts);
    let mut rows = ids.to_vec2::<u32>().unwrap();
    let mask = mask.to_vec2::<u32>().unwrap();
    for _ in 0..n {
        let (b, w) = (rows.len(), rows[0].len());
        let pos: Vec<i64> = mask
            .iter()
            .flat_map(|m| {
                let start = m.iter().take_while(|&&x| x == 0).count();
                (0..w).map(move |i| if i < start { 1 } else { (i - start) as i64 })
            })
            .collect();
        let ids = Tensor::from_vec(rows.concat(), (b, w), &Device::Cpu).unwrap();
        let pos = Tensor::from_vec(pos, (b, w), &Device::Cpu).unwrap();
        let logits = model.forward(&ids, &pos).unwrap();
        let next = logits.narrow(1, w - 1, 1).unwrap().squeeze(1).unwrap();
        let next = next.argmax(1).unwrap().to_vec1::<u32>().unwrap();
        for (r, t) in rows.iter_mut().zip(next) {
            r.push(t);
        }
    }
    rows
}

/// A copy of the files of directory `from` in `to`.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

/// The cache after a prefill of `ids` (rows without padding), made for `capacity` tokens.
fn prefill(
    model: &AutoModelForCausalLM,
    ids: &Tensor,
    capacity: usize,
) -> trl_runtime::nn::KvCache {
    use std::sync::{Arc, Mutex};
    use trl_runtime::generation::CachedForward;
    let (rows, width) = ids.dims2().unwrap();
    let cache = Arc::new(Mutex::new(trl_runtime::nn::KvCache::new(
        vec![0; rows],
        capacity,
    )));
    let pos = Tensor::arange(0i64, width as i64, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((rows, 1))
        .unwrap();
    model.last_logits(ids, &pos, Some(&cache)).unwrap();
    Arc::try_unwrap(cache).unwrap().into_inner().unwrap()
}

/// The KV cache changes nothing: greedy generation with it equals a whole forward per token,
/// on every built-in architecture (windows shorter than the rows, sinks, soft-capping, NoPE
/// layers, experts, composite checkpoints), two left-padded prompts.
#[test]
fn the_cache_gives_the_tokens_of_whole_forwards() {
    for kind in ARCHITECTURES {
        let model =
            AutoModelForCausalLM::from_pretrained(checkpoint(kind), DType::F32, &Device::Cpu)
                .unwrap();
        let (ids, mask) = padded(&prompts());
        let got = model.generate(&ids, &mask, &greedy(12, None)).unwrap();
        let want = greedy_uncached(&model, &prompts(), 12);
        assert_eq!(got.to_vec2::<u32>().unwrap(), want, "{kind}");
        // And the cache is used (without it the loop runs whole rows, with the same tokens):
        // every layer's attention takes its slot.
        use trl_runtime::models::CausalModel;
        let width = ids.dim(1).unwrap();
        let mut cache = prefill(&model, &ids, width);
        let slots = cache.commit(width).unwrap();
        assert_eq!(
            slots,
            model.num_layers(),
            "{kind}: layers attending through the cache"
        );
    }
}

/// Greedy generation equals transformers' `generate(do_sample=False)` token for token on every
/// built-in architecture, left-padded prompts of different lengths, with no EOS and with an
/// EOS that stops one row early (padded after, the batch going on until the other stops).
#[test]
fn greedy_generation_equals_transformers() {
    let Some(python) = common::python_with(&["torch", "transformers"]) else {
        return;
    };
    let new = 16;
    let mut jobs = Vec::new();
    let mut ours = Vec::new();
    // Llama 4's NoPE layers scale queries by position: transformers counts a row's tokens
    // from its first, pads included, we count from its first real token (as each prompt
    // alone, and as vLLM and Meta's code do). So its left-padded rows are compared with the
    // scale off (a copy of the checkpoint), and with it on, rows of one length.
    let tmp = tempfile::tempdir().unwrap();
    let cool = tmp.path().join("llama4-no-temperature");
    copy_dir(&checkpoint("llama4"), &cool);
    let config = std::fs::read_to_string(cool.join("config.json")).unwrap();
    let config = config.replace(
        "\"attn_temperature_tuning\": true",
        "\"attn_temperature_tuning\": false",
    );
    std::fs::write(cool.join("config.json"), config).unwrap();
    let same_length: Vec<Vec<u32>> = prompts().iter().map(|p| p[..7].to_vec()).collect();
    let mut cases: Vec<(&str, std::path::PathBuf, Vec<Vec<u32>>)> = ARCHITECTURES
        .iter()
        .map(|k| match k.starts_with("llama4") {
            true => (*k, checkpoint(k), same_length.clone()),
            false => (*k, checkpoint(k), prompts()),
        })
        .collect();
    cases.push(("llama4 (no temperature)", cool, prompts()));
    // A prompt shorter than Gated DeltaNet's convolution: the pads before it must not reach
    // the first decoded tokens through the held inputs.
    let mut short = prompts();
    short[0].truncate(2);
    cases.push(("qwen3.5 (a 2-token prompt)", checkpoint("qwen3.5"), short));
    for (kind, dir, prompts) in cases {
        let model = AutoModelForCausalLM::from_pretrained(&dir, DType::F32, &Device::Cpu).unwrap();
        let (ids, mask) = padded(&prompts);
        let free = model.generate(&ids, &mask, &greedy(new, None)).unwrap();
        let free = free.to_vec2::<u32>().unwrap();
        // The 4th new token of the first row stops it.
        let eos = free[0][ids.dim(1).unwrap() + 3];
        let stopped = model
            .generate(&ids, &mask, &greedy(new, Some(eos)))
            .unwrap()
            .to_vec2::<u32>()
            .unwrap();
        for (e, tokens) in [(None, free), (Some(eos), stopped)] {
            jobs.push(serde_json::json!({
                "model": dir, "prompts": prompts, "max_new_tokens": new,
                "eos_token_id": e, "pad_token_id": PAD,
            }));
            ours.push((kind, e, tokens));
        }
    }
    let job_file = tmp.path().join("job.json");
    std::fs::write(&job_file, serde_json::json!({ "jobs": jobs }).to_string()).unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/transformers_generate.py");
    let out = common::stdout_of(
        std::process::Command::new(python)
            .arg(script)
            .arg(&job_file),
    );
    #[derive(serde::Deserialize)]
    struct Want {
        tokens: Vec<Vec<u32>>,
        gaps: Vec<Vec<f32>>,
    }
    let want: Vec<Want> = serde_json::from_str(&out).unwrap();
    for ((kind, eos, got), want) in ours.iter().zip(&want) {
        eprintln!(
            "{kind} eos {eos:?}: {got:?}\n  transformers: {:?}",
            want.tokens
        );
        let smallest = want.gaps.iter().flatten().fold(f32::MAX, |a, &b| a.min(b));
        assert_eq!(
            got, &want.tokens,
            "{kind} (eos {eos:?}): tokens differ from transformers' (smallest top-2 logit gap {smallest})"
        );
    }
}

/// The KV cache a generation allocates is what the planner counts
/// (`estimate::generation_round`): rows x tokens x layers x kv heads x head dim x 2 x 4 bytes;
/// Qwen3-Next's and Qwen3.5's Gated DeltaNet layers a recurrent state per row instead.
#[test]
fn the_cache_holds_what_the_plan_counts() {
    use trl_runtime::parallel::estimate::{generation_round, ModelShapes, Setup};
    for kind in [
        "tiny",
        "mistral",
        "gpt-oss",
        "qwen3-next",
        "qwen3.5-moe-vision",
        // Wider full layers; the last two reuse earlier layers' keys and values.
        "gemma4",
        "gemma4-moe-vision",
    ] {
        let dir = checkpoint(kind);
        let model = AutoModelForCausalLM::from_pretrained(&dir, DType::F32, &Device::Cpu).unwrap();
        let (ids, _) = padded(&prompts());
        let (rows, width) = ids.dims2().unwrap();
        let capacity = width + 20;
        let held = prefill(&model, &ids, capacity).bytes();
        let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let shapes = ModelShapes::of_json(&config, kind).unwrap();
        let setup = Setup::new(
            trl_runtime::train::Strategy::Ddp,
            trl_runtime::config::parallelism::ParallelDims {
                dp_replicate: 1,
                dp_shard: 1,
                cp: 1,
                sp: 1,
                tp: 1,
            },
            rows,
            width,
        );
        let want = generation_round(&shapes, &setup, rows, (width, capacity)).kv_cache;
        assert_eq!(held, want, "{kind}");
    }
}

/// Sampling through the loop: a seed repeats a run exactly, another seed draws otherwise, and
/// the rows of a batch draw independently (two copies of one prompt continue differently).
#[test]
fn sampling_repeats_with_its_seed_and_rows_draw_independently() {
    let model =
        AutoModelForCausalLM::from_pretrained(checkpoint("mistral"), DType::F32, &Device::Cpu)
            .unwrap();
    let p = prompts()[1].clone();
    let (ids, mask) = padded(&[p.clone(), p]);
    let run = |seed: u64| {
        let cfg = GenerationConfig {
            max_new_tokens: 16,
            do_sample: true,
            top_k: 0,
            seed,
            pad_token_id: Some(PAD),
            ..GenerationConfig::default()
        };
        model
            .generate(&ids, &mask, &cfg)
            .unwrap()
            .to_vec2::<u32>()
            .unwrap()
    };
    let first = run(1);
    assert_eq!(first, run(1), "the same seed draws the same tokens");
    assert_ne!(first, run(2), "another seed draws others");
    assert_ne!(first[0], first[1], "the rows draw independently");
}

/// DeepSeek-V3's latent attention caches what transformers' cache holds: per token and layer
/// the normed key/value latent and the rotary key (kv_lora_rank + qk_rope_head_dim = 16 + 8
/// features), not the keys and values of every head (4 x (24 + 24) as the kernels run them).
#[test]
fn latent_attention_caches_the_compressed_latent() {
    use trl_runtime::models::CausalModel;
    let model =
        AutoModelForCausalLM::from_pretrained(checkpoint("deepseek-v3"), DType::F32, &Device::Cpu)
            .unwrap();
    let (ids, _) = padded(&prompts());
    let (b, width) = ids.dims2().unwrap();
    let capacity = width + 20;
    let cache = prefill(&model, &ids, capacity);
    let want = model.num_layers() * b * capacity * (16 + 8) * 4;
    assert_eq!(cache.bytes(), want);
}
