#!/usr/bin/env python
"""Generate text with a trained GPT (Megatron's tools/generate_samples_gpt.py, reworked).

    python tools/generate_samples_gpt.py --help

The command line lives in megatron_ds/cli/generate_samples_gpt.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.generate_samples_gpt import main

if __name__ == "__main__":
    sys.exit(main())
