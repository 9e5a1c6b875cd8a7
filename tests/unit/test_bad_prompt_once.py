"""A training prompt that fails to encode is named and counted once per run, then left out of
every later draw on every rank (trainer/bad_input.py, `BadInput.draw`); the sampler's stream is
untouched, so resuming stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

import vlrft.trainer.bad_input as bad_input_module
from vlrft.config import load_config
from vlrft.data.dataset import DataError
from vlrft.data.sampler import PromptSampler
from vlrft.trainer.bad_input import BadInput


def image_row(row_id: str, image: str) -> dict:
    return {"id": row_id, "answer": "red", "messages": [{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": "colour?"}]}]}


def test_a_bad_prompt_is_skipped_once_per_run(tiny_vl, world_of_one, tmp_path, capsys):
    """Two rows, both drawn at every step: the bad one is named and counted at step 1 only."""
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    Image.new("RGB", (56, 56), (200, 0, 0)).save(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"not a PNG file")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in [image_row("good", "good.png"), image_row("bad", "bad.png")]))
    trainer = SPMDTrainer(load_config(None, [
        f"model.path={tiny_vl}", f"data.train_path={train}", f"output.dir={tmp_path / 'run'}",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=2", "eval.every_steps=0",
        "rollout.rollout_prompts=2", "data.on_bad_sample=skip", "train.total_steps=4"]))
    skipped = [trainer.train_step()["data/skipped_prompts"] for _ in range(4)]
    assert skipped == [1.0, 0.0, 0.0, 0.0]
    lines = [line for line in capsys.readouterr().out.splitlines() if "row id 'bad'" in line]
    assert lines == [f"vlrft: skipping row id 'bad': cannot read image {tmp_path / 'bad.png'} "
                     "(cannot identify image file as PNG, JPEG or WEBP, the image formats read) (on_bad_sample: skip)"]
    assert trainer.bad_input.dropped_rows == {1} and trainer.sampler.consumed == 8  # the stream went on as ever
    trainer.save_checkpoint()
    resumed = SPMDTrainer(load_config(None, [  # the same run, resumed: the row stays dropped, unnamed
        f"model.path={tiny_vl}", f"data.train_path={train}", f"output.dir={tmp_path / 'run'}",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=2", "eval.every_steps=0",
        "rollout.rollout_prompts=2", "data.on_bad_sample=skip", "train.total_steps=6"]))
    assert resumed.bad_input.dropped_rows == {1} and resumed.global_step == 4
    assert [resumed.train_step()["data/skipped_prompts"] for _ in range(2)] == [0.0, 0.0]
    assert "row id 'bad'" not in capsys.readouterr().out


class EncoderDouble:
    """Encodes a row to its id, or raises DataError for ids in `bad`; counts each row's tries."""

    def __init__(self, bad: set[str]):
        self.bad = bad
        self.tries: dict[str, int] = {}

    def encode(self, row: dict, index: int):
        self.tries[row["id"]] = self.tries.get(row["id"], 0) + 1
        if row["id"] in self.bad:
            raise DataError(f"row id {row['id']!r}: cannot read image")
        return row["id"]


def test_a_row_another_rank_dropped_is_never_tried_here(monkeypatch, capsys):
    """Rank 0 of two: rank 1 reports a failure on a row of its share (the collectives are
    doubles standing for rank 1); rank 0 drops that row too, and never encodes it when later
    epochs hand it to rank 0."""
    rows = [{"id": f"r{i}"} for i in range(4)]
    sampler = PromptSampler(len(rows), 4, rank=0, world_size=2, seed=0)
    theirs = [row for _, row in PromptSampler(len(rows), 4, rank=1, world_size=2, seed=0).next_indices()][0]
    monkeypatch.setattr(bad_input_module, "all_reduce_sum", lambda failed: failed + torch.tensor([0.0, 1.0]))
    monkeypatch.setattr(bad_input_module, "all_gather_1d", lambda mine: torch.cat([mine, torch.tensor([theirs])]))
    bad_input, encoder = BadInput("skip", 0, 2), EncoderDouble(bad=set())
    prompts, skipped = bad_input.draw(encoder, sampler, rows)
    assert skipped == 1 and len(prompts) == 2 and bad_input.dropped_rows == {theirs}
    monkeypatch.setattr(bad_input_module, "all_reduce_sum", lambda failed: failed)  # no failures from here on
    reference = PromptSampler(len(rows), 4, rank=0, world_size=2, seed=0)
    reference.next_indices()
    handed_here = 0
    for _ in range(8):  # epochs, some of which hand that row to rank 0
        indices = [row for _, row in reference.next_indices()]
        handed_here += theirs in indices
        assert bad_input.draw(encoder, sampler, rows) == ([f"r{row}" for row in indices if row != theirs], 0)
    assert handed_here and f"r{theirs}" not in encoder.tries and capsys.readouterr().out == ""
    assert sampler.consumed == reference.consumed


def test_a_run_whose_every_row_fails_stops_in_one_line(monkeypatch):
    rows = [{"id": "a"}, {"id": "b"}]
    bad_input = BadInput("skip", 0, 1)
    with pytest.raises(DataError, match=r"^every training row \(2\) failed to encode and was dropped; nothing to train on$"):
        bad_input.draw(EncoderDouble(bad={"a", "b"}), PromptSampler(2, 2, 0, 1, seed=0), rows)


def test_under_error_a_bad_prompt_still_stops_the_run(world_of_one):
    bad_input = BadInput("error", 0, 1)
    with pytest.raises(DataError, match=r"^row id 'b': cannot read image$"):
        bad_input.draw(EncoderDouble(bad={"b"}), PromptSampler(2, 2, 0, 1, seed=0), [{"id": "a"}, {"id": "b"}])
    assert bad_input.dropped_rows == set()
