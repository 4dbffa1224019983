//! Ring attention for context parallelism. The sequence is cut into 2 x cp chunks and rank r
//! holds chunks r and 2cp-1-r (head-tail balance: with a causal mask every rank then has the
//! same amount of work). Each rank attends with its queries over every rank's keys: the key
//! and value chunks travel around the ring, one hop per step, and the partial results merge
//! with the online softmax (running row maximum, sum and weighted values). Backward sends the
//! keys and values around again, with their gradients accumulating as they travel, and one
//! last hop brings each rank's key/value gradients home.
//!
//! The mask is causal within documents over the whole sequence (unlike Accelerate's CP, packed
//! documents do not see each other): a query at global index i of a document starting at st
//! sees the keys at global indices st..=i, wherever they are held.
//!
//! Within a step the local queries and the visiting keys are taken in blocks (as in the
//! blockwise attention), so memory stays linear in the length: one block of scores at a time.
//!
//! Where a fused kernel applies (f32 on the CPU: [`crate::kernels::cpu_flash`]; bf16 / f16 on a GPU:
//! `cuda_flash`, the same tiling) each (query chunk, key chunk) pair of a step runs it with
//! the pair's key spans, and the pairs merge by their log-sum-exps in f32; backward runs the
//! kernel's backward per pair with the whole attention's output and log-sum-exp, which makes
//! each pair's gradients exact. Other inputs take the blockwise path below.
//!
//! Precision as in the blockwise attention: matmuls in the inputs' dtype (bf16 under mixed
//! precision), scores, softmax and accumulators in f32 (f64 for f64 inputs). The key and value
//! gradients travel around the ring in f32 too, so each hop adds to an unrounded sum.

use crate::comm::{CommQueue, Communicator, Pending};
use crate::data::sequence::balanced_indices;
use crate::kernels::cpu_flash::{self, KeySpans};
use crate::kernels::precision::{self, accumulate};
use crate::nn::flash::BLOCK;
use crate::nn::mask::{AttentionMask, ScoreMods, WithScoreMods, MASKED};
use crate::nn::memo::Memo;
use crate::precomputed::{with_backward3, Backward3, Saved3};
use candle_core::{DType, Result, Tensor, D};
use std::sync::Arc;

/// Which keys every local query sees (its global index and the global index where its
/// document starts, per batch row), and the ring the keys travel around.
#[derive(Clone)]
pub struct RingMask {
    /// Global index of each local position.
    query_index: Vec<usize>,
    /// Per batch row, the document start of each local position.
    starts: Vec<Vec<usize>>,
    chunk: usize,
    /// Queries and keys per block within a ring step.
    block: usize,
    group: Arc<dyn Communicator>,
    /// Runs the hops in the background (one thread for every layer of the forward and its
    /// backward), so that the next step's keys travel while this step computes.
    queue: Arc<CommQueue>,
    /// The masks of each block pair by (first local query, key source rank, key block, dtype),
    /// built once for every layer of the forward and its backward; None where every query
    /// sees the whole key block.
    masks: Arc<Memo<RingBlock, Option<BlockMask>>>,
    /// Whether inputs the fused kernels take run them (else always the blockwise path).
    fused: bool,
    /// Soft-capping (the fused kernels get it in each chunk pair's key spans) and sinks
    /// (added once to the merged steps).
    pub mods: ScoreMods,
}

impl WithScoreMods for RingMask {
    fn mods_mut(&mut self) -> &mut ScoreMods {
        &mut self.mods
    }
}

/// (first local query, key source rank, key block, dtype).
type RingBlock = (usize, usize, usize, DType);

/// Additive mask and 0/1 visibility of one block pair: [batch, 1, 1, nq, nk] each. The 0/1
/// mask multiplies the probabilities as well, so a row that sees nothing in one step adds
/// nothing.
type BlockMask = (Tensor, Tensor);

impl RingMask {
    /// From this rank's global position ids [batch, 2 * chunk] (documents restart at 0),
    /// gathering every rank's to find where documents start (collective over `cp`).
    pub fn new(
        position_ids: &Tensor,
        cp: &Arc<dyn Communicator>,
        window: Option<crate::nn::Window>,
    ) -> Result<Self> {
        let (size, rank) = (cp.size(), cp.rank());
        let local = position_ids.to_dtype(DType::I64)?;
        let (b, chunk) = (local.dim(0)?, local.dim(1)? / 2);
        let gathered = cp.all_gather(&local, 1).map_err(|e| e.into_candle())?;
        // Columns in global order: rank j's two chunks go to their places.
        let mut order = vec![0u32; 2 * size * chunk];
        for j in 0..size {
            for (k, g) in balanced_indices(j, size, chunk).into_iter().enumerate() {
                order[g] = (j * 2 * chunk + k) as u32;
            }
        }
        let order = Tensor::new(order.as_slice(), gathered.device())?;
        let global = gathered.index_select(&order, 1)?;
        // The attention mask of the whole sequence knows every document's start.
        let whole =
            AttentionMask::windowed(&global, window, DType::F32, &candle_core::Device::Cpu)?;
        let all_starts = &whole.ranges().starts;
        let len = 2 * size * chunk;
        let query_index = balanced_indices(rank, size, chunk);
        let starts = (0..b)
            .map(|row| {
                query_index
                    .iter()
                    .map(|&g| all_starts[row * len + g] as usize)
                    .collect()
            })
            .collect();
        Ok(RingMask {
            query_index,
            starts,
            chunk,
            block: BLOCK,
            group: cp.clone(),
            queue: Arc::new(CommQueue::new(cp.clone()).map_err(|e| e.into_candle())?),
            masks: Arc::default(),
            fused: true,
            mods: ScoreMods::default(),
        })
    }

