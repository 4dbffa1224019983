//! Attention of a few new queries against a KV cache (generation's decode step), fused on the
//! CPU: per (batch row, key/value head), the scores of every query head of the group against
//! the visible keys, read once in place from the cache buffer, their softmax, and the
//! weighted sum of the values, read once. No [heads x keys] matrix per head, no copy of the
//! cache, no autograd (generation computes no gradients).
//!
//! [`attention_reference`] is the same computation in Candle ops, for other devices and
//! dtypes (and the reference the kernel is tested against). The CUDA kernel splits the key
//! length over blocks (flash-decoding, `kernels/cuda_decode.rs`); [`split_combine`] is its
//! algorithm on the CPU, tested here.

use super::cpu_flash::{exp_visible, KeySpans};
use super::fused::row_max_f32;
use super::op::inplace_op;
use super::simd::simd_dispatch;
use candle_core::{CpuStorage, DType, Result, Tensor, D};
use rayon::prelude::*;

/// Whether the CPU kernel takes these: f32 on the CPU, q [b, heads, sq, d], the cache
/// buffers [b, kv_heads, capacity, d].
pub fn applies(q: &Tensor, cache: &Tensor) -> bool {
    q.device().is_cpu() && q.dtype() == DType::F32 && cache.dtype() == DType::F32
}

/// The f32 data of a contiguous CPU tensor's storage.
fn slice<'a>(s: &'a candle_core::Storage, l: &candle_core::Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (candle_core::Storage::Cpu(CpuStorage::F32(x)), Some((a, e))) => Ok(&x[a..e]),
        _ => candle_core::bail!("decode attention: contiguous f32 CPU tensors expected"),
    }
}

/// The shapes of one call.
#[derive(Clone, Copy)]
struct Dims {
    heads: usize,
    kv_heads: usize,
    sq: usize,
    cap: usize,
    d: usize,
}

/// Attention of `q` [b, heads, sq, d] over the first `keys` keys of the cache buffers `k`, `v`
/// [b, kv_heads, capacity, d] (contiguous), each (batch row, query) seeing the keys its span
/// says (`spans.lo()..spans.hi()`, indices into the cache; the soft-cap is theirs). Returns the
/// output [b, heads, sq, d] and the log-sum-exp [b, heads, sq] (minus infinity where a query
/// sees nothing, its output zero), which attention sinks fold into (`super::sinks::fold`).
pub fn attention(
    q: &Tensor,
    (k, v): (&Tensor, &Tensor),
    keys: usize,
    spans: &KeySpans,
) -> Result<(Tensor, Tensor)> {
    let (b, heads, sq, d) = q.dims4()?;
    let (kb, kv_heads, cap, kd) = k.dims4()?;
    if kb != b || kd != d || heads % kv_heads != 0 || keys > cap || spans.len() != b * sq {
        candle_core::bail!(
            "decode attention: q {:?}, cache {:?} ({keys} keys) and {} spans do not match",
            q.dims(),
            k.dims(),
            spans.len()
        );
    }
    spans.check_within(keys)?;
    let dims = Dims {
        heads,
        kv_heads,
        sq,
        cap,
        d,
    };
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (out, lse) = run(
        dims,
        (slice(&qs, ql)?, slice(&ks, kl)?, slice(&vs, vl)?),
        spans,
    );
    drop((qs, ks, vs));
    let dev = q.device();
    Ok((
        Tensor::from_vec(out, (b, heads, sq, d), dev)?,
        Tensor::from_vec(lse, (b, heads, sq), dev)?,
    ))
}

