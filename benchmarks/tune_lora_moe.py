"""Tune the fast LoRA MoE path's tiles on this GPU: rows per block, and each hook's shrink and expand tiles.

    python -m benchmarks.tune_lora_moe [--shapes ...] [--tokens 1 8 64 256 1024 4096 8192] [--rank-sets ...] [--out results]

Per shape (``_bench.SHAPES``), rank set (4 adapters of ranks 8/16/32/64, and all 16 on the GLM-5.1
shape) and batch size: for each candidate rows-per-block, the routing, then each hook's shrink tiles
and expand tiles timed alone (CUDA-graph replay, best of 3 x 20; where ``=fast`` splits the fused down launch by
rank, the down expand of the adapters above the split alone, as it runs there), the best of each kept, then the
whole hook with those two against both GEMMs in one launch (``StageConfig.one_kernel``, up to 8192
pairs); the rows-per-block with the least total wins. Writes ``lora_moe_tiles.json`` (the package's data format,
``sglang_lora_tma_guard/tuning.py``: the table in use, ``SGLANG_LORA_TMA_GUARD_TILES`` or the shipped
one, with each bucket tuned here replaced under this GPU's name: a GPU that takes another's tiles, ``tuning.TILES_OF``,
keeps them for every bucket not tuned on it) and
``tune_lora_moe.md`` under ``--out``; copy the JSON into the package to ship it. Before the timing,
``--compile-workers`` processes compile every candidate of every batch into Triton's cache (a cold
tuning spent most of its time compiling one kernel at a time).

``--against FILE`` tunes nothing: each batch's whole LoRA work (its routing and both hooks) with the
shipped tiles and with FILE's, the two graphs replayed in turn (best of 5 x 50), into ``tiles_ab.md``:
what a tuned table buys on shapes whose base the kernel table cannot build (block-fp8 needs widths
in multiples of 128; Qwen3-30B-A3B at tp 4 has 192).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks._bench import benchmark_parser, capture, prepare_sglang, replay_times, results_dir
from benchmarks._lora_setup import add_rank_sets_option, batches, lora_info, shape_rank_sets
from harness import tables, tiny_moe
from sglang_lora_tma_guard import fused_lora, lora_moe, tuning
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


@dataclass
class Hook:
    """One hook's operands: ``x`` into ``out`` through A and B (``halves``: 2 for a gated gate-up)."""

    x: torch.Tensor
    out: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    halves: int
    topk: int
    rank: int
    weights: torch.Tensor | None
    rank_above: int = 0  # the expand adds only the adapters above this rank (the fused down launch split by rank)


