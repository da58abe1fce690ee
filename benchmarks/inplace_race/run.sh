#!/usr/bin/env bash
# On the H200 machine, from the repository root, with the server kit of benchmarks/e2e/fetch_kit.sh
# carried in two calls (benchmarks/e2e/setup_there.sh) and SGLang 0.5.17's own tree
# (benchmarks/inplace_race/fetch.sh, .e2e/sglang-0.5.17.tar.xz, carried with part1 and unpacked by
# `source benchmarks/inplace_race/run.sh unpack`) beside it:
#   1. the dual-stream DeepSeek MoE block in a CUDA graph, the race made deterministic by a delay on the
#      shared expert's stream (dual_stream.py): SGLang 0.5.16 without and with the guard, then 0.5.17;
#   2. a real 0.5.16 server on a DeepSeek-V3-class checkpoint, CUDA graphs on, 80 requests of 256 new
#      tokens (32 and 48 concurrent), guard on; and guard off with --disable-shared-experts-fusion (the
#      racy path without the guard's fix), every token scored against transformers' fp32 model.
#   bash benchmarks/inplace_race/run.sh        results under ${OUT:-results}/
set -euo pipefail
if [ "${1:-}" = unpack ]; then  # the first call: part1 and SGLang 0.5.17's tree
  source benchmarks/e2e/setup_there.sh
  mkdir -p /tmp/e2e/sglang-0.5.17 && tar -xJf .e2e/sglang-0.5.17.tar.xz -C /tmp/e2e/sglang-0.5.17 && echo unpacked
  exit 0
fi
source benchmarks/e2e/setup_there.sh || { echo "kit incomplete"; exit 3; }
export OUT="${OUT:-results}"
mkdir -p "$OUT/sglang-0.5.16" "$OUT/sglang-0.5.17"
quiet() { { grep -v Warning || true; } | tail -12; }
python3 -m benchmarks.inplace_race.dual_stream --out "$OUT/sglang-0.5.16" 2>&1 | quiet
if [ -d "$E2E/sglang-0.5.17/sglang" ]; then  # unpacked by the first call: unpack_0517
  PYTHONPATH="$E2E/sglang-0.5.17:$PYTHONPATH" python3 -m benchmarks.inplace_race.dual_stream --out "$OUT/sglang-0.5.17" 2>&1 \
    | quiet
fi
bash benchmarks/shared_expert/run.sh deepseek long
