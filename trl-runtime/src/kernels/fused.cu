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

// 16 bytes of T, moved as one access (these passes are bound by memory: 2-byte accesses leave
// them at a fraction of an H100's bandwidth).
template <typename T> struct Pack16 {
    static constexpr int N = 16 / sizeof(T);
    alignas(16) T e[N];
};
template <typename T> __device__ __forceinline__ Pack16<T> load16(const T* p) {
    Pack16<T> v;
    *reinterpret_cast<uint4*>(v.e) = *reinterpret_cast<const uint4*>(p);
    return v;
}
template <typename T> __device__ __forceinline__ void store16(T* p, const Pack16<T>& v) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v.e);
}
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

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

// RMSNorm forward, one warp per row: y = round(x * rstd) * w, rstd = 1 / sqrt(mean(x^2) + eps)
// (rounded to the input dtype before the weight, as transformers does). Rows of a multiple of
// 16 bytes are read and written 16 bytes at a time; the second pass reads the row again from
// cache.
template <typename T>
__device__ void rms_norm_fwd(const T* x, const T* w, T* y, int rows, int h, float eps) {
    constexpr int V = Pack16<T>::N;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const bool wide = h % V == 0 && aligned16(x) && aligned16(w) && aligned16(y);
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < rows;
         row += gridDim.x * warps) {
        const T* xr = x + (size_t)row * h;
        T* yr = y + (size_t)row * h;
        float ss = 0.f;
        if (wide) {
            for (int i = lane; i < h / V; i += 32) {
                const Pack16<T> xv = load16(xr + i * V);
#pragma unroll
                for (int j = 0; j < V; ++j) ss += to_f(xv.e[j]) * to_f(xv.e[j]);
            }
        } else {
            for (int i = lane; i < h; i += 32) ss += to_f(xr[i]) * to_f(xr[i]);
        }
        const float rstd = 1.f / sqrtf(warp_sum(ss) / h + eps);
        if (wide) {
            for (int i = lane; i < h / V; i += 32) {
                const Pack16<T> xv = load16(xr + i * V), wv = load16(w + i * V);
                Pack16<T> yv;
#pragma unroll
                for (int j = 0; j < V; ++j)
                    yv.e[j] = of<T>(to_f(of<T>(to_f(xv.e[j]) * rstd)) * to_f(wv.e[j]));
                store16(yr + i * V, yv);
            }
        } else {
            for (int i = lane; i < h; i += 32)
                yr[i] = of<T>(to_f(of<T>(to_f(xr[i]) * rstd)) * to_f(w[i]));
        }
    }
}

