"""A peer's death as this rank's own calls see it: a lost gloo connection, or the job's store gone.

A rank that is killed (SIGKILL, the out-of-memory killer, a lost machine) closes its sockets. A
peer inside a gloo collective, send or receive with it then raises at once ("Connection closed
by peer"), and one that calls the job's key-value store that it hosted raises DistNetworkError.
Neither says whose connection it was: the rank watch (vlrft/rank_watch.py) finds which peer went
silent, and the rank stops with one line naming it instead of the library's traceback.
"""

from __future__ import annotations

import re

# gloo's transport errors for a connection that the other end closed, after gloo's source
# location ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41234.
# This is typically caused by a remote worker crashing. ...").
GLOO_LOST = re.compile(r"\[[^\]\n]*gloo/transport[^\]\n]*\]\s*((?:Connection closed by peer|Connection reset by peer"
                       r"|Read error|Write error|Socket closed|Socket unexpectedly closed)[^\n]*)")


def first_sentence(text: str) -> str:
    return text.split(". ", 1)[0].strip().rstrip(".")


def lost_connection(err: BaseException) -> str | None:
    """What `err` says of a lost connection to a peer (gloo) or to the job's store, in a few
    words; None when it is no such error."""
    from vlrft.distributed import lost_store

    if lost_store(err):  # (a RuntimeError: checked first)
        return f"the job's store: {first_sentence(str(err))}"
    if not isinstance(err, RuntimeError):
        return None
    match = GLOO_LOST.search(str(err))
    return f"gloo: {first_sentence(match[1])}" if match else None
