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


@pytest.mark.parametrize("kind", ["text", "image", "qwen3-vl video", "qwen2.5-vl video"])
def test_stored_logprobs_equal_trainer_forward(kind, tiny_text, vl_models, addition_data, colour_data, video_data, tmp_path, world_of_one):
    model, data = {
        "text": (tiny_text, addition_data),
        "image": (vl_models("qwen2.5-vl"), colour_data),
        "qwen3-vl video": (vl_models("qwen3-vl"), video_data),  # image, video and image+video prompts
        "qwen2.5-vl video": (vl_models("qwen2.5-vl"), video_data),
    }[kind]
    trainer = build_trainer(model, data, tmp_path, [SEVERAL_STEPS])
    torch.manual_seed(1)
    rows = trainer.train_rows[-4:] if "video" in kind else None  # the last rows hold videos
    prompts = [trainer.encoder.encode(row, pos) for pos, row in enumerate(rows)] if rows else [
        trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    if rows:
        assert sum("video_grid_thw" in p.mm_inputs for p in prompts) == 4 and sum("image_grid_thw" in p.mm_inputs for p in prompts) == 2
    experiences, _ = trainer.maker.make(prompts)
    assert len(experiences) == 12
    trainer.buffer.add(experiences)
    batches = trainer.buffer.micro_batches(shuffle=True)  # other grouping and padding than the maker's
    assert len(batches) > 1
    checked = 0
    for batch in batches:
        if kind == "image":
            # One image per prompt, 16 patches, once per micro-batch however many responses share it.
            prompts = {id(s.rollout.prompt) for s in batch.samples}
            assert batch.mm_inputs["pixel_values"].shape[0] == 16 * len(prompts) < 16 * len(batch.samples)
        with torch.no_grad():
            logp = token_logprobs(trainer.backend.model, batch, trainer.cfg.rollout.temperature)
        for got, exp in zip(gather_responses(batch, logp), batch.samples):
            assert got.dtype == torch.float32
            assert (got - exp.old_logprobs).abs().max().item() <= 1e-5
            # The reference model starts equal to the policy: same numbers, so k3 KL = 0.
            assert (exp.ref_logprobs - exp.old_logprobs).abs().max().item() <= 1e-5
            checked += 1
    assert checked == 12
