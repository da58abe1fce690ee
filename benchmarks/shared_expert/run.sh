#!/usr/bin/env bash
# On the H200 machine, from the repository root, with the server kit of benchmarks/e2e/fetch_kit.sh
# (carried in two calls, see benchmarks/e2e/setup_there.sh): real SGLang 0.5.16 servers on a model whose
# shared expert SGLang fuses, three LoRA adapters (one with shared-expert LoRA), with SGLang's default
# flags, the guard on and the guard off, one after the other on GPU 0. Each server answers the
# correctness requests (client.py run) and then the decode-throughput waves (client.py load); then every
# request is scored against transformers' fp32 model with the adapter merged (reference.py).
#   bash benchmarks/shared_expert/run.sh glm|deepseek [load|long|adapters]   results under ${OUT:-results}/
# With "load": throughput only, guard on, guard off, guard on again (the drift between servers).
# With "long": 80 requests of 256 new tokens (client.py long), guard on, and guard off with
# --disable-shared-experts-fusion (SGLang's dual-stream path with its in-place MoE output, 0.5.11-0.5.16).
# With "adapters" (glm): adapters loaded, unloaded and reloaded at runtime (client.py adapters), guard on
# (the up_proj-only adapter too), and guard off with --disable-shared-experts-fusion (up_proj last: it
# takes SGLang's scheduler down); two slots (--max-loras-per-batch 2) so that adapters share them.
set -euo pipefail
source benchmarks/e2e/setup_there.sh || { echo "kit incomplete"; exit 3; }
source benchmarks/serving/server.sh
arch="${1:-glm}" mode="${2:-run}"
export OUT="${OUT:-results}"; mkdir -p "$OUT"
model="$E2E/se-$arch-model" lora="$E2E/se-$arch-lora"
[ -f "$model/model.safetensors" ] || python3 -m benchmarks.shared_expert.make_model "$arch" "$model" "$lora"
client() { python3 -m benchmarks.shared_expert.client "$@"; }

serve() {  # NAME PORT GUARD_VALUE [EXTRA SERVER ARGS...]
  local name="$arch-$1" port="$2" guard="$3"; shift 3
  local log="$OUT/server-$name.log"
  if start_server "$log" "$port" 120 SGLANG_LORA_TMA_GUARD="$guard" -- --model-path "$model" --skip-tokenizer-init \
      --enable-lora --lora-paths r1="$lora/r1" r2="$lora/r2" s1="$lora/s1" --max-loras-per-batch 4 \
      --max-lora-rank 32 --attention-backend triton --sampling-backend pytorch --moe-runner-backend triton \
      --cuda-graph-max-bs 64 --mem-fraction-static 0.3 --disable-radix-cache --random-seed 0 "$@"; then
    echo "== $name: up after $SERVER_UP_S s"
    case "$mode" in
      adapters) client adapters "$port" "$OUT/run-$name.json" "$name" "$lora" ${ADAPTERS_UP:-} ;;
      long) client long "$port" "$OUT/run-$name.json" "$name" ;;
      load) client load "$port" "$OUT/load-$name.json" "$name" ;;
      *) client run "$port" "$OUT/run-$name.json" "$name"
         client load "$port" "$OUT/load-$name.json" "$name" ;;
    esac
  fi
  echo "== $name: what the log says about the guard and the MoE shape"
  { grep -hoE "sglang-lora-tma-guard: [^.]*|Config file not found at [^ ]*/(E=[0-9]+,N=[0-9]+)[^ ]*" "$log" || true; } \
    | sed -E 's#Config file not found at .*/(E=[0-9]+,N=[0-9]+).*#MoE runner shape \1#' | sort | uniq -c | cut -c1-200
  stop_server
}

show_loads() {
  local f
  for f in "$OUT"/load-"$arch"-*.json; do
    if [ -f "$f" ]; then echo "$(basename "$f"): $(cat "$f")"; fi
  done
}

if [ "$mode" = load ]; then
  serve guard 31001 1; serve noguard 31002 0; serve guard-again 31003 1
  show_loads
  exit 0
fi
if [ "$mode" = adapters ]; then
  more=(--max-loras-per-batch 2 --lora-target-modules gate_proj up_proj down_proj q_proj v_proj)
  ADAPTERS_UP=up serve adapters-guard 31001 1 "${more[@]}"
  ADAPTERS_UP='' serve adapters-noguard-nofusion 31002 0 --disable-shared-experts-fusion "${more[@]}"
elif [ "$mode" = long ]; then
  serve long-guard 31001 1
  serve long-noguard-nofusion 31002 0 --disable-shared-experts-fusion
else
  serve guard 31001 1
  serve noguard 31002 0
fi
runs=("$OUT"/run-"$arch"-*.json)
if [ -f "${runs[0]}" ]; then
  python3 -m benchmarks.serving.reference "$model" "$lora" "${runs[@]}" --out "$OUT/verdict-$arch.txt"
fi
show_loads
