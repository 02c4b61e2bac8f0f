"""Model families, the top floor: one package per family (``gpt/``, ``bert/``, ``t5/``), each holding
its model, its flags' checks and parameter and memory terms, its datasets' wiring and micro-batches,
its Hugging Face mapping, its evaluation, its FLOPs and the ``ModelFamily`` (``config/family.py``)
that carries them to the floors below. ``registry.py`` registers each once; the entry points and
tools look them up by name (``get_family("bert")``).
"""
from megatron_ds.families.registry import FAMILIES, HF_EXPORTS, checkpoint_family, get_family, main, pretrain

__all__ = ["FAMILIES", "HF_EXPORTS", "checkpoint_family", "get_family", "main", "pretrain"]
