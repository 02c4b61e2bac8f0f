"""pretrain_gpt.py in which rank $HANG_RANK stops responding at its $HANG_AT-th training step
(sleeps forever, as a rank stuck on a dead file system or a wedged device would)."""
import os
import sys
import time

from megatron_ds.training import loop
from megatron_ds.families import main

_original, _calls = loop.train_step, [0]


def _train_step(*args, **kwargs):
    _calls[0] += 1
    if _calls[0] == int(os.environ["HANG_AT"]) and os.environ.get("RANK") == os.environ["HANG_RANK"]:
        while True:
            time.sleep(1)
    return _original(*args, **kwargs)


loop.train_step = _train_step
sys.exit(main())
