"""TrajectorySaver: every JSONL key and value, image de-duplication, the schedule, and two
processes saving the same step with overlapping images at once."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlrft.trajectory.saver import TrajectorySaver
from vlrft.types import Experience, Prompt, Rollout

KEYS = {
    "step", "rank", "id", "data_source", "group_id", "prompt_text", "images", "response_text", "response_ids",
    "response_tokens", "logprobs", "entropy", "reward", "components", "advantage", "response_length",
    "truncated", "correct",
}


@pytest.fixture(scope="module")
def tokenizer():
    # Imported here so the spawned ranks, which re-import this module, skip transformers.
    from data_tools.tiny_tokenizer import build_tokenizer

    return build_tokenizer()


def solid_image(colour: tuple[int, int, int], size: int = 16) -> Image.Image:
    image = Image.new("RGB", (size, size), colour)
    image.putpixel((1, 2), (colour[2], colour[0], colour[1]))  # not a single flat colour
    return image


def make_experience(tokenizer, prompt_id: str, text: str, images: list, group_id: int = 0, **fields) -> Experience:
    response_ids = tokenizer.encode(text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompt = Prompt(
        id=prompt_id, data_source="color_shapes", answer="red", meta={},
        prompt_text="<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>\n",
        prompt_ids=[1, 2, 3], images=images,
    )
    rollout = Rollout(prompt=prompt, group_id=group_id, response_ids=response_ids, response_text=text, truncated=False)
    return Experience(rollout=rollout, reward=fields.pop("reward", 1.0), reward_components=fields.pop("components", {}),
                      **fields)


def read_lines(path: Path) -> list[dict]:
    def no_constants(name):  # NaN / Infinity are not JSON
        raise AssertionError(f"invalid JSON constant {name} in {path}")

    return [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines()]


def temp_files(run_dir: Path) -> list[Path]:
    return [p for p in (run_dir / "trajectories").rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]


def test_every_key_and_value(tmp_path, tokenizer):
    red, blue = solid_image((200, 10, 10)), solid_image((10, 10, 200))
    first = make_experience(
        tokenizer, "q1", "<answer>red</answer>", [red, blue], group_id=7, reward=1.25,
        components={"accuracy": 1.0, "format": None, "length": [0.1, 0.2, 0.3, 0.4], "judge": 0.5},
        old_logprobs=torch.tensor([-0.1234567891, -1.0, -2.5, float("nan")]),
        advantages=torch.tensor([1.0, 2.0, 3.0, 6.0]),
        entropy=torch.tensor([0.5, float("inf"), 0.25, 1 / 3]),
    )
    second = make_experience(tokenizer, "q2", "blue", [], group_id=8, reward=float("nan"))
    second.rollout.truncated = True
    path = TrajectorySaver(tmp_path, rank=3, tokenizer=tokenizer, save_every=1).save(12, [first, second], [1.0, 0.0])

    assert path == tmp_path / "trajectories" / "step_000012.rank3.jsonl"
    one, two = read_lines(path)
    assert set(one) == KEYS and set(two) == KEYS
    ids = first.rollout.response_ids
    assert one["step"] == 12 and one["rank"] == 3 and one["id"] == "q1" and one["data_source"] == "color_shapes"
    assert one["group_id"] == 7 and one["prompt_text"] == first.rollout.prompt.prompt_text
    assert one["response_text"] == "<answer>red</answer>" and one["response_ids"] == ids
    assert one["response_tokens"] == ["<answer>", "red", "</answer>", "<|im_end|>"]
    assert one["response_tokens"] == [tokenizer.decode([t]) for t in ids] and one["response_length"] == len(ids) == 4
    assert one["logprobs"] == [-0.123457, -1.0, -2.5, None]  # 6 significant digits; NaN -> null
    assert one["entropy"] == [0.5, None, 0.25, 0.333333]
    assert one["reward"] == 1.25 and one["advantage"] == 3.0 and one["correct"] == 1.0
    assert one["components"] == {"accuracy": 1.0, "format": None, "length": 1.0, "judge": 0.5}
    assert one["truncated"] is False
    for image, relative in zip([red, blue], one["images"]):
        assert relative.startswith("images/") and relative.endswith(".png") and len(Path(relative).stem) == 20
        stored = tmp_path / "trajectories" / relative
        assert hashlib.sha256(stored.read_bytes()).hexdigest()[:20] == Path(relative).stem
        with Image.open(stored) as reopened:
            assert reopened.convert("RGB").tobytes() == image.tobytes()
    assert one["images"][0] != one["images"][1]

    assert two["id"] == "q2" and two["images"] == [] and two["reward"] is None and two["truncated"] is True
    assert two["logprobs"] is None and two["entropy"] is None and two["advantage"] == 0.0
    assert two["components"] == {} and two["correct"] == 0.0 and two["response_text"] == "blue"
    assert temp_files(tmp_path) == []


def test_an_image_is_stored_once(tmp_path, tokenizer):
    image = solid_image((20, 200, 20))
    # Four responses to one prompt share the object; another prompt has an equal copy.
    group = [make_experience(tokenizer, "q1", "green", [image]) for _ in range(4)]
    other = make_experience(tokenizer, "q2", "green", [image.copy()])
    saver = TrajectorySaver(tmp_path, rank=0, tokenizer=tokenizer, save_every=1)
    records = read_lines(saver.save(1, group + [other], [1.0] * 5))

    stored = list((tmp_path / "trajectories" / "images").iterdir())
    assert len(stored) == 1 and {r["images"][0] for r in records} == {f"images/{stored[0].name}"}
    inode = stored[0].stat().st_ino
    saver.save(2, [other], [1.0])  # a later step: the existing file is kept, not rewritten
    assert [p.stat().st_ino for p in (tmp_path / "trajectories" / "images").iterdir()] == [inode]


def test_a_different_image_gets_another_file(tmp_path, tokenizer):
    image = solid_image((20, 200, 20))
    changed = image.copy()
    changed.putpixel((0, 0), (0, 0, 0))
    experiences = [make_experience(tokenizer, "q1", "green", [image]), make_experience(tokenizer, "q2", "green", [changed])]
    records = read_lines(TrajectorySaver(tmp_path, 0, tokenizer, 1).save(1, experiences, [1.0, 1.0]))
    assert records[0]["images"] != records[1]["images"]
    assert len(list((tmp_path / "trajectories" / "images").iterdir())) == 2


def test_due_every_n_steps_and_at_the_last(tmp_path, tokenizer):
    every_five = TrajectorySaver(tmp_path, 0, tokenizer, save_every=5)
    assert [s for s in range(1, 13) if every_five.due(s, total_steps=12)] == [5, 10, 12]
    off = TrajectorySaver(tmp_path, 0, tokenizer, save_every=0)
    assert not any(off.due(s, total_steps=12) for s in range(13))


def test_mismatched_correctness_is_an_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="1 correctness values for 2 experiences"):
        TrajectorySaver(tmp_path, 0, tokenizer, 1).save(1, [make_experience(tokenizer, "q", "red", [])] * 2, [1.0])


SHARED_COLOURS = [(i * 9 % 256, i * 37 % 256, i * 71 % 256) for i in range(24)]
STEPS = (1, 2, 3)


class DecodeTable:
    """The tokenizer's single-token texts as a plain dict: the spawned ranks then need not
    import transformers to unpickle a tokenizer (seconds each)."""

    def __init__(self, tokenizer, ids):
        self.texts = {i: tokenizer.decode([i]) for i in ids}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.texts[i] for i in ids)


def rank_experiences(tokenizer, rank: int) -> list[Experience]:
    """Both ranks show the 24 shared images, each in its own order (so the two collide on
    files), plus one image of their own."""
    own = solid_image((255, 255, rank), size=64)
    order = SHARED_COLOURS if rank == 0 else SHARED_COLOURS[::-1]
    return [make_experience(tokenizer, f"q{i}-{rank}", "red", [solid_image(c, size=64), own], group_id=i)
            for i, c in enumerate(order)]


def save_as_rank(run_dir: str, rank: int, tokenizer, experiences: list[Experience], barrier) -> None:
    """Child process: save every step, starting each together with the other rank."""
    saver = TrajectorySaver(Path(run_dir), rank=rank, tokenizer=tokenizer, save_every=1)
    for step in STEPS:
        barrier.wait(timeout=300)
        saver.save(step, experiences, [float(i % 2) for i in range(len(experiences))])


def test_two_ranks_save_the_same_step_concurrently(tmp_path, tokenizer):
    by_rank = [rank_experiences(tokenizer, rank) for rank in (0, 1)]
    table = DecodeTable(tokenizer, by_rank[0][0].rollout.response_ids)
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(2)
    ranks = [spawn.Process(target=save_as_rank, args=(str(tmp_path), rank, table, by_rank[rank], barrier))
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)  # generous: a loaded CI machine imports torch slowly
    for process in ranks:
        if process.is_alive():  # hung (e.g. waiting at the barrier for a crashed peer)
            process.kill()
    assert [p.exitcode for p in ranks] == [0, 0]

    trajectory_dir = tmp_path / "trajectories"
    expected = {(step, rank): f"step_{step:06d}.rank{rank}.jsonl" for step in STEPS for rank in (0, 1)}
    assert sorted(p.name for p in trajectory_dir.glob("*.jsonl")) == sorted(expected.values())
    referenced = set()
    for (step, rank), name in expected.items():
        records = read_lines(trajectory_dir / name)
        assert len(records) == len(SHARED_COLOURS)
        assert {(r["step"], r["rank"]) for r in records} == {(step, rank)}
        referenced |= {image for r in records for image in r["images"]}
    assert len(referenced) == len(SHARED_COLOURS) + 2  # shared ones once, plus one per rank
    assert {f"images/{p.name}" for p in (trajectory_dir / "images").iterdir()} == referenced
    for relative in referenced:
        data = (trajectory_dir / relative).read_bytes()
        assert hashlib.sha256(data).hexdigest()[:20] == Path(relative).stem
        with Image.open(trajectory_dir / relative) as image:
            image.load()  # a truncated PNG fails here
            assert image.size == (64, 64)
    assert temp_files(tmp_path) == []


def test_a_failed_write_leaves_neither_a_partial_file_nor_a_temporary(tmp_path, tokenizer, monkeypatch):
    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("vlrft.trajectory.saver.os.replace", crash)
    experience = make_experience(tokenizer, "q1", "red", [solid_image((1, 2, 3))])
    with pytest.raises(OSError, match="disk full"):
        TrajectorySaver(tmp_path, 0, tokenizer, 1).save(1, [experience], [1.0])
    assert [p for p in (tmp_path / "trajectories").rglob("*") if p.is_file()] == []
