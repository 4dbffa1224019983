"""TRL's SFTTrainer on our tiny model and chat data, for the parity test
(cargo-trl/tests/sft.rs): prints one JSON line of logged metrics per logged step.

usage: trl_sft.py MODEL_DIR DATA.jsonl OUT_DIR STEPS BATCH LR [KEY=VALUE ...]
(scripts/trl_parity.py says the rest); packing off.
"""
from trl import SFTConfig, SFTTrainer

from trl_parity import Run

run = Run()
run.train(SFTTrainer, SFTConfig(**{**run.args, "packing": False, **run.extra}))
