#!/usr/bin/env bash
# On the H200 machine, from the repository root, with the kit of benchmarks/e2e/fetch_kit.sh (two calls,
# see benchmarks/e2e/setup_there.sh): real SGLang 0.5.16 servers on a model with Qwen3-30B-A3B's layer
# shapes (make_model.py), one after the other on GPU 0: no LoRA, SGLang's default LoRA MoE path
# (SGLANG_LORA_TMA_GUARD=1), this package's fast path (=fast), and on request ("fused") the fast path
# with the down delta in the down GEMM's epilogue (placed by fused_site/sitecustomize.py) or
# ("onestream") the fast path with all its LoRA kernels on the MoE call's stream (onestream_site/) or ("hookact")
# the fast path with the gate-up expand in its hook, not in the activation (hookact_site/) or ("free")
# a ceiling: SGLang's LoRA machinery with MoE LoRA hooks that do nothing (free_site/; not scored). Each:
# correctness requests, decode and prefill throughput, a profile of a prefill wave and of steady
# decoding (client.py run, load, profile; the profile summarized by profile.py); on request (STEPS) teacher-forced
# prefills (client.py forced). "score": every run so
# far (greedy and teacher-forced, with the rotated control) scored against transformers' fp32 model with each
# adapter merged (benchmarks/serving/reference.py), then the fast run compared with the default one, and each
# teacher-forced LoRA run with the default one prompt by prompt (benchmarks/serving/paired.py, into paired.txt).
#   bash benchmarks/fast_lora/run.sh [names...]    (default: default fast nolora score); results under ${OUT:-results}/
# LAYERS (default 3): the model's depth; 16 makes a decode step GPU-bound. DTYPE=float16|bfloat16 (default
# bfloat16): the servers' --dtype. STEPS (default "run load profile"; also "forced", and "single": decode at 1
# request only, more waves, one file per server as names may repeat): which of the client's steps each
# server takes; PROFILE_STACK=0: the profile's traces without Python stacks. The runs are kept on the
# machine too ($E2E/runs-L$LAYERS), so "score" may come in a later call than the servers.
# PROMPTS (default 8): the prompts each adapter's correctness requests take (client.py run and forced).
# FP8=1: the model's projections in block fp8 (make_model.py --fp8, experts as Qwen3-30B-A3B-FP8 holds
# them), adapters of ranks 8/16/16/16 (--max-lora-rank 16), scored against the bf16 checkpoint of the same
# dequantized weights ("score" then calibrates the greedy runs' verdict on the no-LoRA run's). Its "fused" server
# takes the fused down GEMM for every batch; =fast for the batches fused_lora.FASTER_FROM_ROUTES places it at (K 768:
# from 2048 tokens at these ranks).
set -euo pipefail
source benchmarks/e2e/setup_there.sh || { echo "kit incomplete"; exit 3; }
source benchmarks/serving/server.sh
export OUT="${OUT:-results}"; mkdir -p "$OUT"
layers="${LAYERS:-3}" suffix='' ranks=(8 16 32 64) fp8=()
[ "$layers" = 3 ] || suffix="-L$layers"
keep="$E2E/runs-L$layers"
if [ "${FP8:-0}" = 1 ]; then
  suffix="$suffix-fp8" ranks=(8 16 16 16) keep="$keep-fp8"
  fp8=(--fp8 "$E2E/q3-ref$suffix")
fi
model="$E2E/q3-model$suffix" lora="$E2E/q3-lora$suffix"
reference="${fp8[1]:-$model}"  # what the servers' tokens are scored against
max_rank=$(printf '%s\n' "${ranks[@]}" | sort -n | tail -1)
mkdir -p "$keep"
[ -f "$model/model.safetensors" ] || python3 -m benchmarks.fast_lora.make_model "$model" "$lora" --layers "$layers" \
  --ranks "${ranks[@]}" "${fp8[@]}"

