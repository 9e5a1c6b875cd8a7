"""Shared-prompt micro-batches (`train.share_prompts`): a group's prompt and its images enter a
micro-batch once, followed by its responses. Per-token logprobs, entropies and values, and the
parameter gradients, equal the unshared layout's (fp32, 1e-5) for text, one image, two images,
video, Qwen3-VL and multi-turn observation images, under each CPU attention form."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import vlrft.models.torch_varlen as torch_varlen
from tests.reference_flash import reference_flash  # noqa: F401 (fixture)
from tests.conftest import make_mixed_rollouts
from tests.unit.test_model_families import frames, video_rollouts  # noqa: F401  (frames: a fixture)
from tests.unit.test_torch_varlen import ReferenceVarlen, text_rollouts
from vlrft.models.attention import block_causal_mask, resolve_attention, varlen_kwargs
from vlrft.models.collate import gather_responses
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.packing import micro_batches, pack, position_ids, predictor_rows, split_by_token_budget
from vlrft.models.value_model import ValueModel, token_values
from vlrft.types import Rollout


def groups_of(rollouts: list[Rollout], n: int, seed: int = 0) -> list[Rollout]:
    """n responses of different lengths (one of them empty in the first group) to each rollout's prompt, interleaved
    across prompts as an engine returns them in no particular order."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        for i, r in enumerate(rollouts):
            length = 0 if (i, k) == (0, 1) else int(torch.randint(1, 14, (1,), generator=g))
            out.append(Rollout(r.prompt, r.group_id, torch.randint(10, 600, (length,), generator=g).tolist(), "", False))
    return out


def run(model, batch, temperature, critic=None, backward=False, weights=None):
    """Per sample (by identity): logprobs, entropies, values; and the gradient of a sum of
    them weighted per sample (`weights`, by identity) and per response position, when `backward`."""
    out = policy_forward(model, batch, temperature)
    values = token_values(critic, batch) if critic is not None else None
    logp, entropy = gather_responses(batch, out.logp), gather_responses(batch, out.entropy)
    vals = gather_responses(batch, values) if values is not None else [None] * len(logp)
    found, loss = {}, 0.0
    for sample, *rows in zip(batch.samples, logp, entropy, vals):
        found[id(sample)] = [None if r is None else r.detach() for r in rows]
        position = torch.linspace(0.5, 1.5, len(rows[0]))
        loss = loss + weights[id(sample)] * sum((r * position).sum() for r in rows if r is not None)
    if backward:
        loss.backward()
    return found


def largest(difference: torch.Tensor) -> float:
    return float(difference.abs().max()) if difference.numel() else 0.0


def gradients(*models) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for m in models if m is not None for p in m.parameters() if p.grad is not None])


def assert_shared_equals_unshared(model_path, rollouts, temperature=0.8, attention="sdpa_segments", critic=True, backward=True):
    results, grads = [], []
    weights = {id(r): 1.0 + 0.1 * i for i, r in enumerate(rollouts)}
    for share in (False, True):
        torch.manual_seed(0)
        model = load_model(model_path, attention=resolve_attention(attention, "float32")).eval()
        value_model = None
        if critic:
            value_model = ValueModel(load_model(model_path, attention=resolve_attention(attention, "float32"))).eval()
            torch.nn.init.normal_(value_model.value_head.weight, std=0.1)
        batch = pack(rollouts, share=share)
        assert batch.shares_prompts() == share
        with torch.set_grad_enabled(backward):
            results.append(run(model, batch, temperature, value_model, backward, weights))
        if backward:
            grads.append(gradients(model, value_model))
    unshared, shared = results
    assert unshared.keys() == shared.keys() == {id(r) for r in rollouts}
    for key, rows in unshared.items():
        for name, a, b in zip(("logprobs", "entropy", "values"), rows, shared[key]):
            if a is not None:
                assert a.shape == b.shape and largest(a - b) <= 1e-5, name
    if backward:
        assert grads[0].shape == grads[1].shape and grads[0].norm() > 0
        rel = float((grads[1] - grads[0]).norm() / grads[0].norm())
        assert rel <= 1e-5, f"relative gradient difference {rel:.2e}"


# ------------------------------------------------------------------------------------ layout


