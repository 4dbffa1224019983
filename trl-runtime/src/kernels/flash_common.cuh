// What the attention kernels share (flash.cu, the mma.sync kernels for sm_80 and newer, and
// flash_sm90.cu, the wgmma ones for Hopper): conversions, packing accumulators into A
// fragments, cp.async, and the key-span test.

#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
// Soft-capping's tanh by the special-function unit (one instruction, sm_75+; relative error
// 2^-11, below the bf16 rounding of the scores it caps). libdevice's tanhf and a division per
// score made the capped kernels 17-37% slower than the uncapped ones (H100, 2026-11-27).
__device__ __forceinline__ float tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
template <typename T> __device__ __forceinline__ T of(float v);
template <> __device__ __forceinline__ __nv_bfloat16 of<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half of<__half>(float v) { return __float2half(v); }

// Two floats as one register of two 16-bit values (the lower one first).
template <typename T> __device__ __forceinline__ uint32_t pack(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Two 16x8 f32 accumulator tiles (t[2 kk], t[2 kk + 1]) as one 16x16 A fragment: the C
// layout of one mma is the A layout of the next, so no shared memory round trip.
template <typename T>
__device__ __forceinline__ void pack_a(uint32_t* a, const float (*t)[4], int kk) {
    a[0] = pack<T>(t[2 * kk][0], t[2 * kk][1]);
    a[1] = pack<T>(t[2 * kk][2], t[2 * kk][3]);
    a[2] = pack<T>(t[2 * kk + 1][0], t[2 * kk + 1][1]);
    a[3] = pack<T>(t[2 * kk + 1][2], t[2 * kk + 1][3]);
}

constexpr unsigned FULL = 0xffffffffu;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Zeroes N accumulator tiles of 16x8 f32 (4 registers a thread each).
template <int N> __device__ __forceinline__ void zero_tiles(float (*t)[4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) t[n][e] = 0.f;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// cp.async (sm_80+): 16 bytes from global to shared memory without passing through registers;
// with `bytes` 0 the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}


// Whether a query with key span [lo, hi) sees key `key`.
__device__ __forceinline__ bool sees(int lo, int hi, int key) { return key >= lo && key < hi; }

// One key tile of the forward's online softmax, for the two rows (g, g + 8) this thread holds
// of a warp's 16: masks the scores `s` [BC keys] (columns `key0` + n * 8 + (e & 1) for tile n,
// element e) to the rows' spans, scales them to base 2 (soft-capped with CAP), updates the
// running max `m` and sum `l`, turns `s` into exp2(s - max) and rescales the output `acc` [D].
template <int BC, int D, bool CAP>
__device__ __forceinline__ void online_softmax(float (*s)[4], float (*acc)[4], float* m, float* l,
                                               const int* rlo, const int* rhi, int key0,
                                               float sl2, float over_cap, float cap2) {
    // Mask and scale (base 2), then the rows' new maxima over the quad of lanes.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int x = e >> 1, key = key0 + n * 8 + (e & 1);
            const float v = CAP ? cap2 * tanh_fast(s[n][e] * over_cap) : s[n][e] * sl2;
            s[n][e] = sees(rlo[x], rhi[x], key) ? v : -INFINITY;
            mx[x] = fmaxf(mx[x], s[n][e]);
        }
    float alpha[2], mu[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        mx[x] = fmaxf(mx[x], __shfl_xor_sync(FULL, mx[x], 1));
        mx[x] = fmaxf(mx[x], __shfl_xor_sync(FULL, mx[x], 2));
        const float m_new = fmaxf(m[x], mx[x]);
        // A row that has seen no key yet keeps 0 as its reference (no inf - inf).
        mu[x] = m_new == -INFINITY ? 0.f : m_new;
        alpha[x] = exp2f(m[x] - mu[x]);
        m[x] = m_new;
        l[x] *= alpha[x];
    }
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int x = e >> 1;
            s[n][e] = exp2f(s[n][e] - mu[x]);
            l[x] += s[n][e];
        }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
    }
}

// The forward's end for this thread's rows `row` and `row` + 8 (of [rows, D] f32 `o` and
// `lse`): the output divided by the rows' sums (each lane summed its own columns: the sums
// over the quad first) and the log-sum-exp in natural log (minus infinity where a row saw no
// key).
template <int D>
__device__ __forceinline__ void store_rows(const float (*acc)[4], const float* m, float* l,
                                           float* o, float* lse, size_t row, int t) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        l[x] += __shfl_xor_sync(FULL, l[x], 1);
        l[x] += __shfl_xor_sync(FULL, l[x], 2);
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const size_t r = row + 8 * x;
        const float inv = l[x] > 0.f ? 1.f / l[x] : 0.f;
        float* orow = o + r * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<float2*>(orow + n * 8 + 2 * t) =
                make_float2(acc[n][2 * x] * inv, acc[n][2 * x + 1] * inv);
        if (t == 0) lse[r] = l[x] > 0.f ? (m[x] + log2f(l[x])) * LN2 : -INFINITY;
    }
}

