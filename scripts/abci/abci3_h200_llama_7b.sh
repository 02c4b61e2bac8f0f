#!/bin/bash
#PBS -q rt_HF
#PBS -l select=2:mpiprocs=8
#PBS -l walltime=24:00:00
#PBS -j oe
#PBS -k oed
# Ending well: SIGTERM, SIGUSR1 or SIGUSR2 make every rank finish its iteration, save a complete
# checkpoint and exit 0 (a second signal stops at once). PBS sends SIGTERM at the walltime and on qdel,
# and SIGKILL after the queue's kill_delay (often seconds: too short for a large checkpoint); it has
# no option for a signal ahead of the walltime, so EXIT_DURATION_IN_MINS below stops on time, and
# `qsig -s SIGUSR1 <job id>` asks a running job to save and stop now.
#
# A 7B Llama-style model on 2 ABCI 3.0 H200 nodes (16 x H200 141 GB): rotary embeddings, SwiGLU,
# RMSNorm, grouped-query attention (8 key/value heads), no linear biases, untied output layer;
# bf16, TP 2 (inside a node), ZeRO-1 over DP 8. Sequence 4096 fits without activation
# checkpointing.
# Per GPU, DRY_RUN's estimate (python scripts/abci/abci_numbers.py writes these lines):
#   stage 0: weights + gradients + optimizer states 28.90 GB, activations 10.01 GB;
#   total 37.79 of 141 GB. One checkpoint (weights and optimizer states): ~85 GB
#
# Tokenizer: GPT-2 BPE by default (the data from dataset/*.sh). For a Llama SentencePiece model,
# preprocess the data with it and set TOKENIZER_TYPE=SentencePieceTokenizer TOKENIZER_MODEL=...
#
# Submit from the repository root (ABCI 3.0: the group goes on the command line or as #PBS -P):
#   qsub -P GROUP scripts/abci/abci3_h200_llama_7b.sh
#   qsub -P GROUP -l select=4:mpiprocs=8 scripts/abci/abci3_h200_llama_7b.sh   # more nodes, more DP
# Interactive debugging:
#   qsub -I -P GROUP -q rt_HF -l select=1:mpiprocs=8 -l walltime=1:00:00
#   cd <repo> && bash scripts/abci/interactive.sh scripts/abci/abci3_h200_llama_7b.sh --train-iters 20
# Check the configuration without GPUs (e.g. on the login node):
#   NUM_NODES=2 DRY_RUN=1 bash scripts/abci/abci3_h200_llama_7b.sh
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
RUN_NAME=${RUN_NAME:-llama_7b}

TP=${TP:-2}
PP=${PP:-1}
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
NUM_HEADS=${NUM_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
NUM_KV_HEADS=${NUM_KV_HEADS:-8}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-11008}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-1024}
TRAIN_ITERS=${TRAIN_ITERS:-250000}
LR=${LR:-3.0e-4}
MIN_LR=${MIN_LR:-3.0e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
# Stop and save 20 minutes before the walltime (24:00:00): a 7B checkpoint with optimizer
# states (its size is in the header) takes minutes to write.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1420}
# Data, tokenizer and output paths, ZERO_STAGE and DS_CONFIG: the shared defaults in common.sh.
set_job_defaults bf16

# ---- Launch ---------------------------------------------------------------------------------
prepare_training  # checks the inputs, sets up the job and GPT_ARGS (common.sh)
ARGS=(
  "${GPT_ARGS[@]}"
  --ffn-hidden-size "$FFN_HIDDEN_SIZE" --num-key-value-heads "$NUM_KV_HEADS"
  --use-rotary-position-embeddings --swiglu --normalization rmsnorm --disable-bias-linear
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --bf16
)
launch_training "${ARGS[@]}" "$@"