// RMSNorm backward, one warp per row: dx with x^ = x * rstd and g = dy * w,
// dx = rstd * (g - x^ * mean(g * x^)); dw = sum over rows of dy * round(x^), accumulated per
// warp in its own row of shared memory (warps x h floats), those rows summed and added to `dw`
// (f32, zeroed) once per block.
template <typename T>
__device__ void rms_norm_bwd(const T* x, const T* w, const T* dy, T* dx, float* dw, int rows,
                             int h, float eps) {
    constexpr int V = Pack16<T>::N;
    extern __shared__ float dw_block[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* dw_warp = dw_block + (size_t)warp * h;
    for (int i = threadIdx.x; i < warps * h; i += blockDim.x) dw_block[i] = 0.f;
    __syncthreads();
    const bool wide =
        h % V == 0 && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx);
    for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
        const size_t at = (size_t)row * h;
        float ss = 0.f, dot = 0.f;
        if (wide) {
            for (int i = lane; i < h / V; i += 32) {
                const Pack16<T> xv = load16(x + at + i * V), dv = load16(dy + at + i * V),
                                wv = load16(w + i * V);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float xf = to_f(xv.e[j]);
                    ss += xf * xf;
                    dot += to_f(dv.e[j]) * to_f(wv.e[j]) * xf;
                }
            }
        } else {
            for (int i = lane; i < h; i += 32) {
                const float xf = to_f(x[at + i]);
                ss += xf * xf;
                dot += to_f(dy[at + i]) * to_f(w[i]) * xf;
            }
        }
        const float rstd = 1.f / sqrtf(warp_sum(ss) / h + eps);
        const float mean = warp_sum(dot) * rstd / h;
        if (wide) {
            for (int i = lane; i < h / V; i += 32) {
                const Pack16<T> xv = load16(x + at + i * V), dv = load16(dy + at + i * V),
                                wv = load16(w + i * V);
                Pack16<T> out;
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float xh = to_f(xv.e[j]) * rstd, d = to_f(dv.e[j]);
                    // Column i * V + j kept at j * (h / V) + i: a warp's lanes hit
                    // consecutive words (no bank conflicts).
                    dw_warp[j * (h / V) + i] += d * to_f(of<T>(xh));
                    out.e[j] = of<T>(rstd * (d * to_f(wv.e[j]) - xh * mean));
                }
                store16(dx + at + i * V, out);
            }
        } else {
            for (int i = lane; i < h; i += 32) {
                const float xh = to_f(x[at + i]) * rstd, d = to_f(dy[at + i]);
                dw_warp[i] += d * to_f(of<T>(xh));
                dx[at + i] = of<T>(rstd * (d * to_f(w[i]) - xh * mean));
            }
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
        const int at = wide ? (c % V) * (h / V) + c / V : c;
        float sum = 0.f;
        for (int k = 0; k < warps; ++k) sum += dw_block[(size_t)k * h + at];
        atomicAdd(&dw[c], sum);
    }
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

// The running maximum `m2`, sum of 2^(x2 - m2) and sum of z 2^(x2 - m2) taking the logit `z`
// (x2 = z log2(e); the sums rescaled when the maximum grows). Base 2: exp2 is one instruction,
// expf several.
__device__ __forceinline__ void online_take_z(float z, float x2, float& m2, float& sum,
                                              float& zs) {
    if (x2 > m2) {
        const float r = exp2f(m2 - x2);
        sum = sum * r + 1.f;
        zs = zs * r + z;
        m2 = x2;
    } else {
        const float e = exp2f(x2 - m2);
        sum += e;
        zs += e * z;
    }
}

// Cross-entropy of logits rows against targets (-100 and other negatives: ignored), in place:
// loss[row] = log-sum-exp - logit[target]; stats[2 row] the row's entropy (log-sum-exp minus
// the probabilities' mean logit) and stats[2 row + 1] 1 when the target is the argmax (the
// first maximum, as torch's argmax; TRL's mean_token_accuracy), both 0 for ignored rows; with
// `grads`, the row becomes softmax minus the one-hot target (zero for ignored rows). The fused
// linear cross-entropy's per-row pass. Rows whose length and start allow it are read and
// written 16 bytes at a time (the pass is bound by memory: 2-byte accesses left it at ~0.7
// TB/s on an H100).
template <typename T>
__device__ void cross_entropy_rows(T* logits, const int64_t* targets, float* loss, float* stats,
                                   int rows, int vocab, int grads) {
    constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
    constexpr int V = 16 / sizeof(T);  // elements per 16 bytes
    const bool wide = vocab % V == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        T* r = logits + (size_t)row * vocab;
        const int64_t t = targets[row];
        if (t < 0) {
            if (grads)
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) r[i] = of<T>(0.f);
            if (threadIdx.x == 0) {
                loss[row] = 0.f;
                stats[2 * row] = stats[2 * row + 1] = 0.f;
            }
            continue;
        }
        const float picked = to_f(r[t]);  // read by every thread before any write below
        // One pass for the maximum, the sum (in base 2) and the logits' sum weighted alike
        // (the entropy's), and the maximum before the target (argmax's tie rule); then the
        // block's maximum and each thread's sums brought to it.
        float m2 = -INFINITY, sum = 0.f, zs = 0.f, before = -INFINITY;
        if (wide) {
            for (int i = threadIdx.x; i < vocab / V; i += blockDim.x) {
                alignas(16) T e[V];
                *reinterpret_cast<uint4*>(e) = reinterpret_cast<const uint4*>(r)[i];
                float mx = -INFINITY;
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float z = to_f(e[j]);
                    mx = fmaxf(mx, z * LOG2E);
                    if (i * V + j < t) before = fmaxf(before, z);
                }
                if (mx > m2) {
                    const float rescale = exp2f(m2 - mx);
                    sum *= rescale;
                    zs *= rescale;
                    m2 = mx;
                }
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float z = to_f(e[j]), w = exp2f(z * LOG2E - m2);
                    sum += w;
                    zs += w * z;
                }
            }
        } else {
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float z = to_f(r[i]);
                online_take_z(z, z * LOG2E, m2, sum, zs);
                if (i < t) before = fmaxf(before, z);
            }
        }
        const float mt = m2;
        m2 = block_max(m2);
        const float scale = mt == -INFINITY ? 0.f : exp2f(mt - m2);
        sum = block_sum(sum * scale);
        zs = block_sum(zs * scale);
        before = block_max(before);
        if (threadIdx.x == 0) {
            const float log_z = (m2 + log2f(sum)) * LN2;
            loss[row] = log_z - picked;
            stats[2 * row] = log_z - zs / sum;
            stats[2 * row + 1] = picked * LOG2E >= m2 && picked > before ? 1.f : 0.f;
        }
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

