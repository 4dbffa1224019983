"""transformers' Gated DeltaNet layer (Qwen3NextGatedDeltaNet) on random weights and inputs,
for trl-runtime/tests/gated_delta.rs:

    python scripts/gated_deltanet_reference.py OUT.safetensors

Writes the layer's weights under their names (`in_proj_qkvz.weight`, `conv1d.weight`,
`A_log`, ...), `hidden` [2, 13, 32] and transformers' `output` for it (float32, the torch
chunk path, no cache): 2 key heads of 8 features serving 4 value heads of 6, a kernel of 4.
"""
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

torch.manual_seed(0)
config = Qwen3NextConfig(
    hidden_size=32,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)
layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
with torch.no_grad():
    for name, p in layer.named_parameters():
        if name == "A_log":
            p.copy_(torch.empty_like(p).uniform_(0.01, 2.0).log())
        elif name == "dt_bias":
            p.copy_(0.5 * torch.randn_like(p))
        elif name == "norm.weight":
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
            p.copy_(0.3 * torch.randn_like(p))
    hidden = torch.randn(2, 13, 32)
    output = layer(hidden)
tensors = {name: p.detach().contiguous() for name, p in layer.named_parameters()}
tensors["hidden"] = hidden
tensors["output"] = output.contiguous()
save_file(tensors, sys.argv[1])
