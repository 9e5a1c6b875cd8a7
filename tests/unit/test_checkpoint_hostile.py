"""A checkpoint directory someone else could write into: rank 0 checks everything a resume will
read before anything is discarded or any rank loads a file, and refuses in one line naming the
file: a pickle of plain data that never finishes unpickling (a hash bomb), files of the wrong
shape, links and special files. What restoring still finds wrong is one line too, and the
discarding of an abandoned future skips names vlrft did not write."""

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vlrft.algo.kl import FixedKLController
from vlrft.config import ConfigError, load_config, to_dict
from vlrft.trainer.checkpoint import discard_after, resume_decision, rng_state
from vlrft.trainer.checkpoint_io import load_checkpoint
from vlrft.trainer.rollback import Rollbacks

BASE = ["model.path=m", "data.train_path=t.jsonl", "reward.default=[{recipe: exact_match}]"]
TAMPERED = "(not written by vlrft, or tampered with)"


def trainer_state(config: dict, step: int) -> dict:
    """trainer.pt as the trainer writes it, for a one-rank run of `config` (a to_dict config
    without critic, policy EMA or moving reference)."""
    return {"step": step, "world_size": 1, "config": config, "kl_controller": {"coef": 0.05}, "return_stats": None,
            "policy_ema": None, "reference": None, "eval_history": [(0, 0.5)], "zero_reward_streak": 0}


def rank_state() -> dict:
    """A trainer rank's rank<R>.pt as the trainer writes it."""
    return {"rng": rng_state(), "buffer_generator": torch.Generator().get_state(), "prompts_consumed": 8,
            "dropped_rows": [3], "ptx_position": 0}


def checkpoint(run: Path, config: dict, step: int = 5) -> Path:
    """A complete one-rank checkpoint of `config` at `step` (DeepSpeed's model states a stand-in
    state dict: the pre-check reads every pickle alike)."""
    saved = run / "checkpoints" / f"step_{step:06d}"
    (saved / "policy" / "state").mkdir(parents=True)
    torch.save(trainer_state(config, step), saved / "trainer.pt")
    torch.save(rank_state(), saved / "rank0.pt")
    torch.save({"module": {"w": torch.zeros(2)}}, saved / "policy" / "state" / "mp_rank_00_model_states.pt")
    return saved


def with_pickle(path: Path, pickled: bytes) -> None:
    """Replace `path` by a torch.save archive whose data.pkl is `pickled`."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    source = zipfile.ZipFile(buffer)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name in source.namelist():
            archive.writestr(name, pickled if name.endswith("/data.pkl") else source.read(name))


def hash_bomb(levels: int = 64) -> bytes:
    """{t: None}, t a tuple DAG `levels` deep (each level two references to the one below):
    plain data, no global, and hashing t takes 2**levels steps in C (tuples cache no hash)."""
    return b"\x80\x02})" + b"q\x00h\x00\x86" * levels + b"Ns."


# Rank 0's decision in a process of its own: on a pickle that never finishes, the process (not
# the test run) is what hangs and gets killed. The probe's limit, lowered: a real checkpoint's
# probe takes milliseconds.
DECIDE = """import sys
from pathlib import Path
import vlrft.trainer.checkpoint as checkpoint
from vlrft.config import load_config, to_dict
checkpoint.PROBE_TIMEOUT_S = 3.0
try:
    print("accepted", checkpoint.resume_decision("auto", Path(sys.argv[1]), 0, to_dict(load_config(None, sys.argv[2:])), 1))
except checkpoint.ConfigError as err:
    print(err)