// SwiGLU: out = silu(g) * u, 16 bytes at a time where the buffers allow it.
template <typename T>
__device__ void swiglu_fwd(const T* g, const T* u, T* out, size_t n) {
    constexpr int V = Pack16<T>::N;
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (aligned16(g) && aligned16(u) && aligned16(out)) {
        for (size_t i = start; i < n / V; i += stride) {
            const Pack16<T> gv = load16(g + i * V), uv = load16(u + i * V);
            Pack16<T> o;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float gf = to_f(gv.e[j]);
                o.e[j] = of<T>(gf * sigmoid(gf) * to_f(uv.e[j]));
            }
            store16(out + i * V, o);
        }
        done = n / V * V;
    }
    for (size_t i = done + start; i < n; i += stride) {
        const float gv = to_f(g[i]);
        out[i] = of<T>(gv * sigmoid(gv) * to_f(u[i]));
    }
}

// SwiGLU backward into out = [dg | du]: with s = sigmoid(g),
// dg = d * u * s * (1 + g * (1 - s)), du = d * g * s.
template <typename T>
__device__ __forceinline__ void swiglu_grads(float gv, float uv, float dv, T& dg, T& du) {
    const float s = sigmoid(gv);
    dg = of<T>(dv * uv * s * (1.f + gv * (1.f - s)));
    du = of<T>(dv * gv * s);
}

template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, const T* d, T* out, size_t n) {
    constexpr int V = Pack16<T>::N;
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (aligned16(g) && aligned16(u) && aligned16(d) && aligned16(out) && aligned16(out + n)) {
        for (size_t i = start; i < n / V; i += stride) {
            const Pack16<T> gv = load16(g + i * V), uv = load16(u + i * V), dv = load16(d + i * V);
            Pack16<T> dg, du;
#pragma unroll
            for (int j = 0; j < V; ++j)
                swiglu_grads(to_f(gv.e[j]), to_f(uv.e[j]), to_f(dv.e[j]), dg.e[j], du.e[j]);
            store16(out + i * V, dg);
            store16(out + n + i * V, du);
        }
        done = n / V * V;
    }
    for (size_t i = done + start; i < n; i += stride)
        swiglu_grads(to_f(g[i]), to_f(u[i]), to_f(d[i]), out[i], out[n + i]);
}

// Calls f(r, c) for row r and column c of a [rows, cols] half of each row, every `step`
// columns (grid-stride over rows x cols / step).
template <typename F>
__device__ __forceinline__ void over_half_rows(size_t rows, size_t cols, size_t step, F f) {
    const size_t per_row = cols / step;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * per_row;
         i += (size_t)gridDim.x * blockDim.x)
        f(i / per_row, (i % per_row) * step);
}

