"""`model.fused_head`: which LM head computes logprobs and entropy, and the plumbing of Liger's
fused head around its kernel, on CPUs.

Liger-Kernel needs a CUDA GPU (tests/gpu/test_fused_head_gpu.py runs the real kernel against the
chunked head). Here a plain-PyTorch stand-in with the same arguments and outputs as
`LigerFusedLinearScaledCrossEntropyFunction` takes its place, and the tests check what vlrft
does around it: the targets and rows it passes, the temperature, the sign and dtype of what
comes back, gradients into the hidden states and the (tied) weight, the one call a rank with
nothing to score still makes, and the weight gathered under ZeRO-3.
"""

import importlib.metadata
import importlib.util
import sys

import pytest
import torch

from vlrft.config import ConfigError, load_config
from vlrft.models import fused_head
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.packing import pack
from vlrft.types import Prompt, Rollout


class LigerStandIn:
    """LigerFusedLinearScaledCrossEntropyFunction's contract in plain autograd: (input [N, H],
    weight [V, H], target [N], temperature, ignore_index, m_tiles_per_cluster, return_entropy)
    -> (nll [N] fp32, entropy [N] in the input dtype). Records each call."""

    def __init__(self):
        self.calls = []

    def apply(self, x, weight, target, temperature, ignore_index, m_tiles_per_cluster, return_entropy):
        self.calls.append(dict(tokens=x.shape[0], weight_shape=tuple(weight.shape), dtypes=(x.dtype, weight.dtype),
                               temperature=temperature, return_entropy=return_entropy, ignore_index=ignore_index))
        logits = (x @ weight.t()).float() / temperature
        lse = torch.logsumexp(logits, dim=-1)
        nll = lse - logits.gather(-1, target[:, None]).squeeze(-1)
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return nll, entropy.to(x.dtype)


@pytest.fixture
def liger(monkeypatch):
    """Liger "available" (no CUDA needed) and replaced by the stand-in."""
    stand_in = LigerStandIn()
    monkeypatch.setattr(fused_head, "liger_missing", lambda compute_dtype: "")
    monkeypatch.setattr(fused_head, "_liger_function", lambda: stand_in)
    return stand_in


