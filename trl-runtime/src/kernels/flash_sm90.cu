// Attention on Hopper (sm_90a, compiled apart from flash.cu): flash.cu's forward and 128-key
// backward, with the same grids, key spans, inputs and outputs, their products on the
// warpgroup tensor cores (`wgmma.mma_async`), which read their shared-memory operands
// themselves (no ldmatrix) at Hopper's full matrix rate. A warpgroup of 4 warps computes 64
// rows per product, warp w holding rows 16w..16w+15 in the layout mma.sync's
// accumulators have, so the per-score code (softmax, dS) is flash.cu's.
//
// Forward, per key tile of 64 keys: S = Q K^T (A = Q and B = K from shared memory); while it
// runs, the tile's V comes from global memory into registers and, once S is done, goes to
// shared memory transposed (V^T: every operand is K-major, the layout of the plainest
// descriptor); the softmax; O += P V with P from registers (S's accumulators are the A
// fragments) and V^T from shared memory; the next K tile loads by cp.async meanwhile. The
// backward is described above flash_bwd_wg.
//
// Shared-memory operands: no swizzle, K-major. An [mn x k] tile is stored as core matrices of
// 8 rows x 8 elements (16 bytes a row, 128 bytes each), consecutive along k and k / 8 x 128
// bytes apart along mn; a descriptor's leading byte offset is 128 and its stride byte offset
// k / 8 x 128, and one k-step of 16 elements moves its start by 256 bytes.
//
// Selected by TRL_FLASH_WGMMA=1 on a GPU of compute capability 9.0 (kernels/cuda_flash.rs).

#include "flash_common.cuh"

// Element offset of (mn, k) in a K-major tile K elements wide.
template <int K> __device__ __forceinline__ int tiled(int mn, int k) {
    return ((mn >> 3) * (K >> 3) + (k >> 3)) * 64 + (mn & 7) * 8 + (k & 7);
}

// The descriptor of a K-major tile K elements wide starting at `p` (16-byte aligned).
template <int K> __device__ __forceinline__ uint64_t desc(const void* p) {
    const uint64_t start = (smem_addr(p) & 0x3FFFF) >> 4;
    const uint64_t leading = 128 >> 4, stride = (K / 8 * 128) >> 4;
    return start | (leading << 16) | (stride << 32);
}

__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Shared memory written by ordinary stores or cp.async (the generic proxy) before the tensor
// cores read it (the async proxy).
__device__ __forceinline__ void fence_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of N accumulator tiles across a wgmma, which
// writes them asynchronously (from issue to wait).
template <int N> __device__ __forceinline__ void pin(float (*t)[4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(t[n][e])::"memory");
}

#define WG_ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define WG_ACC16 WG_ACC4(0), WG_ACC4(1), WG_ACC4(2), WG_ACC4(3)
#define WG_ACC32 WG_ACC16, WG_ACC4(4), WG_ACC4(5), WG_ACC4(6), WG_ACC4(7)
#define WG_ACC64                                                                                \
    WG_ACC32, WG_ACC4(8), WG_ACC4(9), WG_ACC4(10), WG_ACC4(11), WG_ACC4(12), WG_ACC4(13),       \
        WG_ACC4(14), WG_ACC4(15)
#define WG_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define WG_R32                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_R64                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "    \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "    \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// The accumulate flag of a wgmma (a predicate): always on, the accumulators are zeroed first.
#define WG_ON "{\n.reg .pred on;\nsetp.ne.b32 on, 1, 0;\n"

// D [64 x N] += A B^T: A [64 x 16] and B [N x 16] K-major tiles in shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (*d)[4], uint64_t a, uint64_t b);
// D [64 x N] += A B^T: A [64 x 16] in registers (a warp's 16 rows as mma.sync's A fragment),
// B [N x 16] a K-major tile in shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (*d)[4], const uint32_t* a, uint64_t b);

// One wgmma shape: D [64 x N] (the R registers, ACC operands) += A B^T with A and B in shared
// memory (descriptors %IA and %IB), or A in registers (%A0..%A0+3, B's descriptor %IB).
#define WG_SS(T, TY, N, R, ACC, IA, IB)                                                         \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_ss<T, N>(float (*d)[4], uint64_t a, uint64_t b) {     \
        asm volatile(WG_ON "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " R     \
                           ", %" #IA ", %" #IB ", on, 1, 1, 0, 0;\n}\n"                        \
                     : ACC                                                                      \
                     : "l"(a), "l"(b));                                                         \
    }
