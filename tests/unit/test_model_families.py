"""Qwen2-VL, Qwen3-VL and Qwen3 text models through the same code path as Qwen2.5-VL and
Qwen2, and video prompts for the three VL families: packed micro-batches equal per-sample
forwards (fp32, 1e-5), packed M-RoPE positions equal the model's own rope index, and video
pixels have the Qwen-VL video layout."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import assert_packed_equals_per_sample, make_mixed_rollouts
from vlrft.data.dataset import DataError, load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.data.video import Clip, group_timestamps, read_clip, spaced, video_pixels
from vlrft.experience.checks import ImageTokenCheck
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.packing import pack, position_ids
from vlrft.types import Rollout


def assert_positions_are_the_models_own(backbone, rollouts):
    """The packed ids against the model's function run on each whole sequence."""
    expected = []
    for r in rollouts:
        ids = torch.tensor(r.prompt.prompt_ids + r.response_ids)[None]
        types = torch.tensor((r.prompt.mm_token_types or [0] * len(r.prompt.prompt_ids)) + [0] * len(r.response_ids))
        mm = r.prompt.mm_inputs
        video = {k: mm[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in mm}
        positions, _ = backbone.get_rope_index(ids, image_grid_thw=mm.get("image_grid_thw"), attention_mask=torch.ones_like(ids),
                                               mm_token_type_ids=types[None], **video)
        expected.append(positions)
    assert torch.equal(position_ids(backbone, pack(rollouts)), torch.cat(expected, dim=-1))


@pytest.mark.parametrize("family, model_class", [("qwen2-vl", "Qwen2VL"), ("qwen3-vl", "Qwen3VL")])
def test_other_families_pack_exactly(family, model_class, vl_models, colour_data, tmp_path):
    rollouts = make_mixed_rollouts(vl_models(family), colour_data, tmp_path)
    model = load_model(vl_models(family)).eval()
    assert type(model).__name__ == f"{model_class}ForConditionalGeneration"
    assert_packed_equals_per_sample(model, rollouts, 0.7)
    assert_positions_are_the_models_own(model.model, rollouts)


def test_qwen3_text_model_packs_exactly(addition_data, tmp_path):
    from data_tools.make_tiny_model import build_text_model, main

    path = str(build_text_model(tmp_path / "qwen3", warmup_steps=0, family="qwen3"))
    model = load_model(path).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    encoder = PromptEncoder(path, 3136, 12544, 512)
    rows = load_rows(addition_data / "train.jsonl")[:3]
    rollouts = [Rollout(encoder.encode(r, i), i, [7 + i] * n, "", False) for i, (r, n) in enumerate(zip(rows, [1, 30, 9]))]
    assert_packed_equals_per_sample(model, rollouts, 1.0)
    with pytest.raises(SystemExit):  # argparse: "--family qwen3-vl is not a text family"
        main(["--kind", "text", "--family", "qwen3-vl", "--out", str(tmp_path / "x")])


def test_qwen3_vl_deepstack_features_reach_the_decoder(vl_models, colour_data, tmp_path):
    # Deepstack adds vision-layer features to the first decoder layers' hidden states at the
    # image tokens: zeroing those mergers must change the response logprobs of an image prompt.
    _, image_rollout, _ = make_mixed_rollouts(vl_models("qwen3-vl"), colour_data, tmp_path)
    model = load_model(vl_models("qwen3-vl")).eval()
    assert len(model.model.visual.deepstack_merger_list) == 2
    batch = pack([image_rollout])
    with torch.no_grad():
        before = policy_forward(model, batch, 1.0).logp
        for merger in model.model.visual.deepstack_merger_list:
            torch.nn.init.zeros_(merger.linear_fc2.weight)
            torch.nn.init.zeros_(merger.linear_fc2.bias)
        after = policy_forward(model, batch, 1.0).logp
    assert (before - after).abs().max() > 1e-4


# ------------------------------------------------------------------------------------ videos


@pytest.fixture
def frames(tmp_path):
    """Five 64x48 frames of different colours, in the test's directory: the data files the
    tests write there may name them (a row names only files inside its data set)."""
    root = tmp_path
    paths = []
    for i in range(5):
        Image.new("RGB", (64, 48), (40 * i, 200 - 30 * i, 90 + 20 * i)).save(root / f"f{i}.png")
        paths.append(str(root / f"f{i}.png"))
    return paths


def video_rollouts(model_path, frames, tmp_path, max_frames=4):
    rows = [
        {"id": "vid", "answer": "x", "messages": [{"role": "user", "content": [
            {"type": "video", "video": frames, "fps": 1.0}, {"type": "text", "text": "What changes?"}]}]},
        {"id": "both", "answer": "x", "messages": [{"role": "user", "content": [
            {"type": "image", "image": frames[0]}, {"type": "video", "video": frames[:2]}, {"type": "text", "text": "Same?"}]}]},
        {"id": "text", "answer": "4", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoder = PromptEncoder(model_path, 32 * 32, 64 * 64, 512, max_frames=max_frames, video_max_pixels=64 * 64)
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(tmp_path / "rows.jsonl"))]
    g = torch.Generator().manual_seed(0)
    return encoder, [Rollout(p, i, torch.randint(10, 600, (n,), generator=g).tolist(), "", False)
                     for i, (p, n) in enumerate(zip(prompts, [7, 12, 25]))]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen2-vl", "qwen3-vl"])
def test_video_prompts_pack_exactly(family, vl_models, frames, tmp_path):
    model_path = vl_models(family)
    encoder, rollouts = video_rollouts(model_path, frames, tmp_path)
    video, both, _ = (r.prompt for r in rollouts)
    # 5 frames at most 4 -> frames 0, 1, 3, 4 in 2 temporal groups; 2 frames -> 1 group.
    assert video.mm_inputs["video_grid_thw"][0, 0] == 2 and both.mm_inputs["video_grid_thw"][0, 0] == 1
    assert set(video.mm_token_types) == {0, 2} and set(both.mm_token_types) == {0, 1, 2}
    if family == "qwen2.5-vl":  # seconds per temporal group: 2 frames at 1 fps, at the default 2 fps
        assert video.mm_inputs["second_per_grid_ts"].tolist() == [2.0] and both.mm_inputs["second_per_grid_ts"].tolist() == [1.0]
    else:
        assert "second_per_grid_ts" not in video.mm_inputs
    text = encoder.tokenizer.decode(video.prompt_ids)
    if family == "qwen3-vl":  # each group's time in the prompt: frames (0, 1) -> 0.5 s, (3, 4) -> 3.5 s
        assert "<0.5 seconds><|vision_start|><|video_pad|>" in text and "<3.5 seconds><|vision_start|>" in text
    else:
        assert "seconds" not in text
    model = load_model(model_path).eval()
    check = ImageTokenCheck.for_model(model.config)
    assert check.first_problem(rollouts) is None
    broken = Rollout(video, 0, [model.config.video_token_id], "", False)
    tokens = int(video.mm_inputs["video_grid_thw"].prod()) // 4  # 2x2 patches merge into a token
    assert check.problem(broken) == f"sample 'vid' has {tokens + 1} video tokens but its videos give {tokens} (video_grid_thw)"
    assert_packed_equals_per_sample(model, rollouts, 0.7)
    assert_positions_are_the_models_own(model.model, rollouts)


def test_video_pixels_have_the_video_processor_layout(tiny_vl, frames):
    # A patch holds `temporal_patch_size` (2) frames: an image is its frame twice, so a clip of
    # one frame shown twice equals the image, and a clip of two frames holds each frame's
    # patch on its own temporal slice.
    processor = PromptEncoder(tiny_vl, 32 * 32, 64 * 64, 512).image_processor
    size = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}
    load = [Image.open(f).convert("RGB") for f in frames]
    image = {i: processor(images=[load[i]], size=size, return_tensors="pt")["pixel_values"] for i in (0, 1, 2)}
    same = video_pixels(Clip([load[0], load[0]], [0, 1], 1.0), processor, size)
    assert torch.equal(same["pixel_values_videos"], image[0])
    assert same["video_grid_thw"].tolist() == [[1, 4, 4]]
    three = video_pixels(Clip(load[:3], [0, 1, 2], 1.0), processor, size)  # padded to 4 with frame 2
    assert three["video_grid_thw"].tolist() == [[2, 4, 4]]
    patches = three["pixel_values_videos"].view(2, 16, 3, 2, 14, 14)  # [group, patch, C, t, p, p]
    per_image = {i: image[i].view(16, 3, 2, 14, 14) for i in image}
    for group, slot, frame in ((0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 2)):
        assert torch.equal(patches[group, :, :, slot], per_image[frame][:, :, 0])


