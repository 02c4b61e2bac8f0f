#!/usr/bin/env python
"""Print what training start-up would use in this environment, without starting anything.

    python tools/check_env.py --help

The command line lives in megatron_ds/cli/check_env.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.check_env import main

if __name__ == "__main__":
    sys.exit(main())
