#!/usr/bin/env bash
# On the H200 machine (two GPUs), from the repository root, after `source benchmarks/e2e/setup_there.sh`:
# real SGLang 0.5.16 servers (Qwen3-MoE, block fp8, E=80 and N=640 per rank, four LoRA adapters of ranks
# 8-64, decode CUDA graphs up to batch 64, Triton attention), each sent the same requests
# (benchmarks/e2e/client.py).
#   bash benchmarks/e2e/run_servers.sh tp1   guard on | guard off, then reference | guard off without CUDA
#                                            graphs, two servers at a time, one per GPU
#   bash benchmarks/e2e/run_servers.sh tp2   guard on, then reference, tensor parallel 2 over both GPUs
#   bash benchmarks/e2e/run_servers.sh load  throughput only (client.py load), one server at a time: guard
#                                            (weight TMA), guard (plain fix), guard off, guard off without
#                                            CUDA graphs, guard again
# The reference's MoE configs never say USE_TMA (copies of SGLang's tuned E=80,N=640 configs without it).
# Writes $OUT/server-NAME.log, $OUT/run-NAME.json (or load-NAME.json), $OUT/verdict-MODE.txt.
set -euo pipefail
source benchmarks/serving/server.sh
mode="${1:-tp1}"; tp=1; [ "$mode" = tp2 ] && tp=2
S="${E2E:-/tmp/e2e}"
model="$S/model-$mode" lora="$S/lora-$mode"
[ -d "$model" ] || MOE_I=$((640 * tp)) python3 -m benchmarks.e2e.make_model "$model" "$lora"
cfg="$S/site/sglang/srt/layers/moe/moe_runner/triton_utils/configs"
mkdir -p "$S/notma/configs/triton_3_6_0"
for f in "$cfg"/triton_3_5_1/E=80,N=640,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=*; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [v.pop('USE_TMA',None) for v in d.values()]; json.dump(d,open(sys.argv[2],'w'))" \
    "$f" "$S/notma/configs/triton_3_6_0/$(basename "$f")"
done

task=run; [ "$mode" = load ] && task=load
serve() {  # NAME GPUS PORT [EXTRA_ARGS...] -- ENV...
  local name="$1" gpus="$2" port="$3"; shift 3
  local args=(); while [ "$#" -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done; shift
  local log="$OUT/server-$name.log"
  if start_server "$log" "$port" 150 CUDA_VISIBLE_DEVICES="$gpus" "$@" -- --model-path "$model" \
      --skip-tokenizer-init --enable-lora --lora-paths a1="$lora/a1" a2="$lora/a2" a3="$lora/a3" a4="$lora/a4" \
      --max-loras-per-batch 5 --max-lora-rank 64 --attention-backend triton --sampling-backend pytorch \
      --moe-runner-backend triton --cuda-graph-max-bs 64 --mem-fraction-static 0.3 --tp-size "$tp" "${args[@]}"; then
    python3 -m benchmarks.e2e.client "$task" "$port" "$OUT/$task-$name.json" 2>> "$log" | sed "s/^/== $name load: /"
  fi
  echo "== $name guard lines:"; guard_lines "$log"
  stop_server
}

if [ "$mode" = load ]; then
  # One server at a time on one GPU, guard first and last to show the drift between runs.
  serve guard 0 30001 -- SGLANG_LORA_TMA_GUARD=1
  serve plain 0 30003 -- SGLANG_LORA_TMA_GUARD=plain
  serve noguard 0 30002 -- SGLANG_LORA_TMA_GUARD=0
  serve nocudagraph 0 30004 --disable-cuda-graph -- SGLANG_LORA_TMA_GUARD=0
  serve guard-again 0 30001 -- SGLANG_LORA_TMA_GUARD=1
elif [ "$tp" = 1 ]; then
  serve guard 0 30001 -- SGLANG_LORA_TMA_GUARD=1 & serve noguard 1 30002 -- SGLANG_LORA_TMA_GUARD=0 & wait
  serve notma 0 30003 -- SGLANG_LORA_TMA_GUARD=0 SGLANG_MOE_CONFIG_DIR="$S/notma" &
  serve nocudagraph 1 30004 --disable-cuda-graph -- SGLANG_LORA_TMA_GUARD=0 & wait
  python3 -m benchmarks.e2e.client compare "$OUT/run-notma.json" "$OUT/run-guard.json" "$OUT/run-noguard.json" \
    "$OUT/run-nocudagraph.json" | tee "$OUT/verdict-tp1.txt"
else
  serve guard-tp2 0,1 30005 -- SGLANG_LORA_TMA_GUARD=1
  serve notma-tp2 0,1 30006 -- SGLANG_LORA_TMA_GUARD=0 SGLANG_MOE_CONFIG_DIR="$S/notma"
  python3 -m benchmarks.e2e.client compare "$OUT/run-notma-tp2.json" "$OUT/run-guard-tp2.json" | tee "$OUT/verdict-tp2.txt"
fi
