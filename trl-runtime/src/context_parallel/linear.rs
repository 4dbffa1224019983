//! Context parallelism (cp, ring attention's split) for linear attention: the gated delta
//! rule of Gated DeltaNet layers, whose state carries the whole row before a token, as
//! flash-linear-attention's context parallelism runs it.
//!
//! Each rank holds two chunks of every row (ring attention's head-tail balanced split: chunks
//! r and 2n - 1 - r of 2n). A chunk's rule is affine in the state it starts from, column by
//! column: S_out = A S_in + B, A [dk, dk] the chunk's product of decays and corrections
//! (zero from a document start on), B [dk, dv] what the chunk writes from a zero state. So:
//! 1. each rank runs the rule over its chunks once, from the state [0 | I] with values
//!    [v | 0]: its final state is [B | A], and each token's output [o_t | A_t^T q_t], what
//!    the token reads of its chunk's own writes and how it reads the state the chunk starts
//!    from (A_t: the map up to t);
//! 2. an all-gather of every chunk's (A, B) (h x dk x (dk + dv) per row and chunk: nothing
//!    grows with the sequence);
//! 3. every rank scans the maps in row order for the states S its chunks start from (2n
//!    small products);
//! 4. each token's output is o_t + (A_t^T q_t)^T S, one product per chunk.
//!
//! No rank waits for another's chunk, and all is autograd (the all-gather's adjoint is a
//! reduce-scatter), so the backward carries each chunk's state gradient to the chunks before.
//! The rule runs once over dv + dk columns: twice one process's work per token when dk = dv,
//! which the ranks share (each does 2/n of it); the projections, the convolution and the
//! gated norm stay per token. The convolution's first `kernel - 1` taps of a chunk read the
//! chunk before ([`with_halo`]).
//!
//! Splitting by heads does 1/n of the rule per rank instead, between two all-to-alls of every
//! token's projections (`models::gated_deltanet`): the layers take it where the key heads
//! divide by the cp size and this scan where they do not (and under `TRL_LINEAR_CP=scan`).

use crate::comm::autograd::all_gather;
use crate::context_parallel::SeqSplit;
use crate::error::{Error, Result};
use crate::nn::gated_delta::{rule, DeltaInputs};
use candle_core::Tensor;

/// The chunks of the row (of 2 x ranks) that `rank` holds, in its local order.
fn chunks_of(rank: usize, ranks: usize) -> [usize; 2] {
    [rank, 2 * ranks - 1 - rank]
}

/// Where chunk `c` of the row sits among all-gathered chunks (rank by rank, two each).
fn gathered(c: usize, ranks: usize) -> usize {
    match c < ranks {
        true => 2 * c,
        false => 2 * (2 * ranks - 1 - c) + 1,
    }
}

fn ring_of(split: &SeqSplit) -> Result<(usize, usize)> {
    match split.ring {
        true => Ok((split.group.rank(), split.group.size())),
        false => Err(Error::Parallelism(
            "the linear-attention scan runs over ring attention's chunks (cp), not Ulysses'".into(),
        )),
    }
}

/// This rank's two chunks of `x` [b, 2m, channels] as rows of their own, [2b, width + m,
/// channels], each led by the last `width` tokens of the row before it (zeros before the
/// row's start), gathered from the ranks that hold them; and the document starts of those
/// rows, from the whole rows' `starts` (in row order). A causal convolution of `width + 1`
/// taps over them gives each chunk's tokens what it gives them over the whole rows.
pub fn with_halo(
    x: &Tensor,
    split: &SeqSplit,
    width: usize,
    starts: &[Vec<bool>],
) -> Result<(Tensor, Vec<Vec<bool>>)> {
    let (rank, ranks) = ring_of(split)?;
    let (b, t, channels) = x.dims3()?;
    let m = t / 2;
    let mine = chunks_of(rank, ranks);
    let halves = x.reshape((b, 2, m, channels))?;
    // Every chunk's last tokens (all of a chunk shorter than the halo).
    let tail = width.min(m);
    let tails = halves.narrow(2, m - tail, tail)?.contiguous()?;
    let tails = all_gather(&tails, &split.group, 1)?;
    let front = Tensor::zeros((b, width, channels), x.dtype(), x.device())?;
    let mut rows = Vec::with_capacity(2);
    for (half, &c) in mine.iter().enumerate() {
        // The chunks before c, nearest last, until `width` tokens are there.
        let back = match tail {
            0 => 0,
            _ => c.min(width.div_ceil(tail)),
        };
        let mut pieces = vec![front.clone()];
        for before in c - back..c {
            pieces.push(tails.narrow(1, gathered(before, ranks), 1)?.squeeze(1)?);
        }
        let seen = Tensor::cat(&pieces, 1)?;
        let halo = seen.narrow(1, seen.dim(1)? - width, width)?;
        rows.push(Tensor::cat(
            &[&halo, &halves.narrow(1, half, 1)?.squeeze(1)?],
            1,
        )?);
    }
    // [b, 2, width + m, channels] -> rows (row, half).
    let rows = Tensor::stack(&rows, 1)?.reshape((2 * b, width + m, channels))?;
    let mut row_starts = Vec::with_capacity(2 * b);
    for row in starts {
        for &c in &mine {
            row_starts.push(
                (0..width + m)
                    .map(|i| match (c * m + i).checked_sub(width) {
                        Some(p) => row[p],
                        // Before the row: zeros, one document of their own.
                        None => i == 0,
                    })
                    .collect(),
            );
        }
    }
    Ok((rows, row_starts))
}

