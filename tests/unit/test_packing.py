"""Packed micro-batches: exact against per-sample forwards for text, single- and multi-image
samples of very different lengths in one micro-batch (fp32, max abs diff <= 1e-5)."""

import pytest
import torch

from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.experience.collate import collate, gather_responses
from vlrft.experience.packing import pack, position_ids, split_by_token_budget
from vlrft.models.attention import block_causal_mask
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.value_model import load_value_model, token_values
from vlrft.types import Rollout


def test_block_causal_mask_by_hand():
    mask = block_causal_mask([2, 3])[0, 0].int()
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ])
    assert torch.equal(mask, expected)


def test_split_by_token_budget_sums_lengths():
    class S:  # a sample of a given total length
        def __init__(self, n):
            self.rollout = Rollout(prompt=type("P", (), {"prompt_ids": [0] * n})(), group_id=0, response_ids=[],
                                   response_text="", truncated=False)

    groups = split_by_token_budget([S(4), S(5), S(2), S(12), S(1)], 10)
    assert [[len(s.rollout.prompt.prompt_ids) for s in g] for g in groups] == [[4, 5], [2], [12], [1]]


def test_packed_pixel_inputs_follow_sample_order(mixed_rollouts):
    batch = pack(mixed_rollouts)
    expected = torch.cat([r.prompt.mm_inputs["pixel_values"] for r in mixed_rollouts[1:]])
    assert torch.equal(batch.mm_inputs["pixel_values"], expected)
    assert batch.input_ids.shape == (1, sum(batch.seq_lengths))
    assert int(batch.mm_inputs["mm_token_type_ids"].sum()) == sum(sum(r.prompt.mm_token_types) for r in mixed_rollouts)


def test_packed_positions_restart_per_sample(tiny_text, addition_data):
    encoder = PromptEncoder(tiny_text, 3136, 12544, 512)
    rows = load_rows(addition_data / "train.jsonl")[:2]
    batch = pack([Rollout(encoder.encode(r, i), i, [5] * (i + 1), "", False) for i, r in enumerate(rows)])
    positions = position_ids(load_model(tiny_text).model, batch)[0]
    first = batch.seq_lengths[0]
    assert torch.equal(positions[:first], torch.arange(first)) and positions[first] == 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_forward_equals_per_sample_forward(mixed_rollouts, tiny_vl, temperature):
    model = load_model(tiny_vl).eval()
    with torch.no_grad():
        packed = policy_forward(model, pack(mixed_rollouts), temperature)
        packed_batch = pack(mixed_rollouts)
        packed_logp = gather_responses(packed_batch, packed.logp)
        packed_entropy = gather_responses(packed_batch, packed.entropy)
        for i, rollout in enumerate(mixed_rollouts):
            alone = collate([rollout], pad_id=0)
            single = policy_forward(model, alone, temperature)
            assert (packed_logp[i] - gather_responses(alone, single.logp)[0]).abs().max() <= 1e-5
            assert (packed_entropy[i] - gather_responses(alone, single.entropy)[0]).abs().max() <= 1e-5


def test_packed_critic_values_equal_per_sample(mixed_rollouts, tiny_vl):
    critic = load_value_model(tiny_vl).eval()
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    with torch.no_grad():
        batch = pack(mixed_rollouts)
        packed = gather_responses(batch, token_values(critic, batch))
        for i, rollout in enumerate(mixed_rollouts):
            alone = collate([rollout], pad_id=0)
            single = gather_responses(alone, token_values(critic, alone))[0]
            assert (packed[i] - single).abs().max() <= 1e-5


def test_packed_text_forward_equals_per_sample(tiny_text, addition_data):
    encoder = PromptEncoder(tiny_text, 3136, 12544, 512)
    rows = load_rows(addition_data / "train.jsonl")[:3]
    rollouts = [Rollout(encoder.encode(r, i), i, [7 + i] * n, "", False) for i, (r, n) in enumerate(zip(rows, [1, 30, 9]))]
    model = load_model(tiny_text).eval()
    with torch.no_grad():
        batch = pack(rollouts)
        packed = gather_responses(batch, policy_forward(model, batch, 1.0).logp)
        for i, rollout in enumerate(rollouts):
            alone = collate([rollout], pad_id=0)
            assert (packed[i] - gather_responses(alone, policy_forward(model, alone, 1.0).logp)[0]).abs().max() <= 1e-5
