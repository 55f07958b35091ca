#!/usr/bin/env bash
# N processes of `python -m hetjax.launch` on this machine (the CPU path: gloo
# collectives over localhost). Process 0 prints to the terminal; the others log to
# <workdir>/proc<k>.log. If any process fails, the others are stopped.
#
#   launch/local.sh N [hetjax.launch arguments...]
#   launch/local.sh 2 --config gpt_tiny --workdir runs/zero2 --config.offload.mode=stream \
#       --config.distributed.data_parallel=0
#
# Environment: HETJAX_PORT (coordinator port, default 12355), HETJAX_DEVICES_PER_PROCESS
# (virtual CPU devices per process, default 1; ignored when XLA_FLAGS is set),
# PYTHON (default python3).
set -euo pipefail
source "$(dirname "$0")/common.sh"
n=${1:?usage: launch/local.sh NUM_PROCESSES [hetjax.launch arguments...]}
shift
port=${HETJAX_PORT:-12355}
python=${PYTHON:-python3}
workdir=runs/local
for ((i = 1; i <= $#; i++)); do  # find --workdir for the logs
  if [[ ${!i} == --workdir ]]; then j=$((i + 1)); workdir=${!j}; fi
  if [[ ${!i} == --workdir=* ]]; then workdir=${!i#--workdir=}; fi
done
mkdir -p "$workdir"
export XLA_FLAGS=${XLA_FLAGS:---xla_force_host_platform_device_count=${HETJAX_DEVICES_PER_PROCESS:-1}}
export HETJAX_COORDINATOR=localhost:$port HETJAX_NUM_PROCESSES=$n
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for ((k = 1; k < n; k++)); do
  HETJAX_PROCESS_ID=$k "$python" -m hetjax.launch "$@" >"$workdir/proc$k.log" 2>&1 &
  pids+=($!)
done
HETJAX_PROCESS_ID=0 "$python" -m hetjax.launch "$@" &
pids+=($!)
status=0
wait_all "${pids[@]}" || status=$?  # the first failure stops the rest
exit "$status"
