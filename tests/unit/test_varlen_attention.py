"""Varlen (flash-attention) packing and bf16 compute, on a CPU.

transformers' real flash-attention integration runs here with a plain-torch stand-in for the
flash-attn kernels (tests/reference_flash.py): what is checked is everything around the kernel,
i.e. that vlrft's packed inputs (sample starts, no mask, M-RoPE ids, images encoded apart) make
the varlen path give each packed sample exactly its per-sample result. The real kernel on a GPU
is tests/gpu/test_flash_packing.py.
"""

import pytest
import torch

from tests.reference_flash import reference_flash  # noqa: F401 (fixture)
from vlrft.config import ConfigError, load_config
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.models.collate import collate, gather_responses
from vlrft.models.packing import forward_inputs, pack
from vlrft.models.attention import resolve_attention, varlen_kwargs
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.sdpa_segments import SDPA_SEGMENTS
from vlrft.models.value_model import load_value_model, token_values
from vlrft.types import Rollout


def test_varlen_kwargs_are_cumulative_sample_starts():
    kwargs = varlen_kwargs([3, 1, 5])
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 4, 9] and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 5


def per_sample(model, rollouts, temperature=1.0):
    """Each rollout alone, padded collate, sdpa: the reference every packed result must match."""
    out = []
    for rollout in rollouts:
        alone = collate([rollout], pad_id=0)
        single = policy_forward(model, alone, temperature)
        out.append((gather_responses(alone, single.logp)[0], gather_responses(alone, single.entropy)[0]))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_varlen_packed_vision_language_forward_equals_per_sample(reference_flash, mixed_rollouts, tiny_vl, temperature):
    """Text, one-image and two-image samples of 1, 12 and 25 response tokens in one micro-batch."""
    sdpa = load_model(tiny_vl).eval()
    flash = load_model(tiny_vl, attention="flash_attention_2").eval()
    batch = pack(mixed_rollouts)
    inputs = forward_inputs(flash.model, batch)
    assert "attention_mask" not in inputs  # no [T, T] mask built
    with torch.no_grad():
        packed = policy_forward(flash, batch, temperature)
        expected = per_sample(sdpa, mixed_rollouts, temperature)
    starts = [0]
    for length in batch.seq_lengths:
        starts.append(starts[-1] + length)
    text_layers = flash.config.text_config.num_hidden_layers
    assert reference_flash.kernels_seen("varlen").count(starts) == text_layers  # every decoder layer, varlen
    assert len(reference_flash.kernels_seen("varlen")) > text_layers  # and the vision tower's own windows
    assert reference_flash.kernels_seen("dense") == []
    logp, entropy = gather_responses(batch, packed.logp), gather_responses(batch, packed.entropy)
    for i, (ref_logp, ref_entropy) in enumerate(expected):
        assert (logp[i] - ref_logp).abs().max() <= 1e-5
        assert (entropy[i] - ref_entropy).abs().max() <= 1e-5


def test_varlen_packed_critic_values_equal_per_sample(reference_flash, mixed_rollouts, tiny_vl):
    torch.manual_seed(0)
    sdpa = load_value_model(tiny_vl).eval()
    flash = load_value_model(tiny_vl, attention="flash_attention_2").eval()
    head = torch.randn_like(sdpa.value_head.weight) * 0.1
    sdpa.value_head.weight.data.copy_(head)
    flash.value_head.weight.data.copy_(head)
    with torch.no_grad():
        batch = pack(mixed_rollouts)
        packed = gather_responses(batch, token_values(flash, batch))
        for i, rollout in enumerate(mixed_rollouts):
            alone = collate([rollout], pad_id=0)
            assert (packed[i] - gather_responses(alone, token_values(sdpa, alone))[0]).abs().max() <= 1e-5
    assert reference_flash.kernels_seen("varlen")


