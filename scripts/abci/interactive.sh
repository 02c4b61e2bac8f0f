#!/bin/bash
# Run a job script's training on the node(s) of an interactive job, the same way the batch job
# would (same modules, hostfile, mpirun line, flags):
#
#   ABCI 3.0:  qsub -I -P GROUP -q rt_HF -l select=1:mpiprocs=8 -l walltime=1:00:00
#   Grid Engine (ABCI 2.0's names):  qrsh -g GROUP -l rt_F=1 -l h_rt=1:00:00
#   then, in the repository:
#              bash scripts/abci/interactive.sh scripts/abci/abci3_h200_gpt_1.3b.sh --train-iters 20
#
# Arguments after the job script go to pretrain_gpt.py (the last value of a flag wins); every
# variable of the job script can be set in front (TP=2 NUM_LAYERS=4 bash scripts/abci/...).
# Run outside an interactive job, it prints the qsub -I / qrsh command that gets one for that
# script (its resource type and node count, from its #$ / #PBS header) and exits 1; DRY_RUN=1
# works anywhere.
#
# Differences from the batch job, because an interactive session is short and typed into:
# - data/, checkpoints/ and runs/ go under the current directory (WORK_DIR), not the directory
#   qsub -I was started from;
# - training saves and exits SESSION_MARGIN_MINS (default 5) before the session's walltime (asked
#   from qstat; INTERACTIVE_MINUTES overrides it, default 60, ABCI's default elapsed-time limit)
#   instead of the batch walltime the job script assumes.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "[interactive] ERROR: $*" >&2; exit 1; }
note() { echo "[interactive] $*"; }

[ $# -ge 1 ] || die "usage: bash scripts/abci/interactive.sh JOB_SCRIPT [pretrain_gpt.py flags...]"
SCRIPT=$1; shift
if [ ! -f "$SCRIPT" ] && [ -f "$HERE/$SCRIPT" ]; then SCRIPT=$HERE/$SCRIPT; fi
[ -f "$SCRIPT" ] || die "job script not found: $SCRIPT (e.g. scripts/abci/abci3_h200_gpt_1.3b.sh)"

# The interactive command matching the script's header.
allocation_command() {
  local rt nodes
  if grep -q '^#PBS ' "$SCRIPT"; then
    rt=$(sed -n 's/^#PBS -q \([^ ]*\).*/\1/p' "$SCRIPT" | head -n 1)
    nodes=$(sed -n 's/^#PBS -l select=\([^ ]*\).*/\1/p' "$SCRIPT" | head -n 1)
    echo "qsub -I -P GROUP -q ${rt:-rt_HF} -l select=${nodes:-1} -l walltime=1:00:00"
  else
    rt=$(sed -n 's/^#\$ -l \(rt_[A-Za-z.]*=[0-9]*\).*/\1/p' "$SCRIPT" | head -n 1)
    echo "qrsh -g GROUP -l ${rt:-rt_F=1} -l h_rt=1:00:00"
  fi
}

# The session's walltime in minutes, from the scheduler (empty if it can't be asked).
session_minutes() {
  local out
  if [ -n "${PBS_JOBID:-}" ] && command -v qstat >/dev/null 2>&1; then
    out=$(qstat -f "$PBS_JOBID" 2>/dev/null | sed -n 's/^ *Resource_List.walltime = //p' | head -n 1)
    [ -n "$out" ] && echo "$out" | awk -F: '{ print $1 * 60 + $2 }'
  elif [ -n "${JOB_ID:-}" ] && command -v qstat >/dev/null 2>&1; then
    # Grid Engine: "hard resource_list: ...h_rt=3600..." (seconds)
    out=$(qstat -j "$JOB_ID" 2>/dev/null | sed -n 's/.*h_rt=\([0-9]*\).*/\1/p' | head -n 1)
    [ -n "$out" ] && echo $((out / 60))
  fi
  return 0
}

if [ -z "${SGE_JOB_HOSTLIST:-}" ] && [ -z "${PBS_NODEFILE:-}" ] && [ "${DRY_RUN:-0}" != 1 ]; then
  die "not inside an interactive job. Get one with:
    $(allocation_command)
then run this command again in the repository (or add DRY_RUN=1 to only validate)."
fi

minutes=${INTERACTIVE_MINUTES:-$(session_minutes)}
minutes=${minutes:-60}
margin=${SESSION_MARGIN_MINS:-5}
[ "$minutes" -gt "$margin" ] || die "the session has $minutes minutes: too short for a save $margin minutes before its end"
export EXIT_DURATION_IN_MINS=${EXIT_DURATION_IN_MINS:-$((minutes - margin))}
export WORK_DIR=${WORK_DIR:-$PWD}
MEGATRON_DS_ROOT=${MEGATRON_DS_ROOT:-$(cd "$HERE/../.." && pwd)}
export MEGATRON_DS_ROOT
note "$(basename "$SCRIPT") in a ${PBS_ENVIRONMENT:-interactive} session: work dir $WORK_DIR," \
  "saving and exiting after $EXIT_DURATION_IN_MINS of $minutes minutes"
exec bash "$SCRIPT" "$@"
