"""The zoom example (examples/zoom): its data, its environment, and its warm-up prompts, which
are token for token the conversation a multi-turn rollout builds."""

import numpy as np
import pytest
from PIL import Image

from data_tools.synth_shapes import _BASE_RGB, _COLOUR_JITTER, write_zoom_task
from data_tools.zoom_warmup import PIXELS, ZOOM, ZOOMED, zoom_prompts
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.multiturn.environment import as_step, resolve_environment
from vlrft.multiturn.template import observation_template

ENVIRONMENT = "examples/zoom/zoom_env.py:CentreZoom"


@pytest.fixture(scope="module")
def zoom_data(tmp_path_factory):
    return write_zoom_task(tmp_path_factory.mktemp("zoom"), n_train=8, n_test=4)


def test_the_crop_shows_the_answer_and_the_environment_zooms_once(zoom_data, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).parents[2])  # the example names its environment from the repository root
    env = resolve_environment(ENVIRONMENT)()
    for row in load_rows(zoom_data / "train.jsonl"):
        env.reset({"meta": row["meta"], "answer": row["answer"]})
        assert as_step(env.step("<answer>red</answer>")).done  # an answer ends the trajectory
        env.reset({"meta": row["meta"]})
        zoomed = as_step(env.step(ZOOM))
        assert not zoomed.done and zoomed.observation == ZOOMED and len(zoomed.images) == 1
        crop = np.asarray(zoomed.images[0], dtype=int)  # [8, 8, 3]: the mark, nothing else
        assert crop.shape == (8, 8, 3) and (np.abs(crop - _BASE_RGB[row["answer"]]) <= _COLOUR_JITTER).all()
        assert Image.open(row["meta"]["full_image"]).size == (224, 224)
        assert as_step(env.step(ZOOM)).done  # one zoom per trajectory


def test_warmup_prompts_are_the_rollouts_conversation(tiny_vl, tmp_path):
    """The after-crop prompt the warm-up trains on = the row's prompt + "<zoom>" + end of turn +
    the observation a multi-turn rollout appends (the crop's image part and the text)."""
    encoder = PromptEncoder(tiny_vl, PIXELS, PIXELS, 512)
    first, after = zoom_prompts(encoder, np.random.default_rng(0), 2, tmp_path)
    tokenizer = encoder.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    template = observation_template(tokenizer, [end], "user", "tiny-vl")
    image_part = encoder.expand_image_pads(template.image_part, after[0].mm_inputs | {"image_grid_thw": after[0].mm_inputs["image_grid_thw"][1:]}, "", 1)
    action = tokenizer.encode(ZOOM, add_special_tokens=False) + [end]
    for f, a in zip(first, after):
        assert a.prompt_ids == f.prompt_ids + action + template.observation_ids(end, ZOOMED, image_part)
        assert a.mm_inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]  # prompt and crop: one token each
