"""Every recipe call is isolated: a raise, a hang or malformed output becomes a counted failure
with the recipe's fallback, and the rest of the mix still scores. Recipes run in worker
processes (tests/unit/test_workers.py); those marked `runs_in_trainer` in a trainer thread."""

import math
import sys
import time

import numpy as np
import pytest

from tests.recipe_plugin import install_recipe_plugin
from vlrft.config import ConfigError, RecipeSpec, RewardConfig, load_config
from vlrft.rewards import RewardMix, available_recipes, resolve_recipe
from vlrft.isolation.calls import abandoned_calls
from vlrft.rewards.guard import RecipeFailure, call_recipe, check_scores
from vlrft.workers import killed_calls

RECIPES = '''
import time

def raises(completions, samples):
    raise ValueError("verifier exploded\\non two lines")

def hangs(completions, samples):
    while True:
        time.sleep(0.05)

def length(completions, samples):
    return [float(len(c)) for c in completions]

def split(completions, samples):
    return [{"format": 0.5, "accuracy": 1.0} for c in completions]

def counted(completions, samples):
    with open(samples[0]["log"], "a") as log:  # the call ran in a worker: it tells the test by file
        log.write(f"{len(completions)}\\n")
    return [1.0] * len(completions)

def hangs_in_trainer(completions, samples):
    time.sleep(samples[0]["sleep"])
    return [1.0] * len(completions)

hangs_in_trainer.runs_in_trainer = True
'''


@pytest.fixture()
def recipes(tmp_path):
    path = tmp_path / "recipes.py"
    path.write_text(RECIPES)
    return path


def test_raising_and_hanging_recipes_fall_back_and_are_counted(recipes, capsys):
    mix = RewardMix(RewardConfig(default=[
        RecipeSpec(recipe=f"{recipes}:raises", fallback=0.0),
        RecipeSpec(recipe=f"{recipes}:hangs", timeout_s=0.5),  # fallback None: not applicable
        RecipeSpec(recipe=f"{recipes}:length", weight=0.5),
    ]))
    killed, abandoned = killed_calls(), abandoned_calls()
    start = time.perf_counter()
    totals, components, _ = mix.score(["ab", "abcd"], [{"data_source": "x"}] * 2)
    assert time.perf_counter() - start < 5.0  # the hang cost its timeout (and three worker starts), not forever
    assert totals == [1.0, 2.0]  # only `length` counted; raises -> 0, hangs -> not applicable
    assert components == [{"raises": 0.0, "length": 2.0}, {"raises": 0.0, "length": 4.0}]
    assert mix.take_failures() == {"raises": 1, "hangs": 1}
    assert mix.take_failures() == {}  # reset by the take
    assert killed_calls() == killed + 1 and abandoned_calls() == abandoned  # killed with its worker process
    assert sorted(mix.workers) == sorted(spec.recipe for spec, _ in mix.default)  # a worker per recipe
    err = capsys.readouterr().err
    assert f"reward recipe '{recipes}:raises' failed (raised ValueError: verifier exploded on two lines)" in err
    assert f"reward recipe '{recipes}:hangs' failed (timed out after 0.5s); 2 completions scored None" in err


def test_dict_scores_are_named_sub_components_summed(recipes):
    mix = RewardMix(RewardConfig(default=[RecipeSpec(recipe=f"{recipes}:split", weight=2.0, name="r1")]))
    totals, components, _ = mix.score(["a"], [{"data_source": "x"}])
    assert totals == [3.0]  # 2.0 * (0.5 + 1.0)
    assert components == [{"r1": 1.5, "r1.format": 0.5, "r1.accuracy": 1.0}]


@pytest.mark.parametrize("scores, message", [
    ([1.0], "returned 1 scores for 2 completions"),
    (5.0, "returned float, not a list of scores"),
    ([1.0, float("nan")], "score 1 is nan, not a finite number"),
    ([1.0, "1"], "score 1 is '1', not a finite number"),
    ([True, 1.0], "score 0 is True, not a finite number"),
    ([{"a": math.inf}, 1.0], "score 0 is inf, not a finite number"),
])
def test_malformed_outputs_are_failures(scores, message):
    with pytest.raises(RecipeFailure, match=message):
        check_scores(scores, 2)


def test_well_formed_outputs_pass_unchanged():
    scores = [None, 1, np.float32(0.5), [0.1, 0.2], {"a": 1.0}]
    assert check_scores(scores, 5) == scores


