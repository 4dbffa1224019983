"""transformers' greedy `generate` on left-padded prompts, for trl-runtime/tests/generation.rs.

Reads JSON from the file named by its argument:
{"jobs": [{"model": dir, "prompts": [[ids]], "max_new_tokens": n, "eos_token_id": id or null,
           "pad_token_id": id}]}
Prints, per job, {"tokens": [[ids]] (prompt, left-padded, and what follows), "gaps": [[float]]
(per row and step, the gap between the two largest logits: a tie shows as ~0)}.
Vision-language checkpoints load as AutoModelForImageTextToText. Runs on the CPU in float32, with the model's default attention (sdpa) and DynamicCache.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

from text_forward import on_text

with open(sys.argv[1]) as f:
    job = json.load(f)
out = []
for j in job["jobs"]:
    try:
        model = AutoModelForCausalLM.from_pretrained(j["model"], dtype=torch.float32)
    except ValueError:
        # Vision-language checkpoints (qwen3_vl): generation on text alone.
        model = AutoModelForImageTextToText.from_pretrained(j["model"], dtype=torch.float32)
    model.eval()
    pad = j["pad_token_id"]
    width = max(len(p) for p in j["prompts"])
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in j["prompts"]])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in j["prompts"]])
    cfg = GenerationConfig(
        max_new_tokens=j["max_new_tokens"],
        do_sample=False,
        # None would take the checkpoint's EOS: an id outside the vocabulary never stops.
        eos_token_id=j["eos_token_id"] if j["eos_token_id"] is not None else 10**9,
        pad_token_id=pad,
        bos_token_id=None,
    )
    with torch.no_grad():
        res = on_text(model).generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=cfg,
            return_dict_in_generate=True,
            output_logits=True,
        )
    gaps = []
    for logits in res.logits:
        top = logits.float().topk(2, dim=-1).values
        gaps.append((top[:, 0] - top[:, 1]).tolist())
    out.append(
        {
            "tokens": res.sequences.tolist(),
            "gaps": [list(r) for r in zip(*gaps)],
        }
    )
print(json.dumps(out))
