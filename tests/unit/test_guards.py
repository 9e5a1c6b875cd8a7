"""The run's guards (docs/guards.md): each failure is made on purpose and must stop the run (or
warn) with its one line; the pure decisions are checked by hand."""

import time

import pytest
import torch

from vlrft.config import load_config
from vlrft.isolation.budget import CallStalled, StepBudget
from vlrft.rewards.guard import call_recipe
from vlrft.rewards.mix import sample_ids
from vlrft.engines.weight_digest import WeightDigestError
from vlrft.trainer.sync_check import DEFAULT_GAP_LIMIT, GAP_LIMITS, SyncError, gap_limit, mean_gap, sync_problem
from vlrft.trainer.watches import (
    MIN_WINDOW_GROWTH,
    ComponentWatch,
    MemoryWatch,
    component_ranges,
    growth_slope,
    merge_ranges,
    only_grows,
    stuck_components,
)

RECIPES = (
    "import time\n"
    "def distinct_chars(completions, samples):\n"
    "    return [len(set(c)) / 10 for c in completions]\n"
    "def never(completions, samples):\n"
    "    return [0.0 for c in completions]\n"
    "def slow(completions, samples):\n"
    "    time.sleep(30)\n"
    "    return [0.0 for c in completions]\n"
)


# ---- pure decisions ----

def test_stuck_component_is_one_at_zero_while_another_pays():
    assert stuck_components({"exact_match": (0.0, 0.0), "format": (0.0, 1.0)}) == ["exact_match"]
    assert stuck_components({"exact_match": (-1.0, -1.0), "format": (1.0, 1.0)}) == ["exact_match"]  # a constant penalty
    assert stuck_components({"exact_match": (0.0, 1.0), "format": (1.0, 1.0)}) == []  # a learned bonus is not stuck
    assert stuck_components({"exact_match": (0.0, 0.0), "format": (0.0, 0.0)}) == []  # nothing pays: zero_reward_patience's case
    assert stuck_components({"exact_match": (0.0, 0.0)}) == []


def test_component_ranges_merge_over_ranks():
    rank0 = component_ranges([{"a": 0.0, "b": 1.0}, {"a": 0.0}], ["a", "b", "c"])
    rank1 = component_ranges([{"a": 0.5, "b": 0.25}], ["a", "b", "c"])
    assert rank0 == {"a": (0.0, 0.0), "b": (1.0, 1.0)}
    assert merge_ranges([rank0, rank1]) == {"a": (0.0, 0.5), "b": (0.25, 1.0)}


def test_component_watch_reports_once_per_streak():
    watch = ComponentWatch(patience=2)
    assert watch.update(["a"]) == []
    assert watch.update(["a", "b"]) == ["a"]
    assert watch.update(["a", "b"]) == ["b"]  # a's streak goes on: not again
    assert watch.update(["b"]) == []
    assert watch.update([]) == [] and watch.update(["a"]) == [] and watch.update(["a"]) == ["a"]  # a new streak
    assert ComponentWatch(patience=0).update(["a"]) == []


def test_memory_growth_needs_a_whole_window_of_growth():
    assert growth_slope([0.0, 2.0, 4.0, 6.0]) == pytest.approx(2.0)
    assert growth_slope([1.0, 0.0, 1.0, 0.0]) == pytest.approx(-0.2)
    assert only_grows([0.0, 1.0, 1.0, 3.0], min_growth=3.0)
    assert not only_grows([0.0, 2.0, 1.0, 3.0], min_growth=1.0)  # one step down: not a leak
    assert not only_grows([0.0, 1.0, 2.0], min_growth=3.0)  # too little: allocator noise
    watch = MemoryWatch(window=3)
    step = MIN_WINDOW_GROWTH
    assert [watch.update(v) for v in (0.0, step, 2 * step)] == [None, None, pytest.approx(step)]
    assert watch.update(3 * step) is None  # a fresh window starts after a warning
    assert MemoryWatch(window=0).update(1.0) is None


def test_sync_problem_names_engine_step_and_gap():
    assert sync_problem("hf", 3, gap=0.01, shift=0.5, limit=0.1) == ""
    assert sync_problem("hf", 3, gap=5.0, shift=5.0, limit=0) == ""  # off
    stale = sync_problem("vllm", 3, gap=0.5, shift=0.52, limit=0.1)
    assert "'vllm' engine" in stale and "after step 3" in stale and "0.5 per token" in stale
    assert "did not reach the engine" in stale
    other = sync_problem("hf", 7, gap=0.5, shift=0.01, limit=0.1)
    assert "dtype" in other and "\n" not in other
    assert mean_gap(torch.tensor([0.0, 1.0, 5.0]), torch.tensor([0.5, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])) == 0.75


