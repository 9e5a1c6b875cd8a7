"""The image-token check names a sample whose image tokens do not match its pixel patches."""

from transformers import AutoConfig

from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.experience.checks import ImageTokenCheck
from vlrft.types import Rollout


def test_image_token_check(tiny_vl, tiny_text, colour_data):
    assert ImageTokenCheck.for_model(AutoConfig.from_pretrained(tiny_text)) is None  # text model
    check = ImageTokenCheck.for_model(AutoConfig.from_pretrained(tiny_vl))
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    prompt = encoder.encode(load_rows(colour_data / "train.jsonl")[0], 0)
    good = Rollout(prompt, 0, [5, 6], "", False)
    # 56 x 56 image, 14-pixel patches: grid 1 x 4 x 4 = 16 patches, merged 2 x 2 -> 4 tokens.
    assert prompt.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4]] and check.problem(good) is None
    generated_pad = Rollout(prompt, 0, [5, check.image_token_id], "", False)  # a sampled <|image_pad|>
    assert check.problem(generated_pad) == (
        "sample 'color_shapes-train-00000' has 5 image tokens but its images give 4 (image_grid_thw)"
    )
    assert check.first_problem([good, generated_pad, good]) == check.problem(generated_pad)


def test_experience_pass_drops_and_counts_a_bad_rollout(tiny_vl, colour_data, tmp_path, world_of_one, capsys):
    from tests.unit.test_logprob_consistency import SEVERAL_STEPS, build_trainer

    trainer = build_trainer(tiny_vl, colour_data, tmp_path, [SEVERAL_STEPS])  # KL on: rollout/kl is reported too
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    scored = trainer.maker.generate_and_score(prompts)
    scored[0].rollout.response_ids = scored[0].rollout.response_ids + [trainer.image_check.image_token_id]
    experiences, metrics = trainer.maker.finish(scored)
    assert len(experiences) == len(scored) - 1 and scored[0] not in experiences
    assert metrics["rollout/skipped_samples"] == 1 and "rollout/kl" in metrics
    assert f"dropping a rollout: sample {scored[0].rollout.prompt.id!r} has 5 image tokens" in capsys.readouterr().out
