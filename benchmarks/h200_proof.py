"""The bug and the guard on a Hopper GPU, with the installed SGLang's own kernels and tuned configs.

    python benchmarks/h200_proof.py [--shapes glm51-fp8-tp8 e80-n640 e513-n512]
                                    [--tokens 1 8 64 256 1024 4096 8192] [--out results]

For each shape (experts E, intermediate size per shard N, hidden K, top-k; block-fp8 [128,128]
weights, bf16 activations) and batch size, the configs come from SGLang's own lookup
(``try_get_optimal_moe_config``, the device's tuned ``*_down.json`` deciding ``USE_TMA``). LoRA-style
hooks add a low-rank delta per route. The guard is loaded the way users load it
(``SGLANG_LORA_TMA_GUARD=1`` and SGLang's ``load_plugins()``), and toggled with ``deactivate()`` /
``activate()`` for the unguarded runs. Reported per size, eager and under CUDA-graph capture and
replay: rows wrong without the guard, maximum difference to SGLang's non-TMA hooked path with it;
CUDA-graph replay times of four variants; the guard's host cost per eager hook-less call.
Writes ``h200_proof.json`` and ``h200_proof.md`` under ``--out``.

Without the ``sglang-kernel`` wheel (too large to carry), ``torch.version.cuda`` is set to None
before SGLang is imported: SGLang's helper ops (activation, sum) take their portable paths, while
the fused-MoE Triton kernels run on the GPU with real TMA descriptors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # GLM-5.1-FP8 on 8 GPUs: 256 routed experts + the fused shared expert, N per shard, hidden 6144.
    "glm51-fp8-tp8": dict(E=257, N=256, K=6144, topk=8),
    # Two more shapes whose tuned H200 down configs say USE_TMA (hidden sizes chosen here).
    "e80-n640": dict(E=80, N=640, K=4096, topk=8),
    "e513-n512": dict(E=513, N=512, K=4096, topk=8),
}
TOKENS = [1, 8, 64, 256, 1024, 4096, 8192]


def benchmark_parser(doc: str, tokens: list[int], shapes: bool = True) -> argparse.ArgumentParser:
    """The options every H200 benchmark takes: --tokens, --out (default $OUT or results), --shapes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if shapes:
        parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=tokens)
    parser.add_argument("--out", default=os.environ.get("OUT", "results"), type=Path)
    return parser


def results_dir(args) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out


def load_sglang():
    if not torch.cuda.is_available():
        sys.exit("h200_proof: needs a CUDA GPU")
    from _sglang_env import portable_helper_ops

    portable_helper_ops()
    import warnings

    warnings.filterwarnings("ignore")
    from sglang_lora_tma_guard import tiny_moe

    return tiny_moe


def lookup_configs(shape: dict, tokens: int):
    """SGLang's own choice for this shape and batch size: (config, down_config, use_tma)."""
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import support_tensor_descriptor
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        try_get_optimal_moe_config,
    )

    E, N, K = shape["E"], shape["N"], shape["K"]
    config, (down_config, _) = try_get_optimal_moe_config(
        (E, 2 * N, K), (E, K, N), shape["topk"], "fp8_w8a8", tokens,
        block_shape=[128, 128], return_down_config=True,
    )
    use_tma = bool(support_tensor_descriptor() and down_config is not None
                   and down_config.pop("USE_TMA", False))
    return dict(config), dict(down_config or config), use_tma


