"""Which tile settings suit the fallback's kernels, per batch size, on the GLM-5.1-FP8 TP8 shape.

    python -m benchmarks.tune_fallback [--tokens 1 8 32 64 256 1024 4096 8192]

For each batch size, starts from SGLang's tuned configs (what the fallback uses) and varies the
pipeline depth, warps and N tile of one GEMM at a time, timing the whole hooked fallback call as a
CUDA-graph replay. Prints, per size, SGLang's hooked non-TMA time and the best variants. BLOCK_M
stays SGLang's: the route list is padded to it.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from benchmarks._bench import SHAPES, benchmark_parser, capture, lookup_configs, prepare_sglang, replay_ms
from harness import tiny_moe
from sglang_lora_tma_guard import fallback

TOKENS = [1, 8, 32, 64, 256, 1024, 4096, 8192]


def main(argv=None) -> int:
    args = benchmark_parser(__doc__, TOKENS, shapes=False).parse_args(argv)
    prepare_sglang()
    shape = SHAPES["glm51-fp8-tp8"]
    weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=0, device="cuda")
    for tokens in args.tokens:
        config, down_config, _ = lookup_configs(shape, tokens)
        problem = tiny_moe.make_problem(num_tokens=tokens, topk=shape["topk"], rank=16, seed=tokens,
                                     device="cuda", dtype=torch.bfloat16, weights=weights,
                                     config=config, down_config=down_config)
        hooks = tiny_moe.lora_hooks(problem)
        g, _ = capture(lambda: tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks))
        sglang_ms = replay_ms(g)
        del g

        def time_with(up=None, down=None):
            over = {"config": {**config, **(up or {})}, "down_config": {**down_config, **(down or {})}}
            graph, _ = capture(lambda: fallback.fused_moe_hooked(tiny_moe.call_arguments(problem, hooks, **over)))
            ms = replay_ms(graph)
            del graph
            return ms

        results = [("sglang tiles", {}, {}, time_with())]
        for stages, warps, block_n in itertools.product((2, 3, 4), (4, 8), (64, 128, 256)):
            variant = {"num_stages": stages, "num_warps": warps, "BLOCK_SIZE_N": block_n}
            for which in ("up", "down"):
                try:
                    ms = time_with(**{which: variant})
                except Exception:  # out of shared memory and the like
                    ms = float("inf")
                results.append((which, variant, None, ms))
        results.sort(key=lambda r: r[-1])
        base = next(r[-1] for r in results if r[0] == "sglang tiles")
        print(json.dumps({"tokens": tokens, "sglang_ms": sglang_ms, "fallback_sglang_tiles_ms": base,
                          "best": [(r[0], r[1], round(r[-1], 4)) for r in results[:4]]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