    /// Always the blockwise path of Candle ops, also where a fused kernel applies (to
    /// compare the two).
    pub fn blockwise(mut self) -> Self {
        self.fused = false;
        self
    }

    /// Starts sending `t` one hop along the ring (to rank + 1); the result is what rank - 1
    /// sent. Hops run in the order they are started, on every rank alike.
    fn start_pass(&self, t: &Tensor) -> Pending {
        let (r, n) = (self.group.rank(), self.group.size());
        let t = t.clone();
        self.queue
            .submit(move |c| c.send_recv(&t, (r + 1) % n, (r + n - 1) % n))
    }

    /// The rank whose keys this rank holds at step `t`.
    fn source(&self, t: usize) -> usize {
        let (r, n) = (self.group.rank(), self.group.size());
        (r + n - t) % n
    }

    /// The key spans of local query chunk `a` (0: the head chunk, 1: the tail) over key chunk
    /// `c` of rank `src`'s keys; None when no query of it sees a key of it.
    fn chunk_spans(&self, a: usize, src: usize, c: usize) -> Option<KeySpans> {
        let chunk = self.chunk;
        let q0 = self.query_index[a * chunk];
        let k0 = balanced_indices(src, self.group.size(), chunk)[c * chunk];
        let starts: Vec<&[usize]> = self
            .starts
            .iter()
            .map(|row| &row[a * chunk..(a + 1) * chunk])
            .collect();
        KeySpans::shifted(&starts, q0, chunk, k0, chunk).map(|s| s.with_softcap(self.mods.softcap))
    }

    /// The same mask computed in blocks of `block` queries and keys.
    pub fn with_block(mut self, block: usize) -> Self {
        self.block = block.max(1);
        self
    }

    /// Whether some local query of `queries` (a range of local positions) may see some key
    /// of `keys` (global indices) in any row: a cheap test that lets invisible blocks be
    /// skipped (it may say yes for a block that turns out all masked).
    fn any_visible(&self, queries: std::ops::Range<usize>, keys: &[usize]) -> bool {
        let (lo, hi) = (
            keys.iter().copied().min().unwrap_or(usize::MAX),
            keys.iter().copied().max().unwrap_or(0),
        );
        let latest = self.query_index[queries.clone()]
            .iter()
            .copied()
            .max()
            .unwrap_or(0);
        let earliest_start = self
            .starts
            .iter()
            .flat_map(|row| row[queries.clone()].iter().copied())
            .min()
            .unwrap_or(usize::MAX);
        lo <= latest && hi >= earliest_start
    }

    /// The masks of local queries `queries` over key block `(source rank, block)` at global
    /// indices `keys`, or None when every query sees every key of it (keys wholly before the
    /// queries and inside their documents): built once, then shared.
    fn block_mask(
        &self,
        queries: std::ops::Range<usize>,
        key_block: (usize, usize),
        keys: &[usize],
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<Option<BlockMask>> {
        let id = (queries.start, key_block.0, key_block.1, dtype);
        self.masks.get_or_build(id, || {
            let first_key = keys.iter().copied().min().unwrap_or(0);
            let last_key = keys.iter().copied().max().unwrap_or(0);
            let earliest_query = self.query_index[queries.clone()].iter().copied().min();
            let latest_start = self
                .starts
                .iter()
                .flat_map(|row| row[queries.clone()].iter().copied())
                .max();
            let open = earliest_query.is_some_and(|q| last_key <= q)
                && latest_start.is_some_and(|st| st <= first_key);
            match open {
                true => Ok(None),
                false => self.block(queries, keys, dtype, device).map(Some),
            }
        })
    }

    /// Additive mask and 0/1 visibility of local queries `queries` over the keys at global
    /// indices `keys`: [batch, 1, 1, nq, nk] each.
    fn block(
        &self,
        queries: std::ops::Range<usize>,
        keys: &[usize],
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<BlockMask> {
        let (b, nq, nk) = (self.starts.len(), queries.len(), keys.len());
        let mut vis = Vec::with_capacity(b * nq * nk);
        for row in &self.starts {
            for (&q, &st) in self.query_index[queries.clone()]
                .iter()
                .zip(&row[queries.clone()])
            {
                vis.extend(keys.iter().map(|&k| (k >= st && k <= q) as u8 as f32));
            }
        }
        let vis = Tensor::from_vec(vis, (b, 1, 1, nq, nk), device)?.to_dtype(dtype)?;
        let bias = ((vis.ones_like()? - &vis)? * MASKED as f64)?;
        Ok((bias, vis))
    }
}

struct Ring<'a> {
    cp: &'a Arc<dyn Communicator>,
    mask: &'a RingMask,
    /// Queries scaled by 1/sqrt(d): [b, kv, group, n, d].
    q: Tensor,
    b: usize,
    kv: usize,
    group: usize,
    n: usize,
    d: usize,
    /// The inputs' dtype, and that of scores, softmax and accumulators.
    io: DType,
    wide: DType,
}

impl Ring<'_> {
    fn source(&self, t: usize) -> usize {
        self.mask.source(t)
    }

