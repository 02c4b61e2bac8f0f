#!/usr/bin/env python
"""Concatenate indexed datasets (`.bin/.idx` pairs) into one, Megatron's merge_datasets.

    python tools/merge_datasets.py --help

The command line lives in megatron_ds/cli/merge_datasets.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.merge_datasets import main

if __name__ == "__main__":
    sys.exit(main())
