#!/bin/bash
#$ -l rt_G.small=1
#$ -l h_rt=1:00:00
#$ -j y
#$ -cwd
#PBS -q rt_HG
#PBS -l select=1
#PBS -l walltime=1:00:00
#PBS -j oe
#PBS -k oed
# Build the Python environment the job scripts use, on a compute node with the training modules
# loaded (apex and other CUDA extensions must be compiled there, never on a login node):
#
#   ABCI 3.0:  qsub -P GROUP scripts/abci/setup_env.sh                    # H200 (rt_HG)
#   Grid Engine (ABCI 2.0's names):
#              qsub -g GROUP scripts/abci/setup_env.sh                    # V100 (rt_G.small)
#              qsub -g GROUP -l rt_AG.small=1 scripts/abci/setup_env.sh   # for A100 jobs
#   or inside qsub -I / qrsh:  bash scripts/abci/setup_env.sh
#
# (one file serves both systems: PBS reads the #PBS lines, Grid Engine the #$ lines; outside a job,
# ABCI_SYSTEM=3 picks ABCI 3.0's module names, ABCI 2.0's otherwise.) Steps, each
# skipped when already done with the same inputs, so re-running is cheap and safe:
#   1. module load cuda / cudnn / nccl / hpcx (the job scripts' list, common.sh), python on ABCI 3.0
#   2. the venv VENV_DIR (default: <repo>/.venv, where the job scripts look for it)
#   3. torch: TORCH_SPEC (default "torch", whose Linux wheels are CUDA builds) with TORCH_PIP_ARGS
#      (e.g. "--index-url <a CUDA 12.8 wheel index>" to match the loaded CUDA module)
#   4. DeepSpeed and the other requirements, then this package (pip install -e, C++ helpers) with
#      its tensorboard extra (the job scripts write TensorBoard events)
#   5. BUILD_APEX=1: apex with its CUDA extensions for TORCH_CUDA_ARCH_LIST (default: the GPUs
#      of this node; else by resource type: V100 7.0, A100 8.0, H200 9.0), APEX_SRC (a checkout
#      or pip URL, default NVIDIA's git repository), MAX_JOBS compile processes
#   6. tools/check_env.py: what training start-up will use (fused kernels, flash attention, NCCL)
# SETUP_SKIP_INSTALL=1 prints steps 2-5 instead of running them (tests; checking a plan).
set -euo pipefail
cd "${PBS_O_WORKDIR:-$PWD}"  # PBS starts jobs in $HOME

for MEGATRON_DS_ROOT in "${MEGATRON_DS_ROOT:-}" "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." \
    2>/dev/null && pwd)" "$PWD"; do
  [ -n "$MEGATRON_DS_ROOT" ] && [ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] && break
done
[ -f "$MEGATRON_DS_ROOT/scripts/abci/common.sh" ] || { echo "ERROR: megatron_ds repository not" \
  "found: qsub from its root or set MEGATRON_DS_ROOT" >&2; exit 1; }
source "$MEGATRON_DS_ROOT/scripts/abci/common.sh"

VENV_DIR=${VENV_DIR:-$MEGATRON_DS_ROOT/.venv}
TORCH_SPEC=${TORCH_SPEC:-torch}
TORCH_PIP_ARGS=${TORCH_PIP_ARGS:-}
BUILD_APEX=${BUILD_APEX:-0}
APEX_SRC=${APEX_SRC:-git+https://github.com/NVIDIA/apex.git}
MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 8)}
# ABCI 3.0's system python is 3.9; the python module gives 3.12 (https://docs.abci.ai/v3/en/python/).
: "${ABCI3_PYTHON_MODULE=python/3.12/3.12.9}"
: "${ABCI2_PYTHON_MODULE=}"
PYTHON_BIN=${PYTHON_BIN:-python3}
SETUP_SKIP_INSTALL=${SETUP_SKIP_INSTALL:-0}
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}  # DeepSpeed compiles the ops it needs at first use

# Runs a step (or prints it with SETUP_SKIP_INSTALL=1).
run_step() {
  if [ "$SETUP_SKIP_INSTALL" = 1 ]; then
    echo "[setup] would run: $*"
  else
    echo "[setup] $*"
    "$@"
  fi
}

# A step is redone only when its inputs (the text after the name) changed since it last succeeded.
stamp_ok() { [ -f "$VENV_DIR/.setup-$1" ] && [ "$(cat "$VENV_DIR/.setup-$1")" = "$2" ]; }
stamp_set() { [ "$SETUP_SKIP_INSTALL" = 1 ] || printf '%s' "$2" > "$VENV_DIR/.setup-$1"; }

