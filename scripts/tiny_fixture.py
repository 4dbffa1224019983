"""What the fixture scripts share: the bundled tokenizer's vocabulary, and writing a tiny
transformers model to assets/<name> with that tokenizer and parity.safetensors (24-token input
ids drawn with seed 1, and the logits transformers computes for them at positions 0..23)."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "assets/tiny/model"
VOCAB = json.loads((TOKENIZER_DIR / "config.json").read_text())["vocab_size"]


def write(model, name):
    """Saves `model` to assets/<name>/model with the tokenizer, and its parity logits."""
    out = ROOT / "assets" / name
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(TOKENIZER_DIR / f, model_dir / f)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 24), generator=gen)
    position_ids = torch.arange(24).unsqueeze(0).repeat(2, 1)
    from text_forward import on_text

    with torch.no_grad():
        logits = on_text(model)(input_ids=input_ids, position_ids=position_ids).logits.float()
    save_file(
        {"input_ids": input_ids.to(torch.int64).contiguous(), "logits": logits.contiguous()},
        str(out / "parity.safetensors"),
    )
    print("wrote", out)
