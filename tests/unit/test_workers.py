"""Worker processes (vlrft/workers.py): a call past its timeout is killed with everything it
started, whatever it was doing; nothing is left behind; failures are one line; the step's
budget still stops the run."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from vlrft.multiturn.environment import EnvironmentFailure
from vlrft.multiturn.host import EnvironmentHost
from vlrft.isolation.budget import STEP_BUDGET, CallStalled
from vlrft.isolation.calls import abandoned_calls
from vlrft.rewards.guard import RecipeFailure, call_recipe_in_worker, recipe_worker
from vlrft.workers import CallFailed, CallTimedOut, Worker, killed_calls

MARGIN_S = 1.5  # a kill and its reaping, on a loaded two-core machine

RECIPES = '''
import subprocess
import sys
import time


def sleeps(completions, samples):
    time.sleep(3600)


def spins_in_c(completions, samples):
    while True:
        sum(range(10**9))  # one C call, about 30 s here, that never lets go of the GIL


def spins_in_python(completions, samples):
    while True:
        pass


def starts_children(completions, samples):
    """A child in its own process group (as a program run by the code sandbox) and one in the
    worker's, their pids written where the test reads them; then hangs."""
    apart = subprocess.Popen(["sleep", "600"], start_new_session=True)
    along = subprocess.Popen(["sleep", "600"])
    with open(samples[0]["pids"], "w") as f:
        f.write(f"{apart.pid} {along.pid}")
    time.sleep(3600)


def raises(completions, samples):
    raise KeyError("no\\nanswer")


def unpicklable(completions, samples):
    return (x for x in completions)


class Score(float):
    pass


def own_class(completions, samples):
    return [Score(1.0) for c in completions]


def exits(completions, samples):
    import os
    os._exit(3)


def length(completions, samples, scale=1.0):
    return [scale * len(c) for c in completions]


def torch_imported(completions, samples):
    from vlrft.rewards import resolve_recipe

    resolve_recipe("exact_match")(completions, [{"answer": "a"}] * len(completions))
    return [float("torch" in sys.modules)] * len(completions)
