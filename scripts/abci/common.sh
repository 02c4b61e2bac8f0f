# shellcheck shell=bash
# Shared helpers for the ABCI job scripts in this folder. Sourced, never run on its own.
#
# A job script sets its own defaults (GPUS_PER_NODE, RUN_NAME, model sizes, TP/PP, batch sizes,
# learning rates, SAVE_INTERVAL, EXIT_DURATION_IN_MINS), then calls, in order:
#   set_job_defaults P   the defaults all jobs share, for the variables still unset: data,
#                        tokenizer and output paths, ZERO_STAGE, DS_CONFIG (P: fp16 or bf16)
#   prepare_training     the steps below, from require_file to set_gpt_args
#   launch_training ARGS mpirun -np WORLD_SIZE ... $PYTHON $MEGATRON_DS_ENTRY ARGS --use-mpi,
#                        output also appended to $LOG_DIR/train.<job id>.log. ARGS: GPT_ARGS,
#                        the job's model-specific flags, then the arguments given to the script
#
# prepare_training, step by step (inputs are checked before any module is loaded):
#   require_file F ...   fail before mpirun if an input is missing (a clear line, not a traceback
#                        from every rank)
#   require_data_path P  the same for a Megatron --data-path (prefixes or a weighted blend);
#                        sets DATA_PATH_ARGS
#   set_tokenizer_args   checks the tokenizer files, sets TOKENIZER_ARGS
#   setup_job            detect the scheduler, load modules, write the hostfile, export
#                        MASTER_ADDR/MASTER_PORT, compute NUM_NODES and WORLD_SIZE
#   set_gpt_args         sets GPT_ARGS, the pretrain flags every job script passes, from the
#                        job's variables
#
# Everything below can be overridden from the environment (or `qsub -v VAR=...`).

# ---------------------------------------------------------------- modules
# `module load` names per system. Set one to "" to skip it (e.g. when your venv ships its own
# NCCL); set CUDA_MODULE etc. to override regardless of the system. Check `module avail` after
# system updates: these are the versions the scripts were written against.
# ABCI 2.0 (https://docs.abci.ai/en/environment-modules/): CUDA 12.1 is the newest with a cuDNN 8
# and NCCL 2.18 build there, and hpcx/2.12 is its Open MPI.
: "${ABCI2_CUDA_MODULE=cuda/12.1/12.1.1}"
: "${ABCI2_CUDNN_MODULE=cudnn/8.9/8.9.7}"
: "${ABCI2_NCCL_MODULE=nccl/2.18/2.18.5-1}"
: "${ABCI2_HPCX_MODULE=hpcx/2.12}"
# ABCI 3.0 (https://docs.abci.ai/v3/en/environment-modules/, module list of 2026-01): cuda
# 11.8.0-13.0.1, cudnn 9.5.1-9.13.0, nccl 2.23.4-1-2.28.3-1, hpcx 2.20 (Open MPI 4.1.7,
# https://docs.abci.ai/v3/en/mpi/). CUDA 12.8 matches PyTorch's cu128 wheels (setup_env.sh);
# NCCL 2.27 is not older than the NCCL those wheels bundle: the module's library comes first on
# LD_LIBRARY_PATH, and an older one than torch was built with fails at the first collective.
: "${ABCI3_CUDA_MODULE=cuda/12.8/12.8.1}"
: "${ABCI3_CUDNN_MODULE=cudnn/9.10/9.10.2}"
: "${ABCI3_NCCL_MODULE=nccl/2.27/2.27.7-1}"
: "${ABCI3_HPCX_MODULE=hpcx/2.20}"

