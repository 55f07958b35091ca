# Shared by launch/local.sh and launch/ssh.sh (sourced, not run).

# wait_all PID...: waits for every process; when one fails, stops the others (SIGTERM),
# waits for them and returns the failed one's status at once. 0 when all succeed.
wait_all() {
  local running=("$@") finished pid rest status
  while ((${#running[@]})); do
    status=0
    wait -n -p finished "${running[@]}" || status=$?
    rest=()
    for pid in "${running[@]}"; do
      [[ $pid == "$finished" ]] || rest+=("$pid")
    done
    running=("${rest[@]}")
    if ((status)); then
      if ((${#running[@]})); then
        kill "${running[@]}" 2>/dev/null || true
        wait "${running[@]}" 2>/dev/null || true
      fi
      return "$status"
    fi
  done
  return 0
}
