"""train.sequence_parallel: what it refuses (one line naming the key), how a micro-batch's
images are shared out, which tokens a rank scores, and a sequence mean's denominator."""

from types import SimpleNamespace

import pytest
import torch

from vlrft.algo import aggregate
from vlrft.config import ConfigError, load_config
from vlrft.config_checks import check_world_size
from vlrft.models.sequence_parallel import _cut, heads_problem, local_tokens
from vlrft.models.ulysses import SequenceShard

BASE = ["model.path=m", "data.train_path=t.jsonl", "train.sequence_parallel=2"]


@pytest.mark.parametrize("override, named", [
    ("model.attention=sdpa", "model.attention sdpa"),
    ("model.attention=flash_attention_2 model.compute_dtype=bfloat16", "model.attention flash_attention_2"),
    ("algo.policy_loss=gspo", "algo.policy_loss gspo"),
    ("algo.policy_loss=gmpo", "algo.policy_loss gmpo"),
    ("train.mode=async", "train.mode async"),
    ("algo.kl.coef=0.1 algo.kl.estimator=full", "algo.kl.estimator full"),
    ("algo.moe_aux_coef=0.01", "algo.moe_aux_coef"),
    ("model.compile=on", "model.compile on"),
])
def test_what_does_not_compose_is_one_line_naming_the_key(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + override.split())
    message = str(err.value)
    assert "'train.sequence_parallel' (2) does not compose with " + named in message and "\n" not in message


def test_a_group_size_must_divide_the_ranks_and_be_positive():
    with pytest.raises(ConfigError, match="'train.sequence_parallel' must be >= 1, got 0"):
        load_config(None, ["model.path=m", "data.train_path=t.jsonl", "train.sequence_parallel=0"])
    cfg = load_config(None, BASE + ["rollout.rollout_prompts=6"])
    with pytest.raises(ConfigError, match=r"'train.sequence_parallel' \(2\) must divide the number of ranks \(3\)"):
        check_world_size(cfg, 3)
    check_world_size(cfg, 2)  # (no error)
    with pytest.raises(ConfigError, match=r"must divide the ranks per node \(3\)"):
        check_world_size(load_config(None, BASE + ["rollout.rollout_prompts=12"]), 6, ranks_per_node=3)


def test_auto_attention_picks_one_that_exchanges_heads():
    from vlrft.models.attention import resolve_attention
    from vlrft.models.sdpa_segments import SDPA_SEGMENTS

    assert resolve_attention("auto", "float32", sequence_parallel=True) == SDPA_SEGMENTS
    assert resolve_attention("auto", "bfloat16", sequence_parallel=True) == SDPA_SEGMENTS  # (no CUDA here)


def test_the_heads_must_split_over_the_group():
    config = SimpleNamespace(num_attention_heads=12, num_key_value_heads=2)
    assert heads_problem(config, 2) == ""
    assert "12 attention heads and 2 key/value heads must each divide by it" in heads_problem(config, 4)
    assert "key/value heads" in heads_problem(SimpleNamespace(num_attention_heads=12, num_key_value_heads=None), 5)


def test_images_are_shared_out_in_contiguous_runs_balanced_by_patches():
    # Patches 100, 10, 10, 100 over 2 ranks: an item goes where its middle falls (110 each).
    assert _cut([100, 10, 10, 100], 2) == [(0, 2), (2, 4)]
    assert _cut([100, 10, 30, 100], 2) == [(0, 2), (2, 4)]  # the third's middle, 125, past 120
    assert _cut([64], 2) == [(0, 1), (1, 1)]  # one image: the other rank encodes none
    assert _cut([16, 16, 16, 16], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    runs = _cut([5, 80, 3, 3, 40, 9], 3)
    assert runs[0][0] == 0 and runs[-1][1] == 6 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))


def test_each_rank_scores_its_own_contiguous_shard_of_the_padded_row():
    # 7 tokens over 2 ranks: padded to 8, shards [0, 4) and [4, 8) (the pad is nobody's token).
    first = local_tokens(7, SequenceShard(None, 0, 2), "cpu")
    second = local_tokens(7, SequenceShard(None, 1, 2), "cpu")
    assert first.tolist() == [True] * 4 + [False] * 3
    assert second.tolist() == [False] * 4 + [True] * 3
    assert local_tokens(7, None, "cpu").all()


def test_a_sequence_mean_divides_by_the_whole_sequence_not_the_shard():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    whole = torch.ones(1, 4)
    mine, theirs = torch.tensor([[1.0, 1.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    alone = aggregate(loss, whole, "seq-mean-token-mean", 4, 1, 4)
    shared = [aggregate(loss, m, "seq-mean-token-mean", 4, 1, 4, counted=whole) for m in (mine, theirs)]
    assert float(alone) == pytest.approx(2.5) and float(sum(shared)) == pytest.approx(2.5)
    assert float(aggregate(loss, mine, "seq-mean-token-mean", 4, 1, 4)) == pytest.approx(1.5)  # the shard's own mean
