"""The parallelism planner: which (TP, PP, DP, ZeRO, recompute, ...) layouts of a run fit the GPUs, and
how fast each would train (docs/planner.md). It reads the flags and their resolution (``config``),
the pipeline schedules (``parallel.schedules``) and a model family's FLOPs, nothing that trains.

    flops.py        model FLOPs of the transformer's pieces (the iteration line's TFLOP/s uses them too,
                    through each family's count)
    time_model.py   the predicted step time of one resolved layout on a cluster
    search.py       the layouts the memory estimate fits, ranked by predicted step time
    evaluate.py     one given layout's predicted step, term by term, with its expected error (tools/plan.py --layout)
    plan_cli.py     tools/plan.py and --dry-run --plan
    job_script.py   the ABCI job script of a chosen layout
"""
