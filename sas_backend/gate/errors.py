"""The one exception type of gate-checkpoint handling."""

from __future__ import annotations


class GateCheckpointError(ValueError):
    """A gate checkpoint is missing, unreadable, malformed, or does not fit the served model.

    The message always names the file (or directory) and what is wrong with it.
    """
