"""`model.compile`: decoder layers and vision blocks compiled in place (CPU inductor, fp32) give
the eager model's per-token logprobs, entropies and parameter gradients to 1e-5, with gradient
checkpointing on (images included); micro-batches of ever new lengths stop recompiling after the first change."""

import copy

import torch

from tests.conftest import make_mixed_rollouts
from vlrft.models.collate import gather_responses
from vlrft.models.compiled_layers import compile_config_problem, compile_layers, compile_wanted, compiled_frames
from vlrft.models.forward import policy_forward
from vlrft.models.loader import enable_gradient_checkpointing, load_model
from vlrft.models.packing import pack
from vlrft.types import Prompt, Rollout



def stats_and_grads(model, batch):
    model.zero_grad()
    out = policy_forward(model, batch, 0.7)
    weights = torch.linspace(0.5, 1.5, out.logp.shape[1])  # every position's gradient path weighted differently
    ((out.logp * weights).sum() + (out.entropy * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return gather_responses(batch, out.logp), gather_responses(batch, out.entropy), grads


def assert_same(eager, compiled, batch):
    logp_e, entropy_e, grads_e = stats_and_grads(eager, batch)
    logp_c, entropy_c, grads_c = stats_and_grads(compiled, batch)
    assert (torch.cat(logp_e + entropy_e) - torch.cat(logp_c + entropy_c)).abs().max() <= 1e-5
    assert grads_e.keys() == grads_c.keys() and grads_e
    for name, grad in grads_e.items():
        assert (grad - grads_c[name]).norm() <= 1e-5 * grad.norm().clamp(min=1e-6), name


def test_compiled_vl_layers_equal_eager_with_images(tiny_vl, colour_data, tmp_path):
    # sdpa (the block mask) traces whole, so the checkpointed decoder layers compile: the
    # checkpoint is then recomputed inside the compiled graph.
    eager = load_model(tiny_vl, attention="sdpa").eval()
    enable_gradient_checkpointing(eager)
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled) == 2 + 2  # the tiny model's decoder layers and vision blocks
    mixed = make_mixed_rollouts(tiny_vl, colour_data, tmp_path)  # text, one image, two images
    before = compiled_frames()
    assert_same(eager, compiled, pack(mixed))
    assert compiled_frames() > before


def text_batch(seed: int, count: int):
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for i in range(count):
        ids = torch.randint(10, 500, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist()
        prompt = Prompt(id=str(i), data_source="t", answer="", meta={}, prompt_text="", prompt_ids=ids)
        rollouts.append(Rollout(prompt, i, torch.randint(10, 500, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist(), "", False))
    return pack(rollouts)


def test_new_lengths_stop_recompiling_after_the_first_change(tiny_text):
    eager = load_model(tiny_text, attention="vlrft_sdpa_segments").eval()
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    batches = [text_batch(seed, 2 + seed % 4) for seed in range(6)]
    assert len({b.input_ids.shape[1] for b in batches}) == 6 and len({len(b.seq_lengths) for b in batches}) == 4
    frames = []
    for batch in batches:
        assert_same(eager, compiled, batch)
        frames.append(compiled_frames())
    # Compiles on the first batch and once more at the first new length (then symbolic); none after.
    assert frames[1] > frames[0] and frames[-1] == frames[1], frames


def test_compile_choices():
    assert compile_config_problem("sometimes", 2).startswith("config key 'model.compile' is 'sometimes'")
    assert "train.zero_stage 3" in compile_config_problem("on", 3) and compile_config_problem("auto", 3) == ""
    assert compile_wanted("on", 2) and not compile_wanted("off", 2)
    assert compile_wanted("auto", 2) == torch.cuda.is_available() and not compile_wanted("auto", 3)
