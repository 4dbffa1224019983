"""Prints transformers' logits for a checkpoint, for the tests that check a checkpoint we saved
opens in transformers (cargo-trl/tests/builtin_models.rs): loads DIR (f32) by the class its
config.json's `architectures` names, as TRL's trainers do (Qwen3-VL is no
AutoModelForCausalLM), else with AutoModelForCausalLM, and writes OUT.safetensors with `logits`
for the input ids in IDS.safetensors (`input_ids`, positions 0..len).

    python scripts/transformers_logits.py DIR IDS OUT
"""

import sys

import torch
from safetensors.torch import load_file, save_file
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from text_forward import on_text

model_dir, ids_file, out_file = sys.argv[1:4]
architectures = AutoConfig.from_pretrained(model_dir).architectures or []
model_class = getattr(transformers, architectures[0], None) if architectures else None
model = (model_class or AutoModelForCausalLM).from_pretrained(model_dir, dtype=torch.float32).eval()
input_ids = load_file(ids_file)["input_ids"].to(torch.long)
position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0).repeat(input_ids.shape[0], 1)
with torch.no_grad():
    logits = on_text(model)(input_ids=input_ids, position_ids=position_ids).logits.float()
save_file({"logits": logits.contiguous()}, out_file)
