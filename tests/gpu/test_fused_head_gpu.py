"""Liger-Kernel's fused LM head against the chunked head on a GPU (`model.fused_head`), at the
1.5B shape (hidden 1536, vocabulary 151,936) with one 32,768-token micro-batch in bf16 compute:
per-token logprobs and entropy, and the gradients of the hidden states and the head weight
through both (the entropy as a bonus), agree within bf16 rounding. Prints each head's time and
peak memory (`pytest -m gpu tests/gpu/test_fused_head_gpu.py -s`).

Skips, saying why, without a CUDA GPU or without what Liger's head needs there (liger-kernel
>= 0.8.2, bf16, and on a Hopper GPU nvidia-cutlass-dsl: `pip install -e '.[gpu]'`). The CPU
tests of the dispatch around the kernel: tests/unit/test_fused_head.py.
"""

import time

import pytest
import torch

from vlrft.models.fused_head import head_token_stats, liger_missing, resolve_fused_head

HIDDEN, VOCAB, TOKENS = 1536, 151_936, 32_768
TEMPERATURE = 0.9

MISSING = liger_missing("bfloat16")  # '' where it runs; else why not (no CUDA GPU first)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(MISSING), reason=f"Liger's fused head {MISSING}")]


class Head(torch.nn.Module):
    """What `head_token_stats` reads of a causal LM: its lm_head (fp32 master weight, as vlrft
    keeps under ZeRO 0-2), its compute dtype and the head it was given."""

    def __init__(self, weight: torch.Tensor, kind: str):
        super().__init__()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="cuda")
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        self.compute_dtype, self.fused_head = torch.bfloat16, kind


def run(kind, weight, hidden, targets, upstream):
    """(logp, entropy, hidden's gradient, weight's gradient, seconds, peak GiB above the inputs)."""
    model = Head(weight, kind)
    hidden = hidden.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes, start = torch.cuda.memory_allocated(), time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as decoder_autocast runs the head
        logp, entropy, _ = head_token_stats(model, hidden, targets, TEMPERATURE)
    (logp * upstream[0] + 0.1 * entropy * upstream[1]).sum().backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - start_bytes) / 2**30
    return logp.detach(), entropy.detach(), hidden.grad, model.lm_head.weight.grad, seconds, peak


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_liger_head_matches_the_chunked_head_at_the_1_5b_shape():
    g = torch.Generator(device="cuda").manual_seed(0)
    # Post-norm hidden states (unit scale) and a head whose logits have a standard deviation of
    # ~3 (maxima ~14), so the distributions range from flat to peaked.
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.08
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=g)
    upstream = torch.randn(2, TOKENS, device="cuda", generator=g)  # per-token loss weights
    print(f"\n{torch.cuda.get_device_name()}: auto picks {resolve_fused_head('auto', 'bfloat16', torch.nn.Linear(2, 2, bias=False))}")
    for kind in ("chunked", "liger"):  # first use: Liger compiles its kernels, cuBLAS picks its own
        run(kind, weight, hidden[:2048], targets[:2048], upstream[:, :2048])
    results = {kind: run(kind, weight, hidden, targets, upstream) for kind in ("chunked", "liger")}
    for kind, (_, _, _, _, seconds, peak) in results.items():
        print(f"{kind:>8} head, {TOKENS} tokens x {VOCAB} vocabulary: forward + backward {seconds * 1e3:.0f} ms, "
              f"peak {peak:.2f} GiB above the inputs")
    chunked, fused = results["chunked"], results["liger"]
    logp_diff, entropy_diff = (fused[0] - chunked[0]).abs(), (fused[1] - chunked[1]).abs()
    print(f"logprob |diff| max {logp_diff.max():.4f} mean {logp_diff.mean():.5f}; entropy |diff| max "
          f"{entropy_diff.max():.4f} mean {entropy_diff.mean():.5f}; gradients' relative difference: hidden "
          f"{relative(fused[2], chunked[2]):.4f}, weight {relative(fused[3], chunked[3]):.4f}")
    assert fused[0].dtype == fused[1].dtype == torch.float32 and fused[0].shape == fused[1].shape == (TOKENS,)
    assert chunked[0].abs().mean() > 1.0 and chunked[1].std() > 0.1  # logprobs and entropies that vary
    # bf16 rounding: the chunked head rounds each logit to bf16 (2^-9 relative, ~0.02 at 10),
    # Liger's kernel keeps them in fp32 and rounds the entropy it returns to bf16.
    assert logp_diff.max() < 0.1 and logp_diff.mean() < 0.01
    assert entropy_diff.max() < 0.1 and entropy_diff.mean() < 0.02
    # Both heads' gradients pass through bf16 matmuls: ~2^-8 relative per element.
    assert relative(fused[2], chunked[2]) < 0.02 and relative(fused[3], chunked[3]) < 0.02
    assert fused[3].dtype == torch.float32  # the gradient reaches the fp32 master weight
