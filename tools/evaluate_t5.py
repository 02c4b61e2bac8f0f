#!/usr/bin/env python
"""Evaluate a T5 checkpoint on held-out data: span-prediction loss and token accuracy.

    python tools/evaluate_t5.py --help

The command line lives in megatron_ds/cli/evaluate_t5.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.evaluate_t5 import main

if __name__ == "__main__":
    sys.exit(main())
