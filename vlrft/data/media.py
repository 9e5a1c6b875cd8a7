"""Where a data set's rows may name media files (docs/datasets.md, "Media paths").

A row is data, possibly from a stranger: an image path like `/home/me/.ssh/id_rsa.png`,
`../../secret` or a symlink planted in the data set must not make training read (and the
trajectory report publish) a file outside the data. So a media path must resolve, symlinks
followed, inside the directory holding the data set (a JSONL or parquet file, or a saved HF data
set's directory) or one of `data.media_roots`;
`data.allow_external_media: true` lifts the rule for data one trusts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class MediaPaths:
    roots: tuple[str, ...] = ()  # directories whose files rows may name (absolute paths)
    allow_external: bool = False

    def within(self, directory: Path) -> MediaPaths:
        """The rule for one data set: `directory` (the one holding it) allowed as well."""
        return replace(self, roots=(str(directory), *self.roots))

    def allows(self, path: Path) -> bool:
        """Whether `path` (absolute) resolves inside one of the roots."""
        if self.allow_external:
            return True
        real = Path(os.path.realpath(path))  # symlinks followed: a link out of the data is out
        return any(real.is_relative_to(os.path.realpath(root)) for root in self.roots)


def media_from(data_config) -> MediaPaths:
    """The rule the config's `data.media_roots` and `data.allow_external_media` set."""
    return MediaPaths(tuple(data_config.media_roots), data_config.allow_external_media)
