"""The HF engine's static-cache decode (`rollout.hf_decode: static`) against its dynamic one.

Both paths sample through the engine's `_sample`, over the rows still running in the same order,
so they draw the same random numbers. Their logits are not bit-identical (the static step
attends over the whole fixed-length cache, masked, in a batch that keeps stopped rows, so fp32
sums round differently: ~1e-7), and a token could differ only where a uniform draw falls that
close to a boundary of the cumulative distribution: the tests assert the same tokens and
logprobs within 1e-5, greedy included.
"""

import pytest
import torch
from transformers import StaticCache

from vlrft.config import ConfigError, load_config
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.engines import SamplingParams
from vlrft.engines.hf_engine import HFEngine
from vlrft.models.loader import banned_token_ids, load_model, stop_token_ids

SAMPLED = SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_p=0.9)
GREEDY = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, greedy=True)


def make_engine(model_path: str, decode: str) -> HFEngine:
    tok = PromptEncoder(model_path, 56 * 56, 112 * 112, 512).tokenizer
    engine = HFEngine(model_path, tok, stop_token_ids(tok), banned_token_ids(tok), decode=decode)
    # A nudge towards the stop token: some responses stop early, some run to the limit.
    engine.stop_bonus = torch.zeros(engine.model.get_output_embeddings().weight.shape[0])
    engine.stop_bonus[engine.stop_ids[0]] = 3.0
    engine.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + engine.stop_bonus)
    return engine


def sample(engine: HFEngine, prompts, params: SamplingParams, seed: int = 0):
    torch.manual_seed(seed)
    return engine.generate(prompts, params)


def assert_same_samples(dynamic, static):
    assert [r.response_ids for r in static] == [r.response_ids for r in dynamic]
    assert [r.truncated for r in static] == [r.truncated for r in dynamic]
    for a, b in zip(dynamic, static):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


@pytest.fixture(scope="module")
def prompt_sets(tiny_text, tiny_vl, addition_data, mixed_rollouts):
    """(model, prompts): text prompts, and Qwen2.5-VL prompts with no, one and two images."""
    encoder = PromptEncoder(tiny_text, 56 * 56, 112 * 112, 512)
    text = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    return [(tiny_text, text), (tiny_vl, [r.prompt for r in mixed_rollouts])]


def test_static_decode_draws_the_dynamic_engines_tokens(prompt_sets):
    for model_path, prompts in prompt_sets:
        dynamic, static = make_engine(model_path, "dynamic"), make_engine(model_path, "static")
        assert (dynamic.decode, static.decode) == ("dynamic", "static")
        expected = sample(dynamic, prompts, SAMPLED)
        lengths = {len(r.response_ids) for r in expected}
        assert min(lengths) < 12 and any(r.truncated for r in expected)  # rows stop at different steps
        assert_same_samples(expected, sample(static, prompts, SAMPLED))
        # Another seed draws other tokens: the comparison above can fail.
        assert [r.response_ids for r in sample(static, prompts, SAMPLED, seed=1)] != [r.response_ids for r in expected]
        for engine in (dynamic, static):  # greedy, without the nudge (it would stop every response at once)
            engine.stop_bonus.zero_()
        assert_same_samples(dynamic.generate(prompts, GREEDY), static.generate(prompts, GREEDY))


def test_static_decode_keeps_one_shape_and_one_cache(tiny_text, prompt_sets):
    """Every decoding step feeds the same shapes (12 responses padded to 16 rows, stopped rows
    kept) into the same StaticCache, which the next batch of that shape reuses."""
    engine = make_engine(tiny_text, "static")
    calls = []
    engine.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(
            (kwargs["input_ids"].shape, kwargs["attention_mask"].shape, kwargs[engine.cache_name])),
        with_kwargs=True)
    prompts = prompt_sets[0][1]
    for _ in range(2):
        calls.clear()
        rollouts = sample(engine, prompts, SAMPLED)
        steps = calls[1:]  # calls[0] is the prefill: the 3 distinct prompts, once each
        assert calls[0][0][0] == 3 and len(steps) == max(len(r.response_ids) for r in rollouts) - 1
        width = max(len(p.prompt_ids) for p in prompts)
        length = 1 << (width + SAMPLED.max_new_tokens - 1).bit_length()
        assert {(ids, mask) for ids, mask, _ in steps} == {(torch.Size([16, 1]), torch.Size([16, length]))}
        caches = {id(cache) for _, _, cache in steps}
        assert len(caches) == 1 and isinstance(steps[0][2], StaticCache)
        if _ == 0:
            first = caches
    assert caches == first


