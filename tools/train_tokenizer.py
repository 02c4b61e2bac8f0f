#!/usr/bin/env python
"""Train a tokenizer on your own JSONL corpus, offline.

    python tools/train_tokenizer.py --help

The command line lives in megatron_ds/cli/train_tokenizer.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
