"""Writes assets/tiny-gpt-oss-mxfp4: assets/tiny-gpt-oss with its experts' gate_up_proj and
down_proj stored as the hub stores gpt-oss's, MXFP4 (`*_blocks` u8 [experts, rows, groups,
16], `*_scales` u8 [experts, rows, groups]; random nibbles, scales 2^-4..2^-1) with
`quantization_config` {"quant_method": "mxfp4"}, and parity.safetensors: the logits
transformers computes for the 24-token inputs of tiny_fixture.py after loading it with
Mxfp4Config(dequantize=True). trl-runtime/tests/models.rs reads it dequantized and checks
the logits; cargo-trl/tests/builtin_models.rs trains it and opens the dense checkpoint.

    python scripts/make_mxfp4_fixture.py   (after make_decoder_fixture.py gpt-oss)
"""

import json
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from tiny_fixture import ROOT, VOCAB

src = ROOT / "assets/tiny-gpt-oss/model"
out = ROOT / "assets/tiny-gpt-oss-mxfp4"
model_dir = out / "model"
model_dir.mkdir(parents=True, exist_ok=True)
for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
    shutil.copy(src / f, model_dir / f)
config = json.loads((src / "config.json").read_text())
config["quantization_config"] = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
(model_dir / "config.json").write_text(json.dumps(config, indent=2))
tensors = load_file(src / "model.safetensors")
gen = torch.Generator().manual_seed(3)
for name in list(tensors):
    if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
        experts, inner, outer = tensors.pop(name).shape  # dense [E, in, out]
        # Stored transposed: rows are the dense tensor's last dimension.
        blocks = torch.randint(0, 256, (experts, outer, inner // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(123, 127, (experts, outer, inner // 32), generator=gen, dtype=torch.uint8)
        tensors[name + "_blocks"] = blocks
        tensors[name + "_scales"] = scales
save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"))
model = AutoModelForCausalLM.from_pretrained(
    model_dir, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
).eval()
gen = torch.Generator().manual_seed(1)
input_ids = torch.randint(0, VOCAB, (2, 24), generator=gen)
position_ids = torch.arange(24).unsqueeze(0).repeat(2, 1)
with torch.no_grad():
    logits = model(input_ids=input_ids, position_ids=position_ids).logits.float()
    print("expert dtype", model.model.layers[0].mlp.experts.gate_up_proj.dtype)
save_file(
    {"input_ids": input_ids.to(torch.int64).contiguous(), "logits": logits.contiguous()},
    str(out / "parity.safetensors"),
)
print("wrote", out)
