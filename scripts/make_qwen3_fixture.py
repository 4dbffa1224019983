"""Writes assets/tiny-qwen3: a tiny random Qwen3 (transformers' Qwen3ForCausalLM: per-head
q/k RMSNorms, tied embeddings) in HF format, sharing the bundled tokenizer, and
parity.safetensors: input ids and the logits transformers computes for them. The built-in
Qwen3 (trl-runtime/tests/models.rs, cargo-trl/tests/builtin_models.rs) and the port of
candle-transformers' qwen3.rs (cargo-trl/tests/port.rs) are checked against these and trained
on it.

Run by hand (needs torch and transformers from PyPI; nothing is downloaded):
    python scripts/make_qwen3_fixture.py
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

root = Path(__file__).resolve().parent.parent
tokenizer_dir = root / "assets/tiny/model"
out = root / "assets/tiny-qwen3"
model_dir = out / "model"
model_dir.mkdir(parents=True, exist_ok=True)

vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
config = Qwen3Config(
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    eos_token_id=2,
    bos_token_id=1,
)
torch.manual_seed(0)
model = Qwen3ForCausalLM(config).eval()
# Random norms, so that parity covers the per-head q/k norms too.
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
model.save_pretrained(model_dir, safe_serialization=True)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(tokenizer_dir / f, model_dir / f)

gen = torch.Generator().manual_seed(1)
input_ids = torch.randint(0, vocab, (2, 24), generator=gen)
with torch.no_grad():
    logits = model(input_ids=input_ids).logits.float()
save_file(
    {"input_ids": input_ids.to(torch.int64).contiguous(), "logits": logits.contiguous()},
    str(out / "parity.safetensors"),
)
print("wrote", out)
