#!/usr/bin/env bash
# On the H200 machine, from the repository root, with the kit unpacked (benchmarks/e2e/setup_there.sh):
# the kernel table (benchmarks/lora_moe_kernels.py) of this tree's fast path, then of another version of
# sglang_lora_tma_guard/lora_moe.py on the same machine, same arguments: what a kernel change buys.
#   BASE=.e2e/main_lora_moe.py bash benchmarks/ab_lora_moe.sh [lora_moe_kernels arguments]
# BASE: the other lora_moe.py (carried: e.g. `git show main:sglang_lora_tma_guard/lora_moe.py`); it must
# take the same calls as this tree's. Results under ${OUT:-results}/this and .../base.
set -euo pipefail
source benchmarks/e2e/setup_there.sh || { echo "kit incomplete"; exit 3; }
out="${OUT:-results}" base="${BASE:?BASE: the other lora_moe.py}"
timeout "${BENCH_S:-250}" python3 -m benchmarks.lora_moe_kernels --out "$out/this" "$@"
# The benchmarks import the tree's package, a server the installed wheel's: both take the other version.
cp "$base" sglang_lora_tma_guard/lora_moe.py
cp "$base" "$E2E/plugin/sglang_lora_tma_guard/lora_moe.py"
timeout "${BENCH_S:-250}" python3 -m benchmarks.lora_moe_kernels --out "$out/base" "$@"
