"""tools/plan.py: the fastest parallel layout that fits, its predicted speed and an ABCI job script.

    python tools/plan.py --resource rt_F --nodes 8 --model-size 13B --seq-length 2048 \\
        --global-batch-size 1024 --fp16 --write-script gpt13b.sh

``--family NAME`` plans another registered family's models (``bert``, ``t5``: their pretrain flags;
default the first registered, the GPT); everything else is ``planner/plan_cli.py``'s (docs/planner.md).
"""
from __future__ import annotations

import sys

from megatron_ds.families import FAMILIES
from megatron_ds.planner.plan_cli import main as plan_main


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plannable = [name for name, family in FAMILIES.items() if family.plannable]
    name = plannable[0]
    if "--family" in argv:
        at = argv.index("--family")
        if at + 1 >= len(argv) or argv[at + 1] not in plannable:
            print(f"plan.py: error: --family takes {', '.join(plannable)}", file=sys.stderr)
            return 2
        name = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    return plan_main(argv, family=FAMILIES[name], prog="plan.py")