"""


@pytest.mark.parametrize("planted", ["trainer.pt", "rank0.pt", "policy/state/mp_rank_00_model_states.pt"])
def test_a_pickle_that_never_finishes_unpickling_is_refused_within_the_probe_timeout(planted, tmp_path):
    """trainer.pt (rank 0 would hang in its decision, the other ranks in its broadcast), a rank
    file and a DeepSpeed file (every rank would hang loading it) alike."""
    bombed = checkpoint(tmp_path, to_dict(load_config(None, BASE))) / planted
    with_pickle(bombed, hash_bomb())
    try:
        decided = subprocess.run([sys.executable, "-c", DECIDE, str(tmp_path), *BASE], capture_output=True, text=True,
                                 timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the resume decision on a hash bomb in {planted} did not end in 240 s")
    lines = [line for line in decided.stdout.splitlines() if line.strip()]
    assert lines == [f"refusing to load checkpoint file {bombed}: its pickle did not unpickle within 3s {TAMPERED}"], \
        decided.stdout + decided.stderr[-2000:]


def nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    return value


TRAINER_FILES = {  # a trainer.pt that is plain data, of the wrong shape: what the refusal names
    "a dict without the trainer's fields": (lambda state: {}, "it has no field 'step'"),
    "a list": (lambda state: [], "it holds a list, not a dict of trainer state"),
    "a step that is a string": (lambda state: {**state, "step": "five"}, "its field 'step' must be a step number"),
    "no config": (lambda state: {**state, "config": None}, "its field 'config' must be a config (a dict"),
    # (compared key by key at resume; a file can nest deeper than the recursion limit: bounded)
    "a config nested 100 levels deep": (lambda state: {**state, "config": nested(100)}, "its field 'config' must be a config"),
    "a KL controller without its coefficient": (lambda state: {**state, "kl_controller": {}}, "its field 'kl_controller'"),
    "evaluations that are not (step, accuracy)": (lambda state: {**state, "eval_history": [("a", 1.0)]},
                                                  "its field 'eval_history'"),
}
RANK_FILES = {  # likewise a rank0.pt
    "no prompt position": (lambda state: {k: v for k, v in state.items() if k != "prompts_consumed"},
                           "it has no field 'prompts_consumed'"),
    "a python random state of 5 ints": (lambda state: {**state, "rng": {**state["rng"], "python": (3, (1,) * 5, None)}},
                                        "its field 'rng' is not a random state this rank can restore (ValueError"),
    "a numpy random state of 3 keys": (lambda state: {**state, "rng": {**state["rng"], "numpy": ("MT19937", [1] * 3, 0, 0, 0.0)}},
                                       "its field 'rng' is not a random state this rank can restore"),
    "a torch random state of 3 bytes": (lambda state: {**state, "rng": {**state["rng"], "torch": torch.zeros(3, dtype=torch.uint8)}},
                                        "its field 'rng' is not a random state this rank can restore (RuntimeError"),
    "no random state at all": (lambda state: {**state, "rng": {}}, "its field 'rng' has no python random state"),
    "a buffer generator that is floats": (lambda state: {**state, "buffer_generator": torch.zeros(4)},
                                          "its field 'buffer_generator' must be a torch generator's state"),
    "dropped rows that are not row numbers": (lambda state: {**state, "dropped_rows": ["x"]}, "its field 'dropped_rows'"),
}


@pytest.mark.parametrize("case", [("trainer.pt", c) for c in TRAINER_FILES] + [("rank0.pt", c) for c in RANK_FILES])
def test_a_file_of_the_wrong_shape_is_one_line_naming_it_before_any_rank_loads(case, tmp_path):
    """Valid weights-only pickles, not vlrft's schema: refused by rank 0's decision (so on every
    rank, before anything is discarded), not a KeyError/TypeError/ValueError on one rank."""
    name, label = case
    config = to_dict(load_config(None, BASE))
    saved = checkpoint(tmp_path, config)
    assert resume_decision("auto", tmp_path, 0, config, 1) == (saved, 5)  # the checkpoint as written resumes
    reshape, named = (TRAINER_FILES if name == "trainer.pt" else RANK_FILES)[label]
    torch.save(reshape(trainer_state(config, 5) if name == "trainer.pt" else rank_state()), saved / name)
    with pytest.raises(ConfigError) as refused:
        resume_decision("auto", tmp_path, 0, config, 1)
    what = "trainer" if name == "trainer.pt" else "rank"
    assert str(refused.value).startswith(f"checkpoint file {saved / name} is not a vlrft {what} state: "), str(refused.value)
    assert named in str(refused.value) and "\n" not in str(refused.value)


class ShellPayload:
    def __reduce__(self):  # unpickling this would run a shell command that creates the file
        return (os.system, (f"touch {os.environ['PAYLOAD_MARKER']}",))


def test_a_linked_directory_is_refused_though_a_walk_that_follows_none_would_see_no_file_in_it(tmp_path, monkeypatch):
    """policy/state as a link to a directory elsewhere holding a pickled command: a recursive
    glob does not descend into it (rank 0 would see no DeepSpeed file and accept); the walk
    refuses the link itself."""
    marker = tmp_path / "payload-ran"
    monkeypatch.setenv("PAYLOAD_MARKER", str(marker))
    config = to_dict(load_config(None, BASE))
    saved = checkpoint(tmp_path / "run", config)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"module": ShellPayload()}, elsewhere / "mp_rank_00_model_states.pt")
    for old in (saved / "policy" / "state").iterdir():
        old.unlink()
    (saved / "policy" / "state").rmdir()
    (saved / "policy" / "state").symlink_to(elsewhere)
    with pytest.raises(ConfigError) as refused:
        resume_decision("auto", tmp_path / "run", 0, config, 1)
    assert str(refused.value) == (f"refusing to resume from {saved}: {saved / 'policy' / 'state'} is a symbolic link, "
                                  f"which no checkpoint vlrft writes holds {TAMPERED}")
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["rank0.pt", "policy/zero_to_fp32.py"])
def test_a_linked_file_or_a_fifo_anywhere_in_the_checkpoint_is_refused(planted, tmp_path):
    """A link to a file the checks would accept (a link can be pointed elsewhere between rank 0's
    check and a rank's load), and a FIFO (opening it waits forever), even where no rank reads."""
    config = to_dict(load_config(None, BASE))
    saved = checkpoint(tmp_path / "run", config)
    target = saved / planted
    if target.exists():
        target.rename(tmp_path / "moved")
    target.symlink_to(tmp_path / "moved")
    with pytest.raises(ConfigError, match=rf"^refusing to resume from {saved}: {target} is a symbolic link, "):
        resume_decision("auto", tmp_path / "run", 0, config, 1)
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(ConfigError) as refused:
        resume_decision("auto", tmp_path / "run", 0, config, 1)
    assert str(refused.value) == f"refusing to resume from {saved}: {target} is not a regular file {TAMPERED}"


def fake_trainer(policy_ema: dict) -> SimpleNamespace:
    """What load_checkpoint restores into, of a one-rank run whose model is a plain state dict
    (test doubles for the backend, the engine and the bookkeeping)."""
    return SimpleNamespace(
        rank=0, role="both", global_step=0, cfg=SimpleNamespace(train=SimpleNamespace(mode="sync")),
        backend=SimpleNamespace(load_checkpoint=lambda path, schedule=True: None), critic=None, reference=None,
        kl_controller=FixedKLController(0.1), return_stats=None, policy_ema=policy_ema, eval_history=[],
        zero_reward_watch=SimpleNamespace(streak=0), sampler=SimpleNamespace(consumed=0),
        bad_input=SimpleNamespace(dropped_rows=set()), ptx=None, buffer=SimpleNamespace(generator=torch.Generator()),
        engine=SimpleNamespace(update_weights=lambda weights: None, resume_at=lambda step: None),
        policy_weights=lambda: [], rollbacks=Rollbacks(),
        guards=SimpleNamespace(digests=SimpleNamespace(update=lambda weights, where: None)),
    )


def test_state_that_does_not_fit_the_model_is_one_line_naming_the_file_when_restored(tmp_path):
    """A policy EMA of another model (names and shapes only the built model knows): refused as
    it is restored, naming trainer.pt, instead of failing steps later inside training."""
    config = to_dict(load_config(None, BASE + ["train.ema_beta=0.5"]))
    saved = tmp_path / "step_000005"
    saved.mkdir()
    torch.save({**trainer_state(config, 5), "policy_ema": {"other.weight": torch.zeros(3)}}, saved / "trainer.pt")
    torch.save(rank_state(), saved / "rank0.pt")
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(fake_trainer({"w": torch.zeros(2)}), saved)
    assert str(refused.value) == (f"cannot resume from {saved / 'trainer.pt'}: ValueError: its policy_ema does not match "
                                  "this model's at 'other.weight'")
    trainer = fake_trainer({"w": torch.zeros(2)})  # the same file with this model's EMA restores
    torch.save({**trainer_state(config, 5), "policy_ema": {"w": torch.ones(2)}}, saved / "trainer.pt")
    load_checkpoint(trainer, saved)
    assert trainer.global_step == 5 and torch.equal(trainer.policy_ema["w"], torch.ones(2)) and trainer.sampler.consumed == 8


def test_discarding_the_abandoned_future_skips_names_it_did_not_write(tmp_path):
    trajectories = tmp_path / "trajectories"
    trajectories.mkdir()
    for name in ("step_000004.rank0.jsonl", "step_000009.rank0.jsonl", "step_x.rank0.jsonl", "step_000009.notes.jsonl"):
        (trajectories / name).write_text("{}\n")
    (trajectories / "step_000010.rank1.jsonl").mkdir()  # a directory under a trajectory's name
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4}) + "\n")
    discard_after(tmp_path, 4)
    assert sorted(p.name for p in trajectories.iterdir()) == [
        "step_000004.rank0.jsonl", "step_000009.notes.jsonl", "step_000010.rank1.jsonl", "step_x.rank0.jsonl"]


