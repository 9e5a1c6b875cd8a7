"""On-policy distillation's teacher pass: the teacher's logprobs of the sampled tokens in a packed
micro-batch (images, shared prompts, a multi-turn response) equal the teacher's own unpacked HF
forward (fp32, 1e-5), its argmax flags and top-k tokens equal the forward's, and the experience
pass turns them into the per-token advantage and the metrics."""

import re
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


TOP_K = 5


def own_logprobs(model, rollout):
    """The teacher's HF forward on the sample alone, with its own M-RoPE positions: [R, V] its
    logprobs at TEMPERATURE at each response token, and the tokens, [R]."""
    batch = collate([rollout], pad_id=0)
    inputs = batch.model_inputs()
    extra = {}
    if hasattr(model.model, "get_rope_index"):
        extra["position_ids"], _ = model.model.get_rope_index(
            batch.input_ids, image_grid_thw=inputs.get("image_grid_thw"), attention_mask=batch.attention_mask,
            mm_token_type_ids=inputs.get("mm_token_type_ids"))
    with torch.no_grad():
        logits = model(**inputs, **extra).logits[0, :-1].float() / TEMPERATURE  # [L-1, V] predicting tokens 1..
    scored = batch.response_mask[0, 1:].bool()
    return torch.log_softmax(logits, -1)[scored], batch.input_ids[0, 1:][scored]


def own_forward(model, rollout):
    """(logprob of each response token, whether it is the argmax, [R] each; the TOP_K most likely
    tokens and their logprobs, [R, TOP_K] each) from `own_logprobs`."""
    every, targets = own_logprobs(model, rollout)
    best, ids = every.topk(TOP_K, dim=-1)
    return every.gather(-1, targets[:, None]).squeeze(-1), (every.argmax(-1) == targets).float(), ids, best


@pytest.fixture(scope="module")
def teacher(tiny_vl):
    return load_model(tiny_vl).eval()


def assert_scores_equal_own_forward(teacher, rollouts, share=False):
    batch = pack(rollouts, share=share)
    scores = teacher_scores(teacher, batch, TEMPERATURE, top_k=TOP_K)
    logp, top, top_ids, top_logp = (gather_responses(batch, t) for t in (scores.logp, scores.argmax, scores.top_ids, scores.top_logp))
    assert sum(len(r) for r in logp) > 20
    for rollout, got_logp, got_top, got_ids, got_best in zip(batch.samples, logp, top, top_ids, top_logp):
        want_logp, want_top, want_ids, want_best = own_forward(teacher, rollout)
        assert (got_logp - want_logp).abs().max() <= 1e-5
        assert torch.equal(got_top, want_top)
        assert torch.equal(got_ids, want_ids)
        assert (got_best - want_best).abs().max() <= 1e-5
    # and what the student's forward of the same model gives, the top-k tokens' logprobs too
    # (jsd mode's update forward), by the chunked head and by the full-logits path
    for keep_logits in (False, True):
        student = policy_forward(teacher, batch, TEMPERATURE, keep_logits=keep_logits, top_ids=scores.top_ids)
        torch.testing.assert_close(torch.cat(logp), torch.cat(gather_responses(batch, student.logp)), rtol=0, atol=1e-6)
        torch.testing.assert_close(student.top_logp, scores.top_logp, rtol=0, atol=1e-5)
    assert scores.top_logp[~batch.response_mask.bool()].abs().sum() == 0


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
    scores = teacher_scores(teacher, batch, TEMPERATURE)
    teacher_logp, top = gather_responses(batch, scores.logp), gather_responses(batch, scores.argmax)
    assert scores.top_ids is None  # only jsd mode asks for the top-k
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
    # jsd mode: the advantage is left alone too, and the teacher's top-k kept for the update:
    # copies (int32 ids), not views of the micro-batch's rows, which a pickled experience would
    # carry whole to another rank
    ids, best = torch.arange(100 * 3).reshape(100, 3), -torch.rand(100, 3)  # a micro-batch of 100 response tokens
    rows = {"old": student, "teacher": teacher_logp, "teacher_top": top, "teacher_topk_ids": [ids[10:35]],
            "teacher_topk_logprobs": [best[10:35]]}
    unchanged, _ = distill_experiences(DistillSettings("jsd", 2.0, 3), [experience], rows, torch.ones(1, 25), mask, 0.0)
    assert torch.equal(unchanged, torch.ones(1, 25))
    assert torch.equal(experience.teacher_topk_ids, ids[10:35].int()) and experience.teacher_topk_ids.dtype == torch.int32
    assert torch.equal(experience.teacher_topk_logprobs, best[10:35])
    for kept in (experience.teacher_topk_ids, experience.teacher_topk_logprobs):
        assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()


