//! The shared-memory index arithmetic of the Hopper attention kernels (kernels/flash_sm90.cu),
//! proven on the CPU: its functions written again here line for line, the tensor cores'
//! reading of a no-swizzle K-major descriptor as the PTX ISA defines it (core matrices of 8
//! rows x 16 bytes; the leading byte offset between neighbours along k, the stride byte
//! offset along m or n), and the products they must give. A GPU run checks the kernel itself
//! against the CPU attention (`scripts/gpu-run tests` with `TRL_FLASH_WGMMA=1`).

/// flash_sm90.cu's `tiled<K>(mn, k)`: element offset of (mn, k) in a K-major tile K wide.
fn tiled(width: usize, mn: usize, k: usize) -> usize {
    ((mn >> 3) * (width >> 3) + (k >> 3)) * 64 + (mn & 7) * 8 + (k & 7)
}

/// flash_sm90.cu's `desc<K>`: (start, leading, stride) in bytes.
fn desc(start_bytes: usize, width: usize) -> (usize, usize, usize) {
    (start_bytes, 128, width / 8 * 128)
}

/// What a wgmma reads as element (row, k) of a [rows x 16] K-major operand at `d` (2-byte
/// elements): the PTX ISA's no-swizzle K-major layout.
fn read(
    smem: &[f32],
    (start, leading, stride): (usize, usize, usize),
    row: usize,
    k: usize,
) -> f32 {
    let byte = start + (row / 8) * stride + (k / 8) * leading + (row % 8) * 16 + (k % 8) * 2;
    smem[byte / 2]
}

