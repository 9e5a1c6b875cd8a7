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
def untied_text(tiny_text, tmp_path_factory):
    """tiny_text with an LM head of its own (a copy of the embedding, untied): the shape of the
    7B-and-larger checkpoints, whose head a weight sync must send as a tensor of its own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_text)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    out = tmp_path_factory.mktemp("untied_text")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_text).save_pretrained(out)
    return str(out)


def one_thread_build(build, out_dir, warmup_steps: int) -> str:
    """A warmed tiny model built on one thread, as the make_tiny_model CLI does (same weights
    every run, no thread spinning)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return str(build(out_dir, warmup_steps=warmup_steps))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def warm_text(tmp_path_factory):
    """A briefly format-warmed tiny text model (~4 s): it answers "<answer>N</answer>" or
    "</answer>", so the judge's parse sees both numbers and no number (the untrained
    tiny_text only emits newlines -> always None)."""
    from data_tools.make_tiny_model import build_text_model

    return one_thread_build(build_text_model, tmp_path_factory.mktemp("warm_text"), 30)


@pytest.fixture(scope="session")
def warm_vl(tmp_path_factory):
    """A briefly warmed tiny VL model (~10 s): it answers "<answer>colour</answer>" and stops, so
    multi-turn rollouts get past their first turn."""
    from data_tools.make_tiny_model import build_vl_model

    return one_thread_build(build_vl_model, tmp_path_factory.mktemp("warm_vl"), 30)


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


def pytest_sessionfinish(session, exitstatus):
    """In-process tests leave a gloo group (world_of_one, trainers built in the test process):
    destroyed here, since one left to interpreter finalisation can abort pytest."""
    from vlrft.distributed import shutdown_distributed

    shutdown_distributed()


@pytest.fixture(scope="session")
def vl_models(tiny_vl, tmp_path_factory):
    """family -> a tiny checkpoint of that VL family (data_tools.make_tiny_model.VL_FAMILIES),
    built on first use; Qwen3-VL has deepstack features and interleaved M-RoPE."""
    from data_tools.make_tiny_model import build_vl_model

    built = {"qwen2.5-vl": tiny_vl}

    def model_of(family: str) -> str:
        if family not in built:
            built[family] = str(build_vl_model(tmp_path_factory.mktemp(family), warmup_steps=0, family=family))
        return built[family]

    return model_of


@pytest.fixture(scope="session")
def video_data(colour_data, tmp_path_factory):
    """The colour task's train and test rows plus rows whose prompt is a 3-frame video of
    colour images (as frame files, fps 1), every other one with an image too: the answer is the
    first frame's colour. {split}_videos.jsonl holds only the video rows."""
    import json
    import shutil

    from vlrft.data.dataset import load_rows

    out = tmp_path_factory.mktemp("video")
    shutil.copytree(colour_data / "images", out / "images")  # rows may name only files inside their data set
    for split in ("train", "test"):
        shutil.copy(colour_data / f"{split}.jsonl", out)
    for split in ("train", "test"):
        rows = load_rows(out / f"{split}.jsonl")
        frames = [r["messages"][0]["content"][0]["image"] for r in rows]
        videos = [
            {"id": f"video-{split}-{k}", "data_source": "video", "answer": rows[k]["answer"], "messages": [{"role": "user", "content": [
                {"type": "video", "video": frames[k : k + 3], "fps": 1.0},
                *([{"type": "image", "image": frames[k + 3]}] if k % 4 else []),
                {"type": "text", "text": "What colour is the shape in the first frame?"}]}]}
            for k in range(0, len(rows) - 3, 2)
        ]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + videos))
        (out / f"{split}_videos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in videos))
    return out


def make_mixed_rollouts(model_path, colour_data, root):
    """A text-only, a single-image and a two-image prompt (one image 4x larger), with
    responses of 1, 12 and 25 tokens."""
    import json

    import torch
    from PIL import Image

    from vlrft.data.dataset import load_rows
    from vlrft.data.encoding import PromptEncoder
    from vlrft.data.media import MediaPaths
    from vlrft.types import Rollout

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
    encoder = PromptEncoder(model_path, 56 * 56, 112 * 112, 512)
    in_colours = MediaPaths(roots=(str(colour_data),))  # rows.jsonl names the colour task's images
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(root / "rows.jsonl", media=in_colours))]
    assert [p.mm_inputs.get("image_grid_thw", torch.zeros(0, 3)).shape[0] for p in prompts] == [0, 1, 2]
    g = torch.Generator().manual_seed(0)
    return [
        Rollout(p, i, torch.randint(10, 600, (n,), generator=g).tolist(), "", False)
        for i, (p, n) in enumerate(zip(prompts, [1, 12, 25]))
    ]


@pytest.fixture(scope="session")
def mixed_rollouts(tiny_vl, colour_data, tmp_path_factory):
    return make_mixed_rollouts(tiny_vl, colour_data, tmp_path_factory.mktemp("multi"))


def assert_packed_equals_per_sample(model, rollouts, temperature: float, single_model=None):
    """Logprobs and entropy of `rollouts` packed into one micro-batch equal each one's own
    forward (by `single_model`, default the same model) to 1e-5."""
    import torch

    from vlrft.models.collate import collate, gather_responses
    from vlrft.models.forward import policy_forward
    from vlrft.models.packing import pack

    with torch.no_grad():
        batch = pack(rollouts)
        out = policy_forward(model, batch, temperature)
        logp, entropy = gather_responses(batch, out.logp), gather_responses(batch, out.entropy)
        for i, rollout in enumerate(rollouts):
            alone = collate([rollout], pad_id=0)
            single = policy_forward(single_model or model, alone, temperature)
            assert (logp[i] - gather_responses(alone, single.logp)[0]).abs().max() <= 1e-5
            assert (entropy[i] - gather_responses(alone, single.entropy)[0]).abs().max() <= 1e-5
