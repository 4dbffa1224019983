// Fused training ops on CUDA: the same math as the CPU kernels of src/nn/fused.rs (RMSNorm,
// SwiGLU, rotary embedding, forward and backward), f32 math inside for f32, bf16 and f16
// tensors. Compiled to PTX by build.rs (nvcc, compute_80: loaded on sm_80 and newer, JIT-compiled
// by the driver) and launched from src/nn/cuda_fused.rs. Inputs are contiguous.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T of(float v);
template <> __device__ __forceinline__ float of<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 of<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <> __device__ __forceinline__ __half of<__half>(float v) { return __float2half(v); }

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), returned to every
// thread.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // an earlier call's readers are done with `partial` and `total`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}

// RMSNorm forward, one block per row: y = round(x * rstd) * w, rstd = 1 / sqrt(mean(x^2) + eps)
// (rounded to the input dtype before the weight, as transformers does).
template <typename T>
__device__ void rms_norm_fwd(const T* x, const T* w, T* y, int rows, int h, float eps) {
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + (size_t)row * h;
        T* yr = y + (size_t)row * h;
        float ss = 0.f;
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            const float v = to_f(xr[i]);
            ss += v * v;
        }
        const float rstd = 1.f / sqrtf(block_sum(ss) / h + eps);
        for (int i = threadIdx.x; i < h; i += blockDim.x)
            yr[i] = of<T>(to_f(of<T>(to_f(xr[i]) * rstd)) * to_f(w[i]));
    }
}

// RMSNorm backward: dx per row, with x^ = x * rstd and g = dy * w,
// dx = rstd * (g - x^ * mean(g * x^)); dw = sum over rows of dy * round(x^), accumulated per
// block in shared memory (h floats) and added to `dw` (f32, zeroed) once per block.
template <typename T>
__device__ void rms_norm_bwd(const T* x, const T* w, const T* dy, T* dx, float* dw, int rows,
                             int h, float eps) {
    extern __shared__ float dw_block[];
    for (int i = threadIdx.x; i < h; i += blockDim.x) dw_block[i] = 0.f;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const size_t at = (size_t)row * h;
        float ss = 0.f, dot = 0.f;
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            const float xv = to_f(x[at + i]);
            ss += xv * xv;
            dot += to_f(dy[at + i]) * to_f(w[i]) * xv;
        }
        const float rstd = 1.f / sqrtf(block_sum(ss) / h + eps);
        const float mean = block_sum(dot) * rstd / h;
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            const float xh = to_f(x[at + i]) * rstd, d = to_f(dy[at + i]);
            dw_block[i] += d * to_f(of<T>(xh));
            dx[at + i] = of<T>(rstd * (d * to_f(w[i]) - xh * mean));
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < h; i += blockDim.x) atomicAdd(&dw[i], dw_block[i]);
}

// Maximum of `v` over the block, as block_sum.
__device__ float block_max(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : -INFINITY;
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}

// The running maximum `m2` and sum of 2^(x2 - m2) taking `x2`, a logit times log2(e) (the sum
// rescaled when the maximum grows). Base 2: exp2 is one instruction, expf several.
__device__ __forceinline__ void online_take(float x2, float& m2, float& sum) {
    if (x2 > m2) {
        sum = sum * exp2f(m2 - x2) + 1.f;
        m2 = x2;
    } else {
        sum += exp2f(x2 - m2);
    }
}

