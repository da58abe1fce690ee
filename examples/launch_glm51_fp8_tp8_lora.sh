#!/usr/bin/env bash
# Serve a block-fp8 MoE model (the GLM-5.1-FP8 case: 256 experts + fused shared expert, TP 8,
# fp8 blocks [128,128]) with several LoRA adapters, CUDA graphs on, and the guard active.
#
#   MODEL_PATH=/models/GLM-5.1-FP8 examples/launch_glm51_fp8_tp8_lora.sh \
#       --lora support=/adapters/support --lora legal=/adapters/legal [--dry-run] [-- EXTRA SGLANG ARGS]
#
# Arguments may also come from the environment: MODEL_PATH, LORA_PATHS ("name=path name=path"),
# TP (default 8), PORT (default 30000), MAX_LORAS_PER_BATCH (default 4), PYTHON (default python3).
set -euo pipefail

model="${MODEL_PATH:-}"
read -r -a loras <<< "${LORA_PATHS:-}"
dry_run=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model-path) model="$2"; shift 2 ;;
    --lora) loras+=("$2"); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$model" ] || [ ${#loras[@]} -eq 0 ]; then
  echo "need a model (--model-path or MODEL_PATH) and at least one adapter (--lora NAME=PATH or LORA_PATHS)" >&2
  exit 2
fi

# CUDA graphs stay on (SGLang's default): the corruption was reported under graph replay, and the
# guard holds there because it decides before SGLang builds its buffers.
# No --disable-shared-experts-fusion needed: with LoRA on, the guard turns shared-experts fusion off in
# the launcher (fused, every adapter request would read another adapter's weights for the shared
# expert: README, "The second bug").
cmd=(env SGLANG_LORA_TMA_GUARD=1 "${PYTHON:-python3}" -m sglang.launch_server
     --model-path "$model"
     --tp-size "${TP:-8}"
     --enable-lora
     --lora-paths "${loras[@]}"
     --max-loras-per-batch "${MAX_LORAS_PER_BATCH:-4}"
     --moe-runner-backend triton
     --port "${PORT:-30000}"
     "${extra[@]}")

if [ "$dry_run" -eq 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
