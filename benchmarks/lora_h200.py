"""Hooked MoE calls on a Hopper GPU: TMA off (today's fix) against TMA for the weights, with
LoRA-style hooks and with SGLang's own LoRA hooks, eager and under CUDA-graph replay.

    python -m benchmarks.lora_h200 [--shapes glm51-fp8-tp8 e80-n640 e513-n512]
                                   [--tokens 1 8 64 256 1024 4096 8192] [--hooks style sglang] [--out results]

Per shape and batch size (SGLang's own tuned configs, which say USE_TMA for these three H200 shapes):

- ``style``: in-place low-rank adds per route (``tiny_moe.lora_hooks``), as in the README's weight-TMA table;
- ``sglang``: SGLang's ``build_lora_hooks`` with a ``LoRAInfo`` of 4 adapters (ranks 8, 16, 32, 64,
  padded to 64; the batch split among them and the base model), its ``fused_moe_lora`` kernels, the
  call made by SGLang's ``TritonRunnerCore.run``; graphs captured in SGLang's capture mode
  (``model_capture_mode``), with its CUDA-graph LoRA buffers and its GPU alignment kernel, hooks built
  inside the graph as the server's runner builds them.

Variants, each captured in its own graph with the guard in the matching state: ``off`` (guard,
plain fix: ``down_moe_use_tma=False``), ``weight`` (guard, weight TMA: route-major buffers,
``b_use_tma=True`` on both GEMMs), ``full`` (no guard: full TMA, wrong output), ``nohook`` (no hooks,
TMA). Checks per row: ``weight`` and ``off`` bit-identical to SGLang's non-TMA path, eagerly and
under replay; rows wrong in ``full``. Times: ms per call, CUDA-graph replay, best of 5 x 50,
interleaved. Writes ``lora_h200.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import sglang_lora_tma_guard as guard
from benchmarks._bench import (
    SHAPES,
    benchmark_parser,
    capture,
    lookup_configs,
    prepare_sglang,
    replay_times,
    results_dir,
    run_meta,
)
from benchmarks._lora_setup import cg_buffers
from harness import real_lora, tables, tiny_moe

TOKENS = [1, 8, 64, 256, 1024, 4096, 8192]
RANKS = (8, 16, 32, 64)


def measure(capture_mode, shape_name, shape, tokens, weights, kinds) -> list[dict]:
    config, down_config, use_tma = lookup_configs(shape, tokens)
    problem = tiny_moe.make_problem(
        num_tokens=tokens, topk=shape["topk"], rank=16, seed=tokens, device="cuda", dtype=torch.bfloat16,
        weights=weights, config=config, down_config=down_config,
    )
    rows = []
    for kind in kinds:
        if kind == "style":
            hooks = tiny_moe.lora_hooks(problem)

            def call(tma, hooked=True):
                return tiny_moe.run_sequence(problem, use_tma=tma, hooks=hooks if hooked else None)
            in_capture = None
        else:
            adapters = real_lora.Adapters(ranks=RANKS, enabled=(True,) * len(RANKS))
            info = real_lora.make_lora_info(problem, adapters, seed=tokens,
                                            cg_buffers=cg_buffers(problem, len(RANKS)))

            def call(tma, hooked=True):
                hooks = real_lora.lora_hooks(problem, info) if hooked else None
                return real_lora.run_runner(problem, hooks, use_tma=tma)
            in_capture = capture_mode

        def graph(fn):
            if in_capture is None:
                return capture(fn)
            with in_capture():
                return capture(fn)

        row = {"shape": shape_name, "tokens": tokens, "hooks": kind, "tma_config": use_tma}
        guard.deactivate()
        reference = call(False)
        full = call(True)
        g_ref, out_ref = graph(lambda: call(False))
        g_full, out_full = graph(lambda: call(True))
        g_nohook, _ = graph(lambda: call(True, hooked=False))
        guard.activate(weight_tma=False)
        off = call(True)
        g_off, out_off = graph(lambda: call(True))
        guard.activate(weight_tma=True)
        weight = call(True)
        g_weight, out_weight = graph(lambda: call(True))
        graphs = {"off": g_off, "weight": g_weight, "full": g_full, "nohook": g_nohook}
        times = replay_times(graphs)
        row.update(
            rows_wrong_full_eager=tiny_moe.compare(full, reference).rows_wrong,
            rows_wrong_full_graph=tiny_moe.compare(out_full, out_ref).rows_wrong,
            weight_identical_eager=bool(torch.equal(weight, reference)),
            weight_identical_graph=bool(torch.equal(out_weight, out_ref)),
            off_identical_eager=bool(torch.equal(off, reference)),
            off_identical_graph=bool(torch.equal(out_off, out_ref)),
            **{f"ms_{name}": value for name, value in times.items()},
        )
        row["weight_vs_off"] = row["ms_off"] / row["ms_weight"]  # > 1: weight TMA is faster
        row["weight_vs_full"] = row["ms_weight"] / row["ms_full"]  # <= 1: not slower than full TMA
        rows.append(row)
        del g_ref, g_full, g_nohook, g_off, g_weight, graphs
    return rows


def markdown(rows, meta) -> str:
    lines = [
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}. ms per hooked "
        "MoE call, CUDA-graph replay, best of 5 x 50 (interleaved). off = today's fix (TMA off); weight = TMA for "
        "the weights only; full = unguarded TMA (wrong output). Speed-up = off / weight.",
        "",
    ]
    same = {True: "bit-identical", False: "DIFFERENT"}
    lines.append(tables.markdown(
        ["shape", "tokens", "hooks", "TMA off", "weight TMA", "full TMA (wrong)", "no hooks, TMA", "speed-up vs off",
         "weight / full", "weight = non-TMA (eager / graph)", "off = non-TMA", "rows wrong, full (eager / graph)"],
        ([r["shape"], r["tokens"], r["hooks"], f"{r['ms_off']:.3f}", f"{r['ms_weight']:.3f}", f"{r['ms_full']:.3f}",
          f"{r['ms_nohook']:.3f}", f"{r['weight_vs_off']:.3f}", f"{r['weight_vs_full']:.3f}",
          f"{same[r['weight_identical_eager']]} / {same[r['weight_identical_graph']]}",
          same[r["off_identical_eager"] and r["off_identical_graph"]],
          f"{r['rows_wrong_full_eager']}/{r['tokens']} / {r['rows_wrong_full_graph']}/{r['tokens']}"] for r in rows)))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, TOKENS)
    parser.add_argument("--hooks", nargs="+", default=["style", "sglang"], choices=["style", "sglang"])
    args = parser.parse_args(argv)
    out = results_dir(args)

    prepare_sglang()
    from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

    meta = run_meta(ranks=RANKS)
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=0, device="cuda")
        for tokens in args.tokens:
            t0 = time.perf_counter()
            for row in measure(model_capture_mode, name, shape, tokens, weights, args.hooks):
                rows.append(row)
                print(json.dumps(row) + f"  # {time.perf_counter() - t0:.1f} s", flush=True)
            (out / "lora_h200.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            (out / "lora_h200.md").write_text(markdown(rows, meta))
        del weights
        torch.cuda.empty_cache()
    guard.deactivate()
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
