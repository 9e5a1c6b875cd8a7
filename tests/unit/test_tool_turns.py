"""Tool turns, which the policy writes (hostile): how calls are parsed, what the `tools`
environment runs and what its answer may hold (vlrft/multiturn/tool_calls.py, tools.py,
environment.py)."""

from __future__ import annotations

import time

import pytest

from tests.marks import needs_sandbox
from vlrft.errors import ConfigError
from vlrft.multiturn.environment import Step, as_step
from vlrft.multiturn.tool_calls import MAX_CALL_CHARS, MAX_CALL_DEPTH
from vlrft.multiturn.tools import ToolEnvironment, calculator, parse_tool_calls


def test_tool_calls_are_parsed_and_answered():
    calls = parse_tool_calls(
        'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7 // 2\\"}"}</tool_call>'
        "<tool_call>not json</tool_call><tool_call>{\"arguments\": {}}</tool_call>"
    )
    assert calls[:2] == [{"name": "calculator", "arguments": {"expression": "17 * 23"}},
                         {"name": "calculator", "arguments": {"expression": "7 // 2"}}]
    assert "not JSON" in calls[2]["error"] and "no 'name'" in calls[3]["error"]
    env = ToolEnvironment(["calculator"])
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "(2 + 3) ** 2 / 5"}}</tool_call>'
                    '<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert step.observation == "5\nerror: unknown tool 'search'; available: calculator" and not step.done
    assert env.step("The answer is 391.") == Step("", 0.0, done=True)  # no call: the final answer


# Model-written calls, each answered as the first tool result (an error past the parser's
# bounds), quickly; the turn goes on to the next call.
CALLS = {
    "1,000 nested objects": ('{"name": "calculator", "arguments": ' + '{"a": ' * 1000 + "1" + "}" * 1000 + "}",
                             f"error: tool call nested more than {MAX_CALL_DEPTH} deep"),
    "1,000 nested arrays": ('{"name": "calculator", "arguments": {"x": ' + "[" * 1000 + "]" * 1000 + "}}",
                            f"error: tool call nested more than {MAX_CALL_DEPTH} deep"),
    "nested arguments string": ('{"name": "calculator", "arguments": "' + "[" * 1000 + "]" * 1000 + '"}',
                                f"error: tool call nested more than {MAX_CALL_DEPTH} deep"),
    "100,000 characters": ('{"name": "calculator", "arguments": {"expression": "' + "1" * 100_000 + '"}}',
                           f"error: tool call longer than {MAX_CALL_CHARS} characters"),
    "a 5,000-digit number": ('{"name": "calculator", "arguments": {"expression": ' + "7" * 5000 + "}}",
                             "error: tool call cannot be read (Exceeds the limit (4300 digits) for integer string conversion)"),
}


@pytest.mark.parametrize("case", CALLS)
def test_a_call_past_the_parsers_bounds_is_a_tool_error_and_the_turn_goes_on(case):
    body, answer = CALLS[case]
    start = time.perf_counter()
    step = ToolEnvironment(["calculator"]).step(f"<tool_call>{body}</tool_call>"
                                                '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>')
    assert time.perf_counter() - start < 2.0
    assert step.observation.split("\n") == [answer, "42"] and not step.done


def test_the_parser_is_linear_in_the_turn_and_reads_every_call_within_its_bounds():
    """Whitespace after an opening tag, or opening tags without a closing one: a regular
    expression that backtracks took 26 s on 4,000 spaces here (and 216 s on 8,000)."""
    for turn in ("<tool_call>" + " " * 4000, "<tool_call>" + " " * 100_000, "<tool_call>" * 100_000,
                 "<tool_call>" + " " * 100_000 + "x</tool_call>"):
        start = time.perf_counter()
        parse_tool_calls(turn)
        assert time.perf_counter() - start < 2.0, len(turn)
    deepest = '{"name": "calculator", "arguments": {"expression": "1 + 1", "x": ' + "[" * 30 + "]" * 30 + "}}"
    assert parse_tool_calls(f"<tool_call>{deepest}</tool_call>")[0]["arguments"]["expression"] == "1 + 1"  # 32 deep: read
    in_a_string = '{"name": "calculator", "arguments": {"expression": "2 + 2  # ' + "[{" * 400 + '"}}'  # not nesting
    assert ToolEnvironment(["calculator"]).step(f"<tool_call>{in_a_string}</tool_call>").observation == "4"


