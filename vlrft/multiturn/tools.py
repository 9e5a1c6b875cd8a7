"""Tool calling: Qwen/Hermes-style calls parsed from a turn, run, and their results returned as
the next observation.

A call is written by the policy as
    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>
A turn without a call is the final answer: the trajectory ends there (calls are parsed in
vlrft/multiturn/tool_calls.py; one that cannot be read is answered with why). A tool is a plain
function taking the call's arguments as keywords and returning text; built-ins are
`calculator` (exact arithmetic, no eval) and `python` (a program run in the subprocess sandbox,
its stdout returned). A tool that raises returns its error as the result: the policy sees it,
as a person at a terminal would.
"""

from __future__ import annotations

import ast
import operator
from typing import Callable

from vlrft.errors import ConfigError
from vlrft.multiturn.environment import Step
from vlrft.multiturn.tool_calls import parse_tool_calls
from vlrft.registry import load_callable
from vlrft.isolation.sandbox import run_python

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


# A timeout kills the environment worker the calculator runs in, and ends the trajectory; so a
# hard expression must never reach the timeout: every operation is refused before it runs if
# its result could be big, which bounds the work of any expression by construction
# (`(((9**64)**64)**64)**64` has small exponents but huge operands). Results past these bounds
# are errors the policy sees, as a typo would be.
MAX_EXPRESSION_CHARS = 1000
MAX_DEPTH = 100  # nested operations (a chain `1+1+...` nests one level per operator)
MAX_EXPONENT = 64
MAX_INT_BITS = 4096  # about 1233 decimal digits; products of such ints take microseconds
MAX_FLOAT = 1e300  # past this a float is as good as infinite


def _int_result_bits(op: ast.operator, a: int, b: int) -> int:
    """An upper bound on the bit length of `a op b` for ints (0 for operations that shrink)."""
    if isinstance(op, ast.Pow):
        return b * a.bit_length() if b > 0 else 0  # |a|**b < 2**(b * bits(a)); b <= 0 gives a float <= |a|
    if isinstance(op, ast.Mult):
        return a.bit_length() + b.bit_length()
    if isinstance(op, (ast.Add, ast.Sub)):
        return max(a.bit_length(), b.bit_length()) + 1
    return 0  # / // %: no larger than the operands


def _checked(value):
    """`value` if it is a real number within the bounds, else the error the policy sees."""
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"number too large (over {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not (abs(value) <= MAX_FLOAT):  # also catches inf and nan
        raise ValueError("number too large")
    if not isinstance(value, (int, float)):  # (-8) ** 0.5 is complex
        raise ValueError("result is not a real number")
    return value


def _binary(op: ast.operator, a, b):
    if isinstance(op, ast.Pow) and abs(b) > MAX_EXPONENT:
        raise ValueError("exponent too large")
    if isinstance(a, int) and isinstance(b, int) and _int_result_bits(op, a, b) > MAX_INT_BITS:
        raise ValueError(f"result too large (over {MAX_INT_BITS} bits)")
    try:
        return _checked(_OPERATORS[type(op)](a, b))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:  # float ** float, or an int too large for a float
        raise ValueError("number too large") from None


def _evaluate(node: ast.AST, depth: int = 0) -> float | int:
    if depth > MAX_DEPTH:
        raise ValueError(f"expression nested more than {MAX_DEPTH} deep")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _binary(node.op, _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand, depth + 1))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses), exact for ints;
    an expression past the bounds above raises ValueError (the tool's error text)."""
    expression = str(expression)
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (RecursionError, MemoryError):  # the parser's own nesting limit
        raise ValueError(f"expression nested more than {MAX_DEPTH} deep") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def python(code: str) -> str:
    """Run a program in the sandbox (5 s, 512 MB); its standard output, or why it failed."""
    result = run_python(str(code), timeout_s=5.0)
    if result.timed_out:
        return "error: timed out after 5s"
    if result.returncode != 0:
        return "error: " + (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
    return result.stdout


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


def resolve_tool(spec: str) -> tuple[str, Callable[..., str]]:
    """(name the policy calls it by, function): a built-in name or 'module:fn' / 'file.py:fn'."""
    if spec in BUILTIN_TOOLS:
        return spec, BUILTIN_TOOLS[spec]
    try:
        fn = load_callable(spec)
    except ValueError as err:
        raise ConfigError(f"tool {err}; built-in tools: {', '.join(BUILTIN_TOOLS)}") from None
    return spec.rpartition(":")[2], fn


class ToolEnvironment:
    """The `tools` environment: runs the tool calls of each turn; a turn without one ends the
    trajectory. environment_args: tools (list of names or 'file.py:fn'), max_result_chars,
    max_calls_per_turn (calls past it are answered with an error, not run: a turn of many slow
    calls would otherwise spend the whole environment timeout, and the step's budget, at once)."""

    observation_role = "tool"
    shows_images = False  # tool results are text

    def __init__(self, tools: list[str] = ("calculator",), max_result_chars: int = 1000, max_calls_per_turn: int = 4):
        if not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ConfigError(f"environment_args 'max_calls_per_turn' must be a whole number >= 1, got {max_calls_per_turn!r}")
        self.tools = dict(resolve_tool(spec) for spec in tools)
        self.max_result_chars = max_result_chars
        self.max_calls_per_turn = max_calls_per_turn

    def reset(self, sample: dict) -> None:
        pass

    def step(self, action: str) -> Step:
        calls = parse_tool_calls(action)
        if not calls:
            return Step("", 0.0, done=True)
        over = f"error: more than {self.max_calls_per_turn} tool calls in one turn; this one was not run"
        return Step("\n".join(self.run(call) if i < self.max_calls_per_turn else over for i, call in enumerate(calls)))

    def run(self, call: dict) -> str:
        if "error" in call:
            return f"error: {call['error']}"
        tool = self.tools.get(call["name"])
        if tool is None:
            return f"error: unknown tool '{call['name']}'; available: {', '.join(self.tools)}"
        try:
            result = str(tool(**call["arguments"]))
        except Exception as err:  # noqa: BLE001 - a tool's error is its result, shown to the policy
            result = f"error: {type(err).__name__}: {err}"
        return result[: self.max_result_chars]
