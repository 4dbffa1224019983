"""The transformers side of `bench train`'s GPU comparison: the same Qwen2-0.5B shape, random
init, trained on one GPU at the same batch and sequence length, bf16 as TRL runs it
(`bf16=True`: fp32 weights under bf16 autocast, fused AdamW), and through TRL's SFTTrainer when
trl and datasets import. Prints one JSON line per framework: {"framework", "tokens_per_s"}.
Run by the Rust bench; usable alone: python3 hf_train.py --seq 2048 --batch 2."""

import argparse
import json
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def config():
    return Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )


def batches(n, batch, seq, vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab - 8, (batch, seq), generator=g) for _ in range(n)]


def plain_loop(args):
    """What transformers' Trainer does per step with bf16=True: autocast forward, backward,
    clip, fused AdamW."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config(), attn_implementation=args.attn).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    data = [b.cuda() for b in batches(args.warmup + args.steps, args.batch, args.seq, 151936)]

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for ids in data[: args.warmup]:
        step(ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for ids in data[args.warmup:]:
        step(ids)
    torch.cuda.synchronize()
    secs = time.perf_counter() - start
    return args.steps * args.batch * args.seq / secs


def trl_sft(args):
    """TRL's SFTTrainer on pre-tokenized rows of the same length (no packing needed)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = batches(args.warmup + args.steps, args.batch, args.seq, 151936)
    ids = [r.tolist() for b in rows for r in b]
    model = Qwen2ForCausalLM._from_config(config(), attn_implementation=args.attn)
    timings = []

    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            timings.append(time.perf_counter())

    cfg = SFTConfig(
        output_dir="/tmp/hf-train-bench", per_device_train_batch_size=args.batch,
        max_length=args.seq, bf16=True, learning_rate=1e-5, max_steps=args.warmup + args.steps,
        logging_steps=1000, save_strategy="no", report_to=[], dataset_num_proc=None,
        optim="adamw_torch_fused",
    )
    trainer = SFTTrainer(model=model, args=cfg,
                         train_dataset=Dataset.from_dict({"input_ids": ids}),
                         callbacks=[Clock()])
    trainer.train()
    secs = timings[-1] - timings[args.warmup - 1]
    return args.steps * args.batch * args.seq / secs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    # Ours computes attention from the whole score matrix; sdpa is transformers' default.
    p.add_argument("--attn", default="sdpa")
    args = p.parse_args()
    print(json.dumps({"framework": "transformers", "tokens_per_s": plain_loop(args)}), flush=True)
    torch.cuda.empty_cache()
    try:
        print(json.dumps({"framework": "trl", "tokens_per_s": trl_sft(args)}), flush=True)
    except ImportError as e:
        print(f"TRL comparison skipped: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