#define WG_RS(T, TY, N, R, ACC, A0, A1, A2, A3, IB)                                             \
    template <>                                                                                 \
    __device__ __forceinline__ void wgmma_rs<T, N>(float (*d)[4], const uint32_t* a,           \
                                                   uint64_t b) {                                \
        asm volatile(WG_ON "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " R     \
                           ", {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #IB                  \
                           ", on, 1, 1, 0;\n}\n"                                               \
                     : ACC                                                                      \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                     \
    }
// The shapes the kernels use, per 16-bit type (`TY`: its PTX name).
#define FLASH_WGMMA(T, TY)                                                                      \
    WG_SS(T, TY, 32, WG_R16, WG_ACC16, 16, 17)                                                  \
    WG_SS(T, TY, 64, WG_R32, WG_ACC32, 32, 33)                                                  \
    WG_RS(T, TY, 64, WG_R32, WG_ACC32, 32, 33, 34, 35, 36)                                      \
    WG_RS(T, TY, 128, WG_R64, WG_ACC64, 64, 65, 66, 67, 68)
FLASH_WGMMA(__nv_bfloat16, "bf16")
FLASH_WGMMA(__half, "f16")
#undef FLASH_WGMMA
#undef WG_SS
#undef WG_RS

// Issues D [64 x N] = A B^T over K columns (K / 16 wgmmas, both operands K-major tiles K
// elements wide in shared memory) and commits them; the caller waits, and may work meanwhile.
template <typename T, int N, int K>
__device__ __forceinline__ void issue_ss(float (*d)[4], const T* a, const T* b) {
    zero_tiles<N / 8>(d);
    pin<N / 8>(d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        wgmma_ss<T, N>(d, desc<K>(a + kk * 128), desc<K>(b + kk * 128));
    wg_commit();
}

// Rows [r0, r0 + rows) of a [n, D] matrix into a K-major tile (k = the D columns) by cp.async,
// 16 bytes (one core-matrix row) per copy; rows past n are zeros.
template <typename T, int D>
__device__ __forceinline__ void load_tiled_async(T* dst, const T* src, int r0, int rows, int n) {
    for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        const bool in = r0 + r < n;
        cp_async16(dst + tiled<D>(r, c), src + (size_t)(in ? r0 + r : 0) * D + c, in ? 16 : 0);
    }
}

// 16-bit element j (0..7, at run time) of 8 packed in `x`, by selects (an indexed register
// array would go to local memory).
__device__ __forceinline__ uint32_t element(const uint4& x, int j) {
    const uint32_t w = (j & 4) ? ((j & 2) ? x.w : x.z) : ((j & 2) ? x.y : x.x);
    return (j & 1) ? (w >> 16) : (w & 0xffffu);
}

// ROWS rows of a [n, D] matrix in registers on their way to shared memory, transposed (and,
// for the backward's Q and dO, also as they are). Per step a thread holds two rows' 8 values
// of one 8-column chunk: lane % 4 picks the row pair within a group of 8 rows, lane / 4 the
// chunk (so a warp reads 128-byte rows), the step and warp the rest.
template <int D, int ROWS, int THREADS> struct RowPairs {
    static constexpr int STEPS = (ROWS / 2) * (D / 8) / THREADS;
    static_assert(STEPS >= 1 && (ROWS / 2) * (D / 8) % THREADS == 0, "whole steps");
    uint4 lo[STEPS], hi[STEPS];

    // The first of the step's two rows (from the tile's start) and its chunk's first column.
    __device__ __forceinline__ static void at(int s, int& row, int& col) {
        const int idx = threadIdx.x + s * THREADS, lane = idx & 31, w = idx >> 5;
        constexpr int HALVES = D / 64;  // 8 chunks per warp-row of lanes
        row = 2 * ((w / HALVES) * 4 + (lane & 3));
        col = ((lane >> 2) + 8 * (w % HALVES)) * 8;
    }

    // Rows [r0, r0 + ROWS) of `src` [n, D] (rows past n are zeros).
    template <typename T> __device__ __forceinline__ void load(const T* src, int r0, int n) {
        const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            int row, col;
            at(s, row, col);
            row += r0;
            lo[s] = row < n ? *reinterpret_cast<const uint4*>(src + (size_t)row * D + col) : zero;
            hi[s] = row + 1 < n ? *reinterpret_cast<const uint4*>(src + (size_t)(row + 1) * D + col)
                                : zero;
        }
    }

    // As [D x ROWS], K-major (k = the rows): each 32-bit store is two rows of one column. A
    // core matrix's 32 words are the 32 banks; lanes start at different columns (rotated by
    // lane / 4) so that a warp's store touches each bank once.
    template <typename T> __device__ __forceinline__ void store_t(T* dst) const {
        const int rot = (threadIdx.x & 31) >> 2;
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            int row, col;
            at(s, row, col);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int j = (e + rot) & 7;
                *reinterpret_cast<uint32_t*>(dst + tiled<ROWS>(col + j, row)) =
                    element(lo[s], j) | (element(hi[s], j) << 16);
            }
        }
    }

    // As they are, [ROWS x D] K-major (k = the D columns): 16 bytes per store.
    template <typename T> __device__ __forceinline__ void store(T* dst) const {
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
            int row, col;
            at(s, row, col);
            *reinterpret_cast<uint4*>(dst + tiled<D>(row, col)) = lo[s];
            *reinterpret_cast<uint4*>(dst + tiled<D>(row + 1, col)) = hi[s];
        }
    }
};

