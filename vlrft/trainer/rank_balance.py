"""Even out the update's work over ranks: scored experiences move between ranks so that each
holds about the same number of tokens (prompt + response).

Every rank generates its own prompts' responses, and response lengths are skewed: without
this, the rank that drew the long responses is the step's straggler while its peers wait in
the collectives of the update. The loss is normalised by global counts (update.py), so which
rank holds a sample changes nothing but the order of floating-point sums. Balancing runs after
the experience pass, whose group statistics (GRPO advantages) need each group on one rank.
"""

from __future__ import annotations

from vlrft.distributed import all_gather_objects, rank, send_objects, world_size
from vlrft.models.packing import packed_length, prompt_groups


def balance_moves(lengths: list[list[int]]) -> list[tuple[int, int, int]]:
    """Which units (samples, or whole prompt groups) to move, as `(source rank, index on the
    source, destination rank)`, given each rank's unit lengths. Greedy and deterministic (every rank computes the same plan):
    repeatedly the most loaded rank sends the least loaded one the own sample whose length is
    closest to half their gap, while that lowers the larger of the two loads. A sample moves at
    most once, so few samples travel and the loop ends."""
    loads = [sum(ranks) for ranks in lengths]
    movable = [dict(enumerate(ranks)) for ranks in lengths]  # rank -> {index: length} not moved yet
    moves = []
    while True:
        high = max(range(len(loads)), key=lambda r: (loads[r], -r))
        low = min(range(len(loads)), key=lambda r: (loads[r], r))
        gap = loads[high] - loads[low]
        helps = [(abs(2 * length - gap), index) for index, length in movable[high].items() if 0 < length < gap]
        if not helps:
            return moves
        _, index = min(helps)
        length = movable[high].pop(index)
        loads[high] -= length
        loads[low] += length
        moves.append((high, index, low))


def imbalance(loads: list[int]) -> float:
    """Most loaded rank's tokens over the mean (1.0 = even)."""
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0


def balance_across_ranks(samples: list, share_prompts: bool = False) -> tuple[list, dict[str, float]]:
    """This rank's samples after balancing (its kept samples in their order, then those it
    received, by source rank) and the imbalance before and after. With `share_prompts` a
    prompt's responses move together (each rank would otherwise run the prompt again), and
    the loads count each prompt once. A collective."""
    if world_size() == 1:
        return samples, {}
    units = [[samples[i] for i in group] for group in prompt_groups(samples, share_prompts)]
    lengths = all_gather_objects([packed_length(unit) for unit in units])
    moves = balance_moves(lengths)
    me = rank()
    leaving = {index for source, index, _ in moves if source == me}
    transfers: dict[tuple[int, int], list] = {}
    for source, index, destination in moves:
        transfers.setdefault((source, destination), []).extend(units[index] if source == me else [])
    received = send_objects([(source, destination, objects) for (source, destination), objects in sorted(transfers.items())])
    loads = [sum(ranks) for ranks in lengths]
    after = loads[:]
    for source, index, destination in moves:
        after[source] -= lengths[source][index]
        after[destination] += lengths[source][index]
    kept = [s for i, unit in enumerate(units) if i not in leaving for s in unit]
    return kept + received, {"perf/rank_imbalance_before": imbalance(loads), "perf/rank_imbalance": imbalance(after)}
