#!/usr/bin/env python
"""Import a local Hugging Face transformers model directory as a megatron_ds checkpoint.

    python tools/checkpoint/from_hf.py --help

The command line lives in megatron_ds/cli/from_hf.py (this script only calls it), so the package
must be installed with its "hf" extra (transformers): `pip install -e '.[hf]'`.
"""
import sys

from megatron_ds.cli.from_hf import main

if __name__ == "__main__":
    sys.exit(main())
