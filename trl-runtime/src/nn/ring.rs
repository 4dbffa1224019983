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
//! Each step holds one local-by-remote block of scores ([2L/2cp]^2 per head), not [L x L].

use super::attention::document_ids;
use super::precomputed::{attention_result, AttentionBackward};
use crate::comm::Communicator;
use candle_core::{DType, Result, Tensor, D};
use std::sync::Arc;

/// Added to masked scores; the 0/1 mask multiplies the probabilities as well, so a row that
/// sees nothing in one step adds nothing.
const MASKED: f32 = -1e30;

/// The global token index of each of rank `rank`'s local positions (its two chunks of `chunk`
/// tokens) among `2 * size` chunks.
pub fn balanced_indices(rank: usize, size: usize, chunk: usize) -> Vec<usize> {
    let tail = 2 * size - 1 - rank;
    (rank * chunk..(rank + 1) * chunk)
        .chain(tail * chunk..(tail + 1) * chunk)
        .collect()
}

/// Which keys every local query sees: its global index and the global index where its
/// document starts, per batch row.
#[derive(Debug, Clone)]
pub struct RingMask {
    /// Global index of each local position.
    query_index: Vec<usize>,
    /// Per batch row, the document start of each local position.
    starts: Vec<Vec<usize>>,
    size: usize,
    chunk: usize,
}

impl RingMask {
    /// From this rank's global position ids [batch, 2 * chunk] (documents restart at 0),
    /// gathering every rank's to find where documents start (collective over `cp`).
    pub fn new(position_ids: &Tensor, cp: &dyn Communicator) -> Result<Self> {
        let (size, rank) = (cp.size(), cp.rank());
        let local = position_ids.to_dtype(DType::I64)?;
        let chunk = local.dim(1)? / 2;
        let all: Vec<Vec<i64>> = cp
            .all_gather(&local, 1)
            .map_err(|e| e.into_candle())?
            .to_vec2()?;
        let query_index = balanced_indices(rank, size, chunk);
        let mut starts = Vec::with_capacity(all.len());
        for row in &all {
            // Rows in global order: rank j's two chunks go to their places.
            let mut global = vec![0i64; row.len()];
            for j in 0..size {
                for (k, g) in balanced_indices(j, size, chunk).into_iter().enumerate() {
                    global[g] = row[j * 2 * chunk + k];
                }
            }
            let docs = document_ids(&global);
            let mut start_of = vec![0usize; global.len()];
            for i in 1..global.len() {
                start_of[i] = if docs[i] == docs[i - 1] {
                    start_of[i - 1]
                } else {
                    i
                };
            }
            starts.push(query_index.iter().map(|&g| start_of[g]).collect());
        }
        Ok(RingMask {
            query_index,
            starts,
            size,
            chunk,
        })
    }

