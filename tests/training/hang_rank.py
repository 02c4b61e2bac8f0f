"""pretrain_gpt.py in which rank $HANG_RANK stops responding at its $HANG_AT-th training step
(sleeps forever, as a rank stuck on a dead file system or a wedged device would)."""
import os
import signal
import sys
import time

from megatron_ds.training import loop
from megatron_ds.families import main

_original, _calls = loop.train_step, [0]


def _train_step(*args, **kwargs):
    _calls[0] += 1
    if _calls[0] == int(os.environ["HANG_AT"]) and os.environ.get("RANK") == os.environ["HANG_RANK"]:
        # Ended by torchrun's SIGTERM once the other rank has failed. With the trainer's handler kept, the
        # hung rank would note the signal and sleep on, and torch's torchrun (2.13) SIGKILLs a failed
        # group's workers only after 30 s, whatever --shutdown-timeout says: 28 s of waiting that shows
        # nothing about the rank that noticed the hang.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(1)
    return _original(*args, **kwargs)


loop.train_step = _train_step
sys.exit(main())
