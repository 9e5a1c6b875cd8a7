"""Peak memory of token logprobs + entropy (forward and backward) through a Qwen-sized LM head
(hidden 896, vocabulary 151,936): naive full logits vs vlrft's chunked computation.

    python bench/chunked_logprobs.py [--tokens 2048] [--chunk 1024]

Each variant runs in its own subprocess; the reported number is the growth of the process's
peak resident memory over the inputs' footprint (ru_maxrss), so allocator reuse cannot hide it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

HIDDEN, VOCAB = 896, 151_936


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_variant(variant: str, tokens: int, chunk: int) -> dict:
    import torch

    from vlrft.algo.entropy import token_entropy
    from vlrft.models.chunked import chunked_token_stats

    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(tokens, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (tokens,))
    # Warm up the allocator and kernels on a small input, then take the baseline.
    chunked_token_stats(hidden[:8], targets[:8], head, 1.0)[0].sum().backward()
    head.weight.grad = None
    hidden.grad = None
    base = peak_mib()
    start = time.perf_counter()
    if variant == "naive":
        logits = head(hidden).float()  # [T, V]
        logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        entropy = token_entropy(logits)
    else:
        logp, entropy, _ = chunked_token_stats(hidden, targets, head, 1.0, chunk_tokens=chunk)
    (logp.sum() + 0.01 * entropy.sum()).backward()
    return {"variant": variant, "peak_extra_mib": peak_mib() - base, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--variant", choices=["naive", "chunked"])
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.chunk)))
        return
    logits_mib = args.tokens * VOCAB * 4 / 2**20
    print(f"LM head {HIDDEN} x {VOCAB}, {args.tokens} tokens; one fp32 [T, V] logits tensor = {logits_mib:.0f} MiB")
    results = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens), "--chunk", str(args.chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[variant] = json.loads(out)
        r = results[variant]
        print(f"{variant:8s} peak extra memory {r['peak_extra_mib']:8.0f} MiB   forward+backward {r['seconds']:.2f} s")
    ratio = results["naive"]["peak_extra_mib"] / max(results["chunked"]["peak_extra_mib"], 1.0)
    chunk_mib = args.chunk * VOCAB * 4 / 2**20
    print(f"chunked uses {ratio:.1f}x less; its bound is a few chunks of {chunk_mib:.0f} MiB, independent of the token count")


if __name__ == "__main__":
    main()
