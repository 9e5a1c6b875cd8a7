"""Read what a run directory holds for the report: the saved trajectories
(`trajectories/step_NNNNNN.rankR.jsonl`, one JSON record per response) and `metrics.jsonl`.

A file the reader cannot use stops it with a one-line `ReportError` naming the file and line.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from vlrft.errors import VlrftError

TRAJECTORY_NAME = re.compile(r"step_(\d+)\.rank(\d+)\.jsonl")
# Fields the report reads from every record; "entropy", "logprobs" and "response_tokens" are
# optional (a run without per-token statistics still gets a report).
REQUIRED_FIELDS = ("id", "data_source", "group_id", "prompt_text", "images", "response_text", "reward",
                   "components", "advantage", "response_length", "truncated", "correct")


class ReportError(VlrftError, ValueError):
    """A run directory the report cannot read: missing, without trajectories, or holding a
    malformed line. The message is one line naming the file (and line)."""


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, JSON object) for each line of a JSONL file, blank lines skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ReportError(f"{path}:{number}: malformed JSON line ({err.msg})") from None
            if not isinstance(row, dict):
                raise ReportError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def as_float(value) -> float:
    """The saver writes NaN/inf as null (JSON has neither); read null back as NaN so the number
    stays visibly broken instead of turning into a plausible 0."""
    return float("nan") if value is None else float(value)


def normalised(record: dict, where: str) -> dict:
    """`record` checked for the fields the report reads, with nulls made numeric: a null
    component means "not applicable" and is left out, so component means average only the
    responses it applies to."""
    missing = [field for field in REQUIRED_FIELDS if field not in record]
    if missing:
        raise ReportError(f"{where}: record lacks {', '.join(missing)}")
    try:
        entropy = record.get("entropy")
        return record | {
            "reward": as_float(record["reward"]),
            "advantage": as_float(record["advantage"]),
            "correct": as_float(record["correct"]),
            "components": {name: float(v) for name, v in record["components"].items() if v is not None},
            # Long per-token lists are copied only when they hold a null.
            "entropy": [as_float(h) for h in entropy] if entropy is not None and None in entropy else entropy,
        }
    except (TypeError, ValueError, AttributeError) as err:
        raise ReportError(f"{where}: record has a non-numeric score ({err})") from None


def trajectory_files(run_dir: Path) -> list[tuple[int, int, Path]]:
    """(step, rank, path) of every saved trajectory file, in step then rank order."""
    found = []
    directory = run_dir / "trajectories"
    for path in directory.glob("step_*.rank*.jsonl") if directory.is_dir() else ():
        match = TRAJECTORY_NAME.fullmatch(path.name)
        if match:
            found.append((int(match[1]), int(match[2]), path))
    return sorted(found)


def load_records(run_dir: str | Path) -> dict[int, list[dict]]:
    """step -> the records of all ranks at that step (rank 0's first), steps ascending.
    Steps whose files hold no records are left out; no trajectories at all gives {}."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist")
    by_step: dict[int, list[dict]] = defaultdict(list)
    for step, _rank, path in trajectory_files(run_dir):
        for number, record in read_jsonl(path):
            by_step[step].append(normalised(record, f"{path}:{number}"))
    return {step: records for step, records in sorted(by_step.items())}


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The lines of `run_dir/metrics.jsonl` in file order; [] when the run logged none."""
    path = Path(run_dir) / "metrics.jsonl"
    return [row for _number, row in read_jsonl(path)] if path.is_file() else []
