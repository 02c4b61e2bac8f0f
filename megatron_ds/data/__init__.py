"""Data pipeline: tokenizers, Megatron's indexed dataset, GPT/BERT/T5 samples, blending, samplers,
batches, and the index cache that one process builds while the others wait.

Names are re-exported lazily (PEP 562): `tools/preprocess_data.py` and its worker processes use
the tokenizer and the indexed dataset builder without paying for importing torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "indexed_dataset": (
        "DTYPES", "IndexedDatasetError", "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "best_fitting_dtype",
        "data_file_path", "dataset_exists", "index_file_path",
    ),
    "tokenizer": ("MockTokenizer", "TokenizerError", "build_tokenizer", "build_tokenizer_for"),
    "helpers": ("build_blending_indices", "build_mapping", "build_sample_idx"),
    "wordpiece": ("BertWordPieceTokenizer",),
    "masking": ("create_masked_lm_predictions",),
    "samples_mapping": ("get_samples_mapping",),
    "bert_dataset": ("BertDataset",),
    "t5_dataset": ("T5Dataset",),
    "bert_t5_datasets": ("DSET_TYPE_BERT", "DSET_TYPE_T5"),
    "index_cache": ("CacheTimings", "cache_dirs", "description_hash", "load_or_build"),
    "gpt_dataset": (
        "GPTDataset", "build_index_mappings", "build_train_valid_test_datasets", "check_train_valid_test_data",
        "num_epochs_needed", "parse_split", "split_document_ranges",
    ),
    "blendable_dataset": ("BlendableDataset", "blended_num_samples", "parse_data_path"),
    "samplers": ("CyclicSampler", "PretrainingSampler"),
    "batch": ("GPTBatch", "get_ltor_masks_and_position_ids", "gpt_batch_from_samples"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