// SwiGLU on the halves of each row of gu [rows, 2 cols] (gate | up), as one GEMM against the
// concatenated gate and up weights writes it: out [rows, cols] = silu(gate) * up. By 16 bytes
// where cols is a multiple of the pack (every pack aligned then), else by element.
template <typename T>
__device__ void swiglu_halves_fwd(const T* gu, T* out, size_t rows, size_t cols) {
    constexpr int V = Pack16<T>::N;
    const bool wide = cols % V == 0 && aligned16(gu) && aligned16(out);
    over_half_rows(rows, cols, wide ? V : 1, [&](size_t r, size_t c) {
        const T* row = gu + r * 2 * cols;
        if (!wide) {
            const float gv = to_f(row[c]);
            out[r * cols + c] = of<T>(gv * sigmoid(gv) * to_f(row[cols + c]));
            return;
        }
        const Pack16<T> gv = load16(row + c), uv = load16(row + cols + c);
        Pack16<T> o;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float gf = to_f(gv.e[j]);
            o.e[j] = of<T>(gf * sigmoid(gf) * to_f(uv.e[j]));
        }
        store16(out + r * cols + c, o);
    });
}

// Its backward in place: each row of gu (gate | up) becomes (dgate | dup) for the output's
// gradient d [rows, cols]. Every thread reads the elements it then writes.
template <typename T>
__device__ void swiglu_halves_bwd(T* gu, const T* d, size_t rows, size_t cols) {
    constexpr int V = Pack16<T>::N;
    const bool wide = cols % V == 0 && aligned16(gu) && aligned16(d);
    over_half_rows(rows, cols, wide ? V : 1, [&](size_t r, size_t c) {
        T* row = gu + r * 2 * cols;
        if (!wide) {
            T dg, du;
            swiglu_grads(to_f(row[c]), to_f(row[cols + c]), to_f(d[r * cols + c]), dg, du);
            row[c] = dg;
            row[cols + c] = du;
            return;
        }
        const Pack16<T> gv = load16(row + c), uv = load16(row + cols + c),
                        dv = load16(d + r * cols + c);
        Pack16<T> dg, du;
#pragma unroll
        for (int j = 0; j < V; ++j)
            swiglu_grads(to_f(gv.e[j]), to_f(uv.e[j]), to_f(dv.e[j]), dg.e[j], du.e[j]);
        store16(row + c, dg);
        store16(row + cols + c, du);
    });
}

// Rotary embedding of x [batch, heads, seq, d] by cos, sin [batch, seq, d] (rotate_half
// layout): forward (sign > 0) out_j = x_j c_j - x_{j+h} s_j, out_{j+h} = x_{j+h} c_{j+h} +
// x_j s_{j+h}; backward (sign < 0) is its transpose. One thread per pair (j, j + d/2), or per
// 16 bytes of pairs where half a row is whole 16-byte units (the index math once for them).
template <typename T>
__device__ __forceinline__ void rotate(float a, float b, float c1, float c2, float s1, float s2,
                                       float sign, T& lo, T& hi) {
    if (sign > 0.f) {
        lo = of<T>(a * c1 - b * s1);
        hi = of<T>(b * c2 + a * s2);
    } else {
        lo = of<T>(a * c1 + b * s2);
        hi = of<T>(b * c2 - a * s1);
    }
}

