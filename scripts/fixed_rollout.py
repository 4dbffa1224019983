"""A GRPO rollout program (docs/grpo.md, `rollout_command`) giving fixed completions, for the
tests (trl-runtime/tests/grpo.rs, cargo-trl/tests/grpo.rs) and as an example of the protocol:
one JSON line in per round, one out. Each row is answered with the last 1-4 tokens of its
prompt (by the prompt's last token and the row), EOS after it on even rows; scripts/trl_grpo.py
gives TRL's rollout_func the same rule.
"""
import json
import sys


def completion(prompt_ids, row, eos):
    n = 1 + (prompt_ids[-1] + row) % 4
    c = prompt_ids[-n:]
    return c + [eos] if row % 2 == 0 else c


if __name__ == "__main__":
    for line in sys.stdin:
        r = json.loads(line)
        eos = r["eos_token_id"][0]
        out = [completion(p, i, eos) for i, p in enumerate(r["prompt_ids"])]
        print(json.dumps({"prompt_ids": r["prompt_ids"], "completion_ids": out}), flush=True)
