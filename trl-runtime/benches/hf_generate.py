"""transformers' greedy `generate` (KV cache, sdpa; float32 on the CPU, bfloat16 on "cuda")
timed on a model directory, for benches/generate.rs. Usage: hf_generate.py MODEL_DIR JOB_JSON,
JOB_JSON holding {"cases": [{"batch": b, "prompt": p, "new": n}], "threads": t, "reps": r,
"device": "cpu" | "cuda" (default "cpu")}; prints one JSON
line per case: {"batch", "prefill_s", "total_s", "copy_bytes_per_s"} (the medians of r runs of generating 1
token, and n + 1 tokens, with EOS off)."""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

model_dir, job = sys.argv[1], json.loads(open(sys.argv[2]).read())
torch.set_num_threads(job["threads"])
device = job.get("device", "cpu")
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
model.eval()
vocab = model.config.vocab_size


def run(ids, new):
    cfg = GenerationConfig(
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
    )
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


# On a GPU, torch's device-to-device copy rate (1 GiB read and 1 GiB written, the best of 5):
# the bandwidth the decode's bytes per token are set against.
copy_rate = None
if device == "cuda":
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    copy_rate = 2 * (1 << 30) / min(times[1:])
    del src, dst

for case in job["cases"]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab - 8, (case["batch"], case["prompt"]), generator=g).to(device)
    run(ids, 2)  # warm-up
    prefill = sorted(run(ids, 1) for _ in range(job["reps"]))[job["reps"] // 2]
    total = sorted(run(ids, case["new"] + 1) for _ in range(job["reps"]))[job["reps"] // 2]
    print(json.dumps({"batch": case["batch"], "prefill_s": prefill, "total_s": total,
                      "copy_bytes_per_s": copy_rate}), flush=True)
