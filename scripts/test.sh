#!/usr/bin/env bash
# Runs the test suite against the real SGLang 0.5.16 kernels on CPU: by default every test not marked
# slow; with --all (as CI does) every test. Other arguments pass through to pytest. Tests run in
# $TEST_WORKERS processes (default 2, one per core of the CI machine; 0: in this process), a test
# file's tests in one process (module fixtures, such as the version matrix, are built once).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
args=()
for arg in "$@"; do
  if [ "$arg" = --all ]; then args+=(-m "slow or not slow"); else args+=("$arg"); fi
done
workers="${TEST_WORKERS:-2}"
if [ "$workers" != 0 ]; then args=(-n "$workers" --dist loadfile "${args[@]}"); fi
exec "$PY" -m pytest "${args[@]}"
