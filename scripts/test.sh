#!/usr/bin/env bash
# Runs the whole test suite against the real SGLang 0.5.16 kernels on CPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec "$PY" -m pytest "$@"
