"""Writes assets/tiny/teacher: the distillation trainer's bundled teacher, a transformers Qwen2
checkpoint wider and deeper than assets/tiny/model (hidden 96 against 64, 3 layers against 2,
an untied LM head) over the same tokenizer and vocabulary, as TRL's DistillationTrainer needs.
Its weights are random (seeded): it teaches a distribution to match, not a skill.

    /root/py/bin/python scripts/make_teacher_fixture.py
"""

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tiny"
src, out = ASSETS / "model", ASSETS / "teacher"
config = Qwen2Config(
    vocab_size=284,
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    eos_token_id=2,
    initializer_range=0.1,
)
torch.manual_seed(7)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
if out.exists():
    shutil.rmtree(out)
model.save_pretrained(out)
for name in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(src / name, out / name)
print(f"wrote {out}")