// Keeps the compiler from moving the writes of N A fragments past the wgmma fence.
template <int N> __device__ __forceinline__ void pin_a(uint32_t (*a)[4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[n][e])::"memory");
}

template <typename T, int D, bool CAP>
__device__ void flash_fwd_wg(const T* q, const T* k, const T* v, const uint32_t* lo,
                             const uint32_t* hi, float* o, float* lse, int hq, int hk, int nq,
                             int nk, int nq_pad, float scale, float cap) {
    constexpr int BR = 64, BC = 64;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sq = (T*)smem;        // Q [BR x D]
    T* sk = sq + BR * D;     // K [BC x D]
    T* svt = sk + BC * D;    // V^T [D x BC]
    __shared__ int kfirst, kend;

    const int bh = blockIdx.y, bi = bh / hq, h = bh % hq, kvh = h / (hq / hk);
    const int i0 = blockIdx.x * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const T* qb = q + (size_t)bh * nq * D;
    const T* kb = k + (size_t)(bi * hk + kvh) * nk * D;
    const T* vb = v + (size_t)(bi * hk + kvh) * nk * D;
    const uint32_t* lob = lo + (size_t)bi * nq;
    const uint32_t* hib = hi + (size_t)bi * nq;

    load_tiled_async<T, D>(sq, qb, i0, BR, nq);  // in flight during the span scan
    // The keys any row of the block sees: the key tiles to visit.
    const int2 tiles = key_tiles<BR, BC>(lob, hib, i0, nq, nk, kfirst, kend);
    const int j_begin = tiles.x, j_end = tiles.y;
    if (j_begin < j_end) load_tiled_async<T, D>(sk, kb, j_begin, BC, nk);
    cp_async_commit();
    cp_async_wait<0>();
    fence_async();
    __syncthreads();

    int rlo[2], rhi[2];
    row_spans(lob, hib, i0 + warp * 16 + g, nq, rlo, rhi);
    float acc[D / 8][4];
    zero_tiles<D / 8>(acc);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const float sl2 = scale * LOG2E;
    const float over_cap = CAP ? scale / cap : 0.f, cap2 = cap * LOG2E;

    for (int j0 = j_begin; j0 < j_end; j0 += BC) {
        // S = Q K^T, issued; V_j comes into registers while it runs.
        float s[BC / 8][4];
        issue_ss<T, BC, D>(s, sq, sk);
        RowPairs<D, BC, 128> vt;
        vt.load(vb, j0, nk);
        wg_wait();
        pin<BC / 8>(s);
        __syncthreads();  // no product reads K_j or V^T_{j-1} any more
        if (j0 + BC < j_end) load_tiled_async<T, D>(sk, kb, j0 + BC, BC, nk);
        cp_async_commit();
        vt.store_t(svt);
        online_softmax<BC, D, CAP>(s, acc, m, l, rlo, rhi, j0 + 2 * t, sl2, over_cap, cap2);
        // O += P V: two score tiles (16 keys) are one A fragment, all packed before the fence.
        uint32_t a[BC / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) pack_a<T>(a[kk], s, kk);
        pin_a<BC / 16>(a);
        fence_async();
        __syncthreads();  // V^T_j is in place
        pin<D / 8>(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            wgmma_rs<T, D>(acc, a[kk], desc<BC>(svt + kk * 128));
        wg_commit();
        wg_wait();
        pin<D / 8>(acc);
        cp_async_wait<0>();
        fence_async();
        __syncthreads();  // K_{j+1} is in place
    }
    store_rows<D>(acc, m, l, o, lse, (size_t)bh * nq_pad + i0 + warp * 16 + g, t);
}

// The backward on Hopper: flash.cu's 128-key backward (the same grid, inputs and outputs)
// with its five products on wgmma. A block is two warpgroups; warpgroup w owns the block's
// keys 64w..64w+63 and its warp 4w + i their rows 16i.. in the accumulators' layout, so the
// per-score code and the dK / dV writes are flash.cu's. Per query tile of BR rows (64 at head
// dim 64, 32 at 128, where dK and dV take 128 registers a thread) that sees the block:
//   S^T = K_w Q^T and dP^T = V_w dO^T   (A = K_w, V_w; B = Q, dO; all in shared memory)
//   P^T and dS^T in registers; dS to shared memory (the tile's queries x the block's keys)
//   dV_w += P^T dO and dK_w += dS^T Q   (A = P^T, dS^T in registers; B = dO^T, Q^T)
//   dQ^T += K^T dS^T                    (A = K^T, B = dS, in shared memory), added to the
//                                        f32 dQ by atomics; a warpgroup takes 64 of dQ's
//                                        columns and 32 of its rows: at head dim 64 every
//                                        column and half the tile's queries, at 128 half
//                                        the columns and every query
// Q and dO come through registers (stored as they are and transposed); the next visible
// tile's loads are in flight while this one is computed.
template <typename T, int D, bool CAP>
__device__ void flash_bwd_wg(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                             const float* delta, const uint32_t* lo, const uint32_t* hi,
                             float* dq, float* dk, float* dv, int hq, int hk, int nq, int nk,
                             int nk_pad, float scale, float cap) {
    constexpr int BR = D == 64 ? 64 : 32, BC = 128, THREADS = 256;
    // dQ^T's block per warpgroup: 64 columns of dQ (from d0) by NQ queries (from q0).
    constexpr int NQ = D * BR / 128;
    static_assert(NQ == 32 && (D == 64 || D == 128), "head dim 64 or 128");
    extern __shared__ __align__(128) unsigned char smem[];
    T* sk = (T*)smem;        // K [BC x D]
    T* sv = sk + BC * D;     // V [BC x D]
    T* skt = sv + BC * D;    // K^T [D x BC]
    T* sq = skt + D * BC;    // Q [BR x D]
    T* sdo = sq + BR * D;    // dO [BR x D]
    T* sqt = sdo + BR * D;   // Q^T [D x BR]
    T* sdot = sqt + D * BR;  // dO^T [D x BR]
    T* sds = sdot + D * BR;  // dS [BR x BC]
    __shared__ float s_lse[2][BR], s_delta[2][BR];
    __shared__ int s_lo[2][BR], s_hi[2][BR];

    const int bh = blockIdx.y, bi = bh / hq, h = bh % hq, kvh = h / (hq / hk);
    const int j0 = blockIdx.x * BC;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
    const int g = lane >> 2, t = lane & 3;
    const T* kb = k + (size_t)(bi * hk + kvh) * nk * D;
    const T* vb = v + (size_t)(bi * hk + kvh) * nk * D;
    const T* qb = q + (size_t)bh * nq * D;
    const T* dob = dout + (size_t)bh * nq * D;
    const uint32_t* lob = lo + (size_t)bi * nq;
    const uint32_t* hib = hi + (size_t)bi * nq;
    auto next_visible = [&](int i0, int b) -> int {
        return next_visible_tile<BR, BC>(i0, s_lo[b], s_hi[b], s_lse[b], s_delta[b], lob, hib,
                                         lse, delta, (size_t)bh * nq, nq, j0);
    };

    // K and V as they are (cp.async), K^T through registers, and the first visible tile.
    load_tiled_async<T, D>(sk, kb, j0, BC, nk);
    load_tiled_async<T, D>(sv, vb, j0, BC, nk);
    cp_async_commit();
    {
        RowPairs<D, BC, THREADS> kt;
        kt.load(kb, j0, nk);
        kt.store_t(skt);
    }
    RowPairs<D, BR, THREADS> tq, tdo;
    int i0 = next_visible(0, 0);
    if (i0 < nq) {
        tq.load(qb, i0, nq);
        tdo.load(dob, i0, nq);
        tq.store(sq);
        tq.store_t(sqt);
        tdo.store(sdo);
        tdo.store_t(sdot);
    }
    cp_async_wait<0>();
    fence_async();
    __syncthreads();

    float dka[D / 8][4], dva[D / 8][4];
    zero_tiles<D / 8>(dka);
    zero_tiles<D / 8>(dva);
    // This thread's two keys (rows of S^T).
    const int key0 = j0 + warp * 16 + g;
    const float sl2 = scale * LOG2E;
    const float over_cap = CAP ? scale / cap : 0.f, cap2 = cap * LOG2E;
    const T* kw = sk + wg * 64 * D;  // this warpgroup's keys
    const T* vw = sv + wg * 64 * D;
    const int d0 = D == 128 ? 64 * wg : 0, q0 = D == 64 ? NQ * wg : 0;
    int buf = 0;
    while (i0 < nq) {
        const int i_next = next_visible(i0 + BR, buf ^ 1);
        if (i_next < nq) {
            tq.load(qb, i_next, nq);
            tdo.load(dob, i_next, nq);
        }
        const int* t_lo = s_lo[buf];
        const int* t_hi = s_hi[buf];
        const float* t_lse = s_lse[buf];
        const float* t_delta = s_delta[buf];
        // S^T = K_w Q^T and dP^T = V_w dO^T, 64 keys x BR queries each.
        float st[BR / 8][4], dpt[BR / 8][4];
        zero_tiles<BR / 8>(st);
        zero_tiles<BR / 8>(dpt);
        pin<BR / 8>(st);
        pin<BR / 8>(dpt);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            wgmma_ss<T, BR>(st, desc<D>(kw + kk * 128), desc<D>(sq + kk * 128));
            wgmma_ss<T, BR>(dpt, desc<D>(vw + kk * 128), desc<D>(sdo + kk * 128));
        }
        wg_commit();
        wg_wait();
        pin<BR / 8>(st);
        pin<BR / 8>(dpt);
        // P^T and dS^T = P^T (dP^T - Delta), masked; dS to shared memory.
        backward_scores<BR, CAP>(st, dpt, key0, nk, i0, nq, t_lo, t_hi, t_lse, t_delta, sl2,
                                 over_cap, cap2, g, t, [&](int qc, int kr, float ds) {
                                     sds[tiled<BC>(qc, warp * 16 + kr)] = of<T>(ds);
                                 });
        // dV_w += P^T dO and dK_w += dS^T Q: two query tiles of P^T (dS^T) are one A fragment.
        uint32_t ap[BR / 16][4], ad[BR / 16][4];
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
            pack_a<T>(ap[kk], st, kk);
            pack_a<T>(ad[kk], dpt, kk);
        }
        pin_a<BR / 16>(ap);
        pin_a<BR / 16>(ad);
        pin<D / 8>(dva);
        pin<D / 8>(dka);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
            wgmma_rs<T, D>(dva, ap[kk], desc<BR>(sdot + kk * 128));
            wgmma_rs<T, D>(dka, ad[kk], desc<BR>(sqt + kk * 128));
        }
        wg_commit();
        // dQ^T (64 columns of dQ x NQ queries per warpgroup) += K^T dS^T, once every warp's
        // dS is in place (the dV and dK products run meanwhile).
        fence_async();
        __syncthreads();
        float qa[NQ / 8][4];
        issue_ss<T, NQ, BC>(qa, skt + d0 * BC, sds + q0 * BC);
        wg_wait();
        pin<D / 8>(dva);
        pin<D / 8>(dka);
        pin<NQ / 8>(qa);
        pin_a<BR / 16>(ap);
        pin_a<BR / 16>(ad);
        // This thread's dQ columns d0 + 16 (warp % 4) + g (+ 8), queries q0 + 8n + 2t (+ 1).
        float* col = dq + (size_t)bh * nq * D + d0 + (warp & 3) * 16 + g;