    fn pass(&self, t: &Tensor) -> Result<Tensor> {
        pass(self.mask, t)
    }

    fn prefetch(&self, t: usize, k: &Tensor, v: &Tensor) -> Option<(Pending, Pending)> {
        prefetch(self.mask, t, k, v)
    }

    /// Local positions of block `i` (the last one may be shorter).
    fn rows(&self, i: usize) -> std::ops::Range<usize> {
        i * self.mask.block..((i + 1) * self.mask.block).min(self.n)
    }

    /// Rows `r` of a [b, kv, group, n, x] tensor as [b, kv, group * len, x].
    fn take(&self, t: &Tensor, r: &std::ops::Range<usize>) -> Result<Tensor> {
        let x = t.dim(4)?;
        t.narrow(3, r.start, r.len())?.contiguous()?.reshape((
            self.b,
            self.kv,
            self.group * r.len(),
            x,
        ))
    }

    /// The (query block, key block) pairs of a step over `src`'s keys that may see each
    /// other, with the key blocks' global indices.
    fn pairs(&self, src: usize) -> Vec<(usize, usize, Vec<usize>)> {
        let keys = balanced_indices(src, self.cp.size(), self.mask.chunk);
        let blocks = self.n.div_ceil(self.mask.block);
        let mut out = Vec::new();
        for i in 0..blocks {
            for j in 0..blocks {
                let k = keys[self.rows(j)].to_vec();
                if self.mask.any_visible(self.rows(i), &k) {
                    out.push((i, j, k));
                }
            }
        }
        out
    }

    /// Scores of query rows `qi` (block `i`) over `kj` (key block `key_block`, at global
    /// indices `keys`), soft-capped when the mask says, with the mask added; the 0/1
    /// visibility (None: all visible); and when capped and `slope` (the backward) the cap's
    /// slope 1 - tanh^2: [b, kv, group, qn, kn].
    fn scores(
        &self,
        qi: &Tensor,
        i: usize,
        kj: &Tensor,
        (key_block, keys): ((usize, usize), &[usize]),
        slope: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let rows = self.rows(i);
        let s = qi
            .matmul(&kj.t()?)?
            .reshape((self.b, self.kv, self.group, rows.len(), keys.len()))?
            .to_dtype(self.wide)?;
        let (s, slope) = crate::nn::mask::soft_cap(s, self.mask.mods.softcap, slope)?;
        match self
            .mask
            .block_mask(rows, key_block, keys, self.wide, qi.device())?
        {
            Some((bias, vis)) => Ok((s.broadcast_add(&bias)?, Some(vis), slope)),
            None => Ok((s, None, slope)),
        }
    }

