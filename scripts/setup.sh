#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment the demo and the tests run in:
# the real sglang==0.5.16 wheel with its import chain, CPU only, and this package in editable mode.
# Usage: source scripts/setup.sh   (sets $PY to the environment's python)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LORA_TMA_GUARD_VENV:-$root/.venv}"
sglang_pin="sglang==0.5.16"
stamp="$venv/.lora-tma-guard-stamp"
want="$(cat "$root/requirements/sglang-0.5.16-cpu.txt" "$root/setup.cfg" | sha256sum | cut -c1-16) $sglang_pin"

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv"
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the SGLang 0.5.16 CPU environment (a few minutes the first time)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$root/requirements/sglang-0.5.16-cpu.txt"
  "$venv/bin/python" -m pip install -q --no-deps "$sglang_pin"
  # setuptools' build backend talks on stderr even when all is well (an editable-install banner):
  # keep it in a log, shown only if the install fails.
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" 2> "$venv/editable-install.log" \
    || { cat "$venv/editable-install.log" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
PY="$venv/bin/python"
export PY