def capture(fn):
    """Capture ``fn`` in a CUDA graph; return (graph, its output tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def replay_ms(graph, replays=50, repeats=5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / replays)
    return best


def host_us_per_call(fn, guard, calls=100, repeats=5) -> tuple[float, float]:
    """Host time per eager call, guard off and on, interleaved; best of ``repeats`` each."""
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for on in (False, True):
            guard.activate() if on else guard.deactivate()
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[on] = min(best[on], (time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return best[False], best[True]


def measure(tiny_moe, guard, shape_name: str, shape: dict, tokens: int, weights) -> dict:
    config, down_config, use_tma = lookup_configs(shape, tokens)
    problem = tiny_moe.make_problem(
        num_tokens=tokens, topk=shape["topk"], rank=16, seed=tokens, device="cuda",
        dtype=torch.bfloat16, weights=weights, config=config, down_config=down_config,
    )
    hooks = tiny_moe.lora_hooks(problem)

    def call(tma, with_hooks):
        return lambda: tiny_moe.run_sequence(problem, use_tma=tma, hooks=hooks if with_hooks else None)

    row = {"shape": shape_name, "tokens": tokens, "tma_config": use_tma,
           "block_m": config["BLOCK_SIZE_M"]}

    guard.deactivate()
    reference = call(False, True)()
    unguarded = call(True, True)()
    plain_nohook, tma_nohook = call(False, False)(), call(True, False)()
    g_ref, out_ref = capture(call(False, True))
    g_bad, out_bad = capture(call(True, True))
    g_plain, _ = capture(call(False, False))
    g_tma, _ = capture(call(True, False))

    guard.activate()
    guarded = call(True, True)()
    tma_nohook_guarded = call(True, False)()
    g_good, out_good = capture(call(True, True))
    unguarded_host, guarded_host = host_us_per_call(call(True, False), guard)

    eager_bad, eager_good = tiny_moe.compare(unguarded, reference), tiny_moe.compare(guarded, reference)
    graph_bad, graph_good = tiny_moe.compare(out_bad, out_ref), tiny_moe.compare(out_good, out_ref)
    row.update(
        eager_rows_wrong_unguarded=eager_bad.rows_wrong,
        eager_max_rel_err_unguarded=eager_bad.max_rel_err,
        eager_guarded_identical=eager_good.identical,
        eager_guarded_max_abs_diff=eager_good.max_abs_diff,
        graph_rows_wrong_unguarded=graph_bad.rows_wrong,
        graph_guarded_identical=graph_good.identical,
        graph_guarded_max_abs_diff=graph_good.max_abs_diff,
        nohook_tma_equals_plain=bool(torch.equal(tma_nohook, plain_nohook)),
        nohook_untouched_by_guard=bool(torch.equal(tma_nohook_guarded, tma_nohook)),
        ms_nohook_tma=replay_ms(g_tma),
        ms_nohook_plain=replay_ms(g_plain),
        ms_hooked_guarded=replay_ms(g_good),
        ms_hooked_tma_wrong=replay_ms(g_bad),
        host_us_nohook_unguarded=unguarded_host,
        host_us_nohook_guarded=guarded_host,
    )
    row["guard_cost_ratio"] = row["ms_hooked_guarded"] / row["ms_hooked_tma_wrong"]
    del g_ref, g_bad, g_plain, g_tma, g_good
    return row


def compiled_caller_check(tiny_moe, guard, tokens=8) -> dict:
    """A caller compiled with torch.compile (backend "eager") on the GPU: is the guard applied?"""
    shape = SHAPES["glm51-fp8-tp8"]
    config, down_config, _ = lookup_configs(shape, tokens)
    weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=1, device="cuda")
    problem = tiny_moe.make_problem(num_tokens=tokens, topk=shape["topk"], seed=1, device="cuda",
                                 dtype=torch.bfloat16, weights=weights, config=config,
                                 down_config=down_config)
    hooks = tiny_moe.lora_hooks(problem)
    guard.deactivate()
    reference = tiny_moe.run_sequence(problem, use_tma=False, hooks=hooks)
    result = {}
    for on in (False, True):
        guard.activate() if on else guard.deactivate()
        torch._dynamo.reset()
        compiled = torch.compile(lambda: tiny_moe.run_sequence(problem, use_tma=True, hooks=hooks),
                                 backend="eager")
        try:
            verdict = tiny_moe.compare(compiled(), reference)
            result["guard on" if on else "guard off"] = str(verdict)
        except Exception as exc:  # report, do not hide: Dynamo may not trace SGLang's function
            result["guard on" if on else "guard off"] = f"error: {type(exc).__name__}: {exc}"[:300]
    return result


def markdown(rows, meta) -> str:
    lines = [
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}; "
        "ms per MoE call as CUDA-graph replay (best of 5 x 50); rows wrong = relative L2 error > 1% "
        "against SGLang's non-TMA hooked path.",
        "",
        "| shape | tokens | TMA config | rows wrong, unguarded (eager / graph) | guarded vs non-TMA (eager / graph) "
        "| no hooks, TMA | no hooks, plain | hooked, guarded | hooked, TMA (wrong) | guarded / TMA "
        "| host µs/call hook-less (off → on) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = lambda ok, diff: "bit-identical" if ok else f"max diff {diff:.3g}"  # noqa: E731
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {'on' if r['tma_config'] else 'off'} "
            f"| {r['eager_rows_wrong_unguarded']}/{r['tokens']} / {r['graph_rows_wrong_unguarded']}/{r['tokens']} "
            f"| {same(r['eager_guarded_identical'], r['eager_guarded_max_abs_diff'])} / "
            f"{same(r['graph_guarded_identical'], r['graph_guarded_max_abs_diff'])} "
            f"| {r['ms_nohook_tma']:.3f} | {r['ms_nohook_plain']:.3f} | {r['ms_hooked_guarded']:.3f} "
            f"| {r['ms_hooked_tma_wrong']:.3f} | {r['guard_cost_ratio']:.3f} "
            f"| {r['host_us_nohook_unguarded']:.1f} → {r['host_us_nohook_guarded']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = benchmark_parser(__doc__, TOKENS).parse_args(argv)
    out = results_dir(args)

    tiny_moe = load_sglang()
    os.environ["SGLANG_LORA_TMA_GUARD"] = "1"
    from sglang.srt.plugins import load_plugins

    import sglang_lora_tma_guard as guard
    from sglang_lora_tma_guard import installed
    from sglang_lora_tma_guard.inspection import sglang_version

    installed.fused_moe_module()
    installed.ensure_server_args()
    load_plugins()
    state = guard.status()
    if not state.installed:
        sys.exit(f"h200_proof: the guard did not install through load_plugins(): {state}")
    import triton

    meta = {"sglang": sglang_version(), "torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name(0), "strategy": state.strategy,
            "activated_by": "SGLANG_LORA_TMA_GUARD=1 + sglang.srt.plugins.load_plugins()"}
    print(json.dumps(meta), flush=True)
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=0, device="cuda")
        for tokens in args.tokens:
            t0 = time.perf_counter()
            rows.append(measure(tiny_moe, guard, name, shape, tokens, weights))
            print(json.dumps(rows[-1]) + f"  # {time.perf_counter() - t0:.1f} s", flush=True)
            (out / "h200_proof.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            (out / "h200_proof.md").write_text(markdown(rows, meta))
        del weights
        torch.cuda.empty_cache()
    print(markdown(rows, meta))
    meta["torch_compile"] = compiled_caller_check(tiny_moe, guard)
    print("torch.compile:", json.dumps(meta["torch_compile"]))
    (out / "h200_proof.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
