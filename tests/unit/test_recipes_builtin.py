"""Built-in rule recipes on real edge cases: boxes, LaTeX braces, unparsable and empty answers."""

import pytest

from reward_recipes.answer_match import exact_match, extract_answer
from reward_recipes.choice import chosen_letter, counting, multiple_choice, read_count
from reward_recipes.grounding import box_iou, grounding_iou, parse_box
from reward_recipes.repetition import repetition_penalty
from vlrft.rewards import BUILTIN_RECIPES, resolve_recipe


def test_boxed_answers_keep_nested_braces():
    assert extract_answer(r"so the answer is \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_answer(r"\boxed{3} then \boxed{4}") == "4"  # the last box
    assert extract_answer(r"<answer>x = \boxed{7}</answer>") == "7"
    assert extract_answer(r"\boxed{3") == r"\boxed{3"  # unbalanced: no box is extracted
    assert exact_match([r"\boxed{ 42 }", "", r"\boxed{}"], [{"answer": "42"}] * 3) == [1.0, 0.0, 0.0]


def test_multiple_choice_letters():
    assert [chosen_letter(t) for t in ["(B)", "The answer is C.", "<answer>D)</answer>", "none", ""]] == [
        "B", "C", "D", None, None]
    samples = [{"answer": "B"}, {"answer": "(c)"}, {"answer": "A"}, {"answer": "A"}]
    assert multiple_choice(["B", "I pick C", "Apple", ""], samples) == [1.0, 1.0, 0.0, 0.0]


def test_counting_reads_digits_and_words():
    assert [read_count(t) for t in ["There are 3 circles", "<answer>five</answer>", "no idea", "2 or 4"]] == [3, 5, None, 4]
    assert counting(["3", "three", "many", ""], [{"answer": "3"}] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_grounding_boxes_and_iou():
    assert parse_box("[10, 10, 20, 20]") == (10.0, 10.0, 20.0, 20.0)
    assert parse_box("the box is [0.5, 1, 2.5, 3] ok") == (0.5, 1.0, 2.5, 3.0)
    assert parse_box([1, 2, 3, 4]) == (1.0, 2.0, 3.0, 4.0)
    for bad in ["[1, 2, 3]", "[5, 5, 1, 1]", "box", "[a, b, c, d]", "", None, ["1", "x", 3, 4]]:
        assert parse_box(bad) is None, bad
    # [0,0,2,2] vs [1,1,3,3]: intersection 1, union 4 + 4 - 1 = 7.
    assert box_iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7)
    samples = [{"answer": [0, 0, 2, 2]}, {"answer": "[0, 0, 2, 2]"}, {"answer": [0, 0, 2, 2]}]
    got = grounding_iou(["<answer>[1, 1, 3, 3]</answer>", "[0, 0, 2, 2]", "[3, 3, 1, 1]"], samples)
    assert got == pytest.approx([1 / 7, 1.0, 0.0])


def test_repetition_penalty():
    # "a b c a b c": 3-grams abc, bca, cab, abc -> 1 repeat of 4.
    assert repetition_penalty(["a b c a b c", "one two three four", "", "x"], [{}] * 4) == [-0.25, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="n >= 1"):
        repetition_penalty(["a"], [{}], n=0)


def test_every_builtin_short_name_resolves():
    for name in BUILTIN_RECIPES:
        assert callable(resolve_recipe(name)), name
