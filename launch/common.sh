# Shared by launch/local.sh and launch/ssh.sh (sourced, not run).
#
# A script sets `launcher` (its name, for messages), defines start_all (starts every
# process, in the background, appending each one's pid to `pids`, its name, e.g.
# "process 1 (node-b)", to `names[pid]` and, where its output goes to a file, that file
# to `logs[pid]`) and calls `supervise MAX_RESTARTS`.

pids=()
declare -A names=() logs=()
signalled=""  # the stop signal this script got, if any: no restart after it
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
# SIGTERM or SIGUSR1 to the script (a scheduler's preemption) go to every process, which
# checkpoints and exits 75; the script waits for them and exits with their status.
# Ctrl-C (SIGINT) reaches local processes itself; the others get SIGTERM.
forward() {
  signalled=$1
  kill -"$2" "${pids[@]}" 2>/dev/null || true
}
trap 'forward TERM TERM' TERM
trap 'forward USR1 USR1' USR1
trap 'forward INT TERM' INT

say() { echo "$launcher: $*" >&2; }

# default_python DIR: the Python to run hetjax with when PYTHON is not set: an active
# virtual environment's (python3 on PATH), else DIR/.venv/bin/python where the README's
# set-up made one, else python3.
default_python() {
  if [[ -z ${VIRTUAL_ENV:-} && -x $1/.venv/bin/python ]]; then
    echo "$1/.venv/bin/python"
  else
    echo python3
  fi
}

# failed PID STATUS WHAT: says that process PID failed with STATUS (WHAT: what happens
# next), and where its output went to a log, names the log and shows its last lines
# (the cause, e.g. a Python without JAX, is there, not on this terminal).
failed() {
  say "${names[$1]:-process $1} failed ($(status_words "$2"))$3"
  local log=${logs[$1]:-}
  if [[ -n $log && -s $log ]]; then
    say "its output is in $log, which ends:"
    tail -n 10 "$log" | sed 's/^/    /' >&2
  fi
}

# status_words STATUS: "exit status 3", or "killed by SIGKILL" for 128+N.
status_words() {
  if (($1 > 128)) && kill -l "$(($1 - 128))" >/dev/null 2>&1; then
    echo "exit status $1: killed by SIG$(kill -l "$(($1 - 128))")"
  else
    echo "exit status $1"
  fi
}

# stop PID...: SIGTERM, and SIGKILL to those still running 10 s later (a process whose
# peer died may be stuck in a collective: hetjax takes SIGTERM as "checkpoint and stop",
# which needs every process); returns once all have ended.
stop() {
  kill "$@" 2>/dev/null || true
  # the pids stay ours (unreaped) until the wait below, so the delayed kill cannot hit
  # another process
  (sleep 10 && kill -KILL "$@") >/dev/null 2>&1 &
  local killer=$! pid
  for pid; do
    while kill -0 "$pid" 2>/dev/null; do  # (a trapped signal may interrupt a wait)
      wait "$pid" 2>/dev/null && break
    done
  done
  kill "$killer" 2>/dev/null || true
}

# wait_all: waits for every process of `pids`; when one fails, says which, stops the
# others (stop), waits for them and returns the failed one's status. 75 when a
# process stopped preempted and none failed (the others stop at the same step: they are
# left to finish); 0 when all succeed.
wait_all() {
  local running=("${pids[@]}") finished pid rest status preempted=0
  while ((${#running[@]})); do
    status=0
    finished=""
    wait -n -p finished "${running[@]}" || status=$?
    [[ -n ${finished:-} ]] || continue  # a trapped signal interrupted the wait (and unset it)
    rest=()
    for pid in "${running[@]}"; do
      [[ $pid == "$finished" ]] || rest+=("$pid")
    done
    running=("${rest[@]}")
    if ((status == 75)); then
      preempted=75
    elif ((status)); then
      if ((${#running[@]})); then
        failed "$finished" "$status" "; stopping the other ${#running[@]}"
        stop "${running[@]}"
      else
        failed "$finished" "$status" ""
      fi
      return "$status"
    fi
  done
  return "$preempted"
}

# take_max_restarts ARGS...: sets `max_restarts` (from --max-restarts N or
# --max-restarts=N, default 0) and `args` (ARGS without it).
take_max_restarts() {
  max_restarts=0
  args=()
  while (($#)); do
    case $1 in
      --max-restarts) max_restarts=${2:?--max-restarts needs a number}; shift 2 ;;
      --max-restarts=*) max_restarts=${1#--max-restarts=}; shift ;;
      *) args+=("$1"); shift ;;
    esac
  done
  if ! [[ $max_restarts =~ ^[0-9]+$ ]]; then
    echo "$launcher: --max-restarts takes a number of restarts (0, 1, ...), not '$max_restarts'" >&2
    exit 2
  fi
}

# supervise MAX_RESTARTS: start_all, then wait_all. When a process fails, all are
# stopped and, up to MAX_RESTARTS times, started again: `python -m hetjax.launch`
# resumes from the newest complete checkpoint. Not restarted: success (0), a bad
# config (2, it would fail again), preemption (75, the run checkpointed and stopped on
# a signal: the scheduler's decision) and anything after a stop signal to the script.
# Returns the last status.
supervise() {
  local max=$1 restart=0 status
  while :; do
    pids=()
    names=()
    logs=()
    start_all
    status=0
    wait_all || status=$?
    if ((status == 0 || status == 2 || status == 75)) || [[ -n $signalled ]]; then
      return "$status"
    fi
    if ((restart >= max)); then
      ((max == 0)) || say "giving up: $max restart(s) used"
      return "$status"
    fi
    restart=$((restart + 1))
    say "restart $restart of $max: starting all ${#pids[@]} processes again, from the newest checkpoint"
  done
}
