#!/usr/bin/env python
"""Pretrain a T5 (encoder-decoder) model: Megatron-DeepSpeed's pretrain_t5.py flags, DeepSpeed's engine.

    deepspeed --num_gpus 8 pretrain_t5.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \
        --pipeline-model-parallel-split-rank 2 --encoder-num-layers 12 --decoder-num-layers 12 \
        --encoder-seq-length 512 --decoder-seq-length 128 --data-path my-t5_text_sentence \
        --vocab-file bert-vocab.txt --vocab-extra-ids 100 ... --deepspeed_config ds.json
    torchrun --nproc_per_node 8 pretrain_t5.py ...
    mpirun -np 16 ... python pretrain_t5.py ... --use-mpi
    python pretrain_t5.py --dry-run --world-size 64 ...     # validate without starting anything

--tokenizer-type defaults to BertWordPieceLowerCase (as upstream). With pipeline parallelism,
stages before --pipeline-model-parallel-split-rank hold the encoder and the others the decoder; the
encoder's output travels with the decoder's activations to every decoder stage.
"""
import sys

from megatron_ds.families import get_family
from megatron_ds.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main(family=get_family("t5")))
