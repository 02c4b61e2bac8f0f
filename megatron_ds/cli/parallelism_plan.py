"""tools/plan.py: the fastest parallel layout that fits, its predicted speed and an ABCI job script.

    python tools/plan.py --resource rt_F --nodes 8 --model-size 13B --seq-length 2048 \\
        --global-batch-size 1024 --fp16 --write-script gpt13b.sh

``--family bert|t5`` plans those models (their pretrain flags); everything else is
``training/plan_cli.py``'s (docs/planner.md).
"""
from __future__ import annotations

import sys

from megatron_ds.families import get_family
from megatron_ds.training.plan_cli import main as plan_main


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "gpt"
    if "--family" in argv:
        at = argv.index("--family")
        if at + 1 >= len(argv) or argv[at + 1] not in ("gpt", "bert", "t5"):
            print("plan.py: error: --family takes gpt, bert or t5", file=sys.stderr)
            return 2
        name = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    return plan_main(argv, family=get_family(name), prog="plan.py")
