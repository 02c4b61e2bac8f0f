#!/usr/bin/env python
"""The fastest parallel layout that fits a model on a cluster, its predicted speed, and an ABCI job script.

    python tools/plan.py --resource rt_F --nodes 8 --model-size 13B --seq-length 2048 --global-batch-size 1024 --fp16

The command line lives in megatron_ds/cli/plan.py (this script only calls it), so the
package must be installed: `pip install -e .` (`make install`). docs/planner.md explains the output.
"""
import sys

from megatron_ds.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
