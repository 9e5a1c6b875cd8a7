"""model.freeze_vision: the vision tower (found by attribute) gets no update; the rest does."""

import pytest
import torch

from vlrft.config import ConfigError, load_config
from vlrft.models.loader import vision_tower


def build(model, data, tmp_path, extra=()):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    return SPMDTrainer(load_config(None, [
        f"model.path={model}", f"data.train_path={data / 'train.jsonl'}", "rollout.rollout_prompts=2",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6", "train.lr=0.01", "algo.entropy_coef=0.1",
        f"output.dir={tmp_path}", *extra,
    ]))


def test_frozen_vision_tower_is_counted_and_never_moves(tiny_vl, colour_data, tmp_path, world_of_one):
    trainer = build(tiny_vl, colour_data, tmp_path, ["model.freeze_vision=true", "algo.advantage=gae", "critic.enabled=true"])
    tower = vision_tower(trainer.backend.module)
    assert trainer.frozen_vision_parameters == sum(p.numel() for p in tower.parameters()) > 0
    assert not any(p.requires_grad for p in vision_tower(trainer.critic.module.backbone).parameters())
    vision_before = [p.detach().clone() for p in tower.parameters()]
    rest_before = [p.detach().clone() for n, p in trainer.backend.module.named_parameters() if ".visual." not in f".{n}"]
    trainer.train_step()
    assert all(torch.equal(a, p) for a, p in zip(vision_before, tower.parameters()))
    rest_after = [p for n, p in trainer.backend.module.named_parameters() if ".visual." not in f".{n}"]
    assert any(not torch.equal(a, p) for a, p in zip(rest_before, rest_after))


def test_freezing_a_text_model_is_a_config_error(tiny_text, addition_data, tmp_path, world_of_one):
    with pytest.raises(ConfigError, match="'model.freeze_vision': .* has no vision tower"):
        build(tiny_text, addition_data, tmp_path, ["model.freeze_vision=true"])
