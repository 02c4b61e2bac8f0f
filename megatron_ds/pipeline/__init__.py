"""The pipeline schedules of Megatron-LM and the executor that runs them on DeepSpeed's plain engine.

    plan.py      the interleaved 1F1B and ZB-H1 schedules as pure step lists, their checks and
                 --dry-run's description (no process, no model)
    p2p.py       tagged point-to-point messages between pipeline ranks, the tied-embedding group
    chunks.py    this pipeline rank's model chunks for the interleaved schedule
    executor.py  InterleavedPipeline: walks a rank's step list inside DeepSpeed's plain engine

Deliberately imports nothing: ``config`` checks and describes a schedule through ``plan.py``
without loading the model code that ``chunks.py`` and ``executor.py`` need.
"""
