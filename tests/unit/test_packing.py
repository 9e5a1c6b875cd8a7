"""Packed micro-batches: exact against per-sample forwards for text, single- and multi-image
samples of very different lengths in one micro-batch (fp32, max abs diff <= 1e-5)."""

import pytest
import torch

from tests.conftest import assert_packed_equals_per_sample

from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.models.collate import collate, gather_responses
from vlrft.models.packing import pack, position_ids, split_by_token_budget
from vlrft.models.attention import block_causal_mask
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.value_model import load_value_model, token_values
from vlrft.types import Prompt, Rollout


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


class S:  # a sample of a given total length
    def __init__(self, n, mm_inputs=None):
        prompt = Prompt("p", "src", "", {}, "", list(range(1, n + 1)), mm_inputs=mm_inputs or {})
        self.rollout = Rollout(prompt=prompt, group_id=0, response_ids=[], response_text="", truncated=False)


def lengths(groups) -> list[list[int]]:
    return [[len(s.rollout.prompt.prompt_ids) for s in g] for g in groups]


def test_split_by_token_budget_is_first_fit_decreasing():
    # Longest first: 12 alone (over budget), 5 opens a group, 4 joins it (9), 2 does not fit
    # (11) and opens a third, 1 fills the second to 10. Groups keep the input order.
    assert lengths(split_by_token_budget([S(4), S(5), S(2), S(12), S(1)], 10)) == [[12], [4, 5, 1], [2]]
    # A consecutive split would need 4 micro-batches here: [6], [6], [4, 4], [4] -> FFD: 3.
    assert lengths(split_by_token_budget([S(6), S(4), S(6), S(4), S(4)], 10)) == [[6, 4], [6, 4], [4]]


def test_micro_batches_even_out_the_count_with_one_token_dummies(monkeypatch):
    import vlrft.models.packing as packing

    monkeypatch.setattr(packing, "all_reduce_max_int", lambda n: n + 2)  # a peer has two micro-batches more
    batches = packing.micro_batches([S(4), S(9)], 10)
    assert [b.dummy for b in batches] == [False, False, True, True]
    for dummy in batches[2:]:  # the shortest prompt's first token, an empty response, out of the loss
        assert dummy.input_ids.tolist() == [[1]] and dummy.response_mask.sum() == 0
        assert not dummy.samples[0].in_loss and dummy.samples[0].advantages.numel() == 0
    image = {"pixel_values": torch.zeros(16, 8), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    vl_dummy = packing.micro_batches([S(7, image), S(9, image)], 100)[-1]  # images dropped too (models/vision_calls.py)
    assert vl_dummy.input_ids.tolist() == [[1]] and vl_dummy.mm_inputs == {}
    monkeypatch.setattr(packing, "all_reduce_max_int", lambda n: 1)  # this rank has none, a peer has one
    (placeholder_dummy,) = packing.micro_batches([], 10, placeholder=S(3))
    assert placeholder_dummy.dummy and placeholder_dummy.input_ids.tolist() == [[1]]
    with pytest.raises(ValueError, match="needs a placeholder"):
        packing.micro_batches([], 10)


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
    assert_packed_equals_per_sample(load_model(tiny_vl).eval(), mixed_rollouts, temperature)


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


def test_packed_mrope_positions_equal_the_models_own_per_sample(mixed_rollouts, tiny_vl):
    # The prompt's ids come from the model's function once per prompt; the response continues
    # them. Check against the function run on each whole sequence (prompt + response).
    backbone = load_model(tiny_vl).model
    rollouts = mixed_rollouts + [Rollout(mixed_rollouts[1].prompt, 9, [5, 6, 7], "", False)]  # a shared prompt
    batch = pack(rollouts)
    expected = []
    for r in rollouts:
        ids = torch.tensor(r.prompt.prompt_ids + r.response_ids)[None]
        types = torch.tensor((r.prompt.mm_token_types or [0] * len(r.prompt.prompt_ids)) + [0] * len(r.response_ids))
        positions, _ = backbone.get_rope_index(ids, image_grid_thw=r.prompt.mm_inputs.get("image_grid_thw"),
                                               attention_mask=torch.ones_like(ids), mm_token_type_ids=types[None])
        expected.append(positions)
    assert torch.equal(position_ids(backbone, batch), torch.cat(expected, dim=-1))
    assert len(mixed_rollouts[1].prompt.rope_positions) == 1  # computed once, reused
