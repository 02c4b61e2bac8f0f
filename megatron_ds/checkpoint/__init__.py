"""Checkpoints: the on-disk format, saving and loading a live engine, and checkpoints beyond the run
that wrote them (full weights, another layout, DeepSpeed universal, Hugging Face).

    format          format.py         names, trackers, the saved config and its signature
                    integrity.py      a manifest per checkpoint, verified on load, fallback and pruning
                    lock.py           one writer per --save directory
    live engine     checkpointing.py  saving and loading a DeepSpeed engine plus this toolkit's files
                    async_save.py     --async-save: the same save, its files written in the background
                    snapshot.py       the copy of a save's state the background writer writes
                    background.py     the writer processes (one per save, or one per run)
    reading         files.py          a checkpoint's files, whatever layout wrote it
                    tp.py             how each parameter splits over tensor parallel ranks
                    plain_optim.py    ZeRO-0 optimizer state by parameter name
                    zero3.py          ZeRO-3 checkpoints, parameter by parameter
                    expert_files.py   DeepSpeed's expert files and expert numbering across EP sizes
                    moe_sources.py    reading a checkpoint written by an engine with MoE layers
                    optim_state.py    optimizer state by parameter name, whatever wrote it
    full weights    consolidate.py    any checkpoint -> unsharded fp32 weights (``load_consolidated``)
                    sources.py        where those weights come from, layer by layer
    other layouts   reshard.py        resume at another TP / PP / DP / ZeRO stage / precision
                    engine_state.py   writing resharded weights and optimizer state into a live engine
                    universal.py      DeepSpeed universal checkpoints (--universal-checkpoint)
                    megatron_names.py parameter names of ours and Megatron-DeepSpeed's universal files
    Hugging Face    hf_files.py       safetensors read and written in shards, the fused QKV split and fused;
                                      each family maps its own names (families/<name>/*_hf*.py)

``load_consolidated`` and friends are re-exported lazily (PEP 562): importing the format modules
must not import DeepSpeed and the model.
"""
from __future__ import annotations

_EXPORTS = ("Consolidated", "iter_consolidated_layers", "load_consolidated")
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from megatron_ds.checkpoint import consolidate  # noqa: PLC0415 - imports DeepSpeed and the model

    return getattr(consolidate, name)