def test_a_group_packs_its_prompt_once_then_each_response(tiny_text, addition_data):
    first, second, third = text_rollouts(tiny_text, addition_data)
    a1, a2 = first, Rollout(first.prompt, 0, [5, 6], "", False)
    empty = Rollout(first.prompt, 0, [], "", False)
    batch = pack([a1, second, a2, empty], share=True)
    p0, p1 = len(first.prompt.prompt_ids), len(second.prompt.prompt_ids)
    # Groups in order of first appearance, each in input order; the empty response has no segment.
    assert batch.samples == [a1, a2, empty, second]
    assert batch.seq_lengths == [p0, 1, 2, p1 + 30]
    assert [s.parent for s in batch.segments] == [-1, 0, 0, -1]
    assert batch.input_ids[0].tolist() == first.prompt.prompt_ids + a1.response_ids + [5, 6] + second.prompt.prompt_ids + second.response_ids
    assert batch.response_mask[0].tolist() == [0] * p0 + [1, 1, 1] + [0] * p1 + [1] * 30
    rows = predictor_rows(batch)[0].tolist()
    assert rows[p0] == p0 - 1 and rows[p0 + 1] == p0 - 1 and rows[p0 + 2] == p0 + 1  # both responses read the prompt's end
    assert rows[p0 + 3] == p0 + 2  # the next sequence's first token (never scored)
    # Each response's positions continue its prompt's, as after its own copy of the prompt.
    positions = position_ids(load_model(tiny_text).model, batch)[0].tolist()
    assert positions == list(range(p0)) + [p0] + [p0, p0 + 1] + list(range(p1 + 30))
    # The unshared layout is unchanged: one segment per sample.
    plain = pack([a1, second, a2, empty])
    assert [s.parent for s in plain.segments] == [-1] * 4 and plain.samples == [a1, second, a2, empty]


def test_shared_masks_and_varlen_keys_match_a_hand_written_layout():
    # Segments: prompt A (3), its responses (2, 1), a whole sequence (2).
    lengths, parents = [3, 2, 1, 2], [-1, 0, 0, -1]
    mask = block_causal_mask(lengths, parents=parents)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # response 1 sees the prompt and itself
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0],  # response 2 sees the prompt and itself, never response 1
        [0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 1, 1],
    ]
    kwargs = varlen_kwargs(lengths, parents)
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 8]
    assert kwargs["cu_seq_lens_k"].tolist() == [0, 3, 8, 12, 14]
    assert kwargs["shared_key_index"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7]
    assert (kwargs["max_length_q"], kwargs["max_length_k"]) == (3, 5)
    assert "shared_key_index" not in varlen_kwargs(lengths, [-1] * 4)


def test_the_token_budget_counts_a_shared_prompt_once_and_splits_a_large_group(tiny_text, addition_data):
    first, second, _ = text_rollouts(tiny_text, addition_data)
    p = len(first.prompt.prompt_ids)
    group = [Rollout(first.prompt, 0, [9] * 10, "", False) for _ in range(4)]
    assert [len(b) for b in split_by_token_budget(group, p + 40, share=True)] == [4]  # P + 4 x 10 fits
    assert [len(b) for b in split_by_token_budget(group, p + 40)] == [1, 1, 1, 1]  # unshared: 4 x (P + 10)
    runs = split_by_token_budget(group, p + 25, share=True)  # P + 2 x 10 per run: the prompt in each
    assert [len(b) for b in runs] == [2, 2]
    batches = micro_batches(group, p + 25, share=True)
    assert [b.seq_lengths for b in batches] == [[p, 10, 10]] * 2
    # A prompt outside the run's stream (index < 0) or with other pixels is never shared.
    outside = [Rollout(replace(first.prompt, index=-1), 0, [9], "", False) for _ in range(2)]
    assert not pack(outside, share=True).shares_prompts()


def test_a_prompt_with_other_pixels_under_the_same_index_is_not_shared(mixed_rollouts):
    image = mixed_rollouts[1].prompt
    other = replace(image, mm_inputs={**image.mm_inputs, "pixel_values": image.mm_inputs["pixel_values"] + 1})
    batch = pack([Rollout(image, 0, [5], "", False), Rollout(other, 0, [6], "", False)], share=True)
    assert not batch.shares_prompts()


# ------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("attention", ["sdpa_segments", "sdpa"])
def test_text_groups_match_the_unshared_forward_and_backward(tiny_text, addition_data, attention):
    rollouts = groups_of(text_rollouts(tiny_text, addition_data), 3)
    assert_shared_equals_unshared(tiny_text, rollouts, attention=attention)