fn run(dims: Dims, (q, k, v): (&[f32], &[f32], &[f32]), spans: &KeySpans) -> (Vec<f32>, Vec<f32>) {
    let Dims { sq, cap, d, .. } = dims;
    let g = dims.heads / dims.kv_heads;
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![f32::NEG_INFINITY; q.len() / d];
    out.par_chunks_mut(g * sq * d)
        .zip(lse.par_chunks_mut(g * sq))
        .enumerate()
        .for_each(|(t, (o, l))| {
            let bi = t / dims.kv_heads;
            let span = bi * sq..(bi + 1) * sq;
            let task = Task {
                g,
                sq,
                d,
                lo: &spans.lo()[span.clone()],
                hi: &spans.hi()[span],
                cap: spans.softcap,
            };
            let kv = t * cap * d..(t + 1) * cap * d;
            let qs = &q[t * g * sq * d..(t + 1) * g * sq * d];
            group(task, (qs, &k[kv.clone()], &v[kv]), (o, l));
        });
    (out, lse)
}

/// One (batch row, key/value head): its `g` query heads of `sq` queries, the spans of those
/// queries, the soft-cap.
#[derive(Clone, Copy)]
struct Task<'a> {
    g: usize,
    sq: usize,
    d: usize,
    lo: &'a [u32],
    hi: &'a [u32],
    cap: Option<f32>,
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out[j] = q . keys[j] * scale` for each key row of `keys` (`out.len()` rows of `q.len()`).
/// With AVX-512, sixteen keys at a time, their sixteen dots summed in one transposing tree
/// (a dot's own sum of lanes cost more than its multiply-adds at head dim 64); a last partial
/// block is the sixteen keys ending at the last one.
#[inline(always)]
fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    let (d, n) = (q.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if n >= 16 && std::is_x86_feature_detected!("avx512f") {
        let mut j = 0;
        while j < n {
            let at = j.min(n - 16);
            let mut block = [0f32; 16];
            // SAFETY: the CPU has AVX-512F (checked above); keys at..at + 16 are in `keys`.
            unsafe { scores16(q, &keys[at * d..(at + 16) * d], scale, &mut block) };
            out[j..at + 16].copy_from_slice(&block[j - at..]);
            j = at + 16;
        }
        return;
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot(q, &keys[j * d..(j + 1) * d]) * scale;
    }
}

/// [`scores`] of sixteen keys.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores16(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32; 16]) {
    use std::arch::x86_64::*;
    let d = q.len();
    let mut acc = [_mm512_setzero_ps(); 16];
    let mut c = 0;
    while c < d {
        let mask: __mmask16 = if d - c >= 16 {
            0xffff
        } else {
            (1 << (d - c)) - 1
        };
        let qv = _mm512_maskz_loadu_ps(mask, q.as_ptr().add(c));
        for (kk, a) in acc.iter_mut().enumerate() {
            let kv = _mm512_maskz_loadu_ps(mask, keys.as_ptr().add(kk * d + c));
            *a = _mm512_fmadd_ps(qv, kv, *a);
        }
        c += 16;
    }
    let sums = super::simd::x86::reduce16(&acc);
    _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
}

#[inline(always)]
fn group_body(t: Task, (q, k, v): (&[f32], &[f32], &[f32]), (out, lse): (&mut [f32], &mut [f32])) {
    let Task { g, sq, d, .. } = t;
    let first =
        t.lo.iter()
            .zip(t.hi)
            .filter(|(l, h)| l < h)
            .map(|(l, _)| *l as usize)
            .min();
    let end = t.hi.iter().copied().max().unwrap_or(0) as usize;
    let Some(first) = first else {
        return;
    };
    let n = end - first;
    let scale = 1.0 / (d as f32).sqrt();
    // Scores of every (query head, query) row against keys first..end, a row per query row
    // (the keys a row does not see weigh zero after the softmax).
    let rows = g * sq;
    let mut s = vec![0f32; rows * n];
    let keys = &k[first * d..end * d];
    for (r, row) in s.chunks_exact_mut(n).enumerate() {
        scores(&q[r * d..(r + 1) * d], keys, scale, row);
    }
    // Per row: soft-cap, max, exp, sum over its visible keys (the rest weigh zero), in loops
    // that vectorize.
    for r in 0..rows {
        let qi = r % sq;
        let (a, b) = (t.lo[qi] as usize, t.hi[qi] as usize);
        if a >= b {
            continue;
        }
        let row = &mut s[r * n..(r + 1) * n];
        let vis = a - first..b - first;
        if let Some(cap) = t.cap {
            row[vis.clone()]
                .iter_mut()
                .for_each(|x| *x = cap * (*x / cap).tanh());
        }
        let m = row_max_f32(&row[vis.clone()]);
        let sum = exp_visible(row, vis.clone(), m);
        row[vis].iter_mut().for_each(|x| *x /= sum);
        lse[r] = m + sum.ln();
    }
    // The values weighed into each row, 64 features at a time (the values stay in L1 between
    // rows), over each row's visible keys only: a key it does not see weighs nothing, and is not
    // multiplied in (a zero weight times a value that is not finite would not be zero).
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        let qi = r % sq;
        let (a, b) = (t.lo[qi] as usize, t.hi[qi] as usize);
        if a >= b {
            continue;
        }
        let p = &s[r * n + a - first..r * n + b - first];
        let values = &v[a * d..b * d];
        let mut c = 0;
        while c + 64 <= d {
            weigh::<64>(p, values, (d, c), o);
            c += 64;
        }
        while c + 16 <= d {
            weigh::<16>(p, values, (d, c), o);
            c += 16;
        }
        while c < d {
            weigh::<1>(p, values, (d, c), o);
            c += 1;
        }
    }
}

/// `o[c..c + W]` = the sum of each weight in `p` times its value row's features `c..c + W`
/// (value rows `d` long). A fixed width, so the sums stay in registers (summed into `o` in
/// memory the loop was load- and store-bound).
#[inline(always)]
fn weigh<const W: usize>(p: &[f32], values: &[f32], (d, c): (usize, usize), o: &mut [f32]) {
    let mut acc = [0f32; W];
    for (j, &pj) in p.iter().enumerate() {
        for (a, x) in acc.iter_mut().zip(&values[j * d + c..][..W]) {
            *a += pj * x;
        }
    }
    o[c..c + W].copy_from_slice(&acc);
}

simd_dispatch!(group, group_avx2, group_body, (t: Task, qkv: (&[f32], &[f32], &[f32]), ol: (&mut [f32], &mut [f32])));

/// [`attention`] in Candle ops, any device and dtype (computed in f32): the scores of each
/// group's query heads against the cache, masked outside the spans, soft-capped.
pub fn attention_reference(
    q: &Tensor,
    (k, v): (&Tensor, &Tensor),
    keys: usize,
    spans: &KeySpans,
) -> Result<(Tensor, Tensor)> {
    let (b, heads, sq, d) = q.dims4()?;
    let kv_heads = k.dim(1)?;
    let g = heads / kv_heads;
    let dev = q.device();
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let k = f(&k.narrow(2, 0, keys)?)?.contiguous()?;
    let v = f(&v.narrow(2, 0, keys)?)?.contiguous()?;
    let q = f(&q.reshape((b, kv_heads, g * sq, d))?)?;
    let mut s = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
    if let Some(cap) = spans.softcap {
        s = ((s / cap as f64)?.tanh()? * cap as f64)?;
    }
    let mut mask = vec![-1e30f32; b * sq * keys];
    for (i, (lo, hi)) in spans.lo().iter().zip(spans.hi()).enumerate() {
        mask[i * keys + *lo as usize..i * keys + (*hi as usize).max(*lo as usize)].fill(0.0);
    }
    let visible = Tensor::from_vec(mask, (b, 1, 1, sq, keys), dev)?;
    let s = s
        .reshape((b, kv_heads, g, sq, keys))?
        .broadcast_add(&visible)?;
    let m = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let p = e
        .broadcast_div(&sum)?
        .reshape((b, kv_heads, g * sq, keys))?;
    let out = p.matmul(&v)?.reshape((b, heads, sq, d))?;
    let lse = (m + sum.log()?)?.reshape((b, heads, sq))?;
    // A query that sees nothing: zero output, log-sum-exp minus infinity (as the kernel).
    let blind = Tensor::from_vec(
        (0..b * sq)
            .map(|i| u8::from(spans.lo()[i] >= spans.hi()[i]))
            .collect::<Vec<_>>(),
        (b, 1, sq),
        dev,
    )?
    .broadcast_as((b, heads, sq))?;
    let lse = blind.where_cond(&Tensor::full(f32::NEG_INFINITY, lse.shape(), dev)?, &lse)?;
    let out = blind
        .unsqueeze(3)?
        .broadcast_as(out.shape())?
        .where_cond(&out.zeros_like()?, &out)?;
    Ok((out, lse))
}

/// Writes `fresh` [b, kv_heads, sq, d] into the cache buffer `cache` [b, kv_heads,
/// capacity, d] after the tokens it holds, their count read from `held` (u32, its first
/// element) where it lives: on a GPU the kernel reads it on the device, so that a captured
/// CUDA graph appends each step's keys where the length written before that launch says
/// (`nn::KvCache::fix_steps`). Keys past the capacity are dropped (the cache checks room).
pub fn append_at(cache: &Tensor, fresh: &Tensor, held: &Tensor) -> Result<()> {
    let (b, h, _, d) = cache.dims4()?;
    let (fb, fh, _, fd) = fresh.dims4()?;
    if (b, h, d) != (fb, fh, fd) || cache.dtype() != fresh.dtype() || held.dtype() != DType::U32 {
        candle_core::bail!(
            "KV cache append: new {:?} {:?} into {:?} {:?} (length {:?})",
            fresh.dims(),
            fresh.dtype(),
            cache.dims(),
            cache.dtype(),
            held.dtype()
        );
    }
    cache.inplace_op3(&fresh.contiguous()?, held, &Append)
}

struct Append;

fn append_rows<T: Copy>(
    cache: &mut [T],
    fresh: &[T],
    at: usize,
    (cap, sq, d): (usize, usize, usize),
) {
    for (r, rows) in fresh.chunks(sq * d).enumerate() {
        for (t, row) in rows.chunks(d).enumerate().filter(|(t, _)| at + t < cap) {
            let to = (r * cap + at + t) * d;
            cache[to..to + d].copy_from_slice(row);
        }
    }
}

inplace_op!(Append: InplaceOp3 [this] {
    name: "kv-append",
    cpu(cs, cl, fs, fl, hs, hl) {
        let (Some((c0, c1)), Some((f0, f1)), Some((h0, _))) =
            (cl.contiguous_offsets(), fl.contiguous_offsets(), hl.contiguous_offsets())
        else {
            candle_core::bail!("KV cache append: contiguous tensors expected")
        };
        let (_, _, cap, d) = cl.shape().dims4()?;
        let sq = fl.shape().dims4()?.2;
        let at = match hs {
            CpuStorage::U32(h) => h[h0] as usize,
            _ => candle_core::bail!("KV cache append: the length must be u32"),
        };
        let shape = (cap, sq, d);
        match (cs, fs) {
            (CpuStorage::F32(c), CpuStorage::F32(f)) => append_rows(&mut c[c0..c1], &f[f0..f1], at, shape),
            (CpuStorage::BF16(c), CpuStorage::BF16(f)) => append_rows(&mut c[c0..c1], &f[f0..f1], at, shape),
            (CpuStorage::F16(c), CpuStorage::F16(f)) => append_rows(&mut c[c0..c1], &f[f0..f1], at, shape),
            _ => candle_core::bail!("KV cache append: f32, bf16 or f16 expected"),
        }
        Ok(())
    }
    cuda(cs, cl, fs, fl, hs, hl) {
        super::cuda_decode::append((cs, cl), (fs, fl), (hs, hl))
    }
});

/// The CUDA kernel's algorithm (`decode.cu`, flash-decoding) on the CPU, to prove it: each
/// query's visible keys cut into `splits` stretches, each stretch an online softmax over its
/// keys taken by `warps` warps in turn (each warp's running max, sum and output merged at the
/// end of the stretch), then the stretches combined by their log-sum-exps. Returns what
/// [`attention`] returns, as flat f32 vectors (output, log-sum-exp).
#[cfg(test)]
pub(crate) fn split_combine(
    q: &Tensor,
    (k, v): (&Tensor, &Tensor),
    spans: &KeySpans,
    (splits, warps): (usize, usize),
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (b, heads, sq, d) = q.dims4()?;
    let (_, kv_heads, cap, _) = k.dims4()?;
    let (q, k, v) = (
        q.flatten_all()?.to_vec1::<f32>()?,
        k.flatten_all()?.to_vec1::<f32>()?,
        v.flatten_all()?.to_vec1::<f32>()?,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let rows = b * heads * sq;
    let (mut out, mut lse) = (vec![0f32; rows * d], vec![f32::NEG_INFINITY; rows]);
    for row in 0..rows {
        let (qi, h, bi) = (row % sq, (row / sq) % heads, row / (sq * heads));
        let kh = h / (heads / kv_heads);
        let (from, to) = (
            spans.lo()[bi * sq + qi] as usize,
            spans.hi()[bi * sq + qi] as usize,
        );
        let len = to.saturating_sub(from);
        let per = len.div_ceil(splits);
        let qr = &q[row * d..(row + 1) * d];
        let base = (bi * kv_heads + kh) * cap * d;
        // Per split: (normalized output, log-sum-exp).
        let mut parts = Vec::new();
        for split in 0..splits {
            let s0 = from + split * per;
            let s1 = to.min(s0 + per);
            // Per warp: running max, sum, output.
            let mut w: Vec<(f32, f32, Vec<f32>)> =
                vec![(f32::NEG_INFINITY, 0.0, vec![0.0; d]); warps];
            for (j, key) in (s0..s1).enumerate() {
                let (m, l, acc) = &mut w[j % warps];
                let kr = &k[base + key * d..base + (key + 1) * d];
                let mut s: f32 = qr.iter().zip(kr).map(|(a, b)| a * scale * b).sum();
                if let Some(cap) = spans.softcap {
                    s = cap * (s / cap).tanh();
                }
                let m_new = m.max(s);
                let (alpha, p) = ((*m - m_new).exp(), (s - m_new).exp());
                *l = *l * alpha + p;
                let vr = &v[base + key * d..base + (key + 1) * d];
                for (a, x) in acc.iter_mut().zip(vr) {
                    *a = *a * alpha + p * x;
                }
                *m = m_new;
            }
            let mm = w.iter().map(|x| x.0).fold(f32::NEG_INFINITY, f32::max);
            let (mut ll, mut o) = (0f32, vec![0f32; d]);
            for (m, l, acc) in &w {
                let a = if *m == f32::NEG_INFINITY {
                    0.0
                } else {
                    (m - mm).exp()
                };
                ll += l * a;
                o.iter_mut().zip(acc).for_each(|(x, y)| *x += y * a);
            }
            match ll > 0.0 {
                true => parts.push((o.iter().map(|x| x / ll).collect::<Vec<_>>(), mm + ll.ln())),
                false => parts.push((vec![0.0; d], f32::NEG_INFINITY)),
            }
        }
        let mm = parts.iter().map(|p| p.1).fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = parts
            .iter()
            .filter(|p| p.1 != f32::NEG_INFINITY)
            .map(|p| (p.1 - mm).exp())
            .sum();
        for (o, x) in parts.iter().filter(|p| p.1 != f32::NEG_INFINITY).map(|p| {
            let wgt = (p.1 - mm).exp() / total;
            (&p.0, wgt)
        }) {
            out[row * d..(row + 1) * d]
                .iter_mut()
                .zip(o)
                .for_each(|(a, y)| *a += y * x);
        }
        if total > 0.0 {
            lse[row] = mm + total.ln();
        }
    }
    Ok((out, lse))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::max_abs_diff;
    use candle_core::Device;

    /// A key a query does not see adds nothing to it, whatever its value: of two new queries
    /// of one row, the first sees keys 0..20 (holding NaN) and the second keys 20..40, whose
    /// output stays that of finite values.
    #[test]
    fn keys_a_query_does_not_see_do_not_reach_it() {
        let dev = Device::Cpu;
        let (heads, keys, d) = (2, 40, 64);
        let q = Tensor::randn(0f32, 1.0, (1, heads, 2, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, 1, keys, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, 1, keys, d), &dev).unwrap();
        let spans = KeySpans::new(2, vec![0, 20], vec![20, 40]);
        let second = |o: Tensor| o.narrow(2, 1, 1).unwrap();
        let (want, _) = attention(&q, (&k, &v), keys, &spans).unwrap();
        let mut poisoned = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        poisoned[..20 * d].fill(f32::NAN);
        let poisoned = Tensor::from_vec(poisoned, (1, 1, keys, d), &dev).unwrap();
        let (got, _) = attention(&q, (&k, &poisoned), keys, &spans).unwrap();
        assert_eq!(max_abs_diff(&second(got), &second(want)), 0.0);
    }

    /// Against the Candle ops on fresh random inputs: grouped heads, left-padded rows, a
    /// window, soft-capping, one and several new queries, pad queries that see nothing (zero
    /// output, log-sum-exp minus infinity), and the CUDA kernel's split and combine.
    #[test]
    fn equals_the_reference() {
        let dev = Device::Cpu;
        for (b, heads, kv_heads, sq, keys, d, cap) in [
            (2, 4, 2, 1, 37, 16, None),
            // A head dim that leaves partial lanes, keys past a block of sixteen.
            (2, 3, 1, 1, 21, 24, None),
            (3, 6, 2, 3, 70, 64, Some(5.0f32)),
            (1, 2, 2, 5, 5, 8, None),
            // Row 1's first two queries are pads of a prompt: they see no key.
            (2, 4, 2, 3, 6, 16, None),
        ] {
            let capacity = keys + 3;
            let q = Tensor::randn(0f32, 1.0, (b, heads, sq, d), &dev).unwrap();
            let k = Tensor::randn(0f32, 1.0, (b, kv_heads, capacity, d), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (b, kv_heads, capacity, d), &dev).unwrap();
            let (mut lo, mut hi) = (Vec::new(), Vec::new());
            for bi in 0..b {
                let start = if keys == 6 { 5 * bi } else { 2 * bi };
                for i in 0..sq {
                    let at = keys - sq + i;
                    // Row 1 in a window of 4 keys; a prompt's pad query sees nothing.
                    let first = if bi == 1 {
                        (at + 1).saturating_sub(4)
                    } else {
                        0
                    };
                    let first = first.max(start);
                    lo.push(first as u32);
                    hi.push(if at < start { first } else { at + 1 } as u32);
                }
            }
            let mut spans = KeySpans::new(sq, lo, hi);
            spans.softcap = cap;
            let (o, l) = attention(&q, (&k, &v), keys, &spans).unwrap();
            // The CUDA kernel's split and combine (decode.cu), on the CPU.
            for splits in [1, 3, 7] {
                let (so, sl) = split_combine(&q, (&k, &v), &spans, (splits, 4)).unwrap();
                let want = o.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let diff = so
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(diff < 1e-5, "{splits} splits: output differs by {diff}");
                let want = l.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for (a, b) in sl.iter().zip(&want) {
                    assert!(
                        a == b || (a - b).abs() < 1e-4,
                        "{splits} splits: lse {a} vs {b}"
                    );
                }
            }
            let (ro, rl) = attention_reference(&q, (&k, &v), keys, &spans).unwrap();
            let diff = max_abs_diff(&o, &ro);
            assert!(diff < 1e-5, "output differs by {diff}");
            let (l, rl) = (l.flatten_all().unwrap(), rl.flatten_all().unwrap());
            let (l, rl) = (l.to_vec1::<f32>().unwrap(), rl.to_vec1::<f32>().unwrap());
            for (a, b) in l.iter().zip(&rl) {
                assert!(a == b || (a - b).abs() < 1e-4, "lse {a} vs {b}");
            }
        }
    }
}
