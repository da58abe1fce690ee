"""Tiles of ``lora_moe.expand_silu_and_mul`` (the gate-up expand and the activation in one kernel) against the fast
hook's gate-up expand followed by SGLang's ``silu_and_mul``, on a GPU.

    python -m benchmarks.act_tiles [--shapes qwen3-30b-tp1] [--tokens 256 2048 8192] [--rank-sets r16 mixed] [--shipped]

Per batch (``benchmarks/_lora_setup.py``'s: SGLang's ``LoRAInfo``, four adapters and the base model), CUDA-graph
replays, best of 5 x 50, interleaved: ``both`` (the expand at the shipped tile, then SGLang's activation), and the
one kernel at its shipped tile (``fused_act.tile``) and at each tile of :data:`TILES` (BLOCK_N, column tiles a
program, warps, stages, ranks a tile; ``--shipped``: the shipped tile only), each also scored against the float32
activation of the rows with the delta (before any timing).
Writes ``act_tiles.json`` / ``.md``.
"""

from __future__ import annotations

import functools
import sys

import torch

from benchmarks._bench import benchmark_parser, capture, replay_times
from benchmarks._lora_setup import add_base_option, lora_batch, run_batches
from harness import tables
from sglang_lora_tma_guard import fused_act, lora_moe, lora_path, tuning

_GROUPS = ((32, 8), (64, 1), (64, 6), (64, 12), (128, 6))  # (BLOCK_N, column tiles a program)
TILES = ([(bn, n, w, 2, None, major, False) for bn, n in _GROUPS for w in (4, 8) for major in (False, True)]
         + [(bn, n, 4, 2, 16, major, False) for bn, n in _GROUPS for major in (False, True)]
         + [(bn, n, w, 2, None, True, True) for bn, n in _GROUPS for w in (4, 8)]
         + [(64, 1, 4, 2, None, False, True)])
"""(BLOCK_N, column tiles a program, warps, stages, BLOCK_R: None for every rank in one tile, BLOCK_MAJOR: a block's
column groups as neighbouring programs, PREFETCH: each column tile's rows loaded a tile ahead). The best of a first sweep
(``benchmarks/results/lora_moe/act/``: 4, 8 column tiles of 32; 1, 2, 4, 6 of 64; 1, 2, 3 of 128; stages 2 and 3,
the same within 1%) and one group of the whole width (12 tiles of 64, 6 of 128: Qwen3-30B-A3B at tp 1), in both
program orders, with and without rank tiles of 16; then block by block with the rows asked for before the ranks and
a tile ahead. A block's ranks in a tile of its own size (16, 32 or 64) was slower at every batch measured and is
withdrawn (``benchmarks/results/lora_moe/act/order/classes/``)."""


NO_DELTA = ("silu", "rows only")
"""The variants without the delta: timed, not scored, and not candidates for the best tile."""


def label(tile) -> str:
    return ("N{}x{} w{} s{}".format(*tile[:4]) + (f" R{tile[4]}" if tile[4] else "") + (" B" if tile[5] else "")
            + (" P" if tile[6] else ""))


