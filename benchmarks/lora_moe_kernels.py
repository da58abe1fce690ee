"""Each kernel of the fast LoRA MoE path against its own floor, and what fusing the LoRA work into the MoE
GEMMs would save, on a Hopper GPU.

    python -m benchmarks.lora_moe_kernels [--shapes glm51-fp8-tp8] [--tokens 1 8 64 256 1024 4096 8192] [--out results]
        [--base fp8|bf16] [--rank-sets mixed r16]

Per batch (the ``benchmarks/lora_moe_h200.py`` set-up: SGLang's ``LoRAInfo``, 4 adapters of ranks
8/16/32/64 or all 16, the batch split evenly among them and the base model), CUDA-graph replays, best of
5 x 50, interleaved:

- the hook-less call (SGLang's ``TritonRunnerCore.run``, weight TMA), SGLang's default hooked call
  (its ``build_lora_hooks``), the fast hooked call, the same with every LoRA kernel on the call's own
  stream (``one stream``: ``lora_path.OVERLAP`` off, the routing and gate-up shrink in the gate-up hook,
  after the gate-up GEMM, instead of beside it), and the fast hooked call with the down expand in the
  down GEMM's epilogue where ``sglang_lora_tma_guard.fused_lora`` takes the batch and the gate-up expand in the
  activation where ``sglang_lora_tma_guard.fused_act`` does (``fused``; ``fused, gate-up hooked``: the same with
  the gate-up expand left in its hook, what ``SGLANG_LORA_TMA_GUARD=fast`` serves while ``fused_act.BY_FAST`` is
  off); ``fast, act``: the hooks with the gate-up expand in the activation and the fused down launch at no batch,
  how ``=fast`` runs a batch it places no fused launch for (beside ``fused``, what a placement row moves); with
  ``--split-rank R`` also ``fused, split``: the fused down launch at every batch, its epilogue taking the
  adapters up to rank R and the hook's expand the others (``fused_lora.SPLIT_FROM_ROUTES``);
- each kernel of the fast hooks alone, on the routing and tiles a server's batch gets: the routing, the
  gate-up shrink and expand, the down shrink and expand;
- the gate-up side after the gate-up GEMM: the hook's expand, SGLang's activation, and the two in one kernel;
- the fused down GEMM's parts: SGLang's down GEMM alone (its launcher, weights by TMA where the call asks),
  this package's (``moe_gemm``) without and with the LoRA epilogue, one column tile a program and wide (as
  ``fused_lora`` launches it, where K is short enough), and its fp8 quantization of the input (block fp8 only).

The base experts are block fp8 (128 x 128 scales) or, with ``--base bf16``, bf16: the shapes whose widths
are no multiple of 128 (Qwen3-30B-A3B at tp 4) run only so; the LoRA kernels and their floors are the same.

Each kernel's floor is the larger of its bytes at HBM speed (what it must read and write at least: the
rows of x or of the activation it multiplies, the LoRA weights of every (adapter, expert) in use at the
adapter's true rank, the float32 ranks it writes or reads, the output rows it adds into, read and
written) and its FLOPs at the bf16 dense peak. ``fusable`` is the traffic that exists only because the
LoRA work runs beside the GEMMs (a fused kernel reads x and the activation in the tiles the base GEMMs
read anyway, and adds both expands in the GEMMs' epilogues): the x and activation reads of the two
shrinks, the read-modify-write of both outputs, the ranks' round trips. The fused floor of a hooked
call is the hook-less call plus the LoRA weights read once. Writes ``lora_moe_kernels.json`` / ``.md``.
"""

from __future__ import annotations

import functools
import sys

import torch

import sglang_lora_tma_guard as guard
from benchmarks._bench import benchmark_parser, capture, replay_times
from benchmarks._lora_setup import (
    BASE_NAMES,
    HBM_BYTES_PER_S,
    add_base_option,
    add_rank_sets_option,
    fused_down,
    fused_down_asked,
    hbm_bytes_per_s,
    lora_batch,
    one_stream,
    run_batches,
    wide_change_asked,
)
from harness import real_lora, tables
from sglang_lora_tma_guard import lora_moe, lora_path, tuning

