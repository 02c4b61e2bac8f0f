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
# BERT 345M (BERT-large: 24 layers, hidden 1024, 16 heads, sequence 512) on one ABCI 3.0 H200 node,
# Megatron-DeepSpeed's examples/pretrain_bert_distributed.sh model with pretrain_bert.py: bf16,
# ZeRO-1, data parallel 8, masked-LM + sentence-order losses, lr 1e-4 decayed linearly (TP / PP
# from the environment: TP=2 PP=2 bash ... splits it as the GPT scripts do).
# Data: a WordPiece vocab.txt and sentence-split data (tools/preprocess_data.py --split-sentences
# --tokenizer-type BertWordPieceLowerCase --vocab-file VOCAB: PREFIX_text_sentence.bin/.idx).
# Per GPU, DRY_RUN's estimate (python scripts/abci/abci_numbers.py writes these lines):
#   stage 0: weights + gradients + optimizer states 3.19 GB, activations 7.33 GB;
#   total 14.12 of 141 GB. One checkpoint (weights and optimizer states): ~5 GB
#
# Submit from the repository root (ABCI 3.0: the group goes on the command line or as #PBS -P):
#   qsub -P GROUP scripts/abci/abci3_h200_bert_345m.sh
#   qsub -P GROUP -v DATA_PATH=/groups/GROUP/data/wiki_text_sentence,VOCAB_FILE=/groups/GROUP/data/vocab.txt \
#     scripts/abci/abci3_h200_bert_345m.sh
# Interactive debugging:
#   qsub -I -P GROUP -q rt_HF -l select=1:mpiprocs=8 -l walltime=1:00:00
#   cd <repo> && bash scripts/abci/interactive.sh scripts/abci/abci3_h200_bert_345m.sh --train-iters 20
# Check the configuration without GPUs (e.g. on the login node):
#   NUM_NODES=1 DRY_RUN=1 bash scripts/abci/abci3_h200_bert_345m.sh
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
RUN_NAME=${RUN_NAME:-bert_345m}
MEGATRON_DS_ENTRY=${MEGATRON_DS_ENTRY:-$MEGATRON_DS_ROOT/pretrain_bert.py}

TP=${TP:-1}
PP=${PP:-1}
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-1024}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-512}
MICRO_BATCH=${MICRO_BATCH:-16}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
TRAIN_ITERS=${TRAIN_ITERS:-1000000}
LR=${LR:-1.0e-4}
MIN_LR=${MIN_LR:-1.0e-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-10000}
# Stop and save 15 minutes before the walltime (24:00:00) so the job is never killed mid-write.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1425}
# BERT's inputs (before set_job_defaults, whose GPT-2 defaults they replace)
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
  --lr-decay-style linear --weight-decay 1e-2 --mask-prob 0.15 --short-seq-prob 0.1
  --bf16
)
launch_training "${ARGS[@]}" "$@"
