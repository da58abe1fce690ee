#!/usr/bin/env bash
# Start a command only when `python -m sglang_lora_tma_guard.check` says this environment is not
# affected or is protected (exit 0). Affected and unprotected (1) or cannot tell (2): refuse.
#
#   SGLANG_LORA_TMA_GUARD=1 examples/prelaunch_check.sh [--dry-run] -- python3 -m sglang.launch_server ...
#
# --dry-run runs the check and prints the command instead of starting it. PYTHON picks the
# interpreter that runs the check (default python3).
set -euo pipefail

dry_run=0
while [ "$#" -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
if [ "$#" -eq 0 ]; then
  echo "usage: $0 [--dry-run] -- COMMAND [ARGS...]" >&2
  exit 2
fi

status=0
"${PYTHON:-python3}" -m sglang_lora_tma_guard.check || status=$?
case "$status" in
  0) ;;
  1) echo "prelaunch: refusing to start: LoRA adapters on MoE layers would produce garbled output here (see above)" >&2
     exit 1 ;;
  *) echo "prelaunch: refusing to start: the check could not tell whether this environment is safe (exit $status)" >&2
     exit "$status" ;;
esac

if [ "$dry_run" -eq 1 ]; then
  printf '%q ' "$@"; echo
  exit 0
fi
exec "$@"
