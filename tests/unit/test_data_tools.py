"""Fast checks for data_tools: synthetic datasets and tiny offline checkpoints (no warm-up)."""

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data_tools import make_tiny_model as mtm
from data_tools import synth_shapes as ss
from data_tools import tiny_tokenizer as tt
from data_tools import tiny_warmup as tw
from vlrft.data.encoding import PromptEncoder


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- datasets


def test_constants_and_formatting():
    assert ss.COLOURS == ("red", "green", "blue", "yellow")
    assert ss.addition_question(3, 5) == "What is 3 + 5? Answer as <answer>number</answer>."
    assert ss.format_answer("red") == "<answer>red</answer>"
    assert ss.format_answer(12) == "<answer>12</answer>"


def test_render_shape_is_rgb_and_seeded():
    img = ss.render_shape("blue", "triangle", np.random.default_rng(1))
    assert img.mode == "RGB" and img.size == (56, 56)
    again = ss.render_shape("blue", "triangle", np.random.default_rng(1))
    assert np.array_equal(np.asarray(img), np.asarray(again))
    with pytest.raises(ValueError):
        ss.render_shape("purple", "circle", np.random.default_rng(0))


@pytest.mark.parametrize("colour", ss.COLOURS)
def test_rendered_colour_is_unambiguous(colour):
    # The most saturated pixels (the shape) must be closest to the intended base colour.
    base = {c: np.array(v, dtype=float) for c, v in ss._BASE_RGB.items()}
    for seed in range(5):
        px = np.asarray(ss.render_shape(colour, "square", np.random.default_rng(seed)), dtype=float).reshape(-1, 3)
        shape_px = px[(px.max(1) - px.min(1)) > 80]
        assert len(shape_px) > 100
        mean = shape_px.mean(0)
        assert min(base, key=lambda c: np.linalg.norm(base[c] - mean)) == colour


def test_colour_task_schema_images_and_balance(tmp_path):
    ss.write_colour_task(tmp_path, n_train=40, n_test=12, seed=3)
    for split, n in (("train", 40), ("test", 12)):
        rows = _rows(tmp_path / f"{split}.jsonl")
        assert len(rows) == n
        assert len({r["id"] for r in rows}) == n
        for r in rows:
            assert set(r) == {"id", "messages", "answer", "data_source", "meta"}
            assert r["data_source"] == "color_shapes" and r["answer"] in ss.COLOURS
            (msg,) = r["messages"]
            assert msg["role"] == "user"
            image_part, text_part = msg["content"]
            assert text_part == {"type": "text", "text": ss.COLOUR_QUESTION}
            rel = image_part["image"]
            assert image_part["type"] == "image" and not Path(rel).is_absolute() and rel.startswith("images/")
            with Image.open(tmp_path / rel) as im:
                assert im.size == (56, 56)
        counts = Counter(r["answer"] for r in rows)
        assert set(counts) == set(ss.COLOURS) and max(counts.values()) - min(counts.values()) <= 1


def test_left_right_task_needs_the_relation(tmp_path):
    ss.write_left_right_task(tmp_path, n_train=40, n_test=8, seed=1)
    rows = _rows(tmp_path / "train.jsonl")
    assert len(rows) == 40 and {r["data_source"] for r in rows} == {"left_right"}
    for r in rows:
        meta = r["meta"]
        assert meta["left"] != meta["right"]  # "any colour in the image" is right half the time
        assert r["answer"] == meta[meta["side"]]
        assert r["messages"][0]["content"][1]["text"] == ss.side_question(meta["side"])
        with Image.open(tmp_path / r["messages"][0]["content"][0]["image"]) as im:
            assert im.size == (112, 56)
            pixels = np.asarray(im).astype(int)
        # each half holds its own colour: the half's most saturated pixels are nearest that colour
        for half, colour in ((pixels[:, :56], meta["left"]), (pixels[:, 56:], meta["right"])):
            vivid = half[(half.max(-1) - half.min(-1)) > 100]
            nearest = min(ss.COLOURS, key=lambda c: np.abs(vivid.mean(0) - np.array(ss._BASE_RGB[c])).sum())
            assert nearest == colour
    counts = Counter(r["answer"] for r in rows)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert Counter(r["meta"]["side"] for r in rows) == {"left": 20, "right": 20}


