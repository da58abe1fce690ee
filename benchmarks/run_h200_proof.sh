#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .whl/ from fetch_h200_wheels.sh:
# install the wheels into /tmp/site and run the proof; results go to ${OUT:-results}/.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m benchmarks.h200_proof --out "${OUT:-results}" "$@"
python3 -m benchmarks.wrapper_overhead
python3 -m benchmarks.fallback_vs_sglang --out "${OUT:-results}"
