//! Blockwise (flash-style) attention whose memory grows linearly with the sequence length.
//!
//! Forward: queries and keys are cut into blocks; for each query block the visible key blocks
//! are visited with the online softmax (running row maximum and sum), so only one block of
//! scores exists at a time. What is kept for backward is the output and the per-row
//! log-sum-exp, not the [seq x seq] probabilities. Backward recomputes each block's scores from
//! q, k and the log-sum-exp and accumulates dq, dk and dv block by block (FlashAttention-2's
//! algorithm). Key blocks that no query of a block may see (after it causally, or before the
//! start of every document in it) are skipped in both directions, and blocks every query sees
//! whole get no mask.
//!
//! The mask is the one [`super::attention`] uses: causal within the documents of packed rows.
//! Grouped-query heads share their key/value head without copying it.
//!
//! Precision: the matmuls run in the inputs' dtype (bf16 on tensor cores under mixed
//! precision); scores, the softmax, its running statistics and every accumulator are f32 (f64
//! for f64 inputs), as in FlashAttention's kernels. Results are cast back to the inputs' dtype.

use super::mask::AttentionMask;
use crate::kernels::precision::{self, accumulate};
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::{DType, Device, Result, Tensor, D};

/// Queries and keys per block on the CPU: large enough for efficient matmuls, small enough
/// that a block of scores ([batch, heads, BLOCK, BLOCK]) stays small.
pub const BLOCK: usize = 128;

/// The same on a GPU, where each block costs a dozen kernel launches: larger blocks keep the
/// launches few (3 block pairs per layer at 2048 tokens) while a block of scores stays far
/// below the whole matrix (1024 x 1024 per head).
pub const GPU_BLOCK: usize = 1024;

/// The block size for tensors on `device`.
pub fn block_for(device: &Device) -> usize {
    if device.is_cpu() {
        BLOCK
    } else {
        GPU_BLOCK
    }
}

/// The geometry of one call: batch, key/value heads, query heads per kv head, sequence
/// length, head size, and the block size.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    kv: usize,
    group: usize,
    s: usize,
    d: usize,
    block: usize,
}

impl Dims {
    fn blocks(&self) -> usize {
        self.s.div_ceil(self.block)
    }

    /// First index and length of block `i`.
    fn range(&self, i: usize) -> (usize, usize) {
        let start = i * self.block;
        (start, self.block.min(self.s - start))
    }
}

struct Inputs<'a> {
    /// Queries scaled by 1/sqrt(d), as [b, kv, group, s, d].
    q: Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    dims: Dims,
    mask: &'a AttentionMask,
    /// The dtype of scores, softmax and accumulators.
    wide: DType,
}

