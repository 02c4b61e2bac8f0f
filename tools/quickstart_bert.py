#!/usr/bin/env python
"""The BERT quickstart: the same as `python tools/quickstart.py --model bert`.

    python tools/quickstart_bert.py --help

The command line lives in megatron_ds/cli/quickstart.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.quickstart import main

if __name__ == "__main__":
    sys.exit(main(["--model", "bert", *sys.argv[1:]]))