def test_frame_sampling_and_timestamps(frames):
    assert spaced(5, 4) == [0, 1, 3, 4] and spaced(3, 8) == [0, 1, 2] and spaced(10, 2) == [0, 9]
    clip = read_clip({"video": frames, "fps": 2.0}, 3, lambda f: Image.open(f).convert("RGB"))
    assert clip.indices == [0, 2, 4] and clip.fps == 2.0 and len(clip.frames) == 3
    # groups (0, 2) and (4, 4 repeated): mid-times 0.5 s and 2.0 s at 2 fps
    assert group_timestamps(clip, 2) == [0.5, 2.0]


def test_video_file_is_sampled_at_the_requested_rate(tiny_vl, tmp_path):
    cv2 = pytest.importorskip("cv2", reason="reading video files needs OpenCV (installed with the vllm extras)")
    path = str(tmp_path / "clip.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    for i in range(20):  # 2 s at 10 fps: frame i is grey level 10 * i
        writer.write(np.full((48, 64, 3), 10 * i, dtype=np.uint8))
    writer.release()
    clip = read_clip({"video": path, "fps": 2.0}, 32, None)
    assert clip.fps == 2.0 and clip.indices == [0, 1, 2, 3]  # every 5th frame: 0, 5, 10, 15
    assert [round(np.asarray(f)[0, 0, 0] / 10) for f in clip.frames] == [0, 5, 10, 15]
    capped = read_clip({"video": path, "fps": 10.0}, 3, None)
    assert capped.indices == [0, 10, 19] and capped.fps == 10.0


def test_bad_video_parts_are_one_line_errors(tiny_vl, tiny_text, frames, tmp_path):
    def row(part):
        return {"id": "r", "answer": "a", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "q"}]}]}

    bad = {
        "a video part needs 'video'": {"type": "video", "video": []},
        "video file not found": {"type": "video", "video": ["nope.png"]},
        "'fps' must be a positive number": {"type": "video", "video": frames[:2], "fps": 0},
    }
    for message, part in bad.items():
        (tmp_path / "bad.jsonl").write_text(json.dumps(row(part)) + "\n")
        with pytest.raises(DataError, match=message):
            load_rows(tmp_path / "bad.jsonl")
    (tmp_path / "ok.jsonl").write_text(json.dumps(row({"type": "video", "video": frames[:2]})) + "\n")
    (good,) = load_rows(tmp_path / "ok.jsonl")
    refusing = PromptEncoder(tiny_vl, 3136, 12544, 512, video_refusal="video prompts need rollout.engine: hf (not 'vllm')")
    with pytest.raises(DataError, match=r"row id 'r' has a video: video prompts need rollout.engine: hf \(not 'vllm'\)"):
        refusing.encode(good, 0)
    with pytest.raises(DataError, match="has a video: the model checkpoint has no image processor"):
        PromptEncoder(tiny_text, 3136, 12544, 512).encode(good, 0)
    Image.new("RGB", (30, 40)).save(tmp_path / "odd.png")
    mixed = row({"type": "video", "video": [frames[0], str(tmp_path / "odd.png")]})
    with pytest.raises(DataError, match=r"cannot read video 0 \(2 frames\) \(frames differ in size"):
        PromptEncoder(tiny_vl, 3136, 12544, 512).encode(mixed, 0)