// Cross-entropy of logits rows against targets (-100 and other negatives: ignored), in place:
// loss[row] = log-sum-exp - logit[target] and, with `grads`, the row becomes softmax minus the
// one-hot target (zero for ignored rows). The fused linear cross-entropy's per-row pass. Rows
// whose length and start allow it are read and written 16 bytes at a time (the pass is bound
// by memory: 2-byte accesses left it at ~0.7 TB/s on an H100).
template <typename T>
__device__ void cross_entropy_rows(T* logits, const int64_t* targets, float* loss, int rows,
                                   int vocab, int grads) {
    constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
    constexpr int V = 16 / sizeof(T);  // elements per 16 bytes
    const bool wide = vocab % V == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        T* r = logits + (size_t)row * vocab;
        const int64_t t = targets[row];
        if (t < 0) {
            if (grads)
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) r[i] = of<T>(0.f);
            if (threadIdx.x == 0) loss[row] = 0.f;
            continue;
        }
        const float picked = to_f(r[t]);  // read by every thread before any write below
        // One pass for the maximum and the sum (in base 2), then the block's maximum and each
        // thread's sum brought to it.
        float m2 = -INFINITY, sum = 0.f;
        if (wide) {
            for (int i = threadIdx.x; i < vocab / V; i += blockDim.x) {
                alignas(16) T e[V];
                *reinterpret_cast<uint4*>(e) = reinterpret_cast<const uint4*>(r)[i];
                float mx = -INFINITY;
#pragma unroll
                for (int j = 0; j < V; ++j) mx = fmaxf(mx, to_f(e[j]) * LOG2E);
                if (mx > m2) {
                    sum *= exp2f(m2 - mx);
                    m2 = mx;
                }
#pragma unroll
                for (int j = 0; j < V; ++j) sum += exp2f(to_f(e[j]) * LOG2E - m2);
            }
        } else {
            for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                online_take(to_f(r[i]) * LOG2E, m2, sum);
        }
        const float mt = m2;
        m2 = block_max(m2);
        sum = block_sum(mt == -INFINITY ? 0.f : sum * exp2f(mt - m2));
        if (threadIdx.x == 0) loss[row] = (m2 + log2f(sum)) * LN2 - picked;
        if (grads) {
            const float inv = 1.f / sum;
            if (wide) {
                for (int i = threadIdx.x; i < vocab / V; i += blockDim.x) {
                    alignas(16) T e[V];
                    uint4* p = reinterpret_cast<uint4*>(r) + i;
                    *reinterpret_cast<uint4*>(e) = *p;
#pragma unroll
                    for (int j = 0; j < V; ++j)
                        e[j] = of<T>(exp2f(to_f(e[j]) * LOG2E - m2) * inv -
                                     (i * V + j == t ? 1.f : 0.f));
                    *p = *reinterpret_cast<const uint4*>(e);
                }
            } else {
                for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                    r[i] = of<T>(exp2f(to_f(r[i]) * LOG2E - m2) * inv - (i == t ? 1.f : 0.f));
            }
        }
    }
}

template <typename T>
__device__ void cast_from_f32(const float* src, T* dst, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[i] = of<T>(src[i]);
}

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

// SwiGLU: out = silu(g) * u.
template <typename T>
__device__ void swiglu_fwd(const T* g, const T* u, T* out, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gv = to_f(g[i]);
        out[i] = of<T>(gv * sigmoid(gv) * to_f(u[i]));
    }
}

// SwiGLU backward into out = [dg | du]: with s = sigmoid(g),
// dg = d * u * s * (1 + g * (1 - s)), du = d * g * s.
template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, const T* d, T* out, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gv = to_f(g[i]), uv = to_f(u[i]), dv = to_f(d[i]);
        const float s = sigmoid(gv);
        out[i] = of<T>(dv * uv * s * (1.f + gv * (1.f - s)));
        out[n + i] = of<T>(dv * gv * s);
    }
}

// Rotary embedding of x [batch, heads, seq, d] by cos, sin [batch, seq, d] (rotate_half
// layout): forward (sign > 0) out_j = x_j c_j - x_{j+h} s_j, out_{j+h} = x_{j+h} c_{j+h} +
// x_j s_{j+h}; backward (sign < 0) is its transpose. One thread per pair (j, j + d/2).
template <typename T>
__device__ void rotary(const T* x, const T* cos, const T* sin, T* out, int heads, int seq,
                       int d, size_t pairs, float sign) {
    const int half = d / 2;
    for (size_t p = blockIdx.x * (size_t)blockDim.x + threadIdx.x; p < pairs;
         p += (size_t)gridDim.x * blockDim.x) {
        const size_t row = p / half;
        const int j = (int)(p % half);
        const size_t batch = row / ((size_t)heads * seq);
        const size_t pos = row % seq;
        const size_t at = (batch * seq + pos) * d;
        const size_t xi = row * d;
        const float a = to_f(x[xi + j]), b = to_f(x[xi + j + half]);
        const float c1 = to_f(cos[at + j]), c2 = to_f(cos[at + j + half]);
        const float s1 = to_f(sin[at + j]), s2 = to_f(sin[at + j + half]);
        if (sign > 0.f) {
            out[xi + j] = of<T>(a * c1 - b * s1);
            out[xi + j + half] = of<T>(b * c2 + a * s2);
        } else {
            out[xi + j] = of<T>(a * c1 + b * s2);
            out[xi + j + half] = of<T>(b * c2 - a * s1);
        }
    }
}

