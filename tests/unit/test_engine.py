import torch

from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.engines import SamplingParams
from vlrft.engines.hf_engine import HFEngine
from vlrft.models.loader import banned_token_ids, load_model, stop_token_ids


def make_engine(model_path, banned=True):
    encoder = PromptEncoder(model_path, 56 * 56, 112 * 112, 512)
    tok = encoder.tokenizer
    engine = HFEngine(model_path, tok, stop_token_ids(tok), banned_token_ids(tok) if banned else [])
    return engine, encoder


def bias_towards(model, token_id):
    """Make `token_id` the overwhelming next token by adding 100 to its logit."""
    bonus = torch.zeros(model.get_output_embeddings().weight.shape[0])
    bonus[token_id] = 100.0
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + bonus)


def test_vision_tokens_can_never_be_generated(tiny_vl, colour_data):
    rows = load_rows(colour_data / "test.jsonl")[:2]
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
    for banned in (False, True):
        torch.manual_seed(0)
        engine, encoder = make_engine(tiny_vl, banned=banned)
        pad = encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        bias_towards(engine.model, pad)
        prompts = [encoder.encode(r, i) for i, r in enumerate(rows)]
        generated = [t for r in engine.generate(prompts, params) for t in r.response_ids]
        vision = set(banned_token_ids(encoder.tokenizer))
        if banned:
            assert not vision & set(generated)
        else:  # the same bias without the ban does produce them: the check above can fail
            assert pad in generated


def test_groups_truncation_and_stop(tiny_text, addition_data):
    engine, encoder = make_engine(tiny_text)
    prompts = [encoder.encode(r, 10 + i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    torch.manual_seed(0)
    rollouts = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=5, temperature=1.0))
    assert [r.group_id for r in rollouts] == [10] * 4 + [11] * 4 + [12] * 4
    stops = set(stop_token_ids(encoder.tokenizer))
    for r in rollouts:
        assert 1 <= len(r.response_ids) <= 5
        ends_with_stop = r.response_ids[-1] in stops
        assert r.truncated == (not ends_with_stop)
        assert not stops & set(r.response_ids[:-1])  # nothing after the stop token is kept


def test_weight_sync_changes_generation(tiny_text, addition_data):
    engine, encoder = make_engine(tiny_text)
    prompts = [encoder.encode(load_rows(addition_data / "test.jsonl")[0], 0)]
    greedy = SamplingParams(n=1, max_new_tokens=4, temperature=1.0, greedy=True)
    before = engine.generate(prompts, greedy)[0].response_ids
    trained = load_model(tiny_text)
    with torch.no_grad():  # a "trained" policy: every weight nudged
        for param in trained.parameters():
            param.add_(0.5 * torch.randn_like(param))
    engine.update_weights(trained.named_parameters())
    after = engine.generate(prompts, greedy)[0].response_ids
    assert after != before
    for (name, synced), (_, source) in zip(engine.model.named_parameters(), trained.named_parameters()):
        assert torch.equal(synced, source), name


def test_checkpoint_generation_config_does_not_change_sampling(tiny_text, addition_data, tmp_path):
    # Qwen2.5 Instruct checkpoints ship generation_config.json with repetition_penalty 1.05,
    # top_k 20, ...: transformers would fill every field we leave unset from it, so the engine
    # would sample from a distribution the trainer's logprobs do not describe.
    import json
    import shutil

    shipped = tmp_path / "with_generation_config"
    shutil.copytree(tiny_text, shipped)
    (shipped / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 3.0, "top_k": 2, "no_repeat_ngram_size": 1, "min_new_tokens": 8}))
    rows = load_rows(addition_data / "test.jsonl")[:3]
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0)
    samples = {}
    for path in (tiny_text, str(shipped)):
        engine, encoder = make_engine(path)
        prompts = [encoder.encode(r, i) for i, r in enumerate(rows)]
        torch.manual_seed(0)
        samples[path] = [r.response_ids for r in engine.generate(prompts, params)]
    assert samples[str(shipped)] == samples[tiny_text]


def test_engine_logprobs_equal_the_trainers_packed_forward(tiny_vl, tiny_text, mixed_rollouts, addition_data):
    """Each prompt is prefilled once and its cache repeated for its n responses; decoding drops
    stopped responses from the batch and its cache; what each token was sampled from must still
    be the policy the trainer scores (text and M-RoPE prompts)."""
    from vlrft.models.collate import gather_responses
    from vlrft.models.forward import policy_forward
    from vlrft.models.packing import pack

    # No banned tokens here: the engine renormalises over the tokens it may sample, the trainer
    # scores against the whole vocabulary.
    text_engine, encoder = make_engine(tiny_text, banned=False)
    text_prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    vl_engine, _ = make_engine(tiny_vl, banned=False)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.7)
    for engine, prompts in ((text_engine, text_prompts), (vl_engine, [r.prompt for r in mixed_rollouts])):
        stop = stop_token_ids(engine.tokenizer)[0]
        bonus = torch.zeros(engine.model.get_output_embeddings().weight.shape[0])
        bonus[stop] = 3.0  # some responses stop early, some run to the limit
        engine.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + bonus)
        rows = []  # decoder calls' batch rows
        engine.model.model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape), with_kwargs=True)
        torch.manual_seed(0)
        rollouts = engine.generate(prompts, params)
        assert rows[0] == (3, max(len(p.prompt_ids) for p in prompts)) and rows[1][1] == 1  # prefill: 3 prompts, not 12
        lengths = {len(r.response_ids) for r in rollouts}
        assert min(lengths) < 12 and any(r.truncated for r in rollouts) and len(lengths) > 2
        batch = pack(rollouts)
        with torch.no_grad():
            trainer = gather_responses(batch, policy_forward(engine.model, batch, params.temperature).logp)
        for row, rollout in enumerate(rollouts):
            assert (trainer[row] - torch.tensor(rollout.logprobs)).abs().max() <= 1e-5


def test_kv_cache_argument_follows_the_installed_transformers(tiny_text, addition_data):
    """transformers 5.24 renamed the forward's KV cache `past_key_values` -> `cache` (the old
    name warns on every call, and goes in 5.40): the engine asks the model which it takes."""
    import inspect
    import warnings

    import transformers

    from vlrft.engines.hf_engine import kv_cache_name

    def new_style(input_ids, cache=None, use_cache=None): ...

    def old_style(input_ids, past_key_values=None, use_cache=None): ...

    assert kv_cache_name(type("M", (), {"forward": staticmethod(new_style)})) == "cache"
    assert kv_cache_name(type("M", (), {"forward": staticmethod(old_style)})) == "past_key_values"
    model = load_model(tiny_text)
    expected = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert kv_cache_name(model) == expected
    newer = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 24)
    assert expected == ("cache" if newer else "past_key_values"), transformers.__version__
    # A whole decode on the installed version warns about nothing.
    engine, encoder = make_engine(tiny_text)
    prompt = encoder.encode(load_rows(addition_data / "test.jsonl")[0], 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate([prompt], SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
