"""peft's side of the LoRA tests (trl-runtime/tests/lora.rs):

    python scripts/peft_logits.py write BASE ADAPTER_DIR [PARAMETERS]
        writes a peft LoRA adapter for BASE (all-linear, r=4, alpha=8, lm_head trained whole)
        with random nonzero A and B, as PeftModel.save_pretrained writes it (`write-dora`:
        the same with use_dora, its magnitudes moved too); PARAMETERS, comma-separated, are
        peft's target_parameters (gpt-oss's mlp.experts.gate_up_proj);
    python scripts/peft_logits.py logits BASE ADAPTER_DIR IDS OUT
        loads BASE (f32) with PeftModel.from_pretrained(ADAPTER_DIR) and writes OUT.safetensors
        with `logits` for the `input_ids` of IDS.safetensors (positions 0..len).
"""

import sys

import torch
from safetensors.torch import load_file, save_file
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

mode, base = sys.argv[1:3]
# By the class config.json's `architectures` names, as TRL loads (Qwen3-VL is no
# AutoModelForCausalLM).
architectures = AutoConfig.from_pretrained(base).architectures or []
model_class = getattr(transformers, architectures[0], None) if architectures else None
model = (model_class or AutoModelForCausalLM).from_pretrained(base, dtype=torch.float32).eval()
if mode in ("write", "write-dora"):
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
        target_parameters=sys.argv[4].split(",") if len(sys.argv) > 4 else None,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.05)
    peft_model.save_pretrained(sys.argv[3])
elif mode == "logits":
    from peft import PeftModel

    adapter, ids_file, out_file = sys.argv[3:6]
    peft_model = PeftModel.from_pretrained(model, adapter).eval()
    input_ids = load_file(ids_file)["input_ids"].to(torch.long)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).repeat(input_ids.shape[0], 1)
    with torch.no_grad():
        logits = peft_model(input_ids=input_ids, position_ids=positions).logits.float()
    save_file({"logits": logits.contiguous()}, out_file)
else:
    sys.exit(f"unknown mode {mode}")
