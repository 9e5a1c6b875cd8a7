"""The one collective module, the launch checks, and the multi-node rules (issue: GPU training)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlrft
from tests.process_env import fresh_process_env
from tests.unit.test_checkpoint_hostile import rank_state, trainer_state
from vlrft.config import ConfigError, load_config, to_dict
from vlrft.config_checks import check_world_size
from vlrft.distributed import (
    all_gather_1d,
    all_gather_objects,
    all_reduce_max_int,
    all_reduce_sum,
    broadcast_from_rank0,
    gather_objects_to_rank0,
    launch_problem,
)
from vlrft.engines.base import derived_seed
from vlrft.engines.vllm_engine import groups_spanning_nodes, request_seeds, tp_groups
from vlrft.trainer.checkpoint import resume_decision

PACKAGE = Path(vlrft.__file__).parent


def torch_distributed_uses(source: str) -> list[int]:
    """Line numbers that import or reach torch.distributed (as a module or an attribute)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_each_way_of_reaching_torch_distributed():
    assert torch_distributed_uses("import torch.distributed as dist") == [1]
    assert torch_distributed_uses("from torch.distributed import all_reduce") == [1]
    assert torch_distributed_uses("from torch import distributed") == [1]
    assert torch_distributed_uses("import torch\nx = 1\ntorch.distributed.barrier()") == [3]
    assert torch_distributed_uses("import torch\ntorch.cuda.synchronize()") == []


def test_every_collective_in_vlrft_goes_through_vlrft_distributed():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "distributed.py":
            continue
        found = torch_distributed_uses(path.read_text())
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}, f"torch.distributed used outside vlrft/distributed.py: {offenders}"
    assert torch_distributed_uses((PACKAGE / "distributed.py").read_text())  # the scan sees the real one


def test_helpers_in_a_world_of_one_return_on_the_callers_device_as_float32(world_of_one):
    values = torch.tensor([1, 2, 3], dtype=torch.int64)
    summed = all_reduce_sum(values)
    assert summed.dtype == torch.float32 and summed.device == values.device and summed.tolist() == [1.0, 2.0, 3.0]
    assert summed.data_ptr() != values.data_ptr()  # a copy: the caller's tensor is never reduced in place
    assert all_reduce_sum(values, out_device="cpu").device.type == "cpu"
    assert all_reduce_max_int(7) == 7
    assert all_gather_1d(torch.tensor([0.5, 1.5])).tolist() == [0.5, 1.5]
    assert all_gather_objects({"a": 1}) == [{"a": 1}]
    assert gather_objects_to_rank0(["x"]) == [["x"]]
    assert broadcast_from_rank0(("decision", 3)) == ("decision", 3)


@pytest.mark.parametrize("env, problem", [
    ({}, ""),
    ({"SLURM_NTASKS": "1"}, ""),
    ({"RANK": "3", "SLURM_NTASKS": "8"}, ""),  # torchrun under srun: fine
    ({"SLURM_NTASKS": "4"}, "started as one of 4 Slurm tasks without torchrun's RANK/WORLD_SIZE"),
])
def test_launch_problem_refuses_several_tasks_without_ranks(env, problem):
    found = launch_problem(env)
    assert found.startswith(problem) and bool(found) == bool(problem)


