"""On-policy distillation's teacher pass: the teacher's logprobs of the sampled tokens in a packed
micro-batch (images, shared prompts, a multi-turn response) equal the teacher's own unpacked HF
forward (fp32, 1e-5), its argmax flags equal the forward's, and the experience pass turns them
into the per-token advantage and the metrics."""

from dataclasses import replace

import pytest
import torch

from tests.conftest import make_mixed_rollouts
from tests.unit.test_shared_prefix import groups_of
from vlrft.experience.distillation import DistillSettings, distill_experiences
from vlrft.models.collate import collate, gather_responses
from vlrft.models.forward import policy_forward, teacher_scores
from vlrft.models.loader import load_model
from vlrft.models.packing import pack
from vlrft.models.teacher import teacher_problem
from vlrft.types import Experience

TEMPERATURE = 0.7


def own_forward(model, rollout):
    """The teacher's HF forward on the sample alone, with its own M-RoPE positions: (logprob of
    each response token at TEMPERATURE, whether it is the argmax), [R] each."""
    batch = collate([rollout], pad_id=0)
    inputs = batch.model_inputs()
    extra = {}
    if hasattr(model.model, "get_rope_index"):
        extra["position_ids"], _ = model.model.get_rope_index(
            batch.input_ids, image_grid_thw=inputs.get("image_grid_thw"), attention_mask=batch.attention_mask,
            mm_token_type_ids=inputs.get("mm_token_type_ids"))
    with torch.no_grad():
        logits = model(**inputs, **extra).logits[0, :-1].float() / TEMPERATURE  # [L-1, V] predicting tokens 1..
    targets = batch.input_ids[0, 1:]
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    scored = batch.response_mask[0, 1:].bool()
    return logp[scored], (logits.argmax(-1) == targets).float()[scored]


@pytest.fixture(scope="module")
def teacher(tiny_vl):
    return load_model(tiny_vl).eval()


def assert_scores_equal_own_forward(teacher, rollouts, share=False):
    batch = pack(rollouts, share=share)
    logp, top = teacher_scores(teacher, batch, TEMPERATURE)
    logp, top = gather_responses(batch, logp), gather_responses(batch, top)
    assert sum(len(r) for r in logp) > 20
    for rollout, got_logp, got_top in zip(batch.samples, logp, top):
        want_logp, want_top = own_forward(teacher, rollout)
        assert (got_logp - want_logp).abs().max() <= 1e-5
        assert torch.equal(got_top, want_top)
    # and what the student's forward of the same model gives
    torch.testing.assert_close(torch.cat(logp), torch.cat(gather_responses(batch, policy_forward(teacher, batch, TEMPERATURE).logp)),
                               rtol=0, atol=1e-6)


def test_teacher_scores_equal_its_own_forward_with_images_and_shared_prompts(teacher, tiny_vl, colour_data, tmp_path):
    mixed = make_mixed_rollouts(tiny_vl, colour_data, tmp_path)  # text, one image, two images
    assert_scores_equal_own_forward(teacher, mixed)
    assert_scores_equal_own_forward(teacher, [r for r in groups_of(mixed[1:], 3) if r.response_ids], share=True)


def test_a_multi_turn_response_is_scored_whole_and_distilled_on_its_own_tokens(teacher, mixed_rollouts):
    # The middle five tokens of the response are an environment's observation: the teacher
    # reads them (they are in the sequence) but the student is not pulled on them.
    turns = replace(mixed_rollouts[2], trained=[1] * 10 + [0] * 5 + [1] * 10)
    assert_scores_equal_own_forward(teacher, [turns])
    batch = pack([turns])
    teacher_logp, top = (gather_responses(batch, t) for t in teacher_scores(teacher, batch, TEMPERATURE))
    student = [teacher_logp[0] + 0.5]  # a student half a nat more sure of every token than the teacher
    experience = Experience(turns, 0.0, {})
    mask = turns.trained_mask()[None]
    advantages, metrics = distill_experiences(
        DistillSettings("advantage", 2.0), [experience], {"old": student, "teacher": teacher_logp, "teacher_top": top},
        torch.zeros(1, 25), mask, teacher_seconds=0.25)
    torch.testing.assert_close(advantages, -2.0 * 0.5 * mask)  # -coef * d on the student's own tokens
    assert metrics["distill/reverse_kl"] == pytest.approx(0.5)
    assert metrics["distill/teacher_argmax_match"] == pytest.approx(float((top[0] * mask[0]).sum() / 20))
    assert metrics["distill/teacher_seconds"] == 0.25 and experience.teacher_logprobs is teacher_logp[0]
    # loss mode: the advantage is left alone, the teacher's logprobs are kept for the update
    unchanged, _ = distill_experiences(DistillSettings("loss", 2.0), [experience],
                                       {"old": student, "teacher": teacher_logp, "teacher_top": top},
                                       torch.ones(1, 25), mask, teacher_seconds=0.0)
    assert torch.equal(unchanged, torch.ones(1, 25))


def test_teacher_checks(tiny_vl, tiny_text, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    assert teacher_problem(tiny_vl, tiny_vl) == "" and teacher_problem(tiny_text, tiny_vl) == ""
    assert teacher_problem(tiny_vl, tiny_text) == (
        f"teacher.path {tiny_text} has no vision tower, and model.path {tiny_vl} is a vision-language model: "
        "the teacher must see the student's images")
    other = shutil.copytree(tiny_text, tmp_path / "other_tokens")
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<teacher_only>"])
    tokenizer.save_pretrained(other)
    assert teacher_problem(tiny_text, str(other)).startswith(
        f"teacher.path {other} and model.path {tiny_text} have different tokenizer vocabularies")
    assert "'<teacher_only>' as id" in teacher_problem(tiny_text, str(other))
