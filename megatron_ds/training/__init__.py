"""Training a resolved ``Run``.

    entry point     pretrain.py           main(): parse, resolve, --dry-run, pretrain()
                    family.py, bert.py    the model family an entry point trains (GPT, BERT): builders,
                                          datasets, micro-batches, reported loss names
                    meta_build.py         --dry-run: each pipeline stage built on the meta device
                    trainer.py            train(): start-up checks, build, resume, loop, final evaluation
    set-up          initialize.py         rank discovery, the process group
                    device.py             which device this rank trains on
                    startup_checks.py     --save usable, port clashes, the start-up barrier
                    engine.py             model + optimizer + LR schedule inside DeepSpeed's engine
                    optimizer.py          the fastest AdamW available, the fp32 NaN guard
    the loop        loop.py               Loop: train / evaluate, Megatron's iteration line
                    lr_schedule.py        Megatron's LR schedules (iteration- or sample/token-counted)
                    data.py               datasets, resumable loaders, micro-batches
                    signals.py            walltime signals agreed over ranks
                    collective_timeout.py a hung collective named in one line
                    log.py, flops.py, wandb_log.py  the log lines, model FLOPs, TensorBoard / W&B
"""
