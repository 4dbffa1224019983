// Fused attention on CUDA (FlashAttention-2's tiling, tensor cores through WMMA), forward and
// backward, for bf16 and f16 inputs with head dims 64 and 128; f32 accumulation, grouped-query
// heads without repeating key/value heads. Each query row sees the keys of its span lo..hi
// (per batch row and query): causal attention over packed rows is one case (lo = the
// document's start, hi = the row + 1), one (query chunk, key chunk) pair of a ring-attention
// step another; queries and keys may differ in number. The same tiling as src/nn/cpu_flash.rs,
// proven against the whole score matrix and the blockwise ring on CPU. Launched from
// src/nn/cuda_flash.rs.
//
// Forward, one block per (batch x head, 64 queries), 4 warps of 16 query rows: two passes over
// the visible key tiles of 32 keys. Pass 1 computes each row's maximum and sum (online, scalar);
// pass 2 the probabilities, final at once, and O += P V in tensor-core accumulators. (Scores
// are computed twice; in exchange no rescaling of the accumulators is needed.) Output rows are
// written in f32, padded to the block (`nq_pad` rows per head), with the log-sum-exp per row
// (minus infinity for a row that sees no key).
//
// Backward, one block per (batch x kv head, 64 keys), 4 warps of 16 keys, over every query
// head of the group and every query tile of 32 rows that sees the keys (given the whole
// attention's log-sum-exp, so a part of the keys gets its exact gradients): P^T from the scores and
// the log-sum-exp, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q in
// accumulators; dQ += dS K computed by the 4 warps over column quarters and added to an f32
// buffer with atomics (other key blocks add to the same rows).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T of(float v);
template <> __device__ __forceinline__ __nv_bfloat16 of<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half of<__half>(float v) { return __float2half(v); }

constexpr unsigned FULL = 0xffffffffu;

// Copies rows [r0, r0 + rows) of a [s, D] matrix into shared memory, zeros past row s.
template <typename T, int D>
__device__ void load_tile(T* dst, const T* src, int r0, int rows, int s) {
    for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
        const int r = idx / D, c = idx % D;
        dst[idx] = (r0 + r < s) ? src[(size_t)(r0 + r) * D + c] : of<T>(0.f);
    }
}

// Whether a query with key span [lo, hi) sees key `key`.
__device__ __forceinline__ bool sees(int lo, int hi, int key) { return key >= lo && key < hi; }

