"""TRL's RewardTrainer on our tiny classifier and preference pairs, for the parity test
(cargo-trl/tests/reward.rs): prints one JSON line of logged metrics per step.

usage: trl_reward.py MODEL_DIR DATA.jsonl OUT_DIR STEPS BATCH LR [KEY=VALUE ...]
(scripts/trl_parity.py says the rest). MODEL_DIR is a sequence classifier with one label (the
start our run made from the causal LM, so that both train the same score head).
"""
import torch
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer

from trl_parity import Run

run = Run()
run.model = AutoModelForSequenceClassification.from_pretrained(run.model_dir, dtype=torch.float32)
config = RewardConfig(**{**run.args, **run.extra})
run.train(RewardTrainer, config)