@dataclass
class Batch:
    """One tuned batch: its routing inputs and both hooks."""

    topk_ids: torch.Tensor
    adapters: torch.Tensor
    enabled: torch.Tensor
    ranks: torch.Tensor
    experts: int
    key: str
    gate_up: Hook
    down: Hook

    @classmethod
    def make(cls, shape, ranks_name, tokens, weights, device="cuda", dtype=torch.bfloat16) -> Batch:
        problem = tiny_moe.make_problem(num_tokens=tokens, topk=shape["topk"], seed=tokens, device=device,
                                        dtype=dtype, weights=weights)
        info = lora_info(problem, ranks_name, seed=tokens)
        tok, topk = problem.topk_ids.shape
        hidden, r = problem.hidden_states, info.max_lora_rank
        like = dict(dtype=hidden.dtype, device=device)
        cache1 = torch.zeros(tok, topk, info.gate_up_lora_b_weights.shape[2], **like)
        act = torch.randn(tok * topk, info.down_lora_a_weights.shape[3], **like)
        cache3 = torch.zeros(tok, topk, hidden.shape[1], **like)
        experts = info.gate_up_lora_b_weights.shape[1]
        # Where =fast splits the fused down launch by rank, its epilogue adds the adapters up to that rank and the
        # hook's expand the others: the expand tuned is that one. The split is placed for block-fp8 experts (the
        # tuner's); the tiles are keyed by shape, so a bf16 model of a split shape runs the whole expand on them.
        split = fused_lora._placed(tok * topk, r, act.shape[1])
        return cls(problem.topk_ids, token_adapters(info, tok), info.adapter_enabled, info.lora_ranks, experts,
                   tuning.shape_key(hidden.shape[1], act.shape[1], experts, r),
                   Hook(hidden, cache1, info.gate_up_lora_a_weights, info.gate_up_lora_b_weights, 2, topk, r, None),
                   Hook(act, cache3, info.down_lora_a_weights, info.down_lora_b_weights, 1, topk, r,
                        problem.topk_weights, split if split is not None and split < r else 0))

    @property
    def num_pairs(self) -> int:
        return self.topk_ids.numel()

    @property
    def plan_sizes(self) -> tuple[int, ...]:
        """What ``tuning.plan`` takes for this batch: pairs, hidden, intermediate, experts, adapters, rank."""
        return (self.num_pairs, self.gate_up.x.shape[1], self.down.x.shape[1], self.experts, self.gate_up.a.shape[0],
                self.gate_up.rank)

    def route(self, block_m: int):
        return lora_moe.route(self.topk_ids, self.adapters, self.enabled, self.ranks, self.experts, block_m)

    def launches(self):
        """Every launch the tuner times for this batch (each compiles a kernel variant), for the warm-up."""
        for block_m in block_m_candidates(self.num_pairs):
            yield functools.partial(self.route, block_m)
            routing = self.route(block_m)
            for h in (self.gate_up, self.down):
                t = torch.zeros(self.num_pairs, h.halves * h.rank, dtype=torch.float32, device=h.x.device)
                for table in (shrink_launches(h, routing), expand_launches(h, routing, t), one_kernel_launches(h, routing)):
                    yield from table.values()


def shrink_launches(h: Hook, routing) -> dict:
    return {cfg: functools.partial(lora_moe.shrink, h.x, h.a, routing, topk=h.topk, max_rank=h.rank,
                                   halves=h.halves, config=cfg)
            for cfg in shrink_candidates(h.x.shape[1], h.rank, routing.num_pairs)}


def expand_launches(h: Hook, routing, t) -> dict:
    return {cfg: functools.partial(lora_moe.expand, h.out, t, h.b, routing, max_rank=h.rank, halves=h.halves,
                                   topk_weights=h.weights, config=cfg, rank_above=h.rank_above)
            for cfg in expand_candidates(h.rank, routing.num_pairs)}


def hook_launch(h: Hook, routing, cfg):
    if h.rank_above:  # the shrink of every adapter, the expand of those above the split (as fused_lora runs them)
        def split():
            t = lora_moe.shrink(h.x, h.a, routing, topk=h.topk, max_rank=h.rank, halves=h.halves, config=cfg)
            lora_moe.expand(h.out, t, h.b, routing, max_rank=h.rank, halves=h.halves, topk_weights=h.weights,
                            config=cfg, rank_above=h.rank_above)

        return split
    return functools.partial(lora_moe.add_delta, h.out, h.x, h.a, h.b, routing, max_rank=h.rank, halves=h.halves,
                             topk_weights=h.weights, config=cfg)


def one_kernel_launches(h: Hook, routing) -> dict:
    if h.rank_above:  # one kernel adds every adapter's delta
        return {}
    return {cfg: hook_launch(h, routing, cfg) for cfg in one_kernel_candidates(h.x.shape[1], h.rank, routing.num_pairs)}


def captured(launches: dict) -> dict:
    return {cfg: g for cfg, fn in launches.items() if (g := _try_capture(fn)) is not None}


