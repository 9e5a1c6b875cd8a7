"""Worker of test_bad_input_two_ranks: `vlrft train CONFIG`, with one test-only change: when
BAD_INPUT_NAN_STEP=N, rank 1's N-th policy update sees NaN advantages in one of its experiences
(a NaN loss on that rank only). vlrft itself never reads this variable.
Usage: torchrun ... bad_input_worker.py train CONFIG"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    import vlrft.trainer.spmd_trainer as trainer_module
    from vlrft.cli import main as cli

    nan_step = int(os.environ.get("BAD_INPUT_NAN_STEP", "0"))
    real_update = trainer_module.policy_update
    calls = []

    def policy_update(backend, buffer, *args, **kwargs):
        calls.append(1)
        if len(calls) == nan_step and dist.get_rank() == 1:
            victim = next(e for e in buffer.items if e.in_loss and len(e.advantages))
            victim.advantages = torch.full_like(victim.advantages, float("nan"))
        return real_update(backend, buffer, *args, **kwargs)

    trainer_module.policy_update = policy_update
    return cli(sys.argv[1:])


if __name__ == "__main__":
    from vlrft.distributed import exit_process

    exit_process(main())
