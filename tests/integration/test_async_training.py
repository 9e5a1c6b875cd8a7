"""Asynchronous training (train.mode async): rollout ranks and trainer ranks in one torchrun job.
With max_staleness 0 and one rollout rank it is the synchronous run, step for step."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from tests.integration.test_resume import HELD_RECIPE, finish, launch
from tests.integration.test_torchrun_training import RECIPE, free_port
from tests.process_env import rank_launch
from vlrft.data.sampler import PromptSampler

pytestmark = pytest.mark.integration

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(tmp_path, name: str, ranks: int, model: str, data, rollout: dict = None, reward: dict = None, sections: dict = None,
        **train) -> tuple[dict[int, dict], str]:
    (tmp_path / "recipe.py").write_text(RECIPE)
    config = {
        "model": {"path": model},
        "data": {"train_path": str(data / "train.jsonl"), "eval_path": str(data / "test.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6} | (rollout or {}),
        "algo": {"kl": {"coef": 0.01}},
        "train": {"total_steps": 3, "lr": 1e-2, "micro_batch_tokens": 200} | train,
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}, {"recipe": "exact_match"}]} | (reward or {}),
        "eval": {"every_steps": 3, "max_prompts": 4},
        "output": {"dir": str(tmp_path / name)},
        "checkpoint": {"save_steps": 0},
    }
    for key, value in (sections or {}).items():  # more config sections, merged into those above
        config[key] = config.get(key, {}) | value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    launcher, env = rank_launch(ranks, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(launcher + ["-m", "vlrft.cli", "train", str(path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # a hung role: end every process of the run, then fail
        for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            process.kill()
        raise
    assert proc.returncode == 0, out[-5000:]
    metrics: dict[int, dict] = {}
    for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics.setdefault(record.pop("step"), {}).update(record)
    return metrics, out


# The second run, both at once. Multi-turn: the tools environment runs on the rollout rank; its
# trajectories (observation tokens out of the loss) travel to the trainer whole. EMA: the
# rollout rank evaluates the policy EMA the trainer sends after the version it evaluates
# (held-out "accuracy" scored by distinct_chars, a fraction, so that other weights would show;
# beta 0.99 keeps the EMA near the initial weights, far from the trained policy).
@pytest.mark.parametrize("turns, train", [
    ({}, {}),
    ({"environment": "tools", "max_turns": 2, "max_trajectory_tokens": 16}, {"ema_beta": 0.99}),
])
def test_staleness_zero_with_one_rollout_rank_is_the_synchronous_run(turns, train, tiny_text, addition_data, tmp_path):
    staleness_zero_is_the_synchronous_run(turns, train, tiny_text, addition_data, tmp_path)


def test_a_teacher_scores_on_the_trainer_and_staleness_zero_is_still_the_synchronous_run(tiny_text, addition_data, tmp_path):
    from data_tools.make_tiny_model import build_text_model

    teacher = build_text_model(tmp_path / "teacher", warmup_steps=0, seed=1)  # other weights, the same tokenizer
    metrics = staleness_zero_is_the_synchronous_run({}, {}, tiny_text, addition_data, tmp_path,
                                                    sections={"teacher": {"path": str(teacher)}})
    assert all(metrics[step]["distill/reverse_kl"] != 0 for step in (1, 2, 3))


def staleness_zero_is_the_synchronous_run(rollout: dict, train: dict, tiny_text, addition_data, tmp_path,
                                          sections: dict = None) -> dict:
    """A 1-rank sync run and a 1 + 1 async run at staleness 0 (`rollout`, `train`: settings of
    both; `sections`: more config sections) log the same metrics at every step. Returns the
    async run's metrics."""
    reward = {"accuracy_recipe": "recipe.py:distinct_chars"} if train else None
    sync, _ = run(tmp_path, "sync", 1, tiny_text, addition_data, rollout=rollout, reward=reward, sections=sections, **train)
    asynchronous, out = run(tmp_path, "async", 2, tiny_text, addition_data, rollout={"ranks": 1} | rollout, reward=reward,
                            sections=sections, mode="async", max_staleness=0, **train)
    assert sorted(sync) == sorted(asynchronous) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        assert asynchronous[step]["async/staleness_max"] == 0.0
        # Timings differ; the probe of the engine beside the policy (sync/) exists only in sync runs.
        compared = [key for key in sync[step] if not key.startswith(("perf/", "sync/")) and not key.endswith("_seconds")]
        assert len(compared) > 30
        for key in compared:
            assert asynchronous[step][key] == pytest.approx(sync[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert sync[3]["eval/accuracy"] == asynchronous[3]["eval/accuracy"]
    if train:  # a fraction, not 0 or 1 (evaluating the live policy instead gives another one: checked by hand)
        assert 0 < sync[3]["eval/accuracy"] < 1
    assert "held-out accuracy by step: 0:" in out
    return asynchronous


# (3, 2, 0): two rollout ranks decide DAPO's resampling together (an all-reduce of their own).
# (4, 2, 2, S = 2, evaluating every version): each rollout rank takes versions while it waits for
# its trainer's receipt, and evaluates those due there (collectives of the rollout ranks): the
# two must take the same versions at the same point of their loops, whenever their receipts come.
@pytest.mark.parametrize("ranks, rollout_ranks, zero_stage, max_staleness", [(3, 1, 2, 1), (3, 2, 0, 1), (3, 1, 3, 1), (4, 2, 2, 2)])
def test_stale_batches_train_on_several_ranks_of_each_role(ranks, rollout_ranks, zero_stage, max_staleness, tiny_text,
                                                          addition_data, tmp_path):
    rollout = {"ranks": rollout_ranks, "dynamic_sampling": ranks == 3 and rollout_ranks == 2}
    every = 1 if max_staleness == 2 else 3
    metrics, out = run(tmp_path, "async", ranks, tiny_text, addition_data, rollout=rollout, mode="async",
                       max_staleness=max_staleness, zero_stage=zero_stage, total_steps=4,
                       sections={"eval": {"every_steps": every}})
    # Batch 1 is generated with the initial weights. A rollout rank generates batch k + 1 before
    # it waits for its trainer to receive batch k; while it waits it takes the versions up to
    # k - 1 (broadcast before that receipt) and no newer one: with S = 1 batch k + 1 needs
    # version k - 1 anyway, with S = 2 it is generated with version k - 2.
    for key in ("async/staleness_max", "async/staleness_mean"):
        assert [metrics[step][key] for step in (1, 2, 3, 4)] == [0.0, 1.0, max_staleness, max_staleness], key
    # Every rollout rank's batch arrives; with dynamic sampling, the rounds it took to keep its groups.
    assert all(metrics[step]["rollout/sequences"] >= 16 for step in (1, 2, 3, 4))
    if rollout["dynamic_sampling"]:
        assert all(metrics[step]["rollout/sampling_rounds"] >= 1 for step in (1, 2, 3, 4))
    evaluated = [step for step in range(5) if "eval/accuracy" in metrics.get(step, {})]
    assert evaluated == ([0, 1, 2, 3, 4] if every == 1 else [0, 3, 4])
    assert metrics[4]["train/optimizer_steps"] == 1.0
    assert (tmp_path / "async" / "final" / "config.json").is_file()


def test_staleness_two_takes_weights_while_its_batch_waits(tiny_text, addition_data, tmp_path):
    """With S = 2 the trainer sends version i - 1 before it receives batch i + 1 (generated
    with older weights): the rollout rank takes the weights while it waits for the receipt
    (a wait for the receipt alone deadlocked). No batch is older than 2 updates."""
    metrics, _ = run(tmp_path, "async", 2, tiny_text, addition_data, rollout={"ranks": 1}, mode="async",
                     max_staleness=2, total_steps=6)
    assert all(metrics[step]["async/staleness_max"] <= 2 for step in range(1, 7))
    assert metrics[6]["train/optimizer_steps"] == 1.0


def test_a_frozen_actor_sends_versions_without_tensors(tiny_text, addition_data, tmp_path):
    """GAE with the actor frozen for the critic's first 2 updates: the trainer sends those
    versions empty (the rollout rank waits for every version), then the policy trains."""
    metrics, _ = run(tmp_path, "async", 2, tiny_text, addition_data, rollout={"ranks": 1}, mode="async",
                     max_staleness=1, total_steps=4,
                     sections={"algo": {"advantage": "gae"}, "critic": {"enabled": True, "freeze_actor_steps": 2}})
    assert ["train/lr" in metrics[step] for step in (1, 2, 3, 4)] == [False, False, True, True]  # the actor's updates
    assert all("critic/value_loss" in metrics[step] for step in (1, 2, 3, 4))
    assert [metrics[step]["async/staleness_max"] for step in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]


def test_weights_arrive_exactly_and_a_skipped_version_stops_the_rollout_rank(tmp_path):
    worker = Path(__file__).with_name("weights_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(worker)]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**ENV, "PYTHONPATH": str(Path(__file__).parents[2])},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "received version 1: ['a.weight', 'b.bias']" in proc.stdout
    assert "error: rank 1 expected weights version 2 from rank 0, got ('vlrft-weights', 3)" in proc.stdout


def test_partial_rollouts_take_new_weights_without_losing_a_batch(tiny_text, addition_data, tmp_path):
    # Long responses: the trainer's update of batch i often ends while batch i + 1 is being
    # decoded, and the responses in flight then go on under the new weights (whether it lands
    # mid-batch depends on timing; the token-level exactness is test_partial_rollouts.py's).
    metrics, _ = run(tmp_path, "async", 2, tiny_text, addition_data, rollout={"ranks": 1, "max_new_tokens": 48},
                     mode="async", max_staleness=1, partial_rollouts=True, total_steps=6)
    steps = [metrics[step] for step in range(1, 7)]
    assert all(s["rollout/sequences"] == 16 and s["async/staleness_max"] <= 1 for s in steps)
    assert all(s["async/updates_mid_batch"] in (0.0, 1.0) for s in steps)
    print("updates taken mid-batch:", [s["async/updates_mid_batch"] for s in steps])


# (3 ranks: one trainer, two rollout ranks) and (4: two trainers under ZeRO-3, which gather the
# weights once per rollout rank, with a policy EMA that each rollout rank evaluates).
@pytest.mark.parametrize("ranks, zero_stage, ema_beta", [(3, 2, 0.0), (4, 3, 0.99)])
def test_partial_rollouts_on_two_rollout_ranks_take_versions_on_their_own(ranks, zero_stage, ema_beta, tiny_text,
                                                                          addition_data, tmp_path):
    # Versions 2 and 4 are evaluated (a collective of the rollout ranks): those wait for a
    # batch's end, the others may land mid-batch on either rank.
    metrics, _ = run(tmp_path, "async", ranks, tiny_text, addition_data, rollout={"ranks": 2, "max_new_tokens": 48},
                     mode="async", max_staleness=1, partial_rollouts=True, total_steps=5,
                     zero_stage=zero_stage, ema_beta=ema_beta, sections={"eval": {"every_steps": 2}})
    steps = [metrics[step] for step in range(1, 6)]
    assert all(s["rollout/sequences"] == 16 and s["async/staleness_max"] <= 1 for s in steps)
    assert all(s["async/updates_mid_batch"] in (0.0, 0.5, 1.0) for s in steps)  # (the rollout ranks' mean)
    assert [step for step in range(6) if "eval/accuracy" in metrics.get(step, {})] == [0, 2, 4, 5]
    assert (tmp_path / "async" / "final" / "config.json").is_file()
    print("updates taken mid-batch:", [s["async/updates_mid_batch"] for s in steps])


@pytest.mark.parametrize("routes", ["own", "shared"])
def test_partial_rollouts_send_each_rollout_rank_its_weights_whatever_its_peers_do(routes, tmp_path):
    """Rollout rank 1 takes a version at once and then meets rank 2 in an all-reduce that rank
    2 entered before taking it. One broadcast to both deadlocks there (trainer rank 0 waits for
    rank 2, rank 2 for rank 1, rank 1 for the broadcast); with a delivery per rollout rank (the
    routes of partial rollouts) rank 0 serves each as it becomes ready."""
    worker = Path(__file__).with_name("partial_weights_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(free_port()),
           str(worker), routes]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**ENV, "PYTHONPATH": str(Path(__file__).parents[2])},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=20 if routes == "shared" else 120)
    except subprocess.TimeoutExpired:
        for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            process.kill()
        assert routes == "shared", "deadlocked with a delivery per rollout rank"
        return
    assert routes == "own", "one broadcast to both should deadlock here:\n" + out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    received = [{"w": [float(v)] * 3, "b": [-float(v)]} for v in (1, 2, 3)]
    received[1] = {}  # version 2 came without tensors
    for rank in (1, 2):
        assert f"rank {rank} received {received}" in out, out[-3000:]
    # Each version's own iteration ran once; the second delivery of versions 1 and 3 read the
    # weights again, version 2's sent nothing to either; rank 2 was served first where it was ready first.
    assert "first passes [1, 3]; resends [1, 3]; deliveries [(1, [1]), (1, [2]), (2, [1]), (2, [2]), (3, [2]), (3, [1])]" in out, out[-3000:]


def by_rank(launcher: psutil.Process, rank: int, program: str = "vlrft.cli") -> psutil.Process:
    """The process of global rank `rank` among torchrun's children."""
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and program in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of rank {rank}")


# (2 ranks, ZeRO-2, kill the rollout rank 1, which runs multi-turn rollouts with partial
# rollouts: it starts each batch while the one before waits on its environments) and (3 ranks:
# trainers 0 and 1 under ZeRO-3 with a policy EMA, rollout rank 2; kill trainer 1)
@pytest.mark.parametrize("ranks, zero_stage, victim, ahead", [(2, 2, 1, True), (3, 3, 1, False)])
def test_kill_9_of_either_role_resumes_with_every_prompt_trained_once(ranks, zero_stage, victim, ahead, tiny_text, addition_data, tmp_path):
    kill_9_and_resume(ranks, zero_stage, victim, ahead, tiny_text, addition_data, tmp_path)


def kill_9_and_resume(ranks, zero_stage, victim, ahead, tiny_text, addition_data, tmp_path, rollout=None) -> None:
    """kill -9 of one rank (torchrun ends the others) once step 2's checkpoint exists, while the
    rollout rank is held inside a later batch's reward call; the rerun resumes at step 2 (or 3) and
    every step trains exactly the prompts the sampler gives it: none lost, none twice (with a
    batch started ahead, its prompts were drawn before step 2's checkpoint: drawn again).
    `rollout`: more rollout settings (the engine)."""
    (tmp_path / "recipe.py").write_text(HELD_RECIPE)
    rows = [json.loads(line)["id"] for line in (addition_data / "train.jsonl").read_text().splitlines()]
    config = {
        "model": {"path": tiny_text},
        "data": {"train_path": str(addition_data / "train.jsonl"), "eval_path": str(addition_data / "test.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6, "ranks": 1} | (rollout or {}),
        "train": {"total_steps": 6, "lr": 1e-2, "micro_batch_tokens": 200, "mode": "async", "max_staleness": 1,
                  "zero_stage": zero_stage},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}, {"recipe": "exact_match"}]},
        "eval": {"every_steps": 2, "max_prompts": 4},
        "trajectory": {"save_every": 1},
        "checkpoint": {"save_steps": 2, "keep_last": 5},
        "output": {"dir": str(tmp_path / "killed")},
    }
    if ahead:  # S = 2: batch i + 1 may start on the weights batch i starts with, so it always starts ahead
        config["rollout"] |= {"environment": "tools", "max_turns": 2, "max_trajectory_tokens": 16}
        config["train"] |= {"partial_rollouts": True, "max_staleness": 2}
    else:  # with a policy EMA: the resumed run's trainers send it after the checkpoint's version, to evaluate
        config["train"] |= {"ema_beta": 0.5}
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "hold").touch()  # HELD_RECIPE: reward calls wait once killed/.../step_000002 exists
    proc = launch(path, ranks=ranks)
    checkpoint = tmp_path / "killed" / "checkpoints" / "step_000002"
    survivors, killed_out = kill_after_checkpoint_of(proc, checkpoint, victim)
    assert not [p for p in survivors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # (vLLM's engine processes too)
    # Trainer rank 0 survives: it names the dead rank and its role in one line, whether gloo's
    # receive saw the closed connection or it stopped on torchrun's signal; no gloo traceback.
    role = "rollout" if victim == ranks - 1 else "trainer"
    assert re.search(rf"^vlrft: rank 0 \(trainer\) stops: rank {victim} \({role}\) died or stopped answering",
                     killed_out, re.M), killed_out[-4000:]
    assert "gloo" not in killed_out, killed_out[-4000:]
    assert sorted(p.name for p in checkpoint.iterdir()) == ["policy"] + [f"rank{r}.pt" for r in range(ranks)] + ["trainer.pt"]
    (tmp_path / "hold").unlink()
    out = finish(launch(path, ranks=ranks))
    # At step 2's checkpoint, or at step 3's: after a rollout rank's death torchrun sends the
    # trainers SIGTERM, and one still waiting for the rollout rank to take version 3 stops
    # there and saves it (a trainer killed, or a trainer blocked in the next receive, cannot).
    # With batches started ahead, also at step 4's: batch 4 may have been scored before step 2's
    # checkpoint appeared (the hold starts then), and on a loaded machine the trainer can train
    # steps 3 and 4 and save before this test's poll sees step 2's checkpoint and kills.
    resumed = re.search(r"resumed from \S+ at step (\d+)", out)
    assert resumed and int(resumed[1]) in ((2, 3, 4) if ahead else (2, 3)), out[-4000:]
    resumed = int(resumed[1])
    assert resumed == 2 or victim == ranks - 1  # (the one rollout rank is the last rank)

    lines = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3, 4, 5, 6]  # each step once
    assert [r["step"] for r in lines if "eval/accuracy" in r] == [0, 2, 4, 6]  # each evaluation once
    history = re.search(r"held-out accuracy by step: (.*)", out)[1]
    assert [int(entry.split(":")[0]) for entry in history.split()] == [0, 2, 4, 6]
    assert (tmp_path / "killed" / "final_ema" / "config.json").is_file() != ahead  # the EMA case exports it
    # Each batch starts with the batch before it (whose weights are recent enough: at most 2
    # updates behind when it trains), but for the first batch of each run, 1 and the one after
    # the checkpoint (it had started in the killed run, before the checkpoint); whether batch 6
    # starts with 5 depends on timing.
    started_ahead = [r["async/started_ahead"] for r in lines if "train/loss" in r]
    first_of_each_run = [0.0] + [1.0] * (resumed - 1) + [0.0] + [1.0] * (4 - resumed)
    assert started_ahead[:5] == (first_of_each_run if ahead else [0.0] * 5)
    sampler = PromptSampler(len(rows), 4, rank=0, world_size=1, seed=0)  # the one rollout rank's, train.seed 0
    saved = tmp_path / "killed" / "trajectories"
    for step in range(1, 7):
        expected = sorted(rows[i] for _, i in sampler.next_indices())
        trained = [json.loads(line)["id"] for f in sorted(saved.glob(f"step_{step:06d}.rank*.jsonl")) for line in f.read_text().splitlines()]
        assert sorted(set(trained)) == expected and len(trained) == 16, step  # 4 prompts x 4 responses


