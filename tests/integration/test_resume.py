"""Issue-8 acceptance: exact resume after SIGKILL (one process: same final parameters and
metrics; two ranks: the same prompts on each rank after the resume), a kill while a
checkpoint is being written or just before it is published (the previous checkpoint stays
intact and resumable), and a second run on a directory in use (refused on every rank)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

import vlrft

from tests.process_env import rank_launch
from vlrft.models.loader import load_model

pytestmark = pytest.mark.integration

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
KILL_WORKER = Path(__file__).with_name("kill_during_save_worker.py")

# distinct_chars rewards (test_torchrun_training.RECIPE), but while the file `hold` exists and the killed run has saved
# step 2, the call waits: the kill lands inside step 3 however fast the loop runs (a 4-step
# run can otherwise finish between two polls for the checkpoint, and nothing resumes).
# Likewise, while `hold_signal` exists and the run `run` has saved step 1's trajectories, the
# call waits: a signal sent then lands inside step 2 (a step takes ~0.05 s, so without the
# wait a loaded machine's poll can see step 1 only after the last step).
HELD_RECIPE = """import time
from pathlib import Path


def distinct_chars(completions, samples):
    here = Path(__file__).parent
    while (here / "hold").exists() and (here / "killed" / "checkpoints" / "step_000002").is_dir():
        time.sleep(0.05)
    while (here / "hold_signal").exists() and (here / "run" / "trajectories" / "step_000001.rank0.jsonl").is_file():
        time.sleep(0.05)
    return [len(set(c)) / 10 for c in completions]
