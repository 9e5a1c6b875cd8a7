"""An engine in a process of its own on a CUDA GPU (how an async run's rollout rank runs vLLM;
the HF engine here, so it runs without vllm): weights cross as CUDA IPC handles and the engine
process answers as the engine in this process does. Skips without a CUDA GPU."""

import pytest
import torch

from tests.unit.test_engine import make_engine
from vlrft.config import Config
from vlrft.data.dataset import load_rows
from vlrft.engines import SamplingParams
from vlrft.engines.engine_process import EngineProcess
from vlrft.models.loader import banned_token_ids, load_model, stop_token_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU is visible")]


def test_cuda_weights_reach_an_engine_process_and_it_answers_as_in_process(tiny_text, addition_data):
    local, encoder = make_engine(tiny_text)
    assert local.model.device.type == "cuda"
    cfg = Config()
    cfg.model.path = tiny_text
    tok = encoder.tokenizer
    child = EngineProcess("hf", cfg, tok, stop_token_ids(tok), banned_token_ids(tok), keep_weights=True)
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    greedy = SamplingParams(n=2, max_new_tokens=5, temperature=1.0, greedy=True)
    before = child.generate(prompts, greedy)
    weights = [(n, p.detach().cuda() * 1.5) for n, p in load_model(tiny_text).named_parameters()]
    for engine in (child, local):
        engine.update_weights(iter(weights))
    after = child.generate(prompts, greedy)
    assert [r.response_ids for r in after] == [r.response_ids for r in local.generate(prompts, greedy)]
    assert [r.response_ids for r in after] != [r.response_ids for r in before]
    kept = dict(child.named_weights())
    assert all(torch.equal(kept[n], t.cpu()) for n, t in weights)
    child.close()
