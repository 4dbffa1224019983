"""What the TRL parity scripts share (scripts/trl_sft.py, scripts/trl_dpo.py): their command
line, the training arguments every comparison fixes, and printing what TRL logs.

usage of a script: SCRIPT.py MODEL_DIR DATA.jsonl OUT_DIR STEPS BATCH LR [WORD | KEY=VALUE ...]
The first BATCH rows, one batch per step, AdamW, constant learning rate, fp32; KEY=VALUE sets
another config key or replaces one of these (whole numbers read as integers, others as floats,
true/false as booleans); `rows=N` trains the first N rows instead (STEPS -1: as many steps as
num_train_epochs makes); `logging_steps=N` logs every N steps (their means); `eval_batch=N`
also evaluates the trained model on the same rows, N per batch, printing {"eval": {...}} last. WORDs are the script's own (DPO's loss types).
"""
import json
import sys

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback


def value(v):
    if v in ("true", "false"):
        return v == "true"
    if v.lstrip("-").isdigit():
        return int(v)
    try:
        return float(v)
    except ValueError:
        return v


class Run:
    """The parsed command line, the model, its tokenizer and the rows."""

    def __init__(self):
        self.model_dir, data, self.out, steps, batch, lr = sys.argv[1:7]
        self.words = [a for a in sys.argv[7:] if "=" not in a]
        self.extra = {k: value(v) for k, v in (a.split("=", 1) for a in sys.argv[7:] if "=" in a)}
        self.eval_batch = int(self.extra.pop("eval_batch", 0))
        rows = int(self.extra.pop("rows", batch))
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.rows = load_dataset("json", data_files=data, split="train").select(range(rows))
        self.args = dict(
            output_dir=self.out,
            per_device_train_batch_size=int(batch),
            max_steps=int(steps),
            learning_rate=float(lr),
            lr_scheduler_type="constant",
            logging_steps=int(self.extra.pop("logging_steps", 1)),
            per_device_eval_batch_size=self.eval_batch or 8,
            save_strategy="no",
            report_to=[],
            bf16=False,
            gradient_checkpointing=False,
            max_length=64,
            seed=0,
            disable_tqdm=True,
            use_cpu=True,
            dataloader_drop_last=True,
        )

    def train(self, trainer_class, config):
        """Trains with `config`, printing each logged line, then the evaluation if asked."""
        trainer = trainer_class(
            model=self.model,
            args=config,
            train_dataset=self.rows,
            eval_dataset=self.rows if self.eval_batch else None,
            processing_class=self.tokenizer,
            callbacks=[Print()],
        )
        trainer.train()
        if self.eval_batch:
            metrics = trainer.evaluate()
            if trainer.is_world_process_zero():
                print(json.dumps({"eval": metrics}), flush=True)


class Print(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        # Every process logs; under torchrun the first one prints.
        if logs and "loss" in logs and state.is_world_process_zero:
            print(json.dumps({"step": state.global_step, **logs}), flush=True)
