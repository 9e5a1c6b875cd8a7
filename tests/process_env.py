"""The environment for a test's child process that starts vlrft as a plain `python` run."""

import os
import sys

# What a world of one started in this test session (init_distributed in-process) leaves in
# os.environ: a child that inherited it would join, or try to serve, this session's store.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def fresh_process_env(**extra: str) -> dict[str, str]:
    """os.environ without the launch variables, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES} | extra


def rank_launch(ranks: int, **extra: str) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that start `ranks` ranks of the program named after the command
    (a script, or -m and a module), with `extra` in their environment: torchrun for several;
    plain `python` for one, on a port of this test worker's slice, which spares the torchrun
    agent's start-up (~2 s of CPU; the suite launches dozens of single ranks)."""
    from tests.ports import free_port

    if ranks == 1:
        return [sys.executable], fresh_process_env(MASTER_PORT=str(free_port()), **extra)
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())],
            fresh_process_env(**extra))
