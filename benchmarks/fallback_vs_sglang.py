"""The route-major fallback against SGLang's own hooked non-TMA path, on a Hopper GPU.

    python -m benchmarks.fallback_vs_sglang [--tokens 1 8 32 64 256 1024 4096 8192] [--out results]

GLM-5.1-FP8 at TP8 (E=257, N=256 per shard, hidden 6144, top-8, block fp8 [128,128], bf16
activations), LoRA-style hooks on both buffers. Both sides get SGLang's tuned config for the batch
size (``try_get_optimal_moe_config``); SGLang runs with ``down_moe_use_tma=False``, which is what
the guard gives hooked calls. Times are CUDA-graph replays (best of 5 x 50). The HBM floor is every
touched expert's weights (and scales) read once at the copy bandwidth measured in the same run.
Also checks, natively and under graph replay, the fallback against SGLang (relative L2 error) and
against the plain PyTorch reference. Writes ``fallback_vs_sglang.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks._bench import SHAPES, benchmark_parser, capture, lookup_configs, prepare_sglang, replay_ms, results_dir, run_meta
from harness import tables, tiny_moe
from harness.reference import reference_moe
from harness.tiny_moe import rel_err
from sglang_lora_tma_guard import fallback

TOKENS = [1, 8, 32, 64, 256, 1024, 4096, 8192]


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second moved by a device-to-device copy (read + write), best of 10."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / best


def measure(shape, tokens, weights, bandwidth) -> dict:
    config, down_config, use_tma = lookup_configs(shape, tokens)
    problem = tiny_moe.make_problem(num_tokens=tokens, topk=shape["topk"], rank=16, seed=tokens,
                                 device="cuda", dtype=torch.bfloat16, weights=weights,
                                 config=config, down_config=down_config)
    hooks = tiny_moe.lora_hooks(problem)

    def sglang():
        return tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks)

    def ours():
        return fallback.fused_moe_hooked(tiny_moe.call_arguments(problem, hooks))

    eager_sglang, eager_ours = sglang(), ours()
    g_sglang, out_sglang = capture(sglang)
    g_ours, out_ours = capture(ours)
    ms_sglang, ms_ours = replay_ms(g_sglang), replay_ms(g_ours)
    touched = int(torch.unique(problem.topk_ids).numel())
    per_expert = (problem.w1[0].numel() * problem.w1.element_size()
                  + problem.w2[0].numel() * problem.w2.element_size()
                  + problem.w1_scale[0].numel() * 4 + problem.w2_scale[0].numel() * 4)
    floor_ms = touched * per_expert / bandwidth * 1e3
    row = {
        "tokens": tokens, "block_m": config["BLOCK_SIZE_M"], "sglang_tma_config": use_tma,
        "ms_sglang_hooked_non_tma": ms_sglang, "ms_fallback": ms_ours, "ratio": ms_ours / ms_sglang,
        "experts_touched": touched, "floor_ms": floor_ms, "fraction_of_floor": floor_ms / ms_ours,
        "rel_err_eager": rel_err(eager_ours, eager_sglang), "rel_err_graph": rel_err(out_ours, out_sglang),
    }
    del g_sglang, g_ours
    return row


def reference_checks() -> list[dict]:
    """Small cases against the plain PyTorch reference, natively (GPU fp8 rounding = PyTorch's)."""
    results = []
    for tokens, experts, topk in [(1, 4, 2), (13, 8, 3), (5, 16, 9), (6, 257, 8)]:
        problem = tiny_moe.make_problem(num_tokens=tokens, num_experts=experts, topk=topk, hidden=256,
                                     intermediate=256, seed=tokens, device="cuda", dtype=torch.bfloat16)
        hooks = tiny_moe.lora_hooks(problem)
        ours = fallback.fused_moe_hooked(tiny_moe.call_arguments(problem, hooks))
        reference = reference_moe(
            {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in tiny_moe.call_arguments(problem, None).items()
             } | {"hooks": _cpu_hooks(problem)})
        results.append({"tokens": tokens, "experts": experts, "topk": topk,
                        "rel_err_vs_reference": rel_err(ours.cpu(), reference)})
    return results


def _cpu_hooks(problem):
    cpu = tiny_moe.MoEProblem(**{f: (getattr(problem, f).cpu() if torch.is_tensor(getattr(problem, f))
                                  else getattr(problem, f))
                              for f in ("hidden_states", "w1", "w2", "w1_scale", "w2_scale",
                                        "topk_weights", "topk_ids", "config", "down_config")},
                           lora={k: v.cpu() for k, v in problem.lora.items()})
    return tiny_moe.lora_hooks(cpu)


def markdown(rows, meta) -> str:
    lines = [
        f"{meta['gpu']}, SGLang {meta['sglang']}, Triton {meta['triton']}; copy bandwidth "
        f"{meta['copy_bandwidth_tb_s']:.2f} TB/s; GLM-5.1-FP8 TP8 shape (E=257, N=256, hidden 6144, "
        "top-8, block fp8); hooked calls; ms per call, CUDA-graph replay, best of 5 x 50.",
        "",
        tables.markdown(
            ["tokens", "SGLang hooked, non-TMA", "fallback", "fallback / SGLang", "experts touched", "HBM floor",
             "fraction of floor", "rel. error vs SGLang (eager / graph)"],
            ([r["tokens"], f"{r['ms_sglang_hooked_non_tma']:.3f}", f"{r['ms_fallback']:.3f}", f"{r['ratio']:.3f}",
              r["experts_touched"], f"{r['floor_ms']:.3f}", f"{r['fraction_of_floor']:.0%}",
              f"{r['rel_err_eager']:.2%} / {r['rel_err_graph']:.2%}"] for r in rows)),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = benchmark_parser(__doc__, TOKENS, shapes=False).parse_args(argv)
    out = results_dir(args)
    prepare_sglang()

    bandwidth = copy_bandwidth()
    meta = run_meta(copy_bandwidth_tb_s=bandwidth / 1e12, reference_checks=reference_checks())
    shape = SHAPES["glm51-fp8-tp8"]
    weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=0, device="cuda")
    rows = []
    for tokens in args.tokens:
        rows.append(measure(shape, tokens, weights, bandwidth))
        print(json.dumps(rows[-1]), flush=True)
        (out / "fallback_vs_sglang.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "fallback_vs_sglang.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
