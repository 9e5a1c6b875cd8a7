"""Multi-turn runs: the environment's own rewards, as a recipe (docs/environments.md)."""

from __future__ import annotations


def environment_reward(completions, samples, per_turn: bool = False):
    """Recipe: the sum of the environment's per-turn rewards over the trajectory (0 for a
    single-turn sample, which has no turns). `per_turn`: a dense reward instead, each turn's
    reward on that turn's last generated token (token-level estimators, reinforce_pp and gae,
    then credit each turn with what came after it)."""
    if not per_turn:
        return [float(s.get("environment_reward", 0.0)) for s in samples]
    dense = []
    for s in samples:
        rewards = [0.0] * s["response_length"]
        for turn in s.get("turns", []):
            if turn.get("last_token", -1) >= 0:
                rewards[turn["last_token"]] += float(turn["reward"])
        dense.append(rewards)
    return dense