# (partial rollouts, rollout ranks): with two, each takes the step's weights on its own, and
# the trainer may stop after it served one of them.
@pytest.mark.parametrize("partial, rollout_ranks", [(False, 1), (True, 1), (True, 2)])
def test_sigterm_stops_both_roles_after_a_checkpoint_and_the_run_resumes(partial, rollout_ranks, tiny_text, addition_data,
                                                                         tmp_path):
    """SIGTERM to torchrun (which passes it to every rank): the trainer finishes its step, saves
    a checkpoint with the rollout rank's state and posts the stop; the rollout rank stops at its
    next wait instead of waiting for weights that will not come. The rerun resumes there.
    Without partial rollouts the rollout rank is held inside a reward call until the checkpoint
    is there: the trainer does not wait for it to take the step's weights (it would have until
    the hold ends, or SIGKILL). With them it took those weights mid-batch, and the trainer waits
    for its batch, as a synchronous run finishes its step; the rollout rank then meets the stop
    inside its decoding, where it looks for new weights."""
    import signal
    import time

    (tmp_path / "recipe.py").write_text(HELD_RECIPE)
    config = {
        "model": {"path": tiny_text},
        "data": {"train_path": str(addition_data / "train.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 6, "ranks": rollout_ranks},
        "train": {"total_steps": 5, "lr": 1e-2, "micro_batch_tokens": 200, "mode": "async", "max_staleness": 1,
                  "partial_rollouts": partial},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}]},
        "eval": {"every_steps": 0},
        "trajectory": {"save_every": 1},
        "checkpoint": {"save_steps": 0},  # the only checkpoint is the one the signal asks for
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "hold_signal").touch()  # HELD_RECIPE: reward calls wait once step 1's trajectories exist
    ranks = 1 + rollout_ranks
    proc = launch(path, ranks=ranks)
    first_step = tmp_path / "run" / "trajectories" / "step_000001.rank0.jsonl"
    while not first_step.is_file():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 25  # (torchrun sends SIGKILL 30 s after its SIGTERM)
    while not partial and not list(checkpoints.glob("step_*")):  # (published: complete)
        assert time.time() < deadline, "no checkpoint while the rollout rank was held"
        time.sleep(0.2)
    (tmp_path / "hold_signal").unlink()
    out, _ = proc.communicate(timeout=120)
    assert "stopped by signal SIGTERM after step" in out and "run the same command again to resume" in out, out[-4000:]
    assert "SIGKILL" not in out  # every rank ended by itself, within torchrun's grace period
    (saved,) = (tmp_path / "run" / "checkpoints").iterdir()
    stopped_at = int(saved.name.split("_")[1])
    assert sorted(p.name for p in saved.iterdir()) == ["policy"] + [f"rank{r}.pt" for r in range(ranks)] + ["trainer.pt"]

    out = finish(launch(path, ranks=ranks))
    assert f"at step {stopped_at}" in out
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3, 4, 5]