    fn forward(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, kv, g, d) = (self.b, self.kv, self.group, self.d);
        let blocks = self.n.div_ceil(self.mask.block);
        let (mut k, mut v) = (k.clone(), v.clone());
        // Per query block: running maximum, sum and weighted values.
        let mut acc: Vec<Option<(Tensor, Tensor, Tensor)>> = vec![None; blocks];
        let mut next = None;
        for t in 0..self.cp.size() {
            if let Some((pk, pv)) = next.take() {
                (k, v) = (wait(pk)?, wait(pv)?);
            }
            next = self.prefetch(t, &k, &v);
            let src = self.source(t);
            for (i, j, keys) in self.pairs(src) {
                let (qr, kr) = (self.rows(i), self.rows(j));
                let qi = self.take(&self.q, &qr)?;
                let kj = k.narrow(2, kr.start, kr.len())?;
                let (s, vis, _) = self.scores(&qi, i, &kj, ((src, j), &keys), false)?;
                let block_max = s.max_keepdim(D::Minus1)?;
                let max = match &acc[i] {
                    Some((m, _, _)) => m.maximum(&block_max)?,
                    None => block_max,
                };
                let p = masked(s.broadcast_sub(&max)?.exp()?, &vis)?;
                let pv = p
                    .to_dtype(self.io)?
                    .reshape((b, kv, g * qr.len(), kr.len()))?
                    .matmul(&v.narrow(2, kr.start, kr.len())?)?
                    .reshape((b, kv, g, qr.len(), d))?
                    .to_dtype(self.wide)?;
                let sum = p.sum_keepdim(D::Minus1)?;
                acc[i] = Some(match acc[i].take() {
                    None => (max, sum, pv),
                    Some((m, l, o)) => {
                        let c = (m - &max)?.exp()?;
                        (max, ((l * &c)? + sum)?, (o.broadcast_mul(&c)? + pv)?)
                    }
                });
            }
        }
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        for a in acc {
            // Every query sees itself, in its own chunk, at step 0.
            let (m, l, o) = a.expect("every query block sees its own keys");
            outs.push(o.broadcast_div(&l)?.to_dtype(self.io)?);
            lses.push((m + l.log()?)?);
        }
        let out = Tensor::cat(&outs, 3)?.reshape((b, kv * g, self.n, d))?;
        Ok((out, Tensor::cat(&lses, 3)?))
    }

    fn backward(
        &self,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
    ) -> Result<[Tensor; 3]> {
        let (b, kv, g, n, d) = (self.b, self.kv, self.group, self.n, self.d);
        let (io, wide) = (self.io, self.wide);
        let five = (b, kv, g, n, d);
        let dout = dout.to_dtype(io)?.reshape(five)?;
        let dsum =
            (dout.to_dtype(wide)? * out.reshape(five)?.to_dtype(wide)?)?.sum_keepdim(D::Minus1)?;
        let blocks = n.div_ceil(self.mask.block);
        let (mut k, mut v) = (k.clone(), v.clone());
        let mut dk = k.zeros_like()?.to_dtype(wide)?;
        let mut dv = v.zeros_like()?.to_dtype(wide)?;
        let mut dq: Vec<Option<Tensor>> = vec![None; blocks];
        let mut next = None;
        for t in 0..self.cp.size() {
            if let Some((pk, pv)) = next.take() {
                (k, v) = (wait(pk)?, wait(pv)?);
                // The key gradients follow their keys once the previous rank added its part.
                (dk, dv) = (self.pass(&dk)?, self.pass(&dv)?);
            }
            next = self.prefetch(t, &k, &v);
            // Per key block of the keys held now, the gradient from every query block.
            let mut dk_blocks: Vec<Option<Tensor>> = vec![None; blocks];
            let mut dv_blocks: Vec<Option<Tensor>> = vec![None; blocks];
            let src = self.source(t);
            for (i, j, keys) in self.pairs(src) {
                let (qr, kr) = (self.rows(i), self.rows(j));
                let qi = self.take(&self.q, &qr)?;
                let doi = self.take(&dout, &qr)?;
                let (kj, vj) = (
                    k.narrow(2, kr.start, kr.len())?,
                    v.narrow(2, kr.start, kr.len())?,
                );
                let (s, vis, slope) = self.scores(&qi, i, &kj, ((src, j), &keys), true)?;
                let lse_i = lse.narrow(3, qr.start, qr.len())?;
                let dsum_i = dsum.narrow(3, qr.start, qr.len())?;
                let p5 = masked(s.broadcast_sub(&lse_i)?.exp()?, &vis)?;
                let p = p5.to_dtype(io)?.reshape((b, kv, g * qr.len(), kr.len()))?;
                accumulate(&mut dv_blocks[j], p.t()?.matmul(&doi)?, wide)?;
                let dp = doi
                    .matmul(&vj.t()?)?
                    .reshape((b, kv, g, qr.len(), kr.len()))?
                    .to_dtype(wide)?;
                let ds = (p5 * dp.broadcast_sub(&dsum_i)?)?;
                // Through the cap: the scores' gradient times its slope.
                let ds = match slope {
                    Some(slope) => (ds * slope)?,
                    None => ds,
                };
                let ds = ds.to_dtype(io)?.reshape((b, kv, g * qr.len(), kr.len()))?;
                let dqi = ds.matmul(&kj)?.reshape((b, kv, g, qr.len(), d))?;
                accumulate(&mut dq[i], dqi, wide)?;
                accumulate(&mut dk_blocks[j], ds.t()?.matmul(&qi)?, wide)?;
            }
            dk = (dk + self.whole(dk_blocks)?)?;
            dv = (dv + self.whole(dv_blocks)?)?;
        }
        // The gradients of the keys held last belong to the next rank: one more hop home.
        if self.cp.size() > 1 {
            (dk, dv) = (self.pass(&dk)?, self.pass(&dv)?);
        }
        let dq = dq
            .into_iter()
            .enumerate()
            .map(|(i, x)| match x {
                Some(x) => Ok(x),
                None => Tensor::zeros((b, kv, g, self.rows(i).len(), d), wide, out.device()),
            })
            .collect::<Result<Vec<_>>>()?;
        let dq = (Tensor::cat(&dq, 3)?.reshape((b, kv * g, n, d))? * (1.0 / (d as f64).sqrt()))?;
        Ok([dq.to_dtype(io)?, dk.to_dtype(io)?, dv.to_dtype(io)?])
    }

    /// Key-block gradients [b, kv, len, d] end to end (zeros where no query saw the block), in
    /// the wide dtype.
    fn whole(&self, parts: Vec<Option<Tensor>>) -> Result<Tensor> {
        let parts = parts
            .into_iter()
            .enumerate()
            .map(|(j, p)| match p {
                Some(p) => Ok(p),
                None => Tensor::zeros(
                    (self.b, self.kv, self.rows(j).len(), self.d),
                    self.wide,
                    self.q.device(),
                ),
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 2)
    }
}

/// Probabilities `p` with the invisible keys zeroed (a row that sees nothing of a block must
/// add nothing, though its masked scores are all equal).
fn masked(p: Tensor, vis: &Option<Tensor>) -> Result<Tensor> {
    match vis {
        Some(vis) => p.broadcast_mul(vis),
        None => Ok(p),
    }
}

fn wait(p: Pending) -> Result<Tensor> {
    p.wait().map_err(|e| e.into_candle())
}

/// One hop of `t` along the ring, waited for.
fn pass(mask: &RingMask, t: &Tensor) -> Result<Tensor> {
    wait(mask.start_pass(t))
}

/// Starts the hop of the keys and values held at step `t`, unless it is the last step.
fn prefetch(mask: &RingMask, t: usize, k: &Tensor, v: &Tensor) -> Option<(Pending, Pending)> {
    (t + 1 < mask.group.size()).then(|| (mask.start_pass(k), mask.start_pass(v)))
}

/// Whether a fused kernel runs the chunk pairs of these inputs.
fn fused_applies(q: &Tensor, k: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if crate::kernels::cuda_flash::applies(q, k) {
        return true;
    }
    cpu_flash::applies(q, k)
}

