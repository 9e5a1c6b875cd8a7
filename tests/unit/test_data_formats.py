"""Data sets as they come: parquet files and saved HF data sets (images as bytes and as paths),
read through the column mapping (data.prompt_key, answer_key, image_key, system_prompt,
prompt_template), the same prompts as the JSONL schema gives, and a few training steps on each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlrft.data.columns import Columns, mapped_row
from vlrft.data.dataset import DataError, load_rows, read_rows


def colour_rows(colour_data: Path, split: str = "train") -> list[dict]:
    return [json.loads(line) for line in (colour_data / f"{split}.jsonl").open()]


def as_columns(row: dict, images: str, base: Path, prefix: str = "") -> dict:
    """A colour-task row in a data set's own columns: "problem" with an <image> marker, the
    answer nested (verl's reward_model.ground_truth), the image as bytes or as a path relative
    to the data set (`prefix` + the JSONL's path)."""
    relative = row["messages"][0]["content"][0]["image"]
    image = {"bytes": (base / relative).read_bytes(), "path": None} if images == "bytes" else prefix + relative
    return {
        "id": row["id"],
        "data_source": row["data_source"],
        "problem": "<image>What colour is the shape?",
        "reward_model": {"ground_truth": row["answer"]},
        "pics": [image],
    }


COLUMNS = Columns(prompt_key="problem", answer_key="reward_model.ground_truth", image_key="pics",
                  prompt_template="{prompt} Answer as <answer>colour</answer>.")
OVERRIDES = ["data.prompt_key=problem", "data.answer_key=reward_model.ground_truth", "data.image_key=pics",
             "data.prompt_template='{prompt} Answer as <answer>colour</answer>.'"]


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hf_dataset(rows: list[dict], path: Path, images: str) -> Path:
    import datasets

    features = datasets.Features({
        "id": datasets.Value("string"),
        "data_source": datasets.Value("string"),
        "problem": datasets.Value("string"),
        "reward_model": {"ground_truth": datasets.Value("string")},
        "pics": datasets.Sequence(datasets.Image() if images == "bytes" else datasets.Value("string")),
    })
    columns = {key: [r[key] for r in rows] for key in features}
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(path))
    return path


def test_mapping_by_hand(tmp_path):
    raw = {"q": "Look: <image> and <image>. Which is red?", "sol": {"final": 3}, "imgs": ["a.png", b"\x89PNG"]}
    row = mapped_row(raw, Columns(prompt_key="q", answer_key="sol.final", image_key="imgs", system_prompt="Be brief."),
                     tmp_path)
    assert row == {"answer": 3, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look: "}, {"type": "image", "image": str(tmp_path / "a.png")},
            {"type": "text", "text": " and "}, {"type": "image", "image": b"\x89PNG"},
            {"type": "text", "text": ". Which is red?"}]}]}
    # no marker: the images go first; a template puts the prompt in context, braces kept
    row = mapped_row({"prompt": "2+2?", "answer": "4", "images": {"bytes": b"x", "path": None}},
                     Columns(prompt_template="{prompt} Put it in \\boxed{}."), tmp_path)
    assert row["messages"] == [{"role": "user", "content": [
        {"type": "image", "image": b"x"}, {"type": "text", "text": "2+2? Put it in \\boxed{}."}]}]
    # verl's chat-message prompt column is used as it is
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert mapped_row({"prompt": chat, "answer": "a"}, Columns(system_prompt="ignored"), tmp_path)["messages"] == chat


@pytest.mark.parametrize("raw, problem", [
    ({"answer": "1"}, "no prompt in column 'prompt' (data.prompt_key) and no 'messages'"),
    ({"prompt": "x", "answer": None}, "no answer in column 'answer' (data.answer_key)"),
    ({"prompt": "<image><image>", "answer": "1", "images": ["a.png"]}, "more <image> markers than images (1)"),
    ({"prompt": "x", "answer": "1", "images": [3]}, "an image must be a path, bytes or {'bytes', 'path'}, got int"),
    ({"prompt": 5, "answer": "1"}, "prompt column 'prompt' must be a string or a list of chat messages"),
])
def test_an_unreadable_row_is_one_line_naming_file_row_and_column(tmp_path, raw, problem):
    path = write_parquet([raw], tmp_path / "bad.parquet")
    with pytest.raises(DataError) as err:
        load_rows(path)
    assert str(err.value) == f"{path}:0 (row id '?'): {problem}"
    mixed = tmp_path / "mixed.jsonl"  # the same mapping reads JSONL rows without "messages"
    mixed.write_text(json.dumps(raw) + "\n" + json.dumps({"prompt": "ok", "answer": "1"}) + "\n")
    rows, problems = read_rows(mixed, skip_bad=True)
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": "ok"}]]
    assert problems == [f"{mixed}:1 (row id '?'): {problem}"]


