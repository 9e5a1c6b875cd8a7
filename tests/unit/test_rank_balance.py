"""Balancing the update's tokens over ranks (trainer/rank_balance.py). The 2-rank exchange and
its exactness (same gradient as without it) are in tests/integration/test_split_invariance.py."""

import random

from vlrft.trainer.rank_balance import balance_moves, imbalance


def loads_after(lengths, moves):
    loads = [sum(r) for r in lengths]
    for source, index, destination in moves:
        loads[source] -= lengths[source][index]
        loads[destination] += lengths[source][index]
    return loads


def test_moves_by_hand():
    # loads 34 | 3, gap 31: 10 is closest to half the gap (15.5); then 24 | 13, gap 11: 7 is
    # closest to 5.5; then 17 | 20 and rank 1's only sample (3) is not below the gap 3.
    assert balance_moves([[10, 9, 8, 7], [3]]) == [(0, 0, 1), (0, 3, 1)]
    assert loads_after([[10, 9, 8, 7], [3]], [(0, 0, 1), (0, 3, 1)]) == [17, 20]


def test_even_ranks_and_one_long_sample_move_nothing():
    assert balance_moves([[5, 5], [4, 6]]) == []
    assert balance_moves([[50], [1, 2]]) == []  # moving 50 would only swap the straggler
    assert balance_moves([[3]]) == []


def test_three_ranks_fill_the_emptiest_first():
    moves = balance_moves([[8, 8, 8, 8], [], [2]])
    assert moves[0] == (0, 0, 1)  # first move: rank 0 (32) to rank 1 (0), gap 32, every 8 as close
    assert loads_after([[8, 8, 8, 8], [], [2]], moves) == [16, 8, 10]


def test_random_plans_keep_every_sample_and_never_raise_the_maximum():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [[rng.randint(1, 300) for _ in range(rng.randint(0, 12))] for _ in range(rng.randint(1, 6))]
        moves = balance_moves(lengths)
        moved = [(source, index) for source, index, _ in moves]
        assert len(moved) == len(set(moved))  # each sample at most once
        loads = loads_after(lengths, moves)
        assert sum(loads) == sum(map(sum, lengths))
        assert max(loads) <= max(sum(r) for r in lengths)
        # Where it stops, the busiest rank has no sample of its own shorter than the gap.
        high = max(range(len(loads)), key=lambda r: (loads[r], -r))
        gap = max(loads) - min(loads)
        left = [length for i, length in enumerate(lengths[high]) if (high, i) not in moved]
        assert all(length >= gap for length in left)


def test_imbalance_is_max_over_mean():
    assert imbalance([30, 10]) == 1.5
    assert imbalance([0, 0]) == 1.0
