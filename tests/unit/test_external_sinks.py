"""WandbSink (offline) and TensorboardSink: log a few steps the way the trainer does, then read
every metric back from the files the sinks wrote."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from vlrft.metrics.external_sinks import MissingSinkPackage, TensorboardSink, WandbSink

# The trainer's order: eval at step 0, then per step the training metrics, trajectory
# statistics and (some steps) eval metrics, each a separate write at the same step.
WRITES = [
    (0, {"eval/accuracy": 0.25, "eval/color_shapes/accuracy": 0.25}),
    (1, {"rollout/reward_mean": 0.125, "train/kl": 0.001, "perf/step_seconds": 1.5, "reward/fmt/mean": 0.5}),
    (1, {"traj/accuracy": 0.25}),
    (2, {"rollout/reward_mean": 0.375, "train/kl": 0.0025, "perf/step_seconds": 1.25, "reward/fmt/mean": 0.75}),
    (2, {"traj/accuracy": 0.5}),
    (2, {"eval/accuracy": 0.625, "eval/color_shapes/accuracy": 0.625}),
    (3, {"rollout/reward_mean": 0.5, "train/kl": 0.003, "perf/step_seconds": 1.0, "reward/fmt/mean": 1.0}),
]
CONFIG = {"train": {"total_steps": 3}, "algo": {"advantage": "grpo"}}


def expected_by_step() -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for step, metrics in WRITES:
        by_step.setdefault(step, {}).update(metrics)
    return by_step


def log_all(sink) -> None:
    for step, metrics in WRITES:
        sink.write(step, metrics)
    sink.close()


def wandb_records(path: Path):
    """The protobuf records of a `.wandb` file. wandb (0.31) ships no reader of its own: the file
    is a LevelDB-style log (https://github.com/google/leveldb/blob/main/doc/log_format.md)
    after a 7-byte ":W&B" header; each chunk has a little-endian [crc32, length, type] header
    and a record is one FULL chunk or FIRST + MIDDLE* + LAST, never crossing 32 KiB blocks
    (a block tail shorter than a chunk header is zero padding)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), f"not a wandb log: {path}"
    block, header = 32768, 7
    pos, pending = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + header : pos + header + length]
        assert checksum == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"corrupt chunk at byte {pos} of {path}"
        pos += header + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a complete record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """One offline wandb run for the module (startup takes about a second)."""
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("WANDB_API_KEY", raising=False)
        for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": root / "default",
                            "WANDB_CONFIG_DIR": root / "config", "WANDB_CACHE_DIR": root / "cache",
                            "WANDB_DATA_DIR": root / "data", "WANDB_DISABLE_GIT": "true",
                            "WANDB_DISABLE_CODE": "true"}.items():
            env.setenv(name, str(value))
        run_dir = root / "run"
        log_all(WandbSink(run_dir, project="vlrft-test", run_name="colours", config=CONFIG, mode="offline"))
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    return list(wandb_records(log))


def test_wandb_offline_has_every_metric_at_its_step(wandb_run):
    history = {}
    for record in wandb_run:
        if record.WhichOneof("record_type") == "history":
            row = {item_key(i): json.loads(i.value_json) for i in record.history.item}
            assert row["_step"] == record.history.step.num
            history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert history == expected_by_step()


def test_wandb_offline_run_is_complete_with_name_project_and_config(wandb_run):
    kinds = [r.WhichOneof("record_type") for r in wandb_run]
    assert "exit" in kinds  # close() returned with the finished run on disk
    (run,) = [r.run for r in wandb_run if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "colours" and run.project == "vlrft-test"
    config = {item_key(i): json.loads(i.value_json) for i in run.config.update}
    assert {k: v for k, v in config.items() if not k.startswith("_")} == CONFIG


def test_wandb_mode_must_be_offline_or_online(tmp_path):
    with pytest.raises(ValueError, match="logging.wandb: unknown mode 'disabled'"):
        WandbSink(tmp_path, project="p", run_name="r", config={}, mode="disabled")


def test_tensorboard_has_every_metric_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(TensorboardSink(tmp_path / "tensorboard"))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    read_back: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            read_back.setdefault(event.step, {})[tag] = event.value
    expected = expected_by_step()
    assert read_back.keys() == expected.keys()
    for step, metrics in expected.items():
        assert read_back[step] == pytest.approx(metrics, rel=1e-6)  # stored as float32


def test_missing_wandb_names_the_key_and_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(MissingSinkPackage) as error:
        WandbSink(tmp_path, project="p", run_name="r", config={}, mode="offline")
    assert isinstance(error.value, ImportError)
    assert str(error.value) == (
        "logging.wandb is set but the wandb package is not installed: pip install 'vlrft[wandb]'"
    )


def test_missing_tensorboard_names_the_key_and_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    for name in [m for m in sys.modules if m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)  # re-run torch's own `import tensorboard`
    with pytest.raises(ImportError, match=r"^logging.tensorboard is set .*: pip install tensorboard$"):
        TensorboardSink(tmp_path / "tensorboard")
    assert not (tmp_path / "tensorboard").exists()


def test_importing_the_sinks_imports_neither_package():
    code = (
        "import sys, vlrft.metrics.external_sinks;"
        "print(sorted(m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_console_bar_is_drawn_at_the_first_metrics_only(capsys):
    from vlrft.metrics.sinks import ConsoleSink

    unused = ConsoleSink(total_steps=50)  # a trainer built and never run (tests, the step API)
    unused.close()
    assert capsys.readouterr().err == ""
    console = ConsoleSink(total_steps=3)
    for step, metrics in WRITES:
        console.write(step, metrics)
    console.close()
    out = capsys.readouterr()
    assert "step    2  held-out accuracy 0.625" in out.out and "3/3" in out.err