# ---------------------------------------------------------------- communication settings
# Exported to every rank (each one overridable; set it to "" to leave it unset):
# - CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware work queue, so a tensor-parallel collective is
#   scheduled before the GEMM that follows it (Megatron-LM's examples set it for TP/SP overlap).
# - TORCH_NCCL_AVOID_RECORD_STREAMS=1: PyTorch frees NCCL buffers by stream sync instead of
#   recordStream, which otherwise holds memory until the allocator notices (less peak memory).
# - NCCL_IB_TIMEOUT: InfiniBand retry timeout exponent (4.096 us * 2^N); unset keeps NCCL's
#   default (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html). Raise it (e.g.
#   22) if large jobs die with "NET/IB ... timeout" on a busy fabric.
# - UCX_MAX_RNDV_RAILS / UCX_MAX_EAGER_RAILS: ABCI 3.0's multi-rail defaults for HPC-X/Intel MPI
#   over the 8 NDR HCAs (4 lanes for large messages, 1 for small; valid 1-8,
#   https://docs.abci.ai/v3/en/mpi/ "How to change the number of InfiniBand NDR"). They steer
#   Open MPI's own traffic; NCCL talks to the HCAs itself (NCCL_IB_HCA selects them).
: "${CUDA_DEVICE_MAX_CONNECTIONS=1}"
: "${TORCH_NCCL_AVOID_RECORD_STREAMS=1}"
: "${NCCL_IB_TIMEOUT=}"
: "${ABCI3_UCX_MAX_RNDV_RAILS=4}"
: "${ABCI3_UCX_MAX_EAGER_RAILS=1}"
# Variables mpirun forwards to every rank (remote ranks start with a fresh environment).
FORWARD_ENV_PATTERN=${FORWARD_ENV_PATTERN:-'^(PYTHONPATH|OMP_NUM_THREADS|CUDA_DEVICE_MAX_CONNECTIONS|TORCH_NCCL_[A-Z0-9_]+|NCCL_[A-Z0-9_]+|UCX_[A-Z0-9_]+|HF_[A-Z0-9_]+)$'}

abci_note() { echo "[abci] $*"; }
abci_die() { echo "[abci] ERROR: $*" >&2; exit 1; }

# SCHEDULER=sge (ABCI 2.0, Grid Engine), pbs (ABCI 3.0, PBS Professional) or none (a plain
# shell: only DRY_RUN=1 or a single-node run on this host make sense there).
detect_scheduler() {
  if [ -n "${PBS_NODEFILE:-}" ] || [ -n "${PBS_JOBID:-}" ]; then
    SCHEDULER=pbs
  elif [ -n "${SGE_JOB_HOSTLIST:-}" ]; then
    SCHEDULER=sge
  else
    SCHEDULER=none
  fi
}

# The ABCI system whose module names and settings apply: the scheduler's inside a job (PBS is
# ABCI 3.0, Grid Engine ABCI 2.0); outside one (a login node's DRY_RUN, a plain shell) ABCI_SYSTEM,
# which each job script sets to the system it is written for (2 or 3; 2 where nothing says).
abci_system() {
  case "$SCHEDULER" in
    pbs) echo 3 ;;
    sge) echo 2 ;;
    *) case "${ABCI_SYSTEM:-2}" in 2|3) echo "${ABCI_SYSTEM:-2}" ;;
         *) abci_die "ABCI_SYSTEM=$ABCI_SYSTEM: use 2 (ABCI 2.0) or 3 (ABCI 3.0)" ;; esac ;;
  esac
}

load_modules() {
  local cuda cudnn nccl hpcx system
  system=$(abci_system) || exit 1
  case "$system" in
    3) cuda=${CUDA_MODULE-$ABCI3_CUDA_MODULE}; cudnn=${CUDNN_MODULE-$ABCI3_CUDNN_MODULE}
       nccl=${NCCL_MODULE-$ABCI3_NCCL_MODULE}; hpcx=${HPCX_MODULE-$ABCI3_HPCX_MODULE} ;;
    *) cuda=${CUDA_MODULE-$ABCI2_CUDA_MODULE}; cudnn=${CUDNN_MODULE-$ABCI2_CUDNN_MODULE}
       nccl=${NCCL_MODULE-$ABCI2_NCCL_MODULE}; hpcx=${HPCX_MODULE-$ABCI2_HPCX_MODULE} ;;
  esac
  # Batch jobs start non-login shells where `module` may not be defined yet.
  if ! command -v module >/dev/null 2>&1 && [ -f /etc/profile.d/modules.sh ]; then
    # shellcheck disable=SC1091
    source /etc/profile.d/modules.sh
  fi
  if ! command -v module >/dev/null 2>&1; then
    abci_note "no 'module' command here: skipping module loads ($cuda $cudnn $nccl $hpcx)"
    return 0
  fi
  local name restore_u=0
  # Module init scripts read unset variables; don't let the job's `set -u` kill them.
  case $- in *u*) restore_u=1; set +u ;; esac
  for name in $cuda $cudnn $nccl $hpcx; do
    module load "$name" || abci_die "module load $name failed: check 'module avail' and set the" \
      "matching *_MODULE variable (see the top of scripts/abci/common.sh)"
  done
  [ "$restore_u" = 1 ] && set -u
  return 0
}

