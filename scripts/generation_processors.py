"""transformers' logits processors on given rows, in the order `generate` builds them for
sampling (repetition penalty, temperature, top-k, top-p, min-p; transformers 5's
`GenerationMixin._get_logits_processor`). Reads JSON (from the file named by its argument):
{"configs": [{"repetition_penalty", "temperature", "top_k", "top_p", "min_p", "do_sample"}],
 "rows": [{"history": [ids], "logits": [floats]}]}; prints, per config, per row, the processed
logits (-inf as null). Used by trl-runtime/tests/generation.rs, which passes the JSON as a file
path argument."""
import json
import sys

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

with open(sys.argv[1]) as f:
    job = json.load(f)
out = []
for c in job["configs"]:
    procs = LogitsProcessorList()
    if c["repetition_penalty"] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(c["repetition_penalty"])))
    if c["do_sample"]:
        if c["temperature"] != 1.0:
            procs.append(TemperatureLogitsWarper(float(c["temperature"])))
        if c["top_k"]:
            procs.append(TopKLogitsWarper(top_k=c["top_k"], min_tokens_to_keep=1))
        if c["top_p"] < 1.0:
            procs.append(TopPLogitsWarper(top_p=float(c["top_p"]), min_tokens_to_keep=1))
        if c["min_p"] is not None:
            procs.append(MinPLogitsWarper(min_p=float(c["min_p"]), min_tokens_to_keep=1))
    rows = []
    for r in job["rows"]:
        ids = torch.tensor([r["history"]], dtype=torch.long)
        scores = torch.tensor([r["logits"]], dtype=torch.float32)
        got = procs(ids, scores)[0].tolist()
        rows.append([None if x == float("-inf") else x for x in got])
    out.append(rows)
print(json.dumps(out))
