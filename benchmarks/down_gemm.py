"""The down GEMM of a hooked call alone, on a Hopper GPU: SGLang's launcher against this package's
``moe_gemm`` over tile variants, and the down LoRA both ways (the fast hook after SGLang's GEMM, or the
expand in this package's GEMM's epilogue over three route lists).

    python -m benchmarks.down_gemm [--shapes glm51-fp8-tp8] [--tokens 1024 4096 8192] [--rank-sets mixed r16]
        [--out DIR]

Per batch (``benchmarks/_lora_setup.py``'s: SGLang's configs for the size, 4 adapters, the batch split
among them and the base model), CUDA-graph replays, best of 5 x 50, interleaved. Rows:

- ``sglang``: SGLang's ``invoke_fused_moe_kernel`` for the down GEMM (its fp8 quantization of the input
  included, weights by TMA where its config asks); ``sglang quantize``: that quantization alone;
- ``quantize``: this package's (``moe_gemm.quantize_per_group``);
- ``own ...``: ``moe_gemm`` on the quantized input, SGLang's tile unless the row names a change;
- ``wide ...``: ``moe_gemm`` with ``n_tiles`` (the wide kernel: one block against several column tiles);
- ``hook``: the fast path's down hook (``lora_moe.add_delta``, tuned tiles) on SGLang's output;
  ``shrink``: the down shrink alone (what the fused GEMM needs before it);
- ``wide + LoRA ...``: the wide kernel with the expand in its epilogue, over SGLang's route list (``N_TILES=0``:
  the narrow kernel, one column tile a program);
- ``own + LoRA, SGLang's blocks`` / ``..., segments``: the GEMM with the expand in its epilogue, over
  SGLang's route list (rows of any adapter in any order), over the same blocks with each expert's rows
  ordered by adapter (``moe_gemm.order_by_adapter``: no padding per adapter);
- ``... shuffled``: over the route list with each expert's routes in random order (the benchmark's own list
  keeps them in token order, so each block holds runs of one adapter; a list made by atomics need not);
  ``SGLang's list``: over the list of SGLang's own ``moe_align_block_size`` (its GPU kernel), and ``... ordered``
  over that list with each expert's routes ordered by adapter (``moe_gemm.order_by_adapter``, timed alone as
  ``order by adapter``).

The sums at the end compare the two ways whole: SGLang + hook against quantize + shrink + the fused GEMM (+ the
ordering by adapter, over the ordered list).
Writes ``down_gemm.json`` / ``.md``.
"""

from __future__ import annotations

import functools
import sys

import torch

from benchmarks._bench import benchmark_parser, time_parts
from benchmarks._lora_setup import add_base_option, add_rank_sets_option, lora_batch, parts_table, run_batches, sglang_route_list
from sglang_lora_tma_guard import fused_lora

TOKENS = [1024, 4096, 8192]
WIDE = [(16, {}), (16, {"num_stages": 2}), (8, {"num_stages": 2}), (32, {"BLOCK_N": 64, "num_stages": 2}),
        (16, {"BLOCK_N": 64, "num_stages": 2}), (16, {"num_stages": 1}),
        (32, {"BLOCK_N": 64, "num_stages": 2, "num_warps": 8}), (16, {"BLOCK_N": 64, "num_stages": 2, "num_warps": 8})]
"""The wide GEMM's variants: column tiles a program, and changes to SGLang's tile."""
SHUFFLED = [(16, {"num_stages": 2}), (32, {"BLOCK_N": 64, "num_stages": 2})]
"""The variants also timed over the route list with each expert's routes in random order."""
K_LOOPS = [(16, {"K_LOOP": 1}), (16, {"K_LOOP": 1, "num_stages": 4}), (16, {"BLOCK_N": 64, "K_LOOP": 1}),
           (32, {"BLOCK_N": 64, "K_LOOP": 1})]
