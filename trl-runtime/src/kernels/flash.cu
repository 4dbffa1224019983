// Fused attention on CUDA, forward and backward: FlashAttention-2's algorithm with the
// operands in registers, on tensor cores through `mma.sync.m16n8k16` (bf16 / f16 in, f32
// accumulate; sm_80 and newer) fed by `ldmatrix` from padded shared-memory tiles. Head dims 64
// and 128; grouped-query heads without repeating key/value heads. Each query row sees the keys
// of its span lo..hi (per batch row and query): causal attention over packed rows is one case,
// one (query chunk, key chunk) pair of a ring-attention step another; queries and keys may
// differ in number. The tiling is src/nn/cpu_flash.rs's (64 queries x 64 keys, online softmax
// forward; per key block, every query block that sees it, backward), proven on CPU against the
// whole score matrix and the blockwise ring. Launched from src/nn/cuda_flash.rs.
//
// Forward: one block per (batch x head, 64 queries), 4 warps of 16 query rows. The warp keeps
// its Q fragments, the scores S (16 x 64) and the output O (16 x D) in registers; per key tile
// (64 keys, K and V in shared memory) it computes S = Q K^T, masks, updates the running max m
// and sum l (base 2: exp2 of scores pre-scaled by log2 e), rescales O and adds P V, P taken
// straight from S's accumulators (their layout is the A operand's). Output in f32, padded to
// the 64-row block (`nq_pad` rows per head), with each row's log-sum-exp (natural log; minus
// infinity for a row that sees no key).
//
// Backward: one block per (batch x query head, 128 keys), 8 warps of 16 keys (or 64 keys and
// 4 warps: TRL_FLASH_BWD_KEYS=64), over every query
// tile of BR rows that sees the keys, given the whole attention's log-sum-exp (so a part of the
// keys gets its exact gradients): S^T = K_w Q^T and dP^T = V_w dO^T in registers, P^T from S^T
// and the log-sum-exp, dS^T = P^T (dP^T - Delta); dV_w += P^T dO and dK_w += dS^T Q in
// registers; dS goes to shared memory and dQ += dS K is split among the warps and added to an
// f32 buffer with atomics (other key blocks add to the same rows). dK and dV are written per
// query head (f32, rows padded to the block) and summed over the heads of a group by
// `unpad_sum_cast`, which keeps the grid at batch x query heads wide.
//
// Each kernel has a `_async` variant (TRL_FLASH_ASYNC=1) that loads its tiles by cp.async,
// overlapped with the math: K and V in the forward, the next query tile in the backward.

#include "flash_common.cuh"

// D += A B for one m16n8k16 tile: A 16x16 (4 registers), B 16x8 (2), D 16x8 f32 (4).
template <typename T>
__device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b);
// One specialisation per 16-bit type; `TY` is its PTX name.
#define FLASH_MMA(T, TY)                                                                      \
    template <>                                                                               \
    __device__ __forceinline__ void mma<T>(float* d, const uint32_t* a, const uint32_t* b) { \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY                        \
                     ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"            \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                         \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));      \
    }
FLASH_MMA(__nv_bfloat16, "bf16")
FLASH_MMA(__half, "f16")
#undef FLASH_MMA

// D += A B over a 16x16 B fragment (4 registers): the two 16x8 tiles t[2 np], t[2 np + 1].
template <typename T>
__device__ __forceinline__ void mma16(float (*t)[4], int np, const uint32_t* a, const uint32_t* b) {
    mma<T>(t[2 * np], a, b);
    mma<T>(t[2 * np + 1], a, b + 2);
}

// Four 8x8 matrices of 16-bit values; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm4(uint32_t* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4_t(uint32_t* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Fragment loads from a row-major shared tile with rows `ld` elements apart. Lane `lane`.
// A (16x16 at row r0, col c0), the matrix stored as is: a[0..4] for mma.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t* a, const T* s, int ld, int r0, int c0, int lane) {
    const int mi = lane >> 3, r = lane & 7;
    ldsm4(a, s + (r0 + r + (mi & 1) * 8) * ld + c0 + (mi >> 1) * 8);
}
// B for two n8 tiles (n0.., n0 + 8..) x k16 at k0, B[k][n] = s[n][k] (the rows are the n
// index, as K is for Q K^T): b[0..2] the first tile, b[2..4] the second.
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t* b, const T* s, int ld, int n0, int k0,
                                          int lane) {
    const int mi = lane >> 3, r = lane & 7;
    ldsm4(b, s + (n0 + r + (mi >> 1) * 8) * ld + k0 + (mi & 1) * 8);
}
// B for two n8 tiles x k16, B[k][n] = s[k][n] (rows are the k index, as V is for P V).
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t* b, const T* s, int ld, int k0, int n0,
                                          int lane) {
    const int mi = lane >> 3, r = lane & 7;
    ldsm4_t(b, s + (k0 + r + (mi & 1) * 8) * ld + n0 + (mi >> 1) * 8);
}