def test_bigger_task_needs_the_size_relation(tmp_path):
    ss.write_bigger_task(tmp_path, n_train=40, n_test=8, seed=2)
    rows = _rows(tmp_path / "train.jsonl")
    assert {r["data_source"] for r in rows} == {"bigger_shape"}
    sides = Counter()
    for r in rows:
        meta = r["meta"]
        assert r["answer"] == meta["big"] != meta["small"]
        assert r["messages"][0]["content"][1]["text"] == ss.BIGGER_QUESTION
        with Image.open(tmp_path / r["messages"][0]["content"][0]["image"]) as im:
            pixels = np.asarray(im).astype(int)
        vivid = (pixels.max(-1) - pixels.min(-1)) > 100  # shape pixels
        big_half, small_half = (slice(0, 56), slice(56, 112)) if meta["big_side"] == "left" else (slice(56, 112), slice(0, 56))
        assert vivid[:, big_half].sum() > 1.5 * vivid[:, small_half].sum()  # clearly bigger (a big triangle vs a small square: ~2x)
        sides[meta["big_side"]] += 1
    assert set(sides) == {"left", "right"}  # position does not give the answer away
    counts = Counter(r["answer"] for r in rows)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_long_video_task_asks_for_the_last_frame_and_encodes_to_thousands_of_tokens(tmp_path, tiny_vl):
    out = ss.write_long_video_task(tmp_path / "lv", n_train=8, n_test=4, seed=0)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and len(list((out / "frames").iterdir())) == 8 * len(ss.COLOURS)
    for row in rows:
        video = row["messages"][0]["content"][0]["video"]
        assert len(video) == ss.LONG_VIDEO_FRAMES and all((out / frame).is_file() for frame in video)
        assert Path(video[-1]).name.split("_")[0] == row["answer"]  # the last frame's colour
    assert Counter(r["answer"] for r in rows) == Counter({c: 2 for c in ss.COLOURS})
    encoder = PromptEncoder(tiny_vl, 3136, 12544, 4096, max_frames=ss.LONG_VIDEO_FRAMES, video_max_pixels=224 * 224)
    from vlrft.data.dataset import load_rows

    prompt = encoder.encode(load_rows(out / "train.jsonl")[0], 0)
    assert 1500 < len(prompt.prompt_ids) < 1700  # 24 frame pairs x 64 tokens, and the question


def test_supervised_probe_runs_and_reports_a_curve(tmp_path, tiny_vl):
    from data_tools.supervised_probe import probe

    ss.write_left_right_task(tmp_path, n_train=16, n_test=8, seed=0)
    curve = probe(tiny_vl, str(tmp_path), steps=2, batch_size=4, lr=1e-3, eval_every=1)
    assert [s for s, _ in curve] == [0, 1, 2] and all(0.0 <= a <= 1.0 for _, a in curve)


def _probe_and_save(model, data, out) -> list:
    from data_tools.supervised_probe import probe

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command line runs it: the same weights every run
    try:
        torch.manual_seed(0)
        return probe(model, str(data), steps=2, batch_size=4, lr=1e-3, eval_every=2, save=str(out))
    finally:
        torch.set_num_threads(threads)


