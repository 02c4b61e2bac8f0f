"""The BERT model family (pretrain_bert.py).

    bert_family.py   BERT, the registered ModelFamily: builders, --mock-data samples, the collator
    bert_params.py   parameter count per stage, refused flags, the MLM head's activation memory
    bert_model.py    the model: embedding with token types, MLM and sentence-order heads, loss
    bert_flops.py    model FLOPs of one iteration
    bert_hf.py       to and from Hugging Face (MegatronBertForPreTraining / BertForPreTraining)
    masked_lm.py     masked-LM evaluation (tools/evaluate_mlm.py)
    bert_quickstart.py  tools/quickstart.py --model bert (the steps of ../masked_quickstart.py)
    bert_tasks.py    fine-tuning task models (MNLI, QQP, RACE); bert_pretrained.py fills them

Its samples are Megatron's (``data/bert_dataset.py``, built by ``data/bert_t5_datasets.py``).
"""
