"""A reward program for GRPO (docs/grpo.md): one JSON line in per round, one line out.

Scores each completion by the share of its token ids that are even: a reward that any sampled
completion earns differently, which the tests use to give GRPO's advantages something to work
on. A Python reward function with TRL's signature fits in the same loop.
"""

import json
import sys


def parity_reward(prompts, completions, completion_ids, **columns):
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


for line in sys.stdin:
    request = json.loads(line)
    print(json.dumps(parity_reward(**request)), flush=True)