# The scheduler's hosts, unique, in order: SGE lists each host once, PBS once per slot.
scheduler_hosts() {
  local list
  case "$SCHEDULER" in
    sge) list=$SGE_JOB_HOSTLIST ;;
    pbs) list=${PBS_NODEFILE:-} ;;
    *)   echo localhost; return 0 ;;
  esac
  if [ -z "$list" ] || [ ! -r "$list" ]; then
    abci_die "$SCHEDULER host list '${list}' is missing or unreadable"
  fi
  awk 'NF && !seen[$1]++ { print $1 }' "$list"
}

# Numeric job id: SGE's JOB_ID, PBS's PBS_JOBID minus its ".server" suffix (and "[i]" of arrays).
scheduler_job_id() {
  local id=""
  case "$SCHEDULER" in
    sge) id=${JOB_ID:-} ;;
    pbs) id=${PBS_JOBID:-}; id=${id%%.*}; id=${id%%\[*} ;;
  esac
  case "$id" in ''|*[!0-9]*) echo "" ;; *) echo "$id" ;; esac
}

# Writes "host slots=GPUS_PER_NODE" per node into the node-local scratch dir; sets HOSTFILE,
# NUM_NODES, WORLD_SIZE and FIRST_HOST as shell variables only: an exported WORLD_SIZE would reach
# every rank and contradict the launcher's own (or a DRY_RUN's).
build_hostfile() {
  local hosts dir requested=${NUM_NODES:-}
  hosts=$(scheduler_hosts) || exit 1
  [ -n "$hosts" ] || abci_die "the $SCHEDULER host list is empty"
  dir=$(node_local_dir)
  if [ -z "$dir" ]; then
    # Outside a job (a login node's DRY_RUN, a plain shell): a temporary directory, removed when
    # the script exits however it ends.
    dir=$(mktemp -d)
    # shellcheck disable=SC2064  # the directory's name is fixed now
    trap "rm -rf '$dir'" EXIT
  fi
  HOSTFILE="$dir/hostfile"
  echo "$hosts" | awk -v slots="$GPUS_PER_NODE" '{ print $1 " slots=" slots }' > "$HOSTFILE"
  NUM_NODES=$(wc -l < "$HOSTFILE" | tr -d ' ')
  if [ "$SCHEDULER" = none ] && [ -n "$requested" ] && [ "$requested" != 1 ]; then
    # No scheduler: only a DRY_RUN validating an N-node job (e.g. on a login node) can use N > 1.
    [ "${DRY_RUN:-0}" = 1 ] || abci_die "NUM_NODES=$requested without a scheduler: submit with" \
      "qsub, or add DRY_RUN=1 to only validate the configuration"
    NUM_NODES=$requested
  elif [ "$SCHEDULER" != none ] && [ -n "$requested" ] && [ "$requested" != "$NUM_NODES" ]; then
    abci_note "warning: ignoring NUM_NODES=$requested: the $SCHEDULER job has $NUM_NODES nodes"
  fi
  if [ "$SCHEDULER" = sge ] && [ -n "${NHOSTS:-}" ] && [ "$NHOSTS" != "$NUM_NODES" ]; then
    abci_note "warning: NHOSTS=$NHOSTS but $SGE_JOB_HOSTLIST lists $NUM_NODES hosts; using the list"
  fi
  WORLD_SIZE=$((NUM_NODES * GPUS_PER_NODE))
  FIRST_HOST=$(echo "$hosts" | head -n 1)
}

# MASTER_ADDR: the first host (rank 0 runs there: -map-by slot fills hosts in hostfile order).
# MASTER_PORT: 10000 + JOB_ID % 50000, so two jobs sharing a node never pick the same port.
export_master() {
  local job_id
  job_id=$(scheduler_job_id)
  : "${MASTER_ADDR:=$FIRST_HOST}"
  if [ -z "${MASTER_PORT:-}" ]; then
    if [ -n "$job_id" ]; then MASTER_PORT=$((10000 + job_id % 50000)); else MASTER_PORT=29500; fi
  fi
  export MASTER_ADDR MASTER_PORT
}

