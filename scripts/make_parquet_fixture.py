#!/usr/bin/env python3
"""Writes the small Parquet files trl-runtime's dataset tests read, the way HF datasets lays
out TRL's formats (needs pyarrow):

    python3 scripts/make_parquet_fixture.py trl-runtime/tests/fixtures/parquet
"""
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

out = Path(sys.argv[1] if len(sys.argv) > 1 else "trl-runtime/tests/fixtures/parquet")
out.mkdir(parents=True, exist_ok=True)

conversations = pa.table({
    "messages": [
        [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "The answer is 5."}],
        [{"role": "user", "content": "What is 1 plus 1?"}, {"role": "assistant", "content": "The answer is 2."}],
    ]
})
pq.write_table(conversations, out / "messages.parquet", compression="snappy")

prompt_completion = pa.table({
    "prompt": ["What is 2 plus 3? ", "What is 4 plus 4? ", "What is 9 plus 1? "],
    "completion": ["The answer is 5.", None, "The answer is 10."],
})
pq.write_table(prompt_completion, out / "prompt_completion.parquet", compression="zstd")
print(f"wrote {out}")