def test_a_missing_image_file_and_a_split_directory_are_named(tmp_path):
    path = write_parquet([{"prompt": "x", "answer": "1", "images": ["nope.png"]}], tmp_path / "d.parquet")
    with pytest.raises(DataError, match=f"image file not found: {tmp_path / 'nope.png'}"):
        load_rows(path)
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["x"], "answer": ["1"]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"holds the splits \['train'\]: point the path at one of them"):
        load_rows(tmp_path / "dd")
    with pytest.raises(DataError, match="not a data set saved with save_to_disk"):
        load_rows(tmp_path)


@pytest.mark.parametrize("form", ["parquet-bytes", "parquet-paths", "hf-bytes", "hf-paths"])
def test_formats_encode_the_same_prompts_as_jsonl(form, tiny_vl, colour_data, tmp_path):
    from vlrft.data.encoding import PromptEncoder

    kind, images = form.split("-")
    canonical = colour_rows(colour_data)[:4]
    if kind == "parquet":  # paths are relative to the file ...
        path = write_parquet([as_columns(r, images, colour_data) for r in canonical], colour_data / f"{tmp_path.name}.parquet")
    else:  # ... or to the data set's directory
        raw = [as_columns(r, images, colour_data, prefix="../") for r in canonical]
        path = write_hf_dataset(raw, colour_data / tmp_path.name, images)
    rows = load_rows(path, COLUMNS)
    expected = load_rows(colour_data / "train.jsonl")[:4]
    encoder = PromptEncoder(tiny_vl, 3136, 12544, 1024)
    for i, (row, reference) in enumerate(zip(rows, expected)):
        assert row["answer"] == reference["answer"] and row["id"] == reference["id"]
        got, want = encoder.encode(row, i), encoder.encode(reference, i)
        assert got.prompt_ids == want.prompt_ids
        torch.testing.assert_close(got.mm_inputs["pixel_values"], want.mm_inputs["pixel_values"], rtol=0, atol=0)
        json.dumps(got.messages)  # recipes and the reward server see JSON-safe messages


@pytest.mark.parametrize("form", ["parquet-bytes", "hf-paths"])
def test_the_colour_task_trains_from_parquet_and_from_an_hf_dataset(form, tiny_vl, colour_data, tmp_path, world_of_one):
    from vlrft.config import load_config
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    from tests.integration.test_torchrun_training import RECIPE

    (tmp_path / "recipe.py").write_text(RECIPE)  # a reward with spread, so the first steps update
    kind, images = form.split("-")
    paths = {}
    for split in ("train", "test"):
        raw = [as_columns(r, images, colour_data, prefix="../" if kind == "hf" else "") for r in colour_rows(colour_data, split)]
        name = f"{tmp_path.name}-{split}"
        paths[split] = (write_parquet(raw, colour_data / f"{name}.parquet") if kind == "parquet"
                        else write_hf_dataset(raw, colour_data / name, images))
    cfg = load_config(None, [
        f"model.path={tiny_vl}", f"data.train_path={paths['train']}", f"data.eval_path={paths['test']}",
        "rollout.rollout_prompts=2", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6",
        "train.total_steps=2", "train.lr=0.001", f"reward.default=[{{recipe: '{tmp_path / 'recipe.py'}:distinct_chars'}}]", "eval.every_steps=2",
        f"output.dir={tmp_path / 'run'}", *OVERRIDES,
    ])
    trainer = SPMDTrainer(cfg)
    assert len(trainer.train_rows) == 48
    before = [p.detach().clone() for p in trainer.backend.module.parameters()]
    history = trainer.train()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.backend.module.parameters()))
    assert [step for step, _ in history] == [0, 2] and all(0.0 <= accuracy <= 1.0 for _, accuracy in history)
