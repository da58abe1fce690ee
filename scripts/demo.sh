#!/usr/bin/env bash
# The main job: on the real SGLang 0.5.16 kernels (CPU, Triton interpreter), show the corruption a
# LoRA-hooked call meets on the TMA down path, then the same call bit-identical with the guard on;
# then every other defect of the catalogue a CPU can show, one row each, without and with the guard.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
"$PY" -m sglang_lora_tma_guard.demo "$@"
cd "$root"
exec "$PY" -m scripts.demo_defects