// Copies rows [r0, r0 + rows) of a [n, D] matrix into a shared tile with rows `ld` apart, 16
// bytes per access; rows past n are zeros.
template <typename T, int D>
__device__ __forceinline__ void load_rows(T* dst, int ld, const T* src, int r0, int rows, int n) {
    constexpr int V = 8;  // 16-bit values per 16 bytes
    for (int idx = threadIdx.x; idx < rows * (D / V); idx += blockDim.x) {
        const int r = idx / (D / V), c = (idx % (D / V)) * V;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r0 + r < n) v = *reinterpret_cast<const uint4*>(src + (size_t)(r0 + r) * D + c);
        *reinterpret_cast<uint4*>(dst + r * ld + c) = v;
    }
}

// load_rows issued as cp.async (the caller commits and waits).
template <typename T, int D>
__device__ __forceinline__ void load_rows_async(T* dst, int ld, const T* src, int r0, int rows,
                                                int n) {
    constexpr int V = 8;
    for (int idx = threadIdx.x; idx < rows * (D / V); idx += blockDim.x) {
        const int r = idx / (D / V), c = (idx % (D / V)) * V;
        const bool in = r0 + r < n;
        // Out of range: row 0's address (valid) with nothing read.
        cp_async16(dst + r * ld + c, src + (size_t)(in ? r0 + r : 0) * D + c, in ? 16 : 0);
    }
}

// ASYNC: K and V tiles come by cp.async, each overlapping the other's math (FlashAttention-2's
// schedule): V_j loads while S = Q K_j^T and the softmax run, K_{j+1} while O += P V_j.
// CAP: the scores are soft-capped (Gemma 2): cap * tanh(s / cap) before the softmax; the
// backward multiplies dS by the slope 1 - tanh^2. A template argument, so that the kernels
// without it are the measured ones, unchanged.
template <typename T, int D, bool ASYNC, bool CAP>
__device__ void flash_fwd(const T* q, const T* k, const T* v, const uint32_t* lo,
                          const uint32_t* hi, float* o, float* lse, int hq, int hk, int nq,
                          int nk, int nq_pad, float scale, float cap) {
    constexpr int BR = 64, BC = 64, LD = D + 8;  // rows padded by 16 bytes: no bank conflicts
    extern __shared__ __align__(128) unsigned char smem[];
    T* sq = (T*)smem;
    T* sk = sq + BR * LD;
    T* sv = sk + BC * LD;
    __shared__ int kfirst, kend;

    const int bh = blockIdx.y, bi = bh / hq, h = bh % hq, kvh = h / (hq / hk);
    const int i0 = blockIdx.x * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;  // the accumulator layout: rows g, g + 8; cols 2t, 2t+1
    const T* qb = q + (size_t)bh * nq * D;
    const T* kb = k + (size_t)(bi * hk + kvh) * nk * D;
    const T* vb = v + (size_t)(bi * hk + kvh) * nk * D;
    const uint32_t* lob = lo + (size_t)bi * nq;
    const uint32_t* hib = hi + (size_t)bi * nq;

    if (ASYNC)
        load_rows_async<T, D>(sq, LD, qb, i0, BR, nq);  // in flight during the span scan
    else
        load_rows<T, D>(sq, LD, qb, i0, BR, nq);
    // The keys any row of the block sees: the key tiles to visit.
    const int2 tiles = key_tiles<BR, BC>(lob, hib, i0, nq, nk, kfirst, kend);
    const int j_begin = tiles.x, j_end = tiles.y;
    if (ASYNC) {
        if (j_begin < j_end) load_rows_async<T, D>(sk, LD, kb, j_begin, BC, nk);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }

    int rlo[2], rhi[2];
    row_spans(lob, hib, i0 + warp * 16 + g, nq, rlo, rhi);
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_a<T>(qf[kk], sq, LD, warp * 16, kk * 16, lane);
    float acc[D / 8][4];
    zero_tiles<D / 8>(acc);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const float sl2 = scale * LOG2E;
    // Capped scores: cap * tanh(s * scale / cap), base 2 (the division once per kernel).
    const float over_cap = CAP ? scale / cap : 0.f, cap2 = cap * LOG2E;

    for (int j0 = j_begin; j0 < j_end; j0 += BC) {
        if (ASYNC) {
            // K_j is in place (loaded before the loop or during the last P V).
            load_rows_async<T, D>(sv, LD, vb, j0, BC, nk);
            cp_async_commit();
        } else {
            __syncthreads();  // the previous tile is no longer read
            load_rows<T, D>(sk, LD, kb, j0, BC, nk);
            load_rows<T, D>(sv, LD, vb, j0, BC, nk);
            __syncthreads();
        }
        float s[BC / 8][4];
        zero_tiles<BC / 8>(s);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < BC / 16; ++np) {
                uint32_t b[4];
                load_b_nk<T>(b, sk, LD, np * 16, kk * 16, lane);
                mma16<T>(s, np, qf[kk], b);
            }
        }
        online_softmax<BC, D, CAP>(s, acc, m, l, rlo, rhi, j0 + 2 * t, sl2, over_cap, cap2);
        if (ASYNC) {
            cp_async_wait<0>();
            __syncthreads();  // V_j is in place and no warp reads K_j any more
            if (j0 + BC < j_end) {
                load_rows_async<T, D>(sk, LD, kb, j0 + BC, BC, nk);
                cp_async_commit();
            }
        }
        // O += P V: two score tiles (16 keys) are one A fragment.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t a[4];
            pack_a<T>(a, s, kk);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                uint32_t b[4];
                load_b_kn<T>(b, sv, LD, kk * 16, np * 16, lane);
                mma16<T>(acc, np, a, b);
            }
        }
        if (ASYNC) {
            cp_async_wait<0>();
            __syncthreads();  // K_{j+1} is in place and no warp reads V_j any more
        }
    }
    store_rows<D>(acc, m, l, o, lse, (size_t)bh * nq_pad + i0 + warp * 16 + g, t);
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

