"""The built-in recipes read a completion in time linear in its length, whatever it holds: a
lazy regex such as `<answer>(.*?)</answer>` is quadratic on many opening tags and no closing
one (320 KB took 66 s), and holds the GIL all that time. Each adversarial completion here is
scored in a worker process with a generous deadline: linear scanning takes milliseconds, the
quadratic one minutes. The str.find scanners match the regexes they replace."""

import random
import re

import pytest

from vlrft.rewards.guard import run_recipe
from vlrft.workers import CallTimedOut, Worker

SIZE = 320_000  # characters
DEADLINE_S = 20.0  # each call takes well under a second here

OPEN_ANSWERS = "<answer>" * (SIZE // 8)
ADVERSARIAL = [
    ("exact_match", OPEN_ANSWERS, {"answer": "x"}, {}),
    ("multiple_choice", OPEN_ANSWERS, {"answer": "A"}, {}),
    ("counting", OPEN_ANSWERS, {"answer": 1}, {}),
    ("grounding_iou", OPEN_ANSWERS, {"answer": [0, 0, 1, 1]}, {}),
    ("math_accuracy", OPEN_ANSWERS, {"answer": "2"}, {}),
    ("think_answer_format", "<think>" * (SIZE // 7), {}, {"strict": False}),
    ("think_answer_format", "<think></think>" + OPEN_ANSWERS, {}, {"strict": False}),
    ("code_unit_tests", "```" + "x" * SIZE, {}, {}),  # a row without tests: only the program is read
    ("code_unit_tests", "```" + "a." * (SIZE // 2), {}, {}),
]


@pytest.fixture(scope="module")
def worker():
    worker = Worker()
    yield worker
    worker.stop()


@pytest.mark.parametrize("recipe, completion, sample, kwargs", ADVERSARIAL,
                         ids=[f"{a[0]}-{i}" for i, a in enumerate(ADVERSARIAL)])
def test_adversarial_completions_are_read_in_linear_time(worker, recipe, completion, sample, kwargs):
    try:
        scores = worker.call(run_recipe, (recipe, [completion], [sample], kwargs), DEADLINE_S)
    except CallTimedOut:
        pytest.fail(f"{recipe} took over {DEADLINE_S:g}s on a {len(completion)}-character completion")
    assert scores in ([0.0], [None])


def test_a_number_or_a_nesting_past_pythons_limits_scores_zero_not_a_failed_call():
    """counting: int() refuses over 4,300 digits; grounding_iou: json.loads raises RecursionError
    past the recursion limit. Either used to fail the whole batch."""
    assert run_recipe("counting", ["9" * 10_000, "3"], [{"answer": 3}] * 2, {}) == [0.0, 1.0]
    assert run_recipe("counting", ["3 then " + "9" * 10_000], [{"answer": 3}], {}) == [0.0]  # the last number
    box = {"answer": [0, 0, 1, 1]}
    assert run_recipe("grounding_iou", ["[" * 100_000, "[0, 0, 1, 1]"], [box] * 2, {}) == [0.0, 1.0]


ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)


def test_the_scanners_find_what_the_regexes_found():
    from reward_recipes.code import extract_program, fenced_blocks
    from reward_recipes.tags import last_answer, tagged_spans

    rng = random.Random(0)
    tag_parts = ["<answer>", "</answer>", "<ans", "wer>", "</", "a", " ", "\n"]
    fence_parts = ["```", "`", "\n", " ", "\t", "py", "python", "é", "x y", "-", "+#", "``"]
    for _ in range(20_000):
        text = "".join(rng.choice(tag_parts) for _ in range(rng.randint(0, 10)))
        start = rng.randint(0, len(text))
        assert list(tagged_spans(text, "<answer>", "</answer>", start)) == \
            [m.span(1) for m in ANSWER_TAG.finditer(text, start)], text
        found = ANSWER_TAG.findall(text)
        assert last_answer(text) == (found[-1] if found else None), text
        fenced = "".join(rng.choice(fence_parts) for _ in range(rng.randint(0, 10)))
        assert list(fenced_blocks(fenced)) == FENCE.findall(fenced), fenced
    assert extract_program("```python\nprint(1)\n```\n```js\nx\n```") == "print(1)\n"