TOKENS = [1, 8, 64, 256, 1024, 4096, 8192]
BF16_FLOPS = 989e12  # H200 dense bf16 peak (NVIDIA's datasheet), for the FLOP side of the floors
GRANULE = 64
"""Bytes HBM moves at least per access (the hypothesis the ``granule`` floors test): SGLang's pool keeps each
B as (rows, max_rank), rank innermost, so a rank-r row is a read of r * 2 bytes every max_rank * 2 bytes;
rows of max_rank * 2 <= 64 bytes lie packed and are read whole."""
KERNELS = ("route", "shrink_gu", "expand_gu", "shrink_dn", "expand_dn")
GATE_UP_PARTS = ("act_sglang", "expand_act")
DOWN_PARTS = ("down_sglang", "quant_own", "down_own_plain", "down_own", "down_own_lora", "down_wide",
              "down_wide_lora")


def traffic(info, ids, hidden_width: int, inter: int) -> dict:
    """Bytes and FLOPs each kernel must move and do at least, and the bytes a fused kernel would not move."""
    ranks = info.lora_ranks.long()
    slots = info.token_lora_mapping.long()
    experts = info.gate_up_lora_b_weights.shape[1]
    halves = info.gate_up_lora_a_weights.shape[2] // info.max_lora_rank
    on = (slots >= 0)[:, None] & (ids >= 0) & (ids < experts)
    on &= (ranks.clamp(min=0)[slots.clamp(min=0)] > 0)[:, None] & info.adapter_enabled.bool()[slots.clamp(min=0)][:, None]
    pair_slot = slots[:, None].expand_as(ids)[on]
    pair_rank = ranks[pair_slot]
    pairs, rank_sum = int(on.sum()), int(pair_rank.sum())  # pairs with a delta; their ranks summed
    keys = torch.unique(pair_slot * experts + ids.long()[on])
    key_rank_sum = int(ranks[keys // experts].sum())  # one (adapter, expert) in use: its rank
    r_max = int(info.max_lora_rank)

    def fetched(rank: int, size: int) -> int:  # one row of ``rank`` elements in a row of r_max, as HBM moves it
        stride = r_max * size
        return stride if stride <= GRANULE else min(stride, -(-rank * size // GRANULE) * GRANULE)

    key_b_row = sum(fetched(int(rank), 2) for rank in ranks[keys // experts])  # a B row of each key
    pair_t_row = sum(fetched(int(rank), 4) for rank in pair_rank)  # a pair's float32 ranks
    tokens_with_delta = int(on.any(dim=1).sum())
    bf16, f32, n2 = 2, 4, halves * inter  # gate-up width: gate and up halves
    out = {
        "shrink_gu": (tokens_with_delta * hidden_width * bf16 + key_rank_sum * halves * hidden_width * bf16
                      + rank_sum * halves * f32, 2 * rank_sum * halves * hidden_width),
        "expand_gu": (rank_sum * halves * f32 + key_rank_sum * n2 * bf16 + 2 * pairs * n2 * bf16,
                      2 * rank_sum * n2),
        "shrink_dn": (pairs * inter * bf16 + key_rank_sum * inter * bf16 + rank_sum * f32, 2 * rank_sum * inter),
        "expand_dn": (rank_sum * f32 + key_rank_sum * hidden_width * bf16 + 2 * pairs * hidden_width * bf16 + pairs * f32,
                      2 * rank_sum * hidden_width),
    }
    if halves == 2:  # the gate-up expand and the activation in one kernel: every pair's rows read, its activation written
        all_pairs = ids.numel()
        out["expand_act"] = (rank_sum * halves * f32 + key_rank_sum * n2 * bf16 + all_pairs * (n2 + inter) * bf16,
                             2 * rank_sum * n2)
    weights = key_rank_sum * bf16 * (halves * hidden_width + n2 + inter + hidden_width)
    fusable = (tokens_with_delta * hidden_width * bf16 + pairs * inter * bf16  # the shrinks' x and activation
               + 2 * pairs * (n2 + hidden_width) * bf16  # both outputs read and written again
               + 2 * rank_sum * (halves + 1) * f32)  # the ranks written and read back
    granule = {  # the expands as fetched: B rows and t rows in whole granules
        "expand_gu": (halves * pair_t_row + key_b_row * n2 + 2 * pairs * n2 * bf16, out["expand_gu"][1]),
        "expand_dn": (pair_t_row + key_b_row * hidden_width + 2 * pairs * hidden_width * bf16 + pairs * f32,
                      out["expand_dn"][1]),
    }
    return {"kernels": out, "granule": granule, "weights_bytes": weights, "fusable_bytes": fusable,
            "pairs_with_delta": pairs}


def down_parts(problem, info, act, c3, t_dn, slots, ranks, enabled, max_rank: int, use_tma: bool) -> dict:
    """The down GEMM alone: SGLang's launcher, and this package's without and with the LoRA epilogue (over the
    route list ordered by adapter, at ``fused_lora.narrow_tile``), one column tile a program and (where K is short
    enough) wide, as ``fused_lora`` launches it."""
    import inspect

    import triton.language as tl
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    from harness.tiny_moe import FP8_BLOCK
    from sglang_lora_tma_guard import fused_lora, moe_gemm

    launch = inspect.unwrap(fused_moe.invoke_fused_moe_kernel)
    sorted_ids, expert_ids, post = problem.alignment
    ids, w, cfg = problem.topk_ids, problem.topk_weights, dict(problem.down_config)
    fp8 = problem.block_fp8
    group_n, group_k = FP8_BLOCK if fp8 else (1, None)

    def quantize():  # block fp8 takes the activation in fp8 with per-row, per-group scales
        return moe_gemm.quantize_per_group(act, group_k) if fp8 else (act, None)

    q, q_scale = quantize()
    lora = moe_gemm.LoRAEpilogue(t_dn, info.down_lora_b_weights, slots, enabled, ranks,
                                 info.down_lora_b_weights.shape[1], max_rank)

    shared = fused_lora.shared_bytes_of(act.device)
    wide_tile, n_tiles = fused_lora.wide_tile(cfg, group_k, act.shape[1], max_rank, problem.w2.element_size(),
                                              shared)  # as the launch picks it
    sglang_tile = moe_gemm.tile(cfg, cfg["BLOCK_SIZE_M"], group_k)
    narrow_tile = fused_lora.narrow_tile(sglang_tile, max_rank, problem.w2.element_size(), shared)  # room for the epilogue
    ordered = moe_gemm.order_by_adapter(sorted_ids, expert_ids, post, slots, ids.shape[1], cfg["BLOCK_SIZE_M"],
                                        ranks.numel())

    def own(epilogue, tma=use_tma, wide=False):
        moe_gemm.moe_gemm(q, problem.w2, c3.view(-1, c3.shape[2]), a_scale=q_scale, w_scale=problem.w2_scale,
                          bias=None, topk_weights=w.view(-1), sorted_ids=sorted_ids if epilogue is None else ordered,
                          expert_ids=expert_ids,
                          num_post_padded=post, routes_per_a_row=1, mul_routed_weight=True,
                          tile=wide_tile if wide else sglang_tile if epilogue is None else narrow_tile,
                          scale_block_n=group_n, topk=ids.shape[1], lora=epilogue, weights_by_tma=tma,
                          n_tiles=n_tiles if wide else 0)

    parts = {
        "down_sglang": lambda: launch(act, problem.w2, None, c3, None, problem.w2_scale, None, w, ids, sorted_ids,
                                      expert_ids, post, True, 1, cfg, compute_type=tl.bfloat16, use_fp8_w8a8=fp8,
                                      use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                                      per_channel_quant=False, block_shape=list(FP8_BLOCK) if fp8 else None,
                                      b_use_tma=use_tma),
        "down_own_plain": lambda: own(None, tma=False),
        "down_own": lambda: own(None),
        "down_own_lora": lambda: own(lora),
    }
    if n_tiles:
        parts["down_wide"] = lambda: own(None, wide=True)
        parts["down_wide_lora"] = lambda: own(lora, wide=True)
    if fp8:
        parts["quant_own"] = lambda: quantize()[0]
    return parts


def gate_up_parts(c1, t_gu, gb, routing, ids, slots, enabled, ranks, max_rank: int) -> dict:
    """The gate-up side after the gate-up GEMM: SGLang's activation alone (its ``silu_and_mul``, which follows the
    gate-up expand in a hooked call), and the expand and the activation in one kernel
    (``lora_moe.expand_silu_and_mul``)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    from sglang_lora_tma_guard import fused_act

    rows = c1.view(-1, c1.shape[2])
    out = rows.new_empty(rows.shape[0], rows.shape[1] // 2)
    return {"act_sglang": lambda: fused_moe.silu_and_mul(rows, out),
            "expand_act": lambda: lora_moe.expand_silu_and_mul(out, rows, t_gu, gb, routing, topk_ids=ids,
                                                               token_lora=slots, enabled=enabled, ranks=ranks,
                                                               max_rank=max_rank, tile=fused_act.tile(rows.shape[0]))}


def floor_ms(nbytes: float, flops: float = 0.0) -> float:
    return max(nbytes / hbm_bytes_per_s(), flops / BF16_FLOPS) * 1e3


def measure(capture_mode, name, shape, ranks_name, tokens, weights, split_rank: int | None = None) -> dict:
    from sglang.srt.lora import lora_moe_runners as runners

    original = runners.build_lora_hooks
    batch = lora_batch(shape, ranks_name, tokens, weights)
    problem, info, use_tma, act, c1, c3 = (batch.problem, batch.info, batch.use_tma, batch.act, batch.cache1,
                                           batch.cache3)
    hidden, ids, w = problem.hidden_states, problem.topk_ids, problem.topk_weights
    topk, r = ids.shape[1], int(info.max_lora_rank)
    ga, gb, da, db = (info.gate_up_lora_a_weights, info.gate_up_lora_b_weights,
                      info.down_lora_a_weights, info.down_lora_b_weights)
    inter, width3 = da.shape[3], hidden.shape[1]
    halves = 2 if lora_path.is_gated(info) else 1
    ranks, enabled = info.lora_ranks.to(torch.int32), info.adapter_enabled.to(torch.int32)
    slots = lora_path.token_adapters(info, tokens)
    tiles = tuning.plan(tokens * topk, width3, inter, gb.shape[1], ranks.numel(), r)
    routing = lora_moe.route(ids, slots, enabled, ranks, gb.shape[1], tiles.block_m)
    t_gu = lora_moe.shrink(hidden, ga, routing, topk=topk, max_rank=r, halves=halves, config=tiles.gate_up)
    t_dn = lora_moe.shrink(act, da, routing, topk=topk, max_rank=r, halves=1, config=tiles.down)
    kernels = {
        "route": lambda: lora_moe.route(ids, slots, enabled, ranks, gb.shape[1], tiles.block_m).sorted_ids,
        "shrink_gu": lambda: lora_moe.shrink(hidden, ga, routing, topk=topk, max_rank=r, halves=halves,
                                             config=tiles.gate_up),
        "expand_gu": lambda: lora_moe.expand(c1, t_gu, gb, routing, max_rank=r, halves=halves,
                                             topk_weights=None, config=tiles.gate_up),
        "shrink_dn": lambda: lora_moe.shrink(act, da, routing, topk=topk, max_rank=r, halves=1,
                                             config=tiles.down),
        "expand_dn": lambda: lora_moe.expand(c3, t_dn, db, routing, max_rank=r, halves=1, topk_weights=w,
                                             config=tiles.down),
    }

    kernels.update(down_parts(problem, info, act, c3, t_dn, slots, ranks, enabled, r, use_tma))
    if halves == 2:
        kernels.update(gate_up_parts(c1, t_gu, gb, routing, ids, slots, enabled, ranks, r))

    builders = {"nohook": lambda h: None, "default": lambda h: original(h, info, ids),  # h: the runner's input
                "fast": lambda h: lora_path.build_hooks(original, h, info, ids),
                "one_stream": lambda h: one_stream(lambda: lora_path.build_hooks(original, h, info, ids))}

    def whole(kind: str):
        with fused_down(kind in ("fused", "fused_no_act", "fused_split", "fast_act"), act=kind != "fused_no_act",
                        how="nowhere" if kind == "fast_act" else None,
                        split_rank=split_rank if kind == "fused_split" else None):
            return real_lora.run_runner(problem, None, use_tma=use_tma, build=builders.get(kind, builders["fast"]))

    guard.activate(weight_tma=True)
    with capture_mode():
        wholes = ("nohook", "default", "fast", "one_stream", "fast_act", "fused", "fused_no_act") + (
            ("fused_split",) if split_rank else ())
        graphs = {kind: capture(lambda k=kind: whole(k))[0] for kind in wholes}
        graphs.update({kernel: capture(fn)[0] for kernel, fn in kernels.items()})
    times = replay_times(graphs)
    del graphs
    moved = traffic(info, ids, width3, inter)
    change = wide_change_asked()
    row = {"shape": name, "ranks": ranks_name, "tokens": tokens, "block_m": tiles.block_m,
           "pairs_with_delta": moved["pairs_with_delta"], "ms_nohook": times["nohook"], "ms_fast": times["fast"],
           "ms_fast_one_stream": times["one_stream"], "ms_fused": times["fused"], "ms_default": times["default"],
           "ms_fused_no_act": times["fused_no_act"], "ms_fast_act": times["fast_act"],
           "fused_down": fused_down_asked(),  # where the fused column took the launch
           **({"wide_change": change} if change else {}),  # switches on the fused launch's wide tiles
           "fast_speedup": times["default"] / times["fast"]}
    if "expand_act" in times:
        row["floor_ms_expand_act"] = floor_ms(*moved["kernels"]["expand_act"])
    for kernel in KERNELS:
        row[f"ms_{kernel}"] = times[kernel]
        if kernel in moved["kernels"]:
            nbytes, flops = moved["kernels"][kernel]
            row[f"floor_ms_{kernel}"] = floor_ms(nbytes, flops)
            row[f"tb_s_{kernel}"] = nbytes / (times[kernel] * 1e-3) / 1e12
        if kernel in moved["granule"]:
            row[f"granule_floor_ms_{kernel}"] = floor_ms(*moved["granule"][kernel])
    row.update({f"ms_{part}": times.get(part) for part in DOWN_PARTS + GATE_UP_PARTS})  # no quantization of a bf16 base
    row["ms_kernels"] = sum(times[k] for k in KERNELS)
    row["floor_ms_weights"] = floor_ms(moved["weights_bytes"])
    row["floor_ms_fusable"] = floor_ms(moved["fusable_bytes"])
    row["fused_floor_ms"] = times["nohook"] + row["floor_ms_weights"]
    row["fast_over_fused_floor"] = times["fast"] / row["fused_floor_ms"]
    row["one_stream_over_fused_floor"] = times["one_stream"] / row["fused_floor_ms"]
    row["fused_over_fused_floor"] = times["fused"] / row["fused_floor_ms"]
    if split_rank:
        row["split_rank"], row["ms_fused_split"] = split_rank, times["fused_split"]
        row["fused_split_over_fused_floor"] = times["fused_split"] / row["fused_floor_ms"]
    return row


def ms(value: float | None, digits: int = 3) -> str:
    """A table cell: the value to ``digits`` places, or a dash where it was not timed."""
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(rows, meta) -> str:
    per_kernel = lambda r, k: f"{ms(r[f'ms_{k}'])} / {ms(r[f'floor_ms_{k}'])}" + (  # noqa: E731
        f" / {ms(r[f'granule_floor_ms_{k}'])}" if f"granule_floor_ms_{k}" in r else "")
    return "\n".join([
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}; base experts "
        f"{BASE_NAMES[meta.get('base', 'fp8')]}. ms per call, "
        f"CUDA-graph replay, best of 5 x 50 (interleaved). Floors: bytes at "
        f"{meta.get('hbm_bytes_per_s', HBM_BYTES_PER_S) / 1e12:.2f} TB/s or "
        f"FLOPs at {BF16_FLOPS / 1e12:.0f} TFLOP/s, whichever is larger. Each kernel: measured / its floor (the "
        f"expands also / their floor with B and rank rows read in {GRANULE}-byte granules). "
        "fusable: the traffic that exists only because LoRA runs beside the GEMMs, at HBM speed. "
        "fused floor: no hooks + the LoRA weights read once.",
        "",
        tables.markdown(
            ["shape", "ranks", "tokens", "no hooks", "SGLang default", "fast", "fast, one stream", "default / fast",
             "fast - no hooks",
             "route", "shrink gate-up",
             "expand gate-up", "shrink down", "expand down", "LoRA weights floor", "fusable", "fused floor",
             "fast / fused floor", "one stream / fused floor", "fused, gate-up hooked", "fused", "fused / fused floor"],
            ([r["shape"], r["ranks"], r["tokens"], ms(r["ms_nohook"]), ms(r["ms_default"]), ms(r["ms_fast"]),
              ms(r["ms_fast_one_stream"]), f"{r['fast_speedup']:.2f}x", ms(r["ms_fast"] - r["ms_nohook"]),
              ms(r["ms_route"]), per_kernel(r, "shrink_gu"), per_kernel(r, "expand_gu"), per_kernel(r, "shrink_dn"),
              per_kernel(r, "expand_dn"), ms(r["floor_ms_weights"]), ms(r["floor_ms_fusable"]), ms(r["fused_floor_ms"]),
              f"{r['fast_over_fused_floor']:.2f}", f"{r['one_stream_over_fused_floor']:.2f}",
              ms(r.get("ms_fused_no_act")), ms(r["ms_fused"]),
              f"**{r['fused_over_fused_floor']:.2f}**"]
             for r in rows)),
        *split_table(rows),
        "",
        "The fused down GEMM's parts (ms): SGLang's down GEMM; this package's fp8 quantization of its input, its "
        "down GEMM without LoRA (weights by plain loads; by TMA as SGLang takes them) and with the LoRA epilogue, "
        "over SGLang's route list (with the epilogue, each expert's routes ordered by adapter and SGLang's tile with "
        "fewer stages where the epilogue would not fit, as fused_lora launches it; the ordering not timed here); "
        "then the wide GEMM (several column tiles a program, the tile fused_lora launches) without and with the "
        "epilogue, where K is short enough.",
        "",
        tables.markdown(["shape", "ranks", "tokens", "SGLang down", "quantize", "own down, no TMA", "own down",
                         "own down + LoRA", "wide down", "wide down + LoRA", "fast: expand down"],
                        ([r["shape"], r["ranks"], r["tokens"], *(ms(r[f"ms_{p}"]) for p in DOWN_PARTS),
                          ms(r["ms_expand_dn"])] for r in rows)),
        "",
        "The gate-up side after the gate-up GEMM (ms, gated experts): the fast hook's gate-up expand, SGLang's "
        "activation (silu_and_mul), and the two in one kernel (lora_moe.expand_silu_and_mul; its floor: every "
        "route's gate-up row read and its activation written, the ranks and the B rows in use read).",
        "",
        tables.markdown(["shape", "ranks", "tokens", "expand gate-up", "SGLang activation", "expand + activation",
                         "one kernel / its floor", "one kernel / both"],
                        ([r["shape"], r["ranks"], r["tokens"], ms(r["ms_expand_gu"]), ms(r.get("ms_act_sglang")),
                          ms(r["ms_expand_gu"] + r["ms_act_sglang"]) if r.get("ms_act_sglang") else "–",
                          f"{ms(r.get('ms_expand_act'))} / {ms(r.get('floor_ms_expand_act'))}",
                          f"{r['ms_expand_act'] / (r['ms_expand_gu'] + r['ms_act_sglang']):.2f}"
                          if r.get("ms_expand_act") else "–"] for r in rows)),
    ]) + "\n"


def split_table(rows) -> list[str]:
    """The whole call as ``=fast`` runs a batch with no fused down launch (fast, act), with it (fused) and, with
    ``--split-rank``, split by rank (fused, split): what a placement row chooses between, side by side."""
    rows = [r for r in rows if "ms_fast_act" in r or "ms_fused_split" in r]  # kept runs before fast, act have neither
    if not rows:
        return []
    return ["", "The whole call (ms): the hooks (fast); the hooks with the gate-up expand in the activation, no fused "
            "down launch (fast, act: how =fast runs a batch it does not place the launch for); the fused down launch at "
            "the batches the fused column takes, and with --split-rank at every batch, its epilogue taking the adapters "
            "up to the split rank and the hook's expand the others (fused, split).", "",
            tables.markdown(["shape", "ranks", "tokens", "split rank", "fast", "fast, act", "fused", "fused, split",
                             "fused floor", "fused / fused floor", "split / fused floor"],
                            ([r["shape"], r["ranks"], r["tokens"], r.get("split_rank") or "–", ms(r["ms_fast"]),
                              ms(r.get("ms_fast_act")), ms(r["ms_fused"]), ms(r.get("ms_fused_split")),
                              ms(r["fused_floor_ms"]), ms(r["fused_over_fused_floor"], 2),
                              f"**{ms(r.get('fused_split_over_fused_floor'), 2)}**"]
                             for r in rows))]


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, TOKENS)
    add_base_option(parser)
    add_rank_sets_option(parser, by_shape=True)
    parser.add_argument("--split-rank", type=int, default=None,
                        help="also time the whole call with the fused down launch split at this rank (fused, split)")
    args = parser.parse_args(argv)
    return run_batches(args, "lora_moe_kernels", functools.partial(measure, split_rank=args.split_rank), markdown,
                       hbm_bytes_per_s=hbm_bytes_per_s(), bf16_flops=BF16_FLOPS)


if __name__ == "__main__":
    sys.exit(main())
