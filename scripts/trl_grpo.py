"""TRL's GRPOTrainer on our tiny model and GRPO prompts with fixed rollouts and rewards, for
the parity test (trl-runtime/tests/grpo.rs): prints one JSON line of logged metrics per step.

usage: trl_grpo.py MODEL_DIR DATA.jsonl OUT_DIR STEPS [KEY=VALUE ...]
The completions come from `rollout_func` (TRL's hook), by scripts/fixed_rollout.py's rule. The
reward is get_soft_overlong_punishment(4, 2). 8 completions per step (2 prompts x 4), one
process, fp32, AdamW at a constant learning rate of 1e-3; KEY=VALUE sets GRPOConfig keys, and
eval_data=FILE evaluates on those prompts (with eval_strategy=steps eval_steps=N), and
reward_model=DIR adds a reward model (a ForSequenceClassification checkpoint, as TRL loads one
named by its path) after that reward. trainer=rloo runs TRL's RLOOTrainer instead (RLOOConfig
keys), whose generation is replaced by the same rule (RLOO has no rollout_func).
"""
import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.rewards import get_soft_overlong_punishment

sys.path.insert(0, os.path.dirname(__file__))
from fixed_rollout import completion  # noqa: E402
from trl_parity import value  # noqa: E402


model_dir, data, out, steps = sys.argv[1:5]
extra = {k: value(v) for k, v in (a.split("=", 1) for a in sys.argv[5:])}
reward_model = extra.pop("reward_model", None)
eval_data = extra.pop("eval_data", None)
rloo = extra.pop("trainer", "grpo") == "rloo"
if "reward_clip_range" in extra:  # MIN,MAX
    extra["reward_clip_range"] = tuple(float(x) for x in str(extra["reward_clip_range"]).split(","))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
rows = load_dataset("json", data_files=data, split="train")


def rollout(prompts, trainer):
    eos = tokenizer.eos_token_id
    prompt_ids, completions = [], []
    for i, prompt in enumerate(prompts):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        p = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt_ids.append(p)
        completions.append(completion(p, i, eos))
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


class FixedRLOO(RLOOTrainer):
    """RLOO with the rollout rule in place of generation."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        eos = tokenizer.eos_token_id
        return [completion(p, i, eos) for i, p in enumerate(prompt_ids)]


class Print(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            print(json.dumps({"step": state.global_step, **logs}), flush=True)
        if logs and "eval_loss" in logs:
            print(json.dumps({"eval_step": state.global_step, **logs}), flush=True)


config = (RLOOConfig if rloo else GRPOConfig)(
    **{
        "output_dir": out,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 4,
        "max_steps": int(steps),
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "bf16": False,
        "gradient_checkpointing": False,
        "seed": 0,
        "disable_tqdm": True,
        "use_cpu": True,
        "shuffle_dataset": False,
        **extra,
    }
)
trainer = (FixedRLOO if rloo else GRPOTrainer)(
    model=model,
    args=config,
    reward_funcs=[get_soft_overlong_punishment(4, 2)] + ([reward_model] if reward_model else []),
    train_dataset=rows,
    eval_dataset=load_dataset("json", data_files=eval_data, split="train") if eval_data else None,
    processing_class=tokenizer,
    **({} if rloo else {"rollout_func": rollout}),
    callbacks=[Print()],
)
trainer.train()
