"""Writes every field of TRL's SFTConfig and DPOConfig at its default, as YAML, into
trl-runtime/tests/fixtures/trl_defaults/ (sft.yaml, dpo.yaml): a dump of TRL's own config must
load here (tests/sft_config.rs). Run by hand with TRL installed; the output is committed.

usage: python scripts/make_trl_defaults_fixture.py
"""
import dataclasses
import json
from pathlib import Path

import trl
import yaml
from trl import DPOConfig, SFTConfig

out = Path(__file__).parents[1] / "trl-runtime/tests/fixtures/trl_defaults"
out.mkdir(parents=True, exist_ok=True)
for cls, name in [(SFTConfig, "sft"), (DPOConfig, "dpo")]:
    fields = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            v = f.default
        elif f.default_factory is not dataclasses.MISSING:
            v = f.default_factory()
        else:
            continue
        try:
            json.dumps(v)
        except TypeError:
            v = str(v)  # enums and the like, as TRL's CLI would read them back
        fields[f.name] = v
    header = f"# Every {cls.__name__} field of TRL {trl.__version__} at its default (scripts/make_trl_defaults_fixture.py).\n"
    (out / f"{name}.yaml").write_text(header + yaml.safe_dump(fields))
    print(name, len(fields))
