import math

import pytest

from vlrft.backends.deepspeed_backend import lr_factor


def test_constant_schedule():
    assert [lr_factor("constant", 5)(s) for s in range(5)] == [1.0] * 5


def test_cosine_goes_from_one_to_a_tenth():
    f = lr_factor("cosine", 5)
    # 0.1 + 0.45 * (1 + cos(pi * s / 4)) for s = 0..4
    expected = [1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55, 0.1 + 0.45 * (1 - math.cos(math.pi / 4)), 0.1]
    assert [f(s) for s in range(5)] == pytest.approx(expected)
    assert f(10) == pytest.approx(0.1)  # past the end it stays at the floor
