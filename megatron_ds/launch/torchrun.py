"""torchrun, ending on a signal in one line: ``python -m megatron_ds.launch.torchrun`` takes torchrun's
arguments and runs torchrun itself (``torch.distributed.run.main``), unchanged.

What differs is the end after a signal. torchrun turns SIGINT (Ctrl-C), SIGTERM, SIGHUP and SIGQUIT into
a ``SignalException``, forwards the signal to its workers' process groups, waits for them up to
``--shutdown-timeout`` (then SIGKILL), and re-raises it: a 25-line traceback and exit status 1 after
workers that finished their iteration, saved and ended in one line each. Here the same shutdown ends
with one line and 128 + the signal number (130 after Ctrl-C), as the workers do. A worker that fails
is still torchrun's own report (its ChildFailedError, naming the rank and its exit status).
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    # torch's launcher is imported here: ``megatron_ds.launch`` is imported by every worker
    from torch.distributed.elastic.multiprocessing import SignalException  # noqa: PLC0415
    from torch.distributed.run import main as torchrun  # noqa: PLC0415

    try:
        torchrun(argv)
    except SignalException as exc:
        print(f"torchrun: stopped by {exc.sigval.name}; its workers were sent it and have ended",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
