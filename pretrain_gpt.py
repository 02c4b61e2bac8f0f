#!/usr/bin/env python
"""Pretrain a GPT model: Megatron-DeepSpeed's flags, DeepSpeed's engine.

    deepspeed --num_gpus 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... --deepspeed_config ds.json
    torchrun --nproc_per_node 8 pretrain_gpt.py ...
    mpirun -np 16 ... python pretrain_gpt.py ... --use-mpi
    python pretrain_gpt.py --dry-run --world-size 64 ...     # validate without starting anything
"""
import sys

from megatron_ds.families import get_family
from megatron_ds.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main(family=get_family("gpt")))
