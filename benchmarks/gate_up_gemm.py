"""The gate-up GEMM of a hooked call and its LoRA shrink, on a Hopper GPU, bf16 experts: SGLang's GEMM and the
fast hook's shrink beside it, against this package's gate-up GEMM with the shrink in its K loop
(``moe_gemm``'s ``LoRAShrink``: the A tiles the GEMM loads are the ones the shrink reads, so the shrink's own
read of each route's hidden state is gone).

    python -m benchmarks.gate_up_gemm --base bf16 [--shapes qwen3-30b-tp1] [--tokens 1024 4096 8192]
        [--rank-sets mixed r16] [--out DIR]

Per batch (``benchmarks/_lora_setup.py``'s: SGLang's configs for the size, 4 adapters, the batch split among
them and the base model; SGLang's own route list), CUDA-graph replays, best of 5 x 50, interleaved. Rows:

- ``sglang``: SGLang's ``invoke_fused_moe_kernel`` for the gate-up GEMM, its tuned config;
- ``shrink``: the fast hook's gate-up shrink (``lora_moe.shrink``, the shipped tiles), and ``routing``, the
  fast path's grouping of the pairs by adapter and expert that it reads;
- ``own``: ``moe_gemm``'s gate-up GEMM alone, SGLang's tile; ``own, GROUP_M=8`` its L2 swizzle changed;
- ``own + shrink``: with the shrink in its K loop, over SGLang's list; ``... ordered``: over that list with
  each expert's routes ordered by adapter (at most two adapters a block but where an expert has few routes),
  and ``order by adapter``, that ordering alone.

The sums: ``fast`` = sglang + routing + shrink (one stream; the fast path runs the routing and the shrink beside the
GEMM on a second stream, so its call pays less than their sum), ``fused`` = own + shrink (+ order by adapter,
over the ordered list) + routing (the expand still reads the routing). The ranks of ``own + shrink`` against the
hook's (largest difference over the largest rank) and its output against SGLang's GEMM's are printed and kept.
Writes ``gate_up_gemm.json`` / ``.md``.
"""

from __future__ import annotations

import sys

import torch

from benchmarks._bench import benchmark_parser, time_parts
from benchmarks._lora_setup import add_base_option, add_rank_sets_option, lora_batch, parts_table, run_batches

TOKENS = [1024, 4096, 8192]


