"""The transformers side of `bench train`'s GPU comparison: the same Qwen2-0.5B shape, random
init, trained on one GPU at the same batch and sequence length, bf16 as TRL runs it
(`bf16=True`: fp32 weights under bf16 autocast, fused AdamW), and through TRL's SFTTrainer when
trl and datasets import. Prints one JSON line per framework: {"framework", "tokens_per_s"}.
Run by the Rust bench; usable alone: python3 hf_train.py --seq 2048 --batch 2. `--device cpu
--shape tiny` runs the same code on a CPU in seconds (a check that it works with the installed
transformers and TRL before GPU time is spent on it)."""

import argparse
import gc as gc_module
import os
import json
import sys
import time
from pathlib import Path
import traceback

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM


SHAPES = {
    # Qwen2-0.5B: the bench's shape.
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    # `bench train`'s CPU reference shape (benches/support reference_config).
    "ref": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4),
    # For checking the script itself.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def config(shape):
    return Qwen2Config(
        **SHAPES[shape], max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def batches(n, batch, seq, vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab - 8, (batch, seq), generator=g) for _ in range(n)]


def plain_loop(args, batch, gc):
    """What transformers' Trainer does per step with bf16=True: autocast forward, backward,
    clip, fused AdamW."""
    torch.manual_seed(0)
    cfg = config(args.shape)
    model = Qwen2ForCausalLM._from_config(cfg, attn_implementation=args.attn).to(args.device)
    if gc:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    data = batches(args.warmup + args.steps, batch, args.seq, cfg.vocab_size)
    data = [b.to(args.device) for b in data]

    def step(ids):
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for ids in data[: args.warmup]:
        step(ids)
    synchronize(args.device)
    start = time.perf_counter()
    for ids in data[args.warmup:]:
        step(ids)
    synchronize(args.device)
    secs = time.perf_counter() - start
    return args.steps * batch * args.seq / secs


def trl_sft(args, batch, gc, liger=False):
    """TRL's SFTTrainer on pre-tokenized rows of the same length (no packing needed); with
    `liger`, its use_liger_kernel (Liger-Kernel's fused RMSNorm, RoPE, SwiGLU and linear
    cross-entropy)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = config(args.shape)
    rows = batches(args.warmup + args.steps, batch, args.seq, cfg.vocab_size)
    ids = [r.tolist() for b in rows for r in b]
    model = Qwen2ForCausalLM._from_config(cfg, attn_implementation=args.attn)
    timings = []

    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            synchronize(args.device)
            timings.append(time.perf_counter())

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Under torchrun: DDP over gloo on CPU, as accelerate launch --multi_cpu sets it up.
    ddp = {"ddp_backend": "gloo"} if world > 1 and args.device == "cpu" else {}
    sft_args = SFTConfig(
        output_dir="/tmp/hf-train-bench", per_device_train_batch_size=batch,
        max_length=args.seq, bf16=args.dtype == "bf16", learning_rate=1e-5, max_steps=args.warmup + args.steps,
        logging_steps=1000, save_strategy="no", report_to=[], dataset_num_proc=None,
        optim="adamw_torch_fused", use_cpu=args.device == "cpu",
        # Stated, not left to TRL's default (on), so the comparison's setting is known.
        gradient_checkpointing=gc, use_liger_kernel=liger,
        **ddp,
    )
    # A tokenizer only for its pad and eos ids (the rows are token ids already): the bundled one.
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "assets/tiny/model")
    trainer = SFTTrainer(model=model, args=sft_args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"input_ids": ids}),
                         callbacks=[Clock()])
    trainer.train()
    secs = timings[-1] - timings[args.warmup - 1]
    return world * args.steps * batch * args.seq / secs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    # sdpa is transformers' default (and ours, which runs it blockwise on a GPU).
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    # fp32 for the CPU comparison (ours trains the CPU shape in fp32).
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--gradient_checkpointing", action="store_true", help="TRL's run with it on")
    p.add_argument("--runs", default="",
                   help="BATCH:on|off,... (gradient checkpointing); overrides --batch and "
                        "--gradient_checkpointing")
    p.add_argument("--peers", default="transformers,trl,trl_liger",
                   help="which peers run (trl_liger: TRL with use_liger_kernel, on a GPU)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [(args.batch, args.gradient_checkpointing)]
    if args.runs:
        runs = [(int(b), gc == "on") for b, gc in (r.split(":") for r in args.runs.split(","))]
    peers = args.peers.split(",")
    # Under torchrun (WORLD_SIZE > 1) only TRL runs, as DDP; rank 0 prints.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    main_rank = os.environ.get("RANK", "0") == "0"
    for batch, gc in runs:
        for peer in peers:
            if peer == "transformers" and world > 1:
                continue
            if peer == "trl_liger" and args.device != "cuda":
                continue
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                if peer == "transformers":
                    tokens_per_s = plain_loop(args, batch, gc)
                else:
                    tokens_per_s = trl_sft(args, batch, gc, liger=peer == "trl_liger")
            except ImportError as e:
                print(f"{peer} skipped: {e}", file=sys.stderr)
                continue
            except Exception:  # the other peers still count
                print(f"{peer} at batch {batch} failed:", file=sys.stderr)
                traceback.print_exc()
                continue
            line = {"framework": peer, "tokens_per_s": tokens_per_s, "world": world,
                    "batch": batch, "gradient_checkpointing": gc}
            if args.device == "cuda":
                line["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if main_rank:
                print(json.dumps(line), flush=True)
            gc_module.collect()


if __name__ == "__main__":
    main()