serve() {  # NAME PORT GUARD_VALUE LORA(yes|no) [VAR=VALUE ...]
  local name="$1" port="$2" guard="$3" use_lora="$4" log="$OUT/server-$1.log" tag=
  shift 4
  local lora_args=()
  if [ "$use_lora" = yes ]; then
    tag=lora
    lora_args=(--enable-lora --lora-paths a1="$lora/a1" a2="$lora/a2" a3="$lora/a3" a4="$lora/a4"
               --max-loras-per-batch 5 --max-lora-rank "$max_rank")
  fi
  if start_server "$log" "$port" 200 SGLANG_LORA_TMA_GUARD="$guard" "$@" -- --model-path "$model" --skip-tokenizer-init \
      "${lora_args[@]}" --attention-backend triton --sampling-backend pytorch --moe-runner-backend triton \
      --dtype "${DTYPE:-bfloat16}" --cuda-graph-max-bs 64 --mem-fraction-static 0.5 --disable-radix-cache \
      --random-seed 0; then
    echo "== $name: up after $SERVER_UP_S s"
    local step
    for step in ${STEPS:-run load profile}; do
      case "$step" in
        run|forced) python3 -m benchmarks.fast_lora.client "$step" "$port" "$OUT/$step-$name.json" $tag
                    cp "$OUT/$step-$name.json" "$keep/" ;;
        load) python3 -m benchmarks.fast_lora.client load "$port" "$OUT/load-$name.json" $tag | sed "s/^/== $name load: /" ;;
        single) local i=1  # a name may come more than once (A/B/A): each server its own file
                while [ -f "$OUT/single-$name-$i.json" ]; do i=$((i + 1)); done
                python3 -m benchmarks.fast_lora.client single "$port" "$OUT/single-$name-$i.json" $tag \
                  | sed "s/^/== $name single $i: /" ;;
        profile) rm -rf "$keep/trace-$name"
                 python3 -m benchmarks.fast_lora.client profile "$port" "$keep/trace-$name" $tag
                 python3 -m benchmarks.fast_lora.profile "$keep/trace-$name" "$name" "$OUT/profile-$name.json" || true ;;
      esac
    done
  fi
  guard_lines "$log"
  stop_server
}

names=("$@"); [ "${#names[@]}" = 0 ] && names=(default fast nolora score)
for name in "${names[@]}"; do
  case "$name" in
    default) serve default 32001 1 yes ;;
    fast) serve fast 32002 fast yes ;;
    fused) serve fused 32004 fast yes PYTHONPATH="$PWD/benchmarks/fast_lora/fused_site:$PYTHONPATH" ;;
    onestream) serve onestream 32005 fast yes PYTHONPATH="$PWD/benchmarks/fast_lora/onestream_site:$PYTHONPATH" ;;
    hookact) serve hookact 32007 fast yes PYTHONPATH="$PWD/benchmarks/fast_lora/hookact_site:$PYTHONPATH" ;;
    free) serve free 32006 fast yes PYTHONPATH="$PWD/benchmarks/fast_lora/free_site:$PYTHONPATH" ;;
    nolora) serve nolora 32003 1 no ;;
    score)
      runs=() calibrate=()
      for run in "$keep"/run-*.json "$keep"/forced-*.json; do  # free: wrong by design
        [ -f "$run" ] && [ "${run%-free.json}" = "$run" ] && runs+=("$run")
      done
      # w8a8: the greedy runs' share of bad positions calibrated on no LoRA's
      [ "${FP8:-0}" = 1 ] && [ -f "$keep/run-nolora.json" ] && calibrate=(--calibrate nolora)
      python3 -m benchmarks.serving.reference "$reference" "$lora" "${runs[@]}" "${calibrate[@]}" --rotated \
        --out "$OUT/verdict-reference.txt" --json "$OUT/scores.json"
      pairs=()  # each teacher-forced LoRA run against the default one's, prompt by prompt
      for run in "$keep"/forced-*.json; do
        run="${run##*/forced-}" run="${run%.json}"
        case "$run" in default|nolora|free|'*') ;; *) [ -f "$keep/forced-default.json" ] && pairs+=("$run" default) ;; esac
      done
      [ "${#pairs[@]}" = 0 ] || python3 -m benchmarks.serving.paired "$OUT/scores.json" "${pairs[@]}" | tee "$OUT/paired.txt"
      if [ -f "$keep/run-default.json" ] && [ -f "$keep/run-fast.json" ]; then
        python3 -m benchmarks.fast_lora.client compare "$keep/run-default.json" "$keep/run-fast.json" > "$OUT/verdict.json"
        head -8 "$OUT/verdict.json"
      fi ;;
    *) echo "unknown name $name (default, fast, fused, onestream, hookact, free, nolora, score)"; exit 2 ;;
  esac
done
