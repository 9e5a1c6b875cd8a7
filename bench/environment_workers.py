"""What a rank's environment worker processes cost (vlrft/multiturn/host.py): the environment
calls of multi-turn batches as `multi_turn_steps` makes them (per batch: T constructions and
resets, two turns of T steps, then the releases; `rollout.environment_workers` = 4, the
default), and the memory of the worker processes once the batches are done.

    python bench/environment_workers.py calculator 128 6   # the calculator example's rank
    python bench/environment_workers.py zoom 256 6         # the zoom example's rank

Run from the checkout's root (the zoom environment is `examples/zoom/zoom_env.py`). Prints the
first batch's seconds (the workers' starts included), the median of the later ones (the
workers reused), the CPU seconds each took in the trainer and in the environment processes
(less bent by a busy machine than the seconds), and per worker process its resident, proportional (Pss: shared pages divided
among the processes sharing them) and private memory (Private_Clean + Private_Dirty) from
/proc/PID/smaps_rollup, and the same for the zygote the workers are forked from. Nothing is
asserted: docs/environments.md keeps the numbers with this command.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from PIL import Image

from vlrft.multiturn.host import EnvironmentHost


def task(kind: str, folder: Path) -> tuple[str, dict, dict, list[str]]:
    """The environment, its args, a sample and the two turns' actions of an example's rank."""
    if kind == "calculator":
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 52"}}</tool_call>'
        return "tools", {"tools": ["calculator"]}, {"id": "q", "answer": "1924", "meta": {}}, [call, "<answer>1924</answer>"]
    full = folder / "full.png"
    Image.new("RGB", (224, 224), "blue").save(full)
    sample = {"id": "q", "meta": {"full_image": str(full), "zoom_box": [100, 100, 124, 124]}}
    return "examples/zoom/zoom_env.py:CentreZoom", {}, sample, ["<zoom>", "blue"]


def memory_mib(pid: int) -> dict[str, float]:
    """Rss, Pss and private memory of a process, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0]) / 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"], "private": fields["Private_Clean"] + fields["Private_Dirty"]}


def cpu_s(pids: list[int]) -> dict[int, float]:
    """CPU seconds each process has run (/proc/PID/schedstat), by pid."""
    return {pid: int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9 for pid in pids}


def processes(host: EnvironmentHost) -> list[int]:
    """The rank's environment processes: its workers, and the zygote they are forked from."""
    zygote = getattr(host, "zygote", None)
    return [w.pid for w in [*host.workers, *([zygote] if zygote is not None else [])] if w.running]


def batch(host: EnvironmentHost, sample: dict, actions: list[str], trajectories: int) -> tuple[float, float, float]:
    """The batch's seconds, the trainer's CPU seconds in it and its environment processes'."""
    def start() -> object:
        held = host.construct("construction")
        host.reset(held, sample, "reset")
        return held

    began, trainer, before = time.monotonic(), time.process_time(), cpu_s(processes(host))
    helds = host.each([start for _ in range(trajectories)])
    for action in actions:
        host.each([partial(host.step, held, action, "step") for held in helds])
    took, trainer = time.monotonic() - began, time.process_time() - trainer
    environments = sum(cpu - before.get(pid, 0.0) for pid, cpu in cpu_s(processes(host)).items())
    host.release(helds)
    return took, trainer, environments


def main() -> None:
    kind, trajectories, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with tempfile.TemporaryDirectory() as folder:
        name, args, sample, actions = task(kind, Path(folder))
        host = EnvironmentHost(name, args, 30.0, 4)
        host.probe()
        runs = [batch(host, sample, actions, trajectories) for _ in range(batches)]
        times = [took for took, _, _ in runs]
        workers = [memory_mib(w.pid) for w in host.workers if w.running]
        zygote = getattr(host, "zygote", None)
        zygote_pid = zygote.pid if zygote is not None and zygote.running else None
        later = times[1:]
        print(f"{kind}, {trajectories} trajectories: first batch {times[0]:.2f} s, later batches median "
              f"{statistics.median(later):.3f} s (min {min(later):.3f}, max {max(later):.3f}); {len(workers)} worker processes")
        print(f"CPU of the first batch: {runs[0][1]:.2f} s in the trainer, {runs[0][2]:.2f} s in the environment processes; "
              f"of a later one (median): {statistics.median(r[1] for r in runs[1:]):.2f} s, {statistics.median(r[2] for r in runs[1:]):.2f} s")
        mean = {key: statistics.mean(w[key] for w in workers) for key in ("rss", "pss", "private")}
        print("per worker process: resident {rss:.1f} MiB, Pss {pss:.1f} MiB, private {private:.1f} MiB".format(**mean))
        if zygote_pid is not None:
            print("the zygote: resident {rss:.1f} MiB, Pss {pss:.1f} MiB, private {private:.1f} MiB".format(**memory_mib(zygote_pid)))
        host.stop()


if __name__ == "__main__":
    main()
