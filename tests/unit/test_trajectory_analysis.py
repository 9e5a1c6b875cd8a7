"""Trajectory statistics against values computed by hand."""

import pytest

from vlrft.trajectory.analysis import (
    distribution,
    per_source_accuracy,
    reflection_counts,
    repetition_score,
    summarise,
    zero_variance_group_fraction,
)


def test_repetition_score_by_hand():
    # 3-grams of "a b c a b c a": abc bca cab abc bca -> 5 grams, 2 repeats
    assert repetition_score("a b c a b c a") == pytest.approx(2 / 5)
    assert repetition_score("the cat sat on the mat") == 0.0
    assert repetition_score("go go go go go", n=1) == pytest.approx(4 / 5)
    assert repetition_score("too short") == 0.0  # no 3-gram at all
    assert repetition_score("") == 0.0


def test_zero_variance_group_fraction_by_hand():
    rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2]
    groups = [7, 7, 3, 3, 9, 9, 4]  # 7: equal, 3: spread, 9: equal, 4: single response
    assert zero_variance_group_fraction(rewards, groups) == pytest.approx(3 / 4)
    assert zero_variance_group_fraction([], []) == 0.0


def test_per_source_accuracy_by_hand():
    records = [{"data_source": "maths", "correct": 1}, {"data_source": "maths", "correct": 0},
               {"data_source": "maths", "correct": 1}, {"data_source": "colours", "correct": 0}]
    assert per_source_accuracy(records) == {"colours": 0.0, "maths": pytest.approx(2 / 3)}


def test_reflection_counts_whole_words_any_case():
    counts = reflection_counts("Wait, wait... let me check. Awaiting nothing; HOWEVER it is right. Hmm")
    assert counts["wait"] == 2 and counts["let me check"] == 1 and counts["however"] == 1 and counts["hmm"] == 1
    assert counts["verify"] == 0


def test_distribution_nearest_rank_quantiles():
    # deviations from 4: 0 -3 -1 -2 6 -> variance 50 / 5 = 10
    stats = distribution([4, 1, 3, 2, 10])
    assert stats == {"mean": 4.0, "std": pytest.approx(10 ** 0.5), "min": 1.0, "p50": 3.0, "p90": 10.0, "max": 10.0}
    assert distribution([1, 2, 3, 4])["p50"] == 2.0  # ceil(0.5 * 4) = 2nd smallest
    assert distribution([]) == {}


def test_summarise_one_step():
    records = [
        {"data_source": "a", "group_id": 0, "reward": 1.0, "components": {"exact": 1.0}, "correct": 1,
         "response_text": "x y z x y z", "response_length": 4, "truncated": False, "entropy": [0.5, 1.5]},
        {"data_source": "a", "group_id": 0, "reward": 0.0, "components": {"exact": 0.0}, "correct": 0,
         "response_text": "wait no", "response_length": 2, "truncated": True, "entropy": [1.0]},
        {"data_source": "b", "group_id": 1, "reward": 0.5, "components": {}, "correct": 1,
         "response_text": "", "response_length": 0, "truncated": False},
    ]
    s = summarise(records)
    assert s["reward/mean"] == pytest.approx(0.5) and s["reward/std"] == pytest.approx((1 / 6) ** 0.5)
    assert s["component/exact/mean"] == 0.5 and s["component/exact/std"] == 0.5
    assert s["source/a/reward_mean"] == 0.5 and s["source/b/reward_mean"] == 0.5
    assert s["source/a/accuracy"] == 0.5 and s["source/b/accuracy"] == 1.0 and s["accuracy"] == pytest.approx(2 / 3)
    assert s["length/mean"] == 2.0 and s["length/max"] == 4.0 and s["truncated_frac"] == pytest.approx(1 / 3)
    # 3-grams of "x y z x y z": xyz yzx zxy xyz -> 1 repeat of 4; the others have none
    assert s["repetition_mean"] == pytest.approx((1 / 4) / 3)
    assert s["reflection_words_per_response"] == pytest.approx(1 / 3)
    assert s["zero_variance_group_frac"] == 0.5  # group 0 spread, group 1 single
    assert s["entropy/mean"] == 1.0 and s["entropy/max"] == 1.5
    assert summarise([]) == {}


def test_step_metrics_from_tensors_equal_the_report_of_saved_records(world_of_one):
    """The trainer's `traj/` metrics (numbers and entropies exchanged as tensors) are the
    report's `summarise` of the same experiences' saved records."""
    import math

    import torch

    from vlrft.trainer.trajectory_metrics import trajectory_metrics
    from vlrft.trajectory.saver import stats_record
    from vlrft.types import Experience, Prompt, Rollout

    def experience(source, group, text, reward, components, entropy, correct, truncated=False):
        prompt = Prompt(id=str(group), data_source=source, answer="", meta={}, prompt_text="", prompt_ids=[1, 2])
        rollout = Rollout(prompt=prompt, group_id=group, response_ids=list(range(len(entropy))), response_text=text,
                          truncated=truncated)
        e = Experience(rollout, reward, components, entropy=torch.tensor(entropy))
        e.correct = correct
        return e

    experiences = [
        experience("maths", 0, "wait wait a b c a b c", 1.0, {"exact": 1.0, "format": None}, [0.5, 0.25, 2.0], 1.0),
        experience("maths", 0, "hmm no", 0.0, {"exact": 0.0, "format": 0.5}, [1.0, math.nan], 0.0, truncated=True),
        experience("colours", 3, "red", 0.5, {"exact": [0.25, 0.25]}, [0.125], 1.0),
        experience("colours", 3, "blue", math.inf, {"exact": 0.0}, [3.0, 0.75, 0.5, 1.5], 0.0),  # dropped: reward
    ]
    records = [stats_record(e, e.correct) for e in experiences]
    expected = summarise([r for r in records if r["reward"] is not None])
    got = trajectory_metrics(experiences)
    assert got == pytest.approx({f"traj/{k}": v for k, v in expected.items()}, rel=1e-6)
    assert {"traj/component/format/mean", "traj/source/colours/accuracy", "traj/entropy/p90",
            "traj/repetition_mean", "traj/reflection_words_per_response"} <= set(got)
