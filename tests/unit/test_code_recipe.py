"""Code-execution reward on real runs (no mocks): passing, failing and malformed programs, the
limits, and running without OS isolation (refused, or opted into). Hostile programs against the
OS sandbox: test_sandbox_redteam.py."""

import os
import re
import time

import pytest

from tests.marks import needs_sandbox
from reward_recipes.code import extract_program, normalise_output, unit_tests
from vlrft.isolation import sandbox
from vlrft.isolation.sandbox import SandboxUnavailable, run_python, run_tests

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = {"id": "add", "meta": {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"}}
SUM_CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"},
             {"input": "0 0\n", "output": "1\n"}]  # the third expected output is deliberately wrong
SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b, ' ')\n"  # trailing space: still right


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nDone."


@needs_sandbox
def test_asserts_right_wrong_and_broken_programs():
    wrong, broken = "def add(a, b):\n    return a - b\n", "def add(a, b)\n    return a + b\n"
    completions = [fenced(ADD), fenced(wrong), fenced(broken), ADD]  # no fence: the whole text is the program
    assert unit_tests(completions, [ADD_TESTS] * 4) == [1.0, 0.0, 0.0, 1.0]


@needs_sandbox
def test_exiting_before_the_asserts_does_not_pass():
    for escape in ["import sys; sys.exit(0)", "import os; os._exit(0)", "exit()"]:
        assert unit_tests([fenced(ADD + escape + "\n")], [ADD_TESTS]) == [0.0], escape


@needs_sandbox
def test_last_python_block_wins():
    wrong = "def add(a, b):\n    return 0\n"
    two = fenced(wrong) + "\nActually:\n" + fenced(ADD, tag="")
    assert extract_program(two) == ADD
    assert extract_program(fenced(ADD) + fenced("echo hi\n", tag="bash")) == ADD  # other languages skipped
    assert unit_tests([two, fenced(ADD) + fenced(wrong)], [ADD_TESTS] * 2) == [1.0, 0.0]


def test_empty_completion_and_rows_without_tests():
    assert unit_tests(["", fenced(""), "   "], [ADD_TESTS] * 3) == [0.0, 0.0, 0.0]
    assert unit_tests([fenced(ADD), ""], [{"id": "x", "meta": {}}, {"id": "y"}]) == [None, None]


@needs_sandbox
def test_stdin_cases_all_or_partial():
    samples = [{"id": "sum", "meta": {"test_cases": SUM_CASES}}]
    assert unit_tests([fenced(SUM_PROGRAM)], samples) == [0.0]
    assert unit_tests([fenced(SUM_PROGRAM)], samples, partial=True) == [pytest.approx(2 / 3)]
    all_right = [{"id": "sum", "meta": {"test_cases": SUM_CASES[:2]}}]
    assert unit_tests([fenced(SUM_PROGRAM), fenced("print(3)")], all_right * 2, partial=True) == [1.0, 0.5]
    assert normalise_output("3 \n4\t\n\n") == normalise_output("3\n4") == "3\n4"


def test_malformed_tests_name_the_sample():
    bad = [{"input": "1 2\n", "output": "3"}, {"input": "1 2\n"}]
    for meta, message in [({"test_cases": bad}, r"'row-7'.*test_cases\[1\]"), ({"test_cases": []}, "'row-7'"),
                          ({"tests": 3}, r"'row-7'.*meta\['tests'\]"),
                          ({"tests": "assert 1", "test_cases": SUM_CASES}, "'row-7'.*both")]:
        with pytest.raises(ValueError, match=message):
            unit_tests(["print(1)"], [{"id": "row-7", "meta": meta}])


@needs_sandbox
def test_infinite_loop_is_killed_on_time():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert result.timed_out and not result.passed
    assert time.monotonic() - start < 1.0 + 3
    start = time.monotonic()
    assert unit_tests([fenced("import time\ntime.sleep(60)\n" + ADD)], [ADD_TESTS], timeout_s=1.0) == [0.0]
    assert time.monotonic() - start < 1.0 + 3


def resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@needs_sandbox
def test_memory_bomb_fails_inside_the_child_only():
    before = resident_kib()
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')\n", memory_mb=256)
    assert not result.passed and "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert resident_kib() - before < 100 * 1024  # this process did not grow by the bomb


@needs_sandbox
def test_output_is_capped():
    result = run_python("while True:\n    print('spam' * 100)\n", timeout_s=3.0)
    assert not result.passed and len(result.stdout) <= 64 * 1024


@needs_sandbox
def test_tests_see_the_programs_objects_and_exceptions():
    """What a harness in another process must still get right: classes and instances, methods,
    generators, big globals, arguments changed in place, exceptions by type."""
    program = """
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
        return self
    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()
def evens(n):
    yield from range(0, n, 2)
def sort_in_place(values):
    values.sort()
def parse(text):
    return int(text)
TABLE = list(range(100000))
"""
    tests = """
s = Stack()
s.push(1).push(2)
assert s.pop() == 2 and s.pop() == 1 and s.items == []
try:
    s.pop()
except IndexError as err:
    assert "empty" in str(err)
else:
    assert False
assert list(evens(7)) == [0, 2, 4, 6]
values = [3, 1, 2]
sort_in_place(values)
assert values == [1, 2, 3]
assert TABLE[99999] == 99999 and len(TABLE) == 100000
assert parse("12") == 12 and {parse("3"): (1.5, b"x", None, {2}, 1j)} == {3: (1.5, b"x", None, {2}, 1j)}
assert parse(str(2**200)) == 2**200
try:
    parse("x")
except ValueError:
    pass
else:
    assert False
"""
    verdict = run_tests(program, tests)
    assert verdict.passed, verdict.reason