/// One chunk pair's output and log-sum-exp (f32) by the fused kernel of the inputs' device.
fn pair_forward(q: &Tensor, k: &Tensor, v: &Tensor, spans: &KeySpans) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::kernels::cuda_flash::forward(q, k, v, spans);
    }
    cpu_flash::forward(q, k, v, spans)
}

/// One chunk pair's gradients (f32) by the fused kernel of the inputs' device.
fn pair_backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (out, lse, dout): (&Tensor, &Tensor, &Tensor),
    spans: &KeySpans,
) -> Result<[Tensor; 3]> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        let (dq, dk, dv) =
            crate::kernels::cuda_flash::backward((q, k, v), (out, lse, dout), spans)?;
        return Ok([
            dq.to_dtype(DType::F32)?,
            dk.to_dtype(DType::F32)?,
            dv.to_dtype(DType::F32)?,
        ]);
    }
    let (dq, dk, dv) = cpu_flash::backward((q, k, v), (out, lse, dout), spans)?;
    Ok([dq, dk, dv])
}

/// Merges a pair's (output, log-sum-exp) into the running ones of its query chunk (f32,
/// [b, heads, chunk, d] and [b, heads, chunk]). A row the pair does not reach has a
/// log-sum-exp of minus infinity and gets nothing from it; a row nothing has reached yet
/// stays zero (the sum of its weights is clamped, not divided by).
fn merge(acc: Option<(Tensor, Tensor)>, (o, l): (Tensor, Tensor)) -> Result<(Tensor, Tensor)> {
    let Some((ao, al)) = acc else {
        return Ok((o, l));
    };
    let m = al.maximum(&l)?.clamp(-1e30f32, f32::MAX)?;
    let (wa, wb) = ((&al - &m)?.exp()?, (&l - &m)?.exp()?);
    let total = (&wa + &wb)?;
    let inv = total.clamp(1e-30f32, f32::MAX)?.recip()?;
    let (wa, wb) = ((wa * &inv)?.unsqueeze(3)?, (wb * &inv)?.unsqueeze(3)?);
    let out = (ao.broadcast_mul(&wa)? + o.broadcast_mul(&wb)?)?;
    Ok((out, (m + total.log()?)?))
}

/// The fused ring forward: every step's (query chunk, key chunk) pairs by the fused kernel,
/// merged by log-sum-exp. Output [b, heads, n, d] in the inputs' dtype, log-sum-exp
/// [b, heads, n] in f32.
fn fused_forward(q: &Tensor, k: &Tensor, v: &Tensor, mask: &RingMask) -> Result<(Tensor, Tensor)> {
    let chunk = mask.chunk;
    let part = |t: &Tensor, a: usize| t.narrow(2, a * chunk, chunk)?.contiguous();
    let qa = [part(q, 0)?, part(q, 1)?];
    let mut acc: [Option<(Tensor, Tensor)>; 2] = [None, None];
    let (mut k, mut v) = (k.clone(), v.clone());
    let mut next = None;
    for t in 0..mask.group.size() {
        if let Some((pk, pv)) = next.take() {
            (k, v) = (wait(pk)?, wait(pv)?);
        }
        next = prefetch(mask, t, &k, &v);
        let src = mask.source(t);
        for c in 0..2 {
            let (kc, vc) = (part(&k, c)?, part(&v, c)?);
            for (a, qa) in qa.iter().enumerate() {
                if let Some(spans) = mask.chunk_spans(a, src, c) {
                    let (o, l) = pair_forward(qa, &kc, &vc, &spans)?;
                    acc[a] = Some(merge(acc[a].take(), (o.to_dtype(DType::F32)?, l))?);
                }
            }
        }
    }
    let (mut outs, mut lses) = (Vec::with_capacity(2), Vec::with_capacity(2));
    for a in acc {
        // Every query sees itself, in its own chunk, at step 0.
        let (o, l) = a.expect("every query chunk sees its own keys");
        outs.push(o);
        lses.push(l);
    }
    Ok((
        Tensor::cat(&outs, 2)?.to_dtype(q.dtype())?,
        Tensor::cat(&lses, 2)?,
    ))
}

