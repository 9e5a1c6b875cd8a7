"""Model-based reward recipes: scalar reward model and generative judge, on tiny offline checkpoints."""

from __future__ import annotations

import json
import re

import pytest
import torch
from PIL import Image
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from vlrft.rewards import reward_models
from vlrft.rewards.reward_models import generative_judge, parse_score, scalar_reward_model

QUESTION = "What is 2 + 3? Answer as <answer>number</answer>."
COMPLETIONS = [
    "<answer>5</answer>",
    "I think the sum is five, so <answer>5</answer>",
    "no",
    "Let me count: two plus three equals five. The answer is <answer>5</answer>. Thank you.",
    "<answer>6</answer> because 2 + 3 = 6",
]
TEMPLATE = "Question: {prompt}\nResponse: {completion}\nReference: {answer}\nScore from 0 to 10:"


def _sample(messages=None, images=()):
    messages = messages or [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    return {
        "id": "s0",
        "answer": "5",
        "data_source": "addition",
        "meta": {},
        "messages": messages,
        "prompt": QUESTION,
        "images": list(images),
    }


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    from data_tools.make_tiny_reward_model import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"), seed=0))


@pytest.fixture(scope="module")
def rm_by_hand(tiny_rm):
    tok = AutoTokenizer.from_pretrained(tiny_rm)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()

    def text_of(completion):
        # The image part is dropped: the reward model reads text only.
        msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": completion}]
        return tok.apply_chat_template(msgs, tokenize=False)

    @torch.no_grad()
    def score_ids(ids):
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    def ids_of(completion):
        return tok(text_of(completion), add_special_tokens=False)["input_ids"]

    return ids_of, score_ids


def test_scalar_rm_batched_equals_unbatched_and_is_deterministic(tiny_rm, rm_by_hand):
    ids_of, score_ids = rm_by_hand
    parts = [{"type": "image", "image": "x.png"}, {"type": "text", "text": QUESTION}]
    with_image = [{"role": "user", "content": parts}]
    samples = [_sample(with_image) for _ in COMPLETIONS]
    lengths = {len(ids_of(c)) for c in COMPLETIONS}
    assert len(lengths) == len(COMPLETIONS)  # really different lengths -> real padding
    scores = scalar_reward_model(COMPLETIONS, samples, path=tiny_rm, batch_size=8)
    assert len(scores) == 5 and all(isinstance(s, float) for s in scores)
    expected = [score_ids(ids_of(c)) for c in COMPLETIONS]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scalar_reward_model(COMPLETIONS, samples, path=tiny_rm, batch_size=2) == pytest.approx(expected, abs=1e-5)
    assert scalar_reward_model(COMPLETIONS, samples, path=tiny_rm, batch_size=8) == scores


def test_scalar_rm_truncates_from_the_left(tiny_rm, rm_by_hand):
    ids_of, score_ids = rm_by_hand
    long = COMPLETIONS[3] * 3
    ids = ids_of(long)
    max_length = 16
    assert len(ids) > 3 * max_length
    (score,) = scalar_reward_model([long], [_sample()], path=tiny_rm, max_length=max_length)
    assert score == pytest.approx(score_ids(ids[-max_length:]), abs=1e-5)
    assert score != pytest.approx(score_ids(ids), abs=1e-5)  # the truncation really happened


def test_scalar_rm_rejects_multi_label_checkpoint(tmp_path):
    from data_tools.make_tiny_reward_model import build_tiny_reward_model

    path = str(build_tiny_reward_model(tmp_path / "rm2", num_labels=2))
    with pytest.raises(ValueError, match=re.escape(path)):
        scalar_reward_model(["x"], [_sample()], path=path)


@pytest.mark.parametrize(
    "text, pattern, scale, expected",
    [
        ("Score: 7/10", r"(-?\d+(?:\.\d+)?)", 0.1, 0.7),
        ("Score: 7/10", r"(-?\d+(?:\.\d+)?)", 1.0, 7.0),
        ("no number", r"(-?\d+(?:\.\d+)?)", 1.0, None),
        ("rating -2 of 5", r"(-?\d+(?:\.\d+)?)", 1.0, -2.0),
        ("score 4.5 then 9", r"(-?\d+(?:\.\d+)?)", 2.0, 9.0),
        ("Score: 8", r"Score: \d", 1.0, None),  # no group: whole match "Score: 8" is no number
        ("Score: 8", r"\d", 1.0, 8.0),  # no group: the whole match
        ("grade: A", r"grade: (\w)", 1.0, None),  # matched but not a number
    ],
)
def test_parse_score(text, pattern, scale, expected):
    got = parse_score(text, pattern, scale)
    assert got == (None if expected is None else pytest.approx(expected))


def test_judge_unknown_template_field():
    with pytest.raises(ValueError, match="reference"):
        generative_judge(["x"], [_sample()], path="/nonexistent", template="{prompt} {reference}")
    with pytest.raises(ValueError, match=r"\{\}"):
        generative_judge(["x"], [_sample()], path="/nonexistent", template="{prompt} {}")


@pytest.mark.parametrize("judge", ["tiny_text", "warm_text"])
def test_judge_text_matches_direct_generation(judge, request):
    from vlrft.data.encoding import PromptEncoder
    from vlrft.engines.base import SamplingParams
    from vlrft.engines.hf_engine import HFEngine
    from vlrft.models.loader import banned_token_ids, stop_token_ids

    tiny_text = request.getfixturevalue(judge)
    samples = [_sample() for _ in COMPLETIONS]
    scores = generative_judge(COMPLETIONS, samples, path=tiny_text, template=TEMPLATE, max_new_tokens=8, scale=0.5)
    assert len(scores) == len(COMPLETIONS)
    assert all(s is None or isinstance(s, float) for s in scores)

    enc = PromptEncoder(tiny_text, 3136, 12544, 4096)
    tok = enc.tokenizer
    engine = HFEngine(tiny_text, tok, stop_token_ids(tok), banned_token_ids(tok))
    params = SamplingParams(n=1, max_new_tokens=8, temperature=1.0, greedy=True)
    for i, completion in enumerate(COMPLETIONS):  # one at a time: no padding in the reference
        text = TEMPLATE.format(prompt=QUESTION, completion=completion, answer="5")
        messages = [{"role": "user", "content": text}]
        row = {"id": "s0", "messages": messages, "answer": "5", "data_source": "a", "meta": {}}
        (rollout,) = engine.generate([enc.encode_with_images(row, [], i)], params)
        match = re.search(r"(-?\d+(?:\.\d+)?)", rollout.response_text)
        assert scores[i] == (None if match is None else 0.5 * float(match.group(1)))
    if judge == "warm_text":
        assert any(s is not None for s in scores)  # the float branch really ran


def _colour_sample(colour_data):
    row = json.loads((colour_data / "train.jsonl").read_text().splitlines()[0])
    parts = [p for m in row["messages"] if not isinstance(m["content"], str) for p in m["content"]]
    paths = [p["image"] for p in parts if p["type"] == "image"]
    assert len(paths) == 1
    with Image.open(colour_data / paths[0]) as img:
        image = img.convert("RGB")
    prompt = "\n".join(p["text"] for p in parts if p["type"] == "text")
    return {**row, "prompt": prompt, "images": [image]}


def _spy_prompts(monkeypatch, path):
    engine = reward_models._JUDGE_CACHE[path]["engine"]
    seen, original = [], engine.generate
    monkeypatch.setattr(engine, "generate", lambda prompts, params: seen.extend(prompts) or original(prompts, params))
    return seen


def test_judge_vl_passes_the_image(tiny_vl, colour_data, monkeypatch):
    sample = _colour_sample(colour_data)
    generative_judge(["<answer>red</answer>"], [sample], path=tiny_vl, template=TEMPLATE, max_new_tokens=4)  # load
    seen = _spy_prompts(monkeypatch, tiny_vl)
    scores = generative_judge(["<answer>red</answer>"], [sample], path=tiny_vl, template=TEMPLATE, max_new_tokens=4)
    assert len(scores) == 1 and (scores[0] is None or isinstance(scores[0], float))
    (prompt,) = seen
    tok = AutoTokenizer.from_pretrained(tiny_vl)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    grid = prompt.mm_inputs["image_grid_thw"]
    assert grid.shape[0] == 1 and "pixel_values" in prompt.mm_inputs
    assert prompt.prompt_ids.count(pad) == int(grid[0].prod()) // 4 > 0  # merge_size 2 -> 4 patches per token
    assert "<answer>red</answer>" in prompt.prompt_text and sample["prompt"] in prompt.prompt_text


def test_text_judge_ignores_images(tiny_text, colour_data, monkeypatch):
    sample = _colour_sample(colour_data)
    generative_judge(["x"], [_sample()], path=tiny_text, template=TEMPLATE, max_new_tokens=2)  # load
    seen = _spy_prompts(monkeypatch, tiny_text)
    scores = generative_judge(["<answer>red</answer>"], [sample], path=tiny_text, template=TEMPLATE, max_new_tokens=4)
    assert len(scores) == 1
    (prompt,) = seen
    assert prompt.mm_inputs == {} and "<|image_pad|>" not in prompt.prompt_text
