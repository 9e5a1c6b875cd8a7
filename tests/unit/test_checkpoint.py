"""Checkpoint bookkeeping without training: atomic publish and rotation, what a resume discards,
the metrics log rewrite, config keys that must not change across a resume, config checks,
fsync before the rename, safe loading (weights_only, DeepSpeed's files included) and RNG state
that loads safely. Hostile checkpoint directories: test_checkpoint_hostile.py."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_checkpoint_hostile import rank_state, trainer_state
from vlrft.config import ConfigError, load_config, to_dict
from vlrft.trainer.checkpoint import (
    changed_state_keys,
    clear_temporaries,
    complete_checkpoints,
    discard_after,
    publish,
    resume_decision,
    resume_path,
    rng_state,
    set_rng_state,
    temporary_dir,
    truncate_metrics_after,
)
from vlrft.trainer.checkpoint_read import PickleProbe, checkpoint_files, load_state

BASE = ["model.path=m", "data.train_path=t.jsonl", "reward.default=[{recipe: exact_match}]"]


def fake_checkpoint(run, step: int, publish_it: bool = True):
    temporary = temporary_dir(run, step)
    temporary.mkdir(parents=True)
    (temporary / "trainer.pt").write_text(str(step))
    return publish(temporary, keep_last=2) if publish_it else temporary


def test_publish_renames_into_place_and_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    # A save killed half-way is never a checkpoint, and the next save clears it.
    half = fake_checkpoint(tmp_path, 4, publish_it=False)
    assert resume_path("auto", tmp_path).name == "step_000003"
    clear_temporaries(tmp_path)
    assert not half.exists()
    # Saving a step again (a resumed run) replaces it.
    again = fake_checkpoint(tmp_path, 3)
    assert again.name == "step_000003" and [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002", "step_000003"]


def test_resume_modes(tmp_path):
    assert resume_path("never", tmp_path) is None and resume_path("auto", tmp_path) is None
    with pytest.raises(ConfigError, match=r"'checkpoint.resume': .*nowhere is not a vlrft checkpoint"):
        resume_path(str(tmp_path / "nowhere"), tmp_path)
    assert resume_path(str(fake_checkpoint(tmp_path, 5)), tmp_path).name == "step_000005"


def test_resuming_discards_the_abandoned_future(tmp_path):
    for step in (10, 20):
        fake_checkpoint(tmp_path, step)
    trajectories = tmp_path / "trajectories"
    trajectories.mkdir()
    for step in (10, 15, 20):
        (trajectories / f"step_{step:06d}.rank0.jsonl").write_text("{}\n")
    lines = [json.dumps({"step": s, "x": s}) for s in (0, 10, 11, 20)] + ['{"step": 21, "x"']  # cut by the kill
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    discard_after(tmp_path, 10)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000010"]
    assert sorted(p.name for p in trajectories.iterdir()) == ["step_000010.rank0.jsonl"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl", "trajectories"]
    truncate_metrics_after(tmp_path / "absent.jsonl", 3)  # no log yet: nothing to do


def test_an_async_resume_drops_the_evaluation_logged_at_its_step(tmp_path):
    """An async run's evaluation of step k arrives after checkpoint k was saved: the resumed run
    evaluates k again, so the old line goes; the step's training line stays."""
    lines = [{"step": 2, "train/loss": 1.0}, {"step": 2, "eval/accuracy": 0.5}, {"step": 3, "train/loss": 0.9}]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    truncate_metrics_after(log, 2)
    assert [json.loads(line) for line in log.read_text().splitlines()] == lines[:2]
    truncate_metrics_after(log, 2, evaluation_at_step=True)
    assert [json.loads(line) for line in log.read_text().splitlines()] == lines[:1]


def test_config_keys_that_shape_the_saved_state_must_match():
    saved = to_dict(load_config(None, BASE))
    assert changed_state_keys(saved, to_dict(load_config(None, BASE + ["train.lr=0.5", "train.total_steps=99"]))) == []
    current = to_dict(load_config(None, BASE + ["train.ema_beta=0.9", "algo.kl.coef=0.1"]))
    assert changed_state_keys(saved, current) == ["train.ema_beta", "algo.kl.coef"]
    # An async run's rank files are not a sync run's: the mode and the split must match too.
    asynchronous = to_dict(load_config(None, BASE + ["train.mode=async", "rollout.ranks=1"]))
    assert changed_state_keys(saved, asynchronous) == ["train.mode", "rollout.ranks"]
    older = json.loads(json.dumps(saved))  # a checkpoint from before train.mode existed: it was sync
    del older["train"]["mode"], older["rollout"]["ranks"]
    assert changed_state_keys(older, saved) == [] and changed_state_keys(older, asynchronous) == ["train.mode", "rollout.ranks"]