def tune_hook(h: Hook, routing):
    """(best StageConfig, ms) for one hook: the shrink tiles, then the expand tiles on the best shrink,
    then that pair (the whole hook, two launches) against the one-kernel candidates (one launch)."""
    shrinks = shrink_launches(h, routing)
    shrink_cfg, _ = best(captured(shrinks))
    t = shrinks[shrink_cfg]()
    expand_cfg, _ = best(captured(expand_launches(h, routing, t)))
    tiles = replace(shrink_cfg, **{k: v for k, v in asdict(expand_cfg).items() if k.startswith("expand")})
    # The two launches against one, timed side by side: a one-kernel hook wins only where it is faster.
    return best({tiles: capture(hook_launch(h, routing, tiles))[0], **captured(one_kernel_launches(h, routing))})


def tune_batch(shape, ranks_name, tokens, weights):
    b = Batch.make(shape, ranks_name, tokens, weights)
    results = []
    for block_m in block_m_candidates(b.num_pairs):
        routing = b.route(block_m)
        route_ms = replay_times({"r": capture(functools.partial(b.route, block_m))[0]}, replays=20, repeats=3)["r"]
        gate_up, gate_up_ms = tune_hook(b.gate_up, routing)
        down, down_ms = tune_hook(b.down, routing)
        results.append((route_ms + gate_up_ms + down_ms, block_m, gate_up, down, route_ms))
    total, block_m, gate_up, down, route_ms = min(results, key=lambda item: item[0])
    entry = {"max_pairs": b.num_pairs, "block_m": block_m, "gate_up": asdict(gate_up), "down": asdict(down),
             "ms": round(total, 4), "route_ms": round(route_ms, 4)}
    return b.key, entry


def plan_launch(b: Batch, plan: tuning.Plan):
    """The LoRA work of a batch as the fast hooks do it with ``plan``: the routing, then both hooks."""
    def run():
        routing = b.route(plan.block_m)
        hook_launch(b.gate_up, routing, plan.gate_up)()
        return hook_launch(b.down, routing, plan.down)()

    return run


def against(args, out) -> int:
    """The shipped tiles against ``args.against``'s, batch by batch, on one GPU."""
    name_b = Path(args.against).name
    table = tables.Table(["shape", "ranks", "tokens", "shipped ms", f"{name_b} ms", f"{name_b} / shipped"])
    for name, shape, ranks_name, tokens, weights in batches(args.shapes, args.tokens, args.rank_sets):
        b = Batch.make(shape, ranks_name, tokens, weights)
        graphs = {path: capture(plan_launch(b, tuning._plan(*b.plan_sizes, path)))[0] for path in (None, args.against)}
        times = replay_times(graphs)
        table.add(name, ranks_name, tokens, f"{times[None]:.4f}", f"{times[args.against]:.4f}",
                  f"{times[args.against] / times[None]:.3f}")
        (out / "tiles_ab.md").write_text(f"{table}\n")
    return 0


def warm(shape_name: str, ranks_name: str, tokens: int, part: int, parts: int) -> tuple[int, int]:
    """In a worker process: compile every ``parts``-th launch of a batch, from the ``part``-th, into
    Triton's on-disk cache, where the tuning process then finds it. Returns (launches compiled, 1 if the
    batch did not fit in what the other workers left of the GPU's memory, else 0): that part is left to
    the tuning."""
    from triton.runtime.errors import OutOfResources

    from benchmarks._bench import SHAPES

    try:
        prepare_sglang()
        shape = SHAPES[shape_name]
        weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=0, device="cuda")
        launches = list(Batch.make(shape, ranks_name, tokens, weights).launches())[part::parts]
        for launch in launches:
            with contextlib.suppress(OutOfResources):
                launch()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return 0, 1
    except BaseException as error:  # an exit too: a pool waits forever for a worker that left
        raise RuntimeError(f"{shape_name} {ranks_name} {tokens}: {type(error).__name__}: {error}") from None
    finally:
        torch.cuda.empty_cache()  # the next batch of this worker, or another worker's, needs the memory
    return len(launches), 0


