#!/usr/bin/env bash
# On the two-GPU H200 machine, from the repository root, with the server kit (benchmarks/e2e/fetch_kit.sh)
# unpacked by benchmarks/e2e/setup_there.sh: the kernel-level benchmark with SGLang's own LoRA hooks and
# weight TMA (GPU 0), then the servers. Results under ${OUT:-results}/.
#   bash benchmarks/run_lora_h200.sh kernels|tp1|tp2|load
set -euo pipefail
source benchmarks/e2e/setup_there.sh || { echo "kit incomplete"; exit 1; }
export OUT="${OUT:-results}"; mkdir -p "$OUT"
case "${1:-kernels}" in
  kernels) CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m benchmarks.lora_h200 --out "$OUT" "${@:2}" ;;
  tp1|tp2|load) timeout 570 bash benchmarks/e2e/run_servers.sh "$1" ;;
esac
