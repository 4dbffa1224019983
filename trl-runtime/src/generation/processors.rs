//! transformers' logits processors for generation, applied to one row's next-token logits in
//! the order `generate` builds them (`GenerationMixin._get_logits_processor`): the repetition
//! penalty; then, when sampling, temperature, top-k, top-p and min-p, each keeping at least
//! one token. A removed token's logit becomes -inf, as transformers' `filter_value`.

use super::GenerationConfig;
use rand::{Rng, SeedableRng};

/// Processes `logits` (one row's, over the vocabulary) for `cfg` in place; `history` is the
/// row's tokens so far, prompt included (and its left padding: transformers penalizes what
/// `input_ids` holds).
pub fn process(cfg: &GenerationConfig, history: &[u32], logits: &mut [f32]) {
    if cfg.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        let p = cfg.repetition_penalty as f32;
        for &t in history {
            let t = t as usize;
            if t < logits.len() && !std::mem::replace(&mut seen[t], true) {
                let s = logits[t];
                logits[t] = if s < 0.0 { s * p } else { s / p };
            }
        }
    }
    if !cfg.do_sample {
        return;
    }
    if cfg.temperature != 1.0 {
        let t = cfg.temperature as f32;
        logits.iter_mut().for_each(|x| *x /= t);
    }
    if cfg.top_k != 0 && cfg.top_k < logits.len() {
        let mut values: Vec<f32> = logits.to_vec();
        let (_, &mut kth, _) = values.select_nth_unstable_by(cfg.top_k - 1, |a, b| b.total_cmp(a));
        logits
            .iter_mut()
            .filter(|x| **x < kth)
            .for_each(|x| *x = f32::NEG_INFINITY);
    }
    if cfg.top_p < 1.0 {
        // Ascending, as transformers sorts: drop the tokens whose cumulative probability stays
        // within 1 - top_p, but the most likely.
        let probs = softmax(logits);
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
        let mut cumulative = 0f32;
        let last = order.len() - 1;
        for (rank, &i) in order.iter().enumerate() {
            cumulative += probs[i];
            if cumulative <= (1.0 - cfg.top_p as f32) && rank != last {
                logits[i] = f32::NEG_INFINITY;
            }
        }
    }
    if let Some(min_p) = cfg.min_p {
        let probs = softmax(logits);
        let (top, _) =
            probs.iter().enumerate().fold(
                (0, f32::MIN),
                |(bi, bp), (i, &p)| if p > bp { (i, p) } else { (bi, bp) },
            );
        let threshold = min_p as f32 * probs[top];
        for (i, p) in probs.iter().enumerate() {
            if *p < threshold && i != top {
                logits[i] = f32::NEG_INFINITY;
            }
        }
    }
}

/// The probabilities of `logits` (-inf: 0).
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|x| (x - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

/// Draws tokens: seeded, so that the same seed draws the same tokens.
pub struct Sampler {
    rng: rand::rngs::StdRng,
}

impl Sampler {
    pub fn new(seed: u64) -> Self {
        Sampler {
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }

    /// A token drawn with probability `probs[token]`.
    pub fn draw(&mut self, probs: &[f32]) -> u32 {
        let u: f32 = self.rng.random::<f32>() * probs.iter().sum::<f32>();
        let mut acc = 0f32;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if u < acc {
                return i as u32;
            }
        }
        // Rounding at the top end: the last token that can be drawn.
        probs.iter().rposition(|p| *p > 0.0).unwrap_or(0) as u32
    }
}

/// A row's next token for `cfg`: its logits processed, then the most likely one (the first of
/// equals, as torch's argmax) or, when sampling, a draw.
pub fn next_token(
    cfg: &GenerationConfig,
    history: &[u32],
    logits: &mut [f32],
    sampler: &mut Sampler,
) -> u32 {
    process(cfg, history, logits);
    if cfg.do_sample {
        return sampler.draw(&softmax(logits));
    }
    let mut best = 0;
    for (i, x) in logits.iter().enumerate() {
        if *x > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling() -> GenerationConfig {
        GenerationConfig {
            do_sample: true,
            top_k: 0,
            ..GenerationConfig::default()
        }
    }

    #[test]
    fn each_processor_keeps_what_transformers_keeps() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, 3.0];
        let kept = |cfg: &GenerationConfig, history: &[u32]| {
            let mut l = logits;
            process(cfg, history, &mut l);
            l
        };
        // Repetition penalty, greedy too: positive logits divided, negative multiplied.
        let rep = GenerationConfig {
            repetition_penalty: 2.0,
            ..GenerationConfig::default()
        };
        assert_eq!(kept(&rep, &[0, 3, 0]), [1.0, 1.0, 0.5, -2.0, 3.0]);
        // Top-k 2: the two largest.
        let k = GenerationConfig {
            top_k: 2,
            ..sampling()
        };
        let l = kept(&k, &[]);
        assert!(l[0] == 2.0 && l[4] == 3.0 && l[1].is_infinite() && l[3].is_infinite());
        // Top-p: the fewest most likely tokens reaching it (at least one).
        let p = GenerationConfig {
            top_p: 0.5,
            ..sampling()
        };
        let l = kept(&p, &[]);
        assert!(
            l[4] == 3.0 && l[..4].iter().all(|x| x.is_infinite()),
            "{l:?}"
        );
        let tiny = GenerationConfig {
            top_p: 0.0,
            ..sampling()
        };
        assert_eq!(kept(&tiny, &[]).iter().filter(|x| x.is_finite()).count(), 1);
        // Min-p 0.3: tokens at least 0.3 of the most likely one's probability.
        let m = GenerationConfig {
            min_p: Some(0.3),
            ..sampling()
        };
        let l = kept(&m, &[]);
        assert!(l[4].is_finite() && l[0].is_finite() && l[1].is_infinite());
    }

    #[test]
    fn a_seed_draws_the_same_tokens() {
        let probs = softmax(&[0.0, 1.0, 2.0, 0.5]);
        let draws = |seed| {
            let mut s = Sampler::new(seed);
            (0..50).map(|_| s.draw(&probs)).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
    }
}