def test_top_k_has_the_right_dtype_without_response_tokens_and_stays_in_the_students_vocabulary(teacher, mixed_rollouts):
    # A micro-batch with no response token to score (with sequence parallelism: a shard that is
    # all prompt): the group sums every shard's rows, so their dtypes must agree.
    empty = pack([replace(mixed_rollouts[1], response_ids=[])])
    scores = teacher_scores(teacher, empty, TEMPERATURE, top_k=TOP_K)
    assert scores.top_ids.dtype == torch.long and scores.top_ids.shape == empty.input_ids.shape + (TOP_K,)
    assert scores.top_logp.dtype == torch.float32 and scores.top_logp.abs().sum() == 0
    # A teacher whose head has more rows than the student's: its top-k among the student's ids,
    # each with its logprob under the teacher's whole distribution.
    batch = pack(mixed_rollouts)
    whole = teacher_scores(teacher, batch, TEMPERATURE, top_k=TOP_K)
    student_vocab = int(whole.top_ids[batch.response_mask.bool()].min()) + 1  # cuts some teacher favourites off
    cut = teacher_scores(teacher, batch, TEMPERATURE, top_k=TOP_K, student_vocab=student_vocab)
    scored = batch.response_mask.bool()
    assert int(cut.top_ids[scored].max()) < student_vocab and not torch.equal(cut.top_ids, whole.top_ids)
    for rollout, ids, logp in zip(batch.samples, gather_responses(batch, cut.top_ids), gather_responses(batch, cut.top_logp)):
        every, _ = own_logprobs(teacher, rollout)  # [R, V] over the teacher's vocabulary
        torch.testing.assert_close(every[:, :student_vocab].topk(TOP_K, dim=-1).indices, ids)
        torch.testing.assert_close(every.gather(-1, ids), logp, rtol=0, atol=1e-5)


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


@pytest.mark.parametrize("overrides, message", [
    (["algo.distill.top_k=5"], "config key 'algo.distill.top_k' applies to algo.distill.mode jsd"),
    (["algo.distill.beta=0.1", "algo.distill.mode=loss"], "config key 'algo.distill.beta' applies to algo.distill.mode jsd"),
    (["algo.distill.mode=jsd", "algo.distill.top_k=1"], "config key 'algo.distill.top_k' must be in 2..256 (renormalised on "
                                                        "one token, both distributions are the same), got 1"),
    (["algo.distill.mode=jsd", "algo.distill.top_k=257"], "config key 'algo.distill.top_k' must be in 2..256"),
    (["algo.distill.mode=jsd", "algo.distill.beta=1.5"], "config key 'algo.distill.beta' must be in [0, 1], got 1.5"),
    (["algo.distill.mode=jsd", "teacher.url=http://t:1"], "config key 'algo.distill.mode' jsd needs a local teacher (teacher.path)"),
])
def test_jsd_config_checks(tiny_text, addition_data, overrides, message):
    from vlrft.config import load_config
    from vlrft.errors import ConfigError

    base = [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}"]
    teacher = [] if any(o.startswith("teacher.url") for o in overrides) else [f"teacher.path={tiny_text}"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, base + teacher + overrides)


def test_jsd_refuses_liger_s_head(tiny_text, addition_data):
    # (on a machine without a GPU liger is refused earlier, for want of one: checked here alone)
    from vlrft.config import load_config
    from vlrft.config_checks import _validate_top_k_distillation
    from vlrft.errors import ConfigError

    cfg = load_config(None, [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}",
                             f"teacher.path={tiny_text}", "algo.distill.mode=jsd"])
    cfg.model.fused_head = "liger"
    with pytest.raises(ConfigError, match=re.escape("config key 'algo.distill.mode' jsd needs the student's logprob of every "
                                                    "top-k token, which model.fused_head liger does not give")):
        _validate_top_k_distillation(cfg)


def test_jsd_picks_the_chunked_head_and_keeps_the_teachers_top_k(tiny_text, addition_data):
    from vlrft.config import load_config
    from vlrft.trainer.build import choose_fused_head, distill_settings

    cfg = load_config(None, [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}",
                             f"teacher.path={tiny_text}", "algo.distill.mode=jsd", "algo.distill.top_k=7"])
    cfg.model.fused_head = "liger"  # (refused with jsd at load; set past the check, still the chunked head)
    assert distill_settings(cfg).top_k == 7 and choose_fused_head(cfg, load_model(tiny_text)) == "chunked"
    cfg.algo.distill.mode = "advantage"
    assert distill_settings(cfg).top_k == 0  # the other modes ask the teacher for no top-k
