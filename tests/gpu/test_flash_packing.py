"""The real varlen flash-attention kernel on a GPU (bf16): a packed micro-batch of text,
one-image and two-image samples gives each sample what it gets alone, and the backward runs.

Skipped without a CUDA GPU and the flash-attn package (pip install 'vlrft[gpu]'). The same path
with a plain-torch stand-in for the kernel runs on CPUs: tests/unit/test_varlen_attention.py.
"""

import pytest
import torch

from vlrft.experience.collate import collate, gather_responses
from vlrft.experience.packing import pack
from vlrft.models.attention import flash_attention_missing
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model

MISSING = flash_attention_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(MISSING), reason=f"needs a CUDA GPU with flash-attn: {MISSING}")]


def test_flash_varlen_packed_forward_equals_per_sample_on_gpu(mixed_rollouts, tiny_vl):
    """Packing adds no error of its own: each packed sample is as close to its exact fp32
    per-sample logprobs as the same sample computed alone in bf16 is (bf16 rounding); a wrong
    sample boundary or position id would be far outside that."""
    flash = load_model(tiny_vl, attention="flash_attention_2", compute_dtype="bfloat16").cuda()
    fp32 = load_model(tiny_vl).cuda().eval()
    batch = pack(mixed_rollouts)
    out = policy_forward(flash, batch, 1.0)
    logp, entropy = gather_responses(batch, out.logp.cpu()), gather_responses(batch, out.entropy.cpu())
    with torch.no_grad():
        for i, rollout in enumerate(mixed_rollouts):
            alone = collate([rollout], pad_id=0)
            single, exact = policy_forward(flash, alone, 1.0), policy_forward(fp32, alone, 1.0)
            single_logp, exact_logp = gather_responses(alone, single.logp.cpu())[0], gather_responses(alone, exact.logp.cpu())[0]
            exact_entropy = gather_responses(alone, exact.entropy.cpu())[0]
            rounding = (single_logp - exact_logp).abs().max().item()
            assert rounding < 0.1
            assert (logp[i] - exact_logp).abs().max() <= 2 * rounding + 1e-3
            rounding = (gather_responses(alone, single.entropy.cpu())[0] - exact_entropy).abs().max().item()
            assert (entropy[i] - exact_entropy).abs().max() <= 2 * rounding + 1e-3
    out.logp.sum().backward()
    grads = [p.grad for p in flash.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