template <typename T>
__device__ void rotary(const T* x, const T* cos, const T* sin, T* out, int heads, int seq,
                       int d, size_t pairs, float sign) {
    constexpr int V = Pack16<T>::N;
    const int half = d / 2;
    const bool wide = half % V == 0 && aligned16(x) && aligned16(cos) && aligned16(sin) &&
                      aligned16(out);
    const int per = wide ? V : 1;  // pairs per thread
    const size_t units = pairs / per;
    for (size_t u = blockIdx.x * (size_t)blockDim.x + threadIdx.x; u < units;
         u += (size_t)gridDim.x * blockDim.x) {
        const size_t p = u * per;
        const size_t row = p / half;
        const int j = (int)(p % half);
        const size_t batch = row / ((size_t)heads * seq);
        const size_t pos = row % seq;
        const size_t at = (batch * seq + pos) * d + j;
        const size_t xi = row * d + j;
        if (wide) {
            const Pack16<T> a = load16(x + xi), b = load16(x + xi + half);
            const Pack16<T> c1 = load16(cos + at), c2 = load16(cos + at + half);
            const Pack16<T> s1 = load16(sin + at), s2 = load16(sin + at + half);
            Pack16<T> lo, hi;
#pragma unroll
            for (int k = 0; k < V; ++k)
                rotate(to_f(a.e[k]), to_f(b.e[k]), to_f(c1.e[k]), to_f(c2.e[k]), to_f(s1.e[k]),
                       to_f(s2.e[k]), sign, lo.e[k], hi.e[k]);
            store16(out + xi, lo);
            store16(out + xi + half, hi);
        } else {
            rotate(to_f(x[xi]), to_f(x[xi + half]), to_f(cos[at]), to_f(cos[at + half]),
                   to_f(sin[at]), to_f(sin[at + half]), sign, out[xi], out[xi + half]);
        }
    }
}

// AdamW over one parameter (or flat shard) in one pass, in place: the f32 master `w` and
// moments `m`, `v` are updated where they are, from the gradient in its own dtype times
// `gscale` (the clipping coefficient: no cast or scaling pass), and with `has_out` the model's
// weight `out` (its own dtype) receives the new value in the same pass. `mask` (read when
// has_mask; a byte per element) is 1 where weight decay applies; the bias corrections are
// folded into `step` (lr / bc1) and `inv_bc2`.
template <typename G, typename W>
__device__ void adamw(float* w, float* m, float* v, const G* g, const unsigned char* mask,
                      int has_mask, W* out, int has_out, size_t n, float gscale, float shrink,
                      float b1, float b2, float step, float inv_bc2, float eps) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float keep = 1.f - shrink * (has_mask ? (float)mask[i] : 1.f);
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
        float* w, float* m, float* v, const G* g, const unsigned char* mask, int has_mask,     \
        W* out, int has_out, size_t n, float gscale, float shrink, float b1, float b2,         \
        float step, float inv_bc2, float eps) {                                                \
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

// Inverted dropout by a counter-based mask (nn::lora's adapters): element i is kept when the
// top 53 bits of splitmix64's output for seed + (i + 1) * golden are below `keep_below` (the
// keep probability x 2^53, rounded up), and then multiplied by `s`, else by 0. The CPU op in
// kernels/fused.rs draws the same mask; the backward is the same op on the gradient.
__device__ __forceinline__ uint64_t counter_hash(uint64_t seed, size_t i) {
    uint64_t z = seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

template <typename T>
__device__ void dropout(const T* x, T* out, size_t n, uint64_t seed, uint64_t keep_below,
                        float s) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = of<T>(to_f(x[i]) * ((counter_hash(seed, i) >> 11) < keep_below ? s : 0.f));
}

// x + uniform noise in [-mag, mag) (NEFTune's embedding noise), drawn as dropout's mask is:
// u = the hash's top 53 bits / 2^53, noise = (2u - 1) mag in f64 rounded to f32, as the CPU
// op in kernels/fused.rs computes it.
template <typename T>
__device__ void uniform_noise(const T* x, T* out, size_t n, uint64_t seed, double mag) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const double u = (double)(counter_hash(seed, i) >> 11) * (1.0 / 9007199254740992.0);
        out[i] = of<T>(to_f(x[i]) + (float)((2.0 * u - 1.0) * mag));
    }
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

