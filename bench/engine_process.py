"""What running the engine in a process of its own costs (vlrft/engines/engine_process.py: how
an async run's rollout rank runs vLLM), measured with the HF engine on both sides.

    python bench/engine_process.py

The model and prompts are bench/engine.py's (a random ~33M-parameter Qwen2-shaped model, fp32;
prompts of 64 random tokens). Prints, for the same engine in this process and in a child
process: the time to load one version of the weights (`update_weights`), its rate in GB/s,
and the time of a small greedy generate call; the ratios are the price of the process boundary. On the CPU each bucket of
weights is copied once into shared memory on its way; on GPUs the tensors go as CUDA IPC
handles (not measured here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import save_model  # noqa: E402  (bench/engine.py: the same model)


def timed(call, repeats: int) -> float:
    """Median seconds of `call()` over `repeats` runs (after one warm-up)."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from data_tools.tiny_tokenizer import build_tokenizer
    from vlrft.config import Config
    from vlrft.engines import SamplingParams
    from vlrft.engines.engine_process import EngineProcess
    from vlrft.engines.hf_engine import HFEngine
    from vlrft.models.loader import banned_token_ids, load_model, stop_token_ids
    from vlrft.types import Prompt

    with tempfile.TemporaryDirectory() as path:
        save_model(path)
        tok = build_tokenizer()
        stop, banned = stop_token_ids(tok), banned_token_ids(tok)
        local = HFEngine(path, tok, stop, banned)
        cfg = Config()
        cfg.model.path = path
        child = EngineProcess("hf", cfg, tok, stop, banned)
        weights = [(n, p.detach().clone()) for n, p in load_model(path).named_parameters()]
        gigabytes = sum(t.numel() * t.element_size() for _, t in weights) / 1e9
        g = torch.Generator().manual_seed(0)
        prompts = [Prompt(id=str(i), data_source="bench", answer="", meta={}, prompt_text="",
                          prompt_ids=torch.randint(10, 600, (64,), generator=g).tolist(), index=i) for i in range(4)]
        greedy = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, greedy=True)
        rows = []
        for name, engine in (("in this process", local), ("engine process", child)):
            load = timed(lambda: engine.update_weights(iter(weights)), args.repeats)
            generate = timed(lambda: engine.generate(prompts, greedy), args.repeats)
            rows.append((name, load, generate))
        child.close()
    print(f"weights: {gigabytes:.2f} GB (fp32); generate: 4 prompts x 2, 8 tokens, greedy")
    print(f"{'engine':<18}{'load weights s':>16}{'GB/s':>8}{'generate s':>12}")
    for name, load, generate in rows:
        print(f"{name:<18}{load:>16.3f}{gigabytes / load:>8.2f}{generate:>12.3f}")
    (_, load_here, gen_here), (_, load_there, gen_there) = rows
    print(f"engine process / in process: load {load_there / load_here:.2f}x, generate {gen_there / gen_here:.2f}x")


if __name__ == "__main__":
    main()