# ------------------------------------------------------------------- balanced vision calls


def counting_tower_calls(family, vl_models, colour_data, tmp_path):
    """A text and an image rollout, the model, and the list its vision tower's calls append
    their patch counts to."""
    model_path = vl_models(family)
    text, image, _ = make_mixed_rollouts(model_path, colour_data, tmp_path)
    model = load_model(model_path).eval()
    calls = []
    model.model.visual.register_forward_pre_hook(lambda module, args: calls.append(int(args[0].shape[0])))
    return text, image, model, calls


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_every_micro_batch_calls_the_vision_tower_for_images_then_videos(family, vl_models, colour_data, tmp_path):
    # ZeRO-3 gathers a module's parameters at each call, so ranks must make the same calls: a
    # text-only micro-batch runs the tower on a dummy for both modalities, an image one on its
    # images and a dummy video; the dummies change no number and leave zero gradients.
    from vlrft.models.vision_calls import encode_vision

    text, image, model, calls = counting_tower_calls(family, vl_models, colour_data, tmp_path)
    for rollout, first_call in ((text, 4), (image, 16)):
        calls.clear()
        batch = pack([rollout])
        out = policy_forward(model, batch, 1.0)
        assert calls == [first_call, 4]  # image pixels (or 4 dummy patches), then 4 dummy video patches
        model.zero_grad()
        out.logp.sum().backward()
        grads = [p.grad for p in model.model.visual.parameters()]
        assert all(g is not None for g in grads)
        assert any(g.abs().sum() > 0 for g in grads) == (rollout is image)
        with torch.no_grad():  # the model's own path (pixels into its forward) gives the same numbers
            from vlrft.models.packing import forward_inputs

            own = model.model(**forward_inputs(model.model, batch), use_cache=False).last_hidden_state
            inputs = forward_inputs(model.model, batch)
            zero = encode_vision(model.model, inputs)
            balanced = model.model(**inputs, use_cache=False).last_hidden_state + zero
        assert torch.equal(own, balanced)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_the_tower_runs_only_for_the_declared_modalities(family, vl_models, colour_data, tmp_path):
    # A run whose data holds images (and no videos) calls the tower for images alone: on a text
    # micro-batch a dummy image; text-only data calls it never. Same numbers either way. A
    # micro-batch holding an undeclared modality is an error naming it.
    from vlrft.models.vision_calls import declare_modalities

    text, image, model, calls = counting_tower_calls(family, vl_models, colour_data, tmp_path)
    for declared, rollout, expected in ((("image",), text, [4]), (("image",), image, [16]), ((), text, [])):
        declare_modalities(model.model, declared)
        calls.clear()
        with torch.no_grad():
            logp = policy_forward(model, pack([rollout]), 1.0).logp
        assert calls == expected
        declare_modalities(model.model, ("image", "video"))
        with torch.no_grad():
            assert torch.equal(logp, policy_forward(model, pack([rollout]), 1.0).logp)
    declare_modalities(model.model, ["video"])
    with pytest.raises(ValueError, match="a micro-batch holds image inputs, but this run declared its data holds only video"):
        policy_forward(model, pack([image]), 1.0)


