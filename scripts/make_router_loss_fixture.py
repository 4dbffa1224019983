"""The router load-balancing loss as transformers computes it, for trl-runtime/tests/models.rs:
for assets/tiny-qwen3-moe, assets/tiny-mixtral and assets/tiny-gpt-oss, a batch of 2 x 24 tokens whose second row
ends in 7 padding tokens (attention_mask 0) and whose first 3 labels are ignored, trained with
output_router_logits and router_aux_loss_coef 0.1 in f32. Writes
assets/tiny-KIND/router_loss.safetensors: input_ids, attention_mask, labels, the loss
(cross-entropy + 0.1 x aux), aux_loss, and the gradients of each sparse layer's router
(`router.L`), of the embedding (`embed`) and of layer 0's q_proj (`q_proj.0`); for gpt-oss
also each layer's attention sinks (`sinks.L`) and fused gate_up experts (`experts.L`).

    python scripts/make_router_loss_fixture.py [KIND ...]   (default: all three)
"""

import sys

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
COEF = 0.1

for kind in sys.argv[1:] or ["qwen3-moe", "mixtral", "gpt-oss"]:
    out = ROOT / "assets" / f"tiny-{kind}"
    model = AutoModelForCausalLM.from_pretrained(
        out / "model", dtype=torch.float32, output_router_logits=True, router_aux_loss_coef=COEF
    ).train()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(1, vocab, (2, 24), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 17:] = 0
    input_ids[1, 17:] = 0
    labels = input_ids.clone()
    labels[:, :3] = -100
    labels[attention_mask == 0] = -100
    position_ids = torch.arange(24).unsqueeze(0).repeat(2, 1)
    o = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        labels=labels,
    )
    o.loss.backward()
    tensors = {
        "input_ids": input_ids.to(torch.int64),
        "attention_mask": attention_mask.to(torch.uint8),
        "labels": labels.to(torch.int64),
        "loss": o.loss.detach().reshape(1),
        "aux_loss": o.aux_loss.detach().reshape(1),
        "embed": model.model.embed_tokens.weight.grad,
        "q_proj.0": model.model.layers[0].self_attn.q_proj.weight.grad,
    }
    for l, layer in enumerate(model.model.layers):
        if kind == "gpt-oss":
            tensors[f"sinks.{l}"] = layer.self_attn.sinks.grad
            tensors[f"experts.{l}"] = layer.mlp.experts.gate_up_proj.grad
        gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if gate is not None and hasattr(gate, "weight") and gate.weight.dim() == 2 and gate.weight.shape[0] < 64:
            tensors[f"router.{l}"] = gate.weight.grad
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "router_loss.safetensors"))
    print("wrote", out / "router_loss.safetensors", sorted(tensors), float(o.aux_loss.detach()))
