"""Worker of test_kill_while_saving: trains with `vlrft train CONFIG`, but the process dies
abruptly (os._exit(137), as under SIGKILL: no clean-up, no exception handlers) after writing
half of trainer.pt into the temporary directory of checkpoint STEP_DIR.
Usage: kill_during_save_worker.py CONFIG STEP_DIR
"""

import os
import sys

import torch


def main(config: str, step_dir: str) -> None:
    real_save = torch.save

    def dying_save(obj, path, *args, **kwargs):
        if str(path).endswith(f"{step_dir}/trainer.pt"):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a file")
                f.flush()
            os._exit(137)
        return real_save(obj, path, *args, **kwargs)

    torch.save = dying_save
    from vlrft.cli import main as cli_main
    from vlrft.distributed import exit_process

    exit_process(cli_main(["train", config]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
