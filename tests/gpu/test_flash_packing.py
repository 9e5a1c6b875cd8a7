"""The real varlen kernels on a GPU (bf16): flash-attn's (`flash_attention_2`) and PyTorch's
built-in one (`torch_varlen`). A packed micro-batch of text, one-image and two-image samples, and
one of long text samples, gives each sample what it gets alone, and the backward runs; so do
shared-prompt micro-batches (`train.share_prompts`), whose responses attend to their prompt's keys
through the kernels' end-aligned causal attention over unequal query and key lengths.

Each kernel's tests skip where it cannot run (no CUDA GPU; flash-attn not installed, `pip install
'vlrft[gpu]'`; torch < 2.11). The same paths with plain-torch stand-ins for the kernels run on
CPUs: tests/unit/test_varlen_attention.py and tests/unit/test_torch_varlen.py.
"""

import pytest
import torch

from vlrft.models.collate import collate, gather_responses
from vlrft.models.packing import pack
from vlrft.models.attention import attention_missing, resolve_attention
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.types import Prompt, Rollout

KERNELS = [pytest.param(kind, marks=pytest.mark.skipif(bool(attention_missing(kind)), reason=f"{kind}: {attention_missing(kind)}"))
           for kind in ("flash_attention_2", "torch_varlen")]
pytestmark = pytest.mark.gpu


def assert_packing_adds_no_error(model, fp32, rollouts, share=False):
    """Each packed sample is as close to its exact fp32 per-sample logprobs as the same sample
    computed alone in bf16 is (bf16 rounding); a wrong sample boundary or position id would be
    far outside that. Then the backward runs into fp32 gradients."""
    batch = pack(rollouts, share=share)
    assert batch.shares_prompts() == share
    out = policy_forward(model, batch, 1.0)
    logp, entropy = gather_responses(batch, out.logp.cpu()), gather_responses(batch, out.entropy.cpu())
    with torch.no_grad():
        for i, rollout in enumerate(batch.samples):
            alone = collate([rollout], pad_id=0)
            single, exact = policy_forward(model, alone, 1.0), policy_forward(fp32, alone, 1.0)
            single_logp, exact_logp = gather_responses(alone, single.logp.cpu())[0], gather_responses(alone, exact.logp.cpu())[0]
            exact_entropy = gather_responses(alone, exact.entropy.cpu())[0]
            rounding = (single_logp - exact_logp).abs().max().item()
            assert rounding < 0.1
            assert (logp[i] - exact_logp).abs().max() <= 2 * rounding + 1e-3, i
            rounding = (gather_responses(alone, single.entropy.cpu())[0] - exact_entropy).abs().max().item()
            assert (entropy[i] - exact_entropy).abs().max() <= 2 * rounding + 1e-3, i
    out.logp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kind", KERNELS)
def test_varlen_packed_vision_language_forward_equals_per_sample_on_gpu(kind, mixed_rollouts, tiny_vl):
    model = load_model(tiny_vl, attention=resolve_attention(kind, "bfloat16"), compute_dtype="bfloat16").cuda()
    assert_packing_adds_no_error(model, load_model(tiny_vl).cuda().eval(), mixed_rollouts)


@pytest.mark.parametrize("kind", KERNELS)
def test_varlen_packed_long_text_forward_equals_per_sample_on_gpu(kind, tiny_text):
    """Lengths 1 to 1500 tokens: many kernel tiles per sample, samples starting mid-tile."""
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for i, (prompt_len, response_len) in enumerate([(5, 1), (40, 700), (17, 90), (300, 1200), (3, 33)]):
        prompt = Prompt(id=str(i), data_source="gpu", answer="", meta={}, prompt_text="",
                        prompt_ids=torch.randint(10, 500, (prompt_len,), generator=g).tolist(), index=i)
        rollouts.append(Rollout(prompt, i, torch.randint(10, 500, (response_len,), generator=g).tolist(), "", False))
    model = load_model(tiny_text, attention=resolve_attention(kind, "bfloat16"), compute_dtype="bfloat16").cuda()
    assert_packing_adds_no_error(model, load_model(tiny_text).cuda().eval(), rollouts)


def grouped(rollouts, n, seed=0):
    """`n` responses (1 to 700 tokens) to each rollout's prompt, as the engine returns a group."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 700, 33, 128, 2, 511, 64, 9][:n]
    return [Rollout(r.prompt, r.group_id, torch.randint(10, 500, (length,), generator=g).tolist(), "", False)
            for r in rollouts for length in lengths]


@pytest.mark.parametrize("kind", KERNELS)
def test_varlen_shared_prompt_vision_language_forward_equals_per_sample_on_gpu(kind, mixed_rollouts, tiny_vl):
    model = load_model(tiny_vl, attention=resolve_attention(kind, "bfloat16"), compute_dtype="bfloat16").cuda()
    assert_packing_adds_no_error(model, load_model(tiny_vl).cuda().eval(), grouped(mixed_rollouts, 4), share=True)


@pytest.mark.parametrize("kind", KERNELS)
def test_varlen_shared_long_prompt_forward_equals_per_sample_on_gpu(kind, tiny_text):
    """A 900-token prompt with 8 responses (1 to 700 tokens): queries and keys of unequal lengths
    spanning many tiles."""
    g = torch.Generator().manual_seed(1)
    prompt = Prompt(id="long", data_source="gpu", answer="", meta={}, prompt_text="",
                    prompt_ids=torch.randint(10, 500, (900,), generator=g).tolist(), index=0)
    rollouts = grouped([Rollout(prompt, 0, [], "", False)], 8)
    model = load_model(tiny_text, attention=resolve_attention(kind, "bfloat16"), compute_dtype="bfloat16").cuda()
    assert_packing_adds_no_error(model, load_model(tiny_text).cuda().eval(), rollouts, share=True)
