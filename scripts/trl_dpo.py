"""TRL's DPOTrainer on our tiny model and preference data, for the parity test
(cargo-trl/tests/dpo.rs): prints one JSON line of logged metrics per step.

usage: trl_dpo.py MODEL_DIR DATA.jsonl OUT_DIR STEPS BATCH LR [LOSS_TYPE | KEY=VALUE ...]
Whole-dataset batches (BATCH = the rows used), AdamW, constant learning rate, fp32; KEY=VALUE
sets another DPOConfig key (numbers read as floats). `eval_batch=N` also evaluates the
trained model on the same rows, N per batch, printing {"eval": {...}} last.
"""
import json
import sys

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from transformers import TrainerCallback

model_dir, data, out, steps, batch, lr = sys.argv[1:7]
def value(v):
    if v in ("true", "false"):
        return v == "true"
    try:
        return float(v)
    except ValueError:
        return v


loss_types = [a for a in sys.argv[7:] if "=" not in a] or ["sigmoid"]
extra = {k: value(v) for k, v in (a.split("=", 1) for a in sys.argv[7:] if "=" in a)}
logging_steps = int(extra.pop("logging_steps", 1))
eval_batch = int(extra.pop("eval_batch", 0))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(model_dir)
ds = load_dataset("json", data_files=data, split="train").select(range(int(batch)))
args = DPOConfig(
    output_dir=out,
    per_device_train_batch_size=int(batch),
    max_steps=int(steps),
    learning_rate=float(lr),
    lr_scheduler_type="constant",
    logging_steps=logging_steps,
    per_device_eval_batch_size=eval_batch or 8,
    save_strategy="no",
    report_to=[],
    bf16=False,
    gradient_checkpointing=False,
    max_length=64,
    loss_type=loss_types,
    beta=0.1,
    seed=0,
    disable_tqdm=True,
    use_cpu=True,
    dataloader_drop_last=True,
    **extra,
)


class Print(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            print(json.dumps({"step": state.global_step, **logs}), flush=True)


eval_ds = ds if eval_batch else None
trainer = DPOTrainer(
    model=model, args=args, train_dataset=ds, eval_dataset=eval_ds, processing_class=tok, callbacks=[Print()]
)
trainer.train()
if eval_batch:
    print(json.dumps({"eval": trainer.evaluate()}), flush=True)
