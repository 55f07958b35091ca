#!/usr/bin/env bash
# One `python -m hetjax.launch` per host over ssh; the first host is process 0 and the
# coordinator. Each host must have this repository at the same path (or HETJAX_REMOTE_DIR)
# with its environment set up, and passwordless ssh. If any process fails, the others
# are stopped; with --max-restarts R all are then started again on the same hosts, from
# the newest checkpoint (checkpoint.dir on a file system every host sees), up to R times.
#
#   launch/ssh.sh HOSTFILE [--max-restarts R] [hetjax.launch arguments...]
#       (one host a line; # comments)
#   launch/ssh.sh hosts.txt --config gpt1p3b --config.offload.mode=stream \
#       --config.distributed.data_parallel=0
#
# Environment: HETJAX_PORT (default 12355), HETJAX_REMOTE_DIR (default: this directory),
# PYTHON (default .venv/bin/python), HETJAX_SSH_OPTIONS (options for ssh, split at
# blanks, e.g. "-F cluster_ssh_config" or "-p 2222 -i ~/.ssh/cluster"). The processes
# get the remote login's environment, not this shell's.
set -euo pipefail
launcher=launch/ssh.sh
source "$(dirname "$0")/common.sh"
hostfile=${1:?usage: launch/ssh.sh HOSTFILE [--max-restarts R] [hetjax.launch arguments...]}
shift
take_max_restarts "$@"
hosts=()
while read -r host _ || [[ -n $host ]]; do  # a line's first word; blank lines and '#' lines skipped
  [[ -z $host || $host == \#* ]] || hosts+=("$host")
done <"$hostfile"
n=${#hosts[@]}
if ((n == 0)); then
  say "no hosts in $hostfile (one host a line, '#' starts a comment)"
  exit 2
fi
port=${HETJAX_PORT:-12355}
dir=${HETJAX_REMOTE_DIR:-$PWD}
python=${PYTHON:-.venv/bin/python}
read -ra ssh_options <<<"${HETJAX_SSH_OPTIONS:-}"
remote_args=""
((${#args[@]} == 0)) || remote_args=$(printf '%q ' "${args[@]}")

start_all() {
  local k env
  for ((k = 0; k < n; k++)); do
    env="HETJAX_COORDINATOR=${hosts[0]}:$port HETJAX_NUM_PROCESSES=$n HETJAX_PROCESS_ID=$k"
    # -tt: the remote process dies with the ssh connection when this script stops it
    ssh "${ssh_options[@]}" -tt "${hosts[$k]}" \
      "cd $(printf '%q' "$dir") && $env $python -m hetjax.launch $remote_args" &
    pids+=($!)
    names[$!]="process $k (${hosts[$k]})"
  done
}

status=0
supervise "$max_restarts" || status=$?
exit "$status"
