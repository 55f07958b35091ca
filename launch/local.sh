#!/usr/bin/env bash
# N processes of `python -m hetjax.launch` on this machine (the CPU path: gloo
# collectives over localhost). Process 0 prints to the terminal; the others log to
# <workdir>/proc<k>.log. If any process fails, the others are stopped; with
# --max-restarts R all are then started again, from the newest checkpoint, up to R times.
# SIGTERM or SIGUSR1 to this script go to every process (they checkpoint and exit 75).
#
#   launch/local.sh N [--max-restarts R] [hetjax.launch arguments...]
#   launch/local.sh 2 --config gpt_tiny --workdir runs/zero2 --config.offload.mode=stream \
#       --config.distributed.data_parallel=0
#
# A process that fails is named with its log's last lines.
#
# Environment: HETJAX_PORT (coordinator port, default 12355), HETJAX_DEVICES_PER_PROCESS
# (virtual CPU devices per process, default 1; ignored when XLA_FLAGS is set),
# PYTHON (default: an active virtual environment's python3, else this repository's
# .venv/bin/python if there is one, else python3).
set -euo pipefail
launcher=launch/local.sh
source "$(dirname "$0")/common.sh"
n=${1:?usage: launch/local.sh NUM_PROCESSES [--max-restarts R] [hetjax.launch arguments...]}
shift
take_max_restarts "$@"
port=${HETJAX_PORT:-12355}
python=${PYTHON:-$(default_python "$(dirname "$0")/..")}
workdir=runs/local
for ((i = 0; i < ${#args[@]}; i++)); do  # find --workdir for the logs
  if [[ ${args[i]} == --workdir ]]; then workdir=${args[i + 1]}; fi
  if [[ ${args[i]} == --workdir=* ]]; then workdir=${args[i]#--workdir=}; fi
done
mkdir -p "$workdir"
export XLA_FLAGS=${XLA_FLAGS:---xla_force_host_platform_device_count=${HETJAX_DEVICES_PER_PROCESS:-1}}
export HETJAX_COORDINATOR=localhost:$port HETJAX_NUM_PROCESSES=$n

start_all() {
  for ((k = 1; k < n; k++)); do
    HETJAX_PROCESS_ID=$k "$python" -m hetjax.launch "${args[@]}" >>"$workdir/proc$k.log" 2>&1 &
    pids+=($!)
    names[$!]="process $k"
    logs[$!]="$workdir/proc$k.log"
  done
  HETJAX_PROCESS_ID=0 "$python" -m hetjax.launch "${args[@]}" &
  pids+=($!)
  names[$!]="process 0"
}

status=0
supervise "$max_restarts" || status=$?
exit "$status"
