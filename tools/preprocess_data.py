#!/usr/bin/env python
"""Tokenize JSONL into Megatron's indexed dataset (`{prefix}_{key}_document.bin/.idx`).

    python tools/preprocess_data.py --help

The command line lives in megatron_ds/cli/preprocess_data.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
