"""Running Megatron-LM's pipeline schedules on DeepSpeed's plain engine (the schedules themselves,
as pure step lists, are ``megatron_ds.parallel.schedules``, below ``config``, which checks and
describes them without any model code).

    p2p.py       tagged point-to-point messages between pipeline ranks, the tied-embedding group
    chunks.py    this pipeline rank's model chunks for the interleaved schedule
    executor.py  InterleavedPipeline: walks a rank's step list inside DeepSpeed's plain engine
"""