#pragma unroll
        for (int n = 0; n < NQ / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = i0 + q0 + n * 8 + 2 * t + (e & 1);
                if (qi < nq) atomicAdd(col + (size_t)qi * D + 8 * (e >> 1), qa[n][e] * scale);
            }
        __syncthreads();  // no product reads this tile's Q, dO, their transposes or dS any more
        if (i_next < nq) {
            tq.store(sq);
            tq.store_t(sqt);
            tdo.store(sdo);
            tdo.store_t(sdot);
            fence_async();
            __syncthreads();
        }
        buf ^= 1;
        i0 = i_next;
    }
    store_kv_rows<D>(dka, dva, dk, dv, (size_t)bh * nk_pad + j0 + warp * 16 + g, t, scale);
}

// flash_fwd_wg[_cap]_<dtype>_d<D>: flash.cu's flash_fwd entry points (the same arguments).
#define FLASH_WG_ENTRY(NAME, T, D, CAP)                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        NAME(const T* q, const T* k, const T* v, const uint32_t* lo, const uint32_t* hi,        \
             float* o, float* lse, int hq, int hk, int nq, int nk, int nq_pad, float scale,     \
             float cap) {                                                                       \
        flash_fwd_wg<T, D, CAP>(q, k, v, lo, hi, o, lse, hq, hk, nq, nk, nq_pad, scale, cap);   \
    }
