"""TRL's DPOTrainer on our tiny model and preference data, for the parity test
(cargo-trl/tests/dpo.rs): prints one JSON line of logged metrics per step.

usage: trl_dpo.py MODEL_DIR DATA.jsonl OUT_DIR STEPS BATCH LR [LOSS_TYPE | KEY=VALUE ...]
(scripts/trl_parity.py says the rest); beta 0.1, the sigmoid loss unless loss types are named.
"""
from trl import DPOConfig, DPOTrainer

from trl_parity import Run

run = Run()
config = DPOConfig(**{**run.args, "loss_type": run.words or ["sigmoid"], "beta": 0.1, **run.extra})
run.train(DPOTrainer, config)