def test_the_probe_refuses_what_torch_save_does_not_write(tmp_path):
    """Called here in this process (a resume calls it in a worker): a real save passes; a global
    outside the allow-list (protocol 4's STACK_GLOBAL too), a compressed record (it could expand
    without bound), the legacy format and a pickle over the size bound are refused."""
    from vlrft.trainer.checkpoint_probe import MAX_PICKLE_BYTES, probe
    from vlrft.trainer.checkpoint_read import TENSOR_GLOBALS

    path = tmp_path / "rank0.pt"
    torch.save(rank_state(), path)
    assert probe(str(path), TENSOR_GLOBALS) is None
    with_pickle(path, b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x04true\x85R.")
    assert probe(str(path), TENSOR_GLOBALS) == ("name", "os.system")
    saved = io.BytesIO()
    torch.save(rank_state(), saved)
    source = zipfile.ZipFile(saved)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in source.namelist():
            archive.writestr(name, source.read(name))
    assert probe(str(path), TENSOR_GLOBALS) == ("unreadable", "its record archive/data.pkl is compressed "
                                                              "(torch.save stores every record as it is)")
    torch.save(rank_state(), path, _use_new_zipfile_serialization=False)
    assert probe(str(path), TENSOR_GLOBALS) == ("unreadable", "not a torch.save archive (File is not a zip file)")
    with_pickle(path, b"\x80\x02N" + b"0N" * (MAX_PICKLE_BYTES // 2) + b".")
    assert probe(str(path), TENSOR_GLOBALS) == (
        "unreadable", f"its pickle is {MAX_PICKLE_BYTES + 4} bytes, more than a checkpoint's may have (64 MiB)")
