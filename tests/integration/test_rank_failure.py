"""Issue 34, item 7: one rank fails, every rank stops, fast (vlrft/rank_watch.py), 2 ranks.

A rank that raises at step 2 ends every rank within seconds, under torchrun and without it (the
raising rank then hosts the store); its message appears once and each other rank adds one line.
A rank SIGKILLed at step 2 ends the other one within guards.peer_timeout_s: these runs start
the two processes without torchrun, whose agent would end the survivor itself. A rank that
hangs alive at step 2 ends both within guards.stall_timeout_s, saying where each was. Times are
measured from the failure (the worker writes it down) to the end of the last process.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.test_torchrun_training import RECIPE, free_port

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("rank_failure_worker.py")
PEER_TIMEOUT_S = 10.0  # for the kill runs: short, but far above a starved heartbeat thread's gap here


def write_config(root: Path, model: str, data: Path, peer_timeout_s: float = 60.0, save_every: int = 0,
                 stall_timeout_s: float = 1800.0) -> Path:
    (root / "recipe.py").write_text(RECIPE)
    config = {
        "model": {"path": model},
        "data": {"train_path": str(data / "train.jsonl")},
        "rollout": {"rollout_prompts": 4, "n_samples_per_prompt": 2, "max_new_tokens": 4},
        "train": {"total_steps": 4, "lr": 1e-2, "micro_batch_tokens": 200},
        "reward": {"default": [{"recipe": "recipe.py:distinct_chars"}]},
        "eval": {"every_steps": 0},
        "trajectory": {"save_every": save_every},
        "guards": {"peer_timeout_s": peer_timeout_s, "stall_timeout_s": stall_timeout_s},
        "output": {"dir": str(root / "run")},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fail_env(root: Path, mode: str, fail_rank: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC") and k not in ("RANK", "WORLD_SIZE")}
    return env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "FAIL_MODE": mode,
                  "FAIL_RANK": str(fail_rank), "FAIL_STEP": "2", "FAIL_MARK": str(root / "failed_at")}


def run(cmds: list[tuple[list[str], dict]], root: Path) -> tuple[list[int], str, float]:
    """Start the processes, wait for all: (exit codes, their combined output, seconds from the
    failure to the end of the last one; 0 when nothing failed)."""
    logs = [open(root / f"out{i}.txt", "w") for i in range(len(cmds))]
    procs = [subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
             for (cmd, env), log in zip(cmds, logs)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    ended = time.time()
    for log in logs:
        log.close()
    out = "".join((root / f"out{i}.txt").read_text() for i in range(len(cmds)))
    mark = root / "failed_at"  # written by the failing rank just before it fails
    return codes, out, ended - float(mark.read_text()) if mark.is_file() else 0.0


def torchrun(root: Path, config: Path, fail_rank: int, mode: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), "train", str(config)]
    return run([(cmd, fail_env(root, mode, fail_rank))], root)


def bare_ranks(root: Path, config: Path, fail_rank: int, mode: str):
    """Two processes with the variables torchrun would set, and nothing watching them."""
    port = str(free_port())
    cmds = []
    for rank in (0, 1):
        env = fail_env(root, mode, fail_rank) | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmds.append(([sys.executable, str(WORKER), "train", str(config)], env))
    return run(cmds, root)


def test_a_raise_on_rank_1_under_torchrun_ends_both_ranks_within_seconds(tiny_text, addition_data, tmp_path):
    (code,), out, seconds = torchrun(tmp_path, write_config(tmp_path, tiny_text, addition_data), 1, "raise")
    assert (tmp_path / "failed_at").is_file(), out[-4000:]  # it did fail, in step 2
    print(f"both ranks ended {seconds:.1f} s after the raise")
    assert code != 0
    assert seconds < 60, out[-4000:]
    assert out.count("injected failure on rank 1 at step 2") == 1, out[-4000:]
    # rank 0 was ended by its watch (not by torchrun's agent): its one line says why
    assert out.count("vlrft: rank 0 stops: rank 1 failed with ValueError (its traceback is above)") == 1, out[-4000:]
    assert out.index("injected failure on rank 1") < out.index("vlrft: rank 0 stops")


def test_a_raise_on_the_rank_hosting_the_store_ends_the_other(tiny_text, addition_data, tmp_path):
    """Without torchrun, rank 0 hosts the store: it waits for rank 1 to read its record."""
    codes, out, seconds = bare_ranks(tmp_path, write_config(tmp_path, tiny_text, addition_data), 0, "raise")
    assert (tmp_path / "failed_at").is_file(), out[-4000:]
    print(f"both ranks ended {seconds:.1f} s after the raise")
    assert codes == [1, 1], out[-4000:]
    assert seconds < 60, out[-4000:]
    assert out.count("injected failure on rank 0 at step 2") == 1, out[-4000:]
    assert out.count("vlrft: rank 1 stops: rank 0 failed with ValueError (its traceback is above)") == 1, out[-4000:]


@pytest.mark.parametrize("killed, line", [
    (1, "vlrft: rank 0 stops: rank 1 has not been heard from for 10 s (killed?)"),
    # rank 0 hosts the store: it goes too, and the survivor gives the store as long as a peer
    (0, "vlrft: rank 1 stops: the rendezvous store has not answered for 10 s (its host, rank 0 or torchrun, gone?)"),
])
def test_a_killed_rank_ends_the_other_within_the_peer_timeout(killed, line, tiny_text, addition_data, tmp_path):
    config = write_config(tmp_path, tiny_text, addition_data, peer_timeout_s=PEER_TIMEOUT_S)
    codes, out, seconds = bare_ranks(tmp_path, config, killed, "kill")
    assert (tmp_path / "failed_at").is_file(), out[-4000:]
    print(f"the survivor ended {seconds:.1f} s after the kill")
    assert codes[killed] == -9 and codes[1 - killed] == 1, out[-4000:]
    assert PEER_TIMEOUT_S - 2 <= seconds < PEER_TIMEOUT_S + 30, out[-4000:]  # the timeout, not gloo, ended it
    assert out.count(line) == 1, out[-4000:]
    if killed == 1:  # the survivor found it, and says where each rank was (the dead one: as it last
        # published it, up to a tick before its death: here it died within a second of starting)
        assert "vlrft: where each rank was (the phase it last entered; since, by its own clock):\n" in out, out[-4000:]
        assert re.search(r"\n  step 2: update: ranks? 0(-1)?  since ", out), out[-4000:]


STALL_TIMEOUT_S = 20.0  # above any phase of these runs on a loaded machine (building the trainer: ~5 s)


def test_a_rank_that_hangs_alive_ends_every_rank_after_the_stall_timeout_saying_where(tiny_text, addition_data, tmp_path):
    """Rank 1 blocks forever at the start of step 2's update, its heartbeat going on; rank 0 waits
    in the update's first collective. Without the stall guard both would wait 60 minutes."""
    config = write_config(tmp_path, tiny_text, addition_data, stall_timeout_s=STALL_TIMEOUT_S)
    (code,), out, seconds = torchrun(tmp_path, config, 1, "hang")
    assert (tmp_path / "failed_at").is_file(), out[-4000:]
    print(f"both ranks ended {seconds:.1f} s after the hang")
    assert code != 0
    assert STALL_TIMEOUT_S - 2 <= seconds < STALL_TIMEOUT_S + 30, out[-4000:]
    # Neither rank moves on: either may find the stall first, or both at one tick
    stops = dict(re.findall(r"vlrft: rank (\d) stops: (?:no rank has moved to a new phase for \d+ s \(guards.stall_timeout_s: "
                            rf"{STALL_TIMEOUT_S:g}\): the job is hung) \[its main thread is at (.*)\]", out))
    assert sorted(stops) == ["0", "1"], out[-4000:]  # each rank says why it stops, and where it is
    assert re.fullmatch(r".*rank_failure_worker\.py:\d+ in policy_update, inside .*threading\.py:\d+ in wait", stops["1"]), stops
    assert "vlrft/" in stops["0"] and "rank_failure_worker" not in stops["0"], stops  # in vlrft's update, waiting for rank 1
    # one report, by the rank that claimed it
    assert out.count("vlrft: where each rank was") == 1, out[-4000:]
    assert "vlrft: where each rank was (the phase it last entered; since, by its own clock):\n" \
           "  step 2: update: ranks 0-1  since " in out, out[-4000:]


def test_a_clean_run_with_a_short_peer_timeout_finishes_with_code_0(tiny_text, addition_data, tmp_path):
    """The watch stops before a rank's clean exit: the rank that ends first is not taken for
    dead, and rank 0's exit (it hosts the store here) while rank 1 is still closing is no failure.
    Rank 0 writes the trajectory report after the others have gone."""
    config = write_config(tmp_path, tiny_text, addition_data, peer_timeout_s=2.0, save_every=1)
    codes, out, _ = bare_ranks(tmp_path, config, 0, "none")
    assert codes == [0, 0], out[-4000:]
    assert "stops:" not in out and "trajectory report:" in out
