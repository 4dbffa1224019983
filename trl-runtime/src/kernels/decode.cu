// Decode attention on CUDA (generation's step: a few new queries against the KV cache), as
// flash-decoding splits it: the cached keys of each (batch row, query head, query) cut into
// `splits` stretches, one block each, every block an online softmax over its stretch (its
// output and log-sum-exp in f32), then one pass combining the stretches. The same math as
// the CPU kernel (src/kernels/decode.rs); the split-and-combine is proven there on the CPU
// (`split_combine`, tested against the reference). Compiled to PTX by build.rs.
//
// q [b, heads, sq, d]; k, v [b, kv_heads, cap, d] (the cache buffers); lo, hi [b * sq]: the
// keys each query sees. Head dims up to 256 (8 floats per lane of a warp).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

#define WARPS 4
#define PER_LANE 8

// One block per (row = (b, head, query), split); a warp per key at a time, each lane holding
// d / 32 features; the warps' running (max, sum, output) merged at the end.
template <typename T>
__device__ void decode_split(const T* q, const T* k, const T* v, const uint32_t* lo,
                             const uint32_t* hi, float* o_part, float* lse_part, int heads,
                             int kv_heads, int sq, int cap, int d, int splits, float scale,
                             float softcap) {
    const int row = blockIdx.x, split = blockIdx.y;
    const int qi = row % sq, h = (row / sq) % heads, b = row / (sq * heads);
    const int kh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int from = lo[b * sq + qi], to = hi[b * sq + qi];
    const int len = to > from ? to - from : 0;
    const int per = (len + splits - 1) / splits;
    const int s0 = from + split * per, s1 = min(to, s0 + per);
    float qv[PER_LANE], acc[PER_LANE];
    const T* qr = q + ((size_t)(b * heads + h) * sq + qi) * d;
    for (int i = 0; i < PER_LANE; i++) {
        const int f = lane + 32 * i;
        qv[i] = f < d ? to_f(qr[f]) * scale : 0.f;
        acc[i] = 0.f;
    }
    float m = -CUDART_INF_F, l = 0.f;
    const size_t base = (size_t)(b * kv_heads + kh) * cap * d;
    for (int j = s0 + warp; j < s1; j += WARPS) {
        const T* kr = k + base + (size_t)j * d;
        float s = 0.f;
        for (int i = 0; i < PER_LANE; i++) {
            const int f = lane + 32 * i;
            if (f < d) s += qv[i] * to_f(kr[f]);
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        const float alpha = __expf(m - m_new), p = __expf(s - m_new);
        l = l * alpha + p;
        const T* vr = v + base + (size_t)j * d;
        for (int i = 0; i < PER_LANE; i++) {
            const int f = lane + 32 * i;
            acc[i] = acc[i] * alpha + (f < d ? p * to_f(vr[f]) : 0.f);
        }
        m = m_new;
    }
    // The warps' partial softmaxes, merged through shared memory.
    __shared__ float sm[WARPS], sl[WARPS], so[WARPS][32 * PER_LANE];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    for (int i = 0; i < PER_LANE; i++) so[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float mm = -CUDART_INF_F;
        for (int w = 0; w < WARPS; w++) mm = fmaxf(mm, sm[w]);
        float ll = 0.f;
        float out[PER_LANE] = {0.f};
        for (int w = 0; w < WARPS; w++) {
            const float a = sm[w] == -CUDART_INF_F ? 0.f : __expf(sm[w] - mm);
            ll += sl[w] * a;
            for (int i = 0; i < PER_LANE; i++) out[i] += so[w][lane + 32 * i] * a;
        }
        float* op = o_part + ((size_t)row * splits + split) * d;
        for (int i = 0; i < PER_LANE; i++) {
            const int f = lane + 32 * i;
            if (f < d) op[f] = ll > 0.f ? out[i] / ll : 0.f;
        }
        if (lane == 0) lse_part[row * splits + split] = ll > 0.f ? mm + logf(ll) : -CUDART_INF_F;
    }
}

// The stretches of each row combined: out = sum_s exp(lse_s - L) o_s, L = log sum_s
// exp(lse_s); a row that sees no key gets a zero output and minus infinity. A warp per row.
extern "C" __global__ void decode_combine(const float* o_part, const float* lse_part, float* out,
                                          float* lse, int rows, int splits, int d) {
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float mm = -CUDART_INF_F;
    for (int s = 0; s < splits; s++) mm = fmaxf(mm, lse_part[row * splits + s]);
    float total = 0.f;
    for (int s = 0; s < splits; s++) {
        const float x = lse_part[row * splits + s];
        total += x == -CUDART_INF_F ? 0.f : __expf(x - mm);
    }
    for (int f = lane; f < d; f += 32) {
        float acc = 0.f;
        for (int s = 0; s < splits; s++) {
            const float x = lse_part[row * splits + s];
            if (x != -CUDART_INF_F)
                acc += o_part[((size_t)row * splits + s) * d + f] * __expf(x - mm) / total;
        }
        out[(size_t)row * d + f] = acc;
    }
    if (lane == 0) lse[row] = total > 0.f ? mm + logf(total) : -CUDART_INF_F;
}

#define DECODE_ENTRY(SFX, T)                                                                     \
    extern "C" __global__ void decode_split_##SFX(                                               \
        const T* q, const T* k, const T* v, const uint32_t* lo, const uint32_t* hi,              \
        float* o_part, float* lse_part, int heads, int kv_heads, int sq, int cap, int d,         \
        int splits, float scale, float softcap) {                                                \
        decode_split<T>(q, k, v, lo, hi, o_part, lse_part, heads, kv_heads, sq, cap, d, splits,  \
                        scale, softcap);                                                         \
    }
DECODE_ENTRY(f32, float)
DECODE_ENTRY(bf16, __nv_bfloat16)
DECODE_ENTRY(f16, __half)

// New keys (or values) [rows = b * kv_heads, sq, d] written into the cache [rows, cap, d]
// after the `len[0]` tokens it holds. The length is read on the device, so that a captured
// CUDA graph writes each step's keys where that step's length (written before its launch)
// says; the host checked that they fit.
template <typename T>
__device__ void kv_append(T* cache, const T* fresh, const uint32_t* len, int rows, int sq,
                          int cap, int d) {
    const size_t n = (size_t)rows * sq * d;
    const size_t at = len[0];
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t f = i % d, t = (i / d) % sq, r = i / ((size_t)d * sq);
        if (at + t < (size_t)cap) cache[(r * cap + at + t) * d + f] = fresh[i];
    }
}

#define APPEND_ENTRY(SFX, T)                                                                    \
    extern "C" __global__ void kv_append_##SFX(T* cache, const T* fresh, const uint32_t* len,   \
                                               int rows, int sq, int cap, int d) {              \
        kv_append<T>(cache, fresh, len, rows, sq, cap, d);                                      \
    }
APPEND_ENTRY(f32, float)
APPEND_ENTRY(bf16, __nv_bfloat16)
APPEND_ENTRY(f16, __half)