#define FLASH_WG_DTYPE(SUFFIX, T)                                                               \
    FLASH_WG_ENTRY(flash_fwd_wg_##SUFFIX##_d64, T, 64, false)                                   \
    FLASH_WG_ENTRY(flash_fwd_wg_cap_##SUFFIX##_d64, T, 64, true)                                \
    FLASH_WG_ENTRY(flash_fwd_wg_##SUFFIX##_d128, T, 128, false)                                 \
    FLASH_WG_ENTRY(flash_fwd_wg_cap_##SUFFIX##_d128, T, 128, true)

// flash_bwd_wg[_cap]_<dtype>_d<D>: flash.cu's flash_bwd128 entry points (the same arguments).
#define FLASH_WG_BWD_ENTRY(NAME, T, D, CAP)                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        NAME(const T* q, const T* k, const T* v, const T* dout, const float* lse,               \
             const float* delta, const uint32_t* lo, const uint32_t* hi, float* dq, float* dk,   \
             float* dv, int hq, int hk, int nq, int nk, int nk_pad, float scale, float cap) {   \
        flash_bwd_wg<T, D, CAP>(q, k, v, dout, lse, delta, lo, hi, dq, dk, dv, hq, hk, nq, nk,   \
                                 nk_pad, scale, cap);                                           \
    }
#define FLASH_WG_BWD_DTYPE(SUFFIX, T)                                                           \
    FLASH_WG_BWD_ENTRY(flash_bwd_wg_##SUFFIX##_d64, T, 64, false)                               \
    FLASH_WG_BWD_ENTRY(flash_bwd_wg_cap_##SUFFIX##_d64, T, 64, true)                            \
    FLASH_WG_BWD_ENTRY(flash_bwd_wg_##SUFFIX##_d128, T, 128, false)                             \
    FLASH_WG_BWD_ENTRY(flash_bwd_wg_cap_##SUFFIX##_d128, T, 128, true)
FLASH_WG_BWD_DTYPE(bf16, __nv_bfloat16)
FLASH_WG_BWD_DTYPE(f16, __half)

FLASH_WG_DTYPE(bf16, __nv_bfloat16)
FLASH_WG_DTYPE(f16, __half)

// Probes of the two operand forms every product above is made of, each alone on one
// warpgroup, so that a first GPU run tells an operand-layout error (descriptors, fragments,
// transposed stores, fences) from one in a kernel's own logic (cuda_flash::wgmma_probe and
// the GPU test `wgmma_operands_follow_the_cpu`):
//   wg_probe_ss_n<N>_d<D>: S [64 x N] = A B^T, A [64 x D] and B [N x D] bf16 staged by
//     load_tiled_async and read by descriptors (the forward's S, the backward's S^T and dQ^T);
//   wg_probe_rs_d<D>: O [64 x D] = P V, P [64 x 64] f32 rounded to bf16 and packed by pack_a
//     from the accumulators' layout, V [64 x D] bf16 transposed by RowPairs::store_t (the
//     forward's O and the backward's dV and dK).
// Outputs f32, row-major, written from the accumulators' layout (warp w: rows 16w + g and
// 16w + g + 8, tile n: columns 8n + 2t and 8n + 2t + 1).
// Element e of accumulator tile n of this thread: (row, column) of a [64 x N] product.
__device__ __forceinline__ void acc_at(int n, int e, int& row, int& col) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    row = warp * 16 + (lane >> 2) + 8 * (e >> 1);
    col = n * 8 + 2 * (lane & 3) + (e & 1);
}

// f(n, e, i) for element e of this thread's accumulator tile n, at i in a row-major
// [64 x N] matrix.
template <int N, typename F> __device__ __forceinline__ void each_acc(F f) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int row, col;
            acc_at(n, e, row, col);
            f(n, e, row * N + col);
        }
}

template <int N, int D>
__device__ void wg_probe_ss(const __nv_bfloat16* a, const __nv_bfloat16* b, float* s) {
    using T = __nv_bfloat16;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sa = (T*)smem;     // A [64 x D]
    T* sb = sa + 64 * D;  // B [N x D]
    load_tiled_async<T, D>(sa, a, 0, 64, 64);
    load_tiled_async<T, D>(sb, b, 0, N, N);
    cp_async_commit();
    cp_async_wait<0>();
    fence_async();
    __syncthreads();
    float d[N / 8][4];
    issue_ss<T, N, D>(d, sa, sb);
    wg_wait();
    pin<N / 8>(d);
    each_acc<N>([&](int n, int e, int i) { s[i] = d[n][e]; });
}

template <int D> __device__ void wg_probe_rs(const float* p, const __nv_bfloat16* v, float* o) {
    using T = __nv_bfloat16;
    extern __shared__ __align__(128) unsigned char smem[];
    T* svt = (T*)smem;  // V^T [D x 64]
    RowPairs<D, 64, 128> vt;
    vt.load(v, 0, 64);
    vt.store_t(svt);
    float s[8][4];
    each_acc<64>([&](int n, int e, int i) { s[n][e] = p[i]; });
    uint32_t af[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) pack_a<T>(af[kk], s, kk);
    pin_a<4>(af);
    fence_async();
    __syncthreads();
    float d[D / 8][4];
    zero_tiles<D / 8>(d);
    pin<D / 8>(d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, D>(d, af[kk], desc<64>(svt + kk * 128));
    wg_commit();
    wg_wait();
    pin<D / 8>(d);
    each_acc<D>([&](int n, int e, int i) { o[i] = d[n][e]; });
}

#define WG_PROBE_SS(N, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) wg_probe_ss_n##N##_d##D(                  \
        const __nv_bfloat16* a, const __nv_bfloat16* b, float* s) {                             \
        wg_probe_ss<N, D>(a, b, s);                                                             \
    }
#define WG_PROBE_RS(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        wg_probe_rs_d##D(const float* p, const __nv_bfloat16* v, float* o) {                    \
        wg_probe_rs<D>(p, v, o);                                                                \
    }
WG_PROBE_SS(32, 64)
WG_PROBE_SS(64, 64)
WG_PROBE_SS(32, 128)
WG_PROBE_SS(64, 128)
WG_PROBE_RS(64)
WG_PROBE_RS(128)