def test_call_recipe_passes_kwargs_and_returns_in_time():
    got = call_recipe(lambda c, s, scale: [scale * len(x) for x in c], ["ab"], [{}], {"scale": 3}, timeout_s=5)
    assert got == [6]


def test_a_recipe_that_runs_in_the_trainer_is_called_in_a_thread_and_abandoned(recipes, capsys):
    from vlrft.rewards.reward_models import generative_judge, scalar_reward_model
    from vlrft.rewards.remote import remote_reward

    assert all(f.runs_in_trainer for f in (scalar_reward_model, generative_judge, remote_reward))
    mix = RewardMix(RewardConfig(default=[RecipeSpec(recipe=f"{recipes}:hangs_in_trainer", timeout_s=0.3, fallback=0.0)]))
    killed, abandoned = killed_calls(), abandoned_calls()
    assert mix.score(["a"], [{"data_source": "x", "sleep": 1.0}])[0] == [0.0]
    assert abandoned_calls() == abandoned + 1 and killed_calls() == killed and mix.workers == {}  # no worker started
    assert "hangs_in_trainer' failed (timed out after 0.3s)" in capsys.readouterr().err
    # No second thread while the abandoned one runs: the next call fails at once.
    assert mix.score(["a"], [{"data_source": "x", "sleep": 0.0}])[0] == [0.0] and abandoned_calls() == abandoned + 1
    assert "failed (not run: a call abandoned at its timeout is still running)" in capsys.readouterr().err
    time.sleep(1.0)  # the abandoned call ends
    assert mix.score(["a"], [{"data_source": "x", "sleep": 0.0}])[0] == [1.0]


def test_accuracy_reuses_the_mix_component_and_counts_failures_as_wrong(recipes, tmp_path):
    log = tmp_path / "calls.log"
    counted = f"{recipes}:counted"
    mix = RewardMix(RewardConfig(default=[RecipeSpec(recipe=counted)], accuracy_recipe=counted))
    assert mix.accuracy(["x"], [{"log": str(log)}], [{"counted": 0.0}]) == [0.0]  # reused, not called
    assert not log.exists()
    assert mix.accuracy(["x"], [{"log": str(log)}], [{}]) == [1.0] and log.read_text() == "1\n"
    broken = RewardMix(RewardConfig(accuracy_recipe=f"{recipes}:raises"))
    assert broken.accuracy(["x", "y"], [{}, {}]) == [0.0, 0.0]


def test_config_load_rejects_unknown_recipes_and_bad_guards(tmp_path):
    base = ["model.path=m", "data.train_path=d.jsonl"]
    with pytest.raises(ConfigError, match="unknown reward recipe 'exact'; available: .*exact_match"):
        load_config(None, [*base, "reward.default=[{recipe: exact}]"])
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        load_config(None, [*base, "reward.default=[{recipe: exact_match, timeout_s: 0}]"])
    with pytest.raises(ConfigError, match="uses component name 'exact_match' twice"):
        load_config(None, [*base, "reward.default=[{recipe: exact_match}, {recipe: exact_match, kwargs: {normalised: false}}]"])
    cfg = load_config(None, [*base, "reward.default=[{recipe: exact_match}, {recipe: exact_match, name: literal, fallback: 0}]"])
    assert cfg.reward.default[1].name == "literal" and cfg.reward.default[1].fallback == 0.0
    assert cfg.reward.default[0].fallback is None and cfg.reward.default[0].timeout_s == 60.0
    with pytest.raises(ConfigError, match="unknown reward recipe 'nope'"):
        load_config(None, [*base, "reward.accuracy_recipe=nope"])


def test_entry_point_plugin_is_found_by_name(tmp_path):
    """A tiny package installed (to a target dir) with a `vlrft.reward_recipes` entry point."""
    site = install_recipe_plugin(
        tmp_path, "shout_reward", "shouting",
        "def shouting(completions, samples):\n    return [float(c.isupper()) for c in completions]\n",
    )
    sys.path.insert(0, str(site))
    try:
        assert "shouting" in available_recipes()
        assert resolve_recipe("shouting")(["HEY", "hey"], [{}, {}]) == [1.0, 0.0]
    finally:
        sys.path.remove(str(site))
    assert "shouting" not in available_recipes()