    /// Additive mask and 0/1 visibility of the local queries over rank `src`'s keys:
    /// [batch, 1, 1, nq, nk] each.
    fn block(
        &self,
        src: usize,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<(Tensor, Tensor)> {
        let keys = balanced_indices(src, self.size, self.chunk);
        let (b, nq, nk) = (self.starts.len(), self.query_index.len(), keys.len());
        let mut vis = Vec::with_capacity(b * nq * nk);
        for row in &self.starts {
            for (&q, &st) in self.query_index.iter().zip(row) {
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
    /// Queries scaled by 1/sqrt(d): [b, kv, group * n, d].
    q: Tensor,
    b: usize,
    kv: usize,
    group: usize,
    n: usize,
    d: usize,
}

impl Ring<'_> {
    /// The rank whose keys this rank holds at step `t`.
    fn source(&self, t: usize) -> usize {
        (self.cp.rank() + self.cp.size() - t) % self.cp.size()
    }

    /// Sends `t` one hop along the ring (to rank + 1) and returns what rank - 1 sent.
    fn pass(&self, t: &Tensor) -> Result<Tensor> {
        let (r, n) = (self.cp.rank(), self.cp.size());
        self.cp
            .send_recv(t, (r + 1) % n, (r + n - 1) % n)
            .map_err(|e| e.into_candle())
    }

    /// Scores over `k` [b, kv, n, d] with the mask added, and the 0/1 visibility:
    /// [b, kv, group, n, n] each (visibility broadcast).
    fn scores(&self, k: &Tensor, src: usize) -> Result<(Tensor, Tensor)> {
        let (bias, vis) = self.mask.block(src, self.q.dtype(), self.q.device())?;
        let s = self
            .q
            .matmul(&k.t()?)?
            .reshape((self.b, self.kv, self.group, self.n, self.n))?
            .broadcast_add(&bias)?;
        Ok((s, vis))
    }

    fn forward(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, kv, g, n, d) = (self.b, self.kv, self.group, self.n, self.d);
        let (mut k, mut v) = (k.clone(), v.clone());
        let mut acc: Option<(Tensor, Tensor, Tensor)> = None;
        for t in 0..self.cp.size() {
            if t > 0 {
                (k, v) = (self.pass(&k)?, self.pass(&v)?);
            }
            let (s, vis) = self.scores(&k, self.source(t))?;
            let block_max = s.max_keepdim(D::Minus1)?;
            let max = match &acc {
                Some((m, _, _)) => m.maximum(&block_max)?,
                None => block_max,
            };
            let p = s.broadcast_sub(&max)?.exp()?.broadcast_mul(&vis)?;
            let pv = p
                .reshape((b, kv, g * n, n))?
                .matmul(&v)?
                .reshape((b, kv, g, n, d))?;
            let sum = p.sum_keepdim(D::Minus1)?;
            acc = Some(match acc {
                None => (max, sum, pv),
                Some((m, l, o)) => {
                    let c = (m - &max)?.exp()?;
                    (max, ((l * &c)? + sum)?, (o.broadcast_mul(&c)? + pv)?)
                }
            });
        }
        let (m, l, o) = acc.expect("at least one rank");
        let out = o.broadcast_div(&l)?.reshape((b, kv * g, n, d))?;
        Ok((out, (m + l.log()?)?))
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
        let five = (b, kv, g, n, d);
        let dsum = (dout.reshape(five)? * out.reshape(five)?)?.sum_keepdim(D::Minus1)?;
        let dout = dout.reshape((b, kv, g * n, d))?;
        let (mut k, mut v) = (k.clone(), v.clone());
        let mut dk = k.zeros_like()?;
        let mut dv = v.zeros_like()?;
        let mut dq = self.q.zeros_like()?;
        for t in 0..self.cp.size() {
            if t > 0 {
                (k, v) = (self.pass(&k)?, self.pass(&v)?);
                (dk, dv) = (self.pass(&dk)?, self.pass(&dv)?);
            }
            let (s, vis) = self.scores(&k, self.source(t))?;
            let p5 = s.broadcast_sub(lse)?.exp()?.broadcast_mul(&vis)?;
            let p = p5.reshape((b, kv, g * n, n))?;
            dv = (dv + p.t()?.matmul(&dout)?)?;
            let dp = dout.matmul(&v.t()?)?.reshape((b, kv, g, n, n))?;
            let ds = (p5 * dp.broadcast_sub(&dsum)?)?.reshape((b, kv, g * n, n))?;
            dq = (dq + ds.matmul(&k)?)?;
            dk = (dk + ds.t()?.matmul(&self.q)?)?;
        }
        // The gradients of the keys held last belong to the next rank: one more hop home.
        if self.cp.size() > 1 {
            (dk, dv) = (self.pass(&dk)?, self.pass(&dv)?);
        }
        let dq = (dq.reshape((b, kv * g, n, d))? * (1.0 / (d as f64).sqrt()))?;
        Ok([dq, dk, dv])
    }
}

fn ring<'a>(
    q: &Tensor,
    kv: usize,
    mask: &'a RingMask,
    cp: &'a Arc<dyn Communicator>,
) -> Result<Ring<'a>> {
    let (b, heads, n, d) = q.dims4()?;
    let group = heads / kv;
    let q = (q.detach() * (1.0 / (d as f64).sqrt()))?.reshape((b, kv, group * n, d))?;
    Ok(Ring {
        cp,
        mask,
        q,
        b,
        kv,
        group,
        n,
        d,
    })
}

/// What the ring backward needs besides q, k, v: the group, the mask and the forward's
/// log-sum-exp.
struct RingBackward {
    cp: Arc<dyn Communicator>,
    mask: RingMask,
    lse: Tensor,
}

impl AttentionBackward for RingBackward {
    const NAME: &'static str = "ring attention";

    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<[Tensor; 3]> {
        ring(q, k.dim(1)?, &self.mask, &self.cp)?.backward(k, v, out, &self.lse, dout)
    }
}

/// Attention of this rank's queries `q` [b, heads, 2 * chunk, d] over the keys and values of
/// every rank of `cp` (`k`, `v` [b, kv_heads, 2 * chunk, d] held here), under `mask`.
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &RingMask,
    cp: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let (heads, kv) = (q.dim(1)?, k.dim(1)?);
    if heads % kv != 0 {
        candle_core::bail!("{heads} attention heads cannot share {kv} key/value heads evenly");
    }
    let (k_in, v_in) = (k.detach().contiguous()?, v.detach().contiguous()?);
    let (out, lse) = ring(q, kv, mask, cp)?.forward(&k_in, &v_in)?;
    let backward = RingBackward {
        cp: cp.clone(),
        mask: mask.clone(),
        lse,
    };
    attention_result(q, k, v, out, backward)
}