def test_full_vocabulary_logits_are_those_of_each_tokens_predictor(tiny_text, addition_data):
    """The exact KL keeps all logits: [:, p-1] is the distribution of token p in both layouts."""
    rollouts = groups_of(text_rollouts(tiny_text, addition_data), 2)
    model = load_model(tiny_text, attention=resolve_attention("auto", "float32")).eval()
    kept = {}
    with torch.no_grad():
        for share in (False, True):
            batch = pack(rollouts, share=share)
            out = policy_forward(model, batch, 1.0, keep_logits=True)
            per_token = F.pad(out.logits.log_softmax(-1).exp().max(-1).values, (1, 0))  # [1, T] a function of each token's logits
            kept[share] = {id(s): row for s, row in zip(batch.samples, gather_responses(batch, per_token))}
            for s, a, b in zip(batch.samples, gather_responses(batch, out.logp), gather_responses(batch, policy_forward(model, batch, 1.0).logp)):
                assert largest(a - b) <= 1e-5
    for key, row in kept[False].items():
        assert largest(row - kept[True][key]) <= 1e-5


def test_image_groups_match_and_the_vision_tower_sees_each_image_once(tiny_vl, colour_data, tmp_path):
    rollouts = groups_of(make_mixed_rollouts(tiny_vl, colour_data, tmp_path), 3)
    assert_shared_equals_unshared(tiny_vl, rollouts, critic=True)
    patches = {share: int(pack(rollouts, share=share).mm_inputs["pixel_values"].shape[0]) for share in (False, True)}
    assert patches[False] == 3 * patches[True]  # n = 3: the tower's work / n


def test_dense_mask_image_groups_match(tiny_vl, colour_data, tmp_path):
    rollouts = groups_of(make_mixed_rollouts(tiny_vl, colour_data, tmp_path), 2)
    assert_shared_equals_unshared(tiny_vl, rollouts, attention="sdpa", critic=False)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_video_groups_match(family, vl_models, frames, tmp_path):  # noqa: F811
    _, rollouts = video_rollouts(vl_models(family), frames, tmp_path)
    assert_shared_equals_unshared(vl_models(family), groups_of(rollouts, 2), critic=family == "qwen3-vl")


def test_qwen3_vl_image_groups_match(vl_models, colour_data, tmp_path):
    path = vl_models("qwen3-vl")
    assert_shared_equals_unshared(path, groups_of(make_mixed_rollouts(path, colour_data, tmp_path), 3), critic=False)


@pytest.mark.parametrize("attention", ["torch_varlen", "flash_attention_2"])
def test_varlen_kernels_get_each_segments_keys(attention, tiny_text, addition_data, monkeypatch, reference_flash):
    """On the CPU references with the kernels' signatures stand in for the CUDA kernels (the real
    ones: tests/gpu/test_flash_packing.py): PyTorch's varlen_attn and flash-attn's varlen function."""
    monkeypatch.setattr(torch_varlen, "varlen_attn", ReferenceVarlen(shared_keys=True))
    rollouts = groups_of(text_rollouts(tiny_text, addition_data), 3)
    reference = load_model(tiny_text, attention=resolve_attention("sdpa_segments", "float32")).eval()
    model = load_model(tiny_text).eval()
    model.config._attn_implementation = resolve_attention("torch_varlen", "bfloat16") if attention == "torch_varlen" else attention
    model.model.config._attn_implementation = model.config._attn_implementation
    with torch.no_grad():
        batch = pack(rollouts, share=True)
        expected = gather_responses(batch, policy_forward(reference, batch, 1.0).logp)
        if attention == "flash_attention_2":
            from vlrft.models.packing import forward_inputs

            assert "shared_key_index" in forward_inputs(model.model, batch)
        got = gather_responses(batch, policy_forward(model, batch, 1.0).logp)
    for a, b in zip(expected, got):
        assert largest(a - b) <= 1e-5
    if attention == "flash_attention_2":  # flash-attn ran every decoder layer, with the segment starts
        assert reference_flash.kernels_seen("varlen").count([0, *torch.tensor(batch.seq_lengths).cumsum(0).tolist()]) \
            == model.config.num_hidden_layers


@pytest.mark.parametrize("implementation", ["flex_attention", "eager", "flash_attention_3"])
def test_an_attention_that_cannot_read_the_layout_is_refused(implementation, tiny_text, addition_data):
    """flex would drop the block mask, eager would add the boolean mask as numbers, another flash
    kernel would ignore the gathered keys: each is refused in one line."""
    rollouts = groups_of(text_rollouts(tiny_text, addition_data), 2)
    model = load_model(tiny_text).eval()
    model.config._attn_implementation = model.model.config._attn_implementation = implementation
    with pytest.raises(ValueError, match=f"^train.share_prompts: attention '{implementation}' cannot run a shared-prompt"):
        policy_forward(model, pack(rollouts, share=True), 1.0)
