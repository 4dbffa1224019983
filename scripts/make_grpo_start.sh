#!/usr/bin/env bash
# Writes assets/tiny/grpo-start: the bundled GRPO job's starting checkpoint. The tiny model
# learns the addition task (the README's SFT job: 95% held-out), then is briefly supervised
# (250 steps) on a careless teacher's answers, two in three of which copy the question's first
# number. It keeps both habits: its greedy answer to a held-out question is now right 4% of
# the time and one sample in ten is. RL with an exact-answer reward alone (accuracy_reward)
# then raises the held-out accuracy: assets/tiny/grpo.yaml, the README's GRPO command.
# It also writes the job's prompts, assets/tiny/data/rl_{train,eval}.jsonl: the addition task's
# training and held-out questions with their sums as `solution`.
# Run by hand from the repository root; its output is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
work=output/grpo-start-work
rm -rf "$work" && mkdir -p "$work"
python3 - "$work/careless_train.jsonl" <<'PY'
import json, random, re, sys
rng = random.Random(20261204)
with open("assets/tiny/data/train.jsonl") as src, open(sys.argv[1], "w") as out:
    for line in src:
        row = json.loads(line)
        first = re.match(r"What is (\d+) \+", row["messages"][0]["content"]).group(1)
        if rng.random() >= 1 / 3:
            row["messages"][1]["content"] = first
        out.write(json.dumps(row) + "\n")
PY
python3 - <<'PY'
import json
for name in ["train", "eval"]:
    with open(f"assets/tiny/data/{name}.jsonl") as src, open(f"assets/tiny/data/rl_{name}.jsonl", "w") as out:
        for line in src:
            user, assistant = json.loads(line)["messages"]
            out.write(json.dumps({"prompt": [user], "solution": assistant["content"]}) + "\n")
PY
# The README's SFT job first (the model learns to add), then the careless teacher's rows.
cargo run --release -p trl-examples --bin sft -- --config assets/tiny/sft.yaml \
  --save_steps 100000 --output_dir "$work/sft"
learnt=$(ls -d "$work"/sft/checkpoint-* | sort -V | tail -1)
cargo run --release -p trl-examples --bin sft -- --config assets/tiny/sft.yaml \
  --model_name_or_path "$learnt" --dataset_name "$work/careless_train.jsonl" \
  --max_steps "${STEPS:-250}" --learning_rate "${LR:-2e-3}" --save_steps 100000 --output_dir "$work/careless"
rm -rf assets/tiny/grpo-start && mkdir -p assets/tiny/grpo-start
last=$(ls -d "$work"/careless/checkpoint-* | sort -V | tail -1)
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
  if [ -f "$last/$f" ]; then cp "$last/$f" assets/tiny/grpo-start/; fi
done
echo "wrote assets/tiny/grpo-start"