def warm_all(jobs: list[tuple[str, str, int]], workers: int, timeout_s: float) -> None:
    """Every batch's launches compiled by ``workers`` processes at once (Triton compiles one kernel at a
    time in a process, and a cold tuning spent most of its time compiling). On any failure, or past
    ``timeout_s``, the workers are stopped and the tuning compiles what is missing itself."""
    import multiprocessing

    t0 = time.perf_counter()
    pool = multiprocessing.get_context("spawn").Pool(workers)
    try:
        done = pool.starmap_async(warm, [(*job, part, workers) for job in jobs for part in range(workers)])
        compiled, short = map(sum, zip(*done.get(timeout_s)))
        print(f"# {compiled} launches compiled by {workers} processes in {time.perf_counter() - t0:.1f} s"
              + (f"; {short} parts of batches out of GPU memory, left to the tuning" if short else ""), flush=True)
    except Exception as error:
        print(f"# warm-up stopped after {time.perf_counter() - t0:.1f} s ({type(error).__name__}: {error}); "
              f"the tuning compiles the rest", flush=True)
    finally:
        pool.terminate()
        pool.join()


def _tiles(t: dict) -> str:
    if t.get("one_kernel"):
        return (f"one kernel k{t['shrink_block_k']} n{t['expand_block_n']} w{t['expand_warps']} "
                f"x{t['expand_n_tiles']}")
    return (f"shrink r{t['shrink_block_r']} k{t['shrink_block_k']} split {t['split_k']}, "
            f"expand n{t['expand_block_n']} r{t['expand_block_r']} w{t['expand_warps']} x{t.get('expand_n_tiles', 1)}"
            f" s{t['expand_stages']}")


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, TOKENS)
    # 4: on the H200, 4 workers compiled GLM-5.1's 654 launches at 8192 tokens in 58 s; 12 ran out of its
    # memory (each holds a whole batch).
    parser.add_argument("--compile-workers", type=int, default=min(4, max(0, (os.cpu_count() or 1) - 2)),
                        help="processes that compile every candidate before the timing starts (0 or 1: none)")
    parser.add_argument("--compile-timeout", type=float, default=240, help="seconds the warm-up may take")
    parser.add_argument("--against", metavar="FILE", help="no tuning: the shipped tiles against FILE's, timed")
    add_rank_sets_option(parser, by_shape=True)
    args = parser.parse_args(argv)
    if args.against and not Path(args.against).is_file():  # the package would fall back to its own table
        parser.error(f"--against {args.against}: no such file")
    out = results_dir(args)
    prepare_sglang()
    if args.against:
        return against(args, out)
    gpu = torch.cuda.get_device_name()
    # The table in use (SGLANG_LORA_TMA_GUARD_TILES, else the shipped one), each bucket tuned here replaced:
    # tunes of other shapes or sizes chain through it.
    tiles = copy.deepcopy(tuning._table(os.environ.get(tuning.TILES_ENV) or None))
    tiles.setdefault(gpu, {})
    table = tables.Table(["shape", "ranks", "tokens", "block_m", "gate-up tiles", "down tiles", "LoRA ms (tuned)"],
                         echo=False)
    if args.compile_workers > 1:
        jobs = [(name, ranks_name, tokens) for name in args.shapes
                for ranks_name in args.rank_sets or shape_rank_sets(name) for tokens in args.tokens]
        warm_all(jobs, args.compile_workers, args.compile_timeout)
    for name, shape, ranks_name, tokens, weights in batches(args.shapes, args.tokens, args.rank_sets):
        t0 = time.perf_counter()
        key, entry = tune_batch(shape, ranks_name, tokens, weights)
        tiles[gpu][key] = tuning.merged(tiles[gpu].get(key, []), [entry])
        line = table.add(name, ranks_name, tokens, entry["block_m"], _tiles(entry["gate_up"]), _tiles(entry["down"]),
                         f"{entry['ms']:.3f}")
        print(line, f"  # {time.perf_counter() - t0:.1f} s", flush=True)
        (out / "lora_moe_tiles.json").write_text(json.dumps(tiles, indent=1) + "\n")
        (out / "tune_lora_moe.md").write_text(f"{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