/// flash_sm90.cu's `RowPairs<D, ROWS, THREADS>::at(s, row, col)` for thread `tid`: the step's
/// first row and its chunk's first column.
fn pairs_at(d: usize, threads: usize, tid: usize, s: usize) -> (usize, usize) {
    let idx = tid + s * threads;
    let (lane, w) = (idx & 31, idx >> 5);
    let halves = d / 64;
    let row = 2 * ((w / halves) * 4 + (lane & 3));
    let col = ((lane >> 2) + 8 * (w % halves)) * 8;
    (row, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// `load_tiled_async`: rows x d of `src` as a K-major tile, 16-byte copies.
    fn tile(src: &[f32], rows: usize, d: usize) -> Vec<f32> {
        let mut dst = vec![f32::NAN; rows * d];
        for idx in 0..rows * d / 8 {
            let (r, c) = (idx / (d / 8), (idx % (d / 8)) * 8);
            let at = tiled(d, r, c);
            assert_eq!(at % 8, 0, "a copy is 16-byte aligned");
            dst[at..at + 8].copy_from_slice(&src[r * d + c..r * d + c + 8]);
        }
        dst
    }

    /// `RowPairs<d, rows, threads>::load` then `store_t` (transposed: [d x rows], K-major) or
    /// `store` (as it is): every element once; each warp's 32-bit transposed stores on 32
    /// different banks.
    fn pairs(src: &[f32], rows: usize, d: usize, threads: usize, transposed: bool) -> Vec<f32> {
        let mut dst = vec![f32::NAN; rows * d];
        let mut written = vec![0; rows * d];
        let steps = rows / 2 * (d / 8) / threads;
        assert_eq!(steps * threads, rows / 2 * (d / 8), "whole steps");
        let mut put = |at: usize, value: f32| {
            dst[at] = value;
            written[at] += 1;
        };
        for s in 0..steps {
            for warp in 0..threads / 32 {
                if !transposed {
                    for lane in 0..32 {
                        let (row, col) = pairs_at(d, threads, warp * 32 + lane, s);
                        for r in [row, row + 1] {
                            let at = tiled(d, r, col);
                            for j in 0..8 {
                                put(at + j, src[r * d + col + j]);
                            }
                        }
                    }
                    continue;
                }
                for e in 0..8 {
                    let mut banks = Vec::new();
                    for lane in 0..32 {
                        let (row, col) = pairs_at(d, threads, warp * 32 + lane, s);
                        let j = (e + (lane >> 2)) & 7;
                        let at = tiled(rows, col + j, row);
                        assert_eq!(at % 2, 0, "a 32-bit store");
                        put(at, src[row * d + col + j]);
                        put(at + 1, src[(row + 1) * d + col + j]);
                        banks.push((at / 2) % 32);
                    }
                    banks.sort_unstable();
                    banks.dedup();
                    assert_eq!(
                        banks.len(),
                        32,
                        "{rows} x {d}: a warp's store hits each bank once"
                    );
                }
            }
        }
        assert!(
            written.iter().all(|&n| n == 1),
            "{rows} x {d}: every element once"
        );
        dst
    }

    /// D [m x n] = A B^T as wgmmas read them: `k_steps` of 16, A's and B's descriptors (start
    /// in bytes, tile width) moving 256 bytes a step.
    #[allow(clippy::too_many_arguments)]
    fn product(
        a: &[f32],
        (a_start, a_width): (usize, usize),
        b: &[f32],
        (b_start, b_width): (usize, usize),
        m: usize,
        n: usize,
        k_steps: usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for (i, o) in out.iter_mut().enumerate() {
            let (r, c) = (i / n, i % n);
            for kk in 0..k_steps {
                let (da, db) = (
                    desc(a_start + kk * 256, a_width),
                    desc(b_start + kk * 256, b_width),
                );
                for kx in 0..16 {
                    *o += read(a, da, r, kx) * read(b, db, c, kx);
                }
            }
        }
        out
    }

    fn assert_close(got: &[f32], want: impl Fn(usize) -> f32, what: &str) {
        let worst = got
            .iter()
            .enumerate()
            .map(|(i, g)| (g - want(i)).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{what} off by {worst}");
    }

    /// The forward: Q and K through `load_tiled_async`, V through `RowPairs::store_t`, then
    /// S = Q K^T and O = S V as the kernel's descriptors make the tensor cores read them.
    #[test]
    fn forward_descriptors_read_the_products() {
        const BR: usize = 64;
        const BC: usize = 64;
        for d in [64, 128] {
            let (q, k, v) = (random(BR * d, 1), random(BC * d, 2), random(BC * d, 3));
            let (sq, sk, svt) = (
                tile(&q, BR, d),
                tile(&k, BC, d),
                pairs(&v, BC, d, 128, true),
            );
            let s = product(&sq, (0, d), &sk, (0, d), BR, BC, d / 16);
            let dot = |r: usize, c: usize| (0..d).map(|x| q[r * d + x] * k[c * d + x]).sum();
            assert_close(&s, |i| dot(i / BC, i % BC), &format!("d {d}: S"));
            // O = S V: A from registers (S's own layout), B = V^T's descriptor per 16 keys.
            let mut o = vec![0f32; BR * d];
            for (i, x) in o.iter_mut().enumerate() {
                let (r, c) = (i / d, i % d);
                for kk in 0..BC / 16 {
                    for kx in 0..16 {
                        *x += s[r * BC + kk * 16 + kx] * read(&svt, desc(kk * 256, BC), c, kx);
                    }
                }
            }
            let pv = |r: usize, c: usize| (0..BC).map(|j| s[r * BC + j] * v[j * d + c]).sum();
            assert_close(&o, |i| pv(i / d, i % d), &format!("d {d}: O"));
        }
    }

    /// The backward (128 keys, two warpgroups of 128 threads; query tiles of 64 at head dim
    /// 64, 32 at 128): each warpgroup's S^T = K_w Q^T, dV_w += P^T dO (dO^T's descriptor),
    /// and its block of dQ^T += K^T dS^T (64 of dQ's columns from d0 by 32 queries from q0),
    /// Q, dO and K^T through `RowPairs`.
    #[test]
    fn backward_descriptors_read_the_products() {
        const BC: usize = 128;
        for (d, br) in [(64, 64), (128, 32)] {
            let nq = d * br / 128;
            let (q, k, dout) = (random(br * d, 4), random(BC * d, 5), random(br * d, 6));
            let (p, ds) = (random(BC * br, 7), random(br * BC, 8));
            let sk = tile(&k, BC, d);
            let sq = pairs(&q, br, d, 256, false);
            let sdot = pairs(&dout, br, d, 256, true);
            let skt = pairs(&k, BC, d, 256, true);
            // dS [br x BC] as the kernel writes it: tiled<BC>(query, key).
            let mut sds = vec![f32::NAN; br * BC];
            for i in 0..br {
                for j in 0..BC {
                    sds[tiled(BC, i, j)] = ds[i * BC + j];
                }
            }
            for wg in 0..2 {
                // S^T = K_w Q^T: K_w starts 64 x d elements in.
                let st = product(&sk, (wg * 64 * d * 2, d), &sq, (0, d), 64, br, d / 16);
                let dot = |r: usize, c: usize| {
                    (0..d)
                        .map(|x| k[(64 * wg + r) * d + x] * q[c * d + x])
                        .sum()
                };
                assert_close(&st, |i| dot(i / br, i % br), &format!("d {d}: S^T"));
                // dV_w = P^T dO: A = P^T from registers, B = dO^T per 16 queries.
                let mut dv = vec![0f32; 64 * d];
                for (i, x) in dv.iter_mut().enumerate() {
                    let (r, c) = (i / d, i % d);
                    for kk in 0..br / 16 {
                        for kx in 0..16 {
                            *x += p[r * br + kk * 16 + kx] * read(&sdot, desc(kk * 256, br), c, kx);
                        }
                    }
                }
                let pdo =
                    |r: usize, c: usize| (0..br).map(|j| p[r * br + j] * dout[j * d + c]).sum();
                assert_close(&dv, |i| pdo(i / d, i % d), &format!("d {d}: dV"));
                // dQ^T: A = K^T's rows from d0, B = dS's rows (queries) from q0.
                let (d0, q0) = if d == 128 { (64 * wg, 0) } else { (0, nq * wg) };
                let dqt = product(
                    &skt,
                    (d0 * BC * 2, BC),
                    &sds,
                    (q0 * BC * 2, BC),
                    64,
                    nq,
                    BC / 16,
                );
                let kds = |r: usize, c: usize| {
                    (0..BC)
                        .map(|j| k[j * d + d0 + r] * ds[(q0 + c) * BC + j])
                        .sum()
                };
                assert_close(&dqt, |i| kds(i / nq, i % nq), &format!("d {d}: dQ^T"));
            }
        }
    }
}