/// The fused ring backward: per step and (query chunk, key chunk) pair the fused kernel's
/// backward with the whole attention's output and log-sum-exp; the key and value gradients
/// travel with their keys as in the blockwise backward, in f32.
fn fused_backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (out, lse, dout): (&Tensor, &Tensor, &Tensor),
    mask: &RingMask,
) -> Result<[Tensor; 3]> {
    let chunk = mask.chunk;
    let part = |t: &Tensor, a: usize| t.narrow(2, a * chunk, chunk)?.contiguous();
    let qa = [part(q, 0)?, part(q, 1)?];
    let oa = [part(out, 0)?, part(out, 1)?];
    let la = [part(lse, 0)?, part(lse, 1)?];
    let da = [part(dout, 0)?, part(dout, 1)?];
    let zeros = |t: &Tensor| Tensor::zeros(t.shape(), DType::F32, t.device());
    let mut dq: [Option<Tensor>; 2] = [None, None];
    let (mut k, mut v) = (k.clone(), v.clone());
    let (mut dk, mut dv) = (zeros(&k)?, zeros(&v)?);
    let mut next = None;
    for t in 0..mask.group.size() {
        if let Some((pk, pv)) = next.take() {
            (k, v) = (wait(pk)?, wait(pv)?);
            // The key gradients follow their keys once the previous rank added its part.
            (dk, dv) = (pass(mask, &dk)?, pass(mask, &dv)?);
        }
        next = prefetch(mask, t, &k, &v);
        let src = mask.source(t);
        let (mut dks, mut dvs) = (Vec::with_capacity(2), Vec::with_capacity(2));
        for c in 0..2 {
            let (kc, vc) = (part(&k, c)?, part(&v, c)?);
            let (mut dkc, mut dvc) = (zeros(&kc)?, zeros(&vc)?);
            for a in 0..2 {
                let Some(spans) = mask.chunk_spans(a, src, c) else {
                    continue;
                };
                let [g_q, g_k, g_v] =
                    pair_backward((&qa[a], &kc, &vc), (&oa[a], &la[a], &da[a]), &spans)?;
                dq[a] = Some(match dq[a].take() {
                    Some(prev) => (prev + g_q)?,
                    None => g_q,
                });
                dkc = (dkc + g_k)?;
                dvc = (dvc + g_v)?;
            }
            dks.push(dkc);
            dvs.push(dvc);
        }
        dk = (dk + Tensor::cat(&dks, 2)?)?;
        dv = (dv + Tensor::cat(&dvs, 2)?)?;
    }
    // The gradients of the keys held last belong to the next rank: one more hop home.
    if mask.group.size() > 1 {
        (dk, dv) = (pass(mask, &dk)?, pass(mask, &dv)?);
    }
    let dq = dq
        .into_iter()
        .zip(&qa)
        .map(|(g, q)| g.map_or_else(|| zeros(q), Ok))
        .collect::<Result<Vec<_>>>()?;
    let io = q.dtype();
    Ok([
        Tensor::cat(&dq, 2)?.to_dtype(io)?,
        dk.to_dtype(io)?,
        dv.to_dtype(io)?,
    ])
}

fn ring<'a>(q: &Tensor, kv: usize, mask: &'a RingMask) -> Result<Ring<'a>> {
    let (b, heads, n, d) = q.dims4()?;
    let group = heads / kv;
    let io = q.dtype();
    let q = (q.detach() * (1.0 / (d as f64).sqrt()))?.reshape((b, kv, group, n, d))?;
    Ok(Ring {
        cp: &mask.group,
        mask,
        q,
        b,
        kv,
        group,
        n,
        d,
        io,
        wide: precision::wide(io),
    })
}

/// What the ring backward needs besides q, k, v: the mask (with its ring) and the forward's
/// log-sum-exp.
struct RingBackward {
    mask: RingMask,
    lse: Tensor,
    /// The forward ran the fused kernels (the log-sum-exp is then [b, heads, n]).
    fused: bool,
}

impl Backward3 for RingBackward {
    const NAME: &'static str = "ring attention";

    fn backward(&self, saved: &Saved3) -> Result<[Option<Tensor>; 3]> {
        let ([q, k, v], out, dout) = (&saved.inputs, &saved.out, &saved.dout);
        let grads = match self.fused {
            true => fused_backward((q, k, v), (out, &self.lse, &dout.contiguous()?), &self.mask),
            false => ring(q, k.dim(1)?, &self.mask)?.backward(k, v, out, &self.lse, dout),
        }?;
        Ok(grads.map(Some))
    }
}

