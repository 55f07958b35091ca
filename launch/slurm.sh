#!/usr/bin/env bash
# One `python -m hetjax.launch` per SLURM task; hetjax reads SLURM_NTASKS, SLURM_PROCID
# and the first host of SLURM_STEP_NODELIST (coordinator port HETJAX_COORDINATOR_PORT,
# default 12355). Submit with sbatch, or run inside an allocation:
#
#   sbatch --nodes=4 --ntasks-per-node=1 launch/slurm.sh --config gpt1p3b \
#       --config.offload.mode=stream --config.distributed.data_parallel=0
#
# One task per node drives all of its node's accelerators; the time limit, partition and
# GPUs per node are the site's sbatch options.
#
# Two minutes before the time limit SLURM sends SIGUSR1 to the batch shell, which is srun
# (exec below); srun forwards it to every task, and hetjax stops between two steps with a
# complete checkpoint and exit status 75 (docs/guide/checkpoints.md, "Preemption"): requeue,
# and the same command resumes. Raise the lead time above one step plus two checkpoint
# writes for large models: sbatch --signal=B:USR1@600 ...
#SBATCH --job-name=hetjax
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:USR1@120
set -euo pipefail
export HETJAX_COORDINATOR_PORT=${HETJAX_COORDINATOR_PORT:-12355}
# --kill-on-bad-exit: one failed task ends the step instead of leaving the others waiting
exec srun --kill-on-bad-exit=1 "${PYTHON:-python3}" -m hetjax.launch "$@"
