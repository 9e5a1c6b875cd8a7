"""Reward recipes that script a collapse for test_rollback.py: they pay well for a rank's first
four calls (one a step) and nothing after, as a policy that fell apart would earn. They run in
the trainer (`runs_in_trainer`), so their call counts live as long as the run's process."""

import itertools

_steps = {"task": itertools.count(1), "format": itertools.count(1)}
GOOD_STEPS = 4


def task(completions, samples):
    """0.6, 0.7, 0.8, 0.9 at steps 1-4 (rising: the peak is step 4), each completion's score
    also differing by its length so that the advantages are not all 0; 0 from step 5 on."""
    step = next(_steps["task"])
    if step > GOOD_STEPS:
        return [0.0] * len(completions)
    return [0.5 + 0.1 * step + 0.05 * (len(text) % 2) for text in completions]


def format_score(completions, samples):
    """1 at steps 1-4, then 0: the component that falls with the accuracy (the cause)."""
    step = next(_steps["format"])
    return [1.0 if step <= GOOD_STEPS else 0.0] * len(completions)


task.runs_in_trainer = True
format_score.runs_in_trainer = True
