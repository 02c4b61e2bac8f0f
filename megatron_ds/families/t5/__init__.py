"""The T5 (encoder-decoder) model family (pretrain_t5.py).

    t5_family.py     T5, the registered ModelFamily: builders, --mock-data samples, the collator
    t5_params.py     parameter count per stage, refused flags, the split rank, activation memory
    t5_model.py      the model: encoder, decoder with cross-attention, the split-rank pipeline
    t5_flops.py      model FLOPs of one iteration
    t5_hf.py         to and from Hugging Face (T5ForConditionalGeneration)
    span_loss.py     span-corruption loss evaluation (tools/evaluate_t5.py)
    t5_quickstart.py tools/quickstart.py --model t5 (the steps of ../masked_quickstart.py)

Its samples are Megatron's (``data/t5_dataset.py``, built by ``data/bert_t5_datasets.py``).
"""
