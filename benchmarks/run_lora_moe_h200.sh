#!/usr/bin/env bash
# On the H200 machine, from the repository root, with the kit (benchmarks/e2e/fetch_kit.sh) unpacked by
# benchmarks/e2e/setup_there.sh: tune the fast LoRA MoE path's tiles, then benchmark it against SGLang's
# default LoRA MoE path with those tiles; or each kernel of the fast path against its floor (kernels).
# Results under ${OUT:-results}/.
#   bash benchmarks/run_lora_moe_h200.sh [tune|bench|all|kernels|act|place-act|tune-ab|race|launch|down|gate-up|ncu|thresholds] [extra arguments for the Python scripts]
# gate-up: benchmarks/gate_up_gemm.py (bf16 experts: SGLang's gate-up GEMM and the hook's shrink, against this
# package's gate-up GEMM with the shrink in its K loop).
# down: benchmarks/down_gemm.py (the down GEMM alone: SGLang's, this package's over tile variants, the down
# LoRA as a hook or in the GEMM's epilogue), then what its table says of the fused launch's thresholds
# (benchmarks/fused_policy.py, into $OUT/fused_policy.md).
# race: benchmarks/overlap_race.py (the fast hooks' second stream delayed: right only with the waits).
# launch: benchmarks/launch_check.py (direct launches bit for bit Triton's own), then the hooks' host time a
# layer (benchmarks/hook_host_time.py --cuda) into $OUT/host-cuda.txt.
# FUSED_DOWN=everywhere: the bench and kernels tables' fused column takes every batch the fused launch covers.
# WIDE_CHANGE='{"LORA_AHEAD": 1}': kernel switches on every wide tile the fused launch places (benchmarks/_lora_setup.py).
# place-act: the gate-up work in the activation (fused_act) placed at every batch (FUSED_DOWN=everywhere): the
# whole call's errors against the float32 reference (lora_moe_h200, into $OUT/bench), then its time with and without
# it (lora_moe_kernels' fused and fused, gate-up hooked columns, into $OUT/kernels).
# tune-ab: tune, then the kernel table with the tuned tiles and with the shipped ones, alternated twice
# (under $OUT/tuned1, shipped1, tuned2, shipped2): what the new tiles buy, on one machine. Its arguments
# go to both scripts (--shapes, --tokens).
# tune-against: tune, then the whole LoRA work of each batch with the tuned tiles against the shipped ones, twice
# (benchmarks/tune_lora_moe.py --against, under $OUT/against1 and against2): the tiles' A/B in a minute or two.
# thresholds: what fused_lora's placement rows (FASTER_FROM_ROUTES, SPLIT_FROM_ROUTES and their _ON rows by GPU) are
# read from, on this GPU, in one call (about 7 minutes): the down side at every rank set, 1024-8192 tokens
# (down_gemm.py and fused_policy.md, under $OUT/down), then the whole hooked call at ranks 32, mixed and 64, 1024-4096
# tokens, with the fused launch whole and split at 32 at every batch (FUSED_DOWN=everywhere, --split-rank 32: the
# fast, fused and fused-split columns) twice, under $OUT/kernels1 and kernels2, and what fused_policy --whole reads
# of those two ($OUT/whole_policy.md). GLM-5.1 TP8 (K 256) by default; arguments replace the batches of all three.
set -euo pipefail
source benchmarks/e2e/setup_there.sh || { echo "kit incomplete"; exit 1; }
export OUT="${OUT:-results}"; mkdir -p "$OUT"
what="${1:-all}"; shift || true
if [ "$what" = tune ] || [ "$what" = all ] || [ "$what" = tune-ab ] || [ "$what" = tune-against ]; then
  # Stopped by the time limit, the tune has written the batches it finished: what follows runs with those.
  timeout "${TUNE_S:-300}" python3 -m benchmarks.tune_lora_moe --out "$OUT" "$@" || echo "tune stopped (exit $?)"
fi
if [ "$what" = tune-ab ]; then
  for i in 1 2; do
    # A table stopped by its time limit keeps its finished rows; the next one still runs.
    SGLANG_LORA_TMA_GUARD_TILES="$OUT/lora_moe_tiles.json" timeout "${BENCH_S:-280}" \
      python3 -m benchmarks.lora_moe_kernels --out "$OUT/tuned$i" "$@" || echo "tuned$i stopped (exit $?)"
    timeout "${BENCH_S:-280}" python3 -m benchmarks.lora_moe_kernels --out "$OUT/shipped$i" "$@" \
      || echo "shipped$i stopped (exit $?)"
  done
  exit 0
fi
if [ "$what" = tune-against ]; then
  for i in 1 2; do
    timeout "${BENCH_S:-120}" python3 -m benchmarks.tune_lora_moe --against "$OUT/lora_moe_tiles.json" \
      --out "$OUT/against$i" "$@" || echo "against$i stopped (exit $?)"
  done
  exit 0
