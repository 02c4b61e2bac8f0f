#!/usr/bin/env python
"""Single-GPU model FLOP utilisation against Hugging Face + torch.compile (megatron_ds/cli/gpu_mfu.py;
``--help`` says how to run it)."""
import sys

from megatron_ds.cli.gpu_mfu import main

if __name__ == "__main__":
    sys.exit(main())
