#!/usr/bin/env python
"""Export a megatron_ds checkpoint to a Hugging Face transformers directory.

    python tools/checkpoint/to_hf.py --help

The command line lives in megatron_ds/cli/to_hf.py (this script only calls it), so the package
must be installed with its "hf" extra (transformers): `pip install -e '.[hf]'`.
"""
import sys

from megatron_ds.cli.to_hf import main

if __name__ == "__main__":
    sys.exit(main())