def test_the_run_config_sets_the_video_bounds(tiny_vl, frames, tmp_path):
    from vlrft.config import load_config

    row = {"id": "v", "answer": "a", "messages": [{"role": "user", "content": [
        {"type": "video", "video": frames}, {"type": "text", "text": "q"}]}]}
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    (clip_row,) = load_rows(tmp_path / "v.jsonl")

    def grid(*overrides):
        cfg = load_config(None, [f"model.path={tiny_vl}", f"data.train_path={tmp_path / 'v.jsonl'}", "data.min_pixels=784", *overrides])
        return PromptEncoder.for_config(cfg).encode(clip_row, 0).mm_inputs["video_grid_thw"].tolist()

    assert grid("data.max_frames=4", "data.video_max_pixels=3136") == [[2, 4, 4]]  # 4 frames of 56x56 (4x4 patches)
    assert grid("data.max_frames=2", "data.video_max_pixels=784") == [[1, 2, 2]]  # 2 frames of 28x28
    with pytest.raises(DataError, match="video prompts need rollout.engine: hf \\(not 'vllm'\\)"):
        cfg = load_config(None, [f"model.path={tiny_vl}", f"data.train_path={tmp_path / 'v.jsonl'}", "rollout.engine=vllm"])
        PromptEncoder.for_config(cfg).encode(clip_row, 0)
