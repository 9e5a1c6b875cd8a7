"""`data.on_bad_sample`: what a bad row or prompt does to a run (docs/bad_input.md).

`error` stops the run with the problem's one-line message; `skip` leaves the row or prompt
out, prints one line naming it and counts it (`data/skipped_rows`, `data/skipped_prompts`).
Prompts are encoded rank by rank, so every decision that changes what a rank runs next is
all-reduced: a bad prompt on one rank stops every rank (error) or is dropped on its own rank
only, with a placeholder keeping an emptied rank in the collectives (skip). A dropped training
row stays dropped for the run, on every rank: it is named and counted once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vlrft.console import say
from vlrft.data.columns import Columns
from vlrft.data.dataset import DataError, read_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.data.media import MediaPaths
from vlrft.data.sampler import PromptSampler
from vlrft.distributed import all_gather_1d, all_reduce_sum
from vlrft.models.packing import empty_response
from vlrft.types import Experience, Prompt


class BadInput:
    def __init__(self, mode: str, rank: int, world_size: int, columns: Columns = Columns(),
                 media: MediaPaths = MediaPaths()):
        self.skip = mode == "skip"
        self.columns = columns  # how rows without "messages" are read (data.*_key)
        self.media = media  # where rows may name media files (data.media_roots, allow_external_media)
        self.rank = rank
        self.world_size = world_size
        self.skipped_rows = 0  # rows left out before training (summed over ranks where rank-local)
        self.dropped_rows: set[int] = set()  # training rows whose prompt failed to encode (`draw`)
        self._placeholder: Experience | None = None

    def _say(self, message: str) -> None:
        where = f"rank {self.rank}: " if self.world_size > 1 else ""
        say(f"vlrft: {where}{message}")

    def load(self, path: str | Path) -> list[dict]:
        """The valid rows of a data set (every rank reads all of it; rank 0 reports)."""
        rows, problems = read_rows(path, skip_bad=self.skip, columns=self.columns, media=self.media)
        self.skipped_rows += len(problems)
        if problems and self.rank == 0:
            for problem in problems:
                say(f"vlrft: skipping {problem} (on_bad_sample: skip)")
            say(f"vlrft: skipped {len(problems)} bad rows of {path} (on_bad_sample: skip)")
        return rows

    def encode(
        self, encoder: PromptEncoder, items: list[tuple[dict, int]], problems: list[str] | None = None
    ) -> tuple[list[Prompt], int]:
        """Encode this rank's (row, stream index) pairs -> (prompts, prompts skipped on all
        ranks). A collective: every rank calls it, with however many items it has. `problems`:
        rows this rank already found bad (they count and stop or skip like the rest)."""
        prompts, _, failed = self._encode(encoder, items, problems)
        return prompts, int(failed.sum())

    def draw(self, encoder: PromptEncoder, sampler: PromptSampler, rows: list[dict]) -> tuple[list[Prompt], int]:
        """The sampler's next prompts for this rank, encoded: (prompts, prompts skipped on all
        ranks). A collective. Under `skip` a training row that fails to encode is dropped for
        the rest of the run: named and counted once, then left out of every later draw, on every
        rank (the failed rows are gathered, so all ranks hold the same set). The sampler is
        untouched: its stream stays the same with or without drops, so resuming is exact (a
        resumed run finds such a row again once, the first time it draws it)."""
        drawn = [(row, position) for position, row in sampler.next_indices() if row not in self.dropped_rows]
        prompts, failed_items, failed = self._encode(encoder, [(rows[row], position) for row, position in drawn])
        if failed.sum() > 0:  # every rank sees the same sum, so every rank joins the gather
            mine = torch.tensor([drawn[k][0] for k in failed_items], dtype=torch.long)
            self.dropped_rows.update(all_gather_1d(mine).tolist())
            if len(self.dropped_rows) == len(rows):
                raise DataError(f"every training row ({len(rows)}) failed to encode and was dropped; nothing to train on")
        return prompts, int(failed.sum())

    def _encode(
        self, encoder: PromptEncoder, items: list[tuple[dict, int]], problems: list[str] | None = None
    ) -> tuple[list[Prompt], list[int], torch.Tensor]:
        """(prompts, indices into `items` of those that failed, [world] failures per rank)."""
        prompts, problems, failed_items = [], list(problems or []), []
        for k, (row, index) in enumerate(items):
            try:
                prompts.append(encoder.encode(row, index))
            except DataError as err:
                problems.append(str(err))
                failed_items.append(k)
        failed = torch.zeros(self.world_size)
        failed[self.rank] = len(problems)
        failed = all_reduce_sum(failed)  # [world] bad prompts per rank
        if failed.sum() > 0 and not self.skip:
            if problems:
                raise DataError(problems[0])
            bad_rank = int(failed.nonzero()[0])
            raise DataError(f"rank {bad_rank} stopped on a bad prompt (data.on_bad_sample: error); its message names the row")
        for problem in problems:
            self._say(f"skipping {problem} (on_bad_sample: skip)")
        return prompts, failed_items, failed

    def encode_at_start(self, encoder: PromptEncoder, items: list[tuple[dict, int]]) -> list[Prompt]:
        """`encode` for prompts encoded once before training (evaluation, PTX): their skipped
        rows count in `data/skipped_rows`."""
        prompts, skipped = self.encode(encoder, items)
        self.skipped_rows += skipped
        return prompts

    def placeholder(self, encoder: PromptEncoder, rows: list[dict]) -> Experience:
        """This rank's placeholder: an empty-response experience (models/packing.empty_response)
        on the first row that encodes, so it has the data's modality. A rank whose prompts were
        all skipped runs it through the experience pass and the update, so it makes the same
        forwards, backwards and collectives as its peers. Found once, silently, without
        collectives."""
        if self._placeholder is None:
            for row in rows:
                try:
                    self._placeholder = empty_response(encoder.encode(row, -1))
                    break
                except DataError:
                    continue
            else:
                raise DataError("no training row can be encoded (every prompt is bad); nothing to train on")
        return self._placeholder
