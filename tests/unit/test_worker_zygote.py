"""Environment workers forked from a zygote (vlrft/worker_zygote.py): each a process of its own
that a timeout kills with what it started, leaving the zygote and every other environment as
they were; nothing of the trainer in them; the zygote's imports shared, not copied; gone with
the zygote, and the zygote gone with its parent."""

import os
import signal
import time
from pathlib import Path

import pytest

from tests.unit.test_workers import MARGIN_S, alive, children, gone_within, run_script
from vlrft.multiturn.environment import EnvironmentFailure
from vlrft.multiturn.host import EnvironmentHost
from vlrft.workers import Worker

ENVIRONMENT = '''
import os
import subprocess
import sys
import time

import numpy

from vlrft.multiturn.environment import Step

with open(__file__ + ".imports", "a") as f:  # who ran this module's top level
    f.write(f"{os.getpid()}\\n")


class Spawner:
    def reset(self, sample):
        self.pids = sample["pids"]

    def step(self, action):
        if action == "spawn":  # a child in a session of its own (as the code sandbox's) and one in the worker's group
            apart = subprocess.Popen(["sleep", "600"], start_new_session=True)
            along = subprocess.Popen(["sleep", "600"])
            with open(self.pids, "w") as f:
                f.write(f"{apart.pid} {along.pid}")
            time.sleep(3600)
        if action == "spin":
            while True:
                sum(range(10**9))  # one C call that never lets go of the GIL
        return Step(f"{os.getpid()} {os.getppid()} {'torch' in sys.modules} {numpy.random.randint(2**31)}")
'''


@pytest.fixture()
def spawner(tmp_path) -> str:
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    return f"{tmp_path / 'env.py'}:Spawner"


def who(host: EnvironmentHost, held) -> tuple[int, int, bool, int]:
    """The worker's pid, its parent's, whether it has imported torch, and a draw of numpy's global generator."""
    pid, parent, torch, draw = host.step(held, "who", "step").observation.split()
    return int(pid), int(parent), torch == "True", int(draw)


def memory_kib(pid: int, field: str) -> int:
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return sum(int(line.split()[1]) for line in lines if line.split(":")[0] in field.split("+"))


def test_a_timeout_kills_its_forked_worker_with_its_tree_and_nothing_else(spawner, tmp_path):
    import torch  # noqa: F401 - as the trainer has
    before, fds = children(), len(os.listdir("/proc/self/fd"))
    host = EnvironmentHost(spawner, {}, timeout_s=1.0)
    first, second = host.construct("construction 1"), host.construct("construction 2")
    zygote = host.zygote.pid
    assert children() == before | {zygote}  # the workers are the zygote's children
    assert len(os.listdir("/proc/self/fd")) == fds + 3  # a socket to each: the zygote and the two workers
    for held in (first, second):
        host.reset(held, {"pids": str(tmp_path / "pids")}, "reset")
    (one, one_parent, one_torch, one_draw), (two, two_parent, two_torch, two_draw) = who(host, first), who(host, second)
    assert one_parent == two_parent == zygote and one != two
    assert not one_torch and not two_torch  # nothing of the trainer
    assert one_draw != two_draw  # numpy's generator reseeded in each worker, as in a fresh interpreter
    # the zygote's imports (numpy, PIL, vlrft) are shared: a worker's own pages are a few
    assert memory_kib(one, "Private_Clean+Private_Dirty") < memory_kib(zygote, "Rss") / 2
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=r"^timed out after 1s$"):
        host.step(first, "spawn", "step")
    assert time.monotonic() - start < 1.0 + MARGIN_S
    spawned = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(spawned) == 2 and gone_within([one, *spawned], 2.0)
    assert alive(zygote) and who(host, second)[0] == two  # the other environment, in its own worker, lives
    host.release([first])
    third = host.construct("construction 3")  # in the killed one's worker: forked afresh from the same zygote
    pid, parent, _, _ = who(host, third)
    assert parent == zygote and pid not in (one, two) and third.worker is first.worker
    assert (tmp_path / "env.py.imports").read_text().split() == [str(zygote)]  # once, in the zygote, for every worker
    host.stop()
    assert children() == before and gone_within([two, pid, zygote], 2.0)


def test_a_zygote_whose_parent_died_goes_away_with_its_workers(spawner):
    """Killed mid-call, the parent cannot stop anything: the zygote, watching it, ends and kills
    its workers, even one spinning in C (which its own watch thread could not do until the C
    call returned)."""
    script = run_script(f"""
        from vlrft.multiturn.host import EnvironmentHost
        host = EnvironmentHost({spawner!r}, {{}}, timeout_s=3600)
        held = host.construct("construction")
        print(host.zygote.pid, host.step(held, "who", "step").observation.split()[0], flush=True)
        host.step(held, "spin", "step")
    """)
    zygote, worker = map(int, script.stdout.readline().split())
    assert alive(zygote) and alive(worker)
    time.sleep(0.5)  # well into its spin
    script.kill()
    script.wait()
    assert gone_within([zygote, worker], 3.0)


def test_a_killed_zygote_is_started_afresh_and_its_workers_go_with_it():
    from vlrft.worker_zygote import Zygote

    zygote = Zygote(prepare=(len, ("",)))
    worker = Worker(zygote=zygote)
    assert worker.call(os.getppid, (), 60) == zygote.pid
    first = zygote.pid
    os.kill(first, signal.SIGKILL)  # as the kernel's OOM killer would
    assert gone_within([worker.pid], 3.0)  # its parent gone, the idle worker ends itself
    again = Worker(zygote=zygote)
    assert again.call(os.getppid, (), 60) == zygote.pid != first
    for w in (worker, again, zygote):
        w.stop()


def test_an_environment_module_that_fails_in_the_zygote_fails_in_one_line_and_leaves_nothing(tmp_path):
    env = tmp_path / "env.py"
    env.write_text('raise RuntimeError("no\\nlicence server")\n')
    before = children()
    host = EnvironmentHost(f"{env}:Game", {}, timeout_s=5.0)
    with pytest.raises(EnvironmentFailure, match=r"^raised RuntimeError: no licence server$"):
        host.probe()
    assert not host.zygote.running and children() == before  # the zygote is gone, nothing was forked
    env.write_text(ENVIRONMENT.replace("class Spawner", "class Game"))
    assert host.probe() == "tool"  # a fresh zygote imports the mended file
    host.stop()