def test_checkpoint_and_logging_keys_are_validated(monkeypatch):
    with pytest.raises(ConfigError, match="'checkpoint.keep_last' must be >= 1"):
        load_config(None, BASE + ["checkpoint.keep_last=0"])
    with pytest.raises(ConfigError, match="'checkpoint.save_steps' must be >= 0"):
        load_config(None, BASE + ["checkpoint.save_steps=-1"])
    with pytest.raises(ConfigError, match="'logging.wandb' is 'offlne'; valid: disabled, offline, online"):
        load_config(None, BASE + ["logging.wandb=offlne"])
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"'logging.tensorboard' needs the tensorboard package.*vlrft\[tensorboard\]"):
        load_config(None, BASE + ["logging.tensorboard=true"])


def test_publish_fsyncs_every_file_and_directory_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    temporary = temporary_dir(tmp_path, 7)
    (temporary / "policy" / "global_step7").mkdir(parents=True)
    for name in ("trainer.pt", "rank0.pt", "policy/latest", "policy/global_step7/shard.pt"):
        (temporary / name).write_text(name)
    written = {str(p) for p in [temporary, *temporary.rglob("*")]}  # 4 files and 3 directories
    events = []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    monkeypatch.setattr(Path, "rename", lambda self, to: events.append(("rename", str(self))) or real_rename(self, to))
    publish(temporary, keep_last=2)
    renamed = events.index(("rename", str(temporary)))
    before = {path for kind, path in events[:renamed]}
    assert len(written) == 7 and before == written
    assert ("fsync", str(tmp_path / "checkpoints")) in events[renamed:]  # the rename itself is durable


class Payload:
    def __reduce__(self):  # unpickling this would create the file
        return (open, (str(Path(os.environ["PAYLOAD_MARKER"])), "w"))


def test_a_pickled_object_in_trainer_pt_is_refused_not_run(tmp_path, monkeypatch):
    marker = tmp_path / "payload-ran"
    monkeypatch.setenv("PAYLOAD_MARKER", str(marker))
    saved = tmp_path / "checkpoints" / "step_000003"
    saved.mkdir(parents=True)
    torch.save({"step": 3, "world_size": 1, "config": {}, "extra": Payload()}, saved / "trainer.pt")
    with pytest.raises(ConfigError, match=r"refusing to load checkpoint file .*step_000003/trainer.pt: it holds io.open, not only") as refused:
        resume_decision("auto", tmp_path, 0, {}, 1)
    assert "\n" not in str(refused.value) and not marker.exists()
    (saved / "trainer.pt").write_bytes(b"PK\x03\x04 half a file")
    with pytest.raises(ConfigError, match=r"checkpoint file .*trainer.pt cannot be read"):
        load_state(saved / "trainer.pt")


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached gaussian is part of numpy's state too
    torch.save({"rng": rng_state()}, tmp_path / "rank0.pt")
    expected = (random.random(), np.random.standard_normal(), float(torch.rand(1)))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_state(tmp_path / "rank0.pt")["rng"])
    assert (random.random(), np.random.standard_normal(), float(torch.rand(1))) == expected


class ShellPayload:
    def __reduce__(self):  # unpickling this would run a shell command that creates the file
        return (os.system, (f"touch {os.environ['PAYLOAD_MARKER']}",))


def deepspeed_checkpoint(root: Path, zero_stage: int):
    """A real DeepSpeed checkpoint of a small model after one optimizer step (AdamW state and
    ZeRO partitions exist), in `root`/policy as vlrft writes it; the backend that wrote it."""
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend

    torch.manual_seed(0)
    backend = DeepSpeedBackend(torch.nn.Linear(4, 4), lr=0.1, weight_decay=0.0, grad_clip=1.0, zero_stage=zero_stage)
    backend.backward(backend.model(torch.ones(2, 4)).sum(), boundary=True)
    backend.step()
    backend.save_checkpoint(root / "policy")
    return backend


