#!/bin/bash
#PBS -q rt_HF
#PBS -l select=2:mpiprocs=8
#PBS -l walltime=24:00:00
#PBS -j oe
#PBS -k oed
# Ending well: SIGTERM, SIGUSR1 or SIGUSR2 make every rank finish its iteration, save a complete
# checkpoint and exit 0 (a second signal stops at once). PBS sends SIGTERM at the walltime and on qdel,
# and SIGKILL after the queue's kill_delay; EXIT_DURATION_IN_MINS below stops on time, and
# `qsig -s SIGUSR1 <job id>` asks a running job to save and stop now.
#
# Continual pretraining of Llama 3.1 8B on 2 ABCI 3.0 H200 nodes (16 x H200 141 GB), the whole
# workflow in docs/continual-pretraining.md: the Hugging Face model imported once with
#   python tools/checkpoint/from_hf.py --hf-dir $HF_DIR --save $PRETRAINED_CHECKPOINT
# the corpus preprocessed with its tokenizer (TOKENIZER_TYPE=HuggingFaceTokenizer TOKENIZER_MODEL=$HF_DIR
# bash scripts/abci/preprocess_jsonl.sh ...), then this job, resubmitted until TRAIN_ITERS: the first
# job starts from PRETRAINED_CHECKPOINT's weights (--pretrained-checkpoint: iteration 0, a fresh
# optimizer), every later one resumes from CHECKPOINT_DIR.
# Model: Llama 3.1 8B's config.json (32 layers, hidden 4096, 32 heads, 8 key/value heads, FFN 14336,
# vocabulary 128256, RoPE base 500000 with Llama 3.1's frequency scaling, untied output layer);
# sequence 8192, global batch 512 (4M tokens per step; 25,000 steps = 105B tokens); bf16.
# Layout from the planner (python tools/plan.py --resource rt_HF --nodes 2 with these flags; its
# ranking in docs/continual-pretraining.md): TP 1, PP 1, ZeRO-2 over DP 16, micro batch 2, no
# activation checkpointing; predicted 25.5 s per step (60% MFU), 7.4 days for the 25,000 steps. If a
# GPU runs out of memory, the planner's second layout is TP=2 with --sequence-parallel and MICRO_BATCH=4
# (109 GB, 6% slower).
# Per GPU, DRY_RUN's estimate (python scripts/abci/abci_numbers.py writes these lines):
#   stage 0: weights + gradients + optimizer states 25.09 GB, activations 73.22 GB;
#   total 117.89 of 141 GB. One checkpoint (weights and optimizer states): ~112 GB
#
# Submit from the repository root (ABCI 3.0: the group goes on the command line or as #PBS -P):
#   qsub -P GROUP scripts/abci/abci3_h200_llama3.1_8b_cpt.sh
#   qsub -P GROUP -v DATA_PATH="0.7 data/ja/ja_text_document 0.3 data/en/en_text_document" \
#       scripts/abci/abci3_h200_llama3.1_8b_cpt.sh   # a weighted blend of corpora
# Interactive debugging:
#   qsub -I -P GROUP -q rt_HF -l select=1:mpiprocs=8 -l walltime=1:00:00
#   cd <repo> && bash scripts/abci/interactive.sh scripts/abci/abci3_h200_llama3.1_8b_cpt.sh --train-iters 20
# Check the configuration without GPUs (e.g. on the login node):
#   NUM_NODES=2 DRY_RUN=1 bash scripts/abci/abci3_h200_llama3.1_8b_cpt.sh
# select=N:mpiprocs=8: N nodes, 8 MPI ranks each. -k oed: PBS otherwise shows the job's output only
# when it ends; the training log is also written live to $LOG_DIR/train.<job id>.log.
# Arguments after the script name are appended to the pretrain flags (the last value wins).
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
RUN_NAME=${RUN_NAME:-llama3.1_8b_cpt}
WORK_DIR=${WORK_DIR:-$PWD}
# The Hugging Face directory (config.json, safetensors, tokenizer.json) and its import by from_hf.py
HF_DIR=${HF_DIR:-$WORK_DIR/hf/Llama-3.1-8B}
PRETRAINED_CHECKPOINT=${PRETRAINED_CHECKPOINT:-$WORK_DIR/checkpoints/llama3.1_8b_hf}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$HF_DIR}
# the corpus, preprocessed with that tokenizer (a prefix, or "W1 PREFIX1 W2 PREFIX2 ...")
DATA_PATH=${DATA_PATH:-$WORK_DIR/data/llama3/corpus_text_document}

TP=${TP:-1}
PP=${PP:-1}
ZERO_STAGE=${ZERO_STAGE:-2}
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
NUM_HEADS=${NUM_HEADS:-32}
NUM_KV_HEADS=${NUM_KV_HEADS:-8}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-14336}
SEQ_LENGTH=${SEQ_LENGTH:-8192}
MICRO_BATCH=${MICRO_BATCH:-2}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TRAIN_ITERS=${TRAIN_ITERS:-25000}
# Continual pretraining: a peak a tenth of Llama 3's pretraining LR, warm-up 1% (common.sh), cosine to a tenth
LR=${LR:-3.0e-5}
MIN_LR=${MIN_LR:-3.0e-6}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
# Stop and save 20 minutes before the walltime (24:00:00): the checkpoint's size is in the header.
EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-1420}
# Output paths, DS_CONFIG: the shared defaults in common.sh.
set_job_defaults bf16

# The first job needs the imported model; a resubmitted one resumes from CHECKPOINT_DIR.
if [ ! -f "$CHECKPOINT_DIR/latest_checkpointed_iteration.txt" ] && \
   [ ! -f "$PRETRAINED_CHECKPOINT/latest_checkpointed_iteration.txt" ]; then
  abci_die "no checkpoint to start from: import the model first (python tools/checkpoint/from_hf.py" \
    "--hf-dir $HF_DIR --save $PRETRAINED_CHECKPOINT) or set PRETRAINED_CHECKPOINT"
fi

# ---- Launch ---------------------------------------------------------------------------------
prepare_training  # checks the inputs, sets up the job and GPT_ARGS (common.sh)
ARGS=(
  "${GPT_ARGS[@]}"
  --pretrained-checkpoint "$PRETRAINED_CHECKPOINT" --no-pipeline-parallel  # PP 1: ZeRO-2 in DeepSpeed's plain engine
  --ffn-hidden-size "$FFN_HIDDEN_SIZE" --group-query-attention --num-query-groups "$NUM_KV_HEADS"
  --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8
  --max-position-embeddings 131072 --swiglu --normalization RMSNorm --norm-epsilon 1e-5
  --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --bf16
)
launch_training "${ARGS[@]}" "$@"