/// Attention of this rank's queries `q` [b, heads, 2 * chunk, d] over the keys and values of
/// every rank of the mask's ring (`k`, `v` [b, kv_heads, 2 * chunk, d] held here).
pub fn ring_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &RingMask) -> Result<Tensor> {
    let (heads, kv) = (q.dim(1)?, k.dim(1)?);
    if heads % kv != 0 {
        candle_core::bail!("{heads} attention heads cannot share {kv} key/value heads evenly");
    }
    let (k_in, v_in) = (k.detach().contiguous()?, v.detach().contiguous()?);
    let fused = mask.fused && fused_applies(q, k);
    let forward = match fused {
        true => fused_forward(&q.detach().contiguous()?, &k_in, &v_in, mask)?,
        false => ring(q, kv, mask)?.forward(&k_in, &v_in)?,
    };
    let mask_of = || mask.clone();
    crate::kernels::sinks::attend_with(forward, mask.mods.sinks.as_ref(), |out, lse| {
        with_backward3(
            q,
            k,
            v,
            out,
            RingBackward {
                mask: mask_of(),
                lse,
                fused,
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::InProcessWorld;
    use crate::kernels::testing::{
        bf16_exact_randn as randn, max_abs_diff as diff, rel_diff as rel,
    };
    use candle_core::{Device, Var};

    /// Rank `rank`'s token indices among `ranks` (chunks of `chunk`) and its position ids
    /// [rows, 2 * chunk] cut from the `global` ones (every row the same).
    fn local(
        rank: usize,
        ranks: usize,
        chunk: usize,
        global: &[i64],
        rows: usize,
    ) -> (Tensor, Tensor) {
        let dev = Device::Cpu;
        let index: Vec<u32> = balanced_indices(rank, ranks, chunk)
            .into_iter()
            .map(|i| i as u32)
            .collect();
        let index = Tensor::new(index.as_slice(), &dev).unwrap();
        let pos = Tensor::new(global, &dev)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
            .repeat((rows, 1))
            .unwrap()
            .index_select(&index, 1)
            .unwrap();
        (index, pos)
    }

    /// The gradients of `<out, w>` with respect to `inputs`.
    fn grads_of(out: &Tensor, w: &Tensor, inputs: [&Var; 3]) -> Vec<Tensor> {
        let g = (out * w).unwrap().sum_all().unwrap().backward().unwrap();
        inputs.iter().map(|t| g.get(t).unwrap().clone()).collect()
    }

    /// Blocks within a ring step change nothing: values and gradients at block 3 (ragged,
    /// spanning the two chunks) equal one block per step, on 2 ranks with packed documents.
    /// In bf16 (inputs bf16 holds exactly) they follow the f32 ones within a few bf16
    /// roundings of the largest value.
    #[test]
    fn blocks_within_a_step_change_nothing() {
        // Per rank: 2 chunks of 5 of a row of 20 tokens; documents of 7 and 13.
        let global: Vec<i64> = (0..7).chain(0..13).collect();
        let q = randn((1, 4, 20, 8), 1.0, 1);
        let k = randn((1, 2, 20, 8), 1.0, 2);
        let v = randn((1, 2, 20, 8), 1.0, 3);
        let w = randn((1, 4, 20, 8), 1.0, 4);
        let run = |block: usize, dtype: DType| {
            InProcessWorld::run(2, |rank, cp| {
                let (index, pos) = local(rank, 2, 5, &global, 1);
                let mask = RingMask::new(&pos, &cp, None)
                    .unwrap()
                    .with_block(block)
                    .blockwise();
                let mine =
                    |t: &Tensor| Var::from_tensor(&t.index_select(&index, 2).unwrap()).unwrap();
                let (q, k, v) = (mine(&q), mine(&k), mine(&v));
                let [ql, kl, vl] = [&q, &k, &v].map(|t| t.to_dtype(dtype).unwrap());
                let out = ring_attention(&ql, &kl, &vl, &mask).unwrap();
                // Small blocks include pairs every query sees whole: their mask is skipped.
                let open = mask.masks.values().iter().filter(|m| m.is_none()).count();
                assert!(
                    block > 5 || open > 0,
                    "rank {rank}: no open block pair at block {block}"
                );
                assert_eq!(out.dtype(), dtype);
                let out = out.to_dtype(DType::F32).unwrap();
                let grads = grads_of(&out, &w.index_select(&index, 2).unwrap(), [&q, &k, &v]);
                (out, grads)
            })
        };
        let whole = run(128, DType::F32);
        // f32: equal up to rounding (absolute); bf16: a few roundings (of dout, ds and the
        // products) of the largest value.
        let measure = |dtype, a: &Tensor, b: &Tensor| match dtype {
            DType::F32 => diff(a, b),
            _ => rel(a, b),
        };
        for (dtype, bound) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let blocked = run(3, dtype);
            for ((o1, g1), (o2, g2)) in whole.iter().zip(&blocked) {
                let d = measure(dtype, o2, o1);
                assert!(d < bound, "{dtype:?}: outputs differ by {d:e}");
                for (a, b) in g1.iter().zip(g2) {
                    let d = measure(dtype, b, a);
                    assert!(d < bound, "{dtype:?}: gradients differ by {d:e}");
                }
            }
        }
    }

    /// The fused path (f32 CPU: the flash kernel per chunk pair, merged by log-sum-exp) equals
    /// the blockwise one, values and every gradient, plain and soft-capped, on 2 and 3 ranks with packed documents
    /// that cross chunk and rank boundaries and chunks longer than a kernel block.
    #[test]
    fn fused_pairs_equal_the_blockwise_ring() {
        for (ranks, chunk) in [(2usize, 70usize), (3, 9)] {
            let len = 2 * ranks * chunk;
            // Documents of 31, 100 and the rest.
            let global: Vec<i64> = (0..len as i64)
                .map(|i| match i {
                    i if i < 31 => i,
                    i if i < 131 => i - 31,
                    i => i - 131,
                })
                .collect();
            let q = randn((2, 4, len, 16), 1.0, 11);
            let k = randn((2, 2, len, 16), 1.0, 12);
            let v = randn((2, 2, len, 16), 1.0, 13);
            let w = randn((2, 4, len, 16), 1.0, 14);
            let run = |fused: bool, cap: Option<f64>| {
                InProcessWorld::run(ranks, |rank, cp| {
                    let (index, pos) = local(rank, ranks, chunk, &global, 2);
                    let mask = RingMask::new(&pos, &cp, None).unwrap().with_softcap(cap);
                    let mask = if fused { mask } else { mask.blockwise() };
                    let mine =
                        |t: &Tensor| Var::from_tensor(&t.index_select(&index, 2).unwrap()).unwrap();
                    let (q, k, v) = (mine(&q), mine(&k), mine(&v));
                    let out = ring_attention(&q, &k, &v, &mask).unwrap();
                    // Only the blockwise path builds block masks.
                    assert_eq!(mask.masks.values().is_empty(), fused, "rank {rank}");
                    let w = w.index_select(&index, 2).unwrap();
                    (out.clone(), grads_of(&out, &w, [&q, &k, &v]))
                })
            };
            // Plain, and with the scores soft-capped (Gemma 2), which must change them.
            let uncapped = run(true, None);
            for cap in [None, Some(2.0)] {
                let (fused, blockwise) = (run(true, cap), run(false, cap));
                if cap.is_some() {
                    assert!(diff(&fused[0].0, &uncapped[0].0) > 1e-3, "the cap bites");
                }
                for ((o1, g1), (o2, g2)) in fused.iter().zip(&blockwise) {
                    let d = diff(o1, o2);
                    assert!(
                        d < 1e-5,
                        "{ranks} ranks, cap {cap:?}: outputs differ by {d:e}"
                    );
                    for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(g1.iter().zip(g2)) {
                        let d = diff(a, b);
                        assert!(
                            d < 1e-4,
                            "{ranks} ranks, cap {cap:?}: {name} differs by {d:e}"
                        );
                    }
                }
            }
        }
    }

    /// Attention sinks (gpt-oss) on the ring, fused and blockwise, equal the whole sequence's
    /// attention in one process: each rank's rows of the output and of dq, dk, dv, and the
    /// sinks' gradient summed over the ranks (each rank's queries add their share).
    #[test]
    fn sinks_on_the_ring_equal_whole_attention() {
        let (ranks, chunk) = (2usize, 9usize);
        let len = 2 * ranks * chunk;
        let global: Vec<i64> = (0..len as i64)
            .map(|i| if i < 13 { i } else { i - 13 })
            .collect();
        let dev = Device::Cpu;
        let (q, k, v) = (
            randn((1, 4, len, 8), 1.0, 21),
            randn((1, 2, len, 8), 1.0, 22),
            randn((1, 2, len, 8), 1.0, 23),
        );
        let w = randn((1, 4, len, 8), 1.0, 24);
        let sinks = Tensor::new(&[1.0f32, -0.5, 3.0, 0.0], &dev).unwrap();
        let whole = {
            let pos = Tensor::new(global.as_slice(), &dev)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let s = Var::from_tensor(&sinks).unwrap();
            let mask = AttentionMask::causal(&pos, DType::F32, &dev)
                .unwrap()
                .with_sinks(Some(s.as_tensor().clone()));
            let [q, k, v] = [&q, &k, &v].map(|t| Var::from_tensor(t).unwrap());
            let out = crate::nn::attention::whole_matrix_attention(&q, &k, &v, &mask).unwrap();
            let g = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let grads: Vec<Tensor> = [&q, &k, &v, &s]
                .iter()
                .map(|t| g.get(t.as_tensor()).unwrap().clone())
                .collect();
            (out, grads)
        };
        for fused in [true, false] {
            let per_rank = InProcessWorld::run(ranks, |rank, cp| {
                let (index, pos) = local(rank, ranks, chunk, &global, 1);
                let s = Var::from_tensor(&sinks).unwrap();
                let mask = RingMask::new(&pos, &cp, None)
                    .unwrap()
                    .with_sinks(Some(s.as_tensor().clone()));
                let mask = if fused { mask } else { mask.blockwise() };
                let mine =
                    |t: &Tensor| Var::from_tensor(&t.index_select(&index, 2).unwrap()).unwrap();
                let (ql, kl, vl) = (mine(&q), mine(&k), mine(&v));
                let out = ring_attention(&ql, &kl, &vl, &mask).unwrap();
                let wl = w.index_select(&index, 2).unwrap();
                let g = (&out * &wl).unwrap().sum_all().unwrap().backward().unwrap();
                let grads: Vec<Tensor> = [&ql, &kl, &vl, &s]
                    .iter()
                    .map(|t| g.get(t.as_tensor()).unwrap().clone())
                    .collect();
                (index, out, grads)
            });
            let mut dsinks = sinks.zeros_like().unwrap();
            for (index, out, grads) in &per_rank {
                let rows = |t: &Tensor| t.index_select(index, 2).unwrap();
                assert!(diff(out, &rows(&whole.0)) < 1e-5, "fused {fused}: output");
                for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                    let d = diff(&grads[i], &rows(&whole.1[i]));
                    assert!(d < 1e-4, "fused {fused}: {name} differs by {d:e}");
                }
                dsinks = (dsinks + &grads[3]).unwrap();
            }
            let d = diff(&dsinks, &whole.1[3]);
            assert!(d < 1e-4, "fused {fused}: dsinks differs by {d:e}");
        }
    }

    /// Merging by log-sum-exp: a part a row does not reach changes nothing, a row no part has
    /// reached stays zero with minus infinity, and two parts weigh by their sums.
    #[test]
    fn merge_weighs_by_log_sum_exp() {
        let dev = Device::Cpu;
        let inf = f32::NEG_INFINITY;
        let t = |v: &[f32], shape: (usize, usize, usize, usize)| {
            Tensor::from_vec(v.to_vec(), shape, &dev).unwrap()
        };
        // Three rows of d = 1: reached by the first part only, by neither, by both.
        let a = (
            t(&[1.0, 0.0, 2.0], (1, 1, 3, 1)),
            t(&[0.5, inf, 0.0], (1, 1, 1, 3)).squeeze(2).unwrap(),
        );
        let b = (
            t(&[7.0, 0.0, 4.0], (1, 1, 3, 1)),
            t(&[inf, inf, 0.0], (1, 1, 1, 3)).squeeze(2).unwrap(),
        );
        let (o, l) = merge(Some(a), b).unwrap();
        let o = o.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let l = l.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(o, [1.0, 0.0, 3.0]);
        assert_eq!(l[0], 0.5);
        assert_eq!(l[1], inf);
        assert!((l[2] - 2f32.ln()).abs() < 1e-6);
    }
}
