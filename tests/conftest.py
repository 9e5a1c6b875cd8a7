"""Shared fixtures: tiny offline checkpoints and synthetic datasets, built once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory):
    from data_tools.make_tiny_model import build_vl_model

    return str(build_vl_model(tmp_path_factory.mktemp("tiny_vl"), warmup_steps=0))


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory):
    from data_tools.make_tiny_model import build_text_model

    return str(build_text_model(tmp_path_factory.mktemp("tiny_text"), warmup_steps=0))


@pytest.fixture(scope="session")
def colour_data(tmp_path_factory):
    from data_tools.synth_shapes import write_colour_task

    out = tmp_path_factory.mktemp("colours")
    write_colour_task(out, n_train=48, n_test=8, seed=0)
    return out


@pytest.fixture(scope="session")
def addition_data(tmp_path_factory):
    from data_tools.synth_shapes import write_addition_task

    out = tmp_path_factory.mktemp("addition")
    write_addition_task(out, n_train=48, n_test=8, seed=0)
    return out


@pytest.fixture(scope="session")
def world_of_one():
    """A one-rank gloo process group, as a plain `python` run of the trainer creates."""
    from vlrft.distributed import init_distributed

    return init_distributed()


@pytest.fixture(scope="session")
def mixed_rollouts(tiny_vl, colour_data, tmp_path_factory):
    """A text-only, a single-image and a two-image prompt (one image 4x larger), with
    responses of 1, 12 and 25 tokens."""
    import json

    import torch
    from PIL import Image

    from vlrft.data.dataset import load_rows
    from vlrft.data.encoding import PromptEncoder
    from vlrft.types import Rollout

    root = tmp_path_factory.mktemp("multi")
    Image.new("RGB", (112, 112), (200, 30, 30)).save(root / "big.png")
    first = load_rows(colour_data / "train.jsonl")[0]
    small = first["messages"][0]["content"][0]["image"]
    rows = [
        {"id": "text", "data_source": "t", "answer": "4", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        first,
        {"id": "two", "data_source": "t", "answer": "red", "messages": [{"role": "user", "content": [
            {"type": "image", "image": small}, {"type": "image", "image": str(root / "big.png")},
            {"type": "text", "text": "Which colours?"}]}]},
    ]
    rows[2]["messages"][0]["content"][0]["image"] = str(colour_data / small)
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(root / "rows.jsonl"))]
    assert [p.mm_inputs.get("image_grid_thw", torch.zeros(0, 3)).shape[0] for p in prompts] == [0, 1, 2]
    g = torch.Generator().manual_seed(0)
    return [
        Rollout(p, i, torch.randint(10, 600, (n,), generator=g).tolist(), "", False)
        for i, (p, n) in enumerate(zip(prompts, [1, 12, 25]))
    ]