# Exports the communication settings above that are non-empty.
export_comm_env() {
  local name
  for name in CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_AVOID_RECORD_STREAMS NCCL_IB_TIMEOUT; do
    if [ -n "${!name:-}" ]; then export "${name?}"; else unset "$name"; fi
  done
  if [ "$(abci_system)" = 3 ]; then
    : "${UCX_MAX_RNDV_RAILS=$ABCI3_UCX_MAX_RNDV_RAILS}" "${UCX_MAX_EAGER_RAILS=$ABCI3_UCX_MAX_EAGER_RAILS}"
    for name in UCX_MAX_RNDV_RAILS UCX_MAX_EAGER_RAILS; do
      if [ -n "${!name:-}" ]; then export "${name?}"; else unset "$name"; fi
    done
  fi
}

# The node-local scratch directory of the job: $SGE_LOCALDIR (ABCI 2.0) or $PBS_LOCALDIR (ABCI
# 3.0, on the node's NVMe); empty outside a job.
node_local_dir() {
  local dir=${SGE_LOCALDIR:-${PBS_LOCALDIR:-}}
  if [ -n "$dir" ] && [ -d "$dir" ]; then echo "$dir"; fi
}

setup_job() {
  [ -n "${GPUS_PER_NODE:-}" ] || abci_die "GPUS_PER_NODE is not set (the job script sets it)"
  detect_scheduler
  load_modules
  build_hostfile
  export_master
  export_comm_env
  JOB_NUMBER=$(scheduler_job_id); JOB_NUMBER=${JOB_NUMBER:-local}
  # mpirun -x of an unset variable only warns, but remote ranks would then lose the value.
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
  : "${MEGATRON_DS_ENTRY:=$MEGATRON_DS_ROOT/pretrain_gpt.py}"
  if [ -z "${PYTHON:-}" ]; then
    if [ -x "$MEGATRON_DS_ROOT/.venv/bin/python" ]; then
      # The Makefile's venv; its bin/ goes on PATH so mpirun -x PATH carries it to every rank.
      PYTHON="$MEGATRON_DS_ROOT/.venv/bin/python"
      export PATH="$MEGATRON_DS_ROOT/.venv/bin:$PATH"
    else
      PYTHON=python3
    fi
  fi
  export MEGATRON_DS_ENTRY PYTHON
  abci_note "scheduler=$SCHEDULER nodes=$NUM_NODES gpus/node=$GPUS_PER_NODE world=$WORLD_SIZE" \
    "master=$MASTER_ADDR:$MASTER_PORT hostfile=$HOSTFILE"
  sed 's/^/[abci]   /' "$HOSTFILE"
}

# The defaults every job script shares, each only where the variable is unset or empty, so the
# environment (or `qsub -v`) overrides any of them. Called after the job script's own defaults:
# the output paths build on its RUN_NAME. $1 (fp16 on V100, which has no bf16; else bf16) picks
# the DeepSpeed template, and must match the precision flag the job script passes.
set_job_defaults() {
  case "${1:-}" in
    fp16|bf16) ;;
    *) abci_die "set_job_defaults needs the precision, fp16 or bf16 (got '${1:-}')" ;;
  esac
  [ -n "${RUN_NAME:-}" ] || abci_die "RUN_NAME is not set (the job script sets it)"
  WORK_DIR=${WORK_DIR:-$PWD}                 # data/, checkpoints/ and runs/ live under it
  DATA_DIR=${DATA_DIR:-$WORK_DIR/data}       # filled by dataset/*.sh
  VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/gpt2/gpt2-vocab.json}
  MERGE_FILE=${MERGE_FILE:-$DATA_DIR/gpt2/gpt2-merges.txt}
  # GPT-2 BPE with the two files above, or e.g. SentencePieceTokenizer with TOKENIZER_MODEL
  # (see set_tokenizer_args): the one the data was preprocessed with.
  TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
  TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
  # A prefix of .bin/.idx files, or a weighted blend "W1 PREFIX1 W2 PREFIX2 ..."
  DATA_PATH=${DATA_PATH:-$DATA_DIR/tinystories/tinystories_train_text_document}
  CHECKPOINT_DIR=${CHECKPOINT_DIR:-$WORK_DIR/checkpoints/$RUN_NAME}
  RUN_DIR=${RUN_DIR:-$WORK_DIR/runs/$RUN_NAME}
  LOG_DIR=${LOG_DIR:-$RUN_DIR/logs}
  TENSORBOARD_DIR=${TENSORBOARD_DIR:-$RUN_DIR/tensorboard}
  ZERO_STAGE=${ZERO_STAGE:-1}
  DS_CONFIG=${DS_CONFIG:-$MEGATRON_DS_ROOT/ds_configs/zero${ZERO_STAGE}_$1.json}
  # The GPU memory DRY_RUN checks the layout's estimate against: GB, or a resource type / GPU name
  # (rt_F 16, rt_AF 40, rt_HF 141; see megatron_ds/config/memory.py). Default: the job's type.
  GPU_MEMORY_GB=${GPU_MEMORY_GB:-${RESOURCE_TYPE:-}}
  # STAGE_DATA=1 copies the DATA_PATH files to node-local storage first (stage_data); the index
  # cache then goes to DATA_CACHE_PATH on the shared file system, built once for all nodes.
  STAGE_DATA=${STAGE_DATA:-0}
  DATA_CACHE_PATH=${DATA_CACHE_PATH:-}
}

