"""Code-execution reward on real runs (no mocks): passing, failing, hostile and malformed programs."""

import os
import re
import time

import pytest

from reward_recipes.code import extract_program, normalise_output, unit_tests
from vlrft.rewards import sandbox
from vlrft.rewards.sandbox import network_namespace_available, run_python

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = {"id": "add", "meta": {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"}}
SUM_CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"},
             {"input": "0 0\n", "output": "1\n"}]  # the third expected output is deliberately wrong
SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b, ' ')\n"  # trailing space: still right


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nDone."


def test_asserts_right_wrong_and_broken_programs():
    wrong, broken = "def add(a, b):\n    return a - b\n", "def add(a, b)\n    return a + b\n"
    completions = [fenced(ADD), fenced(wrong), fenced(broken), ADD]  # no fence: the whole text is the program
    assert unit_tests(completions, [ADD_TESTS] * 4) == [1.0, 0.0, 0.0, 1.0]


def test_exiting_before_the_asserts_does_not_pass():
    for escape in ["import sys; sys.exit(0)", "import os; os._exit(0)", "exit()"]:
        assert unit_tests([fenced(ADD + escape + "\n")], [ADD_TESTS]) == [0.0], escape


def test_last_python_block_wins():
    wrong = "def add(a, b):\n    return 0\n"
    two = fenced(wrong) + "\nActually:\n" + fenced(ADD, tag="")
    assert extract_program(two) == ADD
    assert extract_program(fenced(ADD) + fenced("echo hi\n", tag="bash")) == ADD  # other languages skipped
    assert unit_tests([two, fenced(ADD) + fenced(wrong)], [ADD_TESTS] * 2) == [1.0, 0.0]


def test_empty_completion_and_rows_without_tests():
    assert unit_tests(["", fenced(""), "   "], [ADD_TESTS] * 3) == [0.0, 0.0, 0.0]
    assert unit_tests([fenced(ADD), ""], [{"id": "x", "meta": {}}, {"id": "y"}]) == [None, None]


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


def test_memory_bomb_fails_inside_the_child_only():
    before = resident_kib()
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')\n", memory_mb=256)
    assert not result.passed and "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert resident_kib() - before < 100 * 1024  # this process did not grow by the bomb


@pytest.mark.parametrize("code", [
    "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 80))\nprint('connected')\n",
    "import socket\nprint(socket.getaddrinfo('localhost', 80))\n",
    "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:1/').read())\n",
])
def test_network_is_refused(code):
    result = run_python(code)
    assert not result.passed and "connected" not in result.stdout
    assert re.search(r"sandbox: socket\.\S+ is not allowed", result.stderr), result.stderr


def test_audit_hook_alone_refuses_the_network(monkeypatch):
    # As on a machine where unshare is not permitted: the child runs in the host's namespace.
    monkeypatch.setattr(sandbox, "_unshare_prefix", lambda: ())
    result = run_python("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n")
    assert not result.passed and "sandbox: socket." in result.stderr


def test_network_namespace_has_only_loopback():
    if not network_namespace_available():
        pytest.skip("unshare -rn is not permitted here: the audit hook alone refuses the network")
    result = run_python("print(open('/proc/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines() if ":" in line]
    assert result.passed and interfaces == ["lo"]


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.run(['echo', 'hi'])\n",
    "import os\nos.system('echo hi')\n",
    "import os\nos.execv('/bin/echo', ['echo', 'hi'])\n",
    "import os\nif os.fork() == 0:\n    print('hi')\n",
    "import os\nos.posix_spawn('/bin/echo', ['echo', 'hi'], {})\n",
])
def test_process_spawning_is_refused(code):
    result = run_python(code)
    assert not result.passed and "hi" not in result.stdout
    assert "sandbox:" in result.stderr and "not allowed" in result.stderr, result.stderr


def test_files_stay_in_a_temporary_directory_that_is_removed(tmp_path):
    result = run_python("import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())\nprint(os.listdir('.'))\n")
    assert result.passed, result.stderr
    workdir = result.stdout.splitlines()[0]
    assert "out.txt" in result.stdout and not os.path.exists(workdir)
    outside = tmp_path / "escaped.txt"
    result = run_python(f"open({str(outside)!r}, 'w').write('x')\n")
    assert not result.passed and not outside.exists() and "outside the sandbox" in result.stderr


def test_output_is_capped():
    result = run_python("while True:\n    print('spam' * 100)\n", timeout_s=3.0)
    assert not result.passed and len(result.stdout) <= 64 * 1024