impl Inputs<'_> {
    /// Rows of block `i` of a [b, kv, group, s, x] tensor, as [b, kv, group * len, x].
    fn rows(&self, t: &Tensor, i: usize) -> Result<Tensor> {
        let (q0, qn) = self.dims.range(i);
        let x = t.dim(4)?;
        let Dims { b, kv, group, .. } = self.dims;
        t.narrow(3, q0, qn)?
            .contiguous()?
            .reshape((b, kv, group * qn, x))
    }

    /// The visible key blocks of query block `i`, the diagonal first.
    fn key_blocks(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        let q = self.dims.range(i);
        (0..=i)
            .rev()
            .take_while(move |&j| self.mask.block_visible(q, self.dims.range(j)))
    }

    /// Scores of query block `i` against key block `j`, soft-capped when the mask says, with
    /// the mask added, in the wide dtype: [b, kv, group, qn, kn].
    fn scores(&self, qi: &Tensor, i: usize, j: usize) -> Result<Tensor> {
        Ok(self.scores_and_cap_slope(qi, i, j, false)?.0)
    }

    /// [`Self::scores`] and, when capped and `slope` (the backward), d(capped)/d(score) =
    /// 1 - tanh^2.
    fn scores_and_cap_slope(
        &self,
        qi: &Tensor,
        i: usize,
        j: usize,
        slope: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let Dims { b, kv, group, .. } = self.dims;
        let (q, k) = (self.dims.range(i), self.dims.range(j));
        let kj = self.k.narrow(2, k.0, k.1)?;
        let scores = qi
            .matmul(&kj.t()?)?
            .reshape((b, kv, group, q.1, k.1))?
            .to_dtype(self.wide)?;
        let (scores, slope) = super::mask::soft_cap(scores, self.mask.mods.softcap, slope)?;
        let scores = match self.mask.block_bias(q, k)? {
            Some(bias) => scores.broadcast_add(&bias.to_dtype(self.wide)?)?,
            None => scores,
        };
        Ok((scores, slope))
    }

    /// Output [b, heads, s, d] (the inputs' dtype) and per-row log-sum-exp [b, kv, group, s, 1]
    /// (wide).
    fn forward(&self) -> Result<(Tensor, Tensor)> {
        let Dims {
            b, kv, group, s, d, ..
        } = self.dims;
        let io = self.v.dtype();
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        for i in 0..self.dims.blocks() {
            let qn = self.dims.range(i).1;
            let qi = self.rows(&self.q, i)?;
            let mut acc: Option<(Tensor, Tensor, Tensor)> = None; // (max, sum, weighted v)
            for j in self.key_blocks(i) {
                let (k0, kn) = self.dims.range(j);
                let scores = self.scores(&qi, i, j)?;
                let block_max = scores.max_keepdim(D::Minus1)?;
                let max = match &acc {
                    Some((m, _, _)) => m.maximum(&block_max)?,
                    None => block_max,
                };
                let p = scores.broadcast_sub(&max)?.exp()?;
                let pv = p
                    .to_dtype(io)?
                    .reshape((b, kv, group * qn, kn))?
                    .matmul(&self.v.narrow(2, k0, kn)?)?
                    .reshape((b, kv, group, qn, d))?
                    .to_dtype(self.wide)?;
                let sum = p.sum_keepdim(D::Minus1)?;
                acc = Some(match acc {
                    None => (max, sum, pv),
                    Some((m, l, o)) => {
                        let correction = (m - &max)?.exp()?;
                        let l = ((l * &correction)? + sum)?;
                        let o = (o.broadcast_mul(&correction)? + pv)?;
                        (max, l, o)
                    }
                });
            }
            let (m, l, o) = acc.expect("the diagonal block is always visible");
            outs.push(o.broadcast_div(&l)?.to_dtype(io)?);
            lses.push((m + l.log()?)?);
        }
        let out = Tensor::cat(&outs, 3)?.reshape((b, kv * group, s, d))?;
        Ok((out, Tensor::cat(&lses, 3)?))
    }

    /// dq, dk, dv from the output's gradient `dout`, the output and the log-sum-exp.
    fn backward(&self, out: &Tensor, lse: &Tensor, dout: &Tensor) -> Result<[Tensor; 3]> {
        let Dims {
            b, kv, group, s, d, ..
        } = self.dims;
        let (io, wide) = (self.v.dtype(), self.wide);
        let five = (b, kv, group, s, d);
        let dout = dout.to_dtype(io)?.reshape(five)?;
        // D_i = <dO_i, O_i>, the softmax backward's row term.
        let dsum =
            (dout.to_dtype(wide)? * out.reshape(five)?.to_dtype(wide)?)?.sum_keepdim(D::Minus1)?;
        let blocks = self.dims.blocks();
        let (mut dks, mut dvs): (Vec<Option<Tensor>>, Vec<Option<Tensor>>) =
            (vec![None; blocks], vec![None; blocks]);
        let mut dqs = Vec::with_capacity(blocks);
        for i in 0..blocks {
            let qn = self.dims.range(i).1;
            let qi = self.rows(&self.q, i)?;
            let doi = self.rows(&dout, i)?;
            let lse_i = lse.narrow(3, self.dims.range(i).0, qn)?;
            let dsum_i = dsum.narrow(3, self.dims.range(i).0, qn)?;
            let mut dqi: Option<Tensor> = None;
            for j in self.key_blocks(i) {
                let (k0, kn) = self.dims.range(j);
                let (kj, vj) = (self.k.narrow(2, k0, kn)?, self.v.narrow(2, k0, kn)?);
                let (scores, slope) = self.scores_and_cap_slope(&qi, i, j, true)?;
                let p5 = scores.broadcast_sub(&lse_i)?.exp()?;
                let p = p5.to_dtype(io)?.reshape((b, kv, group * qn, kn))?;
                accumulate(&mut dvs[j], p.t()?.matmul(&doi)?, wide)?;
                let dp = doi
                    .matmul(&vj.t()?)?
                    .reshape((b, kv, group, qn, kn))?
                    .to_dtype(wide)?;
                let ds = (p5 * dp.broadcast_sub(&dsum_i)?)?;
                // Through the cap: the scores' gradient times its slope.
                let ds = match slope {
                    Some(slope) => (ds * slope)?,
                    None => ds,
                };
                let ds = ds.to_dtype(io)?.reshape((b, kv, group * qn, kn))?;
                accumulate(&mut dqi, ds.matmul(&kj)?, wide)?;
                accumulate(&mut dks[j], ds.t()?.matmul(&qi)?, wide)?;
            }
            dqs.push(
                dqi.expect("the diagonal block is always visible")
                    .reshape((b, kv, group, qn, d))?,
            );
        }
        let scale = 1.0 / (d as f64).sqrt();
        let dq = (Tensor::cat(&dqs, 3)?.reshape((b, kv * group, s, d))? * scale)?;
        let whole = |parts: Vec<Option<Tensor>>| -> Result<Tensor> {
            let parts = parts
                .into_iter()
                .enumerate()
                .map(|(j, p)| match p {
                    Some(p) => Ok(p),
                    None => Tensor::zeros((b, kv, self.dims.range(j).1, d), wide, out.device()),
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 2)?.to_dtype(io)
        };
        Ok([dq.to_dtype(io)?, whole(dks)?, whole(dvs)?])
    }
}

