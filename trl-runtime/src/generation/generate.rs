//! The decoding loop of transformers' `generate`: a prefill of the left-padded prompts into a
//! KV cache, then one token per row per step through the logits processors, rows stopping at
//! an EOS id and padded after, until every row stopped or `max_new_tokens`.
//!
//! It drives any [`CachedForward`]: a model on one process (`models`), or a model under a
//! strategy (`parallel`), whose ranks run their forwards together until every rank is done.

use super::{next_token, GenerationConfig, Sampler};
use crate::error::{Error, Result};
use crate::nn::KvCache;
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex};

/// What generation needs from a model.
pub trait CachedForward {
    /// Logits [batch, vocab] (f32, the whole vocabulary) at the last of `input_ids` [batch,
    /// seq] (u32) at `position_ids` [batch, seq] (i64). With a cache, attention runs over what
    /// it holds and the new keys join it (see [`KvCache::commit`]); without, the rows are
    /// whole.
    fn last_logits(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        cache: Option<&Arc<Mutex<KvCache>>>,
    ) -> Result<Tensor>;

    /// Where the inputs go.
    fn input_device(&self) -> Device;

    /// Whether every process generating together is done, `mine` saying whether this one is
    /// (its forwards are collective: each runs until all are). One process: `mine`.
    fn all_done(&self, mine: bool) -> Result<bool> {
        Ok(mine)
    }
}

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
    let out = generate_rows(model, &prompts, &mask, cfg)?;
    let width = out.iter().map(Vec::len).max().unwrap_or(0);
    let pad = pad_id(cfg);
    let flat: Vec<u32> = out
        .into_iter()
        .flat_map(|mut r| {
            r.resize(width, pad);
            r
        })
        .collect();
    Ok(Tensor::from_vec(
        flat,
        (prompts.len(), width),
        &Device::Cpu,
    )?)
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
    let mut logits = model.last_logits(&ids, &pos, Some(&cache))?;
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
    let argmax_on_device = !cfg.do_sample && cfg.repetition_penalty == 1.0 && !device.is_cpu();
    for step in 0..cfg.max_new_tokens {
        let mut tokens = Vec::with_capacity(b);
        if argmax_on_device {
            let best = first_argmax(&logits)?;
            tokens.extend(best.iter().enumerate().map(|(r, &t)| match done[r] {
                true => pad,
                false => t,
            }));
        } else {
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
        let (ids, pos) = match cached {
            true => (
                Tensor::from_vec(tokens, (b, 1), &device)?,
                Tensor::from_vec(next_pos.clone(), (b, 1), &device)?,
            ),
            false => whole_rows(&out, &starts, &device)?,
        };
        let new = ids.dim(1)?;
        logits = match cached {
            true => model.last_logits(&ids, &pos, Some(&cache))?,
            false => model.last_logits(&ids, &pos, None)?,
        };
        if cached {
            cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .commit(new)?;
        }
        next_pos.iter_mut().for_each(|p| *p += 1);
    }
    Ok(out)
}

/// Each row's first index of its largest logit (torch's argmax, and `next_token`'s greedy
/// pick), computed where `logits` [batch, vocab] are: the maximum, the positions equal to it,
/// the smallest of those.
fn first_argmax(logits: &Tensor) -> Result<Vec<u32>> {
    let l = logits.to_dtype(DType::F32)?;
    let (b, vocab) = l.dims2()?;
    let hit = l.broadcast_eq(&l.max_keepdim(1)?)?;
    let index = Tensor::arange(0u32, vocab as u32, l.device())?.broadcast_as((b, vocab))?;
    let past = Tensor::full(vocab as u32, (b, vocab), l.device())?;
    let first = hit.where_cond(&index, &past)?.min(1)?;
    let first: Vec<u32> = first.to_vec1()?;
    // A row of NaNs matches nowhere: the CPU loop's pick (index 0) then.
    Ok(first
        .into_iter()
        .map(|t| if t as usize == vocab { 0 } else { t })
        .collect())
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
