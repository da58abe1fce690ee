"""Tune the fast LoRA MoE path's tiles on this GPU: rows per block, and each hook's shrink and expand tiles.

    python -m benchmarks.tune_lora_moe [--shapes ...] [--tokens 1 8 64 256 1024 4096 8192] [--out results]

Per shape (``_bench.SHAPES``), rank set (4 adapters of ranks 8/16/32/64, and all 16 on the GLM-5.1
shape) and batch size: for each candidate rows-per-block, the routing, then each hook's shrink tiles
and expand tiles timed alone (CUDA-graph replay, best of 3 x 20), the best of each kept, then the
whole hook with those two against both GEMMs in one launch (``StageConfig.one_kernel``, up to 8192
pairs); the rows-per-block with the least total wins. Writes ``lora_moe_tiles.json`` (the package's data format,
``sglang_lora_tma_guard/tuning.py``: the shipped table with each bucket tuned here replaced) and
``tune_lora_moe.md`` under ``--out``; copy the JSON into the package to ship it.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, replace

import torch

from benchmarks._bench import benchmark_parser, capture, prepare_sglang, replay_times, results_dir
from benchmarks._lora_setup import batches, lora_info
from harness import tables, tiny_moe
from sglang_lora_tma_guard import lora_moe, tuning
from sglang_lora_tma_guard.lora_path import token_adapters

TOKENS = [1, 8, 64, 256, 1024, 4096, 8192]
BASE = lora_moe.StageConfig()


def shrink_candidates(k: int, max_rank: int, num_pairs: int):
    for block_r in (16, 32, 64):
        if block_r > max(16, max_rank):
            continue
        for block_k in ((128, 256) if k >= 2048 else (64, 128)):
            for split_k in ((1, 4) if k >= 2048 and num_pairs <= 2048 else (1,)):
                yield replace(BASE, shrink_block_r=block_r, shrink_block_k=block_k, split_k=split_k)


# (128, 16, 8): the decode tiles' own shape with twice the warps: 48 registers a thread against 72 (sm_90
# PTX through ptxas, `python -m harness.ptx`), 40 warps an SM against 28 where Nsight Compute finds the
# 4-warp tile latency-bound at the occupancy its registers allow (docs/lora_moe_floor.md).
EXPAND_TILES = ((64, 16, 4), (64, 32, 4), (128, 16, 4), (128, 16, 8), (128, 32, 8), (128, 64, 8), (256, 32, 8))


def expand_candidates(max_rank: int, num_pairs: int):
    for block_n, block_r, warps in EXPAND_TILES:
        if block_r <= max(16, max_rank):
            for n_tiles in (1, 4, 16, 64):  # column tiles per program (64: a whole row of the output)
                # Where the expand streams its output, more of it in flight: deeper pipelines of the loop.
                for stages in (2, 3, 4) if n_tiles > 1 and num_pairs >= 8192 else (2,):
                    yield replace(BASE, expand_block_n=block_n, expand_block_r=block_r, expand_warps=warps,
                                  expand_n_tiles=n_tiles, expand_stages=stages)


ONE_KERNEL_PAIRS = 8192
"""Up to this many pairs (1024 tokens at top-8) the tuner also tries both GEMMs of a hook in one launch."""


def one_kernel_candidates(k: int, max_rank: int, num_pairs: int):
    if num_pairs > ONE_KERNEL_PAIRS or max_rank > 64:
        return
    for block_n in (64, 128):
        for n_tiles in (1, 4, 16):
            for warps in (4, 8):
                yield replace(BASE, one_kernel=True, shrink_block_k=128 if k >= 512 else 64, expand_block_n=block_n,
                              expand_n_tiles=n_tiles, expand_warps=warps)


def block_m_candidates(num_pairs: int):
    return (16,) if num_pairs <= 512 else (16, 32) if num_pairs <= 8192 else (16, 32, 64)


def best(graphs: dict) -> tuple[str, float]:
    times = replay_times(graphs, replays=20, repeats=3)
    name = min(times, key=times.get)
    return name, times[name]


def _try_capture(fn):
    """The graph of ``fn``, or None when its tiles do not fit this GPU (Triton's OutOfResources at the
    first launch, before any capture starts)."""
    from triton.runtime.errors import OutOfResources

    try:
        fn()
    except OutOfResources:
        return None
    return capture(fn)[0]


def tune_hook(routing, info, ranks, x, out, a, b, halves, topk, weights):
    """(best StageConfig, ms) for one hook: the shrink tiles, then the expand tiles on the best shrink,
    then that pair (the whole hook, two launches) against the one-kernel candidates (one launch)."""
    r = info.max_lora_rank
    shrinks = {}
    for cfg in shrink_candidates(x.shape[1], r, routing.num_pairs):
        graph = _try_capture(lambda c=cfg: lora_moe.shrink(x, a, routing, topk=topk, max_rank=r, halves=halves,
                                                            config=c))
        if graph is not None:
            shrinks[cfg] = graph
    shrink_cfg, _ = best(shrinks)
    t = lora_moe.shrink(x, a, routing, topk=topk, max_rank=r, halves=halves, config=shrink_cfg)
    expands = {}
    for cfg in expand_candidates(r, routing.num_pairs):
        graph = _try_capture(lambda c=cfg: lora_moe.expand(out, t, b, routing, max_rank=r, halves=halves,
                                                            topk_weights=weights, config=c))
        if graph is not None:
            expands[cfg] = graph
    expand_cfg, _ = best(expands)
    tiles = replace(shrink_cfg, **{k: v for k, v in asdict(expand_cfg).items() if k.startswith("expand")})
    # The two launches against one, timed side by side: a one-kernel hook wins only where it is faster.
    hooks = {tiles: capture(lambda: lora_moe.add_delta(out, x, a, b, routing, max_rank=r, halves=halves,
                                                       topk_weights=weights, config=tiles))[0]}
    for cfg in one_kernel_candidates(x.shape[1], r, routing.num_pairs):
        graph = _try_capture(lambda c=cfg: lora_moe.add_delta(out, x, a, b, routing, max_rank=r, halves=halves,
                                                               topk_weights=weights, config=c))
        if graph is not None:
            hooks[cfg] = graph
    return best(hooks)


def tune_batch(shape, ranks_name, tokens, weights):
    problem = tiny_moe.make_problem(num_tokens=tokens, topk=shape["topk"], seed=tokens, device="cuda",
                                    dtype=torch.bfloat16, weights=weights)
    info = lora_info(problem, ranks_name, seed=tokens)
    topk_ids, (tok, topk) = problem.topk_ids, problem.topk_ids.shape
    ranks, enabled = info.lora_ranks, info.adapter_enabled
    experts, halves = info.gate_up_lora_b_weights.shape[1], 2
    adapters = token_adapters(info, tok)
    hidden = problem.hidden_states
    cache1 = torch.zeros(tok, topk, info.gate_up_lora_b_weights.shape[2], dtype=hidden.dtype, device="cuda")
    act = torch.randn(tok * topk, info.down_lora_a_weights.shape[3], dtype=hidden.dtype, device="cuda")
    cache3 = torch.zeros(tok, topk, hidden.shape[1], dtype=hidden.dtype, device="cuda")
    results = []
    for block_m in block_m_candidates(tok * topk):
        routing = lora_moe.route(topk_ids, adapters, enabled, ranks, experts, block_m)
        route_graph, _ = capture(lambda bm=block_m: lora_moe.route(topk_ids, adapters, enabled, ranks, experts, bm))
        route_ms = replay_times({"r": route_graph}, replays=20, repeats=3)["r"]
        gate_up, gate_up_ms = tune_hook(routing, info, ranks, hidden, cache1, info.gate_up_lora_a_weights,
                                        info.gate_up_lora_b_weights, halves, topk, None)
        down, down_ms = tune_hook(routing, info, ranks, act, cache3, info.down_lora_a_weights,
                                  info.down_lora_b_weights, 1, topk, problem.topk_weights)
        results.append((route_ms + gate_up_ms + down_ms, block_m, gate_up, down, route_ms))
    total, block_m, gate_up, down, route_ms = min(results, key=lambda item: item[0])
    key = tuning.shape_key(hidden.shape[1], act.shape[1], experts, info.max_lora_rank)
    entry = {"max_pairs": tok * topk, "block_m": block_m, "gate_up": asdict(gate_up), "down": asdict(down),
             "ms": round(total, 4), "route_ms": round(route_ms, 4)}
    return key, entry


def _place(buckets: list, entry: dict) -> None:
    """``entry`` in place of the bucket of its pair count, or added where the table has none."""
    buckets[:] = sorted([b for b in buckets if b["max_pairs"] != entry["max_pairs"]] + [entry],
                        key=lambda b: b["max_pairs"])


def _tiles(t: dict) -> str:
    if t.get("one_kernel"):
        return (f"one kernel k{t['shrink_block_k']} n{t['expand_block_n']} w{t['expand_warps']} "
                f"x{t['expand_n_tiles']}")
    return (f"shrink r{t['shrink_block_r']} k{t['shrink_block_k']} split {t['split_k']}, "
            f"expand n{t['expand_block_n']} r{t['expand_block_r']} w{t['expand_warps']} x{t.get('expand_n_tiles', 1)}"
            f" s{t['expand_stages']}")


def main(argv=None) -> int:
    args = benchmark_parser(__doc__, TOKENS).parse_args(argv)
    out = results_dir(args)
    prepare_sglang()
    gpu = torch.cuda.get_device_name()
    tiles = copy.deepcopy(tuning._table(None))  # the shipped table, each bucket tuned here replaced
    tiles.setdefault(gpu, {})
    table = tables.Table(["shape", "ranks", "tokens", "block_m", "gate-up tiles", "down tiles", "LoRA ms (tuned)"],
                         echo=False)
    for name, shape, ranks_name, tokens, weights in batches(args.shapes, args.tokens):
        t0 = time.perf_counter()
        key, entry = tune_batch(shape, ranks_name, tokens, weights)
        _place(tiles[gpu].setdefault(key, []), entry)
        line = table.add(name, ranks_name, tokens, entry["block_m"], _tiles(entry["gate_up"]), _tiles(entry["down"]),
                         f"{entry['ms']:.3f}")
        print(line, f"  # {time.perf_counter() - t0:.1f} s", flush=True)
        (out / "lora_moe_tiles.json").write_text(json.dumps(tiles, indent=1) + "\n")
        (out / "tune_lora_moe.md").write_text(f"{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
