"""Offline generation with several LoRA adapters on a block-fp8 MoE model, guard on.

    python examples/offline_engine.py --model-path /models/GLM-5.1-FP8 \
        --lora support=/adapters/support --lora legal=/adapters/legal [--tp 8] [--dry-run]

MODEL_PATH and LORA_PATHS ("name=path name=path") work as defaults. The switch is set before SGLang
is imported: the Engine's scheduler processes inherit it and SGLang loads the guard in each of them.
--dry-run prints the Engine arguments and the requests as JSON and starts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROMPTS = [
    "Summarise the refund policy in one sentence.",
    "List three risks in this contract clause: 'The supplier may terminate at will.'",
    "Write a haiku about mixture-of-experts models.",
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=os.environ.get("MODEL_PATH"))
    parser.add_argument("--lora", action="append", default=None, metavar="NAME=PATH")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.lora = args.lora or os.environ.get("LORA_PATHS", "").split()
    if not args.model_path or not args.lora:
        parser.error("need --model-path (or MODEL_PATH) and at least one --lora NAME=PATH (or LORA_PATHS)")
    if any("=" not in item for item in args.lora):
        parser.error("each adapter is NAME=PATH")
    return args


def plan(args) -> dict:
    names = [item.split("=", 1)[0] for item in args.lora]
    engine_args = {
        "model_path": args.model_path,
        "tp_size": args.tp,
        "enable_lora": True,
        "lora_paths": args.lora,
        "max_loras_per_batch": len(names) + 1,  # the base model counts as one
        "moe_runner_backend": "triton",
    }
    # One adapter per prompt, round robin, and one prompt on the base model: a mixed batch.
    adapters = [names[i % len(names)] for i in range(len(PROMPTS) - 1)] + [None]
    return {
        "env": {"SGLANG_LORA_TMA_GUARD": "1"},
        "engine": engine_args,
        "prompts": PROMPTS,
        "lora_path": adapters,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": args.max_new_tokens},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    job = plan(args)
    if args.dry_run:
        print(json.dumps(job, indent=2))
        return 0
    os.environ.update(job["env"])  # before SGLang is imported and spawns its schedulers
    import sglang

    engine = sglang.Engine(**job["engine"])
    try:
        outputs = engine.generate(job["prompts"], job["sampling_params"], lora_path=job["lora_path"])
        for prompt, adapter, output in zip(job["prompts"], job["lora_path"], outputs):
            print(f"[{adapter or 'base'}] {prompt}\n  -> {output['text']!r}")
            if "!!!!" in output["text"]:
                print("  !! a run of '!' is the symptom this guard exists for: run the check")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