def test_step_budget_cuts_a_call_short_and_names_it():
    from vlrft.isolation import budget

    budget.STEP_BUDGET.start(0.3)
    try:
        start = time.monotonic()
        with pytest.raises(CallStalled, match=r"reward recipe 'slow' on sample 'row-7'.*guards.step_reward_budget_s"):
            call_recipe(lambda c, s: time.sleep(5), ["x"], [{"id": "row-7"}], {}, 60.0, "reward recipe 'slow' on sample 'row-7'")
        assert time.monotonic() - start < 2.0
        assert budget.STEP_BUDGET.slowest["reward"] > 0.25  # cut at the budget, not at 5 s
    finally:
        budget.STEP_BUDGET.start(0)  # no budget for the other tests
    fresh = StepBudget()
    assert fresh.limit(5.0) == (5.0, False)  # never started (the reward server): the call's own timeout


def test_sample_ids_are_short():
    assert sample_ids([{"id": "a"}]) == "sample 'a'"
    assert sample_ids([{"id": str(i)} for i in range(5)]) == "samples '0', '1', '2' and 2 more"


# ---- in a run (one rank, in process) ----

@pytest.fixture
def overrides(tiny_text, addition_data, tmp_path):
    (tmp_path / "recipes.py").write_text(RECIPES)
    return [
        f"model.path={tiny_text}",
        f"data.train_path={addition_data / 'train.jsonl'}",
        "rollout.rollout_prompts=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        "train.lr=0.05",
        "train.total_steps=3",
        f"reward.default=[{{recipe: '{tmp_path / 'recipes.py'}:distinct_chars'}}]",
        "eval.every_steps=0",
        f"output.dir={tmp_path / 'run'}",
    ]


def trainer_for(overrides):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    return SPMDTrainer(load_config(None, overrides))


def withhold_weights(trainer):
    """A sync that does not take effect: the engine consumes the weights and loads none."""
    trainer.engine.update_weights = lambda named_tensors: [None for _ in named_tensors]


def test_a_healthy_sync_has_no_gap(overrides, world_of_one):
    metrics = trainer_for(overrides).train_step()
    assert metrics["sync/logprob_gap"] < 1e-4  # fp32 on both sides
    assert metrics["perf/sync_digest_seconds"] > 0  # and the digests matched
    assert metrics["sync/update_shift"] > 0.05  # the update did move the policy
    assert metrics["perf/slowest_reward_call_seconds"] > 0 and metrics["perf/host_rss_gib"] > 0
    assert metrics["reward/stuck_components"] == 0


@pytest.mark.parametrize("lora", [False, True])
def test_weights_that_never_reach_the_engine_stop_the_run(lora, overrides, world_of_one):
    extra = ["model.lora.rank=4", "model.lora.alpha=16", "train.lr=0.2"] if lora else []
    trainer = trainer_for(overrides + extra + ["guards.sync_digest=false"])  # the probe alone
    withhold_weights(trainer)
    with pytest.raises(SyncError, match=r"after step 1: the 'hf' engine's logprobs .* did not reach the engine"):
        trainer.train_step()


def test_sync_check_off(overrides, world_of_one):
    trainer = trainer_for(overrides + ["guards.sync_max_logprob_gap=0", "guards.sync_digest=false"])
    withhold_weights(trainer)
    metrics = trainer.train_step()
    assert "sync/logprob_gap" not in metrics and "perf/sync_digest_seconds" not in metrics


def faulty_sync(trainer, skip=lambda name: False, round_to=lambda name: False):
    """An engine update that silently leaves the tensors `skip` names out and stores those
    `round_to` names through bfloat16: the partial syncs peers' users report."""
    update = trainer.engine.update_weights

    def faulty(named_tensors):
        update((name, tensor.to(torch.bfloat16).float() if round_to(name) else tensor)
               for name, tensor in named_tensors if not skip(name))

    trainer.engine.update_weights = faulty


@pytest.mark.parametrize(("fault", "expected"), [
    ({"skip": lambda name: ".layers.1." in name}, r"still hold the previous sync's values \('model.layers.1\."),
    # The tiny model ties its LM head to the embedding: the one tensor both are.
    ({"skip": lambda name: "embed_tokens" in name}, r"still hold the previous sync's values \('model.embed_tokens.weight'\)"),
    ({"skip": lambda name: name == "lm_head.weight", "untied": True}, r"still hold the previous sync's values \('lm_head.weight'\)"),
    ({"round_to": lambda name: name.endswith("layers.0.mlp.down_proj.weight")}, r"other values than were sent, e.g. rounded "
                                                                                r"\('model.layers.0.mlp.down_proj.weight'\)"),
])
def test_a_partial_sync_stops_the_run_at_step_1_naming_the_tensors(fault, expected, overrides, untied_text, world_of_one):
    fault = dict(fault)
    trainer = trainer_for(overrides + ([f"model.path={untied_text}"] if fault.pop("untied", False) else []))
    faulty_sync(trainer, **fault)
    with pytest.raises(WeightDigestError, match=r"^weight sync check after step 1: the 'hf' engine does not serve the \d+ tensors "
                                                r"the trainer sent: .*" + expected):
        trainer.train_step()


