#!/usr/bin/env python3
"""Writes the transformers-parity fixture for trl-runtime's model tests.

Run by hand where torch and transformers are installed (the Rust tests only read the result):

    python3 scripts/make_parity_fixture.py trl-runtime/tests/fixtures/parity

For each of a tiny random-init Qwen2 (tied embeddings, q/k/v bias, yarn rope scaling) and Llama
(untied, llama3 rope scaling) it writes <dir>/<model>/config.json + model.safetensors as
`save_pretrained` does, and <dir>/<model>/batch.safetensors with input_ids, position_ids,
labels, and the logits and loss transformers computes in fp32.

Row 0 of the batch packs two documents (positions restart). Its expected logits are those of
each document run on its own, concatenated: what a document-aware causal mask must give.
"""
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

CONFIGS = {
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=True,
        initializer_range=0.2,
    ),
    "llama": dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        initializer_range=0.2,
    ),
}

SEQ = 12
SPLIT = 5  # row 0: document A = tokens [0, 5), document B = [5, 12)


def main(out: Path) -> None:
    torch.manual_seed(0)
    for name, kwargs in CONFIGS.items():
        kwargs = dict(kwargs)
        model_type = kwargs.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        target = out / name
        model.save_pretrained(target, safe_serialization=True)

        ids = torch.randint(0, config.vocab_size, (2, SEQ))
        pos = torch.stack([
            torch.cat([torch.arange(SPLIT), torch.arange(SEQ - SPLIT)]),
            torch.arange(SEQ),
        ])
        labels = ids.clone()
        labels[0, SPLIT] = -100  # the first token of document B is not predicted from A
        labels[1, :3] = -100  # a prompt
        with torch.no_grad():
            row0 = torch.cat([
                model(input_ids=ids[:1, :SPLIT], position_ids=pos[:1, :SPLIT]).logits,
                model(input_ids=ids[:1, SPLIT:], position_ids=pos[:1, SPLIT:]).logits,
            ], dim=1)
            row1 = model(input_ids=ids[1:], position_ids=pos[1:]).logits
            logits = torch.cat([row0, row1])
            # transformers' causal-LM loss: shift, mean over labels != -100.
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, config.vocab_size), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            # Sanity: the unpacked row agrees with the model's own loss path.
            own = model(input_ids=ids[1:], position_ids=pos[1:], labels=labels[1:]).loss
            mine = torch.nn.functional.cross_entropy(
                row1[0, :-1], labels[1, 1:], ignore_index=-100
            )
            assert torch.allclose(own, mine, atol=1e-6), (own, mine)
        save_file(
            {
                "input_ids": ids.to(torch.int64).contiguous(),
                "position_ids": pos.to(torch.int64).contiguous(),
                "labels": labels.to(torch.int64).contiguous(),
                "logits": logits.contiguous(),
                "loss": loss.reshape(1).contiguous(),
            },
            target / "batch.safetensors",
            metadata={"transformers": transformers.__version__, "torch": torch.__version__},
        )
        print(f"{name}: wrote {target} (loss {loss.item():.6f})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "trl-runtime/tests/fixtures/parity"))
