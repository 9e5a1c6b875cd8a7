"""LoRA policies (model.lora): only adapters train, the reference is the base model with the
adapters off (no second copy), the engine and the export get merged weights, and the adapter
export loads in peft."""

import pytest
import torch
from peft import PeftModel

from vlrft.config import ConfigError, load_config
from vlrft.models.forward import token_logprobs
from vlrft.models.loader import load_model
from vlrft.models.lora import BaseModelView, add_lora, adapters_disabled, dropout_active, merged_weights, optimizer_groups
from vlrft.models.packing import pack

from tests.unit.test_freeze_vision import build


def randomise_adapters(model, seed=0):
    """peft starts B at 0 (adapted = base); random B makes the adapters matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_weights_equal_the_adapted_model_and_adapters_off_equal_the_base(tiny_text):
    base = load_model(tiny_text)
    adapted = load_model(tiny_text)
    scalings = add_lora(adapted, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    assert set(scalings.values()) == {2.0} and len(scalings) == 3 * base.config.num_hidden_layers
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    randomise_adapters(adapted)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])

    merged = dict(merged_weights(adapted.named_parameters(), scalings))
    assert set(merged) == {n for n, _ in base.named_parameters()}  # the plain model's names
    plain = load_model(tiny_text)
    plain.load_state_dict(merged, strict=False)
    torch.testing.assert_close(logits(plain, ids), logits(adapted, ids), atol=1e-5, rtol=1e-5)
    # The merge is W + (alpha / rank) * B @ A, by hand for one layer.
    q = adapted.model.layers[0].self_attn.q_proj
    by_hand = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], by_hand)
    assert not torch.allclose(logits(base, ids), logits(adapted, ids), atol=1e-3)

    with adapters_disabled(adapted):
        torch.testing.assert_close(logits(adapted, ids), logits(base, ids))
    assert all(p.requires_grad for n, p in adapted.named_parameters() if n in trainable)  # switch left grads alone
    assert not torch.allclose(logits(base, ids), logits(adapted, ids), atol=1e-3)  # adapters back on


def test_dropout_is_active_only_inside_its_context(tiny_text):
    model = load_model(tiny_text)
    add_lora(model, rank=4, alpha=8.0, dropout=0.5, target_modules=["q_proj"])
    randomise_adapters(model)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    assert torch.equal(logits(model, ids), logits(model, ids))  # eval mode: deterministic
    with dropout_active(model, True):
        torch.manual_seed(0)
        first = logits(model, ids)
        torch.manual_seed(1)
        assert not torch.allclose(first, logits(model, ids))
    assert torch.equal(logits(model, ids), logits(model, ids))


def test_bad_targets_are_one_line_errors(tiny_vl):
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['no_such_proj'\]: .*not found"):
        add_lora(load_model(tiny_vl), rank=4, alpha=8.0, dropout=0.0, target_modules=["no_such_proj"])
    with pytest.raises(ValueError, match="embed_tokens is a Embedding; vlrft trains LoRA on linear and Conv3d layers only"):
        add_lora(load_model(tiny_vl), rank=4, alpha=8.0, dropout=0.0, target_modules=["embed_tokens"])


def test_the_patch_embedding_conv_takes_an_adapter_and_merges_exactly(tiny_vl, mixed_rollouts):
    # The vision patch embedding is a Conv3d (kernel = stride = one patch): its adapter is a
    # rank-r patch conv then a 1x1x1 conv, merged as B @ A over the flattened kernel.
    adapted = load_model(tiny_vl)
    scalings = add_lora(adapted, rank=4, alpha=8.0, dropout=0.0, target_modules=["patch_embed.proj", "q_proj"])
    assert "model.visual.patch_embed.proj" in scalings
    randomise_adapters(adapted, seed=3)
    merged = dict(merged_weights(adapted.named_parameters(), scalings))
    plain = load_model(tiny_vl)
    plain.load_state_dict(merged, strict=False)
    conv = adapted.model.visual.patch_embed.proj
    by_hand = conv.base_layer.weight + 2.0 * torch.einsum("or,rcthw->octhw", conv.lora_B["default"].weight.flatten(1),
                                                           conv.lora_A["default"].weight)
    torch.testing.assert_close(merged["model.visual.patch_embed.proj.weight"], by_hand)
    batch = pack(mixed_rollouts[1:2])  # an image prompt
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(plain, batch, 1.0), token_logprobs(adapted, batch, 1.0), atol=1e-5, rtol=1e-5)
        with adapters_disabled(adapted):
            torch.testing.assert_close(token_logprobs(adapted, batch, 1.0), token_logprobs(load_model(tiny_vl), batch, 1.0))


@pytest.mark.parametrize("overrides, message", [
    (["model.lora.rank=-1"], "'model.lora.rank' must be >= 0"),
    (["model.lora.alpha=32"], r"'model.lora.\*' apply to LoRA training"),
    (["model.lora.rank=8", "model.lora.dropout=1.0"], r"'model.lora.dropout' must be in \[0, 1\)"),
    (["model.lora.lr_ratio=16"], r"'model.lora.\*' apply to LoRA training"),
    (["model.lora.rank=8", "model.lora.lr_ratio=0"], "'model.lora.lr_ratio' must be > 0"),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], "must name at least one module"),
    (["model.lora.rank=8", "model.ref_path=/x"], "'model.ref_path' cannot be combined with model.lora"),
    (["model.lora.rank=8", "algo.kl.coef=0.1", "algo.kl.ref_ema_eta=0.1"], "'algo.kl.ref_ema_eta' cannot be combined"),
])
def test_lora_config_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.path=/m", "data.train_path=/d.jsonl", *overrides])


def test_trainer_reference_is_the_policy_with_adapters_off(tiny_vl, colour_data, tmp_path, world_of_one):
    trainer = build(tiny_vl, colour_data, tmp_path, [
        "model.lora.rank=4", "model.lora.alpha=8", "algo.kl.coef=0.05", "train.lr=0.05",
        "model.lora.target_modules=[q_proj, v_proj, gate_proj]",
    ])
    policy = trainer.backend.module
    # No second model in memory: the reference owns no parameters, it is a view of the policy.
    assert isinstance(trainer.reference, BaseModelView) and not isinstance(trainer.reference, torch.nn.Module)
    assert trainer.reference.module is policy
    base_before = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # Adapters start at B = 0, so the first rollouts come from the base model itself.
    metrics = trainer.train_step()
    assert metrics["rollout/kl"] == 0.0
    metrics = trainer.train_step()
    assert metrics["rollout/kl"] != 0.0, "the adapters did not move the policy away from its base"
    assert all(torch.equal(p, base_before[n]) for n, p in policy.named_parameters() if n in base_before)

    # Reference logprobs are the untouched base checkpoint's; the engine holds the merged policy.
    batch = pack(trainer.buffer.items[:4])
    base = load_model(tiny_vl)
    temperature = trainer.cfg.rollout.temperature
    torch.testing.assert_close(token_logprobs(trainer.reference, batch, temperature), token_logprobs(base, batch, temperature))
    torch.testing.assert_close(token_logprobs(trainer.engine.model, batch, temperature),
                               token_logprobs(policy, batch, temperature), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(token_logprobs(base, batch, temperature), token_logprobs(policy, batch, temperature), atol=1e-4)


def test_export_is_merged_and_the_adapter_loads_in_peft(tiny_text, addition_data, tmp_path, world_of_one):
    trainer = build(tiny_text, addition_data, tmp_path, ["model.lora.rank=4", "train.total_steps=2", "eval.every_steps=0"])
    trainer.train()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    merged = load_model(str(tmp_path / "final"))
    with_adapter = PeftModel.from_pretrained(load_model(tiny_text), str(tmp_path / "final" / "adapter"))
    torch.testing.assert_close(logits(with_adapter, ids), logits(merged, ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(load_model(tiny_text), ids), logits(merged, ids), atol=1e-4)


def test_lora_checkpoint_resumes_the_adapters(tiny_text, addition_data, tmp_path, world_of_one):
    first = build(tiny_text, addition_data, tmp_path, ["model.lora.rank=4", "train.total_steps=1", "eval.every_steps=0",
                                                       "checkpoint.save_steps=1"])
    first.train()
    adapters = {n: p.detach().clone() for n, p in first.backend.module.named_parameters() if p.requires_grad}
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # B moved off zero
    resumed = build(tiny_text, addition_data, tmp_path, ["model.lora.rank=4", "train.total_steps=2", "eval.every_steps=0",
                                                         "checkpoint.save_steps=1"])
    assert resumed.global_step == 1
    for name, p in resumed.backend.module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, adapters[name]), name
    metrics = resumed.train_step()
    assert metrics["train/grad_norm"] > 0


def test_lora_plus_moves_the_b_matrices_at_lr_times_the_ratio(tiny_text, addition_data, tmp_path, world_of_one):
    trainer = build(tiny_text, addition_data, tmp_path, [
        "model.lora.rank=4", "model.lora.lr_ratio=8", "train.lr=0.01", "train.weight_decay=0.0",
        "train.lr_schedule=cosine", "train.total_steps=4", "eval.every_steps=0",
    ])
    policy = trainer.backend.module
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    trainer.train_step()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in policy.named_parameters() if p.requires_grad}
    # Adam's first step moves an element by lr * g / (|g| + eps), about lr. B starts at 0, so
    # only B has a gradient in step 1: B by 0.01 x 8, A not at all.
    b_moves = [m for n, m in moved.items() if "lora_B" in n]
    assert b_moves and all(m == pytest.approx(0.08, rel=0.01) for m in b_moves)
    assert all(m == 0 for n, m in moved.items() if "lora_A" in n)
    # The schedule scales both groups alike: B's lr stays 8x A's (train.lr's) as it decays.
    trainer.train_step()
    a_lr, b_lr = (g["lr"] for g in trainer.backend.engine.optimizer.param_groups)
    assert a_lr < 0.01 and b_lr == pytest.approx(8 * a_lr) and trainer.backend.lr == a_lr
    # Plain LoRA keeps one group, as its checkpoints (written before lr_ratio existed) have.
    assert [len(g["params"]) for g in optimizer_groups(policy, 0.01, 1.0)] == [len(moved)]
