import pytest

from reward_recipes.answer_match import exact_match
from reward_recipes.format import answer_tag_format
from vlrft.config import ConfigError, RecipeSpec, RewardConfig
from vlrft.rewards import RewardError, RewardMix, resolve_recipe


def test_exact_match_extracts_and_normalises():
    samples = [{"answer": "Red"}] * 4
    completions = ["<answer> red. </answer>", "<answer>blue</answer>", "red", "<answer>RED</answer> more"]
    assert exact_match(completions, samples) == [1.0, 0.0, 1.0, 1.0]
    assert exact_match(completions, samples, normalised=False) == [0.0, 0.0, 0.0, 0.0]


def test_answer_format_is_strict():
    got = answer_tag_format(["<answer>red</answer>", " <answer>7</answer>\n", "red", "<answer></answer>", "x<answer>a</answer>"], [{}] * 5)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_mix_per_data_source_with_weights_and_components(tmp_path):
    user = tmp_path / "my_recipe.py"
    user.write_text("def length(completions, samples, scale=1.0):\n    return [scale * len(c) for c in completions]\n")
    cfg = RewardConfig(
        default=[RecipeSpec(recipe="exact_match")],
        by_data_source={
            "maths": [
                RecipeSpec(recipe="exact_match", weight=2.0),
                RecipeSpec(recipe=f"{user}:length", weight=0.5, kwargs={"scale": 0.1}),
            ]
        },
    )
    mix = RewardMix(cfg)
    samples = [{"answer": "4", "data_source": "maths"}, {"answer": "4", "data_source": "other"}]
    totals, components, _ = mix.score(["<answer>4</answer>", "4"], samples)
    # maths: 2 * 1 + 0.5 * (0.1 * 18 chars) = 2.9 ; other: exact_match only = 1
    assert totals == pytest.approx([2.9, 1.0])
    assert components[0] == pytest.approx({"exact_match": 1.0, "length": 1.8})
    assert components[1] == {"exact_match": 1.0}


def test_unknown_recipe_lists_builtins():
    with pytest.raises(ConfigError, match="unknown reward recipe .exactmatch.; available: answer_format, code_unit_tests, counting, environment_reward, exact_match, "):
        resolve_recipe("exactmatch")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg.mod'"):
        resolve_recipe("no_such_pkg.mod:fn")


def test_recipe_returning_wrong_count_is_a_named_failure(tmp_path, capsys):
    (tmp_path / "short.py").write_text("def one_score(completions, samples):\n    return [1.0]\n")
    cfg = RewardConfig(default=[RecipeSpec(recipe=f"{tmp_path / 'short.py'}:one_score", fallback=0.0)])
    mix = RewardMix(cfg)
    totals, components, _ = mix.score(["a", "b"], [{"data_source": "x"}] * 2)
    assert totals == [0.0, 0.0] and components == [{"one_score": 0.0}] * 2  # the fallback
    assert mix.take_failures() == {"one_score": 1}
    assert f"reward recipe '{tmp_path / 'short.py'}:one_score' failed (returned 1 scores for 2 completions)" in capsys.readouterr().err


def test_accuracy_uses_the_configured_recipe():
    samples = [{"answer": "red", "data_source": "x"}]
    strict = RewardMix(RewardConfig(accuracy_recipe="answer_format"))
    assert strict.accuracy(["red"], samples) == [0.0]  # right answer, wrong format
    assert RewardMix(RewardConfig()).accuracy(["red"], samples) == [1.0]  # default: exact_match


def test_dense_recipe_scores_are_weighted_per_token_and_checked(tmp_path):
    user = tmp_path / "dense.py"
    user.write_text(
        "def per_token(completions, samples):\n"
        "    return [[0.5] * s['response_length'] for s in samples]\n"
        "def short(completions, samples):\n"
        "    return [[1.0] for s in samples]\n"
    )
    mix = RewardMix(RewardConfig(default=[RecipeSpec(recipe="exact_match"), RecipeSpec(recipe=f"{user}:per_token", weight=2.0)]))
    samples = [{"answer": "4", "data_source": "x", "response_length": 3}]
    totals, components, dense = mix.score(["<answer>4</answer>"], samples)
    assert totals == [1.0]  # the scalar part only
    assert dense == [[1.0, 1.0, 1.0]]  # 2.0 * 0.5 on each of the 3 tokens
    assert components[0] == {"exact_match": 1.0, "per_token": 1.5}  # a dense component by its sum
    bad = RewardMix(RewardConfig(default=[RecipeSpec(recipe=f"{user}:short")]))
    with pytest.raises(RewardError, match="reward recipe '.*:short' returned a dense reward of 1 values for a response of 3 tokens"):
        bad.score(["abc"], samples)
