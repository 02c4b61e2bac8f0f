"""Training a resolved ``Run``.

    entry point     pretrain.py           main(family): parse, resolve, --dry-run, pretrain(); the family (its
                                          builders, datasets, micro-batches, loss names) is the entry
                                          point's, from megatron_ds.families
                    meta_build.py         --dry-run: each pipeline stage built on the meta device
                    trainer.py            train(): start-up checks, build, resume, loop, final evaluation
    set-up          initialize.py         rank discovery, the process group
                    device.py             which device this rank trains on
                    startup_checks.py     --save usable, port clashes, the start-up barrier
                    engine.py             model + optimizer + LR schedule inside DeepSpeed's engine
                    optimizer.py          the fastest AdamW available, the fp32 NaN guard
                    interleaved_pipeline.py  the interleaved 1F1B and ZB-H1 executor on the plain engine
    the loop        loop.py               Loop: train / evaluate, Megatron's iteration line
                    lr_schedule.py        Megatron's LR schedules (iteration- or sample/token-counted)
                    data.py               datasets, resumable loaders, micro-batches
                    signals.py            walltime signals agreed over ranks
                    collective_timeout.py a hung collective named in one line
                    log.py, flops.py, wandb_log.py  the log lines, model FLOPs, TensorBoard / W&B
"""
