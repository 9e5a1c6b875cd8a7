"""The PTX stream: supervised (prompt, answer) rows mixed into the actor update (InstructGPT's
pretraining-mix term, here any supervised data in the canonical row schema)."""

from __future__ import annotations

from vlrft.data.dataset import DataError, load_rows, modalities_of
from vlrft.data.encoding import PromptEncoder
from vlrft.types import Rollout


class PtxStream:
    """Cycles through this rank's share of the rows; the row's `answer` is the target response."""

    def __init__(
        self, path: str, encoder: PromptEncoder, rows_per_step: int, rank: int, world_size: int, stop_id: int,
        bad_input=None,
    ):
        """`bad_input` (trainer/bad_input.py's BadInput) applies data.on_bad_sample to the file's
        rows and prompts; without it the first bad one raises."""
        rows = bad_input.load(path) if bad_input is not None else load_rows(path)
        self.modalities = modalities_of(rows)  # of every rank's rows: the vision calls are the same on all
        rows = rows[rank::world_size]
        if not rows:
            raise DataError(f"{path}: no PTX rows for rank {rank} of {world_size}")
        items = [(row, -1 - i) for i, row in enumerate(rows)]
        if bad_input is not None:
            prompts = bad_input.encode_at_start(encoder, items)
        else:
            prompts = [encoder.encode(row, index) for row, index in items]
        if not prompts:
            raise DataError(f"{path}: every PTX row of rank {rank} of {world_size} was skipped as bad input")
        tokenizer = encoder.tokenizer
        self.examples = []
        for prompt in prompts:
            target = tokenizer(prompt.answer, add_special_tokens=False)["input_ids"] + [stop_id]
            self.examples.append(
                Rollout(prompt=prompt, group_id=-1, response_ids=target, response_text=prompt.answer, truncated=False)
            )
        self.rows_per_step = rows_per_step
        self.position = 0

    def next_examples(self) -> list[Rollout]:
        out = [self.examples[(self.position + k) % len(self.examples)] for k in range(self.rows_per_step)]
        self.position += self.rows_per_step
        return out
