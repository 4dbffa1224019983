#!/usr/bin/env python3
"""torch's scaled_dot_product_attention (causal, grouped-query heads), forward + backward, at
the shapes `cargo bench -p trl-runtime --bench attention` measures ours: milliseconds per call,
one JSON object per line. On CUDA torch dispatches to its flash / cuDNN kernels."""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--shape", action="append", required=True, help="batch,heads,kv_heads,seq,dim")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    for shape in a.shape:
        b, h, hk, s, d = map(int, shape.split(","))
        q = torch.randn(b, h, s, d, device=a.device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, hk, s, d, device=a.device, dtype=dtype, requires_grad=True)
        v = torch.randn(b, hk, s, d, device=a.device, dtype=dtype, requires_grad=True)
        g = torch.randn(b, h, s, d, device=a.device, dtype=dtype)

        def once():
            for t in (q, k, v):
                t.grad = None
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            y.backward(g)

        for _ in range(3):
            once()
        sync()
        start = time.perf_counter()
        for _ in range(a.reps):
            once()
        sync()
        ms = (time.perf_counter() - start) / a.reps * 1e3
        print(json.dumps({"shape": shape, "ms": ms}), flush=True)


if __name__ == "__main__":
    main()
