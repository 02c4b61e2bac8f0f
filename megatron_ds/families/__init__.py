"""Model families, the top floor but the command lines': one package per family (``gpt/``, ``bert/``,
``t5/``), each holding its model, its flags' checks and parameter and memory terms, its datasets' wiring
and micro-batches, its Hugging Face mapping, its evaluation, its FLOPs, its quickstart and the
``ModelFamily`` (``config/family.py``) that carries them to the floors below. ``registry.py``
registers each once; the entry points and tools look them up by name (``get_family("bert")``).
``quickstart_steps.py`` and ``masked_quickstart.py`` hold the quickstart steps the families share.
"""
from megatron_ds.families.registry import (FAMILIES, checkpoint_family, get_family, hf_dir_family, hf_family, main,
                                          pretrain, weights_family)

__all__ = ["FAMILIES", "checkpoint_family", "get_family", "hf_dir_family", "hf_family", "main", "pretrain",
           "weights_family"]
