//! The gated delta rule of Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear-attention
//! layers): per head a state S [dk, dv] that each token decays by exp(g_t), corrects toward
//! its value (the delta rule: S <- S + beta_t k_t (v_t - S^T k_t)^T) and reads with its
//! query (o_t = S^T q_t), as transformers' torch_recurrent_gated_delta_rule computes token by
//! token ([`recurrent`]).
//!
//! [`chunked`] computes the same in chunks of C tokens, as flash-linear-attention's chunk
//! algorithm (and transformers' torch_chunk_gated_delta_rule) does: within a chunk the
//! corrections are solved at once (the UT transform: a unit lower-triangular system in the
//! chunk's keys), and a scan over the chunks carries the state, one matmul per chunk instead
//! of one update per token. Both are plain Candle ops, so autograd gives their backward.
//!
//! Documents of packed rows (positions that restart) start from a zero state, as each
//! document alone would: within a chunk the decays are cumulated per document and the
//! pairs across a document start masked, the incoming state read only by tokens of the
//! document it belongs to. An initial state may be given and the final one is returned: the
//! scan that context parallelism runs over ranks (each rank's chunk of the row starts from
//! the state the previous one ends with), and generation's recurrent cache.

use candle_core::{DType, Result, Tensor, D};

/// Inputs per head: `q`, `k` [b, h, s, dk] (normalised and scaled by the caller), `v` [b,
/// h, s, dv], the log decays `g` [b, h, s] (<= 0) and the write strengths `beta` [b, h, s];
/// `starts[b][t]` whether token t of row b opens a document (its state starts at zero).
pub struct DeltaInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
    pub starts: &'a [Vec<bool>],
}

/// Which tokens open a document in each row of `position_ids` [b, s]: a position that does
/// not follow its predecessor, and the first token when it is at position 0 (a row that
/// continues a document, a context-parallel rank's later chunk, does not open one).
pub fn document_starts(position_ids: &Tensor) -> Result<Vec<Vec<bool>>> {
    let rows: Vec<Vec<i64>> = position_ids.to_dtype(DType::I64)?.to_vec2()?;
    Ok(rows
        .iter()
        .map(|row| {
            (0..row.len())
                .map(|i| match i {
                    0 => row[0] == 0,
                    _ => row[i] != row[i - 1] + 1,
                })
                .collect()
        })
        .collect())
}

/// The rule as the layers run it: the fused kernel (`kernels::gated_delta`, the recurrence
/// with its block of the state in cache, backward included) where it applies (the CPU in f32
/// and f64; a GPU in f32 with `TRL_DELTA_RULE=fused`, see `fused_here`); elsewhere one step
/// of [`recurrent`] for a decoded token from a state, and [`chunked`] in chunks of `chunk`
/// tokens otherwise. `TRL_DELTA_RULE=chunked` keeps the chunk form on the CPU too, to compare.
pub fn rule(x: &DeltaInputs, initial: Option<&Tensor>, chunk: usize) -> Result<(Tensor, Tensor)> {
    use crate::kernels::gated_delta::{delta_rule, fused_here};
    if fused_here(x.k, x.v) {
        return delta_rule(x.q, x.k, x.v, x.g, x.beta, x.starts, initial);
    }
    match (x.v.dim(2)?, initial) {
        (1, Some(state)) => recurrent(x, Some(state)),
        (_, initial) => chunked(x, initial, chunk),
    }
}

/// Token by token: the outputs [b, h, s, dv] and the final state [b, h, dk, dv], from
/// `initial` (zeros when None).
pub fn recurrent(x: &DeltaInputs, initial: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let (b, h, s, dk) = x.k.dims4()?;
    let dv = x.v.dim(3)?;
    let mut state = match initial {
        Some(s) => s.clone(),
        None => Tensor::zeros((b, h, dk, dv), x.v.dtype(), x.v.device())?,
    };
    let mut outs = Vec::with_capacity(s);
    for t in 0..s {
        // A document start: the state of the one before does not reach it.
        let keep: Vec<f32> = (0..b)
            .map(|r| f32::from(u8::from(!x.starts[r][t])))
            .collect();
        let keep = Tensor::from_vec(keep, (b, 1, 1, 1), x.v.device())?.to_dtype(x.v.dtype())?;
        let at = |t3: &Tensor| t3.narrow(2, t, 1)?.contiguous();
        let decay = at(x.g)?.exp()?.unsqueeze(3)?.broadcast_mul(&keep)?;
        state = state.broadcast_mul(&decay)?;
        let (q, k, v) = (at(x.q)?, at(x.k)?, at(x.v)?);
        let beta = at(x.beta)?.unsqueeze(3)?;
        // S^T k: what the state predicts for k, [b, h, 1, dv].
        let predicted = k.matmul(&state)?;
        let delta = (v - predicted)?.broadcast_mul(&beta)?;
        state = (state + k.transpose(2, 3)?.contiguous()?.matmul(&delta)?)?;
        outs.push(q.matmul(&state)?);
    }
    Ok((Tensor::cat(&outs, 2)?, state))
}

