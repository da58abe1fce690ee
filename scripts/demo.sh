#!/usr/bin/env bash
# The main job: on the real SGLang 0.5.16 kernels (CPU, Triton interpreter), show the corruption a
# LoRA-hooked call meets on the TMA down path, then the same call bit-identical with the guard on.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
exec "$PY" -m sglang_lora_tma_guard.demo "$@"
