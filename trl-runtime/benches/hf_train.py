"""The transformers side of `bench train`'s GPU comparison: the same model (Qwen2-0.5B's shape,
or the config.json in --model_dir, any model type), random init, trained on one GPU at the same
batch and sequence length, bf16 as TRL runs it (`bf16=True`: fp32 weights under bf16
autocast, fused AdamW), and through TRL's SFTTrainer or DPOTrainer when trl and datasets
import. Prints one JSON line per framework: {"framework", "tokens_per_s"}.
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config


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


def config(args):
    """The model's config: the config.json in --model_dir (what the Rust bench wrote and
    trains, any model type), else the Qwen2 --shape."""
    if args.model_dir:
        return AutoConfig.from_pretrained(args.model_dir)
    return Qwen2Config(
        **SHAPES[args.shape], max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )


def random_model(args, cfg):
    """A random-init model of `cfg` (fp32 weights, as TRL keeps them under bf16=True)."""
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=args.attn,
                                            dtype=torch.float32)


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
    cfg = config(args)
    model = random_model(args, cfg).to(args.device)
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


def trainer_setup(args):
    """What a TRL trainer run needs here: the step-end times (filled by the returned
    callback), the world size and, under torchrun on a CPU, DDP over gloo as accelerate
    launch --multi_cpu sets it up."""
    from transformers import TrainerCallback

    timings = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            synchronize(args.device)
            timings.append(time.perf_counter())

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ddp = {"ddp_backend": "gloo"} if world > 1 and args.device == "cpu" else {}
    return timings, Clock(), world, ddp


def trl_sft(args, batch, gc, liger=False, lora=False):
    """TRL's SFTTrainer on pre-tokenized rows of the same length (no packing needed); with
    `liger`, its use_liger_kernel (Liger-Kernel's fused RMSNorm, RoPE, SwiGLU and linear
    cross-entropy); with `lora`, peft's LoRA as TRL's recipes set it (r 16, alpha 32,
    dropout 0.05, every linear layer)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = config(args)
    rows = batches(args.warmup + args.steps, batch, args.seq, cfg.vocab_size)
    ids = [r.tolist() for b in rows for r in b]
    model = random_model(args, cfg)
    timings, clock, world, ddp = trainer_setup(args)
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
    peft_config = None
    if lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=sft_args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"input_ids": ids}),
                         callbacks=[clock], peft_config=peft_config)
    trainer.train()
    secs = timings[-1] - timings[args.warmup - 1]
    return world * args.steps * batch * args.seq / secs


def trl_dpo(args, batch, gc, precompute):
    """TRL's DPOTrainer (sigmoid loss, beta 0.1) on the text pairs of --pref_data, with its
    reference model (a copy of the policy, forward every step) or, with `precompute`, the
    reference log-probs computed before training. Tokens are those of the prompt+chosen and
    prompt+rejected sequences the timed steps took (padding excluded)."""
    import tempfile
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    cfg = config(args)
    torch.manual_seed(0)
    model = random_model(args, cfg)
    # Read as users read a file (a cache the ranks share: TRL's precompute pass maps the
    # dataset on rank 0 first, and an in-memory dataset's cache is a per-process temp dir).
    cache = os.path.join(tempfile.gettempdir(), "hf-train-bench-dpo-cache")
    rows = load_dataset("json", data_files=args.pref_data, split="train", cache_dir=cache)
    timings, clock, world, ddp = trainer_setup(args)
    dpo_args = DPOConfig(
        output_dir="/tmp/hf-train-bench-dpo", per_device_train_batch_size=batch,
        max_length=2 * args.seq, bf16=args.dtype == "bf16", learning_rate=1e-5,
        max_steps=args.warmup + args.steps, logging_steps=1000, save_strategy="no", report_to=[],
        use_cpu=args.device == "cpu", gradient_checkpointing=gc,
        precompute_ref_log_probs=precompute, **ddp,
    )
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "assets/tiny/model")
    # A model built in memory has no path for TRL to load the reference from: the copy TRL
    # would otherwise load (unused with precompute beyond the first pass).
    import copy
    ref_model = copy.deepcopy(model)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=dpo_args,
                         processing_class=tokenizer,
                         train_dataset=rows, callbacks=[clock])
    data = trainer.train_dataset
    per_pair = sum(2 * len(p) + len(c) + len(r) for p, c, r in
                   zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])) / len(data)
    trainer.train()
    secs = timings[-1] - timings[args.warmup - 1]
    return world * args.steps * batch * per_pair / secs


