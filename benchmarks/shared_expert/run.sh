#!/usr/bin/env bash
# On the H200 machine, from the repository root, with the server kit of benchmarks/e2e/fetch_kit.sh
# (carried in two calls, see benchmarks/e2e/setup_there.sh): real SGLang 0.5.16 servers on a model whose
# shared expert SGLang fuses, three LoRA adapters (one with shared-expert LoRA), with SGLang's default
# flags, the guard on and the guard off, one after the other on GPU 0. Each server answers the
# correctness requests (client.py run) and then the decode-throughput waves (client.py load); then every
# request is scored against transformers' fp32 model with the adapter merged (reference.py).
#   bash benchmarks/shared_expert/run.sh glm|deepseek [load|long]   results under ${OUT:-results}/
# With "load": throughput only, guard on, guard off, guard on again (the drift between servers).
# With "long": 80 requests of 256 new tokens (client.py long), guard on, and guard off with
# --disable-shared-experts-fusion (SGLang's dual-stream path with its in-place MoE output, 0.5.11-0.5.16).
# With "adapters" (glm): adapters loaded, unloaded and reloaded at runtime (client.py adapters), guard on
# (the up_proj-only adapter too), and guard off with --disable-shared-experts-fusion (up_proj last: it
# takes SGLang's scheduler down); two slots (--max-loras-per-batch 2) so that adapters share them.
set -u
source benchmarks/e2e/setup_there.sh || { echo "kit incomplete"; exit 3; }
here=benchmarks/shared_expert
arch=${1:-glm} mode=${2:-run}
export OUT=${OUT:-results}; mkdir -p "$OUT"
model=$E2E/se-$arch-model lora=$E2E/se-$arch-lora
[ -f "$model/model.safetensors" ] || python3 $here/make_model.py "$arch" "$model" "$lora" || exit 4

serve() {  # NAME PORT GUARD_VALUE [EXTRA SERVER ARGS...]
  local name=$arch-$1 port=$2 guard=$3; shift 3
  local log=$OUT/server-$name.log t0=$SECONDS
  SGLANG_LORA_TMA_GUARD=$guard python3 -m sglang.launch_server --model-path "$model" --skip-tokenizer-init \
    --enable-lora --lora-paths r1="$lora/r1" r2="$lora/r2" s1="$lora/s1" --max-loras-per-batch 4 \
    --max-lora-rank 32 --attention-backend triton --sampling-backend pytorch --moe-runner-backend triton \
    --cuda-graph-max-bs 64 --mem-fraction-static 0.3 --disable-radix-cache --random-seed 0 --port "$port" \
    "$@" > "$log" 2>&1 &
  local pid=$! ok=0
  for _ in $(seq 1 120); do
    curl -s "127.0.0.1:$port/health" >/dev/null 2>&1 && { ok=1; break; }
    kill -0 $pid 2>/dev/null || break; sleep 2
  done
  if [ $ok = 1 ]; then
    echo "== $name: up after $((SECONDS - t0)) s"
    case "$mode" in
      adapters) python3 $here/client.py adapters "$port" "$OUT/run-$name.json" "$name" "$lora" $ADAPTERS_UP ;;
      long) python3 $here/client.py long "$port" "$OUT/run-$name.json" "$name" ;;
      load) python3 $here/client.py load "$port" "$OUT/load-$name.json" "$name" ;;
      *) python3 $here/client.py run "$port" "$OUT/run-$name.json" "$name"
         python3 $here/client.py load "$port" "$OUT/load-$name.json" "$name" ;;
    esac
  else
    echo "== $name: server did not come up"; tail -20 "$log"
  fi
  echo "== $name: what the log says about the guard and the MoE shape"
  grep -hoE "sglang-lora-tma-guard: [^.]*|Config file not found at [^ ]*/(E=[0-9]+,N=[0-9]+)[^ ]*|sglang-lora-tma-guard: refusing[^.]*" "$log" \
    | sed -E 's#Config file not found at .*/(E=[0-9]+,N=[0-9]+).*#MoE runner shape \1#' | sort | uniq -c | cut -c1-200
  pkill -P $pid 2>/dev/null; kill $pid 2>/dev/null; wait $pid 2>/dev/null
  sleep 3
}

if [ "$mode" = load ]; then
  serve guard 31001 1; serve noguard 31002 0; serve guard-again 31003 1
  for f in "$OUT"/load-$arch-*.json; do echo "$(basename "$f"): $(cat "$f")"; done
  exit 0
fi
if [ "$mode" = adapters ]; then
  more=(--max-loras-per-batch 2 --lora-target-modules gate_proj up_proj down_proj q_proj v_proj)
  ADAPTERS_UP=up serve adapters-guard 31001 1 "${more[@]}"
  ADAPTERS_UP= serve adapters-noguard-nofusion 31002 0 --disable-shared-experts-fusion "${more[@]}"
elif [ "$mode" = long ]; then
  serve long-guard 31001 1
  serve long-noguard-nofusion 31002 0 --disable-shared-experts-fusion
else
  serve guard 31001 1
  serve noguard 31002 0
fi
runs=$(ls "$OUT"/run-$arch-*.json 2>/dev/null)
[ -n "$runs" ] && python3 $here/reference.py "$model" "$lora" $runs --out "$OUT/verdict-$arch.txt"
for f in "$OUT"/load-$arch-*.json; do [ -f "$f" ] && echo "$(basename "$f"): $(cat "$f")"; done
