"""Sequence parallelism (train.sequence_parallel): activation memory and step time per rank on one
long sample, at N = 1, 2 and 4 ranks sharing it.

    python bench/sequence_parallel.py [--tokens 8192] [--sizes 1 2 4] [--layers 8]

A Qwen2-shaped text decoder built from a config (random weights, no download: --layers layers of
width 256, 8 heads, 4 key/value heads, vocabulary 4,096), fp32, sdpa_segments, no gradient
checkpointing; one packed sample of --tokens tokens, half prompt, half response. For each N the
script launches N CPU ranks (torchrun, gloo) sharing the micro-batch and reports, per rank:

- activation memory: the bytes the forward saves for the backward (every tensor autograd keeps,
  counted by torch.autograd.graph.saved_tensors_hooks), the largest rank's, which is what
  sequence parallelism divides: the decoder's per-layer activations fall by N; the token
  embeddings, the gathered last hidden states and the LM head's chunks stay whole per rank;
- step time: forward + backward of the policy's logprobs, best of --repeats (the ranks share this
  machine's cores: a ratio against the bound, not a speed-up claim for GPUs).

Printed: each N's numbers and its memory ratio against N = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build_model(layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vlrft.models.sdpa_segments import SDPA_SEGMENTS

    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=65536,
                         tie_word_embeddings=True, attn_implementation=SDPA_SEGMENTS)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.compute_dtype = torch.float32
    return model


def long_batch(tokens: int):
    from vlrft.models.packing import pack
    from vlrft.types import Prompt, Rollout

    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(10, 4000, (tokens // 2,), generator=g).tolist()
    prompt = Prompt(id="long", data_source="bench", answer="", meta={}, prompt_text="", prompt_ids=prompt_ids, index=0)
    rollout = Rollout(prompt, 0, torch.randint(10, 4000, (tokens - tokens // 2,), generator=g).tolist(), "", False)
    return pack([rollout])


def measure(tokens: int, layers: int, repeats: int, out_file: str) -> None:
    """One rank's numbers (run under torchrun, or alone for N = 1)."""
    from vlrft.distributed import all_gather_objects, init_distributed, rank, sequence_groups, world_size
    from vlrft.models.forward import policy_forward
    from vlrft.models.sequence_parallel import shard_model
    from vlrft.models.ulysses import SequenceShard

    torch.set_num_threads(1)
    init_distributed()
    model = build_model(layers)
    size = world_size()
    if size > 1:
        shard_model(model, SequenceShard(*sequence_groups(size), size))
    batch = long_batch(tokens)
    saved = [0]

    def keep(t: torch.Tensor):
        saved[0] += t.numel() * t.element_size()
        return t

    times = []
    for _ in range(repeats):
        saved[0] = 0
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = policy_forward(model, batch, 1.0)
        out.logp.sum().backward()
        times.append(time.perf_counter() - started)
    numbers = all_gather_objects({"saved": saved[0], "seconds": min(times)})
    if rank() == 0:
        Path(out_file).write_text(json.dumps(numbers))


def launch(size: int, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        launcher = [sys.executable] if size == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(size)]
        command = launcher + [__file__, "--measure", "--tokens", str(args.tokens), "--layers", str(args.layers),
                              "--repeats", str(args.repeats), "--out", str(out)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"N = {size} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.tokens, args.layers, args.repeats, args.out)
    print(f"one sample of {args.tokens} tokens, {args.layers}-layer Qwen2 shape (width 256), fp32, CPU ranks (gloo)")
    print(f"{'N':>3} {'activations per rank (MiB, largest)':>38} {'vs N=1':>8} {'step s (slowest rank)':>22}")
    base = None
    for size in args.sizes:
        ranks = launch(size, args)
        saved = max(r["saved"] for r in ranks) / 2**20
        seconds = max(r["seconds"] for r in ranks)
        base = base or saved
        print(f"{size:>3} {saved:>38.1f} {base / saved:>7.2f}x {seconds:>22.2f}")


if __name__ == "__main__":
    main()
