//! The decoding loop of transformers' `generate`: a prefill of the left-padded prompts into a
//! KV cache, then one token per row per step through the logits processors, rows stopping at
//! an EOS id and padded after, until every row stopped or `max_new_tokens`.
//!
//! It drives any [`CachedForward`]: a model on one process (`models`), or a model under a
//! strategy (`parallel`), whose ranks run their forwards together until every rank is done.

pub use super::forward::CachedForward;
use super::steps::{first_argmax_on, pick_tables, Mode, Out, Steps};
use super::{next_token, GenerationConfig, Sampler};
use crate::error::{Error, Result};
use crate::nn::KvCache;
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex};

/// Tokens [batch, prompt + new] (u32): `input_ids` [batch, prompt] (u32, left-padded, with
/// `attention_mask` [batch, prompt] 1 on tokens and 0 on pads) continued as `cfg` says.
/// Greedy output is transformers' `generate(do_sample=False)`'s token for token.
pub fn generate(
    model: &impl CachedForward,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    cfg: &GenerationConfig,
) -> Result<Tensor> {
    cfg.check("GenerationConfig")?;
    let prompts = rows(input_ids, "input_ids")?;
    let mask = rows(attention_mask, "attention_mask")?;
    padded_rows(generate_rows(model, &prompts, &mask, cfg)?, cfg)
}

/// Rows of generated ids as one [batch, longest] tensor, the shorter padded after.
fn padded_rows(out: Vec<Vec<u32>>, cfg: &GenerationConfig) -> Result<Tensor> {
    let (b, width) = (out.len(), out.iter().map(Vec::len).max().unwrap_or(0));
    let pad = pad_id(cfg);
    let flat: Vec<u32> = out
        .into_iter()
        .flat_map(|mut r| {
            r.resize(width, pad);
            r
        })
        .collect();
    Ok(Tensor::from_vec(flat, (b, width), &Device::Cpu)?)
}

/// [`generate`] with the decode steps after the prompt run as fixed steps when `fixed`
/// (their inputs, length, positions and key spans in device buffers; on a GPU captured once
/// as a CUDA graph and replayed, what `TRL_CUDA_GRAPHS=1` turns on), eagerly otherwise,
/// whatever that variable says. Also returns why fixed steps were given up, when they were
/// (the model or one of its layers cannot run them: decoding went on eagerly, with the same
/// tokens).
pub fn generate_fixed(
    model: &impl CachedForward,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    cfg: &GenerationConfig,
    fixed: bool,
) -> Result<(Tensor, Option<String>)> {
    cfg.check("GenerationConfig")?;
    let prompts = rows(input_ids, "input_ids")?;
    let mask = rows(attention_mask, "attention_mask")?;
    let seeds: Vec<u64> = (0..prompts.len() as u64)
        .map(|r| row_seed(cfg.seed, r))
        .collect();
    let mode = match fixed {
        true => Mode::fixed_on(&model.input_device()),
        false => Mode::Eager,
    };
    let (out, gave_up) = decode_with(model, (&prompts, &mask), cfg, &seeds, &mut |_| Ok(()), mode)?;
    Ok((padded_rows(out, cfg)?, gave_up))
}

/// `prompts` left-padded with `pad` to the longest, as transformers pads for generation:
/// `input_ids` and `attention_mask` [batch, longest] (u32, 0 on the pads), on the CPU.
pub fn left_pad(prompts: &[&[u32]], pad: u32) -> Result<(Tensor, Tensor)> {
    let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for p in prompts {
        let pads = width - p.len();
        ids.extend(std::iter::repeat_n(pad, pads).chain(p.iter().copied()));
        mask.extend((0..width).map(|i| u32::from(i >= pads)));
    }
    let shape = (prompts.len(), width);
    Ok((
        Tensor::from_vec(ids, shape, &Device::Cpu)?,
        Tensor::from_vec(mask, shape, &Device::Cpu)?,
    ))
}

fn rows(t: &Tensor, name: &str) -> Result<Vec<Vec<u32>>> {
    if t.rank() != 2 {
        return Err(Error::config(
            "generate",
            name,
            format!("must be [batch, prompt], got {:?}", t.dims()),
        ));
    }
    Ok(t.to_dtype(DType::U32)?.to_vec2::<u32>()?)
}