def trl_kto(args, batch, gc, precompute):
    """TRL's KTOTrainer (kto loss, beta 0.1) on the text pairs of --pref_data, which it
    unpairs: --batch rows per process and step, with its reference model (a copy of the
    policy, forward every step) or, with `precompute`, the reference log-probs computed
    before training. Tokens are those of the prompt+completion sequences (padding and the
    mismatched pairs of the KL estimate excluded)."""
    import copy
    import tempfile
    from datasets import load_dataset
    from trl import KTOConfig, KTOTrainer

    cfg = config(args)
    torch.manual_seed(0)
    model = random_model(args, cfg)
    cache = os.path.join(tempfile.gettempdir(), "hf-train-bench-kto-cache")
    rows = load_dataset("json", data_files=args.pref_data, split="train", cache_dir=cache)
    timings, clock, world, ddp = trainer_setup(args)
    kto_args = KTOConfig(
        output_dir="/tmp/hf-train-bench-kto", per_device_train_batch_size=batch,
        max_length=2 * args.seq, bf16=args.dtype == "bf16", learning_rate=1e-5,
        max_steps=args.warmup + args.steps, logging_steps=1000, save_strategy="no", report_to=[],
        use_cpu=args.device == "cpu", gradient_checkpointing=gc,
        precompute_ref_log_probs=precompute, **ddp,
    )
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "assets/tiny/model")
    trainer = KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=kto_args,
                         processing_class=tokenizer, train_dataset=rows, callbacks=[clock])
    data = trainer.train_dataset
    per_row = sum(len(p) + len(c) for p, c in zip(data["prompt_ids"], data["completion_ids"]))
    per_row /= len(data)
    trainer.train()
    secs = timings[-1] - timings[args.warmup - 1]
    return world * args.steps * batch * per_row / secs


def trl_reward(args, batch, gc):
    """TRL's RewardTrainer on the text pairs of --pref_data: --batch pairs per process and
    step (a chosen and a rejected sequence each), the random model read as a sequence
    classifier with one output. Tokens are those of both sequences (padding excluded)."""
    import tempfile
    from datasets import load_dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    cfg = config(args)
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "assets/tiny/model")
    cfg.num_labels = 1
    cfg.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation=args.attn,
                                                           dtype=torch.float32)
    cache = os.path.join(tempfile.gettempdir(), "hf-train-bench-reward-cache")
    rows = load_dataset("json", data_files=args.pref_data, split="train", cache_dir=cache)
    timings, clock, world, ddp = trainer_setup(args)
    reward_args = RewardConfig(
        output_dir="/tmp/hf-train-bench-reward", per_device_train_batch_size=batch,
        max_length=2 * args.seq, bf16=args.dtype == "bf16", learning_rate=1e-4,
        max_steps=args.warmup + args.steps, logging_steps=1000, save_strategy="no", report_to=[],
        use_cpu=args.device == "cpu", gradient_checkpointing=gc, **ddp,
    )
    trainer = RewardTrainer(model=model, args=reward_args, processing_class=tokenizer,
                            train_dataset=rows, callbacks=[clock])
    data = trainer.train_dataset
    per_pair = sum(len(c) + len(r) for c, r in zip(data["chosen_ids"], data["rejected_ids"]))
    per_pair /= len(data)
    trainer.train()
    secs = timings[-1] - timings[args.warmup - 1]
    return world * args.steps * batch * per_pair / secs


