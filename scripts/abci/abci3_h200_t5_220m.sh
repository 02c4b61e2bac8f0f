#!/bin/bash
#PBS -q rt_HF
#PBS -l select=1:mpiprocs=8
#PBS -l walltime=24:00:00
#PBS -j oe
#PBS -k oed
# Ending well: SIGTERM, SIGUSR1 or SIGUSR2 make every rank finish its iteration, save a complete
# checkpoint and exit 0 (a second signal stops at once). PBS sends SIGTERM at the walltime and on qdel;
# EXIT_DURATION_IN_MINS below stops on time, and `qsig -s SIGUSR1 <job id>` asks a job to save and stop now.
#
# T5 220M (T5-base: 12 encoder + 12 decoder layers, hidden 768, 12 heads, ffn 3072, encoder sequence
# 512, decoder 128, 100 sentinels) on one ABCI 3.0 H200 node: Megatron-DeepSpeed's
# examples/pretrain_t5_distributed.sh model with pretrain_t5.py, bf16, ZeRO-1, data parallel 8, lr 1e-4
# decayed linearly. Pipeline parallelism needs the split rank: e.g. PP=2 SPLIT_RANK=1 (encoder on
# stage 0, decoder on stage 1; each side's layers must divide by its stages).
# Data: a WordPiece vocab.txt and sentence-split data (tools/preprocess_data.py --split-sentences
# --tokenizer-type BertWordPieceLowerCase --vocab-file VOCAB: PREFIX_text_sentence.bin/.idx).
# Per GPU, DRY_RUN's estimate (python scripts/abci/abci_numbers.py writes these lines):
#   stage 0: weights + gradients + optimizer states 2.11 GB, activations 3.93 GB;
#   total 8.72 of 141 GB. One checkpoint (weights and optimizer states): ~3 GB
#
# Submit from the repository root (ABCI 3.0: the group goes on the command line or as #PBS -P):
#   qsub -P GROUP scripts/abci/abci3_h200_t5_220m.sh
#   qsub -P GROUP -v DATA_PATH=/groups/GROUP/data/wiki_text_sentence,VOCAB_FILE=/groups/GROUP/data/vocab.txt \
#     scripts/abci/abci3_h200_t5_220m.sh
# Interactive debugging:
#   qsub -I -P GROUP -q rt_HF -l select=1:mpiprocs=8 -l walltime=1:00:00
#   cd <repo> && bash scripts/abci/interactive.sh scripts/abci/abci3_h200_t5_220m.sh --train-iters 20
# Check the configuration without GPUs (e.g. on the login node):
#   NUM_NODES=1 DRY_RUN=1 bash scripts/abci/abci3_h200_t5_220m.sh
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
ABCI_SYSTEM=${ABCI_SYSTEM:-3}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RUN_NAME=${RUN_NAME:-t5_220m}
MEGATRON_DS_ENTRY=${MEGATRON_DS_ENTRY:-$MEGATRON_DS_ROOT/pretrain_t5.py}

TP=${TP:-1}
PP=${PP:-1}
SPLIT_RANK=${SPLIT_RANK:-}  # --pipeline-model-parallel-split-rank (PP > 1): the decoder's first stage
NUM_LAYERS=${NUM_LAYERS:-12}  # the encoder's (--num-layers is --encoder-num-layers)
DECODER_NUM_LAYERS=${DECODER_NUM_LAYERS:-12}
HIDDEN_SIZE=${HIDDEN_SIZE:-768}
NUM_HEADS=${NUM_HEADS:-12}
SEQ_LENGTH=${SEQ_LENGTH:-512}  # the encoder's (--seq-length is --encoder-seq-length)
DECODER_SEQ_LENGTH=${DECODER_SEQ_LENGTH:-128}
MICRO_BATCH=${MICRO_BATCH:-16}
GLOBAL_BATCH=${GLOBAL_BATCH:-128}
TRAIN_ITERS=${TRAIN_ITERS:-1000000}
LR=${LR:-1.0e-4}
MIN_LR=${MIN_LR:-1.0e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-10000}
# Stop and save 15 minutes before the walltime (24:00:00) so the job is never killed mid-write.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1425}
# T5's inputs (before set_job_defaults, whose GPT-2 defaults they replace): BERT's vocabulary and data
WORK_DIR=${WORK_DIR:-$PWD}
DATA_DIR=${DATA_DIR:-$WORK_DIR/data}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-BertWordPieceLowerCase}
VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/bert/bert-large-uncased-vocab.txt}
DATA_PATH=${DATA_PATH:-$DATA_DIR/bert/bert_text_sentence}
set_job_defaults bf16

# ---- Launch ---------------------------------------------------------------------------------
prepare_training  # checks the inputs, sets up the job and GPT_ARGS (common.sh)
ARGS=(
  "${GPT_ARGS[@]}"
  --decoder-num-layers "$DECODER_NUM_LAYERS" --decoder-seq-length "$DECODER_SEQ_LENGTH"
  --kv-channels 64 --ffn-hidden-size 3072 --vocab-extra-ids 100
  --lr-decay-style linear --weight-decay 1e-2 --mask-prob 0.15 --short-seq-prob 0.1
  --bf16
)
if [ -n "$SPLIT_RANK" ]; then ARGS+=(--pipeline-model-parallel-split-rank "$SPLIT_RANK"); fi
launch_training "${ARGS[@]}" "$@"