fi
# What tune wrote (this call or an earlier one into the same $OUT) is what bench and kernels run with.
if [ -f "$OUT/lora_moe_tiles.json" ]; then export SGLANG_LORA_TMA_GUARD_TILES="$OUT/lora_moe_tiles.json"; fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_S:-280}" python3 -m benchmarks.lora_moe_h200 --out "$OUT" "$@"
fi
if [ "$what" = kernels ]; then
  timeout "${BENCH_S:-280}" python3 -m benchmarks.lora_moe_kernels --out "$OUT" "$@"
fi
if [ "$what" = act ]; then
  timeout "${BENCH_S:-280}" python3 -m benchmarks.act_tiles --out "$OUT" "$@"
fi
if [ "$what" = place-act ]; then
  FUSED_DOWN=everywhere timeout "${BENCH_S:-150}" python3 -m benchmarks.lora_moe_h200 --out "$OUT/bench" "$@" \
    || echo "bench stopped (exit $?)"
  FUSED_DOWN=everywhere timeout "${KERNELS_S:-330}" python3 -m benchmarks.lora_moe_kernels --out "$OUT/kernels" "$@" \
    || echo "kernels stopped (exit $?)"
fi
if [ "$what" = race ]; then
  timeout "${BENCH_S:-280}" python3 -m benchmarks.overlap_race --out "$OUT" "$@"
fi
if [ "$what" = launch ]; then
  timeout "${BENCH_S:-280}" python3 -m benchmarks.launch_check --out "$OUT" "$@"
  timeout "${BENCH_S:-280}" python3 -m benchmarks.hook_host_time --cuda --repeats 5 --layers 1000 | tee "$OUT/host-cuda.txt"
fi
if [ "$what" = gate-up ]; then
  timeout "${BENCH_S:-280}" python3 -m benchmarks.gate_up_gemm --base bf16 --out "$OUT" "$@" || echo "gate_up_gemm stopped (exit $?)"
fi
if [ "$what" = down ]; then
  timeout "${BENCH_S:-280}" python3 -m benchmarks.down_gemm --out "$OUT" "$@" || echo "down_gemm stopped (exit $?)"
  python3 -m benchmarks.fused_policy "$OUT/down_gemm.json" | tee "$OUT/fused_policy.md"
fi
if [ "$what" = ncu ]; then
  # Nsight Compute on the wide down GEMM (GLM-5.1 TP8 by default; arguments replace the batch): without LoRA, with it
  # as placed past rank 32 (LORA_AHEAD=3), and reading its A tiles once; three launches each, in that order (two
  # before the CUDA-graph capture, one replay), so the report's launches 1-3, 4-6, 7-9 (down_gemm's exact --parts); a
  # batch's nine after the last's (NCU_COUNT=18 for two).
  batch=(--shapes glm51-fp8-tp8 --rank-sets mixed --tokens 2048)
  if [ $# -gt 0 ]; then batch=("$@"); fi
  tile="N_TILES=16, BLOCK_N=64, num_stages=2"
  ahead="B tiles ahead sweep, ordered: wide + LoRA, $tile, LORA_AHEAD=3"  # down_gemm.AHEAD_ROWS + the tile
  timeout "${BENCH_S:-400}" ncu -k regex:_moe_gemm_wide_kernel -c "${NCU_COUNT:-9}" --section LaunchStats --section Occupancy \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section SourceCounters \
    python3 -m benchmarks.down_gemm --out "$OUT/ncu" "${batch[@]}" --parts "=wide, $tile" "=$ahead" "=$ahead, A_ONCE=1" \
    > "$OUT/ncu.txt" 2>&1 || echo "ncu stopped (exit $?)"
  tail -n 5 "$OUT/ncu.txt"
fi
if [ "$what" = thresholds ]; then
  down=(--shapes glm51-fp8-tp8 --rank-sets r8 r16 r32 mixed r64 --tokens 1024 2048 4096 8192)
  whole=(--shapes glm51-fp8-tp8 --rank-sets r32 mixed r64 --tokens 1024 2048 4096)
  if [ $# -gt 0 ]; then down=("$@"); whole=("$@"); fi
  timeout "${BENCH_S:-280}" python3 -m benchmarks.down_gemm --out "$OUT/down" --parts "SGLang's list ordered" "${down[@]}" \
    || echo "down_gemm stopped (exit $?)"
  python3 -m benchmarks.fused_policy "$OUT/down/down_gemm.json" | tee "$OUT/down/fused_policy.md"
  for i in 1 2; do
    FUSED_DOWN=everywhere timeout "${KERNELS_S:-150}" python3 -m benchmarks.lora_moe_kernels --out "$OUT/kernels$i" \
      --split-rank 32 "${whole[@]}" || echo "kernels$i stopped (exit $?)"
  done
  python3 -m benchmarks.fused_policy --whole "$OUT"/kernels*/lora_moe_kernels.json | tee "$OUT/whole_policy.md" || true
fi