/// What the blockwise backward needs besides q, k, v: the mask (its block masks cached from
/// the forward), the geometry and the forward's log-sum-exp.
struct FlashBackward {
    mask: AttentionMask,
    dims: Dims,
    lse: Tensor,
}

impl Backward3 for FlashBackward {
    const NAME: &'static str = "flash attention";

    fn backward(&self, saved: &Saved3) -> Result<[Option<Tensor>; 3]> {
        let [q, k, v] = &saved.inputs;
        let inputs = prepare(q, k, v, self.dims, &self.mask)?;
        Ok(inputs
            .backward(&saved.out, &self.lse, &saved.dout)?
            .map(Some))
    }
}

fn prepare<'a>(
    q: &Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    dims: Dims,
    mask: &'a AttentionMask,
) -> Result<Inputs<'a>> {
    let Dims {
        b, kv, group, s, d, ..
    } = dims;
    let q = (q.detach() * (1.0 / (d as f64).sqrt()))?.reshape((b, kv, group, s, d))?;
    Ok(Inputs {
        q,
        k,
        v,
        dims,
        mask,
        wide: precision::wide(v.dtype()),
    })
}

/// Attention of `q` [batch, heads, seq, head_dim] over `k`, `v` [batch, kv_heads, seq,
/// head_dim] under `mask`, computed in blocks of `block` queries and keys: the same result as
/// [`super::attention`] without ever holding a [seq x seq] matrix.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    block: usize,
) -> Result<Tensor> {
    let (b, heads, s, d) = q.dims4()?;
    let (_, kv, k_len, _) = k.dims4()?;
    if heads % kv != 0 || k_len != s {
        candle_core::bail!(
            "flash attention: {heads} query heads over {kv} key/value heads of length {k_len} \
             (queries of length {s}): heads must share kv heads evenly and lengths must match"
        );
    }
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        candle_core::bail!(
            "flash attention: q, k and v differ in dtype ({:?}, {:?}, {:?})",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    let dims = Dims {
        b,
        kv,
        group: heads / kv,
        s,
        d,
        block: block.max(1),
    };
    let (k_in, v_in) = (k.detach().contiguous()?, v.detach().contiguous()?);
    let forward = prepare(q, &k_in, &v_in, dims, mask)?.forward()?;
    let mask_of = || mask.clone();
    crate::kernels::sinks::attend_with(forward, mask.mods.sinks.as_ref(), |out, lse| {
        with_backward3(
            q,
            k,
            v,
            out,
            FlashBackward {
                mask: mask_of(),
                dims,
                lse,
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{
        assert_out_and_grads, bf16_exact_randn as randn, max_abs_diff as max_diff, rel_diff,
    };
    use crate::nn::attention;
    use crate::nn::WithScoreMods;
    use candle_core::{Device, Var};

    /// Values and gradients equal the plain attention's on packed rows (documents that start
    /// inside blocks, a document spanning blocks), with grouped heads and a ragged last block.
    #[test]
    fn matches_plain_attention_values_and_gradients() {
        let dev = Device::Cpu;
        let s = 23;
        // Document lengths per row.
        let docs: [&[i64]; 3] = [&[9, 14], &[23], &[3, 5, 15]];
        let pos: Vec<i64> = docs
            .iter()
            .flat_map(|row| row.iter().flat_map(|&n| 0..n))
            .collect();
        let pos = Tensor::from_vec(pos, (3, s), &dev).unwrap();
        let mask = AttentionMask::causal(&pos, DType::F32, &dev).unwrap();
        let q = Var::randn(0f32, 1.0, (3, 4, s, 8), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (3, 2, s, 8), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (3, 2, s, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (3, 4, s, 8), &dev).unwrap();
        let run = |f: &dyn Fn() -> Tensor| {
            let out = f();
            crate::kernels::testing::out_and_grads(out, &w, [&q, &k, &v])
        };
        let want = run(&|| attention(&q, &k, &v, &mask).unwrap());
        for block in [4, 5, 23, 64] {
            let got = run(&|| flash_attention(&q, &k, &v, &mask, block).unwrap());
            assert_out_and_grads(&got, &want, 1e-5, &format!("block {block}"));
        }
    }

    /// Soft-capped scores (Gemma 2's `attn_logit_softcapping`), in the fused CPU kernel,
    /// blockwise and through the whole matrix, equal the definition written out (cap * tanh(q k^T / sqrt(d) / cap),
    /// masked, softmax, times v), values and gradients, in a sliding window on packed rows
    /// with grouped heads; and the cap changes the result.
    #[test]
    fn soft_capped_scores_follow_their_definition() {
        let dev = Device::Cpu;
        let (s, d, cap) = (19usize, 8usize, 2.0f64);
        let docs: [&[i64]; 2] = [&[7, 12], &[19]];
        let pos: Vec<i64> = docs
            .iter()
            .flat_map(|row| row.iter().flat_map(|&n| 0..n))
            .collect();
        let pos = Tensor::from_vec(pos, (2, s), &dev).unwrap();
        let plain =
            AttentionMask::windowed(&pos, Some(crate::nn::Window::Sliding(5)), DType::F32, &dev)
                .unwrap();
        let mask = plain.clone().with_softcap(Some(cap));
        // Large scores, so the cap bites.
        let q = Var::randn(0f32, 3.0, (2, 4, s, d), &dev).unwrap();
        let k = Var::randn(0f32, 3.0, (2, 2, s, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (2, 2, s, d), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (2, 4, s, d), &dev).unwrap();
        let run =
            |f: &dyn Fn() -> Tensor| crate::kernels::testing::out_and_grads(f(), &w, [&q, &k, &v]);
        let definition = || {
            let kk = k.as_tensor().repeat((1, 2, 1, 1)).unwrap();
            let vv = v.as_tensor().repeat((1, 2, 1, 1)).unwrap();
            // Heads 0, 1 read kv head 0; 2, 3 kv head 1: repeat interleaves them.
            let order = Tensor::new(&[0u32, 2, 1, 3], &dev).unwrap();
            let (kk, vv) = (
                kk.index_select(&order, 1).unwrap(),
                vv.index_select(&order, 1).unwrap(),
            );
            let scores =
                (q.as_tensor().matmul(&kk.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
            let capped = ((scores / cap).unwrap().tanh().unwrap() * cap).unwrap();
            let bias = plain.block_bias((0, s), (0, s)).unwrap().unwrap();
            let bias = bias.reshape((2, 1, s, s)).unwrap();
            let masked = capped.broadcast_add(&bias).unwrap();
            let p = candle_nn::ops::softmax(&masked, candle_core::D::Minus1).unwrap();
            p.matmul(&vv).unwrap()
        };
        let want = run(&definition);
        let (uncapped, _) = run(&|| attention(&q, &k, &v, &plain).unwrap());
        assert!(
            max_diff(&uncapped, &want.0) > 1e-2,
            "the cap changes nothing here"
        );
        // On the CPU in f32 `attention` runs the fused kernel.
        let fused = || attention(&q, &k, &v, &mask).unwrap();
        let whole = || crate::nn::attention::whole_matrix_attention(&q, &k, &v, &mask).unwrap();
        for (name, f) in [
            ("fused", &fused as &dyn Fn() -> Tensor),
            ("whole", &whole),
            ("block 4", &|| {
                flash_attention(&q, &k, &v, &mask, 4).unwrap()
            }),
            ("block 19", &|| {
                flash_attention(&q, &k, &v, &mask, 19).unwrap()
            }),
        ] {
            assert_out_and_grads(&run(f), &want, 1e-5, name);
        }
    }

    #[test]
    fn masked_key_blocks_are_skipped() {
        // Two documents of 8 in a row of 16, blocks of 4: the second document's query blocks
        // never visit the first document's key blocks.
        let pos: Vec<i64> = (0..8).chain(0..8).collect();
        let pos = Tensor::from_vec(pos, (1, 16), &Device::Cpu).unwrap();
        let mask = AttentionMask::causal(&pos, DType::F32, &Device::Cpu).unwrap();
        let dims = Dims {
            b: 1,
            kv: 1,
            group: 1,
            s: 16,
            d: 1,
            block: 4,
        };
        let q = Tensor::zeros((1, 1, 1, 16, 1), DType::F32, &Device::Cpu).unwrap();
        let k = Tensor::zeros((1, 1, 16, 1), DType::F32, &Device::Cpu).unwrap();
        let inputs = Inputs {
            q,
            k: &k,
            v: &k,
            dims,
            mask: &mask,
            wide: DType::F32,
        };
        let visited: Vec<Vec<usize>> = (0..4).map(|i| inputs.key_blocks(i).collect()).collect();
        assert_eq!(visited, vec![vec![0], vec![1, 0], vec![2], vec![3, 2]]);
        // Key block 0 is wholly before query block 1 and inside its one document: no mask.
        // Diagonal blocks are causal; key block 2 seen from block 3 is open again.
        let masked =
            |q: usize, k: usize| mask.block_bias((4 * q, 4), (4 * k, 4)).unwrap().is_some();
        assert!(!masked(1, 0) && !masked(3, 2));
        assert!((0..4).all(|i| masked(i, i)));
        // Built once: every later layer (and the backward) gets the same tensor.
        let diagonal = || mask.block_bias((4, 4), (4, 4)).unwrap().unwrap();
        assert_eq!(diagonal().id(), diagonal().id());
    }

    /// In bf16 (the matmuls in bf16, softmax and accumulators in f32) the values and gradients
    /// follow the f32 plain attention of the same (bf16-rounded) inputs within a few bf16
    /// roundings, with and without masks on the blocks.
    #[test]
    fn bf16_follows_f32_within_bf16_resolution() {
        let dev = Device::Cpu;
        let s = 96;
        let pos: Vec<i64> = (0..2).flat_map(|_| (0..40).chain(0..56)).collect();
        let pos = Tensor::from_vec(pos, (2, s), &dev).unwrap();
        let mask = AttentionMask::causal(&pos, DType::F32, &dev).unwrap();
        let var = |heads, seed| Var::from_tensor(&randn((2, heads, s, 16), 1.0, seed)).unwrap();
        let (q, k, v) = (var(4, 1), var(2, 2), var(2, 3));
        let w = randn((2, 4, s, 16), 1.0, 4);
        let grads_of = |out: &Tensor| {
            let loss = (out.to_dtype(DType::F32).unwrap() * &w)
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            // Gradients reach the f32 variables through the casts.
            [&q, &k, &v].map(|t| grads.get(t).unwrap().clone())
        };
        let want = attention(&q, &k, &v, &mask).unwrap();
        let want_grads = grads_of(&want);
        let low = [&q, &k, &v].map(|t| t.to_dtype(DType::BF16).unwrap());
        for block in [16, 40, 96] {
            let got = flash_attention(&low[0], &low[1], &low[2], &mask, block).unwrap();
            assert_eq!(got.dtype(), DType::BF16);
            let grads = grads_of(&got);
            let got = got.to_dtype(DType::F32).unwrap();
            let outputs = std::iter::once(("output", &got, &want));
            let gradients = ["dq", "dk", "dv"]
                .into_iter()
                .zip(grads.iter().zip(&want_grads));
            for (name, g, w) in outputs.chain(gradients.map(|(n, (g, w))| (n, g, w))) {
                let d = rel_diff(g, w);
                eprintln!("block {block}: {name} differs by {d:e} of its largest");
                assert!(
                    d < 1e-2,
                    "block {block}: {name} differs by {d:e} of its largest"
                );
            }
        }
    }
}