def test_plain_srun_with_several_tasks_fails_with_one_line(tmp_path, tiny_text, addition_data):
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{path: {tiny_text}}}\ndata: {{train_path: {addition_data / 'train.jsonl'}}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    env = fresh_process_env()
    env["SLURM_NTASKS"] = "2"
    done = subprocess.run(
        [sys.executable, "-m", "vlrft.cli", "train", str(tmp_path / "cfg.yaml")], capture_output=True, text=True, env=env,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("vlrft: error: started as one of 2 Slurm tasks")
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing was started


def test_a_finished_run_destroys_its_process_group(tmp_path, tiny_text, addition_data):
    """A gloo group left to interpreter exit aborts about half of the exits of a 5-rank job
    ("terminate called without an active exception"): `vlrft train` destroys it first."""
    code = (
        "import sys, torch.distributed as dist\n"
        "from vlrft.cli import main\n"
        f"rc = main(['train', '{tmp_path / 'cfg.yaml'}'])\n"
        "print('initialized after the run:', dist.is_initialized())\n"
        "sys.exit(rc)\n"
    )
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{path: {tiny_text}}}\ndata: {{train_path: {addition_data / 'train.jsonl'}}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\nrollout: {{rollout_prompts: 2, n_samples_per_prompt: 2, max_new_tokens: 4}}\n"
        "train: {total_steps: 1}\ntrajectory: {save_every: 0}\n"
    )
    env = fresh_process_env()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "initialized after the run: False" in done.stdout


def test_exit_process_runs_atexit_handlers_flushes_and_keeps_the_code(tmp_path):
    """`exit_process` (the end of `vlrft train` and of every rank script) leaves without the
    interpreter's finalisation, but what a run registered to do at exit still happens, output
    still written from buffers reaches the pipe, the group is gone and the exit code is kept."""
    code = (
        "import atexit, sys, torch.distributed as dist\n"
        "from pathlib import Path\n"
        "from vlrft.distributed import exit_process, init_distributed\n"
        "init_distributed()\n"
        f"atexit.register(lambda: Path('{tmp_path / 'atexit_ran'}').write_text(str(dist.is_initialized())))\n"
        "sys.stdout.write('buffered, no newline')\n"
        "exit_process(3)\n"
        "print('not reached')\n"
    )
    env = fresh_process_env()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "buffered, no newline"
    assert (tmp_path / "atexit_ran").read_text() == "False"  # the group was destroyed before the handlers ran


def test_engine_groups_must_fit_in_a_node(tmp_path):
    (tmp_path / "cfg.yaml").write_text("model: {path: m}\ndata: {train_path: d.jsonl}\nrollout: {engine: vllm}\n")
    cfg = load_config(tmp_path / "cfg.yaml", ["rollout.engine_tp_size=2", "rollout.rollout_prompts=8"])
    check_world_size(cfg, world_size=4, ranks_per_node=2)  # groups [0, 1] and [2, 3]: one node each
    with pytest.raises(ConfigError) as err:
        check_world_size(cfg, world_size=4, ranks_per_node=1)  # one rank per node: [0, 1] spans two
    assert str(err.value) == (
        "config key 'rollout.engine_tp_size' (2) must divide the ranks per node (1): "
        "a tensor-parallel engine group cannot span nodes"
    )
    with pytest.raises(ConfigError, match=r"must divide the number of ranks \(3\)"):
        check_world_size(load_config(tmp_path / "cfg.yaml", ["rollout.engine_tp_size=2", "rollout.rollout_prompts=3"]), 3, 3)


def test_groups_spanning_nodes_are_found_from_host_names():
    groups = tp_groups(4, 2)
    assert groups_spanning_nodes(groups, ["a", "a", "b", "b"]) == []
    assert groups_spanning_nodes(groups, ["a", "b", "b", "b"]) == [[0, 1]]
    assert groups_spanning_nodes(tp_groups(4, 4), ["a", "a", "b", "b"]) == [[0, 1, 2, 3]]


def test_request_seeds_depend_on_call_group_and_position_only():
    first = request_seeds(derived_seed(0, 5, 1), group_index=0, count=3)
    assert first == request_seeds(derived_seed(0, 5, 1), group_index=0, count=3)  # every rank of a group agrees
    assert len(set(first)) == 3 and all(0 <= s < 2**31 for s in first)
    assert set(first).isdisjoint(request_seeds(derived_seed(0, 5, 1), group_index=1, count=3))  # other group
    assert set(first).isdisjoint(request_seeds(derived_seed(0, 6, 1), group_index=0, count=3))  # next step
    assert request_seeds(None, 0, 2) == [None, None]  # greedy evaluation: no seeds


def test_resume_is_decided_once_and_errors_name_the_key(world_of_one, tmp_path):
    config = to_dict(load_config(None, ["model.path=m", "data.train_path=t.jsonl"]))
    assert resume_decision("auto", tmp_path, 0, config, 1) == (None, 0)
    assert resume_decision("never", tmp_path, 0, config, 1) == (None, 0)
    saved = tmp_path / "checkpoints" / "step_000004"
    (saved / "policy").mkdir(parents=True)
    torch.save(rank_state(), saved / "rank0.pt")
    torch.save(trainer_state(config, 4), saved / "trainer.pt")
    assert resume_decision("auto", tmp_path, 0, config, 1) == (saved, 4)
    with pytest.raises(ConfigError, match="checkpoint.resume.*not a vlrft checkpoint"):
        resume_decision(str(tmp_path / "nowhere"), tmp_path, 0, config, 1)
    torch.save({**trainer_state(config, 4), "world_size": 2}, saved / "trainer.pt")
    with pytest.raises(ConfigError, match=r"step_000004 is incomplete: no rank1.pt"):
        resume_decision("auto", tmp_path, 0, config, 2)


SHUTDOWN_ORDER = """
import torch.distributed as dist
from vlrft.distributed import before_shutdown, init_distributed, shutdown_distributed
init_distributed()
seen = []
before_shutdown(lambda: seen.append(("first", dist.is_initialized())))
before_shutdown(lambda: seen.append(("second", dist.is_initialized())))
shutdown_distributed()
shutdown_distributed()  # each callback runs once
print(seen, dist.is_initialized())
"""


def test_callbacks_before_shutdown_run_while_the_group_exists_last_registered_first():
    # In a process of its own: this session's group is held by DeepSpeed in other tests.
    # (Without the launch variables a world of one this session may have set: a store of its own.)
    env = fresh_process_env()
    done = subprocess.run([sys.executable, "-c", SHUTDOWN_ORDER], capture_output=True, text=True, timeout=120,
                          env=env | {"PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[('second', True), ('first', True)] False"