/// The id that fills rows that stopped: `pad_token_id`, else the first EOS id (transformers
/// sets it so, with a warning), else 0.
fn pad_id(cfg: &GenerationConfig) -> u32 {
    cfg.pad_token_id
        .or(cfg.eos_token_id.first().copied())
        .unwrap_or(0)
}

/// [`generate`] on rows of ids: each row's prompt (pads included) and what follows it, as
/// far as this process generated (the rows of processes generating together may be longer).
pub fn generate_rows(
    model: &impl CachedForward,
    prompts: &[Vec<u32>],
    mask: &[Vec<u32>],
    cfg: &GenerationConfig,
) -> Result<Vec<Vec<u32>>> {
    generate_streaming(model, prompts, mask, cfg, &mut |_| Ok(()))
}

/// The seed of row `row` of a batch generated with `seed`: each row draws from its own
/// stream, so a row's tokens do not depend on the rows beside it.
pub fn row_seed(seed: u64, row: u64) -> u64 {
    // splitmix64's finaliser: nearby (seed, row) pairs give unrelated streams.
    let mut z = seed ^ row.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// [`generate_rows`], calling `on_tokens` with each step's new token of every row (a
/// stopped row's is the pad) as soon as it is chosen: streamed output.
pub fn generate_streaming(
    model: &impl CachedForward,
    prompts: &[Vec<u32>],
    mask: &[Vec<u32>],
    cfg: &GenerationConfig,
    on_tokens: &mut dyn FnMut(&[u32]) -> Result<()>,
) -> Result<Vec<Vec<u32>>> {
    let seeds: Vec<u64> = (0..prompts.len() as u64)
        .map(|r| row_seed(cfg.seed, r))
        .collect();
    decode(model, prompts, mask, cfg, &seeds, on_tokens)
}

/// [`generate_rows`] with each row's own sampling seed (see [`row_seed`]): a row drawn
/// with the same seed gives the same tokens in any batch, on any rank.
pub fn generate_rows_seeded(
    model: &impl CachedForward,
    prompts: &[Vec<u32>],
    mask: &[Vec<u32>],
    cfg: &GenerationConfig,
    seeds: &[u64],
) -> Result<Vec<Vec<u32>>> {
    if seeds.len() != prompts.len() {
        return Err(Error::config(
            "generate",
            "seeds",
            format!("{} seeds for {} rows", seeds.len(), prompts.len()),
        ));
    }
    decode(model, prompts, mask, cfg, seeds, &mut |_| Ok(()))
}

fn decode(
    model: &impl CachedForward,
    prompts: &[Vec<u32>],
    mask: &[Vec<u32>],
    cfg: &GenerationConfig,
    seeds: &[u64],
    on_tokens: &mut dyn FnMut(&[u32]) -> Result<()>,
) -> Result<Vec<Vec<u32>>> {
    let mode = Mode::for_run(model, &model.input_device());
    Ok(decode_with(model, (prompts, mask), cfg, seeds, on_tokens, mode)?.0)
}

/// [`decode`] with its steps run as `mode` says; also says why fixed steps were given up.
pub(crate) fn decode_with(
    model: &impl CachedForward,
    (prompts, mask): (&[Vec<u32>], &[Vec<u32>]),
    cfg: &GenerationConfig,
    seeds: &[u64],
    on_tokens: &mut dyn FnMut(&[u32]) -> Result<()>,
    mode: Mode,
) -> Result<(Vec<Vec<u32>>, Option<String>)> {
    let b = prompts.len();
    let width = prompts.first().map_or(0, Vec::len);
    if b == 0 || width == 0 {
        return Err(Error::config("generate", "input_ids", "no prompt tokens"));
    }
    if prompts.iter().any(|p| p.len() != width) || mask.len() != b {
        return Err(Error::config(
            "generate",
            "attention_mask",
            "must be [batch, prompt] as input_ids is",
        ));
    }
    // Left padding only: a pad after a token would sit inside the row.
    let mut starts = Vec::with_capacity(b);
    let mut positions = Vec::with_capacity(b * width);
    for (r, m) in mask.iter().enumerate() {
        let start = m.iter().take_while(|&&x| x == 0).count();
        if m.len() != width || m[start..].contains(&0) {
            return Err(Error::config(
                "generate",
                "attention_mask",
                format!(
                    "row {r} is not left-padded (0s before the tokens, 1s after): pad \
                     prompts on the left, as tokenizer.padding_side = \"left\""
                ),
            ));
        }
        if start == width {
            return Err(Error::config(
                "generate",
                "attention_mask",
                format!("row {r} has no token"),
            ));
        }
        starts.push(start);
        // transformers' positions: cumsum(mask) - 1, pads at 1.
        positions.extend((0..width).map(|i| if i < start { 1 } else { (i - start) as i64 }));
    }
    let device = model.input_device();
    let ids = Tensor::from_vec(prompts.concat(), (b, width), &device)?;
    let pos = Tensor::from_vec(positions, (b, width), &device)?;
    let cache = Arc::new(Mutex::new(KvCache::new(
        starts.clone(),
        width + cfg.max_new_tokens,
    )));
    let logits = model.last_logits(&ids, &pos, Some(&cache))?;
    // A model whose attention does not go through `LayerInputs` makes no use of the cache:
    // each step then runs the whole rows.
    let cached = {
        let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
        c.commit(width)? > 0
    };
    let mut out: Vec<Vec<u32>> = prompts.to_vec();
    let mut next_pos: Vec<i64> = starts.iter().map(|s| (width - s) as i64).collect();
    let mut done = vec![cfg.max_new_tokens == 0; b];
    let mut samplers: Vec<Sampler> = seeds.iter().map(|&s| Sampler::new(s)).collect();
    let pad = pad_id(cfg);
    let mut mine_done = cfg.max_new_tokens == 0;
    // Greedy without a repetition penalty on a GPU: the argmax is taken there and only the
    // tokens come back, not [batch, vocab] logits a step.
    // (Fixed steps pick there as a graph does, on the CPU too: what the CPU checks.)
    let greedy = !cfg.do_sample && cfg.repetition_penalty == 1.0;
    let argmax_on_device = greedy && (!device.is_cpu() || mode == Mode::Fixed);
    let mut steps = Steps::new(if cached { mode } else { Mode::Eager });
    let mut out_step = Out::Logits(logits);
    for step in 0..cfg.max_new_tokens {
        let mut tokens = Vec::with_capacity(b);
        let best = match &out_step {
            Out::Tokens(t) => Some(picked(t.to_vec1::<u32>()?)),
            Out::Logits(l) if argmax_on_device => Some(first_argmax(l)?),
            Out::Logits(_) => None,
        };
        if let Some(best) = best {
            tokens.extend(best.iter().enumerate().map(|(r, &t)| match done[r] {
                true => pad,
                false => t,
            }));
        } else {
            let Out::Logits(logits) = &out_step else {
                unreachable!("tokens are picked above")
            };
            let v = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            for (r, mut row) in v.into_iter().enumerate() {
                let t = match done[r] {
                    true => pad,
                    false => next_token(cfg, &out[r], &mut row, &mut samplers[r]),
                };
                tokens.push(t);
            }
        }
        if !mine_done {
            on_tokens(&tokens)?;
            for (r, &t) in tokens.iter().enumerate() {
                out[r].push(t);
                done[r] |= cfg.eos_token_id.contains(&t);
            }
            mine_done = done.iter().all(|&d| d);
        }
        if step + 1 == cfg.max_new_tokens || model.all_done(mine_done)? {
            break;
        }
        out_step = match cached {
            true => steps.forward(model, &cache, (&tokens, &next_pos), argmax_on_device)?,
            false => {
                let (ids, pos) = whole_rows(&out, &starts, &device)?;
                Out::Logits(model.last_logits(&ids, &pos, None)?)
            }
        };
        next_pos.iter_mut().for_each(|p| *p += 1);
    }
    Ok((out, steps.gave_up))
}

/// Each row's first index of its largest logit (torch's argmax, and `next_token`'s greedy
/// pick), computed where `logits` [batch, vocab] are: the maximum, the positions equal to it,
/// the smallest of those.
fn first_argmax(logits: &Tensor) -> Result<Vec<u32>> {
    let tables = pick_tables(logits)?;
    Ok(picked(first_argmax_on(logits, &tables)?.to_vec1()?))
}

/// Tokens picked on the device: a row of NaNs matches nowhere (`u32::MAX`), and takes the
/// CPU loop's pick then (index 0).
fn picked(first: Vec<u32>) -> Vec<u32> {
    first
        .into_iter()
        .map(|t| if t == u32::MAX { 0 } else { t })
        .collect()
}

/// Every row whole, as the prefill had them (for a model that does not use the cache).
fn whole_rows(out: &[Vec<u32>], starts: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
    let (b, w) = (out.len(), out[0].len());
    let pos: Vec<i64> = starts
        .iter()
        .flat_map(|&s| (0..w).map(move |i| if i < s { 1 } else { (i - s) as i64 }))
        .collect();
    Ok((
        Tensor::from_vec(out.concat(), (b, w), device)?,
        Tensor::from_vec(pos, (b, w), device)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::AutoModelForCausalLM;

    /// Fixed steps (what a CUDA graph replays: inputs, length, positions and key spans read
    /// from device buffers) give the eager steps' tokens on every built-in architecture,
    /// greedy (picked as the graph picks) and sampled; the architectures that cannot run
    /// them give up at their first fixed step, say why, and still give the same tokens.
    #[test]
    fn fixed_steps_give_the_eager_tokens() {
        let assets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets");
        let mut dirs: Vec<_> = std::fs::read_dir(&assets)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("model/config.json").exists())
            .collect();
        dirs.sort();
        let prompts = vec![
            vec![0, 0, 0, 11, 12, 13, 14],
            vec![21, 22, 23, 24, 25, 26, 27],
        ];
        let mask = vec![vec![0, 0, 0, 1, 1, 1, 1], vec![1; 7]];
        let greedy = GenerationConfig {
            max_new_tokens: 9,
            pad_token_id: Some(0),
            ..GenerationConfig::default()
        };
        let sampled = GenerationConfig {
            do_sample: true,
            top_k: 0,
            ..greedy.clone()
        };
        let seeds: Vec<u64> = (0..2).map(|r| row_seed(3, r)).collect();
        let (mut gave_up, mut tested) = (Vec::new(), 0);
        for dir in &dirs {
            let name = dir.file_name().unwrap().to_string_lossy().to_string();
            // (Some fixtures are of models users write themselves: phi.)
            let Ok(model) =
                AutoModelForCausalLM::from_pretrained(dir.join("model"), DType::F32, &Device::Cpu)
            else {
                continue;
            };
            tested += 1;
            for cfg in [&greedy, &sampled] {
                let run = |mode| {
                    decode_with(
                        &model,
                        (&prompts, &mask),
                        cfg,
                        &seeds,
                        &mut |_| Ok(()),
                        mode,
                    )
                    .unwrap()
                };
                let (want, none) = run(Mode::Eager);
                assert_eq!(none, None);
                let (got, why) = run(Mode::Fixed);
                assert_eq!(got, want, "{name}, sampled: {}", cfg.do_sample);
                if let Some(why) = why {
                    gave_up.push(format!("{name}: {why}"));
                }
            }
        }
        assert!(tested > 20, "{tested} built-in architectures");
        // Plain attention, windows, soft-capping, sinks, NoPE layers, experts run them.
        for name in [
            "tiny",
            "tiny-gemma2",
            "tiny-qwen2-sliding",
            "tiny-gpt-oss",
            "tiny-smollm3",
            "tiny-mixtral",
        ] {
            assert!(
                !gave_up.iter().any(|g| g.starts_with(&format!("{name}:"))),
                "{name} gave up fixed steps: {gave_up:?}"
            );
        }
        eprintln!("gave up fixed steps: {gave_up:#?}");
    }

    /// The on-device pick is the CPU loop's: the first of equal maxima, rows apart.
    #[test]
    fn first_argmax_takes_the_first_of_equal_maxima() {
        let cfg = GenerationConfig::default();
        // Values from a small set, so that most rows hold their maximum more than once.
        let (b, vocab) = (6, 37);
        let v: Vec<f32> = (0..b * vocab)
            .map(|i| ((i * 7919 + 13) % 5) as f32 - 2.0)
            .collect();
        let mut sampler = Sampler::new(0);
        let want: Vec<u32> = v
            .chunks(vocab)
            .map(|row| next_token(&cfg, &[], &mut row.to_vec(), &mut sampler))
            .collect();
        let logits = Tensor::from_vec(v, (b, vocab), &Device::Cpu).unwrap();
        assert_eq!(first_argmax(&logits).unwrap(), want);
        let bf16 = logits.to_dtype(DType::BF16).unwrap();
        assert_eq!(first_argmax(&bf16).unwrap(), want);
    }
}