'''


@pytest.fixture()
def recipes(tmp_path):
    path = tmp_path / "recipes.py"
    path.write_text(RECIPES)
    return lambda name: f"{path}:{name}"


def children() -> set[int]:
    """This process's child processes, zombies included (a zombie is a child not reaped)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == os.getpid():
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pids, seconds: float) -> bool:
    """Whether every pid stopped running within `seconds` (a re-parented process is reaped by
    its new parent, not by us)."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def started(worker: Worker) -> int:
    """Start the worker with a call that returns at once (its import is not what a test times); its pid."""
    pid = worker.call(os.getpid, (), 60)
    assert pid == worker.pid and alive(pid)
    return pid


@pytest.mark.parametrize("recipe", ["sleeps", "spins_in_c", "spins_in_python"])
def test_a_hung_recipe_is_killed_at_its_timeout(recipe, recipes):
    worker = recipe_worker(recipes(recipe))
    pid = started(worker)
    killed = killed_calls()
    start = time.monotonic()
    with pytest.raises(RecipeFailure, match=r"^timed out after 0.5s$"):
        call_recipe_in_worker(worker, recipes(recipe), ["a"], [{}], {}, 0.5, f"reward recipe '{recipe}'")
    assert time.monotonic() - start < 0.5 + MARGIN_S
    assert not alive(pid) and killed_calls() == killed + 1
    assert call_recipe_in_worker(worker, recipes("length"), ["abc"], [{}], {"scale": 2.0}, 60, "length") == [6.0]
    assert worker.pid != pid  # a fresh worker answered
    worker.stop()


def test_a_worker_imports_only_what_its_recipe_needs(recipes):
    """A fresh interpreter, not a fork of the trainer (which has imported torch)."""
    import torch  # noqa: F401 - as the trainer has
    worker = recipe_worker(recipes("torch_imported"))
    assert call_recipe_in_worker(worker, recipes("torch_imported"), ["a"], [{}], {}, 60, "torch_imported") == [0.0]
    worker.stop()


def test_fifty_timeouts_leave_no_process_or_thread_behind():
    threads, processes, killed = set(threading.enumerate()), children(), killed_calls()
    worker = Worker()
    pids = []
    for _ in range(50):
        pids.append(started(worker))
        with pytest.raises(CallTimedOut, match="timed out after 0.2s"):
            worker.call(time.sleep, (3600,), 0.2)
        assert not worker.running
    assert killed_calls() == killed + 50
    assert children() == processes  # every killed worker reaped: no zombie, nothing running
    assert set(threading.enumerate()) == threads  # no thread per call
    live = started(worker)
    assert children() == processes | {live}  # the one live worker
    assert not any(alive(p) for p in pids) and len(set(pids)) == 50
    worker.stop()
    assert children() == processes


def test_a_killed_call_takes_the_processes_it_started_with_it(recipes, tmp_path):
    worker = recipe_worker(recipes("starts_children"))
    started(worker)
    with pytest.raises(RecipeFailure, match="timed out after 2s"):
        call_recipe_in_worker(worker, recipes("starts_children"), ["a"], [{"pids": str(tmp_path / "pids")}], {}, 2.0, "spawner")
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and gone_within(pids, 2.0)


def test_failures_are_one_line_and_the_next_call_runs(recipes):
    worker = recipe_worker(recipes("raises"))

    def failure(name: str) -> str:
        with pytest.raises(RecipeFailure) as err:
            call_recipe_in_worker(worker, recipes(name), ["a"], [{}], {}, 60, name)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert failure("raises") == "raised KeyError: 'no\\nanswer'"
    assert failure("unpicklable") == ("returned generator, which cannot be sent back from its worker process "
                                      "(TypeError: cannot pickle 'generator' object)")
    # pickled in the worker, but its class lives in a module the trainer has not imported
    assert failure("own_class").startswith("returned a result the trainer cannot load (ModuleNotFoundError: No module named 'vlrft_user_")
    pid = worker.pid
    assert failure("exits") == "its worker process died (exit code 3)"
    assert not alive(pid) and not worker.running
    assert call_recipe_in_worker(worker, recipes("length"), ["ab"], [{}], {}, 60, "length") == [2.0]
    with pytest.raises(CallFailed, match=r"^could not be sent to its worker process \((PicklingError|AttributeError): .*lambda"):
        worker.call(len, (lambda: 0,), 60)
    assert worker.call(len, ("abc",), 60) == 3  # the worker that refused to send is still the one answering
    worker.stop()


def test_a_call_interrupted_in_the_trainer_leaves_no_reply_out_of_step():
    """A signal handler that raises (Ctrl-C) mid-call: the worker is stopped, so the next call
    cannot read the interrupted call's late reply as its own."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    worker = Worker()
    started(worker)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            worker.call(time.sleep, (1.0,), 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert worker.call(len, ("ab",), 60) == 2
    worker.stop()


def test_the_step_budget_stops_a_worker_call(recipes):
    worker = recipe_worker(recipes("sleeps"))
    started(worker)
    killed, abandoned = killed_calls(), abandoned_calls()
    STEP_BUDGET.start(0.5)
    try:
        start = time.monotonic()
        with pytest.raises(CallStalled, match=r"^reward recipe 'sleeps' on sample 'r1' was still running .*guards.step_reward_budget_s"):
            call_recipe_in_worker(worker, recipes("sleeps"), ["a"], [{}], {}, 60, "reward recipe 'sleeps' on sample 'r1'")
        assert time.monotonic() - start < 0.5 + MARGIN_S
        assert STEP_BUDGET.slowest["reward"] > 0.4  # cut at the budget, not at 60 s
    finally:
        STEP_BUDGET.start(0)
    assert killed_calls() == killed + 1 and abandoned_calls() == abandoned
    assert not worker.running


ENVIRONMENT = '''
import time