"""


def write_config(root: Path, model: str, dataset: Path, run: str, **extra) -> Path:
    (root / "recipe.py").write_text(HELD_RECIPE)
    config = {
        "model": {"path": model},
        "data": {"train_path": str(dataset / "train.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6},
        # KL with an adaptive coefficient, a moving reference and a policy EMA: state beyond
        # the weights that a resume must restore.
        "algo": {"kl": {"coef": 0.05, "target": 0.01, "horizon": 100, "ref_ema_eta": 0.1}},
        "train": {"total_steps": 5, "lr": 1e-2, "lr_schedule": "cosine", "ema_beta": 0.5, "micro_batch_tokens": 200},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}]},
        "eval": {"every_steps": 0},
        "trajectory": {"save_every": 1},
        "checkpoint": {"save_steps": 1, "keep_last": 2},
        "output": {"dir": str(root / run)},
    } | extra
    path = root / f"{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config: Path, ranks: int) -> subprocess.Popen:
    launcher, env = rank_launch(ranks, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(launcher + ["-m", "vlrft.cli", "train", str(config)], cwd=config.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def kill_after_checkpoint(proc: subprocess.Popen, checkpoint: Path) -> None:
    deadline = time.time() + 600
    while not checkpoint.is_dir():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    # Every process of the run at once, like a lost machine (torchrun starts its ranks in
    # sessions of their own, so a process-group kill would miss them).
    launcher = psutil.Process(proc.pid)
    for process in [launcher, *launcher.children(recursive=True)]:
        process.send_signal(signal.SIGKILL)
    proc.wait()


def kill_inside_step_3(config: Path, ranks: int) -> None:
    """Runs the "killed" run of `config` until it has saved step 2 and kills it inside step 3."""
    hold = config.parent / "hold"
    hold.touch()
    kill_after_checkpoint(launch(config, ranks), config.parent / "killed" / "checkpoints" / "step_000002")
    assert not (config.parent / "killed" / "checkpoints" / "step_000003").exists()
    hold.unlink()


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """step -> metrics without timings (perf/*), the only values allowed to differ."""
    merged: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        merged.setdefault(row.pop("step"), {}).update({k: v for k, v in row.items() if not k.startswith("perf/")})
    return merged


def prompt_ids(run_dir: Path, step: int, rank: int) -> list[str]:
    lines = (run_dir / "trajectories" / f"step_{step:06d}.rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["id"] for line in lines]


def max_param_diff(a: Path, b: Path) -> float:
    first, second = load_model(str(a)), load_model(str(b))
    return max(float((p - q).detach().abs().max()) for p, q in zip(first.parameters(), second.parameters()))


def test_single_process_resume_after_sigkill_is_exact(tiny_text, addition_data, tmp_path):
    out = finish(launch(write_config(tmp_path, tiny_text, addition_data, "straight"), ranks=1))
    assert "held-out accuracy" not in out  # no eval data: no empty curve line
    config = write_config(tmp_path, tiny_text, addition_data, "killed")
    kill_inside_step_3(config, ranks=1)
    out = finish(launch(config, ranks=1))
    assert "resumed from" in out and "at step 2" in out

    straight, resumed = tmp_path / "straight", tmp_path / "killed"
    assert max_param_diff(straight / "final", resumed / "final") <= 1e-6
    assert max_param_diff(straight / "final_ema", resumed / "final_ema") <= 1e-6
    expected, got = step_metrics(straight), step_metrics(resumed)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4, 5]  # no step lost or logged twice
    for step in (3, 4, 5):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-9), step
    # Rotation kept the newest two; no temporary is left behind.
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step_000004", "step_000005"]


def test_two_rank_resume_continues_from_each_ranks_position(tiny_text, addition_data, tmp_path):
    train = {"total_steps": 4, "lr": 1e-2, "micro_batch_tokens": 200}
    straight = write_config(tmp_path, tiny_text, addition_data, "straight", train=train)
    config = write_config(tmp_path, tiny_text, addition_data, "killed", train=train)
    finish(launch(straight, ranks=2))
    kill_inside_step_3(config, ranks=2)
    out = finish(launch(config, ranks=2))
    assert "resumed from" in out and "at step 2" in out, out[-6000:]
    for step in (3, 4):
        for rank in (0, 1):
            assert prompt_ids(tmp_path / "killed", step, rank) == prompt_ids(tmp_path / "straight", step, rank)
    assert max_param_diff(tmp_path / "straight" / "final", tmp_path / "killed" / "final") <= 1e-5


def test_kill_while_saving_keeps_the_previous_checkpoint(tiny_text, addition_data, tmp_path):
    config = write_config(tmp_path, tiny_text, addition_data, "run")
    # The worker dies (os._exit, no clean-up) half-way through writing step 2's trainer.pt.
    proc = subprocess.run([sys.executable, str(KILL_WORKER), str(config), "step_000002", "half-write"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 137, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp-step_000002", "step_000001"]
    intact = torch.load(checkpoints / "step_000001" / "trainer.pt", weights_only=True)
    assert intact["step"] == 1
    out = finish(launch(config, ranks=1))
    assert "resumed from" in out and "step_000001 at step 1" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000005"]
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_kill_between_the_complete_write_and_the_rename_resumes_from_the_previous_checkpoint(
        tiny_text, addition_data, tmp_path):
    config = write_config(tmp_path, tiny_text, addition_data, "run")
    proc = subprocess.run([sys.executable, str(KILL_WORKER), str(config), "step_000002", "before-rename"], cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 137, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp-step_000002", "step_000001"]
    # Killed after the write was complete: every file and directory of it had been fsynced.
    written = checkpoints / ".tmp-step_000002"
    assert torch.load(written / "trainer.pt", weights_only=True)["step"] == 2
    on_disk = {str(p) for p in [written, *written.rglob("*")]}
    assert any(p.endswith("mp_rank_00_model_states.pt") for p in on_disk)  # DeepSpeed's files are among them
    assert on_disk <= set(json.loads((tmp_path / "fsynced.json").read_text()))
    out = finish(launch(config, ranks=1))
    assert "step_000001 at step 1" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000005"]
    assert sorted(step_metrics(tmp_path / "run")) == [1, 2, 3, 4, 5]


def test_a_second_run_on_a_directory_in_use_is_refused_on_every_rank(tiny_text, addition_data, tmp_path):
    config = write_config(tmp_path, tiny_text, addition_data, "run")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from vlrft.trainer.run_lock import lock_run_dir; "
                               "lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(600)", str(tmp_path / "run")],
                              env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = launch(config, ranks=2)
        out, _ = proc.communicate(timeout=300)  # a rank left waiting would hang here
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0, out[-4000:]
    refusal = f"{tmp_path / 'run'} is in use by another run (pid {holder.pid} on host"
    assert out.count(refusal) == 2, out[-4000:]  # rank 0 and rank 1, one line each
    # Only torchrun's own report has a traceback: no frame of vlrft's code is printed.
    assert not vlrft_frames(out), out[-4000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".vlrft.lock"]  # nothing written


def test_sigterm_saves_a_checkpoint_and_stops(tiny_text, addition_data, tmp_path):
    # No scheduled checkpoints: the only one is the one the signal asks for.
    config = write_config(tmp_path, tiny_text, addition_data, "run",
                          checkpoint={"save_steps": 0, "keep_last": 2}, eval={"every_steps": 5, "max_prompts": 4},
                          data={"train_path": str(addition_data / "train.jsonl"), "eval_path": str(addition_data / "test.jsonl")})
    (tmp_path / "hold_signal").touch()
    proc = launch(config, ranks=1)
    first_step = tmp_path / "run" / "trajectories" / "step_000001.rank0.jsonl"
    while not first_step.is_file():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # step 2's reward call is waiting (HELD_RECIPE)
    (tmp_path / "hold_signal").unlink()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    assert "stopped by signal SIGTERM after step" in out and "run the same command again to resume" in out
    (saved,) = (tmp_path / "run" / "checkpoints").iterdir()
    stopped_at = int(saved.name.split("_")[1])
    assert stopped_at in (1, 2)  # the step it arrived in, or the next one

    out = finish(launch(config, ranks=1))
    assert f"at step {stopped_at}" in out
    metrics = step_metrics(tmp_path / "run")
    assert sorted(metrics) == [0, 1, 2, 3, 4, 5] and "eval/accuracy" in metrics[5]
    # The export is a plain HF checkpoint that loads and generates.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = tmp_path / "run" / "final"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    ids = tokenizer("1 + 2 =", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]


PLANT = """import os, sys, torch
class ShellPayload:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
state = torch.load(sys.argv[1], weights_only=False)  # the file is the test's own: trusted here
state["planted"] = ShellPayload()
torch.save(state, sys.argv[1])
"""


CHECKPOINTED = {"total_steps": 1, "lr": 1e-2, "micro_batch_tokens": 200, "zero_stage": 2}


@pytest.fixture(scope="module")
def two_rank_run(tiny_text, addition_data, tmp_path_factory) -> Path:
    """The run directory of a two-rank run of CHECKPOINTED, with its checkpoint (trained once per
    test process; each test tampers with a copy)."""
    root = tmp_path_factory.mktemp("checkpointed")
    finish(launch(write_config(root, tiny_text, addition_data, "run", train=CHECKPOINTED), ranks=2))
    return root / "run"


def checkpointed_on_two_ranks(tmp_path, two_rank_run: Path) -> Path:
    """A copy of `two_rank_run` as this test's run directory."""
    shutil.copytree(two_rank_run, tmp_path / "run")
    return tmp_path / "run"


def vlrft_frames(out: str) -> list[str]:
    """Traceback lines in vlrft's own code (torchrun's report of a failed rank has frames of its
    own; a checkout's directory may be named vlrft too)."""
    package = f'File "{Path(vlrft.__file__).parent}/'
    return [line for line in out.splitlines() if line.strip().startswith(package)]


def refused_on_both_ranks(config, refusal: str) -> None:
    """Resuming with `config` fails: both ranks print `refusal`, and no traceback of vlrft's."""
    proc = launch(config, ranks=2)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, out[-4000:]
    assert out.count(refusal) == 2, out[-4000:]  # rank 0 and rank 1, one line each
    assert not vlrft_frames(out), out[-4000:]


def test_a_pickled_callable_in_a_deepspeed_state_file_is_refused_at_resume_and_never_runs(tiny_text, addition_data, tmp_path,
                                                                                         two_rank_run):
    """A shell command pickled into rank 1's ZeRO optimizer partition (a file only rank 1 would
    open) of the checkpoint a two-rank run resumes from: every rank stops with one line naming
    the file, no traceback of vlrft's, the command never runs and the checkpoint stays."""
    run = checkpointed_on_two_ranks(tmp_path, two_rank_run)
    state_file = run / "checkpoints" / "step_000001" / "policy" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "payload-ran"
    subprocess.run([sys.executable, "-c", PLANT, str(state_file), str(marker)], env=ENV, check=True)
    config = write_config(tmp_path, tiny_text, addition_data, "run", train={**CHECKPOINTED, "total_steps": 2})
    refusal = (f"vlrft: error: refusing to load checkpoint file {state_file}: it holds posix.system, not only tensors, "
               "plain data and DeepSpeed's state (not written by vlrft, or tampered with)")
    refused_on_both_ranks(config, refusal)
    assert not marker.exists()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001"]


RESHAPE = """import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
state["rng"]["python"] = (3, (1,) * 5, None)  # 5 ints where python's random state has 625
torch.save(state, sys.argv[1])
"""


def test_a_rank_file_of_the_wrong_shape_stops_every_rank_before_anything_is_discarded(tiny_text, addition_data, tmp_path,
                                                                                     two_rank_run):
    """rank1.pt, which only rank 1 reads, with a random state python refuses: rank 0's check
    refuses it, so both ranks stop with the same line naming the file, and what the abandoned
    run did after its checkpoint (a trajectory file, a metric line) is still there."""
    run = checkpointed_on_two_ranks(tmp_path, two_rank_run)
    rank_file = run / "checkpoints" / "step_000001" / "rank1.pt"
    subprocess.run([sys.executable, "-c", RESHAPE, str(rank_file)], env=ENV, check=True)
    (run / "trajectories" / "step_000002.rank0.jsonl").write_text("{}\n")  # a step after the checkpoint
    with (run / "metrics.jsonl").open("a") as log:
        log.write(json.dumps({"step": 2, "train/loss": 0.5}) + "\n")
    metrics = (run / "metrics.jsonl").read_text()
    config = write_config(tmp_path, tiny_text, addition_data, "run", train={**CHECKPOINTED, "total_steps": 2})
    refusal = (f"vlrft: error: checkpoint file {rank_file} is not a vlrft rank state: its field 'rng' is not a random "
               "state this rank can restore (ValueError: state vector is the wrong size)")
    refused_on_both_ranks(config, refusal)
    assert (run / "trajectories" / "step_000002.rank0.jsonl").exists() and (run / "metrics.jsonl").read_text() == metrics
