#!/usr/bin/env python
"""Fine-tune a BERT checkpoint on GLUE MNLI / QQP or RACE, as Megatron-LM's tasks/main.py.

    python tasks/main.py --task MNLI --train-data MNLI/train.tsv --valid-data MNLI/dev_matched.tsv \
        --pretrained-checkpoint bert_ckpt --epochs 3 --vocab-file bert-vocab.txt ...
    python tasks/main.py --help

The command line lives in megatron_ds/cli/tasks.py (this script only calls it), so the package
must be installed: `pip install -e .` (`make install`).
"""
import sys

from megatron_ds.cli.tasks import main

if __name__ == "__main__":
    sys.exit(main())
