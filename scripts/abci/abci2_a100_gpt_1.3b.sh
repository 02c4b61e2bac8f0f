#!/bin/bash
#$ -l rt_AF=1
#$ -l h_rt=24:00:00
#$ -j y
#$ -cwd
# Ending well: SIGTERM, SIGUSR1 or SIGUSR2 make every rank finish its iteration, save a complete
# checkpoint and exit 0 (a second signal stops at once). Grid Engine sends SIGUSR1 when a soft limit
# passes and SIGKILL `notify` seconds later (a queue setting, 60 s by default): `qsub -l s_rt=23:40:00`
# (under h_rt, where the site allows s_rt) asks for that signal ahead of the walltime; `qsub -notify`
# adds SIGUSR2 before qdel's SIGKILL. EXIT_DURATION_IN_MINS below stops on time without any signal.
#
# GPT 1.3B on one ABCI 2.0 A100 node (8 x A100 40 GB): bf16, ZeRO-1, data parallel 8,
# activation checkpointing (micro batch 4 at sequence 2048 would not fit 40 GB without it).
# Per GPU, DRY_RUN's estimate (python scripts/abci/abci_numbers.py writes these lines):
#   stage 0: weights + gradients + optimizer states 12.50 GB, activations 1.44 GB;
#   total 16.81 of 40 GB. One checkpoint (weights and optimizer states): ~18 GB
#
# Submit from the repository root (ABCI 2.0 takes the group only on the command line):
#   qsub -g GROUP scripts/abci/abci2_a100_gpt_1.3b.sh
#   qsub -g GROUP -l rt_AF=2 scripts/abci/abci2_a100_gpt_1.3b.sh     # 2 nodes, DP 16
# Interactive debugging on a node:
#   qrsh -g GROUP -l rt_AF=1 -l h_rt=1:00:00
#   cd <repo> && bash scripts/abci/interactive.sh scripts/abci/abci2_a100_gpt_1.3b.sh --train-iters 20
# Check the configuration without GPUs (e.g. on the login node):
#   DRY_RUN=1 bash scripts/abci/abci2_a100_gpt_1.3b.sh
# Arguments after the script name are appended to the pretrain flags (the last value wins).
# Resubmitting the same script resumes from the latest checkpoint in CHECKPOINT_DIR.
set -euo pipefail

# Schedulers run a spooled copy of this file, so find the repository from the submit directory.
for MEGATRON_DS_ROOT in "${MEGATRON_DS_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." \
    2>/dev/null && pwd)" "$PWD"; do
  [ -n "$MEGATRON_DS_ROOT" ] && [ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] && break
done
[ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] || { echo "ERROR: megatron_ds repository not" \
  "found: qsub from its root or set MEGATRON_DS_ROOT" >&2; exit 1; }
source "$MEGATRON_DS_ROOT/scripts/abci/common.sh"

# ---- Configuration: every variable can be overridden from the environment -----------------
RESOURCE_TYPE=${RESOURCE_TYPE:-rt_AF}  # GPU memory for DRY_RUN's memory check
ABCI_SYSTEM=${ABCI_SYSTEM:-2}  # ABCI 2.0: its module names also outside a job (a login node's DRY_RUN)
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RUN_NAME=${RUN_NAME:-gpt_1.3b}

TP=${TP:-1}
PP=${PP:-1}
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-2048}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TRAIN_ITERS=${TRAIN_ITERS:-300000}
LR=${LR:-2.0e-4}
MIN_LR=${MIN_LR:-2.0e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
# Stop and save 15 minutes before h_rt (24:00:00) so the job is never killed mid-write.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1425}
# Data, tokenizer and output paths, ZERO_STAGE and DS_CONFIG: the shared defaults in common.sh.
set_job_defaults bf16

# ---- Launch ---------------------------------------------------------------------------------
prepare_training  # checks the inputs, sets up the job and GPT_ARGS (common.sh)
ARGS=(
  "${GPT_ARGS[@]}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --bf16 --checkpoint-activations
)
launch_training "${ARGS[@]}" "$@"
