"""The bundled task's held-out accuracy of a checkpoint in transformers, as the SFT example
measures it in training (trl-runtime/src/train/sft.rs): for each of the first N rows of
EVAL.jsonl, the conversation but its last (assistant) message rendered with the chat template
and a generation prompt, greedy decoding of at most 16 new tokens, and the decoded answer
(special tokens skipped, stripped) compared with the last message. DIR is a plain checkpoint
(a merged one), or a peft adapter directory (its base_model_name_or_path, with the adapter
loaded by PeftModel.from_pretrained). Prints `{"correct": K, "total": N}`.

    python scripts/score_task.py DIR EVAL.jsonl N
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, eval_file, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
adapter = os.path.exists(os.path.join(model_dir, "adapter_config.json"))
if adapter:
    from peft import PeftModel

    with open(os.path.join(model_dir, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, model_dir)
else:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model.eval()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
correct = total = 0
with open(eval_file) as f:
    rows = [json.loads(line) for line in f if line.strip()][:n]
for row in rows:
    messages = row["messages"]
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    correct += answer == messages[-1]["content"].strip()
    total += 1
print(json.dumps({"correct": correct, "total": total}))
