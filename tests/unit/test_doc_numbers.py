"""Numbers in the docs keep their promises: every docs/benchmarks.md entry says when and at
which commit its numbers were measured ("Measured (YYYY-MM-DD, commit abc1234..."), every commit
it names is in the project's history (where a git checkout is at hand), and the sandbox's
attack count is the number of hostile cases in its test file."""

import re
import shutil
import sys
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEASURED = re.compile(r"Measured \((\d{4}-\d{2}-\d{2}), commits? ([0-9a-f]{7,40})")
COMMIT = re.compile(r"\bcommits? ([0-9a-f]{7,40})\b")
ESTIMATES = ("Memory table",)  # an entry that measures nothing: it names the commit that printed it


def entries(text: str) -> dict[str, str]:
    """`## ` heading -> the entry's text."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def undated_entries(text: str) -> list[str]:
    return [heading for heading, body in entries(text).items()
            if not MEASURED.search(body) and not (heading.startswith(ESTIMATES) and COMMIT.search(body))]


def test_every_benchmark_entry_says_when_and_at_which_commit():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(entries(text)) >= 12
    assert undated_entries(text) == []


def test_an_entry_without_its_date_and_commit_is_named():
    text = "## Packing: `bench/packing.py`\n\n- Measured (2026-11-22, commit 0cc947f): 2.0x.\n\n## New: `bench/new.py`\n\n- 3x faster.\n"
    assert undated_entries(text) == ["New: `bench/new.py`"]


def full_history() -> bool:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return False
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    return shallow.stdout.strip() == "false"


@pytest.mark.skipif(not full_history(), reason="not a git checkout with its full history")
def test_every_commit_the_benchmarks_name_is_in_the_history():
    named = set(COMMIT.findall((ROOT / "docs" / "benchmarks.md").read_text()))
    assert len(named) >= 12
    missing = [c for c in sorted(named)
               if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{c}^{{commit}}"], capture_output=True).returncode]
    assert missing == []


def test_the_sandbox_attack_count_in_the_docs_is_the_number_of_hostile_cases():
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             str(ROOT / "tests" / "unit" / "test_sandbox_redteam.py")], capture_output=True, text=True, cwd=ROOT)
    cases = [line for line in listed.stdout.splitlines() if "::" in line]
    hostile = [case for case in cases if "honest" not in case]
    assert len(cases) - len(hostile) == 1, listed.stdout[-2000:]
    for page in ("security.md", "reward_recipes.md", "testing.md"):
        counts = re.findall(r"(\d+) hostile test cases", (ROOT / "docs" / page).read_text())
        assert counts and all(int(n) == len(hostile) for n in counts), (page, counts, len(hostile))
