#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .whl/ from fetch_h200_wheels.sh:
# install the wheels into /tmp/site and run the proof; results go to ${OUT:-results}/.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 benchmarks/h200_proof.py --out "${OUT:-results}" "$@"
python3 benchmarks/wrapper_overhead.py
python3 benchmarks/fallback_vs_sglang.py --out "${OUT:-results}"
