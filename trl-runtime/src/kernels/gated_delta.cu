// The gated delta rule (Gated DeltaNet) on CUDA: the CPU kernel's algorithm and tiling
// (src/kernels/gated_delta.rs, where it is proven against the recurrence), f32. Per head a
// state S [dk, dv]; each token: S' = decay S (0 at a document start), delta = beta (v - S'^T k),
// S = S' + k delta^T, o = S^T q.
//
// One warp per (row x head, block of 32 state columns): each column evolves on its own, so a
// lane owns one column, the block of the state in shared memory ([dk][33]: padded, so that
// the backward's row-wise reads are free of bank conflicts too).
//
// The backward runs the block's row forward again keeping the state every CK tokens (global
// scratch), then per chunk from the last recomputes the chunk's decayed states S' (scratch)
// and goes back token by token: lanes as columns for dS and the value gradients, lanes as
// rows for dq, dk and dg (sums over the columns), then as columns again for the decay.
// Each block writes its partial dq, dk, dg, dbeta (and its own columns' dv) to its own slice;
// `gdr_sum` adds the blocks' slices in a fixed order (no atomics: the same result each run).
//
// x [bh, seq, 2 dk + dv + 2]: per token q, k, v, the log decay g and the strength beta;
// s0 [bh, dk, dv]; starts [b, seq] (1 where a document starts); dk at most MAX_DK.

#include <stdint.h>

#define COLS 32
#define PAD 33
#define CK 16
#define MAX_DK 128

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The token's query and key into shared memory (the warp's lanes together).
__device__ __forceinline__ void load_qk(const float* xt, int dk, float* sq, float* sk) {
    __syncwarp();
    for (int i = threadIdx.x; i < dk; i += 32) {
        sq[i] = xt[i];
        sk[i] = xt[dk + i];
    }
    __syncwarp();
}

// S' = decay S on this lane's column; returns S'^T k.
__device__ __forceinline__ float predict(float* st, const float* sk, int dk, float decay) {
    float pred = 0.f;
    for (int i = 0; i < dk; i++) {
        const float s = st[i * PAD + threadIdx.x] * decay;
        st[i * PAD + threadIdx.x] = s;
        pred += sk[i] * s;
    }
    return pred;
}

// outputs [bh, seq + dk, dv]: the tokens' outputs, then the final state's rows.
extern "C" __global__ void gdr_fwd(const float* x, const float* s0, const uint8_t* starts,
                                   float* out, int heads, int seq, int dk, int dv) {
    const int task = blockIdx.x, lane = threadIdx.x;
    const int row = task / heads, w = 2 * dk + dv + 2;
    const int col = blockIdx.y * COLS + lane;
    const bool live = col < dv;
    __shared__ float st[MAX_DK * PAD];
    __shared__ float sq[MAX_DK], sk[MAX_DK];
    const float* xs = x + (size_t)task * seq * w;
    float* o = out + (size_t)task * (seq + dk) * dv;
    for (int i = 0; i < dk; i++)
        st[i * PAD + lane] = live ? s0[((size_t)task * dk + i) * dv + col] : 0.f;
    for (int t = 0; t < seq; t++) {
        const float* xt = xs + (size_t)t * w;
        load_qk(xt, dk, sq, sk);
        const float decay = starts[(size_t)row * seq + t] ? 0.f : expf(xt[2 * dk + dv]);
        const float beta = xt[2 * dk + dv + 1];
        const float v = live ? xt[2 * dk + col] : 0.f;
        const float delta = beta * (v - predict(st, sk, dk, decay));
        float acc = 0.f;
        for (int i = 0; i < dk; i++) {
            const float s = st[i * PAD + lane] + sk[i] * delta;
            st[i * PAD + lane] = s;
            acc += sq[i] * s;
        }
        if (live) o[(size_t)t * dv + col] = acc;
    }
    if (live)
        for (int i = 0; i < dk; i++) o[((size_t)seq + i) * dv + col] = st[i * PAD + lane];
}