// `lse` and `delta` are [batch x heads, nq]; dq is [batch x heads, nq, D] (f32, accumulated
// with atomics), dk and dv [batch x heads, nk_pad, D] (per query head, f32). A block is WARPS
// warps of 16 keys: with 8, each query tile loaded serves 128 keys and dQ takes half the
// atomic adds of 4.
//
// ASYNC: the query tiles are double-buffered: while one is computed, the next visible one
// (Q, dO by cp.async; spans, lse, delta) is loaded into the other buffer.
template <typename T, int D, int BR, int WARPS, bool ASYNC, bool CAP>
__device__ void flash_bwd(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                          const float* delta, const uint32_t* lo, const uint32_t* hi, float* dq,
                          float* dk, float* dv, int hq, int hk, int nq, int nk, int nk_pad,
                          float scale, float cap) {
    constexpr int BC = 16 * WARPS, LD = D + 8, LDS = BC + 8;
    // dQ (BR x D) among the warps: BR / 16 row groups, the columns split over the rest.
    constexpr int RG = BR / 16, QC = D / (WARPS / RG);
    static_assert(WARPS % RG == 0 && QC % 16 == 0, "dQ split");
    extern __shared__ __align__(128) unsigned char smem[];
    T* sk = (T*)smem;       // BC x LD
    T* sv = sk + BC * LD;   // BC x LD
    T* sq = sv + BC * LD;   // BR x LD
    T* sdo = sq + BR * LD;  // BR x LD
    T* sds = sdo + BR * LD; // BR x LDS: dS, query-major
    // ASYNC: the second query-tile buffer, Q then dO.
    T* sq2 = sds + BR * LDS;
    T* sdo2 = sq2 + BR * LD;
    __shared__ float s_lse[2][BR], s_delta[2][BR];
    __shared__ int s_lo[2][BR], s_hi[2][BR];

    const int bh = blockIdx.y, bi = bh / hq, h = bh % hq, kvh = h / (hq / hk);
    const int j0 = blockIdx.x * BC;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const T* kb = k + (size_t)(bi * hk + kvh) * nk * D;
    const T* vb = v + (size_t)(bi * hk + kvh) * nk * D;
    const T* qb = q + (size_t)bh * nq * D;
    const T* dob = dout + (size_t)bh * nq * D;
    const uint32_t* lob = lo + (size_t)bi * nq;
    const uint32_t* hib = hi + (size_t)bi * nq;

    // Stages tile i0's spans, lse and delta in buffer `b`; whether any row sees the key block.
    auto stage = [&](int i0, int b) -> int {
        return stage_tile<BR, BC>(i0, s_lo[b], s_hi[b], s_lse[b], s_delta[b], lob, hib, lse, delta,
                                  (size_t)bh * nq, nq, j0);
    };
    // The first tile at or after i0 that sees the key block (nq when none), staged in `b`.
    auto next_visible = [&](int i0, int b) -> int {
        return next_visible_tile<BR, BC>(i0, s_lo[b], s_hi[b], s_lse[b], s_delta[b], lob, hib, lse,
                                         delta, (size_t)bh * nq, nq, j0);
    };

    int i_first = 0;
    if (ASYNC) {
        load_rows_async<T, D>(sk, LD, kb, j0, BC, nk);
        load_rows_async<T, D>(sv, LD, vb, j0, BC, nk);
        i_first = next_visible(0, 0);
        if (i_first < nq) {
            load_rows_async<T, D>(sq, LD, qb, i_first, BR, nq);
            load_rows_async<T, D>(sdo, LD, dob, i_first, BR, nq);
        }
        cp_async_commit();
    } else {
        load_rows<T, D>(sk, LD, kb, j0, BC, nk);
        load_rows<T, D>(sv, LD, vb, j0, BC, nk);
    }

    float dka[D / 8][4], dva[D / 8][4];
    zero_tiles<D / 8>(dka);
    zero_tiles<D / 8>(dva);
    // This thread's two keys (rows of S^T).
    const int key0 = j0 + warp * 16 + g;
    const float sl2 = scale * LOG2E;
    // Capped scores: cap * tanh(s * scale / cap), base 2 (the division once per kernel).
    const float over_cap = CAP ? scale / cap : 0.f, cap2 = cap * LOG2E;

    int buf = 0;
    for (int i0 = ASYNC ? i_first : 0; i0 < nq;) {
        int i_next;
        if (ASYNC) {
            // The next visible tile into the other buffer while this one is computed.
            i_next = next_visible(i0 + BR, buf ^ 1);
            if (i_next < nq) {
                load_rows_async<T, D>(buf ? sq : sq2, LD, qb, i_next, BR, nq);
                load_rows_async<T, D>(buf ? sdo : sdo2, LD, dob, i_next, BR, nq);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();  // this tile (and K, V) in place for every thread
        } else {
            i_next = i0 + BR;
            __syncthreads();  // the previous tile is no longer read
            // The tile's spans first: a tile none of whose rows sees this key block is skipped.
            if (!__syncthreads_or(stage(i0, 0))) {
                i0 = i_next;
                continue;
            }
            load_rows<T, D>(sq, LD, qb, i0, BR, nq);
            load_rows<T, D>(sdo, LD, dob, i0, BR, nq);
            __syncthreads();
        }
        const T* tq = buf ? sq2 : sq;
        const T* tdo = buf ? sdo2 : sdo;
        const int* t_lo = s_lo[buf];
        const int* t_hi = s_hi[buf];
        const float* t_lse = s_lse[buf];
        const float* t_delta = s_delta[buf];
        // S^T = K_w Q^T and dP^T = V_w dO^T, 16 keys x BR queries each.
        float st[BR / 8][4], dpt[BR / 8][4];
        zero_tiles<BR / 8>(st);
        zero_tiles<BR / 8>(dpt);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t ak[4], av[4];
            load_a<T>(ak, sk, LD, warp * 16, kk * 16, lane);
            load_a<T>(av, sv, LD, warp * 16, kk * 16, lane);
#pragma unroll
            for (int np = 0; np < BR / 16; ++np) {
                uint32_t b[4];
                load_b_nk<T>(b, tq, LD, np * 16, kk * 16, lane);
                mma16<T>(st, np, ak, b);
                load_b_nk<T>(b, tdo, LD, np * 16, kk * 16, lane);
                mma16<T>(dpt, np, av, b);
            }
        }
        // P^T and dS^T = P^T (dP^T - Delta), masked; dS to shared memory.
        backward_scores<BR, CAP>(st, dpt, key0, nk, i0, nq, t_lo, t_hi, t_lse, t_delta, sl2,
                                 over_cap, cap2, g, t, [&](int qc, int kr, float ds) {
                                     sds[qc * LDS + warp * 16 + kr] = of<T>(ds);
                                 });
        // dV_w += P^T dO and dK_w += dS^T Q: two query tiles of P^T (dS^T) are one A fragment.
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
            uint32_t ap[4], ad[4];
            pack_a<T>(ap, st, kk);
            pack_a<T>(ad, dpt, kk);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                uint32_t b[4];
                load_b_kn<T>(b, tdo, LD, kk * 16, np * 16, lane);
                mma16<T>(dva, np, ap, b);
                load_b_kn<T>(b, tq, LD, kk * 16, np * 16, lane);
                mma16<T>(dka, np, ad, b);
            }
        }
        __syncthreads();  // every warp's dS is in place
        // dQ (BR x D) += dS (BR x BC) K (BC x D): this warp's 16 rows x QC columns.
        const int rg = warp % RG, c0 = (warp / RG) * QC;
        float qa[QC / 8][4];
        zero_tiles<QC / 8>(qa);
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t a[4];
            load_a<T>(a, sds, LDS, rg * 16, kk * 16, lane);
