"""The calculator example (examples/calculator): its data, the tools environment on its calls,
and its warm-up prompts, which are token for token the conversation a multi-turn rollout builds."""

import numpy as np
import pytest

from data_tools.calculator_warmup import calculator_call, calculator_prompts
from data_tools.synth_shapes import PRODUCT_OPERANDS, write_product_task
from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.multiturn.environment import as_step, resolve_environment
from vlrft.multiturn.template import observation_template


def test_product_rows_are_right_and_held_out_pairs_are_new(tmp_path):
    write_product_task(tmp_path, n_train=300, n_test=50, seed=3)
    train, test = load_rows(tmp_path / "train.jsonl"), load_rows(tmp_path / "test.jsonl")
    assert (len(train), len(test)) == (300, 50)
    for row in train + test:
        a, b = row["meta"]["a"], row["meta"]["b"]
        assert a in PRODUCT_OPERANDS and b in PRODUCT_OPERANDS and row["answer"] == str(a * b)
        assert row["messages"][0]["content"][0]["text"].startswith(f"What is {a} * {b}?")
    pairs = lambda rows: {(r["meta"]["a"], r["meta"]["b"]) for r in rows}  # noqa: E731
    assert not pairs(train) & pairs(test) and len(pairs(train)) == 300
    write_product_task(tmp_path / "more", n_train=600, n_test=50, seed=3)
    assert load_rows(tmp_path / "more" / "test.jsonl") == test  # the test set does not depend on n_train
    with pytest.raises(ValueError, match="8100 operand pairs"):
        write_product_task(tmp_path / "too_many", n_train=8100, n_test=1)


def test_the_tools_environment_answers_the_call_and_a_guess_ends_the_trajectory():
    env = resolve_environment("tools")(tools=["calculator"])
    env.reset({"answer": "1924"})
    called = as_step(env.step(calculator_call(37, 52)))
    assert (called.observation, called.done) == ("1924", False)
    assert as_step(env.step("<answer>1924</answer>")).done


def test_warmup_prompts_are_the_rollouts_conversation(tiny_text):
    """The after-call prompt the warm-up trains on = the row's prompt + the call + end of turn +
    the observation a multi-turn rollout appends for the calculator's result (role tool)."""
    encoder = PromptEncoder(tiny_text, 0, 0, 512)
    first, after, pairs = calculator_prompts(encoder, np.random.default_rng(0), 3)
    tokenizer = encoder.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    template = observation_template(tokenizer, [end], "tool", "tiny-text")
    for f, a, (x, y) in zip(first, after, pairs):
        call = tokenizer.encode(calculator_call(x, y), add_special_tokens=False) + [end]
        assert a.prompt_ids == f.prompt_ids + call + template.observation_ids(end, str(x * y))
