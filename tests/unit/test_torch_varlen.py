"""`model.attention: torch_varlen` on a CPU: PyTorch's varlen kernel is CUDA-only, so a
per-sample sdpa stand-in with its signature replaces it here; what is checked is everything
around it (transformers' dispatch to vlrft's attention function, sample starts, causality,
grouped heads, dtypes, the sdpa fallback for the vision tower). The real kernel on a GPU is
tests/gpu/test_flash_packing.py.
"""

import pytest
import torch
import torch.nn.functional as F

import vlrft.models.torch_varlen as torch_varlen
from tests.unit.test_varlen_attention import per_sample
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.models.collate import collate, gather_responses
from vlrft.models.packing import forward_inputs, pack
from vlrft.models.attention import resolve_attention
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.value_model import load_value_model, token_values
from vlrft.models.torch_varlen import TORCH_VARLEN
from vlrft.types import Rollout


class ReferenceVarlen:
    """torch.nn.attention.varlen.varlen_attn's signature, computed one run at a time. With
    `shared_keys` (shared-prompt micro-batches) key runs may be longer than query runs, and the
    causal window is aligned at each run's end (FlashAttention's convention); without, query
    and key runs must be the same."""

    def __init__(self, shared_keys: bool = False):
        self.shared_keys = shared_keys
        self.calls = []  # (sample starts, q dtype, window_size, q heads, kv heads)

    def __call__(self, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert self.shared_keys or torch.equal(cu_seq_q, cu_seq_k)
        assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
        starts, key_starts = cu_seq_q.tolist(), cu_seq_k.tolist()
        assert max_q == max(b - a for a, b in zip(starts, starts[1:])) and starts[-1] == q.shape[0]
        assert max_k == max(b - a for a, b in zip(key_starts, key_starts[1:])) and key_starts[-1] == k.shape[0]
        assert enable_gqa or k.shape[1] == q.shape[1]  # without GQA support the heads must match
        self.calls.append((starts, q.dtype, window_size, q.shape[1], k.shape[1]))
        out = []
        for (a, b), (c, d) in zip(zip(starts, starts[1:]), zip(key_starts, key_starts[1:])):
            allowed = torch.ones(b - a, d - c, dtype=torch.bool).tril((d - c) - (b - a)) if window_size == (-1, 0) else None
            out.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1),
                                                      attn_mask=allowed, scale=scale, enable_gqa=enable_gqa))
        return torch.cat(out, dim=1).transpose(0, 1)


def text_rollouts(tiny_text, addition_data):
    """Three text samples with 1, 30 and 9 response tokens."""
    encoder = PromptEncoder(tiny_text, 3136, 12544, 512)
    rows = load_rows(addition_data / "train.jsonl")[:3]
    return [Rollout(encoder.encode(r, i), i, [7 + i] * n, "", False) for i, (r, n) in enumerate(zip(rows, [1, 30, 9]))]


@pytest.fixture
def reference_varlen(monkeypatch):
    kernel = ReferenceVarlen()
    monkeypatch.setattr(torch_varlen, "varlen_attn", kernel)
    return kernel


def test_torch_varlen_packed_vision_language_forward_equals_per_sample(reference_varlen, mixed_rollouts, tiny_vl):
    sdpa = load_model(tiny_vl).eval()
    varlen = load_model(tiny_vl, attention=resolve_attention("torch_varlen", "bfloat16")).eval()
    assert varlen.config._attn_implementation == TORCH_VARLEN
    batch = pack(mixed_rollouts)
    assert "attention_mask" not in forward_inputs(varlen.model, batch)  # no [T, T] mask built
    with torch.no_grad():
        packed = policy_forward(varlen, batch, 1.0)
        expected = per_sample(sdpa, mixed_rollouts)
    starts = [0, *torch.tensor(batch.seq_lengths).cumsum(0).tolist()]
    config = varlen.config.text_config
    # Every decoder layer goes to the kernel, causal, with the packed starts; the vision tower's
    # windows (not causal) go to sdpa.
    assert [(s, w) for s, _, w, _, _ in reference_varlen.calls] == [(starts, (-1, 0))] * config.num_hidden_layers
    # Grouped key/value heads reach the kernel as they are where it takes them (`enable_gqa`: torch
    # 2.13 has it, 2.11 not), else repeated to one per query head.
    kv_heads = config.num_key_value_heads if torch_varlen.NATIVE_GQA else config.num_attention_heads
    assert {(h, kv) for *_, h, kv in reference_varlen.calls} == {(config.num_attention_heads, kv_heads)}
    logp, entropy = gather_responses(batch, packed.logp), gather_responses(batch, packed.entropy)
    for i, (ref_logp, ref_entropy) in enumerate(expected):
        assert (logp[i] - ref_logp).abs().max() <= 1e-5
        assert (entropy[i] - ref_entropy).abs().max() <= 1e-5


