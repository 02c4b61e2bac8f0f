#!/usr/bin/env python
"""Run lm-evaluation-harness on a checkpoint (any TP / PP) directly, local task files included.

    python tools/eval_harness.py --help

(Not tools/lm_eval.py: Python puts a script's folder first on the module path, where a file named
lm_eval.py would be imported in place of the lm_eval package.)

The command line lives in megatron_ds/cli/eval_harness.py (this script only calls it), so the
package must be installed with its "eval" extra: `pip install -e '.[eval]'` (`make test` installs it too).
"""
import sys

from megatron_ds.cli.eval_harness import main

if __name__ == "__main__":
    sys.exit(main())