/// The masks of one row's chunks, from its document starts.
struct ChunkMasks {
    /// [n, C, C]: key j is in query i's document, j <= i.
    same: Vec<f32>,
    /// [n, C]: token i reads the state the chunk starts with (no document starts in the
    /// chunk up to it).
    carry: Vec<f32>,
    /// [n, C]: token i is in the document of the chunk's last token.
    to_end: Vec<f32>,
}

fn chunk_masks(starts: &[bool], n: usize, c: usize) -> ChunkMasks {
    let (mut same, mut carry, mut to_end) =
        (vec![0f32; n * c * c], vec![0f32; n * c], vec![0f32; n * c]);
    // Document index of every (padded) token: padding continues the last document.
    let mut doc = vec![0usize; n * c];
    for t in 1..n * c {
        doc[t] = doc[t - 1] + usize::from(starts.get(t).copied().unwrap_or(false));
    }
    let opens = |t: usize| starts.get(t).copied().unwrap_or(false);
    for ch in 0..n {
        let base = ch * c;
        let mut open = true;
        for i in 0..c {
            open &= !opens(base + i);
            carry[base + i] = f32::from(u8::from(open));
            to_end[base + i] = f32::from(u8::from(doc[base + i] == doc[base + c - 1]));
            for j in 0..=i {
                if doc[base + i] == doc[base + j] {
                    same[(base + i) * c + j] = 1.0;
                }
            }
        }
    }
    ChunkMasks {
        same,
        carry,
        to_end,
    }
}