"""Variants whose K steps are a loop, the one Triton pipelines (each stage one K tile), for a K too long for two
stages of every K tile (Qwen3-30B-A3B tp 1's six); SGLang's stages unless named."""
NARROW = [(0, {}), (0, {"GROUP_M": 8}), (0, {"BLOCK_N": 64})]
"""The GEMM of one column tile a program (``N_TILES=0``: ``moe_gemm``'s narrow kernel, SGLang's tile unless named),
the LoRA in its epilogue: more programs than the wide kernel's, each paying the block's prologue again, for a K long
enough that the prologue is a small part (Qwen3-30B-A3B tp 1's six K tiles)."""
_BEHIND = [{"num_stages": 2}, {"BLOCK_N": 64, "num_stages": 2}, {"num_stages": 2, "num_warps": 8},
           {"BLOCK_N": 64, "num_stages": 2, "num_warps": 8}, {"num_stages": 3}, {"num_stages": 3, "num_warps": 8}]
AHEAD = [*((16, c) for c in _BEHIND), *((16, {**c, "LORA_AHEAD": 3}) for c in _BEHIND[:4]),
         *((16, {**c, "LORA_AHEAD": 1}) for c in _BEHIND)]
"""Variants whose column tile's LoRA B tiles are loaded before its K steps (``LORA_AHEAD`` 1; 3: their GEMMs
unconditional, the tiles copied a column tile ahead), against the same tiles loading them after (8 warps: half the
registers a thread for the tiles in flight; 3 stages: the next tile's K steps in flight too, one program an SM); timed
over SGLang's list ordered by adapter only, under their own name (``AHEAD_ROWS``, out of the ordered rows
``thresholds`` times), each with ``LORA_AHEAD`` checked bit for bit against its tile without."""
AHEAD_ROWS = "B tiles ahead sweep, ordered: wide + LoRA, "
ONCE = [(16, {"num_stages": 2, "A_ONCE": 1}), (16, {"BLOCK_N": 64, "num_stages": 2, "A_ONCE": 1}),
        (16, {"num_stages": 2, "LORA_AHEAD": 3, "A_ONCE": 1}),
        (16, {"BLOCK_N": 64, "num_stages": 2, "LORA_AHEAD": 3, "A_ONCE": 1}),
        (16, {"BLOCK_N": 64, "num_stages": 3, "LORA_AHEAD": 3, "A_ONCE": 1}),
        (32, {"BLOCK_N": 32, "num_stages": 3, "LORA_AHEAD": 3, "A_ONCE": 1}),
        (32, {"BLOCK_N": 32, "num_stages": 4, "LORA_AHEAD": 3, "A_ONCE": 1})]
"""Tiles of ``AHEAD`` reading the block's two A tiles once for all its column tiles (``A_ONCE``; two K tiles only:
GLM-5.1 and DeepSeek-V3 at TP8), in the same sweep's rows, each checked bit for bit against its tile without. With
two stages Triton issues a column tile's copies after the tile before is stored and waits for them first thing:
one tile in flight a program, none while it computes. Three or four stages keep the next tile's copies in flight
through a tile's GEMMs; the shared memory the A tiles no longer take lets a 32-wide tile do so at two programs an SM
(sm_90, rank 64: 86,016 bytes at three stages, 102,400 at four; the 64-wide tile 131,072, one program an SM)."""
GRANULES = [(16, {"BLOCK_N": 64, "num_stages": 2, "LORA_AHEAD": 3, "A_ONCE": 1, "RANKS_IN_GRANULES": 1}),
            (16, {"BLOCK_N": 64, "num_stages": 3, "LORA_AHEAD": 3, "A_ONCE": 1, "RANKS_IN_GRANULES": 1}),
            (32, {"BLOCK_N": 32, "num_stages": 3, "LORA_AHEAD": 3, "A_ONCE": 1, "RANKS_IN_GRANULES": 1}),
            (16, {"num_stages": 2, "RANKS_IN_GRANULES": 1})]
