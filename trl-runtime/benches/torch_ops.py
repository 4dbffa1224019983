#!/usr/bin/env python3
"""Torch's own ops at the shapes of `cargo bench -p trl-runtime --bench fused`: forward +
backward milliseconds of RMSNorm (as transformers' Qwen2RMSNorm computes it) and SwiGLU
(silu(gate) * up), on CPU with the given thread count. One JSON object per line."""
import argparse
import json
import time

import torch


def rms_norm(x, w, eps):
    # transformers' Qwen2RMSNorm / LlamaRMSNorm
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def swiglu(g, u):
    return torch.nn.functional.silu(g) * u


def timed(f, inputs, reps):
    def once():
        for t in inputs:
            t.grad = None
        y = f(*inputs)
        y.backward(torch.ones_like(y))

    for _ in range(3):
        once()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, requires_grad=True)
    w = torch.randn(a.hidden, requires_grad=True)
    ms = timed(lambda x, w: rms_norm(x, w, 1e-6), [x, w], a.reps)
    print(json.dumps({"op": "rms_norm", "torch_ms": ms}))
    # Rotary on the queries as transformers applies it: [batch, heads, seq, head_dim].
    heads, seq = 8, 512
    d = a.hidden // heads
    q = torch.randn(a.tokens // seq, heads, seq, d, requires_grad=True)
    ang = torch.randn(a.tokens // seq, seq, d)
    cos, sin = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)

    def rotary(q):
        q1, q2 = q[..., : d // 2], q[..., d // 2:]
        return q * cos + torch.cat((-q2, q1), dim=-1) * sin

    ms = timed(rotary, [q], a.reps)
    print(json.dumps({"op": "rotary", "torch_ms": ms}))
    g = torch.randn(a.tokens, a.intermediate, requires_grad=True)
    u = torch.randn(a.tokens, a.intermediate, requires_grad=True)
    ms = timed(swiglu, [g, u], a.reps)
    print(json.dumps({"op": "swiglu", "torch_ms": ms, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
