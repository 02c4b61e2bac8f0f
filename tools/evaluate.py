#!/usr/bin/env python
"""Evaluate a trained GPT: sliding-window perplexity and LAMBADA-style last-word accuracy.

    python tools/evaluate.py --help

The command line lives in megatron_ds/cli/evaluate.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