def test_partial_rollouts_go_on_under_new_weights_alike(tiny_text, prompt_sets):
    """Weights that change mid-response: both paths prefill the responses again and continue
    under the new weights, drawing the same tokens."""
    prompts = prompt_sets[0][1]
    trained = load_model(tiny_text)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    results = {}
    for decode in ("dynamic", "static"):
        engine = make_engine(tiny_text, decode)
        polls = []

        def new_weights(engine=engine, polls=polls) -> bool:  # new weights after the third step
            polls.append(1)
            if len(polls) == 3:
                engine.update_weights(trained.named_parameters())
                return True
            return False

        engine.new_weights = new_weights
        results[decode] = sample(engine, prompts, SAMPLED)
        engine.new_weights = None
        results[decode + " unchanged"] = sample(make_engine(tiny_text, decode), prompts, SAMPLED)
    assert_same_samples(results["dynamic"], results["static"])
    # The reload mattered: the first three tokens as without it, then others.
    logprobs = lambda key: [r.logprobs for r in results[key]]  # noqa: E731
    assert [lp[:3] for lp in logprobs("static")] == [lp[:3] for lp in logprobs("static unchanged")]
    assert logprobs("static") != logprobs("static unchanged")


def test_hf_decode_key_picks_the_engines_decode(tiny_text, tmp_path):
    from vlrft.engines.base import ENGINES

    base = [f"model.path={tiny_text}", f"data.train_path={tmp_path / 'train.jsonl'}"]
    with pytest.raises(ConfigError, match=r"^config key 'rollout.hf_decode' is 'fast'; valid: auto, dynamic, static$"):
        load_config(None, base + ["rollout.hf_decode=fast"])
    tok = PromptEncoder(tiny_text, 56 * 56, 112 * 112, 512).tokenizer
    built = {}
    for setting in ("auto", "dynamic", "static"):
        cfg = load_config(None, base + [f"rollout.hf_decode={setting}"])
        engine = ENGINES.get("hf")(cfg, tok, stop_token_ids(tok), banned_token_ids(tok))
        built[setting] = (engine.decode, engine.static is not None)
    # auto: static on CUDA only (the compiled step pays there; on CPU it measured slower).
    assert built == {"auto": ("dynamic", False), "dynamic": ("dynamic", False), "static": ("static", True)}


def test_compiled_step_is_traced_once_for_every_step(tiny_vl, prompt_sets):
    """The fixed shapes are what a compiled step needs: traced once (by dynamo, here into a
    backend that counts graphs and runs them eagerly; on CUDA inductor + CUDA graphs), then
    reused by every later step and batch of that shape, with no graph break, drawing the
    dynamic path's tokens (Qwen2.5-VL with images: the prefill stays eager)."""
    from transformers import CompileConfig

    from vlrft.engines.static_decode import StaticDecoder

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    prompts = prompt_sets[1][1]
    engine, reference = make_engine(tiny_vl, "static"), make_engine(tiny_vl, "dynamic")
    engine.static = StaticDecoder(engine, CompileConfig(fullgraph=False, dynamic=False, backend=counting_backend, mode=None))
    for seed in (0, 1):
        assert_same_samples(sample(reference, prompts, SAMPLED, seed), sample(engine, prompts, SAMPLED, seed))
    assert len(graphs) == 1
    torch._dynamo.reset()
