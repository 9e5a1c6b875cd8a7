"""`train.mini_batches`: K optimizer steps per pass over the rollout batch, each normalised on its
own, equal to K hand-split updates; K = 1 is the whole-batch update."""

import torch

from tests.unit.test_logprob_consistency import build_trainer
from vlrft.models.packing import prompt_groups
from vlrft.trainer.build import update_settings
from vlrft.trainer.update import policy_update


def scored_prompts(trainer):
    """Generated and scored experiences, with rewards that differ within groups (non-zero advantages)."""
    torch.manual_seed(1)
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    scored = trainer.maker.generate_and_score(prompts)
    for i, e in enumerate(scored):
        e.reward = float(i % 5)
    return scored


def scored_experiences(trainer):
    return trainer.maker.finish(scored_prompts(trainer))[0]


def update(trainer, experiences) -> dict:
    trainer.buffer.clear()
    trainer.buffer.add(experiences)
    return policy_update(trainer.backend, trainer.buffer, update_settings(trainer.cfg), trainer.kl_controller.coef, trainer.reference)


def parameters(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.backend.module.parameters()])


def test_four_mini_batches_equal_four_hand_split_updates(tiny_text, addition_data, tmp_path, world_of_one):
    extra = ["train.lr=0.001", "train.micro_batch_tokens=60"]
    split = build_trainer(tiny_text, addition_data, tmp_path / "split", [*extra, "train.mini_batches=4"])
    experiences = scored_experiences(split)
    assert len(experiences) == 12
    shuffle = split.buffer.generator.get_state()
    start = parameters(split)
    metrics = update(split, experiences)
    assert metrics["train/optimizer_steps"] == 4.0

    # By hand: the same shuffle (of whole groups: shared prompts keep a group's responses side by
    # side), cut into 4 consecutive runs of 3, one whole-batch update each.
    by_hand = build_trainer(tiny_text, addition_data, tmp_path / "by_hand", extra)
    assert torch.equal(parameters(by_hand), start)
    groups = prompt_groups(experiences, split.cfg.train.share_prompts)
    assert split.cfg.train.share_prompts and len(groups) == 4
    order = [i for g in torch.randperm(len(groups), generator=torch.Generator().set_state(shuffle)).tolist() for i in groups[g]]
    for k in range(4):
        assert update(by_hand, [experiences[i] for i in order[3 * k : 3 * k + 3]])["train/optimizer_steps"] == 1.0
    # Only the summation order inside a mini-batch differs (another micro-batch grouping); Adam
    # normalises each step, so a few parameters with near-zero gradients move on that noise.
    hand_gap = (parameters(split) - parameters(by_hand)).abs()
    whole = build_trainer(tiny_text, addition_data, tmp_path / "whole", extra)
    update(whole, experiences)
    whole_gap = (parameters(whole) - parameters(split)).abs()
    assert (hand_gap > 1e-6).float().mean() < 1e-3 and hand_gap.max() < 1e-4
    # The whole-batch update is another update (the comparison above can fail).
    assert (whole_gap > 1e-6).float().mean() > 0.1 and whole_gap.max() > 1e-3


def test_one_mini_batch_is_the_whole_batch_update(tiny_text, addition_data, tmp_path, world_of_one):
    runs = []
    for name, extra in (("default", []), ("one", ["train.mini_batches=1"])):
        trainer = build_trainer(tiny_text, addition_data, tmp_path / name, ["train.lr=0.001", "train.ppo_epochs=2", *extra])
        metrics = update(trainer, scored_experiences(trainer))
        assert metrics["train/optimizer_steps"] == 2.0
        runs.append(parameters(trainer))
    assert torch.equal(runs[0], runs[1])


def test_a_rank_with_fewer_samples_than_mini_batches_gets_dummy_micro_batches(tiny_text, addition_data, tmp_path,
                                                                            world_of_one, monkeypatch):
    import vlrft.models.packing as packing

    trainer = build_trainer(tiny_text, addition_data, tmp_path, ["train.mini_batches=4"])
    experiences = scored_experiences(trainer)[:2]
    trainer.buffer.add(experiences)
    monkeypatch.setattr(packing, "all_reduce_max_int", lambda n: max(n, 1))  # a peer has a micro-batch in each
    plan = trainer.buffer.mini_batches(4, shuffle=True)
    assert len(plan) == 4 and [len(mb) for mb in plan] == [1, 1, 1, 1]
    assert sorted(mb[0].dummy for mb in plan) == [False, False, True, True]
    assert all(mb[0].input_ids.shape == (1, 1) for mb in plan if mb[0].dummy)  # one token, not a repeat
    assert {id(s) for mb in plan for b in mb if not b.dummy for s in b.samples} == {id(e) for e in experiences}
