"""Partial rollouts in the HF engine: new weights arrive mid-response, the responses in flight
go on under them, and each token's recorded logprob is that of the weights that sampled it."""

import torch

from tests.unit.test_engine import make_engine
from vlrft.data.dataset import load_rows
from vlrft.engines import SamplingParams
from vlrft.models.collate import gather_responses
from vlrft.models.forward import policy_forward
from vlrft.models.packing import pack

SWITCH_AFTER = 3  # decoding steps under the first weights (tokens 0..3)


def scored(engine, rollouts, temperature):
    """Per-token logprobs of `rollouts` under the weights `engine` holds (the trainer's forward)."""
    batch = pack(rollouts)
    with torch.no_grad():
        return gather_responses(batch, policy_forward(engine.model, batch, temperature).logp)


def test_tokens_before_and_after_a_mid_response_update_carry_their_own_weights_logprobs(
        tiny_text, tiny_vl, mixed_rollouts, addition_data):
    text_engine, encoder = make_engine(tiny_text, banned=False)
    text_prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:3])]
    vl_engine, _ = make_engine(tiny_vl, banned=False)  # M-RoPE prompts with images
    params = SamplingParams(n=3, max_new_tokens=10, temperature=0.8)
    for engine, prompts in ((text_engine, text_prompts), (vl_engine, [r.prompt for r in mixed_rollouts])):
        old = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        torch.manual_seed(1)
        new = {n: t + 0.05 * torch.randn_like(t) for n, t in old.items()}  # an update that moves logprobs
        steps = []

        def new_weights():
            steps.append(len(steps))
            if len(steps) == SWITCH_AFTER + 1:
                engine.update_weights(new.items())
                return True
            return False

        engine.new_weights = new_weights
        torch.manual_seed(0)
        rollouts = engine.generate(prompts, params)
        long = [r for r in rollouts if len(r.response_ids) > SWITCH_AFTER + 1]
        assert long, "no response ran past the update"
        under_new = scored(engine, long, params.temperature)
        engine.update_weights(old.items())
        under_old = scored(engine, long, params.temperature)
        for rollout, before, after in zip(long, under_old, under_new):
            recorded = torch.tensor(rollout.logprobs)
            split = SWITCH_AFTER + 1
            assert (recorded[:split] - before[:split]).abs().max() <= 1e-5
            assert (recorded[split:] - after[split:]).abs().max() <= 1e-5
            # The two weights really differ on these tokens: the check above could not pass by accident.
            assert (before[split:] - after[split:]).abs().max() > 1e-3


def test_a_version_without_tensors_keeps_the_cache(tiny_text, addition_data):
    """A frozen actor's version changes no weight: the responses in flight go on from their
    cache (one prefill), and sample exactly what they would without the version."""
    engine, encoder = make_engine(tiny_text, banned=False)
    prompts = [encoder.encode(r, i) for i, r in enumerate(load_rows(addition_data / "test.jsonl")[:2])]
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8)
    prefills = []
    prefill = engine._prefill
    engine._prefill = lambda batch: prefills.append(len(batch)) or prefill(batch)  # a spy: counts, then prefills
    torch.manual_seed(0)
    plain = engine.generate(prompts, params)
    assert len(prefills) == 1

    def empty_version():
        engine.update_weights(iter([]))
        return True

    engine.new_weights, prefills[:] = empty_version, []
    torch.manual_seed(0)
    taken = engine.generate(prompts, params)
    assert len(prefills) == 1 and engine.loads == 0
    assert [r.response_ids for r in taken] == [r.response_ids for r in plain]
    assert [r.logprobs for r in taken] == [r.logprobs for r in plain]
    assert max(len(r.response_ids) for r in plain) > 2  # decoding steps ran, and polled
