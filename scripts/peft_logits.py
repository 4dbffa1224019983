"""peft's side of the LoRA tests (trl-runtime/tests/lora.rs):

    python scripts/peft_logits.py write BASE ADAPTER_DIR [PARAMETERS]
        writes a peft LoRA adapter for BASE (all-linear, r=4, alpha=8, lm_head trained whole)
        with random nonzero A and B, as PeftModel.save_pretrained writes it (`write-dora`:
        the same with use_dora, its magnitudes moved too); PARAMETERS, comma-separated, are
        peft's target_parameters (gpt-oss's mlp.experts.gate_up_proj);
    python scripts/peft_logits.py write-json BASE ADAPTER_DIR JSON
        the same with the LoraConfig keys of JSON (over r=4, alpha=8, q_proj alone):
        modules_to_save, ensure_weight_tying, trainable_token_indices, target_modules, ...;
    python scripts/peft_logits.py logits BASE ADAPTER_DIR IDS OUT
        loads BASE (f32) with PeftModel.from_pretrained(ADAPTER_DIR) and writes OUT.safetensors
        with `logits` for the `input_ids` of IDS.safetensors (positions 0..len);
    python scripts/peft_logits.py model-logits DIR IDS OUT
        the same for a plain checkpoint (a merged one), loaded by transformers alone;
    python scripts/peft_logits.py batch TASKS.json
        each task of the JSON list (its `args`: one of the command lines above without the
        script) in one process, torch imported once.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from text_forward import on_text


def load(base):
    # By the class config.json's `architectures` names, as TRL loads (Qwen3-VL is no
    # AutoModelForCausalLM).
    architectures = AutoConfig.from_pretrained(base).architectures or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    return (model_class or AutoModelForCausalLM).from_pretrained(base, dtype=torch.float32).eval()


def randomize(peft_model, trained):
    """Moves every trained tensor off its start (peft starts B at zero), the same on every
    call; a tensor shared by a tied pair is listed once."""
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if trained(name, p):
                p.add_(torch.randn_like(p) * 0.05)


def logits_of(model, ids_file, out_file):
    input_ids = load_file(ids_file)["input_ids"].to(torch.long)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).repeat(input_ids.shape[0], 1)
    # A peft model's adapters sit in the wrapped model's modules: its language model runs
    # them too.
    inner = getattr(getattr(model, "base_model", None), "model", model)
    forward = model if on_text(inner) is inner else on_text(inner)
    with torch.no_grad():
        logits = forward(input_ids=input_ids, position_ids=positions).logits.float()
    save_file({"logits": logits.contiguous()}, out_file)


def run(args):
    mode = args[0]
    if mode == "model-logits":
        model_dir, ids_file, out_file = args[1:4]
        logits_of(load(model_dir), ids_file, out_file)
        return
    base = args[1]
    model = load(base)
    if mode == "write-json":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        kwargs = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"], task_type="CAUSAL_LM")
        kwargs.update(json.loads(args[3]))
        peft_model = get_peft_model(model, LoraConfig(**kwargs))
        randomize(peft_model, lambda name, p: p.requires_grad)
        peft_model.save_pretrained(args[2])
    elif mode in ("write", "write-dora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules="all-linear",
            modules_to_save=["lm_head"],
            task_type="CAUSAL_LM",
            use_dora=mode == "write-dora",
            target_parameters=args[3].split(",") if len(args) > 3 else None,
        )
        peft_model = get_peft_model(model, config)
        randomize(peft_model, lambda name, p: "lora_" in name or "modules_to_save" in name)
        peft_model.save_pretrained(args[2])
    elif mode == "logits":
        from peft import PeftModel

        adapter, ids_file, out_file = args[2:5]
        logits_of(PeftModel.from_pretrained(model, adapter).eval(), ids_file, out_file)
    else:
        sys.exit(f"unknown mode {mode}")


if sys.argv[1] == "batch":
    with open(sys.argv[2]) as f:
        for task in json.load(f):
            run(task["args"])
else:
    run(sys.argv[1:])