/// The document starts of this rank's chunks as rows (row, half), from the whole rows'
/// `starts` in row order; each chunk `m` tokens.
pub fn chunk_starts(split: &SeqSplit, starts: &[Vec<bool>], m: usize) -> Result<Vec<Vec<bool>>> {
    let (rank, ranks) = ring_of(split)?;
    let mine = chunks_of(rank, ranks);
    Ok(starts
        .iter()
        .flat_map(|row| mine.map(|c| row[c * m..(c + 1) * m].to_vec()))
        .collect())
}

/// The gated delta rule over this rank's chunks `x` (rows (row, half) of [2b, h, m, d], each
/// chunk a row, `x.starts` from [`chunk_starts`]), every chunk from the state the row
/// reaches before it: the outputs [2b, h, m, dv], as one process's rule over the whole rows
/// gives them for these tokens. `chunk`: the rule's chunk length where it runs in chunks.
pub fn scan_rule(x: &DeltaInputs, split: &SeqSplit, chunk: usize) -> Result<Tensor> {
    let (rank, ranks) = ring_of(split)?;
    let (rows, h, m, dk) = x.k.dims4()?;
    let dv = x.v.dim(3)?;
    let b = rows / 2;
    let (dtype, dev) = (x.v.dtype(), x.v.device());
    // 1. One run over [v | 0] from [0 | I]: each token's output [o | A_t^T q] (what it reads
    //    of its chunk's own writes, and how it reads the state the chunk starts from), and
    //    the final state [B | A], the chunk's map.
    let values = Tensor::cat(&[x.v, &Tensor::zeros((rows, h, m, dk), dtype, dev)?], 3)?;
    let identity = Tensor::eye(dk, dtype, dev)?.broadcast_as((rows, h, dk, dk))?;
    let from = Tensor::cat(
        &[&Tensor::zeros((rows, h, dk, dv), dtype, dev)?, &identity],
        3,
    )?;
    let run = DeltaInputs { v: &values, ..*x };
    let (out, maps) = rule(&run, Some(&from), chunk)?;
    // 2. Every chunk's, rank by rank: [b, 2 x ranks, h, dk, dv + dk].
    let maps = maps.reshape((b, 2, h, dk, dv + dk))?;
    let maps = all_gather(&maps.contiguous()?, &split.group, 1)?;
    // 3. The scan in row order, as far as this rank's later chunk.
    let mine = chunks_of(rank, ranks);
    let mut state = Tensor::zeros((b, h, dk, dv), dtype, dev)?;
    let mut starting = [None, None];
    for c in 0..=mine[1] {
        for (half, &at) in mine.iter().enumerate() {
            if at == c {
                starting[half] = Some(state.clone());
            }
        }
        if c == mine[1] {
            break;
        }
        let map = maps.narrow(1, gathered(c, ranks), 1)?.squeeze(1)?;
        let (written, carried) = (map.narrow(3, 0, dv)?, map.narrow(3, dv, dk)?);
        state = (carried.contiguous()?.matmul(&state)? + written)?;
    }
    let [Some(first), Some(second)] = starting else {
        return Err(Error::Parallelism(format!(
            "cp rank {rank}: its chunks {mine:?} were not reached by the scan"
        )));
    };
    let initial = Tensor::stack(&[first, second], 1)?.reshape((rows, h, dk, dv))?;
    // 4. Each token's output from its chunk's starting state S: o + (A_t^T q)^T S.
    let (own, reach) = (out.narrow(3, 0, dv)?, out.narrow(3, dv, dk)?.contiguous()?);
    let out = (own + reach.matmul(&initial)?)?;
    Ok(out)
}

/// Whether a Gated DeltaNet layer of `key_heads` runs this scan under `split` (ring
/// attention's): where its key heads do not divide by the cp size (splitting by heads needs
/// them to), or where `TRL_LINEAR_CP=scan` asks for it. Otherwise splitting by heads does
/// less of the rule per rank (1/n against 2/n).
pub fn scans(key_heads: usize, split: &SeqSplit) -> bool {
    // Read at each forward (a layer's work dwarfs it), so that a bench compares both.
    let forced = std::env::var("TRL_LINEAR_CP").is_ok_and(|v| v == "scan");
    split.ring && (forced || !key_heads.is_multiple_of(split.group.size()))
}
