"""The HF engine's preallocated KV cache holds, step for step, what transformers' DynamicCache
holds, so decoding with it gives the same tokens and the same logprobs, bit for bit."""

import copy

import pytest
import torch
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer

import vlrft.engines.hf_engine as hf_engine
from vlrft.data.dataset import load_rows
from vlrft.engines import SamplingParams
from vlrft.engines.kv_cache import PreallocatedLayer, decoding_cache

from tests.unit.test_engine import make_engine


def test_preallocated_layer_holds_what_a_dynamic_layer_holds():
    gen = torch.Generator().manual_seed(0)
    ours, theirs = PreallocatedLayer(capacity=11), DynamicLayer()  # room for a 5-token prompt and 6 tokens
    batch, length = 4, 5
    for step, keep in enumerate([None, None, [0, 2, 3], None, [1, 2], None, None]):
        if keep is not None:  # finished rows leave the batch
            for layer in (ours, theirs):
                layer.batch_select_indices(torch.tensor(keep))
            batch = len(keep)
        k, v = torch.randn(batch, 2, length, 8, generator=gen), torch.randn(batch, 2, length, 8, generator=gen)
        got, want = ours.update(k, v), theirs.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        assert ours.get_seq_length() == theirs.get_seq_length() and ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
        length = 1  # after the prompt, one token a step
    with pytest.raises(RuntimeError, match="KV cache full: 12 positions, room for 11"):
        ours.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))


def test_engine_decodes_the_same_tokens_and_logprobs_as_with_the_dynamic_cache(tiny_text, addition_data, monkeypatch):
    engine, encoder = make_engine(tiny_text)
    stop = torch.zeros(engine.model.get_output_embeddings().weight.shape[0])
    stop[engine.stop_ids] = 5.0  # the random model's stop tokens at ~20% a step: many lengths
    engine.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + stop)
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    params = SamplingParams(n=6, max_new_tokens=12, temperature=1.0)
    torch.manual_seed(0)
    ours = engine.generate(prompts, params)
    monkeypatch.setattr(hf_engine, "decoding_cache", lambda config, capacity: DynamicCache(config=config))
    torch.manual_seed(0)
    theirs = engine.generate(prompts, params)
    assert len({len(r.response_ids) for r in ours}) >= 3, "every response had the same length: no row left the batch"
    assert [r.response_ids for r in ours] == [r.response_ids for r in theirs]
    assert [r.logprobs for r in ours] == [r.logprobs for r in theirs]


def test_models_with_sliding_window_layers_keep_the_dynamic_cache(tiny_text):
    config = AutoConfig.from_pretrained(tiny_text)
    assert all(isinstance(layer, PreallocatedLayer) for layer in decoding_cache(config, 16).layers)
    sliding = copy.deepcopy(config)
    sliding.layer_types = ["sliding_attention"] + config.layer_types[1:]
    sliding.sliding_window = 8
    assert isinstance(decoding_cache(sliding, 16), DynamicCache)
