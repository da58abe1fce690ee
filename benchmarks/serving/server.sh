# shellcheck shell=bash disable=SC2034  # SERVER_PID, SERVER_UP_S: for the caller
# Sourced by each server campaign's run script (bash, `set -euo pipefail`): one SGLang server's start,
# health wait and stop, and what its log says about the guard.
#
#   start_server LOG PORT TRIES [VAR=VALUE ...] -- [SERVER ARGS ...]
#       python3 -m sglang.launch_server --port PORT SERVER ARGS in the background, its output in LOG, the
#       environment given VAR=VALUE; sets SERVER_PID and SERVER_UP_S; returns 0 once /health answers, 1
#       when the server exits first or TRIES checks (2 s apart) go by (the end of LOG is printed).
#   stop_server        the server of the last start_server and its children; waits for them.
#   guard_lines LOG    the guard's lines of LOG, counted (none is not an error).

start_server() {
  local log="$1" port="$2" tries="$3" started="$SECONDS"
  shift 3
  local env_vars=()
  while [ "$#" -gt 0 ] && [ "$1" != -- ]; do env_vars+=("$1"); shift; done
  [ "$#" -gt 0 ] && shift  # the --
  env "${env_vars[@]}" python3 -m sglang.launch_server --port "$port" "$@" > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 "$tries"); do
    if curl -s "127.0.0.1:$port/health" > /dev/null 2>&1; then
      SERVER_UP_S=$((SECONDS - started))
      return 0
    fi
    kill -0 "$SERVER_PID" 2> /dev/null || break
    sleep 2
  done
  echo "server on port $port did not come up; the end of $log:"
  tail -20 "$log" || true
  return 1
}

stop_server() {
  pkill -P "$SERVER_PID" 2> /dev/null || true
  kill "$SERVER_PID" 2> /dev/null || true
  wait "$SERVER_PID" 2> /dev/null || true
  sleep 3  # the GPU's memory back before the next server starts
}

guard_lines() {
  { grep -ho "sglang-lora-tma-guard: [^(]*" "$1" || true; } | sort | uniq -c | cut -c1-200
}