/// In chunks of `chunk` tokens (the flash-linear-attention algorithm): the outputs [b, h,
/// s, dv] and the final state [b, h, dk, dv], from `initial` (zeros when None). Equal to
/// [`recurrent`] up to rounding.
pub fn chunked(
    x: &DeltaInputs,
    initial: Option<&Tensor>,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    let (b, h, s, dk) = x.k.dims4()?;
    let dv = x.v.dim(3)?;
    let (dtype, dev) = (x.v.dtype(), x.v.device());
    let c = chunk.max(1);
    let n = s.div_ceil(c);
    let pad = n * c - s;
    // Padding: zero keys, values, decays and strengths change nothing.
    let padded = |t: &Tensor, dim: usize| -> Result<Tensor> {
        match pad {
            0 => Ok(t.clone()),
            _ => t.pad_with_zeros(dim, 0, pad),
        }
    };
    // Candle's batched matmul takes two batch dimensions: (b x h, chunk).
    let bh = b * h;
    let chunks4 = |t: &Tensor| -> Result<Tensor> {
        let d = t.dim(3)?;
        padded(t, 2)?.reshape((bh, n, c, d))
    };
    let (q, k, v) = (chunks4(x.q)?, chunks4(x.k)?, chunks4(x.v)?);
    let g = padded(x.g, 2)?.reshape((bh, n, c))?;
    let beta = padded(x.beta, 2)?.reshape((bh, n, c, 1))?;
    // The rows' masks, repeated for each head: [b x h, n, ...].
    let masks: Vec<ChunkMasks> = x.starts.iter().map(|st| chunk_masks(st, n, c)).collect();
    let stack = |f: &dyn Fn(&ChunkMasks) -> &Vec<f32>, per_row: &[usize]| -> Result<Tensor> {
        let all: Vec<f32> = masks.iter().flat_map(|m| f(m).iter().copied()).collect();
        let mut shape = vec![b, 1];
        shape.extend_from_slice(per_row);
        let t = Tensor::from_vec(all, shape.as_slice(), dev)?.to_dtype(dtype)?;
        shape[1] = h;
        let t = t.broadcast_as(shape.as_slice())?.contiguous()?;
        let mut flat = vec![bh];
        flat.extend_from_slice(per_row);
        t.reshape(flat.as_slice())
    };
    let same = stack(&|m| &m.same, &[n, c, c])?;
    let carry = stack(&|m| &m.carry, &[n, c])?;
    let to_end = stack(&|m| &m.to_end, &[n, c])?;
    // Decays cumulated within each document of a chunk: G_i = sum of g_j, j <= i in i's
    // document (a masked matmul, so its gradient reaches every g).
    let cum = same.matmul(&g.unsqueeze(3)?.contiguous()?)?.squeeze(3)?;
    // exp(G_i - G_j) for j <= i in one document, 0 elsewhere (masked before the exp: no
    // overflow above the diagonal).
    let diff = cum.unsqueeze(3)?.broadcast_sub(&cum.unsqueeze(2)?)?;
    let hidden = Tensor::full(-1e30f32, diff.shape(), dev)?.to_dtype(dtype)?;
    let pairwise = same.ne(0.0)?.where_cond(&diff, &hidden)?.exp()?;
    let k_beta = k.broadcast_mul(&beta)?;
    let v_beta = v.broadcast_mul(&beta)?;
    let k_t = k.transpose(2, 3)?.contiguous()?;
    // The UT system's strictly lower part, L = tril(k_beta k^T ⊙ pairwise, -1).
    let strictly = {
        let lower: Vec<f32> = (0..c * c)
            .map(|e| f32::from(u8::from(e / c > e % c)))
            .collect();
        Tensor::from_vec(lower, (c, c), dev)?.to_dtype(dtype)?
    };
    let l = (k_beta.matmul(&k_t)? * &pairwise)?.broadcast_mul(&strictly)?;
    // (I + L) [U | W] = [v_beta | k_beta exp(G) carry], by forward substitution over the
    // chunk's rows (every chunk at once).
    let incoming = (cum.exp()?.broadcast_mul(&carry)?).unsqueeze(3)?;
    let rhs = Tensor::cat(&[&v_beta, &k_beta.broadcast_mul(&incoming)?], 3)?;
    let mut rows: Vec<Tensor> = Vec::with_capacity(c);
    for i in 0..c {
        let r = rhs.narrow(2, i, 1)?;
        let row = match i {
            0 => r,
            _ => {
                let prev = Tensor::cat(&rows, 2)?;
                let li = l.narrow(2, i, 1)?.narrow(3, 0, i)?.contiguous()?;
                (r - li.matmul(&prev)?)?
            }
        };
        rows.push(row);
    }
    let solved = Tensor::cat(&rows, 2)?;
    let (u, w) = (solved.narrow(3, 0, dv)?, solved.narrow(3, dv, dk)?);
    // Within-chunk scores (diagonal included) and the decayed reads of the state.
    let intra = (q.matmul(&k_t)? * &pairwise)?;
    let q_in = q.broadcast_mul(&incoming)?;
    let last = cum.narrow(2, c - 1, 1)?;
    let to_last = last.broadcast_sub(&cum)?.exp()?.broadcast_mul(&to_end)?;
    let k_out = k.broadcast_mul(&to_last.unsqueeze(3)?)?;
    let chunk_decay = last.exp()?.broadcast_mul(&carry.narrow(2, c - 1, 1)?)?;
    let mut state = match initial {
        Some(s) => s.reshape((bh, dk, dv))?,
        None => Tensor::zeros((bh, dk, dv), dtype, dev)?,
    };
    let mut outs = Vec::with_capacity(n);
    for ch in 0..n {
        let at = |t: &Tensor| t.narrow(1, ch, 1)?.squeeze(1)?.contiguous();
        let v_new = (at(&u)? - at(&w)?.matmul(&state)?)?;
        outs.push((at(&q_in)?.matmul(&state)? + at(&intra)?.matmul(&v_new)?)?);
        let kept = state.broadcast_mul(&at(&chunk_decay)?.unsqueeze(2)?)?;
        let written = at(&k_out)?.transpose(1, 2)?.contiguous()?.matmul(&v_new)?;
        state = (kept + written)?;
    }
    let out = Tensor::cat(&outs, 1)?
        .reshape((b, h, n * c, dv))?
        .narrow(2, 0, s)?;
    Ok((out, state.reshape((b, h, dk, dv))?))
}

