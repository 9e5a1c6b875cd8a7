"""math_accuracy (math-verify) and think_answer_format on real edge cases, each checked by hand
against math-verify 0.9: what it does and does not treat as equal."""

import sys
import threading
import time

import pytest

from reward_recipes.format import answer_tag_format, think_answer_format
from reward_recipes.math import math_accuracy
from vlrft.config import RecipeSpec, RewardConfig
from vlrft.rewards import RewardMix
from vlrft.workers import killed_calls

pytest.importorskip("math_verify")


def score(completion, gold):
    return math_accuracy([completion], [{"answer": gold}])[0]


@pytest.mark.parametrize("gold, completion", [
    ("0.5", r"\boxed{\frac{1}{2}}"),
    (r"\frac{1}{2}", r"The answer is \boxed{0.5}."),
    (r"\frac{1}{2}", r"\boxed{\dfrac12}"),
    (r"\frac{1}{2}", r"\boxed{1/2}"),
    (r"2\sqrt{2}", r"\boxed{\sqrt{8}}"),
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}"),
    ("x^2+2x+1", r"\boxed{(x+1)^2}"),
    ("$x^2$", r"so $x^2$"),
    (r"\boxed{3}", "3"),
    ("3", r"\boxed{3.0}"),
    ("3", r"\boxed{x=3}"),  # a solved variable counts as its value
    ("1000", r"\boxed{1,000}"),
    ("1000", r"\boxed{10^3}"),
    (r"50\%", r"\boxed{0.5}"),
    (r"\{1,2,3\}", r"\boxed{\{3,2,1\}}"),  # sets ignore order
    ("[1,2)", r"\boxed{[1,2)}"),
    (r"(-\infty, 0]", r"\boxed{(-\infty,0]}"),
])
def test_equivalent_answers_score_one(gold, completion):
    assert score(completion, gold) == 1.0


@pytest.mark.parametrize("gold, completion", [
    ("3", r"\boxed{4}"),
    ("3", r"3 is tempting, but \boxed{4}"),  # the boxed answer wins over earlier numbers
    ("[1,2)", r"\boxed{[1,2]}"),  # interval ends matter
    (r"\frac{1}{3}", r"\boxed{0.333}"),  # too coarse: math-verify rounds to 6 places
    (r"\pi", r"\boxed{3.14159}"),
    ("x^2", r"\boxed{y^2}"),  # variables matter
])
def test_different_answers_score_zero(gold, completion):
    assert score(completion, gold) == 0.0


def test_rounding_to_six_places_is_accepted():
    assert score(r"\boxed{0.333333}", r"\frac{1}{3}") == 1.0


@pytest.mark.parametrize("completion", [
    "I don't know",
    r"\boxed{3",  # unbalanced box: nothing is extracted
    r"\boxed{}",
    "",
    "   ",
    "<answer></answer>",
])
def test_unparsable_or_empty_predictions_score_zero(completion):
    assert score(completion, "3") == 0.0


def test_answer_tag_is_preferred():
    assert score(r"<answer>\boxed{3}</answer>", "3") == 1.0
    assert score("<answer>3</answer>", "3") == 1.0  # bare tag content (math-verify alone finds nothing)
    assert score(r"<answer>2\sqrt{2}</answer>", r"2\sqrt{2}") == 1.0  # not just the leading 2
    assert score(r"<answer>2\sqrt{2}</answer>", "2") == 0.0
    assert score(r"I think \boxed{3}. <answer>4</answer>", "3") == 0.0  # the tag, not the stray box
    assert score(r"<answer>5</answer> then <answer>x = \boxed{7}</answer>", "7") == 1.0  # the last tag
    assert score(r"<answer>\frac{1}{2}</answer>", "0.5") == 1.0


@pytest.mark.parametrize("gold", ["", "   ", "$$", r"\frac{1}{", None])
def test_unparsable_gold_is_not_applicable(gold):
    assert math_accuracy([r"\boxed{3}"], [{"answer": gold}]) == [None]


def test_batch_mixes_scores():
    samples = [{"answer": "0.5"}, {"answer": "0.5"}, {"answer": ""}, {"answer": "7"}]
    got = math_accuracy([r"\boxed{\frac12}", "no idea", r"\boxed{1}", r"\boxed{7"], samples)
    assert got == [1.0, 0.0, None, 0.0]


