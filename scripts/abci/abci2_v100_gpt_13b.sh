#!/bin/bash
#$ -l rt_F=8
#$ -l h_rt=24:00:00
#$ -j y
#$ -cwd
# Ending well: SIGTERM, SIGUSR1 or SIGUSR2 make every rank finish its iteration, save a complete
# checkpoint and exit 0 (a second signal stops at once). Grid Engine sends SIGUSR1 when a soft limit
# passes and SIGKILL `notify` seconds later (a queue setting, 60 s by default): `qsub -l s_rt=23:40:00`
# (under h_rt, where the site allows s_rt) asks for that signal ahead of the walltime; `qsub -notify`
# adds SIGUSR2 before qdel's SIGKILL. EXIT_DURATION_IN_MINS below stops on time without any signal.
#
# GPT 13B on 8 ABCI 2.0 V100 nodes (32 x V100 16 GB): TP 4 (inside a node), PP 8, micro batch 1,
# activation checkpointing, fp16, ZeRO-1. This is the layout that fits 13B into 16 GB GPUs:
# 13e9 / 32 GPUs ~ 0.4e9 parameters each, and recomputed activations. More nodes add data
# parallelism (DP = nodes * 4 / 32).
# Per GPU, DRY_RUN's estimate (python scripts/abci/abci_numbers.py writes these lines):
#   stage 0: weights + gradients + optimizer states 9.38 GB, activations 1.20 GB;
#   total 12.33 of 16 GB. One checkpoint (weights and optimizer states): ~180 GB
#
# Submit from the repository root (ABCI 2.0 takes the group only on the command line):
#   qsub -g GROUP scripts/abci/abci2_v100_gpt_13b.sh
#   qsub -g GROUP -l rt_F=16 scripts/abci/abci2_v100_gpt_13b.sh      # DP 2
# Interactive debugging (the same layout needs all 8 nodes):
#   qrsh -g GROUP -l rt_F=8 -l h_rt=1:00:00
#   cd <repo> && bash scripts/abci/interactive.sh scripts/abci/abci2_v100_gpt_13b.sh --train-iters 20
# Check the configuration without GPUs (e.g. on the login node):
#   NUM_NODES=8 DRY_RUN=1 bash scripts/abci/abci2_v100_gpt_13b.sh
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
RESOURCE_TYPE=${RESOURCE_TYPE:-rt_F}  # GPU memory for DRY_RUN's memory check
ABCI_SYSTEM=${ABCI_SYSTEM:-2}  # ABCI 2.0: its module names also outside a job (a login node's DRY_RUN)
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
RUN_NAME=${RUN_NAME:-gpt_13b}

TP=${TP:-4}
PP=${PP:-8}
NUM_LAYERS=${NUM_LAYERS:-40}
HIDDEN_SIZE=${HIDDEN_SIZE:-5120}
NUM_HEADS=${NUM_HEADS:-40}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TRAIN_ITERS=${TRAIN_ITERS:-250000}
LR=${LR:-1.0e-4}
MIN_LR=${MIN_LR:-1.0e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
# Stop and save 20 minutes before h_rt (24:00:00): a 13B checkpoint (its size is in the header)
# takes minutes to write, and a job killed mid-write leaves only the previous one.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1420}
# Data, tokenizer and output paths, ZERO_STAGE and DS_CONFIG: the shared defaults in common.sh.
set_job_defaults fp16

# ---- Launch ---------------------------------------------------------------------------------
prepare_training  # checks the inputs, sets up the job and GPT_ARGS (common.sh)
ARGS=(
  "${GPT_ARGS[@]}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --fp16 --checkpoint-activations
)
launch_training "${ARGS[@]}" "$@"
