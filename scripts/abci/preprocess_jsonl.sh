#!/bin/bash
#$ -l rt_C.large=1
#$ -l h_rt=12:00:00
#$ -j y
#$ -cwd
#PBS -q rt_HC
#PBS -l select=1
#PBS -l walltime=12:00:00
#PBS -j oe
#PBS -k oed
# Tokenize a directory of JSONL files (.jsonl / .jsonl.gz) into Megatron's .bin/.idx on a CPU node,
# with every core of the job, staging through node-local storage:
#
#   ABCI 3.0 (rt_HC, 32 cores):       qsub -P GROUP -v INPUT_DIR=...,OUTPUT_PREFIX=... scripts/abci/preprocess_jsonl.sh
#   Grid Engine (rt_C.large, 20):     qsub -g GROUP -v INPUT_DIR=...,OUTPUT_PREFIX=... scripts/abci/preprocess_jsonl.sh
#   interactively (qsub -I / qrsh):   bash scripts/abci/preprocess_jsonl.sh INPUT_DIR OUTPUT_PREFIX [flags]
#
# (one file serves both systems: PBS reads the #PBS lines, Grid Engine the #$ lines.)
# Writes OUTPUT_PREFIX_<key>_document.{bin,idx} (key: each of JSON_KEYS, default "text"). Steps:
#   1. copy the corpus to the node-local directory ($SGE_LOCALDIR / $PBS_LOCALDIR): the tokenizer
#      processes then read local disk, not the shared file system;
#   2. tools/preprocess_data.py with WORKERS processes (default: the job's cores), output on the
#      node-local disk;
#   3. copy each .bin, then .idx, into the group area under a temporary name and rename it: a
#      training job never sees a half-written file, and the .idx appearing last means "complete".
# Outputs already present are kept (FORCE=1 rebuilds them). Variables: INPUT_DIR, OUTPUT_PREFIX,
# JSON_KEYS, TOKENIZER_TYPE (GPT2BPETokenizer), VOCAB_FILE, MERGE_FILE, TOKENIZER_MODEL,
# APPEND_EOD (1), WORKERS, PYTHON, STAGING_DIR (default: the node-local directory). Flags after
# the two paths go to preprocess_data.py (e.g. --split-sentences, --strict).
set -euo pipefail
cd "${PBS_O_WORKDIR:-$PWD}"  # PBS starts jobs in $HOME

for MEGATRON_DS_ROOT in "${MEGATRON_DS_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." \
    2>/dev/null && pwd)" "$PWD"; do
  [ -n "$MEGATRON_DS_ROOT" ] && [ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] && break
done
[ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] || { echo "ERROR: megatron_ds repository not" \
  "found: qsub from its root or set MEGATRON_DS_ROOT" >&2; exit 1; }
source "$MEGATRON_DS_ROOT/scripts/abci/common.sh"

if [ $# -ge 2 ]; then INPUT_DIR=$1; OUTPUT_PREFIX=$2; shift 2; fi
if [ -z "${INPUT_DIR:-}" ] || [ -z "${OUTPUT_PREFIX:-}" ]; then
  abci_die "usage: preprocess_jsonl.sh INPUT_DIR OUTPUT_PREFIX [preprocess_data.py flags]" \
    "(or INPUT_DIR=... OUTPUT_PREFIX=... in the environment)"
fi
case "$OUTPUT_PREFIX" in /*) ;; *) OUTPUT_PREFIX=$PWD/$OUTPUT_PREFIX ;; esac
[ -d "$INPUT_DIR" ] || abci_die "INPUT_DIR=$INPUT_DIR is not a directory"
read -r -a JSON_KEYS_ARR <<< "${JSON_KEYS:-text}"
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
DATA_DIR=${DATA_DIR:-$PWD/data}
VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/gpt2/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$DATA_DIR/gpt2/gpt2-merges.txt}
APPEND_EOD=${APPEND_EOD:-1}
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 4)}
if [ -z "${PYTHON:-}" ]; then  # the venv setup_env.sh builds, as the job scripts use it
  if [ -x "$MEGATRON_DS_ROOT/.venv/bin/python" ]; then PYTHON=$MEGATRON_DS_ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

outputs_present() {
  local key
  for key in "${JSON_KEYS_ARR[@]}"; do
    [ -f "${OUTPUT_PREFIX}_${key}_document.bin" ] && [ -f "${OUTPUT_PREFIX}_${key}_document.idx" ] || return 1
  done
}

# Copy $1 to $2 under a temporary name in $2's directory, then rename (atomic on one file system).
publish() {
  if ! { cp "$1" "$2.part.$$" && mv -f "$2.part.$$" "$2"; }; then
    rm -f "$2.part.$$"
    abci_die "could not write $2"
  fi
}

main() {
  local stage files key base tokenizer_args=()
  detect_scheduler
  if outputs_present && [ "${FORCE:-0}" != 1 ]; then
    abci_note "ok: ${OUTPUT_PREFIX}_{${JSON_KEYS_ARR[*]}}_document.{bin,idx} already present (FORCE=1 rebuilds)"
    return 0
  fi
  mapfile -t files < <(find "$INPUT_DIR" -maxdepth 1 -type f \( -name '*.jsonl' -o -name '*.jsonl.gz' \
    -o -name '*.json' -o -name '*.json.gz' \) | sort)
  [ "${#files[@]}" -gt 0 ] || abci_die "no .jsonl/.jsonl.gz/.json files in $INPUT_DIR"
  set_tokenizer_args  # common.sh: checks the files, sets TOKENIZER_ARGS
  tokenizer_args=("${TOKENIZER_ARGS[@]}")
  stage=${STAGING_DIR:-$(node_local_dir)}
  if [ -z "$stage" ]; then
    stage=$(mktemp -d)
    abci_note "no node-local directory (not in a job): staging in $stage"
  fi
  stage="$stage/preprocess.$$"
  mkdir -p "$stage/input" "$stage/output" "$(dirname "$OUTPUT_PREFIX")"
  abci_note "staging ${#files[@]} file(s), $(du -shcL "${files[@]}" | tail -n 1 | cut -f1), to $stage/input"
  cp "${files[@]}" "$stage/input/"
  base=$(basename "$OUTPUT_PREFIX")
  local -a cmd=("$PYTHON" "$MEGATRON_DS_ROOT/tools/preprocess_data.py" --input "$stage/input"
                --output-prefix "$stage/output/$base" --json-keys "${JSON_KEYS_ARR[@]}" "${tokenizer_args[@]}"
                --workers "$WORKERS")
  [ "$APPEND_EOD" = 1 ] && cmd+=(--append-eod)
  abci_note "tokenizing with $WORKERS workers: ${cmd[*]} $*"
  "${cmd[@]}" "$@"
  for key in "${JSON_KEYS_ARR[@]}"; do
    publish "$stage/output/${base}_${key}_document.bin" "${OUTPUT_PREFIX}_${key}_document.bin"
    publish "$stage/output/${base}_${key}_document.idx" "${OUTPUT_PREFIX}_${key}_document.idx"
    abci_note "wrote ${OUTPUT_PREFIX}_${key}_document.{bin,idx}"
  done
  rm -rf "$stage"
  abci_note "use: DATA_PATH=${OUTPUT_PREFIX}_${JSON_KEYS_ARR[0]}_document"
}

main "$@"