#pragma unroll
            for (int np = 0; np < QC / 16; ++np) {
                uint32_t b[4];
                load_b_kn<T>(b, sk, LD, kk * 16, c0 + np * 16, lane);
                mma16<T>(qa, np, a, b);
            }
        }
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const int qi = i0 + rg * 16 + g + 8 * x;
            if (qi >= nq) continue;
            float* row = dq + ((size_t)bh * nq + qi) * D + c0 + 2 * t;
#pragma unroll
            for (int n = 0; n < QC / 8; ++n) {
                atomicAdd(row + n * 8, qa[n][2 * x] * scale);
                atomicAdd(row + n * 8 + 1, qa[n][2 * x + 1] * scale);
            }
        }
        if (ASYNC) {
            __syncthreads();  // no warp reads this buffer (or dS) any more
            buf ^= 1;
        }
        i0 = i_next;
    }
    if (ASYNC) cp_async_wait<0>();  // nothing left in flight when no tile was visible
    store_kv_rows<D>(dka, dva, dk, dv, (size_t)bh * nk_pad + j0 + warp * 16 + g, t, scale);
}

// dst[(g * rows + r) * d + c] = sum over h < sum of src[((g * sum + h) * rows_pad + r) * d + c],
// cast to T: drops the padding rows and adds the query heads of a group (sum = 1: a cast).
template <typename T>
__device__ void unpad_sum_cast(const float* src, T* dst, size_t groups, int sum, int rows,
                               int rows_pad, int d) {
    const size_t n = groups * rows * d, per = (size_t)rows * d, per_pad = (size_t)rows_pad * d;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t gi = i / per, rem = i % per;
        float acc = 0.f;
        for (int h = 0; h < sum; ++h) acc += src[(gi * sum + h) * per_pad + rem];
        dst[i] = of<T>(acc);
    }
}

