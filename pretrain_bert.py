#!/usr/bin/env python
"""Pretrain a BERT model: Megatron-DeepSpeed's pretrain_bert.py flags, DeepSpeed's engine.

    deepspeed --num_gpus 8 pretrain_bert.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --data-path my-bert_text_sentence --vocab-file bert-vocab.txt ... --deepspeed_config ds.json
    torchrun --nproc_per_node 8 pretrain_bert.py ...
    mpirun -np 16 ... python pretrain_bert.py ... --use-mpi
    python pretrain_bert.py --dry-run --world-size 64 ...     # validate without starting anything

--tokenizer-type defaults to BertWordPieceLowerCase (as upstream); --bert-no-binary-head drops the
sentence-order head. The iteration line prints the masked-LM loss as ``lm loss`` and the
sentence-order loss as ``sop loss``.
"""
import sys

from megatron_ds.families import get_family
from megatron_ds.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main(family=get_family("bert")))