"""Tiles whose B tiles skip the ``tl.where`` past each rank (``RANKS_IN_GRANULES``: every adapter's rank a multiple
of the rank granule, as in every rank set here, so the load's mask is the rank's): a B tile copied ahead then goes
from its copy to the GEMM, not through registers and back, and the column loop sheds a third of its instructions
(sm_90, Triton 3.6, rank 64, 64 wide, A once: 179 registers a thread against 238 as placed, two programs an SM). Each checked bit
for bit against its tile without; the 3-stage and 32-wide ones fit two programs an SM up to rank 32 and at rank 64."""
ONCE_PLAIN = [(16, {"BLOCK_N": 64, "num_stages": 3, "A_ONCE": 1}), (32, {"BLOCK_N": 32, "num_stages": 3, "A_ONCE": 1})]
"""The wide GEMM without LoRA reading its A tiles once, pipelined (two K tiles only)."""
PLACED = [(n_tiles, change) for _, n_tiles, change in fused_lora.WIDE_TILES]
"""The wide tiles ``fused_lora.wide_tile`` places at two K tiles, by max rank."""
ORDERED = WIDE[1:6] + [placed for placed in PLACED if placed not in WIDE[1:6]] + K_LOOPS + NARROW
"""The variants also timed over SGLang's own list, and over it ordered by adapter (what the fused launch walks),
the placed ones among them; one stage is what ``fused_lora.wide_tile`` takes where two would not fit in shared
memory."""
SUMS = ("sglang", "hook", "quantize", "shrink", "order by adapter")
"""The parts the sums at the end need: always timed, whatever ``--parts`` says."""


def _wants(wanted: str, part: str) -> bool:
    """Whether ``--parts`` entry ``wanted`` names ``part``: a row whose name holds it, or with a leading ``=`` the
    row of exactly that name (one kernel's launches only, for Nsight Compute)."""
    return part == wanted[1:] if wanted.startswith("=") else wanted in part


def label(n_tiles: int, change: dict) -> str:
    return ", ".join([f"N_TILES={n_tiles}", *(f"{k}={v}" for k, v in change.items())])