def test_a_lora_merge_that_never_reaches_the_engine_stops_the_run_at_step_1(overrides, world_of_one):
    trainer = trainer_for(overrides + ["model.lora.rank=4", "model.lora.alpha=16", "train.lr=0.2"])
    targets = trainer.cfg.model.lora.target_modules
    faulty_sync(trainer, skip=lambda name: any(f".{target}." in name for target in targets))  # base weights stay
    with pytest.raises(WeightDigestError, match=r"after step 1: .* still hold the previous sync's values"):
        trainer.train_step()


def test_gap_limit_comes_from_the_measured_table_unless_set():
    assert gap_limit(None, "hf", "float32") == GAP_LIMITS[("hf", "float32")] < gap_limit(None, "vllm", "bfloat16")
    assert gap_limit(0.3, "hf", "float32") == 0.3 and gap_limit(0.0, "vllm", "float32") == 0.0
    assert gap_limit(None, "my_plugin_engine", "float32") == DEFAULT_GAP_LIMIT


def test_a_stalled_recipe_stops_the_step_naming_it(overrides, tmp_path, world_of_one):
    slow = f"reward.default=[{{recipe: '{tmp_path / 'recipes.py'}:slow', timeout_s: 60}}]"
    trainer = trainer_for(overrides + [slow, "guards.step_reward_budget_s=1"])
    start = time.monotonic()
    with pytest.raises(CallStalled, match=r"reward recipe '.*recipes.py:slow' on samples '.*' .*ran out \(1 s"):
        trainer.train_step()
    assert time.monotonic() - start < 20  # the budget, not the recipe's 30 s or its 60 s timeout


def test_a_hanging_environment_stops_the_step_naming_it(overrides, tmp_path, world_of_one):
    (tmp_path / "env.py").write_text(
        "import time\n"
        "class Hang:\n"
        "    def reset(self, sample):\n"
        "        time.sleep(30)\n"
        "    def step(self, action):\n"
        "        return 'done', 0.0, True\n"
    )
    env = [f"rollout.environment={tmp_path / 'env.py'}:Hang", "rollout.max_trajectory_tokens=32",
           "guards.step_reward_budget_s=1"]
    start = time.monotonic()
    with pytest.raises(CallStalled, match=r"environment reset on sample '.*' was still running"):
        trainer_for(overrides + env).train_step()
    assert time.monotonic() - start < 20


def test_a_component_stuck_at_zero_behind_a_paying_one_is_named(overrides, tmp_path, world_of_one, capsys):
    mix = (f"reward.default=[{{recipe: '{tmp_path / 'recipes.py'}:distinct_chars'}}, "
           f"{{recipe: '{tmp_path / 'recipes.py'}:never'}}]")
    trainer = trainer_for(overrides + [mix, "guards.component_patience=2"])
    first = trainer.train_step()
    assert first["reward/stuck_components"] == 1 and "'never'" not in capsys.readouterr().out
    trainer.train_step()
    out = capsys.readouterr().out
    assert out.count("vlrft: warning: reward component 'never' gave every sample the same score") == 1
    assert "distinct_chars paid out" in out and "guards.component_patience" in out


def test_memory_that_grows_every_step_is_reported_with_its_slope(overrides, world_of_one, capsys, monkeypatch):
    from vlrft.trainer import watches

    trainer = trainer_for(overrides + ["guards.memory_window=3"])
    kept = []
    real_rss = watches.host_rss_bytes

    def leaking_rss():  # a step that keeps 80 MiB more than the last, every step
        kept.append(b"\x01" * (80 * 2**20))
        return real_rss()

    monkeypatch.setattr(watches, "host_rss_bytes", leaking_rss)
    for _ in range(3):
        trainer.train_step()
    out = capsys.readouterr().out
    assert "vlrft: warning: rank 0: host_rss_gib grew at every one of the last 3 steps, by" in out
    slope = float(out.split("grew at every one of the last 3 steps, by ")[1].split(" MiB")[0])
    assert 70 < slope < 120  # the 80 MiB a step it kept