def measure(capture_mode, name, shape, ranks_name, tokens, weights) -> dict:
    import inspect

    import triton.language as tl
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    from sglang_lora_tma_guard import lora_moe, lora_path, moe_gemm, tuning

    batch = lora_batch(shape, ranks_name, tokens, weights)
    problem, info, use_tma, c1 = batch.problem, batch.info, batch.use_tma, batch.cache1
    assert not problem.block_fp8, "the shrink in the GEMM's K loop reads 16-bit A tiles: run with --base bf16"
    ids, w, cfg = problem.topk_ids, problem.topk_weights, dict(problem.config)
    x, w1 = problem.hidden_states, problem.w1
    topk, r = ids.shape[1], int(info.max_lora_rank)
    ga = info.gate_up_lora_a_weights
    halves = ga.shape[2] // r
    ranks, enabled = info.lora_ranks.to(torch.int32), info.adapter_enabled.to(torch.int32)
    slots = lora_path.token_adapters(info, tokens)
    lora_experts = info.gate_up_lora_b_weights.shape[1]
    tiles = tuning.plan(tokens * topk, x.shape[1], info.down_lora_a_weights.shape[3], lora_experts, ranks.numel(), r)
    routing = lora_moe.route(ids, slots, enabled, ranks, lora_experts, tiles.block_m)
    block_m = cfg["BLOCK_SIZE_M"]
    sorted_ids, expert_ids, post = problem.alignment
    ordered = moe_gemm.order_by_adapter(sorted_ids, expert_ids, post, slots, topk, block_m, ranks.numel())
    launch = inspect.unwrap(fused_moe.invoke_fused_moe_kernel)
    base_tile = moe_gemm.tile(cfg, block_m, None)
    out = c1.view(-1, c1.shape[2])
    t = torch.zeros(tokens * topk, halves * r, dtype=torch.float32, device=x.device)
    shrink = moe_gemm.LoRAShrink(t, ga, slots, enabled, ranks, lora_experts, r, halves)

    def own(lora=None, blocks=sorted_ids, **change):
        moe_gemm.moe_gemm(x, w1, out, a_scale=None, w_scale=None, bias=None, topk_weights=None, sorted_ids=blocks,
                          expert_ids=expert_ids, num_post_padded=post, routes_per_a_row=topk, mul_routed_weight=False,
                          tile={**base_tile, **change}, topk=topk, shrink=lora)

    def sglang():
        launch(x, w1, None, c1, None, None, None, w, ids, sorted_ids, expert_ids, post, False, topk, cfg,
               compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
               use_int4_w4a16=False, per_channel_quant=False, block_shape=None, b_use_tma=use_tma)

    def hook_shrink():
        return lora_moe.shrink(x, ga, routing, topk=topk, max_rank=r, halves=halves, config=tiles.gate_up)

    parts = {
        "sglang": sglang,
        "routing": lambda: lora_moe.route(ids, slots, enabled, ranks, lora_experts, tiles.block_m),
        "shrink": hook_shrink,
        "own": lambda: own(),
        "own, GROUP_M=8": lambda: own(GROUP_M=8),
        "own + shrink": lambda: own(shrink),
        "own + shrink, GROUP_M=8": lambda: own(shrink, GROUP_M=8),
        "order by adapter": lambda: moe_gemm.order_by_adapter(sorted_ids, expert_ids, post, slots, topk, block_m,
                                                              ranks.numel()),
        "own + shrink, ordered": lambda: own(shrink, blocks=ordered),
        "own + shrink, ordered, GROUP_M=8": lambda: own(shrink, blocks=ordered, GROUP_M=8),
    }
    times = time_parts(capture_mode, parts)

    # Right: the ranks against the hook's where the hook writes them (each adapter's true ranks of the pairs with a
    # delta), and the output against SGLang's GEMM's.
    expected_t = hook_shrink()
    pair_slot = slots.long().repeat_interleave(topk)
    has = (pair_slot >= 0) & (ids.reshape(-1) >= 0) & (ids.reshape(-1) < lora_experts)
    rank_of = torch.where(has, ranks.long()[pair_slot.clamp(min=0)] * enabled.long()[pair_slot.clamp(min=0)], 0)
    columns = torch.arange(halves * r, device=x.device) % r
    written = has[:, None] & (columns[None, :] < rank_of[:, None])
    t.fill_(float("nan"))
    own(shrink, blocks=ordered)
    got_out = out.clone()
    scale = float(expected_t[written].abs().max())
    t_error = float((t[written] - expected_t[written]).abs().max()) / scale
    sglang()
    out_error = float((got_out.float() - out.float()).abs().max() / out.float().abs().max())
    untouched = bool(t[~written].isnan().all())
    print(f"{name} {ranks_name} {tokens}: ranks vs the hook's {t_error:.2e}, output vs SGLang's {out_error:.2e}, "
          f"nothing written past the ranks: {untouched}", flush=True)

    row = {"shape": name, "ranks": ranks_name, "tokens": tokens, "tile": base_tile, "use_tma": use_tma,
           "ranks error": t_error, "output error": out_error, "only the ranks written": untouched,
           **{f"ms {p}": v for p, v in times.items()}}
    if {"sglang", "routing", "shrink"} <= times.keys():
        row["ms fast"] = times["sglang"] + times["routing"] + times["shrink"]
    for kind, part, extra in (("", "own + shrink", 0.0), (" ordered", "own + shrink, ordered",
                                                          times.get("order by adapter", 0.0))):
        best = min((p for p in times if p.startswith(part) and (kind or "ordered" not in p)), key=times.get,
                   default=None)
        if best is not None and "routing" in times:
            row[f"ms fused{kind}"] = times[best] + extra + times["routing"]
            row[f"best{kind}"] = best
    return row


def markdown(rows, meta) -> str:
    return "\n".join([
        *parts_table(rows, meta, "the gate-up GEMM of a hooked call and its LoRA shrink, bf16 experts, ms per call, "
                     "CUDA-graph replay, best of 5 x 50 (interleaved). fast: sglang + routing + shrink (one stream); "
                     "fused: the best own + shrink (+ order by adapter) + routing."),
        "",
        "Errors (ranks against the hook's shrink, relative to the largest; output against SGLang's GEMM): "
        + "; ".join(f"{r['ranks']} {r['tokens']}: {r['ranks error']:.1e}, {r['output error']:.1e}" for r in rows),
    ]) + "\n"


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, TOKENS)
    add_base_option(parser)
    add_rank_sets_option(parser)
    return run_batches(parser.parse_args(argv), "gate_up_gemm", measure, markdown)


if __name__ == "__main__":
    sys.exit(main())