def plant(state_file: Path) -> None:
    """Add a pickled shell command to a DeepSpeed state file (the file is ours: trusted here)."""
    state = torch.load(state_file, weights_only=False)
    state["planted"] = ShellPayload()
    torch.save(state, state_file)


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_deepspeed_state_loads_back_with_weights_only_and_its_allow_list(zero_stage, tmp_path, world_of_one):
    from vlrft.backends.deepspeed_backend import WeightsOnlyCheckpointEngine

    backend = deepspeed_checkpoint(tmp_path, zero_stage)
    assert type(backend.engine.checkpoint_engine) is WeightsOnlyCheckpointEngine
    saved = {name: tensor.clone() for name, tensor in backend.named_full_parameters()}
    backend.backward(backend.model(torch.ones(2, 4)).sum(), boundary=True)
    backend.step()  # moves the weights away from the checkpoint
    backend.load_checkpoint(tmp_path / "policy")
    assert all(torch.equal(tensor, saved[name]) for name, tensor in backend.named_full_parameters())
    with PickleProbe(timeout_s=60, memory_bytes=4 << 30) as probe:  # nothing beyond the allow-list in any of its files
        for state_file in checkpoint_files(tmp_path / "policy"):
            if state_file.suffix == ".pt":
                probe.check(state_file, deepspeed=True)


@pytest.mark.parametrize("planted", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_pickled_callable_in_a_deepspeed_state_file_is_refused_where_it_is_opened(planted, tmp_path, world_of_one, monkeypatch):
    """Each rank's checkpoint engine refuses the file in one line naming it, before the
    callable can run (as it would on a rank that skipped the check of rank 0 below)."""
    marker = tmp_path / "payload-ran"
    monkeypatch.setenv("PAYLOAD_MARKER", str(marker))
    backend = deepspeed_checkpoint(tmp_path, zero_stage=2)
    plant(tmp_path / "policy" / "state" / planted)
    with pytest.raises(ConfigError) as refused:
        backend.load_checkpoint(tmp_path / "policy")
    assert str(refused.value) == (f"refusing to load checkpoint file {tmp_path / 'policy' / 'state' / planted}: it holds posix.system, "
                                  "not only tensors and plain data (not written by vlrft, or tampered with)")
    assert not marker.exists()


def test_a_pickled_callable_in_a_deepspeed_state_file_is_refused_at_resume_and_never_runs(tmp_path, world_of_one, monkeypatch):
    """Rank 0's resume decision probes every DeepSpeed file's pickle (nothing but allow-listed
    names, unpickled to inert stand-ins in a worker): every rank stops with its one line, before
    any rank loads a file."""
    marker = tmp_path / "payload-ran"
    monkeypatch.setenv("PAYLOAD_MARKER", str(marker))
    config = to_dict(load_config(None, BASE))
    saved = temporary_dir(tmp_path, 3)
    saved.mkdir(parents=True)
    deepspeed_checkpoint(saved, zero_stage=2)
    torch.save(trainer_state(config, 3), saved / "trainer.pt")
    torch.save(rank_state(), saved / "rank0.pt")
    published = publish(saved, keep_last=2)
    assert resume_decision("auto", tmp_path, 0, config, 1) == (published, 3)
    state_file = published / "policy" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    plant(state_file)
    with pytest.raises(ConfigError) as refused:
        resume_decision("auto", tmp_path, 0, config, 1)
    assert str(refused.value) == (f"refusing to load checkpoint file {state_file}: it holds posix.system, not only tensors, "
                                  "plain data and DeepSpeed's state (not written by vlrft, or tampered with)")
    assert not marker.exists()
    state_file.write_bytes(b"not a zip file")
    with pytest.raises(ConfigError, match=rf"^checkpoint file {state_file} cannot be read: not a torch.save archive"):
        resume_decision("auto", tmp_path, 0, config, 1)
    state_file.unlink()
    os.mkfifo(state_file)  # opening it would wait for a writer forever
    with pytest.raises(ConfigError, match=rf"^refusing to resume from {published}: {state_file} is not a regular file"):
        resume_decision("auto", tmp_path, 0, config, 1)
    with pytest.raises(ConfigError, match="is not a regular file$"):
        load_state(state_file)
