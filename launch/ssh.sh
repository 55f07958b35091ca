#!/usr/bin/env bash
# One `python -m hetjax.launch` per host over ssh; the first host is process 0 and the
# coordinator. Each host must have this repository at the same path (or HETJAX_REMOTE_DIR)
# with its environment set up, and passwordless ssh. If any process fails, the others
# are stopped.
#
#   launch/ssh.sh HOSTFILE [hetjax.launch arguments...]      (one host a line; # comments)
#   launch/ssh.sh hosts.txt --config gpt1p3b --config.offload.mode=stream \
#       --config.distributed.data_parallel=0
#
# Environment: HETJAX_PORT (default 12355), HETJAX_REMOTE_DIR (default: this directory),
# PYTHON (default .venv/bin/python).
set -euo pipefail
source "$(dirname "$0")/common.sh"
hostfile=${1:?usage: launch/ssh.sh HOSTFILE [hetjax.launch arguments...]}
shift
hosts=()
while read -r host _ || [[ -n $host ]]; do  # a line's first word; blank lines and '#' lines skipped
  [[ -z $host || $host == \#* ]] || hosts+=("$host")
done <"$hostfile"
n=${#hosts[@]}
if ((n == 0)); then
  echo "launch/ssh.sh: no hosts in $hostfile (one host a line, '#' starts a comment)" >&2
  exit 2
fi
port=${HETJAX_PORT:-12355}
dir=${HETJAX_REMOTE_DIR:-$PWD}
python=${PYTHON:-.venv/bin/python}
args=$(printf '%q ' "$@")
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for ((k = 0; k < n; k++)); do
  env="HETJAX_COORDINATOR=${hosts[0]}:$port HETJAX_NUM_PROCESSES=$n HETJAX_PROCESS_ID=$k"
  # -tt: the remote process dies with the ssh connection when this script stops it
  ssh -tt "${hosts[$k]}" "cd $(printf '%q' "$dir") && $env $python -m hetjax.launch $args" &
  pids+=($!)
done
status=0
wait_all "${pids[@]}" || status=$?  # the first failure stops the rest
exit "$status"
