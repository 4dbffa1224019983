//! The shared-memory index arithmetic of the Hopper attention forward (kernels/flash_sm90.cu),
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

/// flash_sm90.cu's `VTile<D>::at(s, key, col)` for thread `tid`.
fn v_at(d: usize, tid: usize, s: usize) -> (usize, usize) {
    let idx = tid + s * 128;
    let (lane, w) = (idx & 31, idx >> 5);
    let halves = d / 64;
    let key = 2 * ((w / halves) * 4 + (lane & 3));
    let col = ((lane >> 2) + 8 * (w % halves)) * 8;
    (key, col)
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

    /// Q and K through `load_tiled_async`'s copies, V through `load_v` / `store_vt` (every
    /// element once, each warp's 32-bit stores on 32 different banks), then S = Q K^T and
    /// O = S V as the kernel's descriptors make the tensor cores read them.
    #[test]
    fn descriptors_read_the_products() {
        const BR: usize = 64;
        const BC: usize = 64;
        for d in [64, 128] {
            let (q, k, v) = (random(BR * d, 1), random(BC * d, 2), random(BC * d, 3));
            // load_tiled_async: 16-byte copies (8 elements) of row r, columns c..c + 8.
            let tile = |src: &[f32]| {
                let mut dst = vec![f32::NAN; BR * d];
                for idx in 0..BR * d / 8 {
                    let (r, c) = (idx / (d / 8), (idx % (d / 8)) * 8);
                    let at = tiled(d, r, c);
                    assert_eq!(at % 8, 0, "a copy is 16-byte aligned");
                    dst[at..at + 8].copy_from_slice(&src[r * d + c..r * d + c + 8]);
                }
                dst
            };
            let (sq, sk) = (tile(&q), tile(&k));
            // load_v + store_vt: per step two keys' 8 columns, the columns rotated per lane.
            let mut svt = vec![f32::NAN; d * BC];
            let mut written = vec![0; d * BC];
            let steps = 32 * (d / 8) / 128;
            for s in 0..steps {
                for e in 0..8 {
                    for warp in 0..4 {
                        let mut banks = Vec::new();
                        for lane in 0..32 {
                            let tid = warp * 32 + lane;
                            let (key, col) = v_at(d, tid, s);
                            let j = (e + (lane >> 2)) & 7;
                            let at = tiled(BC, col + j, key);
                            assert_eq!(at % 2, 0, "a 32-bit store");
                            svt[at] = v[key * d + col + j];
                            svt[at + 1] = v[(key + 1) * d + col + j];
                            written[at] += 1;
                            written[at + 1] += 1;
                            banks.push((at / 2) % 32);
                        }
                        banks.sort_unstable();
                        banks.dedup();
                        assert_eq!(banks.len(), 32, "d {d}: a warp's store hits each bank once");
                    }
                }
            }
            assert!(written.iter().all(|&n| n == 1), "d {d}: every element once");
            // S = Q K^T: per k-step of 16, both descriptors move 128 elements.
            let mut max_err = 0f32;
            let mut s_mat = vec![0f32; BR * BC];
            for m in 0..BR {
                for n in 0..BC {
                    let mut acc = 0f32;
                    for kk in 0..d / 16 {
                        let (da, db) = (desc(kk * 256, d), desc(kk * 256, d));
                        for kx in 0..16 {
                            acc += read(&sq, da, m, kx) * read(&sk, db, n, kx);
                        }
                    }
                    let want: f32 = (0..d).map(|c| q[m * d + c] * k[n * d + c]).sum();
                    max_err = max_err.max((acc - want).abs());
                    s_mat[m * BC + n] = acc;
                }
            }
            assert!(max_err < 1e-4, "d {d}: S off by {max_err}");
            // O = S V: A from registers (S's own layout), B = V^T's descriptor per 16 keys.
            for m in 0..BR {
                for c in 0..d {
                    let mut acc = 0f32;
                    for kk in 0..BC / 16 {
                        let db = desc(kk * 256, BC);
                        for kx in 0..16 {
                            acc += s_mat[m * BC + kk * 16 + kx] * read(&svt, db, c, kx);
                        }
                    }
                    let want: f32 = (0..BC)
                        .map(|key| s_mat[m * BC + key] * v[key * d + c])
                        .sum();
                    max_err = max_err.max((acc - want).abs());
                }
            }
            assert!(max_err < 1e-4, "d {d}: O off by {max_err}");
        }
    }
}
