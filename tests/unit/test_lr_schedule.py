import math

import pytest
import torch

from vlrft.backends.deepspeed_backend import lr_scheduler


def factors(schedule: str, warmup: int, total: int) -> list[float]:
    """The lr multiplier of each of `total` optimizer steps."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = lr_scheduler(optimizer, schedule, warmup, total)
    out = []
    for _ in range(total):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_constant_schedule():
    assert factors("constant", 0, 5) == [1.0] * 5


def test_cosine_goes_from_one_to_a_tenth():
    # 0.1 + 0.45 * (1 + cos(pi * s / 4)) for s = 0..4: the floor is reached at the last step
    expected = [1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55, 0.1 + 0.45 * (1 - math.cos(math.pi / 4)), 0.1]
    assert factors("cosine", 0, 5) == pytest.approx(expected)


def test_warmup_rises_linearly_then_follows_the_schedule():
    # transformers' warm-up: step s < w runs at s / w of the lr (the first step at 0)
    assert factors("constant", 4, 6) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
    # cosine after 2 warm-up steps over the remaining steps 2..5: 0.1 + 0.45 (1 + cos(pi (s - 2) / 3))
    expected = [0.0, 0.5] + [0.1 + 0.45 * (1 + math.cos(math.pi * (s - 2) / 3)) for s in range(2, 6)]
    assert factors("cosine", 2, 6) == pytest.approx(expected)