def measure(capture_mode, name, shape, ranks_name, tokens, weights, tiles=TILES) -> dict:
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    batch = lora_batch(shape, ranks_name, tokens, weights)
    problem, info, c1 = batch.problem, batch.info, batch.cache1
    ids, hidden = problem.topk_ids, problem.hidden_states
    topk, r = ids.shape[1], int(info.max_lora_rank)
    ga, gb = info.gate_up_lora_a_weights, info.gate_up_lora_b_weights
    ranks, enabled = info.lora_ranks.to(torch.int32), info.adapter_enabled.to(torch.int32)
    slots = lora_path.token_adapters(info, tokens)
    plan = tuning.plan(tokens * topk, hidden.shape[1], info.down_lora_a_weights.shape[3], gb.shape[1], ranks.numel(), r)
    routing = lora_moe.route(ids, slots, enabled, ranks, gb.shape[1], plan.block_m)
    t = lora_moe.shrink(hidden, ga, routing, topk=topk, max_rank=r, halves=2, config=plan.gate_up)
    rows = c1.view(-1, c1.shape[2])
    out = rows.new_empty(rows.shape[0], rows.shape[1] // 2)

    def both():
        lora_moe.expand(c1, t, gb, routing, max_rank=r, halves=2, topk_weights=None, config=plan.gate_up)
        fused_moe.silu_and_mul(rows, out)

    def one(tile):
        return lambda: lora_moe.expand_silu_and_mul(out, rows, t, gb, routing, topk_ids=ids, token_lora=slots,
                                                    enabled=enabled, ranks=ranks, max_rank=r, tile=tile)

    shipped = fused_act.tile(rows.shape[0])
    variants = {"both": both, "shipped": one(shipped), "silu": lambda: fused_moe.silu_and_mul(rows, out),
                "rows only": one({**shipped, "ROWS_ONLY": True})}
    for tile in tiles:
        bn, n, w, s, block_r, major, prefetch = tile
        variants[label(tile)] = one({"BLOCK_N": bn, "N_TILES": n, "num_warps": w, "num_stages": s, "BLOCK_R": block_r,
                                     "BLOCK_MAJOR": major, "PREFETCH": prefetch})
    # Right on this GPU: each variant's output from fixed rows against the float32 activation of the rows plus the
    # expand's delta added in float32 (the same bf16 ranks and B), as a share of the largest value.
    gen = torch.Generator(device="cuda").manual_seed(11)
    start = (torch.randn(rows.shape, generator=gen, device="cuda") * 2).to(rows.dtype)
    exact = start.float().view(c1.shape)
    lora_moe.expand(exact, t, gb, routing, max_rank=r, halves=2, topk_weights=None, config=plan.gate_up)
    exact = exact.view(rows.shape)
    half = rows.shape[1] // 2
    expected = torch.nn.functional.silu(exact[:, :half]) * exact[:, half:]
    errors = {}
    for key, fn in variants.items():
        if key in NO_DELTA:
            continue
        rows.copy_(start)
        out.fill_(float("nan"))
        fn()
        errors[key] = float((out.float() - expected).abs().max() / expected.abs().max())
    with capture_mode():
        graphs = {}
        for key, fn in variants.items():
            try:
                graphs[key] = capture(fn)[0]
            except Exception as error:  # a tile past the GPU's resources
                print(f"{key}: {type(error).__name__}: {str(error)[:120]}", flush=True)
    times = replay_times(graphs)
    best = min((k for k in times if k != "both" and k not in NO_DELTA), key=times.get)
    return {"shape": name, "ranks": ranks_name, "tokens": tokens, "block_m": plan.block_m, "ms": times, "best": best,
            "err": errors}


def markdown(rows, meta) -> str:
    return "\n".join([
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}. ms per call, CUDA-graph "
        "replay, best of 5 x 50 (interleaved). both: the gate-up expand (shipped tile) + SGLang's silu_and_mul; "
        "one kernel: lora_moe.expand_silu_and_mul at its shipped tile (fused_act.tile) and at its best tile (BLOCK_N x column "
        "tiles a program, warps, stages; R16: rank tiles of 16; B: a block's column groups as neighbouring programs; "
        "P: rows loaded a tile ahead; C, in runs of 2026-12-07: a block's ranks in a tile of 16, 32 or 64, withdrawn); "
        "silu: SGLang's silu_and_mul alone on the same rows (no delta, rows in order: what the activation's bytes cost "
        "this GPU); rows only: the one kernel at its shipped tile without the delta (the rows in the routing's order).",
        "",
        tables.markdown(["shape", "ranks", "tokens", "silu", "rows only", "both", "one kernel, shipped tile", "best tile",
                         "one kernel, best", "best / both", "error: both / shipped / worst tile"],
                        ([r["shape"], r["ranks"], r["tokens"], *(f"{r['ms'][k]:.3f}" if k in r["ms"] else "–"
                                                                  for k in NO_DELTA),
                          f"{r['ms']['both']:.3f}", f"{r['ms']['shipped']:.3f}",
                          r["best"], f"{r['ms'][r['best']]:.3f}", f"{r['ms'][r['best']] / r['ms']['both']:.2f}",
                          f"{r['err']['both']:.1e} / {r['err']['shipped']:.1e} / {max(r['err'].values()):.1e}"]
                         for r in rows)),
        "",
        "error: the output's largest difference from the float32 activation of the rows plus the float32 delta, over "
        "the largest value (a bf16 rounding of the output is up to 3.9e-3 of a value; the two kernels round the rows "
        "with their delta once more).",
        "",
        "Every variant, ms (columns: shape, ranks, tokens):",
        "",
        every_variant(rows),
    ]) + "\n"


def every_variant(rows) -> str:
    """A table of every variant's time (rows) at every batch (columns), in the order measured."""
    names = list(dict.fromkeys(name for r in rows for name in r["ms"]))
    return tables.markdown(["variant"] + [f"{r['shape']} {r['ranks']} {r['tokens']}" for r in rows],
                           ([name] + [f"{r['ms'][name]:.3f}" if name in r["ms"] else "–" for r in rows]
                            for name in names))


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, [256, 2048, 8192])
    add_base_option(parser)
    parser.add_argument("--rank-sets", nargs="+", default=["r16", "mixed"])
    parser.add_argument("--shipped", action="store_true", help="the shipped tile only (fused_act.tile)")
    args = parser.parse_args(argv)
    return run_batches(args, "act_tiles", functools.partial(measure, tiles=() if args.shipped else TILES), markdown)


if __name__ == "__main__":
    sys.exit(main())
