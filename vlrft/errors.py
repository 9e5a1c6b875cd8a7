"""The errors vlrft raises for a user's mistake or a broken input (a config key, a data row, a
reward recipe, a launch, a report directory). The CLI prints their one-line message and exits
with status 2, without a traceback; any other exception is a bug and keeps its traceback.

This module imports nothing of vlrft, so every other module may import it."""


class VlrftError(Exception):
    """Base of the user-facing errors; the message is one line naming the culprit."""


class ConfigError(VlrftError, ValueError):
    """A configuration problem: an unknown or invalid key, a missing file it names."""