// The sums of the squares of many tensors in one launch (f32 math): tensor k (at ptrs[k], of
// lens[k] elements) takes blocks first[k] .. first[k + 1], `per_block` elements each (a
// multiple of 16 bytes), and each block adds its part to out[k]. One launch for a model's
// gradients instead of one per tensor, most of them small.
template <typename T>
__device__ void sums_squares(const uint64_t* ptrs, const uint64_t* lens, const uint32_t* first,
                             int count, size_t per_block, float* out) {
    constexpr int V = Pack16<T>::N;
    // This block's tensor: the last k with first[k] <= blockIdx.x.
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    const T* x = reinterpret_cast<const T*>(ptrs[lo]);
    const size_t n = lens[lo], begin = (size_t)(blockIdx.x - first[lo]) * per_block;
    const size_t end = min(n, begin + per_block);
    float acc = 0.f;
    size_t i = begin + threadIdx.x * V;
    if (aligned16(x)) {
        for (; i + V <= end; i += (size_t)blockDim.x * V) {
            const Pack16<T> v = load16(x + i);
#pragma unroll
            for (int j = 0; j < V; ++j) acc += to_f(v.e[j]) * to_f(v.e[j]);
        }
        // The last, partial unit of the tensor: its elements one by one.
        if (i < end)
            for (size_t e = i; e < end; ++e) acc += to_f(x[e]) * to_f(x[e]);
    } else {
        for (i = begin + threadIdx.x; i < end; i += blockDim.x) acc += to_f(x[i]) * to_f(x[i]);
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) atomicAdd(out + lo, acc);
}

// acc[c] += the sum over rows [r0, r0 + rows_per_block) of x[r, c] (x [rows, n]; acc f32,
// zeroed): a block of columns (blockIdx.x) by a chunk of rows (blockIdx.y), consecutive
// threads on consecutive columns, one atomic add per column and block.
template <typename T>
__device__ void sum_rows(const T* x, int rows, int n, int rows_per_block, float* acc) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    const int r0 = blockIdx.y * rows_per_block, r1 = min(rows, r0 + rows_per_block);
    float sum = 0.f;
    for (int r = r0; r < r1; ++r) sum += to_f(x[(size_t)r * n + c]);
    atomicAdd(acc + c, sum);
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
                                                           float* loss, float* stats,         \
                                                           int rows, int vocab, int grads) {  \
        cross_entropy_rows<T>(logits, targets, loss, stats, rows, vocab, grads);              \
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
    extern "C" __global__ void swiglu_halves_fwd_##SUFFIX(const T* gu, T* out, size_t rows,   \
                                                          size_t cols) {                      \
        swiglu_halves_fwd<T>(gu, out, rows, cols);                                            \
    }                                                                                         \
    extern "C" __global__ void swiglu_halves_bwd_##SUFFIX(T* gu, const T* d, size_t rows,     \
                                                          size_t cols) {                      \
        swiglu_halves_bwd<T>(gu, d, rows, cols);                                              \
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
    extern "C" __global__ void dropout_##SUFFIX(const T* x, T* out, size_t n, uint64_t seed,   \
                                                uint64_t keep_below, float s) {                \
        dropout<T>(x, out, n, seed, keep_below, s);                                            \
    }                                                                                         \
    extern "C" __global__ void uniform_noise_##SUFFIX(const T* x, T* out, size_t n,            \
                                                      uint64_t seed, double mag) {             \
        uniform_noise<T>(x, out, n, seed, mag);                                                \
    }                                                                                         \
    extern "C" __global__ void bias_add_##SUFFIX(const T* x, const T* bias, T* out, size_t n,  \
                                                 int cols) {                                  \
        bias_add<T>(x, bias, out, n, cols);                                                   \
    }                                                                                         \
    extern "C" __global__ void sums_squares_##SUFFIX(const uint64_t* ptrs,                    \
                                                     const uint64_t* lens,                    \
                                                     const uint32_t* first, int count,        \
                                                     size_t per_block, float* out) {          \
        sums_squares<T>(ptrs, lens, first, count, per_block, out);                            \
    }                                                                                         \
    extern "C" __global__ void sum_rows_##SUFFIX(const T* x, int rows, int n,                 \
                                                 int rows_per_block, float* acc) {            \
        sum_rows<T>(x, rows, n, rows_per_block, acc);                                         \
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
