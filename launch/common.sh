# Shared by launch/local.sh and launch/ssh.sh (sourced, not run).

# wait_all PID...: waits for every process; the first one to fail makes it return that
# status at once (the caller's EXIT trap then stops the rest). 0 when all succeed.
wait_all() {
  local running=("$@") finished pid rest status
  while ((${#running[@]})); do
    wait -n -p finished "${running[@]}" || { status=$?; return "$status"; }
    rest=()
    for pid in "${running[@]}"; do
      [[ $pid == "$finished" ]] || rest+=("$pid")
    done
    running=("${rest[@]}")
  done
  return 0
}
