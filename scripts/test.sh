#!/usr/bin/env bash
# Runs the test suite against the real SGLang 0.5.16 kernels on CPU: by default every test not marked
# slow; with --all (as CI does) every test. Other arguments pass through to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
args=()
for arg in "$@"; do
  if [ "$arg" = --all ]; then args+=(-m "slow or not slow"); else args+=("$arg"); fi
done
exec "$PY" -m pytest "${args[@]}"