// part [bh, blocks, seq, w] (zeroed): each block's partial token gradients, packed as x;
// out [bh, seq * w + dk * dv]: the initial state's gradient at seq * w, written here (the
// tokens' part by gdr_sum). ck [bh * blocks, ceil(seq / CK), dk, PAD] and sp [bh * blocks,
// CK, dk, PAD]: scratch.
extern "C" __global__ void gdr_bwd(const float* x, const float* s0, const float* grad,
                                   const uint8_t* starts, float* out, float* part, float* ck,
                                   float* sp, int heads, int seq, int dk, int dv) {
    const int task = blockIdx.x, lane = threadIdx.x, blocks = gridDim.y;
    const int row = task / heads, w = 2 * dk + dv + 2;
    const int col = blockIdx.y * COLS + lane;
    const bool live = col < dv;
    const int chunks = (seq + CK - 1) / CK;
    __shared__ float st[MAX_DK * PAD];
    __shared__ float ds[MAX_DK * PAD];
    __shared__ float sq[MAX_DK], sk[MAX_DK];
    __shared__ float res_s[CK * COLS], del_s[CK * COLS];
    __shared__ float dvec[COLS], dpvec[COLS], dovec[COLS];
    const size_t bid = (size_t)task * blocks + blockIdx.y;
    const size_t block = (size_t)dk * PAD;
    float* ckb = ck + bid * chunks * block;
    float* spb = sp + bid * CK * block;
    float* pt = part + bid * seq * w;
    const float* xs = x + (size_t)task * seq * w;
    const float* gr = grad + (size_t)task * (seq + dk) * dv;
    const uint8_t* rs = starts + (size_t)row * seq;
    // Forward again, keeping the state before every CK-th token.
    for (int i = 0; i < dk; i++)
        st[i * PAD + lane] = live ? s0[((size_t)task * dk + i) * dv + col] : 0.f;
    for (int t = 0; t < seq; t++) {
        const float* xt = xs + (size_t)t * w;
        if (t % CK == 0)
            for (int i = 0; i < dk; i++) ckb[(t / CK) * block + i * PAD + lane] = st[i * PAD + lane];
        load_qk(xt, dk, sq, sk);
        const float decay = rs[t] ? 0.f : expf(xt[2 * dk + dv]);
        const float v = live ? xt[2 * dk + col] : 0.f;
        const float delta = xt[2 * dk + dv + 1] * (v - predict(st, sk, dk, decay));
        for (int i = 0; i < dk; i++) st[i * PAD + lane] += sk[i] * delta;
    }
    for (int i = 0; i < dk; i++)
        ds[i * PAD + lane] = live ? gr[((size_t)seq + i) * dv + col] : 0.f;
    for (int c = chunks - 1; c >= 0; c--) {
        const int first = c * CK, last = min(seq, first + CK);
        // The chunk's decayed states S', residuals v - S'^T k and deltas.
        for (int i = 0; i < dk; i++) st[i * PAD + lane] = ckb[c * block + i * PAD + lane];
        for (int t = first; t < last; t++) {
            const int j = t - first;
            const float* xt = xs + (size_t)t * w;
            load_qk(xt, dk, sq, sk);
            const float decay = rs[t] ? 0.f : expf(xt[2 * dk + dv]);
            const float v = live ? xt[2 * dk + col] : 0.f;
            const float res = v - predict(st, sk, dk, decay);
            for (int i = 0; i < dk; i++) spb[j * block + i * PAD + lane] = st[i * PAD + lane];
            const float delta = xt[2 * dk + dv + 1] * res;
            res_s[j * COLS + lane] = res;
            del_s[j * COLS + lane] = delta;
            for (int i = 0; i < dk; i++) st[i * PAD + lane] += sk[i] * delta;
        }
        for (int t = last - 1; t >= first; t--) {
            const int j = t - first;
            const float* xt = xs + (size_t)t * w;
            load_qk(xt, dk, sq, sk);
            for (int i = 0; i < dk; i++) st[i * PAD + lane] = spb[j * block + i * PAD + lane];
            const float decay = rs[t] ? 0.f : expf(xt[2 * dk + dv]);
            const float beta = xt[2 * dk + dv + 1];
            const float dout = live ? gr[(size_t)t * dv + col] : 0.f;
            float* pr = pt + (size_t)t * w;
            // Columns: dS += q do^T; dd = dS^T k; dv = beta dd; dbeta = dd . residual.
            float dd = 0.f;
            for (int i = 0; i < dk; i++) {
                const float d = ds[i * PAD + lane] + sq[i] * dout;
                ds[i * PAD + lane] = d;
                dd += d * sk[i];
            }
            if (live) pr[2 * dk + col] = beta * dd;
            const float dbeta = warp_sum(dd * res_s[j * COLS + lane]);
            if (lane == 0) pr[2 * dk + dv + 1] = dbeta;
            dvec[lane] = del_s[j * COLS + lane];
            dpvec[lane] = -beta * dd;
            dovec[lane] = dout;
            __syncwarp();
            // Rows: dq = S do with S = S' + k delta^T; dk = dS delta + S' dp; dg = sum(dS' S').
            float dg = 0.f;
            for (int i = lane; i < dk; i += 32) {
                const float ki = sk[i];
                float dq = 0.f, dki = 0.f;
                for (int c2 = 0; c2 < COLS; c2++) {
                    const float s = st[i * PAD + c2], d = ds[i * PAD + c2];
                    dq += (s + ki * dvec[c2]) * dovec[c2];
                    dki += d * dvec[c2] + s * dpvec[c2];
                    dg += (d + ki * dpvec[c2]) * s;
                }
                pr[i] = dq;
                pr[dk + i] = dki;
            }
            dg = warp_sum(dg);
            if (lane == 0) pr[2 * dk + dv] = dg;
            __syncwarp();
            // Columns: dS = decay (dS + k dp^T).
            const float dp = dpvec[lane];
            for (int i = 0; i < dk; i++)
                ds[i * PAD + lane] = decay * (ds[i * PAD + lane] + sk[i] * dp);
            __syncwarp();
        }
    }
    if (live)
        for (int i = 0; i < dk; i++)
            out[(size_t)task * ((size_t)seq * w + dk * dv) + (size_t)seq * w + i * dv + col] =
                ds[i * PAD + lane];
}

// out[task][r] = sum over blocks of part[task][block][r], r < seq * w.
extern "C" __global__ void gdr_sum(const float* part, float* out, int tasks, int blocks, int seq,
                                   int dk, int dv) {
    const int w = 2 * dk + dv + 2;
    const size_t per = (size_t)seq * w;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)tasks * per) return;
    const size_t task = idx / per, r = idx % per;
    float s = 0.f;
    for (int b = 0; b < blocks; b++) s += part[(task * blocks + b) * per + r];
    out[task * (per + (size_t)dk * dv) + r] = s;
}