template <typename T, int D>
__device__ void flash_fwd(const T* q, const T* k, const T* v, const uint32_t* lo,
                          const uint32_t* hi, float* o, float* lse, int hq, int hk, int nq,
                          int nk, int nq_pad, float scale) {
    constexpr int BR = 64, BC = 32;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sq = (T*)smem;
    T* sk = sq + BR * D;
    T* sv = sk + BC * D;
    float* ss = (float*)(sv + BC * D);  // 4 warps x 16 x BC scores
    T* sp = (T*)(ss + 4 * 16 * BC);     // 4 warps x 16 x BC probabilities
    __shared__ int kfirst, kend;

    const int bh = blockIdx.y, bi = bh / hq, h = bh % hq, kvh = h / (hq / hk);
    const int i0 = blockIdx.x * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const T* qb = q + (size_t)bh * nq * D;
    const T* kb = k + (size_t)(bi * hk + kvh) * nk * D;
    const T* vb = v + (size_t)(bi * hk + kvh) * nk * D;
    const uint32_t* lob = lo + (size_t)bi * nq;
    const uint32_t* hib = hi + (size_t)bi * nq;

    load_tile<T, D>(sq, qb, i0, BR, nq);
    if (threadIdx.x == 0) {
        kfirst = nk;
        kend = 0;
    }
    __syncthreads();
    // The keys any row of the block sees: the key tiles to visit.
    for (int r = threadIdx.x; r < BR; r += blockDim.x) {
        if (i0 + r < nq && lob[i0 + r] < hib[i0 + r]) {
            atomicMin(&kfirst, (int)lob[i0 + r]);
            atomicMax(&kend, (int)hib[i0 + r]);
        }
    }
    __syncthreads();
    const int j_begin = (kfirst / BC) * BC;

    // This lane's row of the warp (two lanes per row) and its half of the tile's columns.
    const int rr = lane >> 1, c0 = (lane & 1) * (BC / 2);
    const int qrow = i0 + warp * 16 + rr;
    const int qlo = qrow < nq ? (int)lob[qrow] : 0;
    const int qhi = qrow < nq ? (int)hib[qrow] : 0;
    float m = -INFINITY, l = 0.f;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_o[D / 16];
    for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(acc_o[n], 0.f);
    float* sw = ss + warp * 16 * BC;
    T* pw = sp + warp * 16 * BC;

    for (int pass = 0; pass < 2; ++pass) {
        for (int j0 = j_begin; j0 < kend; j0 += BC) {
            __syncthreads();
            load_tile<T, D>(sk, kb, j0, BC, nk);
            if (pass == 1) load_tile<T, D>(sv, vb, j0, BC, nk);
            __syncthreads();
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_s[BC / 16];
            for (int n = 0; n < BC / 16; ++n) wmma::fill_fragment(acc_s[n], 0.f);
            for (int kk = 0; kk < D; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::load_matrix_sync(a, sq + (warp * 16) * D + kk, D);
                for (int n = 0; n < BC / 16; ++n) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                    wmma::load_matrix_sync(b, sk + (n * 16) * D + kk, D);
                    wmma::mma_sync(acc_s[n], a, b, acc_s[n]);
                }
            }
            for (int n = 0; n < BC / 16; ++n)
                wmma::store_matrix_sync(sw + n * 16, acc_s[n], BC, wmma::mem_row_major);
            __syncwarp();
            if (pass == 0) {
                float mx = -INFINITY;
                for (int c = 0; c < BC / 2; ++c) {
                    const int key = j0 + c0 + c;
                    if (sees(qlo, qhi, key)) mx = fmaxf(mx, sw[rr * BC + c0 + c] * scale);
                }
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
                const float m_new = fmaxf(m, mx);
                float sum = 0.f;
                if (m_new > -INFINITY) {
                    for (int c = 0; c < BC / 2; ++c) {
                        const int key = j0 + c0 + c;
                        if (sees(qlo, qhi, key))
                            sum += __expf(sw[rr * BC + c0 + c] * scale - m_new);
                    }
                }
                sum += __shfl_xor_sync(FULL, sum, 1);
                if (m_new > -INFINITY) {
                    l = l * __expf(m - m_new) + sum;
                    m = m_new;
                }
            } else {
                const float inv = l > 0.f ? 1.f / l : 0.f;
                for (int c = 0; c < BC / 2; ++c) {
                    const int key = j0 + c0 + c;
                    const float p = sees(qlo, qhi, key)
                                        ? __expf(sw[rr * BC + c0 + c] * scale - m) * inv
                                        : 0.f;
                    pw[rr * BC + c0 + c] = of<T>(p);
                }
                __syncwarp();
                for (int kk = 0; kk < BC; kk += 16) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                    wmma::load_matrix_sync(a, pw + kk, BC);
                    for (int n = 0; n < D / 16; ++n) {
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                        wmma::load_matrix_sync(b, sv + kk * D + n * 16, D);
                        wmma::mma_sync(acc_o[n], a, b, acc_o[n]);
                    }
                }
            }
            __syncwarp();
        }
    }
    float* ob = o + ((size_t)bh * nq_pad + i0 + warp * 16) * D;
    for (int n = 0; n < D / 16; ++n)
        wmma::store_matrix_sync(ob + n * 16, acc_o[n], D, wmma::mem_row_major);
    if ((lane & 1) == 0)
        lse[(size_t)bh * nq_pad + qrow] = l > 0.f ? m + logf(l) : -INFINITY;
}

// D[row] = sum over the head dim of dO * O, one warp per row of [rows, D].
template <typename T>
__device__ void flash_delta(const T* o, const T* dout, float* delta, int rows, int d) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float acc = 0.f;
    for (int c = lane; c < d; c += 32)
        acc += to_f(o[(size_t)row * d + c]) * to_f(dout[(size_t)row * d + c]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(FULL, acc, off);
    if (lane == 0) delta[row] = acc;
}

