"""TRL's DistillationTrainer on our tiny student and teacher over GRPO prompts with fixed
completions, for the parity test (cargo-trl/tests/distillation.rs): prints one JSON line of
logged metrics per step, then {"eval": {...}} with eval_batch=N.

usage: trl_distillation.py MODEL_DIR DATA.jsonl OUT_DIR STEPS BATCH LR teacher=DIR [KEY=VALUE ...]
(scripts/trl_parity.py says the rest). The completions follow scripts/fixed_rollout.py's rule
(our runs get them from it as a rollout program) in place of sampling; each generation batch is
trained on in its order and the evaluation takes the prompts in order (TRL shuffles both with
torch's generator, which our runs cannot draw).
"""
import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
import torch
import trl.trainer.distillation_trainer as distillation
from transformers import AutoModelForCausalLM
from trl import DistillationConfig, DistillationTrainer
from trl.trainer.utils import RepeatSampler

sys.path.insert(0, os.path.dirname(__file__))
from fixed_rollout import completion  # noqa: E402
from trl_parity import Print, Run  # noqa: E402

run = Run()
teacher = AutoModelForCausalLM.from_pretrained(run.extra.pop("teacher"), dtype=torch.float32)
run.args.pop("max_length")
distillation.shuffle_sequence_dict = lambda batch: batch


class FixedDistillation(DistillationTrainer):
    """Distillation with the rollout rule in place of generation."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        eos = self._tokenizer.eos_token_id
        return [completion(p, i, eos) for i, p in enumerate(prompt_ids)]

    def _get_eval_sampler(self, eval_dataset):
        return RepeatSampler(data_source=eval_dataset, mini_repeat_count=1, shuffle=False)


config = DistillationConfig(**{**run.args, "shuffle_dataset": False, **run.extra})
trainer = FixedDistillation(
    model=run.model,
    teacher_model=teacher,
    args=config,
    train_dataset=run.rows,
    eval_dataset=run.rows if run.eval_batch else None,
    processing_class=run.tokenizer,
    callbacks=[Print()],
)
trainer.train()
if run.eval_batch:
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(json.dumps({"eval": metrics}), flush=True)
