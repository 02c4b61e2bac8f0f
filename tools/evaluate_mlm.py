#!/usr/bin/env python
"""Evaluate a BERT checkpoint on held-out data: masked-LM and sentence-order accuracy.

    python tools/evaluate_mlm.py --help

The command line lives in megatron_ds/cli/evaluate_mlm.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.evaluate_mlm import main

if __name__ == "__main__":
    sys.exit(main())
