"""Training a resolved ``Run``: the stack every model family shares (the families themselves, the
pipeline executors beyond DeepSpeed's own and the parallelism planner live in ``megatron_ds.families``,
``megatron_ds.pipeline`` and ``megatron_ds.planner``).

    entry point     pretrain.py           main(family): parse, resolve, --dry-run, pretrain(); the family (its
                                          builders, datasets, micro-batches, loss names) is the entry
                                          point's, from megatron_ds.families
                    meta_build.py         --dry-run: each pipeline stage built on the meta device
                    file_checks.py        --dry-run: data, --load and --save looked at before the queue
                    trainer.py            train(): start-up checks, build, resume, loop, final evaluation
    set-up          initialize.py         rank discovery, the process group
                    device.py             which device this rank trains on
                    startup_checks.py     --save usable, port clashes, the start-up barrier
                    engine.py             model + optimizer + LR schedule inside DeepSpeed's engine
                    optimizer.py          the fastest AdamW available, the fp32 NaN guard
    the loop        loop.py               Loop: train / evaluate, Megatron's iteration line
                    lr_schedule.py        Megatron's LR schedules (iteration- or sample/token-counted)
                    seqlen_warmup.py      the sequence-length warm-up cut applied to each micro-batch
                    data.py               datasets, resumable loaders, micro-batches
                    signals.py            stop signals (walltime, Ctrl-C) agreed over ranks
                    collective_timeout.py a hung collective named in one line
    reporting       log.py, wandb_log.py  Megatron's log lines, TensorBoard / W&B scalars
                    profiler.py           --profile: torch profiler traces of chosen steps and ranks
"""
