"""Padded vs packed micro-batches for one policy update on a length-skewed batch.

    python bench/packing.py [--samples 32] [--budget 2048]
    python bench/packing.py --attention sdpa_segments --budget 1024 8192   # CPU: token budget vs speed
    python bench/packing.py --device cuda --compute-dtype bfloat16 --attention torch_varlen --samples 256 --budget 16384

Model: a randomly initialised ~50M-parameter Qwen2-shaped causal LM (hidden 512, 11 layers,
32k vocabulary), fp32 weights on CPU by default. On a GPU the packed run can use a varlen kernel
(flash_attention_2 or torch_varlen), timed after the same micro-batches with the block-diagonal
sdpa mask; the peak GPU memory of each run is printed. Batch: 32 sequences with a 64-token prompt and skewed response
lengths (most 8-40 tokens, a few 400-480: the shape of RL rollouts where some responses run
long). Padded baseline: 8 sequences per micro-batch, right-padded to the longest (the usual
fixed-size micro-batch); packed: vlrft's ReplayBuffer packing, `micro_batch_tokens` tokens
per micro-batch (each `--budget` given). `--attention sdpa_segments` (the CPU default) also
times the packed micro-batches without a mask, each sample's attention on its own; its update
should not slow down as the budget grows, the mask's does (T² per micro-batch). Both run the same vlrft forward (`policy_forward`) and a token-mean policy-
gradient loss with backward; the update wall time is the best of 2 runs.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from vlrft.cpu_memory import keep_freed_memory
from vlrft.models.collate import collate
from vlrft.models.packing import pack, split_by_token_budget
from vlrft.models.attention import COMPUTE_DTYPES, resolve_attention
from vlrft.models.forward import policy_forward
from vlrft.types import Prompt, Rollout


def skewed_rollouts(n: int, vocab: int, seed: int = 0) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for i in range(n):
        long = i % 8 == 3  # one in eight responses runs long
        length = int(torch.randint(400, 481, (1,), generator=g)) if long else int(torch.randint(8, 41, (1,), generator=g))
        prompt_ids = torch.randint(10, vocab, (64,), generator=g).tolist()
        prompt = Prompt(id=str(i), data_source="bench", answer="", meta={}, prompt_text="", prompt_ids=prompt_ids, index=i)
        rollouts.append(Rollout(prompt, i, torch.randint(10, vocab, (length,), generator=g).tolist(), "", False))
    return rollouts


def update_seconds(model, batches, total_tokens: float) -> float:
    model.zero_grad(set_to_none=True)
    cuda = next(model.parameters()).is_cuda
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    synchronize()
    start = time.perf_counter()
    for batch in batches:
        logp = policy_forward(model, batch, 1.0).logp  # [B, L], 0 off the response tokens
        (-logp.sum() / total_tokens).backward()  # token-mean policy gradient with A = 1
    synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--per-micro-batch", type=int, default=8, help="padded baseline: sequences per micro-batch")
    parser.add_argument("--budget", type=int, nargs="+", default=[2048], help="packed: micro_batch_tokens (several: each)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "sdpa_segments", "flash_attention_2", "torch_varlen"])
    parser.add_argument("--compute-dtype", default="float32", choices=list(COMPUTE_DTYPES))
    args = parser.parse_args()
    if args.attention in ("flash_attention_2", "torch_varlen") and args.compute_dtype != "bfloat16":
        parser.error(f"--attention {args.attention} needs --compute-dtype bfloat16 (flash-attention has no fp32 kernel)")
    if args.device == "cpu":
        keep_freed_memory()  # as a CPU training rank does (vlrft/cpu_memory.py)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_hidden_layers=11,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).to(args.device)
    model.compute_dtype = COMPUTE_DTYPES[args.compute_dtype]  # as vlrft's loader sets it
    params = sum(p.numel() for p in model.parameters())
    rollouts = skewed_rollouts(args.samples, config.vocab_size)
    real = sum(len(r.prompt.prompt_ids) + len(r.response_ids) for r in rollouts)
    response_tokens = float(sum(len(r.response_ids) for r in rollouts))
    padded = [collate(rollouts[i : i + args.per_micro_batch], 0) for i in range(0, len(rollouts), args.per_micro_batch)]
    padded_tokens = sum(b.input_ids.numel() for b in padded)
    lengths = sorted(len(r.response_ids) for r in rollouts)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"model: Qwen2-shaped, {params / 1e6:.1f}M parameters, fp32 weights, {args.compute_dtype} compute, {where}")
    print(f"batch: {len(rollouts)} sequences, prompt 64 tokens, response tokens min/median/max "
          f"{lengths[0]}/{lengths[len(lengths) // 2]}/{lengths[-1]}; {real} real tokens")
    # Padded runs sdpa on its padding mask; packed runs sdpa on the block-diagonal mask, then
    # (with --attention other than sdpa) the mask-free kernel on the same micro-batches.
    runs = [("padded", "sdpa", padded, padded_tokens)]
    for budget in args.budget:
        packed = [pack(g) for g in split_by_token_budget(rollouts, budget)]
        packed_tokens = sum(b.input_ids.numel() for b in packed)
        runs.append((f"packed {budget}", "sdpa", packed, packed_tokens))
        if args.attention != "sdpa":
            runs.append((f"packed {budget}", args.attention, packed, packed_tokens))
    times = {}
    for name, attention, batches, processed in runs:
        model.set_attn_implementation(resolve_attention(attention, args.compute_dtype))
        label = f"{name} ({'mask' if attention == 'sdpa' else attention})"
        times[label] = min(update_seconds(model, batches, response_tokens) for _ in range(2))
        peak = f"  peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:5.2f} GiB" if args.device.startswith("cuda") else ""
        print(f"{label:32s} {len(batches):2d} micro-batches  tokens processed {processed:6d}  "
              f"padding {1 - real / processed:6.1%}  update {times[label]:6.2f} s{peak}")
    first, last = args.budget[0], args.budget[-1]
    print(f"packed ({first}) is {times['padded (mask)'] / times[f'packed {first} (mask)']:.2f}x faster than padded "
          f"({padded_tokens / runs[1][3]:.2f}x fewer tokens processed)")
    if args.attention != "sdpa":
        varlen = times[f"packed {first} ({args.attention})"]
        print(f"packed with {args.attention} is {times['padded (mask)'] / varlen:.2f}x faster than padded and "
              f"{times[f'packed {first} (mask)'] / varlen:.2f}x faster than packed with the block-diagonal mask")
    if last != first:
        for kernel in ["mask"] + ([args.attention] if args.attention != "sdpa" else []):
            ratio = times[f"packed {last} ({kernel})"] / times[f"packed {first} ({kernel})"]
            print(f"{kernel}: update at micro_batch_tokens {last} takes {ratio:.2f}x the time at {first}")


if __name__ == "__main__":
    main()