# TORCH_CUDA_ARCH_LIST for extension builds: this node's GPUs, else the resource type's GPU.
cuda_arch_list() {
  local caps
  if command -v nvidia-smi >/dev/null 2>&1; then
    caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sort -u | paste -sd';' -)
    if [ -n "$caps" ]; then echo "$caps"; return 0; fi
  fi
  case "${RESOURCE_TYPE:-${PBS_QUEUE:-}}" in
    rt_F|rt_G.*) echo "7.0" ;;
    rt_AF|rt_AG.*) echo "8.0" ;;
    rt_HF|rt_HG) echo "9.0" ;;
    *) case "$(abci_system)" in 3) echo "9.0" ;; *) echo "7.0;8.0;9.0" ;; esac ;;
  esac
}

load_python_module() {
  local name
  case "$(abci_system)" in 3) name=${PYTHON_MODULE-$ABCI3_PYTHON_MODULE} ;; *) name=${PYTHON_MODULE-$ABCI2_PYTHON_MODULE} ;; esac
  [ -n "$name" ] && command -v module >/dev/null 2>&1 || return 0
  case $- in *u*) set +u; module load "$name" || abci_die "module load $name failed (set PYTHON_MODULE)"; set -u ;;
             *) module load "$name" || abci_die "module load $name failed (set PYTHON_MODULE)" ;; esac
}

make_venv() {
  if [ -x "$VENV_DIR/bin/python" ]; then
    echo "[setup] ok: venv $VENV_DIR ($("$VENV_DIR/bin/python" --version 2>&1))"
  else
    run_step "$PYTHON_BIN" -m venv "$VENV_DIR"
    run_step "$VENV_DIR/bin/python" -m pip install -q --upgrade pip
  fi
}

install_packages() {
  local py="$VENV_DIR/bin/python" key
  local -a pip torch_args
  read -r -a pip <<< "${PIP:-$py -m pip}"
  read -r -a torch_args <<< "$TORCH_PIP_ARGS"
  key="$TORCH_SPEC $TORCH_PIP_ARGS"
  if stamp_ok torch "$key"; then echo "[setup] ok: torch ($key)"; else
    run_step "${pip[@]}" install -q "$TORCH_SPEC" "${torch_args[@]}"; stamp_set torch "$key"; fi
  # torch is already there: the requirements must not replace it with another build.
  key=$(cat "$MEGATRON_DS_ROOT/requirements.txt" "$MEGATRON_DS_ROOT/setup.py" | cksum)
  if stamp_ok packages "$key"; then echo "[setup] ok: DeepSpeed, requirements and megatron_ds"; else
    run_step "${pip[@]}" install -q -r "$MEGATRON_DS_ROOT/requirements.txt" \
      --constraint <("$py" -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null || true)
    run_step "${pip[@]}" install -q --no-build-isolation -e "${MEGATRON_DS_ROOT}[tensorboard]"
    stamp_set packages "$key"
  fi
  if [ "$BUILD_APEX" = 1 ]; then
    key="$APEX_SRC $TORCH_CUDA_ARCH_LIST ${CUDA_MODULE-}"
    if stamp_ok apex "$key"; then echo "[setup] ok: apex ($key)"; else
      # --cpp_ext/--cuda_ext (apex's README; APEX_CPP_EXT/APEX_CUDA_EXT in newer apex): its fused
      # kernels (FusedLayerNorm, FusedAdam); without them apex is a Python shell whose layers fail
      # at first use (megatron_ds then uses torch's).
      run_step env MAX_JOBS="$MAX_JOBS" TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
        "${pip[@]}" install -v --no-build-isolation --no-deps \
        --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" "$APEX_SRC"
      stamp_set apex "$key"
    fi
  fi
}

main() {
  detect_scheduler
  load_modules
  load_python_module
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(cuda_arch_list)}
  abci_note "setup: scheduler=$SCHEDULER venv=$VENV_DIR torch=$TORCH_SPEC apex=$BUILD_APEX" \
    "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
  if [ "$SCHEDULER" = none ] && [ "$BUILD_APEX" = 1 ] && [ "$SETUP_SKIP_INSTALL" != 1 ]; then
    abci_die "BUILD_APEX=1 outside a job: build apex on a compute node (qsub this script)"
  fi
  make_venv
  if [ "$SETUP_SKIP_INSTALL" = 1 ] || [ -x "$VENV_DIR/bin/python" ]; then install_packages; fi
  local -a check=("$VENV_DIR/bin/python" "$MEGATRON_DS_ROOT/tools/check_env.py")
  if command -v nvidia-smi >/dev/null 2>&1; then check+=(--require-cuda); fi
  if [ -x "$VENV_DIR/bin/python" ]; then
    "${check[@]}"
  else
    echo "[setup] would run: ${check[*]}"
  fi
  abci_note "setup done: the job scripts use $VENV_DIR/bin/python (PYTHON overrides)"
}

main "$@"