// The key tiles a forward block of BR query rows from i0 visits, [begin, end) with begin a
// multiple of BC: the span of the keys any of its rows sees (begin = end: none). Every
// thread of the block calls it; `first` and `last` are the block's shared scratch.
template <int BR, int BC>
__device__ __forceinline__ int2 key_tiles(const uint32_t* lob, const uint32_t* hib, int i0,
                                          int nq, int nk, int& first, int& last) {
    if (threadIdx.x == 0) {
        first = nk;
        last = 0;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < BR; r += blockDim.x) {
        if (i0 + r < nq && lob[i0 + r] < hib[i0 + r]) {
            atomicMin(&first, (int)lob[i0 + r]);
            atomicMax(&last, (int)hib[i0 + r]);
        }
    }
    __syncthreads();
    return make_int2((first / BC) * BC, last);
}

// The spans of this thread's two rows, row0 and row0 + 8 (rows past nq see nothing).
__device__ __forceinline__ void row_spans(const uint32_t* lob, const uint32_t* hib, int row0,
                                          int nq, int* rlo, int* rhi) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const int row = row0 + 8 * x;
        rlo[x] = row < nq ? (int)lob[row] : 0;
        rhi[x] = row < nq ? (int)hib[row] : 0;
    }
}

// Stages query tile i0's spans, log-sum-exps (base 2) and deltas (rows of the head starting
// at `head`) for a backward block of keys [j0, j0 + BC); whether any of its rows sees a key
// of the block. Rows past nq see nothing.
template <int BR, int BC>
__device__ __forceinline__ int stage_tile(int i0, int* t_lo, int* t_hi, float* t_lse,
                                          float* t_delta, const uint32_t* lob,
                                          const uint32_t* hib, const float* lse,
                                          const float* delta, size_t head, int nq, int j0) {
    int any = 0;
    for (int r = threadIdx.x; r < BR; r += blockDim.x) {
        const int qi = i0 + r;
        const bool in = qi < nq;
        t_lo[r] = in ? (int)lob[qi] : 0;
        t_hi[r] = in ? (int)hib[qi] : 0;
        t_lse[r] = in ? lse[head + qi] * LOG2E : 0.f;
        t_delta[r] = in ? delta[head + qi] : 0.f;
        any |= max(t_lo[r], j0) < min(t_hi[r], j0 + BC);
    }
    return any;
}

// The first query tile at or after i0 that sees the block's keys (nq when none), staged by
// [`stage_tile`]. Every thread of the block calls it.
template <int BR, int BC>
__device__ __forceinline__ int next_visible_tile(int i0, int* t_lo, int* t_hi, float* t_lse,
                                                 float* t_delta, const uint32_t* lob,
                                                 const uint32_t* hib, const float* lse,
                                                 const float* delta, size_t head, int nq,
                                                 int j0) {
    for (; i0 < nq; i0 += BR) {
        __syncthreads();  // the staging buffer is no longer read
        if (__syncthreads_or(stage_tile<BR, BC>(i0, t_lo, t_hi, t_lse, t_delta, lob, hib, lse,
                                                delta, head, nq, j0)))
            return i0;
    }
    return nq;
}

// The backward's end for this thread's keys `row` and `row` + 8 (of [rows, D] f32 `dk` and
// `dv`): dK scaled by the score scale.
template <int D>
__device__ __forceinline__ void store_kv_rows(const float (*dka)[4], const float (*dva)[4],
                                              float* dk, float* dv, size_t row, int t,
                                              float scale) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const size_t r = row + 8 * x;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<float2*>(dk + r * D + n * 8 + 2 * t) =
                make_float2(dka[n][2 * x] * scale, dka[n][2 * x + 1] * scale);
            *reinterpret_cast<float2*>(dv + r * D + n * 8 + 2 * t) =
                make_float2(dva[n][2 * x], dva[n][2 * x + 1]);
        }
    }
}

// The backward's scores for this thread's keys key0 and key0 + 8 (rows g and g + 8 of a
// warp's 16) over a tile of BR queries from i0: S^T becomes P^T and dP^T becomes dS^T =
// P^T (dP^T - Delta) (through the soft-cap's slope 1 - tanh^2 with CAP), masked to the
// queries' spans; each dS also goes to `put(query, row, ds)` (the query within the tile,
// the row within the warp's 16 keys).
template <int BR, bool CAP, typename Put>
__device__ __forceinline__ void backward_scores(float (*st)[4], float (*dpt)[4], int key0, int nk,
                                                int i0, int nq, const int* t_lo, const int* t_hi,
                                                const float* t_lse, const float* t_delta,
                                                float sl2, float over_cap, float cap2, int g,
                                                int t, Put put) {
    // Soft-capped: the scores' tanh in place (P from the capped score, dS through the cap's
    // slope below).
    if (CAP) {
#pragma unroll
        for (int n = 0; n < BR / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = tanh_fast(st[n][e] * over_cap);
    }
#pragma unroll
    for (int n = 0; n < BR / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int kr = g + 8 * (e >> 1), key = key0 + 8 * (e >> 1);
            const int qc = n * 8 + 2 * t + (e & 1);
            const bool vis = key < nk && i0 + qc < nq && sees(t_lo[qc], t_hi[qc], key);
            float p, ds;
            if (CAP) {
                const float th = st[n][e];
                p = vis ? exp2f(cap2 * th - t_lse[qc]) : 0.f;
                ds = p * (dpt[n][e] - t_delta[qc]) * (1.f - th * th);
            } else {
                p = vis ? exp2f(st[n][e] * sl2 - t_lse[qc]) : 0.f;
                ds = p * (dpt[n][e] - t_delta[qc]);
            }
            st[n][e] = p;
            dpt[n][e] = ds;
            put(qc, kr, ds);
        }
}
