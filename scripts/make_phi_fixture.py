"""Writes assets/tiny-phi: a tiny random Phi (transformers' PhiForCausalLM) in HF format,
sharing the bundled tokenizer, and parity.safetensors: input ids and the logits transformers
computes for them, which examples/tests/phi.rs checks our Phi against.

With --qk it writes assets/tiny-phi-qk instead: the same with qk_layernorm (a LayerNorm over
each attention head's queries and keys), the per-head norms that tensor parallelism must sum
the gradients of.

Run by hand (needs torch and transformers from PyPI; nothing is downloaded):
    python scripts/make_phi_fixture.py [--qk]
"""

import sys

import torch
from transformers import PhiConfig, PhiForCausalLM

from tiny_fixture import VOCAB, write

qk = "--qk" in sys.argv[1:]
config = PhiConfig(
    vocab_size=VOCAB,
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
write(model, "tiny-phi-qk" if qk else "tiny-phi")
