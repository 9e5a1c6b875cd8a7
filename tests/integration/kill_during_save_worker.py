"""Worker of the kill-while-saving tests: trains with `vlrft train CONFIG`, but the process dies
abruptly (os._exit(137), as under SIGKILL: no clean-up, no exception handlers) while saving
checkpoint STEP_DIR, at one of two moments:

  half-write      after writing half of trainer.pt into the temporary directory
  before-rename   after every file of the temporary directory is written, right before the
                  rename that publishes it; the paths fsynced until then are written to
                  fsynced.json beside CONFIG, so the test can check nothing was left unflushed

Usage: kill_during_save_worker.py CONFIG STEP_DIR {half-write|before-rename}
"""

import json
import os
import sys
from pathlib import Path

import torch


def main(config: str, step_dir: str, moment: str) -> None:
    real_save, real_rename, real_fsync = torch.save, Path.rename, os.fsync
    fsynced: list[str] = []

    def dying_save(obj, path, *args, **kwargs):
        if str(path).endswith(f"{step_dir}/trainer.pt"):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a file")
                f.flush()
            os._exit(137)
        return real_save(obj, path, *args, **kwargs)

    def recording_fsync(fd):
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def dying_rename(self, target):
        if self.name == f".tmp-{step_dir}":
            Path(config).with_name("fsynced.json").write_text(json.dumps(fsynced))
            os._exit(137)
        return real_rename(self, target)

    if moment == "half-write":
        torch.save = dying_save
    else:
        os.fsync, Path.rename = recording_fsync, dying_rename
    from vlrft.cli import main as cli_main
    from vlrft.distributed import exit_process

    exit_process(cli_main(["train", config]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
