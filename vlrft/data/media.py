"""Where a data set's rows may name media files, and the one way they are opened
(docs/datasets.md, "Media paths").

A row is data, possibly from a stranger: an image path like `/home/me/.ssh/id_rsa.png`,
`../../secret` or a symlink planted in the data set must not make training read (and the
trajectory report publish) a file outside the data. So a media path must resolve, symlinks
followed, inside the directory holding the data set (a JSONL or parquet file, or a saved HF data
set's directory) or one of `data.media_roots`; `data.allow_external_media: true` lifts the rule
for data one trusts.

That check happens once, at load, on the name. A file swapped for a symlink afterwards (the run
takes hours; the data may be on a shared disk) must not be read through it, so the loader keeps
the resolved path with its root (`MediaFile`) and every later reader opens it with `open_media`:
the resolved path, beneath that root, with no symlink on the way (data/beneath.py).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, replace
from pathlib import Path

from vlrft.data.beneath import open_beneath

SHOWN_PATH_CHARS = 200  # a path in a message is cut to this many characters


class MediaFile(str):
    """A media path as the loader resolved it (symlinks followed, checked to lie in `root`).
    It is a str, so rows stay plain data (JSON, recipes, messages); `open_media` reads it."""

    root: str  # the allowed directory it lies in, resolved; "/" with data.allow_external_media

    def __new__(cls, resolved: str, root: str) -> MediaFile:
        path = super().__new__(cls, resolved)
        path.root = root
        return path

    def __reduce__(self):
        return MediaFile, (str(self), self.root)


@dataclass(frozen=True)
class MediaPaths:
    roots: tuple[str, ...] = ()  # directories whose files rows may name (absolute paths)
    allow_external: bool = False

    def within(self, directory: Path) -> MediaPaths:
        """The rule for one data set: `directory` (the one holding it) allowed as well."""
        return replace(self, roots=(str(directory), *self.roots))

    def resolve(self, path: Path) -> MediaFile | None:
        """`path` (absolute) resolved, symlinks followed, with the root it lies in; None when it
        lies in none. Raises OSError or ValueError for a path the system cannot take (a NUL
        byte, a name too long)."""
        real = os.path.realpath(path)  # symlinks followed: a link out of the data is out
        if self.allow_external:
            return MediaFile(real, "/")
        for root in self.roots:
            real_root = os.path.realpath(root)
            if Path(real).is_relative_to(real_root):
                return MediaFile(real, real_root)
        return None


def media_from(data_config) -> MediaPaths:
    """The rule the config's `data.media_roots` and `data.allow_external_media` set."""
    return MediaPaths(tuple(data_config.media_roots), data_config.allow_external_media)


def open_media(path: str):
    """A binary file object of a media file. A `MediaFile` opens the path resolved at load,
    beneath its root, refusing any symlink on the way: a link swapped in since the check fails
    with OSError instead of being followed. A plain path (given by Python code, not read from a
    data set) is resolved now and opened the same way beneath "/"."""
    if isinstance(path, MediaFile):
        resolved, root = str(path), path.root
    else:
        resolved, root = os.path.realpath(path), "/"
    try:
        fd = open_beneath(root, os.path.relpath(resolved, root))
    except OSError as err:
        reason = {errno.ELOOP: "a symbolic link is on its path now; media files are read without following links",
                  errno.EXDEV: f"it is not beneath {root}"}.get(err.errno)
        if reason is None:
            raise
        raise OSError(err.errno, reason) from None
    return os.fdopen(fd, "rb")


def shown(path) -> str:
    """`path` for a one-line message: as it is when printable and short, else escaped and cut."""
    text = os.fspath(path)
    if text.isprintable() and len(text) <= SHOWN_PATH_CHARS:
        return text
    escaped = repr(text)
    if len(escaped) <= SHOWN_PATH_CHARS:
        return escaped
    return f"{escaped[:SHOWN_PATH_CHARS]}... ({len(text)} characters)"