#define FLASH_FWD_ENTRY(NAME, T, D, ASYNC, CAP)                                                \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        NAME(const T* q, const T* k, const T* v, const uint32_t* lo, const uint32_t* hi,       \
             float* o, float* lse, int hq, int hk, int nq, int nk, int nq_pad, float scale,    \
             float cap) {                                                                      \
        flash_fwd<T, D, ASYNC, CAP>(q, k, v, lo, hi, o, lse, hq, hk, nq, nk, nq_pad, scale,    \
                                    cap);                                                      \
    }

#define FLASH_ENTRY(SUFFIX, T, D, BR)                                                          \
    FLASH_FWD_ENTRY(flash_fwd_##SUFFIX##_d##D, T, D, false, false)                             \
    FLASH_FWD_ENTRY(flash_fwd_async_##SUFFIX##_d##D, T, D, true, false)                        \
    FLASH_FWD_ENTRY(flash_fwd_cap_##SUFFIX##_d##D, T, D, false, true)                          \
    FLASH_FWD_ENTRY(flash_fwd_async_cap_##SUFFIX##_d##D, T, D, true, true)                     \
    FLASH_BWD_ENTRY(flash_bwd64_##SUFFIX##_d##D, T, D, BR, 4, false, false)                    \
    FLASH_BWD_ENTRY(flash_bwd64_async_##SUFFIX##_d##D, T, D, BR, 4, true, false)               \
    FLASH_BWD_ENTRY(flash_bwd64_cap_##SUFFIX##_d##D, T, D, BR, 4, false, true)                 \
    FLASH_BWD_ENTRY(flash_bwd64_async_cap_##SUFFIX##_d##D, T, D, BR, 4, true, true)            \
    FLASH_BWD_ENTRY(flash_bwd128_##SUFFIX##_d##D, T, D, BR, 8, false, false)                   \
    FLASH_BWD_ENTRY(flash_bwd128_async_##SUFFIX##_d##D, T, D, BR, 8, true, false)              \
    FLASH_BWD_ENTRY(flash_bwd128_cap_##SUFFIX##_d##D, T, D, BR, 8, false, true)                \
    FLASH_BWD_ENTRY(flash_bwd128_async_cap_##SUFFIX##_d##D, T, D, BR, 8, true, true)

// The backward with blocks of 16 x WARPS keys: flash_bwd<KEYS>[_async][_cap]_<dtype>_d<D>.
#define FLASH_BWD_ENTRY(NAME, T, D, BR, WARPS, ASYNC, CAP)                                     \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
        NAME(const T* q, const T* k, const T* v, const T* dout, const float* lse,              \
             const float* delta, const uint32_t* lo, const uint32_t* hi, float* dq, float* dk,  \
             float* dv, int hq, int hk, int nq, int nk, int nk_pad, float scale, float cap) {  \
        flash_bwd<T, D, BR, WARPS, ASYNC, CAP>(q, k, v, dout, lse, delta, lo, hi, dq, dk, dv,  \
                                               hq, hk, nq, nk, nk_pad, scale, cap);            \
    }

// The 128-key backward at head dim 64 on query tiles of 32 rows, two blocks per
// multiprocessor (the default; TRL_FLASH_BWD_ROWS=64 selects 64-row tiles): 135 registers a
// thread at 32 rows, capped at 128 (ptxas for sm_90: 0-16 bytes spilled) where 64-row tiles
// take 182 and one block of 8 warps per multiprocessor leaves the kernel latency-bound
// (docs/gpu.md); 64 KB of shared memory a block instead of 100.
#define FLASH_BWD_R32_ENTRY(NAME, T, ASYNC, CAP)                                               \
    extern "C" __global__ void __launch_bounds__(256, 2)                                       \
        NAME(const T* q, const T* k, const T* v, const T* dout, const float* lse,              \
             const float* delta, const uint32_t* lo, const uint32_t* hi, float* dq, float* dk,  \
             float* dv, int hq, int hk, int nq, int nk, int nk_pad, float scale, float cap) {  \
        flash_bwd<T, 64, 32, 8, ASYNC, CAP>(q, k, v, dout, lse, delta, lo, hi, dq, dk, dv, hq,  \
                                            hk, nq, nk, nk_pad, scale, cap);                   \
    }
#define FLASH_BWD_R32(SUFFIX, T)                                                               \
    FLASH_BWD_R32_ENTRY(flash_bwd128r32_##SUFFIX##_d64, T, false, false)                       \
    FLASH_BWD_R32_ENTRY(flash_bwd128r32_async_##SUFFIX##_d64, T, true, false)                  \
    FLASH_BWD_R32_ENTRY(flash_bwd128r32_cap_##SUFFIX##_d64, T, false, true)                    \
    FLASH_BWD_R32_ENTRY(flash_bwd128r32_async_cap_##SUFFIX##_d64, T, true, true)

// Query rows per backward tile: 64 for head dim 64; 32 for 128, where the dK and dV
// accumulators take 128 registers per thread.
#define FLASH_DTYPE(SUFFIX, T)                                                                 \
    FLASH_ENTRY(SUFFIX, T, 64, 64)                                                             \
    FLASH_ENTRY(SUFFIX, T, 128, 32)                                                            \
    FLASH_BWD_R32(SUFFIX, T)                                                                   \
    extern "C" __global__ void flash_delta_##SUFFIX(const T* o, const T* dout, float* delta,   \
                                                    int rows, int d) {                         \
        flash_delta<T>(o, dout, delta, rows, d);                                               \
    }                                                                                          \
    extern "C" __global__ void unpad_sum_cast_##SUFFIX(const float* src, T* dst,               \
                                                       size_t groups, int sum, int rows,       \
                                                       int rows_pad, int d) {                  \
        unpad_sum_cast<T>(src, dst, groups, sum, rows, rows_pad, d);                           \
    }

FLASH_DTYPE(bf16, __nv_bfloat16)
FLASH_DTYPE(f16, __half)