require_file() {
  local f
  for f in "$@"; do
    [ -f "$f" ] || abci_die "missing input file: $f (set its variable from the environment, see" \
      "set_job_defaults in scripts/abci/common.sh; for data and vocabularies see dataset/README.md)"
  done
}

# A --data-path is "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ...": every prefix needs .bin and .idx.
# Sets DATA_PATH_ARGS, the words to put after --data-path.
require_data_path() {
  local item
  read -r -a DATA_PATH_ARGS <<< "$1"
  [ "${#DATA_PATH_ARGS[@]}" -gt 0 ] || abci_die "DATA_PATH is empty"
  for item in "${DATA_PATH_ARGS[@]}"; do
    case "$item" in
      ''|*[!0-9.eE+-]*) require_file "$item.bin" "$item.idx" ;;
      *) ;;  # a blend weight
    esac
  done
}

# TOKENIZER_ARGS for --tokenizer-type: GPT-2 BPE needs VOCAB_FILE + MERGE_FILE, BERT WordPiece
# VOCAB_FILE alone; SentencePiece
# and HF tokenizers need TOKENIZER_MODEL. The data must have been preprocessed with the same one.
set_tokenizer_args() {
  case "${TOKENIZER_TYPE:=GPT2BPETokenizer}" in
    GPT2BPETokenizer)
      require_file "$VOCAB_FILE" "$MERGE_FILE"
      TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE"
                      --merge-file "$MERGE_FILE") ;;
    BertWordPieceLowerCase|BertWordPieceCase)  # BERT / T5: a WordPiece vocab.txt
      require_file "$VOCAB_FILE"
      TOKENIZER_ARGS=(--tokenizer-type "$TOKENIZER_TYPE" --vocab-file "$VOCAB_FILE") ;;
    *)
      [ -n "${TOKENIZER_MODEL:-}" ] || abci_die "TOKENIZER_TYPE=$TOKENIZER_TYPE needs" \
        "TOKENIZER_MODEL (the tokenizer the data was preprocessed with)"
      [ -e "$TOKENIZER_MODEL" ] || abci_die "missing tokenizer: TOKENIZER_MODEL=$TOKENIZER_MODEL"
      TOKENIZER_ARGS=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL") ;;
  esac
}

# GPT_ARGS: the pretrain flags every job script passes, from the variables. The job script adds
# its model-specific ones (precision, weight decay and Adam betas, activation checkpointing,
# architecture; none of them repeats a flag here), then the arguments given to it: a user's flag
# comes last and wins.
# shellcheck disable=SC2034  # GPT_ARGS is read by the job script
set_gpt_args() {
  GPT_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS" --lr-decay-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-fraction 0.01
    --clip-grad 1.0
    --data-path "${DATA_PATH_ARGS[@]}" --data-impl mmap --split "949,50,1"
    "${TOKENIZER_ARGS[@]}"
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
    --eval-interval 1000 --eval-iters 10 --log-interval 10
    --tensorboard-dir "$TENSORBOARD_DIR" --exit-duration-in-mins "$EXIT_DURATION_IN_MINS"
    --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE"
    --distributed-backend nccl --seed 1234
  )
}