def text_batch(response_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for i, length in enumerate(response_lengths):
        prompt = Prompt(id=str(i), data_source="t", answer="", meta={}, prompt_text="",
                        prompt_ids=torch.randint(10, 500, (5 + 3 * i,), generator=g).tolist(), index=i)
        rollouts.append(Rollout(prompt, i, torch.randint(10, 500, (length,), generator=g).tolist(), "", False))
    return pack(rollouts)


def forward_and_grads(model, batch, temperature):
    """policy_forward's logp and entropy, and the gradients of all parameters of an arbitrary
    use of both (the entropy as a bonus, as algo.entropy_coef uses it)."""
    model.zero_grad(set_to_none=True)
    out = policy_forward(model, batch, temperature)
    weights = torch.linspace(-1.0, 1.0, out.logp.numel()).view_as(out.logp)
    ((out.logp - 0.1 * out.entropy) * weights).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# --- which head -------------------------------------------------------------------------------

def test_auto_is_the_chunked_head_on_a_cpu():
    head = torch.nn.Linear(8, 50, bias=False)
    for dtype in ("float32", "bfloat16"):
        assert fused_head.resolve_fused_head("auto", dtype, head) == "chunked"
    assert fused_head.resolve_fused_head("chunked", "bfloat16", head) == "chunked"


def test_auto_picks_liger_only_where_its_kernel_runs(liger, monkeypatch):
    head = torch.nn.Linear(8, 50, bias=False)
    monkeypatch.setattr(fused_head, "_hopper", lambda: True)
    assert fused_head.resolve_fused_head("auto", "bfloat16", head) == "liger"
    adapted = torch.nn.Sequential(head)  # not a plain linear layer (a LoRA-adapted head)
    assert fused_head.resolve_fused_head("auto", "bfloat16", adapted) == "chunked"
    refused = "'model.fused_head' liger needs a bias-free torch.nn.Linear LM head, not torch.nn.modules.container.Sequential"
    with pytest.raises(ConfigError, match=refused):
        fused_head.resolve_fused_head("liger", "bfloat16", adapted)
    monkeypatch.setattr(fused_head, "_hopper", lambda: False)  # Liger runs its PyTorch form there
    assert fused_head.resolve_fused_head("auto", "bfloat16", head) == "chunked"
    assert fused_head.resolve_fused_head("liger", "bfloat16", head) == "liger"


@pytest.fixture
def config_args(tiny_text, addition_data, tmp_path):
    return [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", f"output.dir={tmp_path}"]


@pytest.mark.parametrize("value, message", [
    ("liger", "config key 'model.fused_head' liger needs a CUDA GPU (this machine has none)"),
    ("fused", "config key 'model.fused_head' is 'fused'; valid: auto, liger, chunked"),
])
def test_a_head_that_cannot_run_is_one_config_line(value, message, config_args):
    with pytest.raises(ConfigError) as err:
        load_config(None, config_args + [f"model.fused_head={value}", "model.compute_dtype=bfloat16"])
    assert str(err.value) == message


def test_the_config_default_is_auto(config_args):
    assert load_config(None, config_args).model.fused_head == "auto"


def fake_environment(monkeypatch, installed: dict[str, str], capability=(9, 0)):
    """CUDA present with `capability`; `installed` maps module names to distribution versions."""
    find_spec, version = importlib.util.find_spec, importlib.metadata.version
    dist_of = {"liger_kernel": "liger-kernel", "cutlass": "nvidia-cutlass-dsl"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    def fake_find_spec(name, *args):
        if name not in dist_of:
            return find_spec(name, *args)
        return object() if dist_of[name] in installed else None

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: installed[name] if name in dist_of.values() else version(name))


@pytest.mark.parametrize("installed, capability, dtype, missing", [
    ({"liger-kernel": "0.8.5", "nvidia-cutlass-dsl": "4.8.1"}, (9, 0), "float32", "needs model.compute_dtype bfloat16, not float32"),
    ({}, (9, 0), "bfloat16", "needs liger-kernel, which is not installed: pip install -e '.[gpu]'"),
    ({"liger-kernel": "0.8.1", "nvidia-cutlass-dsl": "4.8.1"}, (9, 0), "bfloat16", "needs liger-kernel >= 0.8.2 (installed: 0.8.1)"),
    ({"liger-kernel": "0.8.5"}, (9, 0), "bfloat16", "on a Hopper GPU needs nvidia-cutlass-dsl"),
    ({"liger-kernel": "0.8.5"}, (8, 0), "bfloat16", ""),  # an A100: Liger's PyTorch form needs no DSL
    ({"liger-kernel": "0.8.5", "nvidia-cutlass-dsl": "4.8.1"}, (9, 0), "bfloat16", ""),
])
def test_what_liger_lacks_is_named(installed, capability, dtype, missing, monkeypatch):
    fake_environment(monkeypatch, installed, capability)
    found = fused_head.liger_missing(dtype)
    assert found.startswith(missing) and bool(found) == bool(missing)
    problem = fused_head.fused_head_problem("liger", dtype)
    assert problem == (f"config key 'model.fused_head' liger {found}" if found else "")
    head = torch.nn.Linear(8, 50, bias=False)
    assert fused_head.resolve_fused_head("auto", dtype, head) == ("liger" if not missing and capability == (9, 0) else "chunked")


# --- Liger's head in policy_forward (the stand-in in the kernel's place) ---------------------

def test_the_liger_path_gives_the_chunked_heads_numbers_and_gradients(liger, tiny_text):
    model = load_model(tiny_text).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the head's gradient is the embedding's
    batch = text_batch([3, 1, 7, 4])
    want, want_grads = forward_and_grads(model, batch, 0.7)
    model.fused_head = fused_head.resolve_fused_head("liger", "float32", model.lm_head)
    got, got_grads = forward_and_grads(model, batch, 0.7)
    (call,) = liger.calls  # one call for the micro-batch
    vocab, hidden = model.lm_head.weight.shape
    scored = int(batch.response_mask.sum())
    assert call == dict(tokens=scored, weight_shape=(vocab, hidden), dtypes=(torch.float32, torch.float32),
                        temperature=0.7, return_entropy=True, ignore_index=-100)
    assert got.logp.dtype == got.entropy.dtype == torch.float32
    torch.testing.assert_close(got.logp, want.logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert "liger_kernel" not in sys.modules


def test_the_liger_path_casts_to_the_compute_dtype(liger, tiny_text):
    model = load_model(tiny_text, compute_dtype="bfloat16").eval()
    model.fused_head = "liger"
    out = policy_forward(model, text_batch([2, 5]), 1.0)
    assert liger.calls[0]["dtypes"] == (torch.bfloat16, torch.bfloat16)
    assert out.logp.dtype == out.entropy.dtype == torch.float32 and torch.isfinite(out.logp).all()


def test_nothing_to_score_still_makes_the_one_head_call_and_reaches_every_parameter(liger, tiny_text):
    model = load_model(tiny_text).eval()
    model.fused_head = "liger"
    batch = text_batch([0, 0])
    assert not batch.response_mask.any()
    out = policy_forward(model, batch, 1.0)
    assert [c["tokens"] for c in liger.calls] == [1]  # the dummy call, as every rank makes it
    assert (out.logp == 0).all()
    out.logp.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# --- ZeRO-3: the head weight is gathered for the kernel --------------------------------------

def test_under_zero3_the_head_weight_is_gathered_and_the_update_is_the_chunked_heads(liger, tiny_text, addition_data,
                                                                                    world_of_one, tmp_path):
    from tests.unit.test_config_wiring import RECIPE
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    (tmp_path / "recipe.py").write_text(RECIPE)
    base = [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", "rollout.rollout_prompts=2",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6", "train.lr=0.001", "train.total_steps=2",
            "algo.kl.coef=0.1", "eval.every_steps=0", "train.zero_stage=3",
            f"reward.default=[{{recipe: '{tmp_path / 'recipe.py'}:distinct_chars'}}]"]

    def update(head):
        torch.manual_seed(0)
        trainer = SPMDTrainer(load_config(None, base + [f"model.fused_head={head}", f"output.dir={tmp_path / head}"]))
        before = torch.cat([t.detach().flatten().float() for _, t in trainer.backend.named_full_parameters()])
        trainer.train_step()
        after = torch.cat([t.detach().flatten().float() for _, t in trainer.backend.named_full_parameters()])
        return trainer, after - before

    _, chunked = update("chunked")
    assert not liger.calls
    trainer, fused = update("liger")
    policy = trainer.backend.module
    assert policy.fused_head == trainer.reference.fused_head == "liger"
    assert hasattr(policy.lm_head.weight, "ds_id") and policy.lm_head.weight.numel() == 0  # partitioned outside calls
    vocab_hidden = tuple(policy.lm_head.weight.ds_shape)
    assert liger.calls and all(c["weight_shape"] == vocab_hidden for c in liger.calls)  # gathered for each call
    close = torch.isclose(fused, chunked, rtol=1e-3, atol=1e-6)
    assert chunked.abs().max() > 1e-4 and close.float().mean() > 0.999
