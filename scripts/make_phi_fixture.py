"""Writes assets/tiny-phi: a tiny random Phi (transformers' PhiForCausalLM) in HF format,
sharing the bundled tokenizer, and parity.safetensors: input ids and the logits transformers
computes for them, which examples/tests/phi.rs checks our Phi against.

With --qk it writes assets/tiny-phi-qk instead: the same with qk_layernorm (a LayerNorm over
each attention head's queries and keys), the per-head norms that tensor parallelism must sum
the gradients of.

Run by hand (needs torch and transformers from PyPI; nothing is downloaded):
    python scripts/make_phi_fixture.py [--qk]
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PhiConfig, PhiForCausalLM

root = Path(__file__).resolve().parent.parent
tokenizer_dir = root / "assets/tiny/model"
qk = "--qk" in sys.argv[1:]
out = root / ("assets/tiny-phi-qk" if qk else "assets/tiny-phi")
model_dir = out / "model"
model_dir.mkdir(parents=True, exist_ok=True)

vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
config = PhiConfig(
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    partial_rotary_factor=0.5,
    max_position_embeddings=256,
    layer_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="gelu_new",
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    eos_token_id=2,
    bos_token_id=1,
    qk_layernorm=qk,
)
torch.manual_seed(0)
model = PhiForCausalLM(config).eval()
# Random norms and biases, so that parity covers every parameter.
with torch.no_grad():
    for name, p in model.named_parameters():
        if "layernorm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn_like(p))
model.save_pretrained(model_dir, safe_serialization=True)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(tokenizer_dir / f, model_dir / f)

gen = torch.Generator().manual_seed(1)
input_ids = torch.randint(0, vocab, (2, 24), generator=gen)
position_ids = torch.arange(24).unsqueeze(0).repeat(2, 1)
with torch.no_grad():
    logits = model(input_ids=input_ids, position_ids=position_ids).logits.float()
save_file(
    {"input_ids": input_ids.to(torch.int64).contiguous(), "logits": logits.contiguous()},
    str(out / "parity.safetensors"),
)
print("wrote", out)
