"""Run by test_async_training under torchrun: `vlrft train CONFIG`, with two changes of timing
alone (test doubles): while the file SLOW_FLAG exists, the HF engine of global rank SLOW_RANK
sleeps SLOW_S before each token it samples for a batch (evaluation is left alone), and trainer
rank 0 sleeps UPDATE_DELAY_S before it sends each weights version (a slower update)."""

import os
import sys
import time
from pathlib import Path

import vlrft.engines.hf_engine as hf_engine
from vlrft.trainer.weights_delivery import RolloutRanks

rank = os.environ["RANK"]
if rank == os.environ["SLOW_RANK"]:
    sample, flag, pause = hf_engine.HFEngine._sample, Path(os.environ["SLOW_FLAG"]), float(os.environ["SLOW_S"])

    def slow_sample(self, logits, params):
        if flag.exists() and self.new_weights is not None:  # (None inside an evaluation)
            time.sleep(pause)
        return sample(self, logits, params)

    hf_engine.HFEngine._sample = slow_sample

if rank == "0":
    update, delay = RolloutRanks.update_weights, float(os.environ["UPDATE_DELAY_S"])

    def delayed_update(self, named_tensors):
        time.sleep(delay)
        return update(self, named_tensors)

    RolloutRanks.update_weights = delayed_update

from vlrft.cli import entry  # noqa: E402

sys.argv = ["vlrft", *sys.argv[1:]]
entry()