def trl_grpo(args, batch, gc, rloo=False, distillation=False):
    """TRL's GRPOTrainer without vLLM (transformers' generate with its KV cache) on the text
    prompts of --prompt_data: --batch completions per process and step (one generation round
    per step), groups of --num_generations, --completion_length sampled tokens, beta 0 and
    dapo (TRL's defaults), the soft overlong punishment as the reward. Tokens are TRL's
    num_input_tokens_seen (prompt and completion tokens of every rank); the generation share
    is the time rank 0 spent in `generate` over the timed steps' time. rloo: TRL's
    RLOOTrainer at its defaults (beta 0.05: a reference model) instead. distillation: TRL's
    DistillationTrainer at its defaults (reverse KL) with a teacher of the student's shape."""
    import tempfile
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import (DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer, RLOOConfig,
                     RLOOTrainer)
    from trl.rewards import get_soft_overlong_punishment

    cfg = config(args)
    torch.manual_seed(0)
    model = random_model(args, cfg)
    if rloo:
        # RLOO loads its reference (beta 0.05) from the policy's path: give it one.
        saved = tempfile.mkdtemp(prefix="hf-train-bench-rloo-")
        model.save_pretrained(saved)
        model = type(model).from_pretrained(saved, dtype=model.dtype)
    generating = [0.0]
    generate = model.generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        out = generate(*a, **k)
        generating[0] += time.perf_counter() - start
        return out

    model.generate = timed_generate
    cache = os.path.join(tempfile.gettempdir(), "hf-train-bench-grpo-cache")
    rows = load_dataset("json", data_files=args.prompt_data, split="train", cache_dir=cache)
    rows = rows.remove_columns([c for c in rows.column_names if c != "prompt"])
    _, _, world, ddp = trainer_setup(args)
    marks = []

    class Clock(TrainerCallback):
        def on_step_end(self, _args, state, *_, **__):
            marks.append((time.perf_counter(), state.num_input_tokens_seen, generating[0]))

    Config, Trainer = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    online = {"num_generations": args.num_generations}
    if distillation:
        Config, Trainer, online = DistillationConfig, DistillationTrainer, {}
    grpo_args = Config(
        output_dir="/tmp/hf-train-bench-grpo", per_device_train_batch_size=batch,
        max_completion_length=args.completion_length, **online,
        learning_rate=1e-6, max_steps=args.warmup + args.steps, logging_steps=1000,
        save_strategy="no", report_to=[], use_cpu=args.device == "cpu",
        bf16=args.dtype == "bf16", gradient_checkpointing=gc, **ddp,
    )
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "assets/tiny/model")
    reward = get_soft_overlong_punishment(args.completion_length, args.completion_length // 4)
    if distillation:
        torch.manual_seed(1)
        side = {"teacher_model": random_model(args, cfg)}
    else:
        side = {"reward_funcs": [reward]}
    trainer = Trainer(model=model, args=grpo_args, processing_class=tokenizer,
                      train_dataset=rows, callbacks=[Clock()], **side)
    trainer.train()
    (t0, n0, g0), (t1, n1, g1) = marks[args.warmup - 1], marks[-1]
    return (n1 - n0) / (t1 - t0), (g1 - g0) / (t1 - t0)


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
    p.add_argument("--model_dir", help="a folder with the config.json to train (random init); "
                                       "overrides --shape")
    # fp32 for the CPU comparison (ours trains the CPU shape in fp32).
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--gradient_checkpointing", action="store_true", help="TRL's run with it on")
    p.add_argument("--runs", default="",
                   help="BATCH:on|off,... (gradient checkpointing); overrides --batch and "
                        "--gradient_checkpointing")
    p.add_argument("--peers", default="transformers,trl,trl_liger",
                   help="which peers run (trl_liger: TRL with use_liger_kernel, on a GPU; "
                        "trl_lora: TRL + peft LoRA; trl_dpo, trl_dpo_precompute: TRL's "
                        "DPOTrainer on --pref_data, --batch pairs per process; trl_grpo: TRL's "
                        "GRPOTrainer on --prompt_data, --batch completions per process; trl_rloo, "
                        "trl_distillation: TRL's RLOOTrainer and DistillationTrainer alike)")
    p.add_argument("--pref_data", help="jsonl of prompt / chosen / rejected text for trl_dpo")
    p.add_argument("--prompt_data", help="jsonl of prompt text for trl_grpo")
    p.add_argument("--completion_length", type=int, default=64, help="trl_grpo's completions")
    p.add_argument("--num_generations", type=int, default=4, help="trl_grpo's group size")
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
            extra = {}
            try:
                if peer == "transformers":
                    tokens_per_s = plain_loop(args, batch, gc)
                elif peer in ("trl_grpo", "trl_rloo", "trl_distillation"):
                    tokens_per_s, extra["generation_share"] = trl_grpo(
                        args, batch, gc, rloo=peer == "trl_rloo",
                        distillation=peer == "trl_distillation")
                elif peer == "trl_reward":
                    tokens_per_s = trl_reward(args, batch, gc)
                elif peer.startswith("trl_kto"):
                    tokens_per_s = trl_kto(args, batch, gc, precompute=peer == "trl_kto_precompute")
                elif peer.startswith("trl_dpo"):
                    tokens_per_s = trl_dpo(args, batch, gc, precompute=peer == "trl_dpo_precompute")
                else:
                    tokens_per_s = trl_sft(args, batch, gc, liger=peer == "trl_liger",
                                           lora=peer == "trl_lora")
            except ImportError as e:
                print(f"{peer} skipped: {e}", file=sys.stderr)
                continue
            except Exception:  # the other peers still count
                print(f"{peer} at batch {batch} failed:", file=sys.stderr)
                traceback.print_exc()
                continue
            line = {"framework": peer, "tokens_per_s": tokens_per_s, "world": world,
                    "batch": batch, "gradient_checkpointing": gc, **extra}
            if args.device == "cuda":
                line["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if main_rank:
                print(json.dumps(line), flush=True)
            gc_module.collect()


if __name__ == "__main__":
    main()
