"""The error types a user sees as one line (``error: <message>``), never as a traceback.

The bottom floor: it imports nothing from the project, so every floor can raise them. ``main()`` of
``pretrain_gpt.py`` prints these messages as they are and exits 1; anything else is a bug and keeps
its traceback.
"""


class ConfigError(ValueError):
    """A configuration problem: bad flags, a bad combination, a file the run needs but cannot use.
    The message names the values involved and what to change."""


class DataError(RuntimeError):
    """Bad training data (a path, a split, a blend, token ids outside the vocabulary)."""


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many NaN losses in a row, a rank that never arrived); the message
    says why."""