# STAGE_DATA=1: copy every DATA_PATH prefix's .bin/.idx into the node-local directory of every
# node (one copy process per node, through mpirun), under a temporary name renamed when complete,
# and point DATA_PATH_ARGS at the copies. Reading a multi-GB corpus from local NVMe keeps the
# shared file system out of the data loader's path. The index cache stays shared (DATA_CACHE_PATH,
# default $RUN_DIR/index-cache): built once, reused by resubmitted jobs.
stage_data() {
  local local_dir i item dest files=() sources=() new_args=() script
  [ "${STAGE_DATA:-0}" = 1 ] || return 0
  local_dir=$(node_local_dir)
  if [ -z "$local_dir" ]; then
    abci_note "STAGE_DATA=1 outside a job (no \$SGE_LOCALDIR/\$PBS_LOCALDIR): reading DATA_PATH in place"
    return 0
  fi
  i=0
  for item in "${DATA_PATH_ARGS[@]}"; do
    case "$item" in
      ''|*[!0-9.eE+-]*)
        i=$((i + 1)); dest="$local_dir/data/${i}_$(basename "$item")"
        files+=("$item.bin" "$dest.bin" "$item.idx" "$dest.idx"); sources+=("$item.bin" "$item.idx")
        new_args+=("$dest") ;;
      *) new_args+=("$item") ;;
    esac
  done
  # shellcheck disable=SC2016  # expanded by the copying shell on each node
  script='mkdir -p "$(dirname "$2")" && while [ $# -ge 2 ]; do cp "$1" "$2.part.$$" && mv -f "$2.part.$$" "$2" || exit 1; shift 2; done'
  abci_note "staging ${#sources[@]} files ($(du -shcL "${sources[@]}" 2>/dev/null | tail -n 1 | cut -f1)) to" \
    "$local_dir/data on $NUM_NODES node(s)"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    abci_note "DRY_RUN: would copy ${sources[*]} (validating the shared copies)"
    return 0
  elif [ "$NUM_NODES" -gt 1 ]; then
    local -a extra
    read -r -a extra <<< "${MPIRUN_EXTRA_ARGS:-}"
    "${MPIRUN:-mpirun}" -np "$NUM_NODES" -npernode 1 -hostfile "$HOSTFILE" "${extra[@]}" \
      bash -c "$script" stage "${files[@]}" \
      || abci_die "staging DATA_PATH to node-local storage failed (disk full? set STAGE_DATA=0)"
  else
    bash -c "$script" stage "${files[@]}" || abci_die "staging DATA_PATH to $local_dir failed (set STAGE_DATA=0)"
  fi
  DATA_PATH_ARGS=("${new_args[@]}")
  DATA_CACHE_PATH=${DATA_CACHE_PATH:-$RUN_DIR/index-cache}
}

# DRY_RUN: the world size must split into TP x PP blocks (the last --tensor/--pipeline-model-parallel-size
# among the pretrain arguments "$@", else TP/PP). Found here, it names the variable to change
# (NUM_NODES, or the job's node request), not the --world-size the script derives from it.
check_world_size() {
  local tp=$TP pp=$PP prev="" arg
  for arg in "$@"; do
    case "$prev" in
      --tensor-model-parallel-size) tp=$arg ;;
      --pipeline-model-parallel-size) pp=$arg ;;
    esac
    prev=$arg
  done
  local block=$((tp * pp)) nodes=1
  [ $((WORLD_SIZE % block)) = 0 ] && return 0
  while [ $((nodes * GPUS_PER_NODE % block)) != 0 ]; do nodes=$((nodes + 1)); done
  local where="NUM_NODES=$NUM_NODES"
  case "$SCHEDULER" in
    sge) where="the job's $NUM_NODES node(s) (#$ -l rt_*=N)" ;;
    pbs) where="the job's $NUM_NODES node(s) (#PBS -l select=N)" ;;
  esac
  abci_die "world size $WORLD_SIZE ($where x GPUS_PER_NODE=$GPUS_PER_NODE) is not divisible by TP x PP =" \
    "$tp x $pp = $block: use a multiple of $nodes node(s) (e.g. NUM_NODES=$nodes), or change TP/PP"
}

# The inputs are checked before setup_job loads modules: a wrong path fails in seconds, with
# nothing started.
prepare_training() {
  require_file "$DS_CONFIG"
  require_data_path "$DATA_PATH"
  set_tokenizer_args
  setup_job
  stage_data
  set_gpt_args
  if [ -n "${DATA_CACHE_PATH:-}" ]; then GPT_ARGS+=(--data-cache-path "$DATA_CACHE_PATH"); fi
}

