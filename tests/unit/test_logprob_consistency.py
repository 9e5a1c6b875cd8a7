"""Acceptance: experience-maker logprobs equal the trainer's forward before the first update."""

import pytest
import torch

from vlrft.config import load_config
from vlrft.models.collate import gather_responses
from vlrft.models.forward import token_logprobs


# Two epochs per batch: the experience pass computes the old logprobs itself (with one optimizer
# step per batch the update's forward supplies them; tests/unit/test_old_from_update.py).
SEVERAL_STEPS = "train.ppo_epochs=2"


def build_trainer(model_path, data_dir, tmp_path, extra=()):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    cfg = load_config(
        None,
        [
            f"model.path={model_path}",
            f"data.train_path={data_dir / 'train.jsonl'}",
            "rollout.rollout_prompts=4",
            "rollout.n_samples_per_prompt=3",
            "rollout.max_new_tokens=6",
            "rollout.temperature=0.7",
            "train.micro_batch_tokens=150",  # several micro-batches of different widths
            "train.zero_stage=0",
            "algo.kl.coef=0.1",
            f"output.dir={tmp_path / 'run'}",
            *extra,
        ],
    )
    return SPMDTrainer(cfg)


@pytest.mark.parametrize("kind", ["text", "image"])
def test_stored_logprobs_equal_trainer_forward(kind, tiny_text, tiny_vl, addition_data, colour_data, tmp_path, world_of_one):
    model, data = (tiny_text, addition_data) if kind == "text" else (tiny_vl, colour_data)
    trainer = build_trainer(model, data, tmp_path, [SEVERAL_STEPS])
    torch.manual_seed(1)
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    experiences, _ = trainer.maker.make(prompts)
    assert len(experiences) == 12
    trainer.buffer.add(experiences)
    batches = trainer.buffer.micro_batches(shuffle=True)  # other grouping and padding than the maker's
    assert len(batches) > 1
    checked = 0
    for batch in batches:
        if kind == "image":
            assert batch.mm_inputs["pixel_values"].shape[0] == 16 * len(batch.samples)
        with torch.no_grad():
            logp = token_logprobs(trainer.backend.model, batch, trainer.cfg.rollout.temperature)
        for got, exp in zip(gather_responses(batch, logp), batch.samples):
            assert got.dtype == torch.float32
            assert (got - exp.old_logprobs).abs().max().item() <= 1e-5
            # The reference model starts equal to the policy: same numbers, so k3 KL = 0.
            assert (exp.ref_logprobs - exp.old_logprobs).abs().max().item() <= 1e-5
            checked += 1
    assert checked == 12
