#!/usr/bin/env python
"""The T5 quickstart: the same as `python tools/quickstart.py --model t5`.

    python tools/quickstart_t5.py --help

The command line lives in megatron_ds/cli/quickstart.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.quickstart import main

if __name__ == "__main__":
    sys.exit(main(["--model", "t5", *sys.argv[1:]]))
