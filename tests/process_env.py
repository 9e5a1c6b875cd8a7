"""The environment for a test's child process that starts vlrft as a plain `python` run."""

import os

# What a world of one started in this test session (init_distributed in-process) leaves in
# os.environ: a child that inherited it would join, or try to serve, this session's store.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def fresh_process_env(**extra: str) -> dict[str, str]:
    """os.environ without the launch variables, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES} | extra