def test_works_outside_the_main_thread():
    """math-verify's default timeouts use signal.alarm, which raises in a worker thread; the
    recipe turns them off, as vlrft.rewards.guard calls every recipe from a worker thread."""
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{\sqrt{8}}", "nope"]
    samples = [{"answer": "0.5"}, {"answer": r"2\sqrt{2}"}, {"answer": "1"}]
    results, errors = {}, []

    def work(k):
        try:
            results[k] = math_accuracy(completions, samples)
        except Exception as err:  # pragma: no cover - the failure this test guards against
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {k: [1.0, 1.0, 0.0] for k in range(4)}


def test_a_power_tower_in_training_is_killed_at_its_timeout_and_costs_only_that_call(capsys):
    """`\\boxed{9^{9^{9}}}`: sympy computes 9^387420489 in C, holding the GIL, for minutes. In the
    trainer the recipe runs in a worker process: the call is killed at its timeout_s, its
    completions get the fallback, and the next call is scored by a fresh worker."""
    mix = RewardMix(RewardConfig(default=[RecipeSpec(recipe="math_accuracy", timeout_s=3, fallback=0.0)]))
    assert mix.score([r"\boxed{2}"], [{"answer": "2", "data_source": "x"}])[0] == [1.0]  # its worker started
    killed, start = killed_calls(), time.monotonic()
    totals = mix.score([r"\boxed{9^{9^{9}}}", r"\boxed{2}"], [{"answer": "2", "data_source": "x"}] * 2)[0]
    assert totals == [0.0, 0.0] and killed_calls() == killed + 1 and mix.take_failures() == {"math_accuracy": 1}
    assert time.monotonic() - start < 30  # its timeout and a kill, not the power's minutes
    assert "reward recipe 'math_accuracy' failed (timed out after 3s)" in capsys.readouterr().err
    assert mix.score([r"\boxed{2}"], [{"answer": "2", "data_source": "x"}])[0] == [1.0]


def test_missing_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match=r"pip install 'vlrft\[rewards\]'"):
        math_accuracy(["1"], [{"answer": "1"}])


GOOD = "<think>2 + 2 = 4</think>\n<answer>4</answer>"


@pytest.mark.parametrize("text, strict, lenient", [
    (GOOD, 1.0, 1.0),
    ("  \n<think>\nstep\n</think>  <answer> 4 </answer>\n ", 1.0, 1.0),  # white space only
    ("<think></think><answer>4</answer>", 1.0, 1.0),  # an empty think block is allowed
    ("<answer>4</answer>", 0.0, 0.0),  # missing think
    ("<think>hmm</think>", 0.0, 0.0),  # missing answer
    ("<answer>4</answer><think>hmm</think>", 0.0, 0.0),  # answer before think
    ("<think>a</think><answer>  </answer>", 0.0, 0.0),  # blank answer
    ("Sure! " + GOOD, 0.0, 1.0),  # text outside the tags
    (GOOD + " Hope this helps.", 0.0, 1.0),
    ("<think>a</think> so <answer>4</answer>", 0.0, 1.0),  # text between the blocks
    (GOOD + "<answer>5</answer>", 0.0, 1.0),  # duplicate answer
    ("<think>a</think>" + GOOD, 0.0, 1.0),  # duplicate think
    ("<think>a<answer>4</answer></think>", 0.0, 0.0),  # answer only inside think
    ("<think>a</think><answer>4", 0.0, 0.0),  # unclosed answer
    ("<think>a<answer>4</answer>", 0.0, 0.0),  # unclosed think
    ("", 0.0, 0.0),
])
def test_think_answer_format(text, strict, lenient):
    assert think_answer_format([text], [{}]) == [strict]
    assert think_answer_format([text], [{}], strict=True) == [strict]
    assert think_answer_format([text], [{}], strict=False) == [lenient]


def test_answer_tag_format_unchanged():
    assert answer_tag_format(["<answer>4</answer>", " <answer>4</answer>\n", GOOD, "<answer></answer>"], [{}] * 4) == [
        1.0, 1.0, 0.0, 0.0]


def test_a_recipe_whose_package_is_missing_fails_at_config_load(tmp_path, monkeypatch):
    import importlib.util

    from vlrft.config import ConfigError, load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    (tmp_path / "cfg.yaml").write_text("model: {path: m}\ndata: {train_path: d.jsonl}\n"
                                       "reward: {default: [{recipe: math_accuracy}]}\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.yaml")
    assert str(err.value) == ("reward recipe 'math_accuracy' needs the math_verify module, which is not installed: "
                              "math_accuracy needs math-verify: pip install 'vlrft[rewards]'")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    load_config(tmp_path / "cfg.yaml")  # installed here (the rewards extra): the same config loads