def adapters_per_block(alignment, slots, topk: int, block_m: int) -> float:
    """Distinct adapter slots (tokens of the base model left out) a used block's routes hold, on average."""
    sorted_ids, expert_ids, post = alignment
    used = int(post.item())
    ids = sorted_ids[:used].long()
    ok = ids < slots.numel() * topk
    slot = torch.where(ok, slots.long()[ids.clamp(max=slots.numel() * topk - 1) // topk], -1)
    one_hot = torch.zeros(used // block_m, int(slots.max()) + 2, device=ids.device)
    one_hot.scatter_(1, (slot + 1).view(-1, block_m), 1.0)
    return float(one_hot[:, 1:].sum(1).mean())


def measure(capture_mode, name, shape, ranks_name, tokens, weights, wanted=None) -> dict:
    import inspect

    import triton.language as tl
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    from harness import tiny_moe
    from harness.tiny_moe import FP8_BLOCK
    from sglang_lora_tma_guard import lora_moe, lora_path, moe_gemm, tuning

    # The token-order list; SGLang's own list has rows of its own.
    batch = lora_batch(shape, ranks_name, tokens, weights, route_list="stable")
    problem, info, use_tma, act, c3 = batch.problem, batch.info, batch.use_tma, batch.act, batch.cache3
    ids, w, cfg = problem.topk_ids, problem.topk_weights, dict(problem.down_config)
    assert problem.block_fp8, "the down GEMM rows compare block-fp8 GEMMs"
    topk, r = ids.shape[1], int(info.max_lora_rank)
    da, db = info.down_lora_a_weights, info.down_lora_b_weights
    ranks, enabled = info.lora_ranks.to(torch.int32), info.adapter_enabled.to(torch.int32)
    slots = lora_path.token_adapters(info, tokens)
    tiles = tuning.plan(tokens * topk, c3.shape[2], act.shape[1], db.shape[1], ranks.numel(), r)
    routing = lora_moe.route(ids, slots, enabled, ranks, db.shape[1], tiles.block_m)
    t_dn = lora_moe.shrink(act, da, routing, topk=topk, max_rank=r, halves=1, config=tiles.down)
    q, q_scale = moe_gemm.quantize_per_group(act, FP8_BLOCK[1])
    lora = moe_gemm.LoRAEpilogue(t_dn, db, slots, enabled, ranks, db.shape[1], r)
    experts, block_m = problem.w2.shape[0], cfg["BLOCK_SIZE_M"]
    lists = {block_m: problem.alignment}
    num_slots = ranks.numel()
    segments = (moe_gemm.order_by_adapter(*problem.alignment, slots, topk, block_m, num_slots), *problem.alignment[1:])
    launch = inspect.unwrap(fused_moe.invoke_fused_moe_kernel)
    base_tile = moe_gemm.tile(cfg, block_m, FP8_BLOCK[1])

    shuffled = tiny_moe.shuffle_runs(problem.alignment, block_m)
    real = sglang_route_list(ids, block_m, experts)
    ordered = (moe_gemm.order_by_adapter(*real, slots, topk, block_m, num_slots), *real[1:])
    print(f"adapters a block (with a delta), {ranks_name} {tokens} tokens: "
          f"stable list {adapters_per_block(problem.alignment, slots, topk, block_m):.2f}, "
          f"SGLang's moe_align_block_size {adapters_per_block(real, slots, topk, block_m):.2f}, "
          f"shuffled {adapters_per_block(shuffled, slots, topk, block_m):.2f}, "
          f"SGLang's ordered by adapter {adapters_per_block(ordered, slots, topk, block_m):.2f}", flush=True)

    two_k_tiles = moe_gemm.cdiv(act.shape[1], base_tile["BLOCK_K"]) == 2  # what A_ONCE holds

    def own(epilogue=None, blocks=None, tma=use_tma, n_tiles=0, **change):
        tile = {**base_tile, **change}
        sorted_ids, expert_ids, post = blocks or lists[tile["BLOCK_M"]]
        moe_gemm.moe_gemm(q, problem.w2, c3.view(-1, c3.shape[2]), a_scale=q_scale, w_scale=problem.w2_scale,
                          bias=None, topk_weights=w.view(-1), sorted_ids=sorted_ids, expert_ids=expert_ids,
                          num_post_padded=post, routes_per_a_row=1, mul_routed_weight=True, tile=tile,
                          scale_block_n=FP8_BLOCK[0], topk=topk, lora=epilogue, weights_by_tma=tma,
                          n_tiles=n_tiles)

    def sglang(sorted_ids):  # SGLang's launcher for the down GEMM over a route list of these blocks
        launch(act, problem.w2, None, c3, None, problem.w2_scale, None, w, ids, sorted_ids, expert_ids, post, True, 1,
               cfg, compute_type=tl.bfloat16, use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False,
               use_int4_w4a16=False, per_channel_quant=False, block_shape=list(FP8_BLOCK), b_use_tma=use_tma)

    def sglang_quantize():
        from sglang.kernels.ops.moe import fused_moe_triton_kernels as kernels  # as its launcher imports it

        return kernels.sglang_per_token_group_quant_fp8(act, FP8_BLOCK[1])[0]

    sorted_ids, expert_ids, post = problem.alignment
    parts = {
        "sglang": lambda: sglang(sorted_ids),
        "sglang quantize": sglang_quantize,
        "quantize": lambda: moe_gemm.quantize_per_group(act, FP8_BLOCK[1])[0],
        "own": lambda: own(),
        "own, GROUP_M=8": lambda: own(GROUP_M=8),
        **{f"wide, {label(n, c)}": (lambda n=n, c=c: own(n_tiles=n, **c))
           for n, c in WIDE + (ONCE_PLAIN if two_k_tiles else [])},
        "hook": lambda: lora_moe.add_delta(c3, act, da, db, routing, max_rank=r, halves=1, topk_weights=w,
                                           config=tiles.down),
        "shrink": lambda: lora_moe.shrink(act, da, routing, topk=topk, max_rank=r, halves=1, config=tiles.down),
        "own + LoRA, SGLang's blocks": lambda: own(lora),
        "own + LoRA, SGLang's blocks, GROUP_M=8": lambda: own(lora, GROUP_M=8),
        "own + LoRA, SGLang's blocks, TMA off": lambda: own(lora, tma=False),
        **{f"wide + LoRA, {label(n, c)}": (lambda n=n, c=c: own(lora, n_tiles=n, **c)) for n, c in WIDE},
        "own + LoRA, segments": lambda: own(lora, blocks=segments),
        "sglang, shuffled": lambda: sglang(shuffled[0]),
        **{f"SGLang's list: wide + LoRA, {label(n, c)}": (lambda n=n, c=c: own(lora, blocks=real, n_tiles=n, **c))
           for n, c in ORDERED},
        "order by adapter": lambda: moe_gemm.order_by_adapter(*real, slots, topk, block_m, num_slots),
        **{f"SGLang's list ordered: wide + LoRA, {label(n, c)}": (
            lambda n=n, c=c: own(lora, blocks=ordered, n_tiles=n, **c)) for n, c in ORDERED},
        **{AHEAD_ROWS + label(n, c): (lambda n=n, c=c: own(lora, blocks=ordered, n_tiles=n, **c))
           for n, c in AHEAD + (ONCE + GRANULES if two_k_tiles else [])},
        **{f"shuffled: wide + LoRA, {label(n, c)}": (lambda n=n, c=c: own(lora, blocks=shuffled, n_tiles=n, **c))
           for n, c in SHUFFLED},
    }
    if wanted:
        parts = {p: fn for p, fn in parts.items() if p in SUMS or any(_wants(w, p) for w in wanted)}
    times = time_parts(capture_mode, parts)

    def output(n_tiles, change):  # the fused GEMM's output over SGLang's list ordered by adapter
        own(lora, blocks=ordered, n_tiles=n_tiles, **change)
        return c3.clone()

    def bit_for_bit(variants, rows: str, undo: dict, what: str) -> dict:
        """``{what: whether every variant timed under rows gives, to the bit, its tile's output with undo}`` ({} where
        none was timed)."""
        timed = [(n, c) for n, c in variants if rows + label(n, c) in times]
        if not timed:
            return {}
        same = all(torch.equal(output(n, c), output(n, {**c, **undo})) for n, c in timed)
        print(f"{name} {ranks_name} {tokens}: {what}: {same}", flush=True)
        return {what: same}

    # A K loop is the unrolled K steps in the same order (one stage, which always fits); B tiles loaded ahead are the
    # same GEMMs in the same order: the same output to the bit, both.
    row = {"shape": name, "ranks": ranks_name, "tokens": tokens, "tile": base_tile, "use_tma": use_tma,
           **bit_for_bit(K_LOOPS, "SGLang's list ordered: wide + LoRA, ", {"K_LOOP": 0, "num_stages": 1},
                         "k loop bit for bit"),
           **bit_for_bit([(n, c) for n, c in AHEAD if "LORA_AHEAD" in c], AHEAD_ROWS, {"LORA_AHEAD": 0},
                         "ahead bit for bit"),
           **bit_for_bit(ONCE, AHEAD_ROWS, {"A_ONCE": 0}, "a once bit for bit"),
           **bit_for_bit(GRANULES, AHEAD_ROWS, {"RANKS_IN_GRANULES": 0}, "in granules bit for bit"),
           **{f"ms {p}": t for p, t in times.items()}}
    row["ms fast"] = times["sglang"] + times["hook"]
    for kind, prefix, ordering in (("", "wide + LoRA", 0.0),
                                   (" ordered", "SGLang's list ordered: wide + LoRA", times["order by adapter"])):
        wide = [p for p in times if p.startswith(prefix)]
        row[f"best{kind} wide + LoRA"] = min(wide, key=times.get) if wide else None
        if wide:
            row[f"ms fused{kind}"] = times["quantize"] + times["shrink"] + ordering + min(times[p] for p in wide)
    return row


def markdown(rows, meta) -> str:
    return "\n".join([
        *parts_table(rows, meta, "the down GEMM of a hooked call, block-fp8 experts (128 x 128 scales), ms per call, "
                     "CUDA-graph replay, best of 5 x 50 (interleaved). fast: sglang + hook; fused: quantize + shrink "
                     "+ the best wide + LoRA (fused ordered: + order by adapter)."),
        "",
        "Best wide + LoRA: " + "; ".join(f"{r['ranks']} {r['tokens']}: {r['best wide + LoRA']}" for r in rows),
        "",
        "Best over SGLang's list ordered: " + "; ".join(
            f"{r['ranks']} {r['tokens']}: {r['best ordered wide + LoRA']}" for r in rows),
    ]) + "\n"


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, TOKENS)
    add_base_option(parser)
    add_rank_sets_option(parser)
    parser.add_argument("--parts", nargs="+", help="time only the rows whose name holds one of these, or is one of "
                        "those led by '=' (and the sums' parts)")
    args = parser.parse_args(argv)
    return run_batches(args, "down_gemm", functools.partial(measure, wanted=args.parts), markdown)


if __name__ == "__main__":
    sys.exit(main())