/// transformers' l2norm (flash-linear-attention's): x / sqrt(sum(x^2) + eps) over the last
/// dimension.
pub fn l2_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let norm = (x.sqr()?.sum_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The largest difference of two f64 tensors.
    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .and_then(|d| d.abs()?.max_all()?.to_scalar::<f64>())
            .unwrap()
    }

    /// Random inputs: normalised keys and queries as the model feeds them.
    fn random_inputs(
        (b, h, s, dk, dv): (usize, usize, usize, usize, usize),
        dev: &Device,
    ) -> Result<[candle_core::Var; 5]> {
        use candle_core::Var;
        let q = l2_normalize(&Tensor::randn(0f64, 1.0, (b, h, s, dk), dev)?, 1e-6)?;
        let q = (q / (dk as f64).sqrt())?;
        let k = l2_normalize(&Tensor::randn(0f64, 1.0, (b, h, s, dk), dev)?, 1e-6)?;
        let v = Tensor::randn(0f64, 1.0, (b, h, s, dv), dev)?;
        // Decays in (-0.5, 0] and strengths in (0, 1), as the model's softplus and sigmoid give.
        let g = (Tensor::rand(0f64, 1.0, (b, h, s), dev)? * -0.5)?;
        let beta = Tensor::rand(0.05f64, 0.95, (b, h, s), dev)?;
        Ok([
            Var::from_tensor(&q)?,
            Var::from_tensor(&k)?,
            Var::from_tensor(&v)?,
            Var::from_tensor(&g)?,
            Var::from_tensor(&beta)?,
        ])
    }

    fn starts(rows: &[&[i64]]) -> Vec<Vec<bool>> {
        let s = rows[0].len();
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        document_starts(&Tensor::from_vec(flat, (rows.len(), s), &Device::Cpu).unwrap()).unwrap()
    }

    /// The rule's inputs from random ones' variables.
    fn of_vars<'a>(vars: [&'a candle_core::Var; 5], starts: &'a [Vec<bool>]) -> DeltaInputs<'a> {
        let [q, k, v, g, beta] = vars.map(|v| v.as_tensor());
        DeltaInputs {
            q,
            k,
            v,
            g,
            beta,
            starts,
        }
    }

    /// A step's outputs, final state and the gradients of `vars` (the inputs, then the
    /// initial state) under a loss of fixed pseudo-random weights on both.
    fn outputs_and_gradients(
        vars: &[&candle_core::Var; 6],
        f: &dyn Fn() -> (Tensor, Tensor),
    ) -> (Tensor, Tensor, Vec<Tensor>) {
        let (out, state) = f();
        // Fixed weights (a seeded draw would not repeat across calls otherwise).
        let weigh = |t: &Tensor| {
            let n = t.elem_count();
            let w: Vec<f64> = (0..n)
                .map(|i| ((i * 7919 % 23) as f64 - 11.0) / 7.0)
                .collect();
            let w = Tensor::from_vec(w, t.shape(), t.device()).unwrap();
            (t.to_dtype(DType::F64).unwrap() * w)
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let loss = (weigh(&out) + weigh(&state)).unwrap();
        let grads = loss.backward().unwrap();
        let g = vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).unwrap().clone())
            .collect();
        (out, state, g)
    }

    /// Asserts that a step's outputs, state and gradients (as [`outputs_and_gradients`]
    /// gives them, in any float dtype) are within `tol` of `want` (gradients within `tol_grad`).
    fn assert_step_close(
        what: &str,
        got: &(Tensor, Tensor, Vec<Tensor>),
        want: &(Tensor, Tensor, Vec<Tensor>),
        (tol, tol_grad): (f64, f64),
    ) {
        let wide = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let d = max_abs_diff(&wide(&got.0), &want.0);
        assert!(d < tol, "{what}: outputs differ by {d}");
        let d = max_abs_diff(&wide(&got.1), &want.1);
        assert!(d < tol, "{what}: states differ by {d}");
        for (name, (a, e)) in ["q", "k", "v", "g", "beta", "initial state"]
            .iter()
            .zip(got.2.iter().zip(&want.2))
        {
            let d = max_abs_diff(&wide(a), e);
            assert!(d < tol_grad, "{what}: d{name} differs by {d}");
        }
    }

    /// The chunk form and the fused CPU kernel equal token by token: outputs, final state
    /// and every input's gradient in f64, on packed rows whose documents start inside chunks
    /// and on chunk boundaries (row 0: documents of 9, 20 and 8 tokens; row 1: one document
    /// continued from the initial state), for chunk sizes that do and do not divide the row;
    /// the kernel over more value columns than one of its blocks holds and more tokens than
    /// one checkpoint spans (neither dividing evenly), in f32 within f32's rounding.
    #[test]
    fn chunks_and_the_fused_kernel_equal_the_recurrence_values_and_gradients() {
        use crate::kernels::gated_delta::{delta_rule, fused_here};
        let dev = Device::Cpu;
        let (b, h, s, dk, dv) = (2, 2, 37, 5, 35);
        let [q, k, v, g, beta] = random_inputs((b, h, s, dk, dv), &dev).unwrap();
        let row0: Vec<i64> = (0..9).chain(0..20).chain(0..8).collect();
        let row1: Vec<i64> = (3..40).collect();
        let starts = starts(&[&row0, &row1]);
        let init = candle_core::Var::randn(0f64, 0.5, (b, h, dk, dv), &dev).unwrap();
        let vars = [&q, &k, &v, &g, &beta, &init];
        let x = of_vars([&q, &k, &v, &g, &beta], &starts);
        let run = |f: &dyn Fn() -> (Tensor, Tensor)| outputs_and_gradients(&vars, f);
        let want = run(&|| recurrent(&x, Some(init.as_tensor())).unwrap());
        for chunk in [1, 3, 4, 16] {
            let got = run(&|| chunked(&x, Some(init.as_tensor()), chunk).unwrap());
            assert_step_close(&format!("chunk {chunk}"), &got, &want, (1e-10, 1e-9));
        }
        let fused = |dtype: DType| {
            let at = |t: &candle_core::Var| t.as_tensor().to_dtype(dtype).unwrap();
            let (q, k, v, g, beta, init) = (at(&q), at(&k), at(&v), at(&g), at(&beta), at(&init));
            delta_rule(&q, &k, &v, &g, &beta, &starts, Some(&init)).unwrap()
        };
        assert_step_close(
            "fused f64",
            &run(&|| fused(DType::F64)),
            &want,
            (1e-12, 1e-11),
        );
        assert_step_close(
            "fused f32",
            &run(&|| fused(DType::F32)),
            &want,
            (1e-5, 1e-4),
        );
        // The layers' `rule` takes the fused kernel here (f64 on the CPU).
        assert!(fused_here(x.k, x.v), "the CPU runs the fused kernel");
        // Without an initial state: zeros, as the recurrence starts.
        let (a, _) = recurrent(&x, None).unwrap();
        let (e, _) = delta_rule(x.q, x.k, x.v, x.g, x.beta, &starts, None).unwrap();
        assert!(max_abs_diff(&a, &e) < 1e-12);
        // The documents matter: without the starts the outputs move.
        let joined = vec![vec![false; s]; b];
        let x2 = DeltaInputs {
            starts: &joined,
            ..x
        };
        let (other, _) = chunked(&x2, Some(init.as_tensor()), 4).unwrap();
        assert!(max_abs_diff(&other, &want.0) > 1e-3);
    }

    /// Decoding token by token with the fused kernel, each step's state carried as the view
    /// into its output that the kernel returns and the next step reads in place (no copy):
    /// the outputs, the final state and every input's gradient (through the chain of views)
    /// equal the recurrence over the whole row, f64.
    #[test]
    fn decode_steps_read_the_carried_state_in_place() {
        use crate::kernels::gated_delta::delta_rule;
        let dev = Device::Cpu;
        let (b, h, s, dk, dv) = (2, 3, 5, 16, 40);
        let [q, k, v, g, beta] = random_inputs((b, h, s, dk, dv), &dev).unwrap();
        let init = candle_core::Var::randn(0f64, 0.5, (b, h, dk, dv), &dev).unwrap();
        let vars = [&q, &k, &v, &g, &beta, &init];
        let starts = vec![vec![false; s]; b];
        let x = of_vars([&q, &k, &v, &g, &beta], &starts);
        let want = outputs_and_gradients(&vars, &|| recurrent(&x, Some(init.as_tensor())).unwrap());
        let got = outputs_and_gradients(&vars, &|| {
            let one_token = vec![vec![false; 1]; b];
            let mut state = init.as_tensor().clone();
            let mut outs = Vec::new();
            for t in 0..s {
                let at = |x: &candle_core::Var| x.as_tensor().narrow(2, t, 1).unwrap();
                let (o, next) = delta_rule(
                    &at(&q),
                    &at(&k),
                    &at(&v),
                    &at(&g),
                    &at(&beta),
                    &one_token,
                    Some(&state),
                )
                .unwrap();
                // A view, read in place by the next step.
                assert!(!next.is_contiguous(), "token {t}: the state was copied");
                outs.push(o);
                state = next;
            }
            (Tensor::cat(&outs, 2).unwrap(), state)
        });
        assert_step_close("token by token", &got, &want, (1e-12, 1e-11));
    }

    /// A packed document's outputs are those it has alone; and a row split in two, the
    /// second part started from the first's final state (the scan over context-parallel
    /// ranks), gives the whole row's outputs and state.
    #[test]
    fn documents_start_from_zero_and_states_carry_across_splits() {
        let dev = Device::Cpu;
        let (h, s, dk, dv) = (2, 10, 4, 3);
        let [q, k, v, g, beta] = random_inputs((1, h, s, dk, dv), &dev).unwrap();
        let (q, k, v, g, beta) = (
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            g.as_tensor(),
            beta.as_tensor(),
        );
        let packed = starts(&[&(0..4).chain(0..6).collect::<Vec<i64>>()]);
        let x = DeltaInputs {
            q,
            k,
            v,
            g,
            beta,
            starts: &packed,
        };
        let (whole, _) = chunked(&x, None, 3).unwrap();
        let part = |t: &Tensor, from: usize, len: usize| t.narrow(2, from, len).unwrap();
        let alone = starts(&[&(0..6).collect::<Vec<i64>>()]);
        let (q2, k2, v2, g2, b2) = (
            part(q, 4, 6),
            part(k, 4, 6),
            part(v, 4, 6),
            part(g, 4, 6),
            part(beta, 4, 6),
        );
        let second = DeltaInputs {
            q: &q2,
            k: &k2,
            v: &v2,
            g: &g2,
            beta: &b2,
            starts: &alone,
        };
        let (want, _) = chunked(&second, None, 3).unwrap();
        assert!(max_abs_diff(&part(&whole, 4, 6), &want) < 1e-12);
        // One document of 10, in two parts of 7 and 3.
        let one = starts(&[&(0..10).collect::<Vec<i64>>()]);
        let x = DeltaInputs { starts: &one, ..x };
        let (whole, whole_state) = chunked(&x, None, 4).unwrap();
        let parts = |from: usize, len: usize| [q, k, v, g, beta].map(|t| part(t, from, len));
        let ([q1, k1, v1, g1, b1], [q2, k2, v2, g2, b2]) = (parts(0, 7), parts(7, 3));
        let first_starts = starts(&[&(0..7).collect::<Vec<i64>>()]);
        let rest_starts = starts(&[&(7..10).collect::<Vec<i64>>()]);
        let first = DeltaInputs {
            q: &q1,
            k: &k1,
            v: &v1,
            g: &g1,
            beta: &b1,
            starts: &first_starts,
        };
        let rest = DeltaInputs {
            q: &q2,
            k: &k2,
            v: &v2,
            g: &g2,
            beta: &b2,
            starts: &rest_starts,
        };
        let (a, mid) = chunked(&first, None, 4).unwrap();
        let (b, end) = chunked(&rest, Some(&mid), 4).unwrap();
        let joined = Tensor::cat(&[a, b], 2).unwrap();
        assert!(max_abs_diff(&joined, &whole) < 1e-12);
        assert!(max_abs_diff(&end, &whole_state) < 1e-12);
    }
}