// `lse` and `delta` are [batch x heads, nq]; dq is [batch x heads, nq, D], dk and dv
// [batch x kv heads, nk_pad, D].
template <typename T, int D>
__device__ void flash_bwd(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                          const float* delta, const uint32_t* lo, const uint32_t* hi, float* dq,
                          float* dk, float* dv, int hq, int hk, int nq, int nk, int nk_pad,
                          float scale) {
    constexpr int BC = 64, BR = 32;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sk = (T*)smem;                    // BC x D
    T* sv = sk + BC * D;                 // BC x D
    T* sq = sv + BC * D;                 // BR x D
    T* sdo = sq + BR * D;                // BR x D
    float* ss = (float*)(sdo + BR * D);  // 4 warps x 16 x BR (scores, then P)
    float* sdp = ss + 4 * 16 * BR;       // 4 warps x 16 x BR (dP)
    T* spt = (T*)(sdp + 4 * 16 * BR);    // 4 warps x 16 x BR (P^T as T)
    T* sdst = spt + 4 * 16 * BR;         // BC x BR (dS^T as T)
    float* stage = (float*)(sdst + BC * BR);  // 4 warps x BR x D/4 (dQ staging)
    __shared__ float s_lse[BR], s_delta[BR];
    __shared__ int s_lo[BR], s_hi[BR];

    const int bk = blockIdx.y, bi = bk / hk, kvh = bk % hk, group = hq / hk;
    const int j0 = blockIdx.x * BC;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const T* kb = k + (size_t)bk * nk * D;
    const T* vb = v + (size_t)bk * nk * D;
    const uint32_t* lob = lo + (size_t)bi * nq;
    const uint32_t* hib = hi + (size_t)bi * nq;

    load_tile<T, D>(sk, kb, j0, BC, nk);
    load_tile<T, D>(sv, vb, j0, BC, nk);

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_dk[D / 16], acc_dv[D / 16];
    for (int n = 0; n < D / 16; ++n) {
        wmma::fill_fragment(acc_dk[n], 0.f);
        wmma::fill_fragment(acc_dv[n], 0.f);
    }
    float* sw = ss + warp * 16 * BR;
    float* dpw = sdp + warp * 16 * BR;
    T* ptw = spt + warp * 16 * BR;
    // This lane's key row of the warp's 16 keys (two lanes per key) and its half of the queries.
    const int kr = lane >> 1, q0 = (lane & 1) * (BR / 2);
    const int key = j0 + warp * 16 + kr;

    for (int hh = 0; hh < group; ++hh) {
        const int h = kvh * group + hh, bh = bi * hq + h;
        const T* qb = q + (size_t)bh * nq * D;
        const T* dob = dout + (size_t)bh * nq * D;
        for (int i0 = 0; i0 < nq; i0 += BR) {
            __syncthreads();
            // The tile's spans first: a tile none of whose rows sees this key block is skipped.
            int any = 0;
            for (int r = threadIdx.x; r < BR; r += blockDim.x) {
                const int qi = i0 + r;
                const bool in = qi < nq;
                s_lo[r] = in ? (int)lob[qi] : 0;
                s_hi[r] = in ? (int)hib[qi] : 0;
                s_lse[r] = in ? lse[(size_t)bh * nq + qi] : 0.f;
                s_delta[r] = in ? delta[(size_t)bh * nq + qi] : 0.f;
                any |= max(s_lo[r], j0) < min(s_hi[r], j0 + BC);
            }
            if (!__syncthreads_or(any)) continue;
            load_tile<T, D>(sq, qb, i0, BR, nq);
            load_tile<T, D>(sdo, dob, i0, BR, nq);
            __syncthreads();
            // S^T = K_w Q^T (16 keys x BR queries)
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BR / 16];
            for (int n = 0; n < BR / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
            for (int kk = 0; kk < D; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::load_matrix_sync(a, sk + (warp * 16) * D + kk, D);
                for (int n = 0; n < BR / 16; ++n) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                    wmma::load_matrix_sync(b, sq + (n * 16) * D + kk, D);
                    wmma::mma_sync(acc[n], a, b, acc[n]);
                }
            }
            for (int n = 0; n < BR / 16; ++n)
                wmma::store_matrix_sync(sw + n * 16, acc[n], BR, wmma::mem_row_major);
            // dP^T = V_w dO^T (16 keys x BR queries)
            for (int n = 0; n < BR / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
            for (int kk = 0; kk < D; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::load_matrix_sync(a, sv + (warp * 16) * D + kk, D);
                for (int n = 0; n < BR / 16; ++n) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                    wmma::load_matrix_sync(b, sdo + (n * 16) * D + kk, D);
                    wmma::mma_sync(acc[n], a, b, acc[n]);
                }
            }
            for (int n = 0; n < BR / 16; ++n)
                wmma::store_matrix_sync(dpw + n * 16, acc[n], BR, wmma::mem_row_major);
            __syncwarp();
            // P^T and dS^T = P^T (dP^T - D), masked
            for (int c = 0; c < BR / 2; ++c) {
                const int qc = q0 + c, qi = i0 + qc;
                const float p = (key < nk && qi < nq && sees(s_lo[qc], s_hi[qc], key))
                                    ? __expf(sw[kr * BR + qc] * scale - s_lse[qc])
                                    : 0.f;
                ptw[kr * BR + qc] = of<T>(p);
                sdst[(warp * 16 + kr) * BR + qc] = of<T>(p * (dpw[kr * BR + qc] - s_delta[qc]));
            }
            __syncwarp();
            // dV_w += P^T dO; dK_w += dS^T Q
            for (int kk = 0; kk < BR; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_p, a_ds;
                wmma::load_matrix_sync(a_p, ptw + kk, BR);
                wmma::load_matrix_sync(a_ds, sdst + (warp * 16) * BR + kk, BR);
                for (int n = 0; n < D / 16; ++n) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                    wmma::load_matrix_sync(b, sdo + kk * D + n * 16, D);
                    wmma::mma_sync(acc_dv[n], a_p, b, acc_dv[n]);
                    wmma::load_matrix_sync(b, sq + kk * D + n * 16, D);
                    wmma::mma_sync(acc_dk[n], a_ds, b, acc_dk[n]);
                }
            }
            __syncthreads();  // every warp's dS^T is in place
            // dQ (BR x D) += dS (BR x BC) K (BC x D), warp w taking columns [w D/4, (w+1) D/4)
            constexpr int QC = D / 4;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_q[BR / 16][QC / 16];
            for (int mi = 0; mi < BR / 16; ++mi)
                for (int n = 0; n < QC / 16; ++n) wmma::fill_fragment(acc_q[mi][n], 0.f);
            for (int kk = 0; kk < BC; kk += 16) {
                for (int mi = 0; mi < BR / 16; ++mi) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
                    wmma::load_matrix_sync(a, sdst + kk * BR + mi * 16, BR);
                    for (int n = 0; n < QC / 16; ++n) {
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                        wmma::load_matrix_sync(b, sk + kk * D + warp * QC + n * 16, D);
                        wmma::mma_sync(acc_q[mi][n], a, b, acc_q[mi][n]);
                    }
                }
            }
            float* sg = stage + warp * BR * QC;
            for (int mi = 0; mi < BR / 16; ++mi)
                for (int n = 0; n < QC / 16; ++n)
                    wmma::store_matrix_sync(sg + (mi * 16) * QC + n * 16, acc_q[mi][n], QC,
                                            wmma::mem_row_major);
            __syncwarp();
            for (int idx = lane; idx < BR * QC; idx += 32) {
                const int r = idx / QC, c = idx % QC, qi = i0 + r;
                if (qi < nq)
                    atomicAdd(&dq[((size_t)bh * nq + qi) * D + warp * QC + c], sg[idx] * scale);
            }
        }
    }
    for (int n = 0; n < D / 16; ++n) {
        for (int e = 0; e < acc_dk[n].num_elements; ++e) acc_dk[n].x[e] *= scale;
        float* dkb = dk + ((size_t)bk * nk_pad + j0 + warp * 16) * D;
        float* dvb = dv + ((size_t)bk * nk_pad + j0 + warp * 16) * D;
        wmma::store_matrix_sync(dkb + n * 16, acc_dk[n], D, wmma::mem_row_major);
        wmma::store_matrix_sync(dvb + n * 16, acc_dv[n], D, wmma::mem_row_major);
    }
}