// AdamW over one parameter (or flat shard) in one pass, in place: the f32 master `w` and
// moments `m`, `v` are updated where they are, from the gradient in its own dtype times
// `gscale` (the clipping coefficient: no cast or scaling pass), and with `has_out` the model's
// weight `out` (its own dtype) receives the new value in the same pass. `mask` (read when
// has_mask) is 1 where weight decay applies; the bias corrections are folded into `step`
// (lr / bc1) and `inv_bc2`.
template <typename G, typename W>
__device__ void adamw(float* w, float* m, float* v, const G* g, const float* mask, int has_mask,
                      W* out, int has_out, size_t n, float gscale, float shrink, float b1,
                      float b2, float step, float inv_bc2, float eps) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float keep = 1.f - shrink * (has_mask ? mask[i] : 1.f);
        const float gi = to_f(g[i]) * gscale;
        const float mi = b1 * m[i] + (1.f - b1) * gi;
        const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        const float wi = w[i] * keep - step * mi / (sqrtf(vi) * inv_bc2 + eps);
        w[i] = wi;
        m[i] = mi;
        v[i] = vi;
        if (has_out) out[i] = of<W>(wi);
    }
}

#define ADAMW_ENTRY(GS, G, WS, W)                                                              \
    extern "C" __global__ void adamw_##GS##_##WS(                                              \
        float* w, float* m, float* v, const G* g, const float* mask, int has_mask, W* out,     \
        int has_out, size_t n, float gscale, float shrink, float b1, float b2, float step,     \
        float inv_bc2, float eps) {                                                            \
        adamw<G, W>(w, m, v, g, mask, has_mask, out, has_out, n, gscale, shrink, b1, b2, step, \
                    inv_bc2, eps);                                                             \
    }
#define ADAMW_FOR_WEIGHT(GS, G)                                                                \
    ADAMW_ENTRY(GS, G, f32, float) ADAMW_ENTRY(GS, G, bf16, __nv_bfloat16)                     \
    ADAMW_ENTRY(GS, G, f16, __half)
ADAMW_FOR_WEIGHT(f32, float)
ADAMW_FOR_WEIGHT(bf16, __nv_bfloat16)
ADAMW_FOR_WEIGHT(f16, __half)

// Embedding rows: out[t, :] = w[ids[t], :] (one thread per element).
template <typename T>
__device__ void embedding_fwd(const T* w, const uint32_t* ids, T* out, size_t n, int hidden) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / hidden, c = i % hidden;
        out[i] = w[(size_t)ids[t] * hidden + c];
    }
}

// Embedding backward for columns [c0, c0 + ch) of the table: dw[ids[t], c - c0] += dy[t, c]
// into an f32 slab [vocab, ch] (zeroed), with atomics (repeated ids add up); the slab is added
// into the table gradient's columns after (`embedding_slab_add`). Column slabs keep the f32
// buffer small (Qwen2's table in f32 would be 544 MB).
template <typename T>
__device__ void embedding_bwd(const T* dy, const uint32_t* ids, float* dw, size_t n_ids,
                              int hidden, int c0, int ch) {
    const size_t n = n_ids * ch;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / ch, c = i % ch;
        atomicAdd(dw + (size_t)ids[t] * ch + c, to_f(dy[t * hidden + c0 + c]));
    }
}

// The slab added into the table gradient's columns (zeros, or a tied table's gradient begun
// by the LM head's loss).
template <typename T>
__device__ void embedding_slab_add(const float* dw, T* out, size_t vocab, int hidden, int c0,
                                   int ch) {
    const size_t n = vocab * ch;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t v = i / ch, c = i % ch;
        T* o = out + v * hidden + c0 + c;
        *o = of<T>(dw[i] + to_f(*o));
    }
}

// x *= s in place (the fused loss's kept gradients times the loss's incoming gradient).
template <typename T> __device__ void scale(T* x, size_t n, float s) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = of<T>(to_f(x[i]) * s);
}

// x [a, b, c, row] -> out [a, c, b, row] (dims 1 and 2 swapped: attention's heads moved
// ahead of the sequence, or back), `row` units of U each (16 bytes when the row allows it):
// each thread moves one unit, reading and writing whole rows in order.
template <typename U>
__device__ void swap12(const U* x, U* out, size_t a, size_t b, size_t c, size_t row) {
    const size_t n = a * b * c * row;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t e = i % row, r = i / row;  // r indexes [a, b, c] of the input
        const size_t k = r % c, j = (r / c) % b, h = r / (b * c);
        out[((h * c + k) * b + j) * row + e] = x[i];
    }
}

// out = x + bias over the last dim (`cols`), f32 math: a linear layer's bias without a
// broadcast kernel.
template <typename T>
__device__ void bias_add(const T* x, const T* bias, T* out, size_t n, int cols) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = of<T>(to_f(x[i]) + to_f(bias[i % cols]));
}

