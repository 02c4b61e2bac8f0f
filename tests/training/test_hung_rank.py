"""A rank that never arrives at a collective ends the run within --distributed-timeout-minutes
(plus a short grace period), with one line naming the operation, the iteration and the rank."""
import re
import time
from pathlib import Path

from tests.launch.helpers import PYTHON, clean_env, run_bounded
from tests.training.cli import SMALL_GPT

# Fractional minutes keep the test short (the run waits out the timeout, then the grace period of
# a quarter of it, at least 3 s). Not much less: the start-up collectives are under the same timeout,
# and ranks on a busy 2-core machine do not reach them together -- measured 0.04 s apart on an idle
# 2-core machine and 0.15 s with four busy processes beside them, far inside 15 s.
TIMEOUT_MIN = 0.25


def test_hung_rank_is_named_within_the_timeout(tmp_path):
    # DP 2: every step all-reduces gradients, so rank 0 waits for the hung rank 1 at iteration 3.
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--shutdown-timeout", "2", Path(__file__).with_name("hang_rank.py"), *SMALL_GPT,
           "--train-iters", "10", "--distributed-timeout-minutes", str(TIMEOUT_MIN)]
    started = time.time()
    result = run_bounded(cmd, clean_env(HANG_RANK=1, HANG_AT=3), cwd=tmp_path, timeout=600)
    elapsed = time.time() - started
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-4000:]
    assert re.fullmatch(r"error: a collective in the training loop at iteration 3( \(gloo \w+\))? timed out after "
                        r"--distributed-timeout-minutes 0\.25; rank\(s\) 1 never arrived: look at their logs "
                        r"\(hung or dead\)", lines[0]), lines[0]
    assert " iteration        2/" in result.stdout and " iteration        3/" not in result.stdout
    # start-up (imports, engine) takes most of this on a busy machine; the bound only has to show the
    # run did not hang until some outer limit: timeout 15 s + grace 3.75 s + torchrun's shutdown.
    assert elapsed < 400, elapsed
