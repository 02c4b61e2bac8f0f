#!/bin/bash
#$ -l rt_F=8
#$ -l h_rt=24:00:00
#$ -j y
#$ -cwd
# GPT 13B on 8 ABCI 2.0 V100 nodes (32 x V100 16 GB): TP 4 (inside a node), PP 8, micro batch 1,
# activation checkpointing, fp16, ZeRO-1. This is the layout that fits 13B into 16 GB GPUs:
# 13e9 / 32 GPUs ~ 0.4e9 parameters each, ~6.5 GB of weights + grads + Adam states, and
# recomputed activations. More nodes add data parallelism (DP = nodes * 4 / 32).
#
# Submit from the repository root (ABCI 2.0 takes the group only on the command line):
#   qsub -g GROUP scripts/abci/abci2_v100_gpt_13b.sh
#   qsub -g GROUP -l rt_F=16 scripts/abci/abci2_v100_gpt_13b.sh      # DP 2
# Interactive debugging (the same layout needs all 8 nodes):
#   qrsh -g GROUP -l rt_F=8 -l h_rt=1:00:00
#   cd <repo> && bash scripts/abci/abci2_v100_gpt_13b.sh --train-iters 20
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
[ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] || {
  echo "ERROR: megatron_ds repository not found: qsub from its root or set MEGATRON_DS_ROOT" >&2
  exit 1
}
source "$MEGATRON_DS_ROOT/scripts/abci/common.sh"

# ---- Configuration: every variable can be overridden from the environment -----------------
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
WORK_DIR=${WORK_DIR:-$PWD}                 # data/, checkpoints/ and runs/ live under it
DATA_DIR=${DATA_DIR:-$WORK_DIR/data}       # filled by dataset/*.sh
VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/gpt2/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$DATA_DIR/gpt2/gpt2-merges.txt}
# A prefix of .bin/.idx files, or a weighted blend "W1 PREFIX1 W2 PREFIX2 ..."
DATA_PATH=${DATA_PATH:-$DATA_DIR/tinystories/tinystories_train_text_document}
RUN_NAME=${RUN_NAME:-gpt_13b}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$WORK_DIR/checkpoints/$RUN_NAME}
RUN_DIR=${RUN_DIR:-$WORK_DIR/runs/$RUN_NAME}
LOG_DIR=${LOG_DIR:-$RUN_DIR/logs}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$RUN_DIR/tensorboard}

TP=${TP:-4}
PP=${PP:-8}
ZERO_STAGE=${ZERO_STAGE:-1}
DS_CONFIG=${DS_CONFIG:-$MEGATRON_DS_ROOT/ds_configs/zero${ZERO_STAGE}_fp16.json}
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
# Stop and save 20 minutes before h_rt (24:00:00): a 13B checkpoint (~200 GB with optimizer
# states) takes minutes to write, and a job killed mid-write leaves only the previous one.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1420}

# ---- Launch ---------------------------------------------------------------------------------
require_file "$DS_CONFIG"
require_data_path "$DATA_PATH"
set_tokenizer_args
setup_job

ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr-decay-iters "$TRAIN_ITERS"
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-fraction 0.01
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --fp16 --checkpoint-activations
  --data-path "${DATA_PATH_ARGS[@]}" --data-impl mmap --split "949,50,1"
  "${TOKENIZER_ARGS[@]}"
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
  --eval-interval 1000 --eval-iters 10 --log-interval 10
  --tensorboard-dir "$TENSORBOARD_DIR" --exit-duration-in-mins "$EXIT_DURATION_IN_MINS"
  --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE"
  --distributed-backend nccl --seed 1234
)
launch_training "${ARGS[@]}" "$@"