def test_torch_varlen_repeats_key_value_heads_for_kernels_without_gqa(reference_varlen, monkeypatch, tiny_text, addition_data):
    """A kernel without enable_gqa (torch 2.11): the grouped key/value heads are repeated."""
    monkeypatch.setattr(torch_varlen, "NATIVE_GQA", False)
    rollouts = text_rollouts(tiny_text, addition_data)
    sdpa, varlen = load_model(tiny_text).eval(), load_model(tiny_text, attention=TORCH_VARLEN).eval()
    with torch.no_grad():
        packed = gather_responses(pack(rollouts), policy_forward(varlen, pack(rollouts), 1.0).logp)
        expected = per_sample(sdpa, rollouts)
    heads = varlen.config.num_attention_heads
    assert varlen.config.num_key_value_heads < heads
    assert {(h, kv) for *_, h, kv in reference_varlen.calls} == {(heads, heads)}
    for got, (ref, _) in zip(packed, expected):
        assert (got - ref).abs().max() <= 1e-5


def test_torch_varlen_gets_bf16_under_bf16_compute_and_backpropagates(reference_varlen, tiny_text, addition_data):
    model = load_model(tiny_text, attention=TORCH_VARLEN, compute_dtype="bfloat16")
    out = policy_forward(model, pack(text_rollouts(tiny_text, addition_data)), 1.0)
    out.logp.sum().backward()
    assert {dtype for _, dtype, *_ in reference_varlen.calls} == {torch.bfloat16}  # rotary left q, k fp32
    assert out.logp.dtype == torch.float32
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_torch_varlen_refuses_dropout_and_sliding_windows():
    q = torch.zeros(1, 2, 3, 4)
    kwargs = {"cu_seq_lens_q": torch.tensor([0, 3], dtype=torch.int32), "max_length_q": 3}
    kwargs |= {"cu_seq_lens_k": kwargs["cu_seq_lens_q"], "max_length_k": 3}
    with pytest.raises(ValueError, match="torch_varlen supports neither attention dropout nor sliding windows"):
        torch_varlen.torch_varlen_attention(torch.nn.Identity(), q, q, q, None, dropout=0.1, **kwargs)
    with pytest.raises(ValueError, match="sliding_window 4096"):
        torch_varlen.torch_varlen_attention(torch.nn.Identity(), q, q, q, None, sliding_window=4096, **kwargs)


def test_torch_varlen_missing_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch_varlen, "varlen_attn", None)
    assert "has no torch.nn.attention.varlen (needs torch >= 2.11)" in torch_varlen.torch_varlen_missing()

    def causal_flag_kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        raise AssertionError("never called")  # torch 2.10's signature: is_causal, no window_size

    monkeypatch.setattr(torch_varlen, "varlen_attn", causal_flag_kernel)
    assert "varlen_attn predates its window_size argument (needs torch >= 2.11)" in torch_varlen.torch_varlen_missing()
    monkeypatch.setattr(torch_varlen, "varlen_attn", ReferenceVarlen())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_varlen.torch_varlen_missing() == "no CUDA GPU is visible"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla T4")
    assert torch_varlen.torch_varlen_missing() == "Tesla T4 predates Ampere (FlashAttention needs compute capability 8.0)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    assert torch_varlen.torch_varlen_missing() == ""
    # auto: flash-attn first, PyTorch's kernel without it, sdpa for fp32.
    monkeypatch.setattr("vlrft.models.attention.flash_attention_missing", lambda: "no flash-attn")
    assert resolve_attention("auto", "bfloat16") == TORCH_VARLEN
    assert resolve_attention("auto", "float32") == "sdpa"
    monkeypatch.setattr("vlrft.models.attention.flash_attention_missing", lambda: "")
    assert resolve_attention("auto", "bfloat16") == "flash_attention_2"


def test_torch_varlen_packed_critic_values_equal_per_sample(reference_varlen, mixed_rollouts, tiny_vl):
    torch.manual_seed(0)
    sdpa, varlen = load_value_model(tiny_vl).eval(), load_value_model(tiny_vl, attention=TORCH_VARLEN).eval()
    head = torch.randn_like(sdpa.value_head.weight) * 0.1
    sdpa.value_head.weight.data.copy_(head)
    varlen.value_head.weight.data.copy_(head)
    batch = pack(mixed_rollouts)
    with torch.no_grad():
        packed = gather_responses(batch, token_values(varlen, batch))
        for i, rollout in enumerate(mixed_rollouts):
            alone = collate([rollout], pad_id=0)
            assert (packed[i] - gather_responses(alone, token_values(sdpa, alone))[0]).abs().max() <= 1e-5
    assert len(reference_varlen.calls) == varlen.backbone.config.text_config.num_hidden_layers
