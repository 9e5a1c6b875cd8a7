"""`model.attention: sdpa_segments` (the CPU default of `auto`): a packed micro-batch runs
without a [T, T] mask and matches per-sample forwards and the masked packed backward (fp32)."""

from itertools import accumulate

import pytest
import torch
from transformers import AttentionInterface

import vlrft.models.sdpa_segments as sdpa_segments
from tests.conftest import assert_packed_equals_per_sample
from tests.unit.test_torch_varlen import text_rollouts
from vlrft.models.packing import forward_inputs, pack
from vlrft.models.attention import resolve_attention, uses_varlen
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.sdpa_segments import SDPA_SEGMENTS
from vlrft.types import Rollout


def segments_model(path: str):
    return load_model(path, attention=resolve_attention("sdpa_segments", "float32")).eval()


def test_auto_picks_segments_on_the_cpu_and_packing_sends_sample_starts(tiny_text, addition_data):
    assert resolve_attention("auto", "float32") == SDPA_SEGMENTS == resolve_attention("auto", "bfloat16")
    model = segments_model(tiny_text)
    assert uses_varlen(model.model)
    batch = pack(text_rollouts(tiny_text, addition_data))
    inputs = forward_inputs(model, batch)
    assert "attention_mask" not in inputs and inputs["cu_seq_lens_q"].tolist() == [0, *accumulate(batch.seq_lengths)]


@pytest.fixture
def segment_calls():
    """Counts the decoder calls that reach the per-sample path (sample starts given)."""
    calls = []

    def counting(module, query, *args, cu_seq_lens_q=None, **kwargs):
        calls.append(cu_seq_lens_q is not None)
        return sdpa_segments.sdpa_segments_attention(module, query, *args, cu_seq_lens_q=cu_seq_lens_q, **kwargs)

    AttentionInterface.register(SDPA_SEGMENTS, counting)
    yield calls
    AttentionInterface.register(SDPA_SEGMENTS, sdpa_segments.sdpa_segments_attention)


def test_packed_vision_language_forward_equals_per_sample(mixed_rollouts, tiny_vl, segment_calls):
    assert_packed_equals_per_sample(segments_model(tiny_vl), mixed_rollouts, 1.0, single_model=load_model(tiny_vl).eval())
    assert any(segment_calls) and not all(segment_calls)  # decoder layers split; vision windows go to sdpa


def test_packed_gradients_equal_the_masked_packed_gradients(tiny_text, addition_data):
    first, second, third = text_rollouts(tiny_text, addition_data)
    # Samples of equal length share one batched call: two pairs of them, apart in the pack.
    twin = lambda r: Rollout(r.prompt, r.group_id + 10, [11] * len(r.response_ids), "", False)  # noqa: E731
    rollouts = [first, second, third, twin(second), twin(first)]
    assert len(set(pack(rollouts).seq_lengths)) == 3
    grads = []
    for model in (load_model(tiny_text).eval(), segments_model(tiny_text)):
        batch = pack(rollouts)
        policy_forward(model, batch, 1.0).logp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].shape == grads[1].shape
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * max(1.0, float(grads[0].abs().max()))
