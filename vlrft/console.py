"""Messages for the user that may come while rank 0's progress bar is drawn."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def say(message: str, stream: TextIO | None = None) -> None:
    """Print `message` to `stream` (stdout by default) on a line of its own. `print` would append it
    to the bar's unfinished line (where a log reader, or a grep for the line, misses it); tqdm
    clears an open bar first and draws it again after. Without tqdm's lock: the rank watch calls
    this from its own thread and must print even when the main thread is stuck holding it."""
    stream = stream or sys.stdout
    tqdm.write(message, file=stream, nolock=True)
    stream.flush()
