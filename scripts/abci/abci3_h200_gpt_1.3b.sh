#!/bin/bash
#PBS -q rt_HF
#PBS -l select=1:mpiprocs=8
#PBS -l walltime=24:00:00
#PBS -j oe
#PBS -k oed
# Ending well: SIGTERM, SIGUSR1 or SIGUSR2 make every rank finish its iteration, save a complete
# checkpoint and exit 0 (a second signal stops at once). PBS sends SIGTERM at the walltime and on qdel,
# and SIGKILL after the queue's kill_delay (often seconds: too short for a large checkpoint); it has
# no option for a signal ahead of the walltime, so EXIT_DURATION_IN_MINS below stops on time, and
# `qsig -s SIGUSR1 <job id>` asks a running job to save and stop now.
#
# GPT 1.3B on one ABCI 3.0 H200 node (8 x H200 141 GB): bf16, ZeRO-1, data parallel 8. The
# memory allows micro batch 4 at sequence 2048 without activation checkpointing, which is faster
# than recomputing.
# Per GPU, DRY_RUN's estimate (python scripts/abci/abci_numbers.py writes these lines):
#   stage 0: weights + gradients + optimizer states 12.50 GB, activations 14.54 GB;
#   total 30.56 of 141 GB. One checkpoint (weights and optimizer states): ~18 GB
#
# Submit from the repository root (ABCI 3.0: the group goes on the command line or as #PBS -P):
#   qsub -P GROUP scripts/abci/abci3_h200_gpt_1.3b.sh
#   qsub -P GROUP -l select=2:mpiprocs=8 scripts/abci/abci3_h200_gpt_1.3b.sh   # more nodes, more DP
# Interactive debugging:
#   qsub -I -P GROUP -q rt_HF -l select=1:mpiprocs=8 -l walltime=1:00:00
#   cd <repo> && bash scripts/abci/interactive.sh scripts/abci/abci3_h200_gpt_1.3b.sh --train-iters 20
# Check the configuration without GPUs (e.g. on the login node):
#   NUM_NODES=1 DRY_RUN=1 bash scripts/abci/abci3_h200_gpt_1.3b.sh
# select=N:mpiprocs=8: N nodes, 8 MPI ranks each (rt_HF brings its 192 CPUs and 8 GPUs; see
# https://docs.abci.ai/v3/en/mpi/). -k oed: PBS otherwise shows the job's output only when it
# ends; the training log is also written live to $LOG_DIR/train.<job id>.log.
# Arguments after the script name are appended to the pretrain flags (the last value wins).
# Resubmitting the same script resumes from the latest checkpoint in CHECKPOINT_DIR.
set -euo pipefail
cd "${PBS_O_WORKDIR:-$PWD}"  # PBS starts jobs in $HOME

# Schedulers run a spooled copy of this file, so find the repository from the submit directory.
for MEGATRON_DS_ROOT in "${MEGATRON_DS_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." \
    2>/dev/null && pwd)" "$PWD"; do
  [ -n "$MEGATRON_DS_ROOT" ] && [ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] && break
done
[ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] || { echo "ERROR: megatron_ds repository not" \
  "found: qsub from its root or set MEGATRON_DS_ROOT" >&2; exit 1; }
source "$MEGATRON_DS_ROOT/scripts/abci/common.sh"

# ---- Configuration: every variable can be overridden from the environment -----------------
RESOURCE_TYPE=${RESOURCE_TYPE:-rt_HF}  # GPU memory for DRY_RUN's memory check
ABCI_SYSTEM=${ABCI_SYSTEM:-3}  # ABCI 3.0: its module names also outside a job (a login node's DRY_RUN)
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
# Stop and save 15 minutes before the walltime (24:00:00) so the job is never killed mid-write.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1425}
# Data, tokenizer and output paths, ZERO_STAGE and DS_CONFIG: the shared defaults in common.sh.
set_job_defaults bf16

# ---- Launch ---------------------------------------------------------------------------------
prepare_training  # checks the inputs, sets up the job and GPT_ARGS (common.sh)
ARGS=(
  "${GPT_ARGS[@]}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --bf16
)
launch_training "${ARGS[@]}" "$@"
