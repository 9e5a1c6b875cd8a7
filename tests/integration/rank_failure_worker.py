"""Worker of test_rank_failure: `vlrft train CONFIG`, except that in the FAIL_STEP-th policy
update rank FAIL_RANK fails, after writing the time (time.time()) to FAIL_MARK:
- FAIL_MODE=raise: it raises ValueError("injected failure on rank R at step S");
- FAIL_MODE=kill: it SIGKILLs itself (no handler, no clean-up runs), and the other ranks, in the
  same update, wait forever outside any collective. Inside a gloo collective they would notice
  the closed connection at once and fail themselves, which would hide whether the watch works;
  NCCL never notices, nor does a rank busy with rank-local work (rank 0 writing a checkpoint);
- FAIL_MODE=hang: it blocks forever, alive (its rank watch goes on), and the other ranks
  wait in the update's first collective;
- FAIL_MODE=none: nothing fails.
vlrft itself never reads these variables.
Usage: rank_failure_worker.py train CONFIG (under torchrun, or with RANK, WORLD_SIZE, ... set)"""

import os
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    import vlrft.trainer.spmd_trainer as trainer_module
    from vlrft.cli import main as cli
    from vlrft.distributed import rank

    fail_rank, fail_step, mode = int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"]), os.environ["FAIL_MODE"]
    real_update = trainer_module.policy_update
    calls = []

    def policy_update(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_step and mode != "none":
            if rank() == fail_rank:
                Path(os.environ["FAIL_MARK"]).write_text(repr(time.time()))
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "hang":
                    threading.Event().wait()
                raise ValueError(f"injected failure on rank {fail_rank} at step {fail_step}")
            if mode == "kill":
                threading.Event().wait()
        return real_update(*args, **kwargs)

    trainer_module.policy_update = policy_update
    return cli(sys.argv[1:])


if __name__ == "__main__":
    from vlrft.distributed import exit_process

    exit_process(main())
