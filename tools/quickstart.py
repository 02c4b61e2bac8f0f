#!/usr/bin/env python
"""The whole pipeline on one machine, CPU is enough (`make quickstart` runs this).

    python tools/quickstart.py --help

The command line lives in megatron_ds/cli/quickstart.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.quickstart import main

if __name__ == "__main__":
    sys.exit(main())
