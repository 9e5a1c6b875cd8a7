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

# bf16 keeps 8 bits of mantissa: logprobs of the same tokens computed with other kernel tilings
# (packed vs alone) differ by a few 1e-3; a mixed-up sample boundary differs by whole nats.
BF16_TOLERANCE = 0.05


def test_flash_varlen_packed_forward_equals_per_sample_on_gpu(mixed_rollouts, tiny_vl):
    flash = load_model(tiny_vl, attention="flash_attention_2", compute_dtype="bfloat16").cuda()
    fp32 = load_model(tiny_vl).cuda().eval()
    batch = pack(mixed_rollouts)
    out = policy_forward(flash, batch, 1.0)
    logp, entropy = gather_responses(batch, out.logp.cpu()), gather_responses(batch, out.entropy.cpu())
    with torch.no_grad():
        for i, rollout in enumerate(mixed_rollouts):
            alone = collate([rollout], pad_id=0)
            single = policy_forward(flash, alone, 1.0)
            exact = policy_forward(fp32, alone, 1.0)
            assert (logp[i] - gather_responses(alone, single.logp.cpu())[0]).abs().max() <= BF16_TOLERANCE
            assert (entropy[i] - gather_responses(alone, single.entropy.cpu())[0]).abs().max() <= BF16_TOLERANCE
            assert (logp[i] - gather_responses(alone, exact.logp.cpu())[0]).abs().max() <= BF16_TOLERANCE
    out.logp.sum().backward()
    grads = [p.grad for p in flash.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
