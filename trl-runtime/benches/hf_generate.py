"""transformers' greedy `generate` (KV cache, sdpa, float32, CPU) timed on a model directory,
for benches/generate.rs. Usage: hf_generate.py MODEL_DIR JOB_JSON, JOB_JSON holding
{"cases": [{"batch": b, "prompt": p, "new": n}], "threads": t, "reps": r}; prints one JSON
line per case: {"batch", "prefill_s", "total_s"} (the medians of r runs of generating 1
token, and n + 1 tokens, with EOS off)."""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

model_dir, job = sys.argv[1], json.loads(open(sys.argv[2]).read())
torch.set_num_threads(job["threads"])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
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
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return time.perf_counter() - start


for case in job["cases"]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab - 8, (case["batch"], case["prompt"]), generator=g)
    run(ids, 2)  # warm-up
    prefill = sorted(run(ids, 1) for _ in range(job["reps"]))[job["reps"] // 2]
    total = sorted(run(ids, case["new"] + 1) for _ in range(job["reps"]))[job["reps"] // 2]
    print(json.dumps({"batch": case["batch"], "prefill_s": prefill, "total_s": total}), flush=True)