// dst[(g * rows + r) * d + c] = src[(g * rows_pad + r) * d + c], cast to T.
template <typename T>
__device__ void unpad_cast(const float* src, T* dst, size_t groups, int rows, int rows_pad, int d) {
    const size_t n = groups * rows * d;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t g = i / ((size_t)rows * d), rem = i % ((size_t)rows * d);
        dst[i] = of<T>(src[g * (size_t)rows_pad * d + rem]);
    }
}

#define FLASH_ENTRY(SUFFIX, T, D)                                                              \
    extern "C" __global__ void flash_fwd_##SUFFIX##_d##D(                                      \
        const T* q, const T* k, const T* v, const uint32_t* lo, const uint32_t* hi, float* o,  \
        float* lse, int hq, int hk, int nq, int nk, int nq_pad, float scale) {                 \
        flash_fwd<T, D>(q, k, v, lo, hi, o, lse, hq, hk, nq, nk, nq_pad, scale);               \
    }                                                                                          \
    extern "C" __global__ void flash_bwd_##SUFFIX##_d##D(                                      \
        const T* q, const T* k, const T* v, const T* dout, const float* lse,                   \
        const float* delta, const uint32_t* lo, const uint32_t* hi, float* dq, float* dk,      \
        float* dv, int hq, int hk, int nq, int nk, int nk_pad, float scale) {                  \
        flash_bwd<T, D>(q, k, v, dout, lse, delta, lo, hi, dq, dk, dv, hq, hk, nq, nk, nk_pad, \
                        scale);                                                                \
    }

#define FLASH_DTYPE(SUFFIX, T)                                                                 \
    FLASH_ENTRY(SUFFIX, T, 64)                                                                 \
    FLASH_ENTRY(SUFFIX, T, 128)                                                                \
    extern "C" __global__ void flash_delta_##SUFFIX(const T* o, const T* dout, float* delta,   \
                                                    int rows, int d) {                         \
        flash_delta<T>(o, dout, delta, rows, d);                                               \
    }                                                                                          \
    extern "C" __global__ void unpad_cast_##SUFFIX(const float* src, T* dst, size_t groups,    \
                                                   int rows, int rows_pad, int d) {            \
        unpad_cast<T>(src, dst, groups, rows, rows_pad, d);                                    \
    }

FLASH_DTYPE(bf16, __nv_bfloat16)
FLASH_DTYPE(f16, __half)