def test_varlen_packed_text_gradients_equal_masked_packing(reference_flash, tiny_text, addition_data):
    """The update's backward through the varlen path equals the block-diagonal-mask path."""
    encoder = PromptEncoder(tiny_text, 3136, 12544, 512)
    rows = load_rows(addition_data / "train.jsonl")[:3]
    rollouts = [Rollout(encoder.encode(r, i), i, [7 + i] * n, "", False) for i, (r, n) in enumerate(zip(rows, [1, 30, 9]))]
    grads = {}
    for attention in ("sdpa", "flash_attention_2"):
        model = load_model(tiny_text, attention=attention)
        batch = pack(rollouts)
        out = policy_forward(model, batch, 1.0)
        (out.logp.sum() + 0.1 * out.entropy.sum()).backward()
        grads[attention] = {name: p.grad for name, p in model.named_parameters()}
        if attention == "sdpa":
            reference = per_sample(model, rollouts)
            for i, (ref_logp, _) in enumerate(reference):
                assert (gather_responses(batch, out.logp)[i] - ref_logp).abs().max() <= 1e-5
    for name, grad in grads["sdpa"].items():
        other = grads["flash_attention_2"][name]
        assert (grad - other).abs().max() <= 1e-5 * max(1.0, grad.abs().max().item()), name
    assert len(reference_flash.kernels_seen("varlen")) == load_model(tiny_text).config.num_hidden_layers


def test_bf16_compute_runs_decoder_and_head_matmul_in_bf16_and_logprobs_in_fp32(reference_flash, mixed_rollouts, tiny_vl):
    fp32 = load_model(tiny_vl).eval()
    bf16 = load_model(tiny_vl, attention="flash_attention_2", compute_dtype="bfloat16").eval()
    bf16_sdpa = load_model(tiny_vl, compute_dtype="bfloat16").eval()
    head_calls = []
    bf16.lm_head.register_forward_hook(lambda module, args, out: head_calls.append((args[0].dtype, out.dtype)))
    batch = pack(mixed_rollouts)
    with torch.no_grad():
        packed = policy_forward(bf16, batch, 1.0)
        full_vocabulary = policy_forward(bf16, batch, 1.0, keep_logits=True)  # the exact-KL path
        exact = per_sample(fp32, mixed_rollouts)
        alone_bf16 = per_sample(bf16_sdpa, mixed_rollouts)
    assert {dtype for _, _, dtype in reference_flash.calls} == {torch.bfloat16}  # kernels saw bf16
    # The LM head's matmul runs in bf16 (autocast); logsumexp, logprobs and entropy in fp32.
    assert len(head_calls) == 2 and {out for _, out in head_calls} == {torch.bfloat16}
    assert packed.logp.dtype == packed.entropy.dtype == full_vocabulary.logits.dtype == torch.float32
    assert (packed.logp - full_vocabulary.logp).abs().max() <= 1e-5
    # Packing adds no error of its own: packed bf16 is as close to exact fp32 as each sample
    # computed alone in bf16 is (a wrong boundary or position id is far larger than rounding).
    logp = gather_responses(batch, packed.logp)
    for i, ((ref, _), (single, _)) in enumerate(zip(exact, alone_bf16)):
        rounding = (single - ref).abs().max().item()
        assert 0 < rounding < 0.1
        assert (logp[i] - ref).abs().max() <= 2 * rounding + 1e-3


def test_bf16_critic_runs_its_value_head_in_fp32(mixed_rollouts, tiny_vl):
    critic = load_value_model(tiny_vl, compute_dtype="bfloat16")
    head_calls = []
    critic.value_head.register_forward_hook(lambda module, args, out: head_calls.append((args[0].dtype, out.dtype)))
    decoder_layers = []
    critic.backbone.language_model.layers[0].mlp.register_forward_hook(lambda module, args, out: decoder_layers.append(out.dtype))
    values = token_values(critic, pack(mixed_rollouts))
    values.sum().backward()
    assert decoder_layers == [torch.bfloat16] and head_calls == [(torch.float32, torch.float32)]
    assert values.dtype == torch.float32 and critic.value_head.weight.grad is not None


BASE = "model: {path: m}\ndata: {train_path: d.jsonl}\n"


@pytest.mark.parametrize("overrides, message", [
    (["model.attention=flash"], "config key 'model.attention' is 'flash'; valid: auto, sdpa, sdpa_segments, flash_attention_2, torch_varlen"),
    (["model.compute_dtype=float16"], "config key 'model.compute_dtype' is 'float16'; valid: float32, bfloat16"),
    (["model.attention=flash_attention_2"], "flash_attention_2 needs model.compute_dtype: bfloat16"),
    (["model.attention=flash_attention_2", "model.compute_dtype=bfloat16"],
     "flash_attention_2 cannot run here: no CUDA GPU is visible"),
    (["model.attention=torch_varlen"], "torch_varlen needs model.compute_dtype: bfloat16"),
    (["model.attention=torch_varlen", "model.compute_dtype=bfloat16"], "torch_varlen cannot run here: no CUDA GPU is visible"),
])
def test_attention_config_errors_name_the_key(tmp_path, overrides, message):
    if torch.cuda.is_available():
        pytest.skip("the last case describes a machine without a GPU")
    (tmp_path / "cfg.yaml").write_text(BASE)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(tmp_path / "cfg.yaml", overrides)
    assert "\n" not in str(err.value)


