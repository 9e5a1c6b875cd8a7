"""Code execution: run the completion's program against the row's unit tests in a sandbox."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from vlrft.isolation.sandbox import OUTPUT_LIMIT, run_python, run_tests

# A fence's language tag: after spaces or tabs, the word characters and +#.- that follow ```.
_TAG = re.compile(r"[ \t]*([\w+#.-]*)")
_PYTHON_TAGS = {"", "python", "py", "python3"}


def fenced_blocks(text: str) -> Iterator[tuple[str, str]]:
    r"""(language tag, body) of each fenced block: ``` and an optional tag, the rest of that line,
    the body, the next ```. The matches of re.findall(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```",
    text, re.DOTALL), found with str.find: that regex is quadratic on ``` followed by a long line
    with no newline (its two patterns for the line trade characters)."""
    start = 0
    while True:
        opening = text.find("```", start)
        if opening < 0:
            return
        newline = text.find("\n", opening + 3)
        closing = text.find("```", newline + 1) if newline >= 0 else -1
        if closing < 0:  # and no later opening has a newline and a closing after it either
            return
        yield _TAG.match(text, opening + 3, newline).group(1), text[newline + 1:closing]
        start = closing + 3


def extract_program(text: str) -> str:
    """The last ```python (or untagged) fenced block's body, else the whole text."""
    program = text
    for tag, body in fenced_blocks(text):
        if tag.lower() in _PYTHON_TAGS:
            program = body
    return program


def normalise_output(text: str) -> str:
    """Trailing white space dropped per line, and trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


def _read_tests(sample: dict, index: int) -> str | list[tuple[str, str]] | None:
    """The row's tests: assert code (str), stdin/stdout cases [(input, output)], or None."""
    name = f"sample {sample.get('id', index)!r}"
    meta = sample.get("meta") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"unit_tests: {name}: meta must be a dict, got {type(meta).__name__}")
    tests, cases = meta.get("tests"), meta.get("test_cases")
    if tests is not None and cases is not None:
        raise ValueError(f"unit_tests: {name}: meta has both 'tests' and 'test_cases'; keep one")
    if tests is not None:
        if not isinstance(tests, str) or not tests.strip():
            raise ValueError(f"unit_tests: {name}: meta['tests'] must be non-empty Python test code")
        return tests
    if cases is None:
        return None
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"unit_tests: {name}: meta['test_cases'] must be a non-empty list")
    parsed = []
    for j, case in enumerate(cases):
        if not (isinstance(case, dict) and all(isinstance(case.get(k), str) for k in ("input", "output"))):
            raise ValueError(f"unit_tests: {name}: test_cases[{j}] must be {{'input': str, 'output': str}}, "
                             f"got {case!r:.80}")
        parsed.append((case["input"], case["output"]))
    return parsed


def _passes_asserts(program: str, tests: str, timeout_s: float, memory_mb: int) -> bool:
    # The tests run in a harness sandbox of their own that holds the verdict; the program only
    # answers the calls they make (vlrft/isolation/sandbox.py, run_tests): it cannot read the
    # tests, exit "successfully" before them, or print its way to a pass.
    return run_tests(program, tests, timeout_s=timeout_s, memory_mb=memory_mb).passed


def _passes_case(program: str, stdin: str, expected: str, timeout_s: float, memory_mb: int) -> bool:
    limit = max(OUTPUT_LIMIT, 2 * len(expected.encode()) + 1024)  # room to compare a long answer
    result = run_python(program, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb, output_limit=limit)
    return result.passed and normalise_output(result.stdout) == normalise_output(expected)


def unit_tests(completions: list[str], samples: list[dict], timeout_s: float = 5.0, memory_mb: int = 512,
               partial: bool = False) -> list[float | None]:
    """1.0 when the completion's program passes the row's tests (meta["tests"]: assert code run after
    the program; meta["test_cases"]: [{"input", "output"}] on stdin / stdout), else 0.0; with
    partial=True, the fraction of test cases passed. None for a row without tests."""
    rows = [_read_tests(sample, i) for i, sample in enumerate(samples)]  # bad rows fail before running
    scores: list[float | None] = [None if tests is None else 0.0 for tests in rows]
    jobs = []  # (row, case count, callable)
    for i, (completion, tests) in enumerate(zip(completions, rows)):
        program = extract_program(completion)
        if tests is None or not program.strip():
            continue
        if isinstance(tests, str):
            jobs.append((i, 1, lambda p=program, t=tests: _passes_asserts(p, t, timeout_s, memory_mb)))
        else:
            jobs += [(i, len(tests), lambda p=program, c=case: _passes_case(p, *c, timeout_s, memory_mb))
                     for case in tests]
    failed: set[int] = set()  # rows already lost: with partial=False their other cases are skipped

    def run(row: int, job) -> bool:
        if not partial and row in failed:
            return False
        ok = job()
        if not ok:
            failed.add(row)
        return ok

    # Each job mostly waits on its child process; one per core keeps the children from competing.
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        outcomes = list(pool.map(lambda job: run(job[0], job[2]), jobs))
    passed: dict[int, int] = {}
    for (row, count, _), ok in zip(jobs, outcomes):
        passed[row] = passed.get(row, 0) + ok
        scores[row] = passed[row] / count if partial else float(passed[row] == count)
    return scores