# SIGTERM to one process: trainer rank 0, or the slow rollout rank 2 (its signal travels with
# its batch; the trainers stop after that step).
@pytest.mark.parametrize("signalled", [0, 2])
def test_a_stop_that_two_rollout_ranks_meet_at_different_points_ends_every_rank_cleanly(signalled, tiny_text,
                                                                                     addition_data, tmp_path):
    """Partial rollouts on two rollout ranks; rollout rank 2 decodes slowly. The trainers stop
    after a step without sending its weights, and rollout rank 1 meets the stop at its next wait
    while rank 2 is still decoding its batch. Rank 1 used to stop there while rank 2 went on
    into a collective of the rollout ranks (drawing the next prompts, dynamic sampling's), which
    then failed ("Connection closed by peer"; on NCCL it would hang): the rollout ranks stop
    together now. And no rank exits before the others have stopped: the first exit makes
    torchrun end the rest (a second SIGTERM kills a rank that had one), which cut rank 2's stop
    short. The rerun resumes."""
    import signal
    import time

    (tmp_path / "recipe.py").write_text(RECIPE)
    config = {
        "model": {"path": tiny_text},
        "data": {"train_path": str(addition_data / "train.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 4, "max_new_tokens": 16, "ranks": 2,
                    "dynamic_sampling": True},
        "train": {"total_steps": 8, "lr": 1e-2, "micro_batch_tokens": 400, "mode": "async", "max_staleness": 2,
                  "partial_rollouts": True},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}]},
        "eval": {"every_steps": 0},
        "checkpoint": {"save_steps": 0},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "slow").touch()
    env = {**ENV, "PYTHONPATH": str(Path(__file__).parents[2]), "SLOW_RANK": "2", "SLOW_S": "0.25",
           "SLOW_FLAG": str(tmp_path / "slow"), "UPDATE_DELAY_S": "1.5"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(free_port()),
           str(Path(__file__).with_name("slow_rollout_launch.py")), "train", str(path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.is_file() and '"step": 2' in metrics.read_text()):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.1)
    by_rank(psutil.Process(proc.pid), signalled, "slow_rollout_launch.py").send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "stopped by signal SIGTERM after step" in out, out[-4000:]
    # Each rank ended by itself, on the stop (143: the signal's exit status; torchrun lists every rank).
    assert "Connection closed" not in out and sorted(set(re.findall(r"exitcode\s*:\s*(-?\d+)", out))) == ["143"], out[-4000:]
    (tmp_path / "slow").unlink()
    out = finish(launch(path, ranks=3))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == list(range(1, 9))  # each step once


def kill_after_checkpoint_of(proc, checkpoint: Path, rank: int) -> tuple[list[psutil.Process], str]:
    """kill -9 rank `rank` once `checkpoint` exists; the run's other processes, which must end,
    and the run's output."""
    import time

    deadline = time.time() + 300
    while not checkpoint.is_dir():
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    launcher = psutil.Process(proc.pid)
    others = launcher.children(recursive=True)
    by_rank(launcher, rank).kill()  # SIGKILL: torchrun then ends the other rank
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    psutil.wait_procs(others, timeout=20)
    return others, out
