"""TRL's KTOTrainer on our tiny model and rows (unpaired, or preference pairs TRL unpairs), for
the parity test (cargo-trl/tests/kto.rs): prints one JSON line of logged metrics per step.

usage: trl_kto.py MODEL_DIR DATA.jsonl OUT_DIR STEPS BATCH LR [KEY=VALUE ...]
(scripts/trl_parity.py says the rest); beta 0.1 and the kto loss unless KEY=VALUE says.
"""
from trl import KTOConfig, KTOTrainer

from trl_parity import Run

run = Run()
config = KTOConfig(**{**run.args, "beta": 0.1, **run.extra})
run.train(KTOTrainer, config)