@needs_sandbox
def test_a_failed_verdict_says_why():
    assert run_tests("def f():\n    return 1\n", "assert f() == 2, 'f is wrong'\n").reason == "fail: AssertionError: f is wrong"
    assert run_tests("def f():\n    return 1\n", "assert f() == 1 and g() == 1\n").reason == "fail: NameError: name 'g' is not defined"
    assert run_tests("def f():\n    return 1\n", "assert g() == 1\n").reason == "fail: the tests use none of the program's names"
    slow = run_tests("import time\ntime.sleep(30)\n", "assert True\n", timeout_s=1.0)
    assert not slow.passed and slow.timed_out and slow.reason == "fail: timed out after 1s"


def test_a_failed_probe_is_tried_again_and_a_success_is_kept(monkeypatch):
    """A moment of pressure (memory, disk) must not leave a long-lived worker without its
    sandbox for good: a failure is probed again after PROBE_AGAIN_S; a success is not."""
    from vlrft.isolation import sandbox

    outcomes = iter([(None, "bwrap cannot start a sandbox here (out of memory)"), ("/usr/bin/bwrap", None)])
    probes, clock = [], [1000.0]
    monkeypatch.setattr(sandbox, "_probe", lambda: probes.append(clock[0]) or next(outcomes))
    monkeypatch.setattr(sandbox.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sandbox, "_probed", [])
    assert sandbox.isolation_problem() == "bwrap cannot start a sandbox here (out of memory)"
    clock[0] += sandbox.PROBE_AGAIN_S / 2
    assert sandbox.isolation_problem() is not None and len(probes) == 1  # not probed again at once
    clock[0] += sandbox.PROBE_AGAIN_S
    assert sandbox.isolation_problem() is None and len(probes) == 2
    clock[0] += 10 * sandbox.PROBE_AGAIN_S
    assert sandbox.isolation_problem() is None and len(probes) == 2  # a success holds


def without_bubblewrap(monkeypatch):
    from vlrft.isolation import sandbox

    monkeypatch.setattr(sandbox, "_bubblewrap", lambda: (None, "bubblewrap (bwrap) is not installed"))
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)


def test_without_isolation_code_is_refused_unless_opted_in(monkeypatch, tmp_path):
    """No bubblewrap: the config refuses to load, a call refuses to run, both in one line; with
    sandbox.unsafe_no_isolation the run starts (warning once) and programs run under the audit hook."""
    from vlrft.config import load_config
    from vlrft.isolation import sandbox

    without_bubblewrap(monkeypatch)
    with pytest.raises(SandboxUnavailable, match=r"^this call runs model-written code, which needs OS isolation, "
                                                 r"and bubblewrap \(bwrap\) is not installed: install bubblewrap"):
        run_python("print(1)")
    config = tmp_path / "run.yaml"
    config.write_text("model: {path: m}\ndata: {train_path: t.jsonl}\nreward: {default: [{recipe: code_unit_tests}]}\n")
    with pytest.raises(SandboxUnavailable, match=r"^reward recipe 'code_unit_tests' runs model-written code.*\(unsafe\)$"):
        load_config(config)
    tools = tmp_path / "tools.yaml"
    tools.write_text("model: {path: m}\ndata: {train_path: t.jsonl}\nrollout: {environment: tools, environment_args: {tools: [calculator, python]}}\n")
    with pytest.raises(SandboxUnavailable, match=r"^tool 'python' runs model-written code"):
        load_config(tools)
    load_config(tools, ["rollout.environment_args={tools: [calculator]}"])  # the calculator runs no code
    cfg = load_config(config, ["sandbox.unsafe_no_isolation=true"])
    assert "without OS isolation" in sandbox.configure(cfg.sandbox.unsafe_no_isolation)
    assert run_python("print(6 * 7)").stdout == "42\n"
    assert unit_tests([fenced(ADD)], [ADD_TESTS]) == [1.0]
    result = run_python("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n")
    assert not result.passed and "sandbox: socket." in result.stderr  # the hook is all there is
    outside = tmp_path / "escaped.txt"
    result = run_python(f"open({str(outside)!r}, 'w').write('x')\n")
    assert not result.passed and not outside.exists() and "outside the sandbox" in result.stderr
    assert sandbox.configure(False) is None and sandbox.UNSAFE_ENV not in os.environ


@needs_sandbox
def test_an_interpreter_under_tmp_stays_visible(monkeypatch, tmp_path):
    """The sandbox's /tmp is a tmpfs of its own; a venv that lives under the host's /tmp (as
    .ci/run's may) is bound after it, not hidden by it (found by a clean-clone CI run)."""
    from vlrft.isolation import launch

    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "marker.txt").write_text("bound")
    dirs = launch.python_dirs()
    monkeypatch.setattr(launch, "python_dirs", lambda: [*dirs, str(venv)])
    result = run_python(f"print(open({str(venv / 'marker.txt')!r}).read())")
    assert result.passed and result.stdout == "bound\n", result.stderr
