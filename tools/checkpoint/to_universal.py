#!/usr/bin/env python
"""Convert a megatron_ds checkpoint to a DeepSpeed universal checkpoint.

    python tools/checkpoint/to_universal.py --help

The command line lives in megatron_ds/cli/to_universal.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.to_universal import main

if __name__ == "__main__":
    sys.exit(main())