# MPIRUN_CMD: the mpirun command line that runs "$@" on every GPU of every node.
build_mpirun_cmd() {
  local -a extra exports
  local name
  read -r -a extra <<< "${MPIRUN_EXTRA_ARGS:-}"
  exports=(-x MASTER_ADDR -x MASTER_PORT -x PATH -x LD_LIBRARY_PATH)
  # Remote ranks start with a fresh environment: forward the Python path and the NCCL/UCX/torch
  # communication settings (FORWARD_ENV_PATTERN) too.
  for name in $(compgen -e | grep -E "$FORWARD_ENV_PATTERN" | sort || true); do
    exports+=(-x "$name")
  done
  MPIRUN_CMD=("${MPIRUN:-mpirun}" -np "$WORLD_SIZE" -npernode "$GPUS_PER_NODE" -hostfile "$HOSTFILE"
              "${exports[@]}" -bind-to none -map-by slot "${extra[@]}" "$@")
}

# DRY_RUN=1: print the launch (hostfile, the exact mpirun line, the variables it forwards), then
# validate it with one local process (pretrain_gpt.py --dry-run --world-size N --gpu-memory-gb M,
# which also checks the layout's per-GPU memory estimate). Its exit status is the job's.
dry_run_launch() {
  local name
  check_world_size "$@"
  abci_note "DRY_RUN: hostfile $HOSTFILE:"
  sed 's/^/[abci]   /' "$HOSTFILE"
  abci_note "DRY_RUN: mpirun line:"
  printf '%q ' "${MPIRUN_CMD[@]}" | sed 's/ $//; s/^/[abci]   /'
  echo
  for name in MASTER_ADDR MASTER_PORT $(compgen -e | grep -E "$FORWARD_ENV_PATTERN" | sort || true); do
    abci_note "DRY_RUN:   $name=${!name}"
  done
  if ! command -v "${MPIRUN:-mpirun}" >/dev/null 2>&1; then
    abci_note "DRY_RUN: note: ${MPIRUN:-mpirun} is not on PATH here (the job loads ${HPCX_MODULE-hpcx})"
  fi
  local -a check=("$PYTHON" "$MEGATRON_DS_ENTRY" "$@" --dry-run --world-size "$WORLD_SIZE")
  if [ -n "${GPU_MEMORY_GB:-}" ]; then check+=(--gpu-memory-gb "$GPU_MEMORY_GB"); fi
  abci_note "DRY_RUN: ${check[*]}"
  if "${check[@]}"; then
    abci_note "DRY_RUN: OK: the job would start $WORLD_SIZE processes on $NUM_NODES node(s)"
  else
    abci_note "DRY_RUN: FAILED: fix the error above before submitting" >&2
    return 1
  fi
}

# Runs the entry point on every GPU of every node (or DRY_RUN=1: dry_run_launch), output also
# appended to $LOG_DIR/train.<job id>.log.
launch_training() {
  build_mpirun_cmd "$PYTHON" "$MEGATRON_DS_ENTRY" "$@" --use-mpi
  if [ "${DRY_RUN:-0}" = 1 ]; then
    dry_run_launch "$@"
    return
  fi
  command -v "${MPIRUN:-mpirun}" >/dev/null 2>&1 || abci_die "mpirun not found: load the hpcx" \
    "module (HPCX_MODULE) or put Open MPI on PATH"
  local log_file="${LOG_DIR:-$PWD/logs}/train.$JOB_NUMBER.log"
  mkdir -p "$(dirname "$log_file")"
  abci_note "log: $log_file"
  # A scheduler's SIGTERM/SIGUSR1/SIGUSR2 (walltime, qdel, qsig, s_rt) reaches every process of the
  # job: the ranks finish the iteration, save and exit, mpirun forwards it. This shell and tee ignore
  # it so that they outlive the save: the job must not end (and its ranks be killed) mid-save.
  trap '' TERM USR1 USR2
  # tee: PBS shows the job's stdout only at the end (unless -k oed); the log file is live.
  "${MPIRUN_CMD[@]}" 2>&1 | tee -a "$log_file"
  return "${PIPESTATUS[0]}"
}
