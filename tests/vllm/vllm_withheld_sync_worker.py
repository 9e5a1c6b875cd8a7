"""Worker of test_weights_withheld_from_vllm_stop_the_run: one training step whose weight sync
does not take effect (the engine's update_weights consumes the tensors and loads none). The
sync check must stop it; each rank writes the SyncError's message to OUT_DIR/rank<R>.txt.
Usage: vllm_withheld_sync_worker.py OUT_DIR override [override ...]
"""

import sys
from pathlib import Path


def main(out_dir: str, overrides: list[str]) -> None:
    from vlrft.config import load_config
    from vlrft.distributed import exit_process
    from vlrft.trainer.spmd_trainer import SPMDTrainer
    from vlrft.trainer.sync_check import SyncError

    trainer = SPMDTrainer(load_config(None, overrides))
    trainer.engine.update_weights = lambda named_tensors: [None for _ in named_tensors]
    try:
        trainer.train_step()
    except SyncError as error:
        Path(out_dir, f"rank{trainer.rank}.txt").write_text(str(error))
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
