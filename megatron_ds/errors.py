"""The error types a user sees as one line (``error: <message>``), never as a traceback.

The bottom floor: it imports nothing from the project, so every floor can raise them. ``main()`` of
``pretrain_gpt.py`` prints these messages as they are and exits 1; anything else is a bug and keeps
its traceback.

Exit status, the same for pretrain_gpt.py and every CLI in tools/ (tests/cli/test_exit_codes.py):
2 when the command line is refused as such -- argparse's status: an unknown flag, required flags
missing (all named at once), a malformed value or one no run can use (``--temperature -1``); 1 when it
parsed but the work cannot be done (these errors: a combination the run refuses, a missing or
damaged file, data, a checkpoint, a failure while running); 130 when Ctrl-C (SIGINT) ended it, as a
shell reports such a command; 0 otherwise.
"""
import difflib


class ConfigError(ValueError):
    """A configuration problem: bad flags, a bad combination, a file the run needs but cannot use.
    The message names the values involved and what to change."""


class DataError(RuntimeError):
    """Bad training data (a path, a split, a blend, token ids outside the vocabulary)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the training loop the way a walltime signal does -- after the iteration,
    with the save --save asks for -- and the run now ends as Ctrl-C ends a command: exit status 130.
    A KeyboardInterrupt, so that what catches one (``pretrain.main``) treats both alike."""


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many NaN losses in a row, a rank that never arrived); the message
    says why."""


def closest(name: str, known, normalize=lambda s: s) -> str | None:
    """The entry of ``known`` closest to a misspelt ``name`` (difflib's ratio of at least 0.6), for an
    error line's "did you mean ...?"; None when nothing is close. ``normalize`` is applied to both
    sides before comparing (e.g. underscores as hyphens); the entry is returned as ``known`` spells it
    (the first one of those normalizing alike)."""
    spelled: dict[str, str] = {}
    for entry in known:
        spelled.setdefault(normalize(entry), entry)
    close = difflib.get_close_matches(normalize(name), list(spelled), n=1, cutoff=0.6)
    return spelled[close[0]] if close else None