extern "C" __global__ void swap12_u128(const uint4* x, uint4* out, size_t a, size_t b, size_t c,
                                       size_t row) {
    swap12<uint4>(x, out, a, b, c, row);
}
extern "C" __global__ void swap12_u16(const uint16_t* x, uint16_t* out, size_t a, size_t b,
                                      size_t c, size_t row) {
    swap12<uint16_t>(x, out, a, b, c, row);
}
extern "C" __global__ void swap12_u32(const uint32_t* x, uint32_t* out, size_t a, size_t b,
                                      size_t c, size_t row) {
    swap12<uint32_t>(x, out, a, b, c, row);
}

// out[0] += the sum of the squares of x (f32 math; one atomic add per block).
template <typename T>
__device__ void sum_squares(const T* x, size_t n, float* out) {
    float acc = 0.f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float xi = to_f(x[i]);
        acc += xi * xi;
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) atomicAdd(out, acc);
}

// acc += x, acc in f32: a running sum of partial products without a cast pass or a new buffer.
template <typename T>
__device__ void add_into(float* acc, const T* x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        acc[i] += to_f(x[i]);
}

#define FOR_EACH_DTYPE(M) M(f32, float) M(bf16, __nv_bfloat16) M(f16, __half)

#define ENTRY_POINTS(SUFFIX, T)                                                              \
    extern "C" __global__ void rms_norm_fwd_##SUFFIX(const T* x, const T* w, T* y, int rows,  \
                                                     int h, float eps) {                      \
        rms_norm_fwd<T>(x, w, y, rows, h, eps);                                               \
    }                                                                                         \
    extern "C" __global__ void rms_norm_bwd_##SUFFIX(const T* x, const T* w, const T* dy,     \
                                                     T* dx, float* dw, int rows, int h,       \
                                                     float eps) {                             \
        rms_norm_bwd<T>(x, w, dy, dx, dw, rows, h, eps);                                      \
    }                                                                                         \
    extern "C" __global__ void cross_entropy_rows_##SUFFIX(T* logits, const int64_t* targets,  \
                                                           float* loss, int rows, int vocab,  \
                                                           int grads) {                       \
        cross_entropy_rows<T>(logits, targets, loss, rows, vocab, grads);                     \
    }                                                                                         \
    extern "C" __global__ void cast_from_f32_##SUFFIX(const float* src, T* dst, int n) {      \
        cast_from_f32<T>(src, dst, n);                                                        \
    }                                                                                         \
    extern "C" __global__ void swiglu_fwd_##SUFFIX(const T* g, const T* u, T* out, size_t n) { \
        swiglu_fwd<T>(g, u, out, n);                                                          \
    }                                                                                         \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T* g, const T* u, const T* d, T* out, \
                                                   size_t n) {                                \
        swiglu_bwd<T>(g, u, d, out, n);                                                       \
    }                                                                                         \
    extern "C" __global__ void embedding_fwd_##SUFFIX(const T* w, const uint32_t* ids, T* out,  \
                                                      size_t n, int hidden) {                  \
        embedding_fwd<T>(w, ids, out, n, hidden);                                              \
    }                                                                                         \
    extern "C" __global__ void embedding_bwd_##SUFFIX(const T* dy, const uint32_t* ids,        \
                                                      float* dw, size_t n_ids, int hidden,     \
                                                      int c0, int ch) {                        \
        embedding_bwd<T>(dy, ids, dw, n_ids, hidden, c0, ch);                                  \
    }                                                                                         \
    extern "C" __global__ void embedding_slab_add_##SUFFIX(const float* dw, T* out,            \
                                                           size_t vocab, int hidden, int c0,   \
                                                           int ch) {                           \
        embedding_slab_add<T>(dw, out, vocab, hidden, c0, ch);                                 \
    }                                                                                         \
    extern "C" __global__ void scale_##SUFFIX(T* x, size_t n, float s) { scale<T>(x, n, s); } \
    extern "C" __global__ void bias_add_##SUFFIX(const T* x, const T* bias, T* out, size_t n,  \
                                                 int cols) {                                  \
        bias_add<T>(x, bias, out, n, cols);                                                   \
    }                                                                                         \
    extern "C" __global__ void sum_squares_##SUFFIX(const T* x, size_t n, float* out) {        \
        sum_squares<T>(x, n, out);                                                            \
    }                                                                                         \
    extern "C" __global__ void add_into_##SUFFIX(float* acc, const T* x, size_t n) {           \
        add_into<T>(acc, x, n);                                                               \
    }                                                                                         \
    extern "C" __global__ void rotary_##SUFFIX(const T* x, const T* cos, const T* sin, T* out, \
                                               int heads, int seq, int d, size_t pairs,       \
                                               float sign) {                                  \
        rotary<T>(x, cos, sin, out, heads, seq, d, pairs, sign);                              \
    }

FOR_EACH_DTYPE(ENTRY_POINTS)