def test_calculator_is_exact_and_runs_no_code():
    assert calculator("17 * 23") == "391" and calculator("-(7 - 10) % 4") == "3" and calculator("1 / 4") == "0.25"
    for bad in ("__import__('os').system('true')", "[1] * 10", "2 ** 1000"):
        with pytest.raises(ValueError):
            calculator(bad)


# Each must be refused before it computes: the calculator holds the GIL, no timeout can stop it.
CALCULATOR_BOMBS = {
    "(((9**64)**64)**64)**64": "result too large",  # small exponents, exploding operands
    "9**9**9**9": "exponent too large",
    "(10**4000)*(10**4000)": "exponent too large",
    "(2**64)**60 * (2**64)**60": "result too large",  # each factor allowed (3840 bits), the product not
    " * ".join(["2**64"] * 70): "result too large",  # a long chain of allowed factors
    "-" * 900 + "1": "nested more than",
    "(" * 150 + "1" + "+1)" * 150: "nested more than",
    "1" * 100_000: "longer than",  # a 100,000-digit literal
    "1e300 * 1e300": "number too large",
    "10.0 ** 60 * 1e300": "number too large",
    "2 ** 64 / 0": "division by zero",
    "(-8) ** 0.5": "not a real number",
}


@pytest.mark.parametrize("bomb", CALCULATOR_BOMBS)
def test_calculator_refuses_work_it_cannot_bound(bomb):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=CALCULATOR_BOMBS[bomb]):
        calculator(bomb)
    assert time.perf_counter() - start < 0.5
    # the policy sees it as the tool's one-line error text
    observation = ToolEnvironment(["calculator"]).run({"name": "calculator", "arguments": {"expression": bomb}})
    assert observation.startswith("error: ValueError: ") and "\n" not in observation


def test_calculator_stays_exact_within_its_bounds():
    assert [calculator(f"{x} * {y}") for x, y in ((37, 52), (99, 99), (10, 10))] == ["1924", "9801", "100"]
    assert calculator("2 ** 64") == "18446744073709551616" and calculator("2 ** -2") == "0.25"
    assert calculator("(2**64)**60") == str(2**3840)  # at the bit bound's edge, still exact
    assert calculator("9" * 999) == "9" * 999 and calculator("1.5 * 4") == "6"


@needs_sandbox
def test_user_tools_and_the_python_tool(tmp_path):
    (tmp_path / "my_tools.py").write_text("def shout(text):\n    return text.upper()\n")
    env = ToolEnvironment([f"{tmp_path / 'my_tools.py'}:shout", "python"])
    step = env.step('<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
                    '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
                    '<tool_call>{"name": "shout", "arguments": {"wrong": 1}}</tool_call>')
    lines = step.observation.split("\n")
    assert lines[0] == "HI" and lines[1] == "42" and lines[-1].startswith("error: TypeError")
    with pytest.raises(ConfigError, match="not found"):
        ToolEnvironment([f"{tmp_path / 'missing.py'}:shout"])


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def test_calls_past_max_calls_per_turn_are_answered_not_run():
    env = ToolEnvironment(["calculator"], max_calls_per_turn=2)
    lines = env.step("".join(call(f"{i} + 1") for i in range(5))).observation.split("\n")
    assert lines[:2] == ["1", "2"]
    assert lines[2:] == ["error: more than 2 tool calls in one turn; this one was not run"] * 3
    assert ToolEnvironment(["calculator"]).step("".join(call("1 + 1") for _ in range(4))).observation == "\n".join(["2"] * 4)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4"])
def test_max_calls_per_turn_must_be_a_positive_whole_number(bad):
    with pytest.raises(ConfigError, match="max_calls_per_turn"):
        ToolEnvironment(["calculator"], max_calls_per_turn=bad)


@pytest.mark.parametrize("turn", [
    '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',  # an unknown tool, echoed
    '<tool_call>{"name": "calculator", "arguments": {"\\udfff": 1}}</tool_call>',  # a bad argument, echoed
])
def test_a_lone_surrogate_echoed_by_a_tool_reaches_the_policy_as_a_replacement(turn, tiny_text):
    """JSON's `\\ud800` decodes to a lone surrogate, which the tools echo in their error; the
    tokenizer (and the trajectory files) cannot take it."""
    from transformers import AutoTokenizer

    step = as_step(ToolEnvironment(["calculator"]).step(turn))
    assert "\ufffd" in step.observation and step.observation.encode("utf-8")
    AutoTokenizer.from_pretrained(tiny_text).encode(step.observation)
