import json

import pytest

from vlrft.data.dataset import DataError, load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.data.sampler import PromptSampler


def test_missing_image_fails_naming_row_and_path(tmp_path):
    row = {
        "id": "row-17",
        "messages": [{"role": "user", "content": [{"type": "image", "image": "images/nope.png"}]}],
        "answer": "red",
    }
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as err:
        load_rows(tmp_path / "d.jsonl")
    message = str(err.value)
    assert "'row-17'" in message and str(tmp_path / "images" / "nope.png") in message
    assert "\n" not in message


def test_invalid_json_and_missing_field_name_the_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"messages": [], \n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: invalid JSON"):
        load_rows(tmp_path / "bad.jsonl")
    (tmp_path / "nofield.jsonl").write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(DataError, match=r"nofield.jsonl:1 \(row id 'a'\): missing required field 'answer'"):
        load_rows(tmp_path / "nofield.jsonl")


def test_image_prompt_expands_pads_to_patch_count(tiny_vl, colour_data):
    rows = load_rows(colour_data / "train.jsonl")
    encoder = PromptEncoder(tiny_vl, min_pixels=56 * 56, max_pixels=112 * 112, max_prompt_tokens=512)
    prompt = encoder.encode(rows[0], index=5)
    pad = encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = prompt.mm_inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # 56x56 image, 14px patches
    assert prompt.prompt_ids.count(pad) == 4  # 16 patches merged 2x2
    assert prompt.prompt_text.count("<|image_pad|>") == 1  # engines get the unexpanded text
    assert prompt.mm_inputs["pixel_values"].shape[0] == 16
    assert prompt.index == 5 and prompt.answer == rows[0]["answer"]


def test_max_pixels_bounds_the_image_tokens(tiny_vl, colour_data):
    rows = load_rows(colour_data / "train.jsonl")
    small = PromptEncoder(tiny_vl, min_pixels=28 * 28, max_pixels=28 * 28, max_prompt_tokens=512)
    assert small.encode(rows[0], 0).mm_inputs["image_grid_thw"].tolist() == [[1, 2, 2]]


def test_text_prompt_and_prompt_limit(tiny_text, addition_data):
    rows = load_rows(addition_data / "train.jsonl")
    encoder = PromptEncoder(tiny_text, 1, 2, max_prompt_tokens=512)
    prompt = encoder.encode(rows[0], 0)
    assert prompt.mm_inputs == {} and prompt.images == []
    assert encoder.tokenizer.decode(prompt.prompt_ids) == prompt.prompt_text
    with pytest.raises(DataError, match="data.max_prompt_tokens=3"):
        PromptEncoder(tiny_text, 1, 2, max_prompt_tokens=3).encode(rows[0], 0)


def test_sampler_splits_each_step_over_ranks_without_overlap():
    ranks = [PromptSampler(10, 4, rank, 2, seed=3) for rank in range(2)]
    seen = []
    for _ in range(5):  # 20 prompts = two full epochs
        steps = [s.next_indices() for s in ranks]
        assert all(len(s) == 2 for s in steps)
        seen += [pair for s in steps for pair in s]
    positions = [p for p, _ in seen]
    assert sorted(positions) == list(range(20))  # unique stream positions (= group ids)
    first_epoch = sorted(row for p, row in seen if p < 10)
    assert first_epoch == list(range(10))  # every row once per epoch


def test_user_text_joins_the_user_text_parts_only():
    from vlrft.data.dataset import user_text

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What colour?"},
                                     {"type": "text", "text": "One word."}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "Sure?"},
    ]
    assert user_text(messages) == "What colour?\nOne word.\nSure?"
