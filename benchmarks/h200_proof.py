"""The bug and the guard on a Hopper GPU, with the installed SGLang's own kernels and tuned configs.

    python -m benchmarks.h200_proof [--shapes glm51-fp8-tp8 e80-n640 e513-n512]
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

import json
import os
import sys
import time

import torch

import sglang_lora_tma_guard as guard
from benchmarks._bench import SHAPES, benchmark_parser, capture, lookup_configs, prepare_sglang, replay_ms, results_dir, run_meta
from harness import tables, tiny_moe

TOKENS = [1, 8, 64, 256, 1024, 4096, 8192]


def host_us_per_call(fn, calls=100, repeats=5) -> tuple[float, float]:
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


def measure(shape_name: str, shape: dict, tokens: int, weights) -> dict:
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
    unguarded_host, guarded_host = host_us_per_call(call(True, False))

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


def compiled_caller_check(tokens=8) -> dict:
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
    ]
    same = lambda ok, diff: "bit-identical" if ok else f"max diff {diff:.3g}"  # noqa: E731
    lines.append(tables.markdown(
        ["shape", "tokens", "TMA config", "rows wrong, unguarded (eager / graph)", "guarded vs non-TMA (eager / graph)",
         "no hooks, TMA", "no hooks, plain", "hooked, guarded", "hooked, TMA (wrong)", "guarded / TMA",
         "host µs/call hook-less (off → on)"],
        ([r["shape"], r["tokens"], "on" if r["tma_config"] else "off",
          f"{r['eager_rows_wrong_unguarded']}/{r['tokens']} / {r['graph_rows_wrong_unguarded']}/{r['tokens']}",
          f"{same(r['eager_guarded_identical'], r['eager_guarded_max_abs_diff'])} / "
          f"{same(r['graph_guarded_identical'], r['graph_guarded_max_abs_diff'])}",
          f"{r['ms_nohook_tma']:.3f}", f"{r['ms_nohook_plain']:.3f}", f"{r['ms_hooked_guarded']:.3f}",
          f"{r['ms_hooked_tma_wrong']:.3f}", f"{r['guard_cost_ratio']:.3f}",
          f"{r['host_us_nohook_unguarded']:.1f} → {r['host_us_nohook_guarded']:.1f}"] for r in rows)))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = benchmark_parser(__doc__, TOKENS).parse_args(argv)
    out = results_dir(args)

    prepare_sglang()
    os.environ["SGLANG_LORA_TMA_GUARD"] = "1"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    state = guard.status()
    if not state.installed:
        sys.exit(f"h200_proof: the guard did not install through load_plugins(): {state}")

    meta = run_meta(strategy=state.strategy, activated_by="SGLANG_LORA_TMA_GUARD=1 + sglang.srt.plugins.load_plugins()")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=0, device="cuda")
        for tokens in args.tokens:
            t0 = time.perf_counter()
            rows.append(measure(name, shape, tokens, weights))
            print(json.dumps(rows[-1]) + f"  # {time.perf_counter() - t0:.1f} s", flush=True)
            (out / "h200_proof.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            (out / "h200_proof.md").write_text(markdown(rows, meta))
        del weights
        torch.cuda.empty_cache()
    print(markdown(rows, meta))
    meta["torch_compile"] = compiled_caller_check()
    print("torch.compile:", json.dumps(meta["torch_compile"]))
    (out / "h200_proof.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
