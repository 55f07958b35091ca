#!/usr/bin/env bash
# One `python -m hetjax.launch` per SLURM task; hetjax reads SLURM_NTASKS, SLURM_PROCID
# and the first host of SLURM_STEP_NODELIST (coordinator port HETJAX_COORDINATOR_PORT,
# default 12355). Submit with sbatch, or run inside an allocation:
#
#   sbatch --nodes=4 --ntasks-per-node=1 launch/slurm.sh --config gpt1p3b \
#       --config.offload.mode=stream --config.distributed.data_parallel=0
#
# One task per node drives all of its node's accelerators; the time limit, partition and
# GPUs per node are the site's sbatch options. PYTHON: the Python to run (default: an
# active virtual environment's python3, else .venv/bin/python in the directory the job
# was submitted from if there is one, else python3).
#
# A task that fails ends the job step at once: it says which and cancels the step, so
# the others stop now rather than after distributed.timeout_s. Not srun's
# --kill-on-bad-exit: a preempted task exits 75 and the others, stopping at the same
# step, must be left to finish.
#
# Two minutes before the time limit SLURM sends SIGUSR1 to the batch shell, which is srun
# (exec below); srun forwards it to every task, and hetjax stops between two steps with a
# complete checkpoint and exit status 75 (docs/guide/checkpoints.md, "Preemption"), the
# job's exit code. Requeue then resumes: submit with --requeue and `scontrol requeue
# JOBID` once it ended 75 (or resubmit the same command). Raise the lead time above one
# step plus two checkpoint writes for large models: sbatch --signal=B:USR1@600 ...
# (SLURM may send it up to a minute early, and a signal that arrives while the processes
# are still starting, before their first step, ends them.)
#SBATCH --job-name=hetjax
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:USR1@120
set -euo pipefail
export HETJAX_COORDINATOR_PORT=${HETJAX_COORDINATOR_PORT:-12355}
# (launch/common.sh's default_python, inline: sbatch runs a copy of this script, away from
# the repository's other files)
python=python3
[[ -n ${VIRTUAL_ENV:-} || ! -x .venv/bin/python ]] || python=.venv/bin/python
# Each task, in bash: runs hetjax (the signals SLURM sends the step reach it directly:
# the traps only keep this shell alive to see its status), and when it fails with
# anything but 75, cancels the step.
task='trap : TERM USR1
status=0
"$0" -m hetjax.launch "$@" || status=$?
if ((status != 0 && status != 75)); then
  how="exit status $status"
  ((status <= 128)) || how+=": killed by SIG$(kill -l $((status - 128)))"
  echo "launch/slurm.sh: task $SLURM_PROCID on $(hostname) failed ($how); ending the other tasks" >&2
  scancel --signal=KILL "$SLURM_JOB_ID.$SLURM_STEP_ID"
fi
exit "$status"'
exec srun --kill-on-bad-exit=0 bash -c "$task" "${PYTHON:-$python}" "$@"