def test_auto_attention_falls_back_to_sdpa_segments_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("describes a machine without a GPU")
    (tmp_path / "cfg.yaml").write_text(BASE)
    cfg = load_config(tmp_path / "cfg.yaml", ["model.compute_dtype=bfloat16"])
    assert cfg.model.attention == "auto"
    assert resolve_attention(cfg.model.attention, cfg.model.compute_dtype) == SDPA_SEGMENTS
    assert resolve_attention("auto", "float32") == SDPA_SEGMENTS  # flash-attention never runs fp32


def test_training_step_with_varlen_attention_matches_masked_packing(
    reference_flash, monkeypatch, tiny_vl, colour_data, tmp_path, world_of_one
):
    """A whole in-process RL step (rollouts, experience pass with reference, update) with
    model.attention flash_attention_2 moves the parameters as the sdpa-mask run does."""
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    monkeypatch.setattr("vlrft.models.attention.flash_attention_missing", lambda: "")
    (tmp_path / "recipe.py").write_text(
        "def distinct_chars(completions, samples):\n    return [len(set(c)) / 10 for c in completions]\n"
    )
    updates = {}
    for attention in ("sdpa", "flash_attention_2"):
        cfg = load_config(None, [
            f"model.path={tiny_vl}", f"data.train_path={colour_data / 'train.jsonl'}",
            f"model.attention={attention}", "model.compute_dtype=bfloat16",
            "rollout.rollout_prompts=2", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6",
            "train.micro_batch_tokens=200", "train.lr=0.001", "algo.kl.coef=0.1", f"output.dir={tmp_path / attention}",
            "critic.enabled=true", "algo.advantage=gae",
            f"reward.default=[{{recipe: '{tmp_path / 'recipe.py'}:distinct_chars'}}]",
        ])
        trainer = SPMDTrainer(cfg)
        for model in (trainer.backend.module, trainer.reference, trainer.critic.module.backbone):
            assert model.config._attn_implementation == attention
        assert trainer.reference.compute_dtype == trainer.critic.module.compute_dtype == torch.bfloat16
        before = torch.cat([p.detach().flatten().clone() for p in trainer.backend.module.parameters()])
        metrics = trainer.train_step()
        after = torch.cat([p.detach().flatten() for p in trainer.backend.module.parameters()])
        updates[attention] = (after - before, metrics)
    layers = trainer.backend.module.config.text_config.num_hidden_layers
    assert len(reference_flash.kernels_seen("varlen")) >= 3 * layers  # policy, reference and critic forwards
    masked, varlen = updates["sdpa"][0], updates["flash_attention_2"][0]
    assert masked.abs().max() > 0
    cosine = torch.nn.functional.cosine_similarity(masked, varlen, dim=0).item()
    assert cosine > 0.99, cosine  # bf16 rounding apart (0.997 measured); unrelated updates give ~0
    masked_metrics, varlen_metrics = updates["sdpa"][1], updates["flash_attention_2"][1]
    assert masked_metrics["train/grad_norm"] > 0  # something to learn
    assert masked_metrics["rollout/reward_mean"] == varlen_metrics["rollout/reward_mean"]  # same rollouts
    assert varlen_metrics["train/grad_norm"] == pytest.approx(masked_metrics["train/grad_norm"], rel=0.02)


def test_flash_attention_missing_names_what_is_missing(monkeypatch):
    import importlib.util

    import transformers.utils

    from vlrft.models.attention import flash_attention_missing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash_attention_missing() == "no CUDA GPU is visible"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "flash-attn package is not installed" in flash_attention_missing()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert "not one transformers can use" in flash_attention_missing()
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla T4")
    assert flash_attention_missing() == "Tesla T4 predates Ampere (flash-attention 2 needs compute capability 8.0)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    assert flash_attention_missing() == ""
    assert resolve_attention("auto", "bfloat16") == "flash_attention_2" and resolve_attention("auto", "float32") == "sdpa"
