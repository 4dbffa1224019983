"""Gradients as transformers computes them, for trl-runtime/tests/models.rs: for
assets/tiny-gemma4 and assets/tiny-gemma4-moe-vision, the parity rows (2 x 24 tokens) as their
own labels, the first 3 ignored, in f64 (f32's own gradients are 1.6e-4 of the largest off
f64's on these fixtures, so a comparison in f32 would measure torch's rounding). Writes assets/tiny-KIND/gradients.safetensors:
input_ids, labels, the loss, and the gradients of the parameters where what crosses layers
shows (under our names, `model.` for the wrapper's `model.language_model.`):
- the layers that store keys and values for later layers (their k_proj, k_norm, v_proj), the
  layers that reuse them (q_proj), and the per-layer inputs' tables and projections (tiny-gemma4);
- the router, the per-expert scales and the experts, and a full layer whose keys serve as
  values (tiny-gemma4-moe-vision).

    python scripts/make_gradient_fixture.py [KIND ...]   (default: both)
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration

ROOT = Path(__file__).resolve().parent.parent

WANTED = {
    "gemma4": [
        "model.layers.2.self_attn.k_proj.weight",
        "model.layers.2.self_attn.k_norm.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.4.self_attn.q_proj.weight",
        "model.layers.5.self_attn.q_proj.weight",
        "model.layers.0.per_layer_input_gate.weight",
        "model.layers.5.per_layer_projection.weight",
        "model.embed_tokens_per_layer.weight",
        "model.per_layer_model_projection.weight",
        "model.per_layer_projection_norm.weight",
        "model.embed_tokens.weight",
    ],
    "gemma4-moe-vision": [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.router.proj.weight",
        "model.layers.1.router.scale",
        "model.layers.1.router.per_expert_scale",
        "model.layers.1.experts.gate_up_proj",
        "model.layers.0.experts.down_proj",
        "model.layers.0.post_feedforward_layernorm_2.weight",
        "model.embed_tokens.weight",
    ],
}

for kind in sys.argv[1:] or list(WANTED):
    out = ROOT / "assets" / f"tiny-{kind}"
    if kind == "gemma4-moe-vision":
        model = Gemma4ForConditionalGeneration.from_pretrained(
            # torch's grouped GEMM takes no f64: each expert's loop, as transformers' eager.
            out / "model",
            dtype=torch.float64,
            experts_implementation="eager",
        )
        prefix = "model.language_model."
    else:
        model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float64)
        prefix = "model."
    model.train()
    input_ids = load_file(str(out / "parity.safetensors"))["input_ids"]
    labels = input_ids.clone()
    labels[:, :3] = -100
    position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0).repeat(input_ids.shape[0], 1)
    # The loss by hand: transformers' loss_function casts the logits to f32.
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    loss.backward()
    params = dict(model.named_parameters())
    tensors = {
        "input_ids": input_ids.to(torch.int64),
        "labels": labels.to(torch.int64),
        "loss": loss.detach().reshape(1),
    }
    for name in WANTED[kind]:
        tensors[name] = params[prefix + name[len("model."):]].grad
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "gradients.safetensors"))
    print("wrote", out / "gradients.safetensors", float(loss.detach()))
