"""transformers' gated delta rule (Qwen3-Next's torch_chunk_gated_delta_rule and the token by
token torch_recurrent_gated_delta_rule), for trl-runtime/tests/gated_delta.rs:

    python scripts/gated_delta_reference.py IN.safetensors OUT.safetensors CHUNK

IN holds query, key [b, s, heads, dk], value [b, s, heads, dv], g, beta [b, s, heads] and
initial_state [b, heads, dk, dv] (float64); OUT gets `chunk_out`, `chunk_state`,
`recurrent_out`, `recurrent_state`, with the queries and keys L2-normalised in the kernel as
Qwen3-Next calls it.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

inputs = load_file(sys.argv[1])
args = [inputs[k] for k in ("query", "key", "value", "g", "beta")]
kwargs = dict(
    initial_state=inputs["initial_state"],
    output_final_state=True,
    use_qk_l2norm_in_kernel=True,
)
chunk_out, chunk_state = torch_chunk_gated_delta_rule(*args, chunk_size=int(sys.argv[3]), **kwargs)
rec_out, rec_state = torch_recurrent_gated_delta_rule(*args, **kwargs)
save_file(
    {
        "chunk_out": chunk_out.double().contiguous(),
        "chunk_state": chunk_state.double().contiguous(),
        "recurrent_out": rec_out.double().contiguous(),
        "recurrent_state": rec_state.double().contiguous(),
    },
    sys.argv[2],
)
