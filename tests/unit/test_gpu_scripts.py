"""tests/gpu/run_all.sh, the one command a GPU machine runs: it refuses a mistyped part before
running anything; its `tests` part runs the GPU tests (which skip on CPU, saying why); parts
joined by '+' run at the same time, a failed one does not stop the others, each ends with a
verdict line, and the logs are packed into ARCHIVE however the run ended; past DEADLINE, parts
are skipped; an environment that cannot import what the parts need stops before them."""

import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

RUN_ALL = Path(__file__).resolve().parents[2] / "tests" / "gpu" / "run_all.sh"


def run_all(*parts, tmp_path, **env):
    # Started elsewhere than the checkout, with relative paths: they are the caller's.
    env = {**os.environ, "LOG_DIR": "logs", "WHEELS": str(tmp_path / "no-wheels"), "ARCHIVE": "logs.tgz", **env}
    return subprocess.run(["bash", os.path.relpath(RUN_ALL, tmp_path), *parts], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)


def archived(tmp_path) -> set[str]:
    with tarfile.open(tmp_path / "logs.tgz") as archive:
        return {Path(name).name for name in archive.getnames() if name.endswith(".log")}


@pytest.mark.parametrize("parts, env, message", [
    (["tests", "demo:fp16:2"], {}, "run_all: unknown part 'demo:fp16:2' (tests, demo[:DTYPE[:ZERO[:SEED]]], "
                                   "bench[:SHAPE[:ZERO]], shared[:LAYERS]; '+' joins parts run at once)"),
    (["bench:1.5B:4"], {}, "run_all: unknown part 'bench:1.5B:4' (tests, demo[:DTYPE[:ZERO[:SEED]]], "
                           "bench[:SHAPE[:ZERO]], shared[:LAYERS]; '+' joins parts run at once)"),
    (["demo+bench", "demo:bfloat16:2:0"], {}, "run_all: part 'demo:bfloat16:2:0' is named twice"),
    (["tests"], {"DEADLINE": "8m"}, "run_all: DEADLINE is whole seconds, not '8m'"),
])
def test_a_mistyped_command_stops_before_anything_runs(parts, env, message, tmp_path):
    done = run_all(*parts, tmp_path=tmp_path, **env)
    assert done.returncode == 2
    assert done.stderr.strip() == message
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the GPU tests run themselves, at full length")
def test_parts_run_together_a_failure_stops_nothing_and_every_log_is_archived(tmp_path):
    # On CPU the benchmarks fail at once: a failed part among the others. The bench is handed
    # BENCH_ARGS, here a flag value it refuses (exit status 2, argparse's).
    done = run_all("tests+bench:tiny:2", "shared:2", tmp_path=tmp_path, BENCH_ARGS="--compile sometimes")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("run_all: ")]
    verdicts = {line.split()[1]: line for line in lines[:3]}
    assert verdicts["tests"].startswith("run_all: tests passed after ") and "skipped in" in verdicts["tests"]
    assert "FAILED (exit status 2)" in verdicts["bench:tiny:2"] and "FAILED (exit status 1)" in verdicts["shared:2"]
    assert "argument --compile: invalid choice: 'sometimes'" in (tmp_path / "logs" / "bench-tiny-2.log").read_text()
    log = (tmp_path / "logs" / "tests.log").read_text()
    assert "test_colour_demo_trains_on_one_gpu_with_nccl" in log and "no CUDA GPU is visible" in log
    assert archived(tmp_path) == {"versions.log", "tests.log", "bench-tiny-2.log", "shared-2.log"}


def test_parts_after_the_deadline_are_skipped_and_the_run_fails(tmp_path):
    done = run_all("tests", "bench:tiny+shared:2", tmp_path=tmp_path, DEADLINE="1")
    assert done.returncode == 1
    assert "run_all: tests skipped: the deadline (DEADLINE=1 s) has passed" in done.stdout
    assert "run_all: bench:tiny+shared:2 skipped: the deadline (DEADLINE=1 s) has passed" in done.stdout
    assert archived(tmp_path) == {"versions.log"}


def test_an_environment_missing_a_package_stops_before_any_part(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "peft.py").write_text("raise ImportError('no peft on this image')\n")
    done = run_all("tests", "bench:1.5B", tmp_path=tmp_path, PYTHONPATH=str(planted))
    assert done.returncode == 3
    assert "run_all: this environment cannot run the checks: ImportError: no peft on this image" in done.stdout
    assert "run_all: nothing was run" in done.stdout and "passed" not in done.stdout
    assert archived(tmp_path) == {"versions.log"}