def test_supervised_probe_saves_a_teacher_the_student_can_use(tmp_path, tiny_vl):
    """--save: an HF checkpoint (weights, tokenizer, image processor) that loads with
    from_pretrained, passes the distillation teacher's checks against its student, holds the
    trained weights, and is the same file every run."""
    from vlrft.models.loader import load_model
    from vlrft.models.teacher import teacher_problem

    ss.write_colour_task(tmp_path / "data", n_train=16, n_test=8, seed=0)
    first, again = tmp_path / "teachers" / "first", tmp_path / "teachers" / "again"
    _probe_and_save(tiny_vl, tmp_path / "data", first)
    _probe_and_save(tiny_vl, tmp_path / "data", again)
    assert sorted(p.name for p in first.parent.iterdir()) == ["again", "first"]  # no partial copy left
    names = {p.name for p in first.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= names
    assert teacher_problem(tiny_vl, str(first)) == ""
    student, teacher = load_model(tiny_vl), load_model(str(first))
    assert any(not torch.equal(a, b) for a, b in zip(student.parameters(), teacher.parameters()))  # trained
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_supervised_probe_never_saves_over_a_directory(tmp_path, tiny_vl):
    """An existing --save path is refused before any training, one line, and left as it was."""
    from data_tools.supervised_probe import main

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    refusal = f"supervised_probe: --save {taken} exists; remove it or name another directory"
    with pytest.raises(SystemExit, match=f"^{re.escape(refusal)}$"):
        main(["--model", tiny_vl, "--data", str(tmp_path / "no-data-needed"), "--save", str(taken)])
    assert [p.name for p in taken.iterdir()] == ["notes.txt"] and (taken / "notes.txt").read_text() == "mine"


def test_supervised_probe_scores_the_tasks_own_answers(tmp_path, tiny_text):
    """The answers the probe ranks are the task's (the sums for addition), each one token."""
    from data_tools.supervised_probe import answer_choices, probe

    ss.write_addition_task(tmp_path, n_train=18, n_test=9, seed=0)
    tokenizer = PromptEncoder(tiny_text, 56 * 56, 112 * 112, 512).tokenizer
    answers = [r["answer"] for r in _rows(tmp_path / "train.jsonl")]
    assert answer_choices(tokenizer, answers) == tuple(str(a) for a in ss.ADDITION_ANSWERS)
    with pytest.raises(SystemExit, match="answer '12' is not a single token"):  # "1", "2"
        answer_choices(tokenizer, ["3", "12"])
    curve = probe(tiny_text, str(tmp_path), steps=1, batch_size=4, lr=1e-3, eval_every=1)
    assert [s for s, _ in curve] == [0, 1]


def test_colour_task_is_reproducible(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    ss.write_colour_task(a, 8, 4, seed=7)
    ss.write_colour_task(b, 8, 4, seed=7)
    ss.write_colour_task(c, 8, 4, seed=8)
    for name in ("train.jsonl", "test.jsonl", "images/train_00003.png", "images/test_00001.png"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "train.jsonl").read_bytes() != (c / "train.jsonl").read_bytes()


def test_addition_task(tmp_path):
    ss.write_addition_task(tmp_path, n_train=50, n_test=10, seed=0)
    rows = _rows(tmp_path / "train.jsonl")
    assert len(rows) == 50 and len(_rows(tmp_path / "test.jsonl")) == 10
    for r in rows:
        a, b = r["meta"]["a"], r["meta"]["b"]
        assert 0 <= a <= 4 and 0 <= b <= 4
        assert r["answer"] == str(a + b) and r["data_source"] == "addition"
        assert r["messages"][0]["content"] == [{"type": "text", "text": ss.addition_question(a, b)}]
    # Sums balanced (50 rows over 9 sums: 5 or 6 each), so no constant answer beats 6/50.
    assert sorted(Counter(r["answer"] for r in rows).values()) == [5, 5, 5, 5, 6, 6, 6, 6, 6]
    assert len({(r["meta"]["a"], r["meta"]["b"]) for r in rows}) > 9  # sums come from varied pairs
    ss.write_addition_task(tmp_path / "again", n_train=50, n_test=10, seed=0)
    assert (tmp_path / "train.jsonl").read_bytes() == (tmp_path / "again" / "train.jsonl").read_bytes()


def test_synth_cli(tmp_path):
    ss.main(["--task", "colors", "--out", str(tmp_path), "--n-train", "4", "--n-test", "2", "--seed", "1"])
    assert len(_rows(tmp_path / "train.jsonl")) == 4 and len(_rows(tmp_path / "test.jsonl")) == 2


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_tokens_are_compact():
    tok = mtm.build_tokenizer()
    ids = tt.special_token_ids(tok)
    assert len(set(ids.values())) == len(ids)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert 600 <= len(tok) <= 1000
    for colour in ss.COLOURS:
        assert len(tok(ss.format_answer(colour), add_special_tokens=False)["input_ids"]) == 3
    assert tok(ss.format_answer(7), add_special_tokens=False)["input_ids"][0] == ids["<answer>"]


def test_chat_template():
    tok = mtm.build_tokenizer()
    messages = ss.colour_row("r0", "images/x.png", "red", "circle")["messages"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        + ss.COLOUR_QUESTION
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return mtm.build_vl_model(tmp_path_factory.mktemp("tiny_vl"), warmup_steps=0)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return mtm.build_text_model(tmp_path_factory.mktemp("tiny_text"), warmup_steps=0)


def test_vl_checkpoint_reloads_and_runs(vl_dir, tmp_path):
    from transformers import (
        AutoImageProcessor,
        AutoModelForImageTextToText,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
    )

    tok = AutoTokenizer.from_pretrained(vl_dir)
    ip = AutoImageProcessor.from_pretrained(vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir)

    # Vision token ids in the config are the tokenizer's.
    cfg = model.config
    ids = {t: tok.convert_tokens_to_ids(t) for t in tt.SPECIAL_TOKENS}
    assert cfg.image_token_id == ids["<|image_pad|>"]
    assert cfg.video_token_id == ids["<|video_pad|>"]
    assert cfg.vision_start_token_id == ids["<|vision_start|>"]
    assert cfg.vision_end_token_id == ids["<|vision_end|>"]
    assert cfg.text_config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == ids["<|im_end|>"]
    assert model.generation_config.pad_token_id == ids["<|endoftext|>"]

    # A 56x56 image -> grid (1, 4, 4) -> 4 image tokens after the 2x2 merge.
    assert ip.size == {"shortest_edge": mtm.MIN_PIXELS, "longest_edge": mtm.MAX_PIXELS}  # = the encoder's
    encoder = PromptEncoder(str(vl_dir), mtm.MIN_PIXELS, mtm.MAX_PIXELS, mtm.MAX_PROMPT_TOKENS)
    prompts = tw.colour_prompts(encoder, np.random.default_rng(0), 2, tmp_path)
    inputs = tw.sft_batch(tok, prompts)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert inputs["pixel_values"].shape == (32, 3 * 2 * 14 * 14)
    is_image = inputs["input_ids"] == ids["<|image_pad|>"]
    assert is_image.sum(1).tolist() == [4, 4]
    assert torch.equal(inputs["mm_token_type_ids"], is_image.long())  # M-RoPE positions

    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape == (*inputs["input_ids"].shape, len(tok))
    assert torch.isfinite(out.logits).all()


def test_text_checkpoint_reloads(text_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(text_dir)
    model = AutoModelForCausalLM.from_pretrained(text_dir).eval()
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.vocab_size == len(tok) and model.config.hidden_size == 128
    assert not (Path(text_dir) / "preprocessor_config.json").exists()
    messages = ss.addition_row("r0", 3, 5)["messages"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 3) or out[0, -1].item() == tok.eos_token_id


def test_parse_answer():
    assert tw.parse_answer("<answer>red</answer>") == "red"
    assert tw.parse_answer(" <answer>12</answer>\n") == "12"
    assert tw.parse_answer("<answer></answer>") is None
    assert tw.parse_answer("red") is None


# --------------------------------------------------------------------------- warm-up


def test_sft_batch_labels_only_targets(text_dir):
    encoder = PromptEncoder(str(text_dir), mtm.MIN_PIXELS, mtm.MAX_PIXELS, mtm.MAX_PROMPT_TOKENS)
    tok = encoder.tokenizer
    prompts = tw.addition_prompts(encoder, np.random.default_rng(0), 3)
    targets = [ss.format_answer(1), ss.format_answer(12), ss.format_answer(3)]
    batch = tw.sft_batch(tok, prompts, targets)
    assert "mm_token_type_ids" not in batch and "pixel_values" not in batch  # text-only checkpoint
    for row, (prompt, target) in enumerate(zip(prompts, targets)):
        n = len(prompt.prompt_ids)
        labels = batch["labels"][row]
        assert batch["input_ids"][row, :n].tolist() == prompt.prompt_ids
        assert (labels[:n] == -100).all()
        assert tok.decode(labels[labels != -100].tolist()) == target + "<|im_end|>"
        assert batch["attention_mask"][row].sum() == n + int((labels != -100).sum())


def test_vl_warmup_runs_and_reports(vl_dir):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    encoder = PromptEncoder(str(vl_dir), mtm.MIN_PIXELS, mtm.MAX_PIXELS, mtm.MAX_PROMPT_TOKENS)
    try:
        out = tw.run_warmup(model, encoder, "vl", steps=2, seed=0, batch_size=4, lr=3e-3, n_eval=8)
    finally:
        torch.set_flush_denormal(False)  # warmup() turns it on process-wide; restore the default
    assert np.isfinite(out["final_loss"])
    check = out["check"]
    assert check["sampled_n"] == 8 and set(check["sampled_distribution"]) == set(ss.COLOURS)
    assert sum(check["mean_probs"].values()) == pytest.approx(1.0, abs=1e-5)