from PIL import Image

from vlrft.multiturn.environment import Step


class Flaky:
    def reset(self, sample):
        if sample.get("fail"):
            raise RuntimeError("database\\nunreachable")

    def step(self, action):
        if action == "hang":
            while True:
                pass
        return Step(action.upper(), 1.0, False, [Image.new("RGB", (3, 2), "red")])


def stall(seconds):
    time.sleep(float(seconds))
    return "woke"
'''


def test_an_environment_call_fails_in_one_line_and_a_hang_loses_only_its_environment(tmp_path):
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    host = EnvironmentHost(f"{tmp_path / 'env.py'}:Flaky", {}, timeout_s=0.5)
    assert host.probe() == "tool"
    first, second = host.construct("construction 1"), host.construct("construction 2")
    assert first.worker is host.workers[0] and second.worker is not first.worker  # the probe's worker, then a new one
    with pytest.raises(EnvironmentFailure, match=r"^raised RuntimeError: database unreachable$"):
        host.reset(first, {"fail": True}, "reset 1")
    step = host.step(first, "look", "step 1")
    assert step.observation == "LOOK" and step.images[0].size == (3, 2) and step.images[0].getpixel((0, 0)) == (255, 0, 0)
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=r"^timed out after 0.5s$"):
        host.step(first, "hang", "environment step on sample 'q7'")
    assert time.monotonic() - start < 0.5 + MARGIN_S
    assert host.step(second, "look", "step 2").observation == "LOOK"  # its environment, in a worker of its own, lives
    with pytest.raises(EnvironmentFailure, match=r"^not run: its worker process was stopped$"):
        host.step(first, "look", "step 1 again")
    host.release([first])
    third = host.construct("construction 3")  # the hung one's worker, a fresh process
    assert third.worker is first.worker and third.generation == first.generation + 1
    assert host.step(third, "again", "step 3").observation == "AGAIN"
    host.release([second, third])
    host.stop()


def test_a_hanging_user_tool_is_killed_with_the_tools_environment(tmp_path):
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    host = EnvironmentHost("tools", {"tools": ["calculator", f"{tmp_path / 'env.py'}:stall"]}, timeout_s=1.0)
    held = host.construct("construction")
    call = '<tool_call>{"name": "%s", "arguments": {%s}}</tool_call>'
    assert host.step(held, call % ("calculator", '"expression": "17 * 23"'), "step").observation == "391"
    assert host.step(held, call % ("stall", '"seconds": 0'), "step").observation == "woke"
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure, match="timed out after 1s"):
        host.step(held, call % ("stall", '"seconds": 3600'), "step")
    assert time.monotonic() - start < 1.0 + MARGIN_S
    host.stop()


def run_script(body: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, **kwargs)


def test_workers_stop_at_exit_and_a_worker_outliving_its_parent_kills_itself():
    # The exit path of the trainer (distributed.py): atexit handlers, then os._exit.
    script = run_script("""
        import atexit, os, time
        from vlrft.workers import Worker
        workers = [Worker(), Worker()]
        pids = [w.call(os.getpid, (), 60) for w in workers]
        atexit._run_exitfuncs()
        left = [p for p in pids if os.path.exists(f"/proc/{p}")]  # not even a zombie: reaped
        print(len(pids), left, flush=True)
        os._exit(0)
    """)
    out, _ = script.communicate(timeout=60)
    assert out.split("\n")[0] == "2 []"
    # Killed before it could stop its worker, mid-call.
    script = run_script("""
        import os, time
        from vlrft.workers import Worker
        worker = Worker()
        print(worker.call(os.getpid, (), 60), flush=True)
        worker.call(time.sleep, (3600,), 3600)
    """)
    pid = int(script.stdout.readline())
    script.kill()
    script.wait()
    assert gone_within([pid], 3.0)  # it was sleeping for an hour: its watchdog ended it
