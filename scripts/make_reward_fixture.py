"""Writes assets/tiny-<kind>/reward: a transformers `...ForSequenceClassification` checkpoint
(a reward model, num_labels 1, as TRL's RewardTrainer and GRPOTrainer load them) whose body is
assets/tiny-<kind>/model's and whose `score` head is random, with the bundled tokenizer, and
assets/tiny-<kind>/reward_parity.safetensors: right-padded input ids, their attention mask and
the logits transformers computes for them (pooled at each row's last non-pad token).

One kind per built-in model file: qwen3 (llama.rs, tied embeddings), mistral (a window of 6
under 24-token rows), gemma2 (soft-capped logits: the score is not capped), olmo3 (olmo2.rs),
phi3, qwen3-moe, mixtral, gpt-oss.

    python scripts/make_reward_fixture.py
"""

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

KINDS = ["qwen3", "mistral", "gemma2", "olmo3", "phi3", "qwen3-moe", "mixtral", "gpt-oss"]
ASSETS = Path(__file__).resolve().parent.parent / "assets"

for kind in KINDS:
    src = ASSETS / f"tiny-{kind}" / "model"
    out = ASSETS / f"tiny-{kind}" / "reward"
    tokenizer = AutoTokenizer.from_pretrained(src)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = AutoConfig.from_pretrained(src)
    config.num_labels = 1
    config.pad_token_id = pad
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    causal = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(causal.state_dict(), strict=False)
    assert missing == ["score.weight"], (kind, missing)
    assert set(unexpected) <= {"lm_head.weight"}, (kind, unexpected)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    # Three rows of 24, 17 and 9 tokens, right-padded as TRL pads rewards' inputs.
    lengths = [24, 17, 9]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (len(lengths), max(lengths)), generator=g)
    ids[ids == pad] = 3
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
        ids[r, n:] = pad
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    save_file(
        {"input_ids": ids.int(), "attention_mask": mask.int(), "logits": logits.contiguous()},
        ASSETS / f"tiny-{kind}" / "reward_parity.safetensors",
    )
    print(kind, type(model).__name__, logits.flatten().tolist())
