"""One MoE layer's LoRA batch as SGLang builds it, for the LoRA MoE benchmarks (GPU).

4 adapters in 4 slots (ranks 8/16/32/64 padded to 64, or all 16), the batch split evenly among them
and the base model (``harness/real_lora.py``), SGLang's CUDA-graph LoRA buffers sized as its
backend sizes them, and the weight bytes a batch's LoRA deltas must read at least.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass

import torch

from harness import real_lora

RANK_SETS = {"mixed": (8, 16, 32, 64), "r16": (16, 16, 16, 16)}
PADDED = re.compile(r"r(\d+)in(\d+)")
HBM_BYTES_PER_S = 4.3e12  # what an H200 streams in practice (FACTS.md section 3)
HBM_BYTES_PER_S_OF = {"NVIDIA H100 80GB HBM3": 3.35e12}
"""GPUs whose floors take their own bandwidth: the H100 SXM's datasheet peak (NVIDIA: 3.35 TB/s), which no run there
beats (at the H200's 4.3 TB/s its floors would be below what the card can stream; the H100 tables before 2026-12-07
took it)."""
BASE_NAMES = {"fp8": "block fp8 (128 x 128 scales)", "bf16": "bf16"}


def hbm_bytes_per_s() -> float:
    """The bandwidth this GPU's floors take: :data:`HBM_BYTES_PER_S_OF`'s for a GPU it names, else the H200's."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return HBM_BYTES_PER_S_OF.get(name, HBM_BYTES_PER_S)


def rank_set(name: str) -> tuple[int, ...]:
    """A rank set by name: ``mixed``, ``rN`` (four adapters of rank N), or ``rNinM``: four adapters of rank N in
    buffers padded to M, as SGLang pads them when an adapter of rank M is loaded beside them but not in the batch."""
    padded = PADDED.fullmatch(name)
    return RANK_SETS.get(name) or (int(padded[1] if padded else name.removeprefix("r")),) * 4


def pool_rank(name: str) -> int:
    """The LoRA buffers' width of a rank set by name (``LoRAInfo.max_lora_rank``: what ``=fast`` places by): M of
    ``rNinM``, else the set's largest rank."""
    padded = PADDED.fullmatch(name)
    return int(padded[2]) if padded else max(rank_set(name))


def shape_rank_sets(name: str) -> tuple[str, ...]:
    """The rank sets a shape is measured at: mixed, and on the GLM-5.1 shape all 16 too."""
    return ("mixed", "r16") if name == "glm51-fp8-tp8" else ("mixed",)


def add_base_option(parser) -> None:
    """``--base fp8|bf16``: the MoE's own weights (block fp8 by default; bf16 runs every shape)."""
    from benchmarks._bench import BASES

    parser.add_argument("--base", choices=list(BASES), default="fp8",
                        help="the base experts' weights: block fp8 (128 x 128 scales, SGLang's kernels take only "
                             "widths in multiples of 128) or bf16")


def check_base(shape_names, base: str) -> None:
    """Refuse, before any GPU work, a block-fp8 run of a shape whose widths SGLang's block-fp8 path cannot take."""
    from benchmarks._bench import SHAPES

    if base != "fp8":
        return
    for name in shape_names:
        odd = [f"{what} {SHAPES[name][key]}" for key, what in (("N", "intermediate"), ("K", "hidden"))
               if SHAPES[name][key] % 128]
        if odd:
            raise SystemExit(f"{name}: block fp8 needs widths in multiples of 128 (its {', '.join(odd)}); "
                             "run it with --base bf16")


def weight_base(weights) -> str:
    """``fp8`` or ``bf16``: what :func:`batches` made these MoE weights as."""
    return "fp8" if weights[2] is not None else "bf16"


def batches(shape_names, token_counts, rank_sets=None, base: str = "fp8"):
    """(shape name, shape, rank set, tokens, MoE weights) for every batch the LoRA MoE scripts run: each
    shape with the mixed ranks, the GLM-5.1 shape also with all ranks 16 (or each shape with ``rank_sets``);
    the weights made once a shape, block fp8 or bf16 (``base``)."""
    from benchmarks._bench import BASES, SHAPES
    from harness import tiny_moe

    for name in shape_names:
        shape = SHAPES[name]
        weights = tiny_moe.make_weights(shape["E"], shape["K"], shape["N"], seed=0, device="cuda",
                                        dtype=BASES[base])
        for ranks_name in rank_sets or shape_rank_sets(name):
            for tokens in token_counts:
                yield name, shape, ranks_name, tokens, weights
        del weights
        torch.cuda.empty_cache()


def cg_buffers(problem, loras: int) -> dict:
    """SGLang's CUDA-graph LoRA buffers (``moe_cg_buffers``) for this batch size, as its backend sizes them."""
    tokens, topk = problem.topk_ids.shape
    experts, block_m = problem.num_experts, 64
    padded = -(-(tokens * topk + experts * (block_m - 1)) // block_m) * block_m
    blocks = padded // block_m
    i32 = dict(dtype=torch.int32, device=problem.topk_ids.device)
    return {
        "sorted_token_ids_lora": torch.empty(loras * padded, **i32),
        "expert_ids_lora": torch.empty(loras * blocks, **i32),
        "num_tokens_post_padded_lora": torch.empty(loras, **i32),
        "lora_ids": torch.arange(loras, **i32),
        "cumsum_buffer": torch.zeros(loras * (experts + 1), **i32),
        "token_mask": torch.empty(loras * tokens * topk, **i32),
    }


def lora_info(problem, ranks, seed: int):
    padded = pool_rank(ranks) if isinstance(ranks, str) else None
    ranks = rank_set(ranks) if isinstance(ranks, str) else ranks
    adapters = real_lora.Adapters(ranks=ranks, enabled=(True,) * len(ranks), pool_rank=padded)
    return real_lora.make_lora_info(problem, adapters, seed=seed, cg_buffers=cg_buffers(problem, len(ranks)))


def floor_bytes(info, topk_ids) -> tuple[int, int]:
    """LoRA weight bytes the batch's deltas read at least: every (adapter, expert) it uses, read once,
    at the adapters' true ranks and at the padded rank."""
    ga, gb, da, db = (info.gate_up_lora_a_weights, info.gate_up_lora_b_weights,
                      info.down_lora_a_weights, info.down_lora_b_weights)
    r = info.max_lora_rank
    halves = ga.shape[2] // r
    hidden, intermediate, size = ga.shape[3], da.shape[3], ga.element_size()
    per_rank = size * (halves * hidden + gb.shape[2] + intermediate + db.shape[2])
    ranks, enabled = info.lora_ranks.tolist(), info.adapter_enabled.tolist()
    adapters = info.token_lora_mapping.long()
    used = torch.zeros(len(ranks), gb.shape[1], dtype=torch.bool, device=topk_ids.device)
    ok = (adapters >= 0)[:, None].expand_as(topk_ids) & (topk_ids >= 0) & (topk_ids < gb.shape[1])
    rows = adapters[:, None].expand_as(topk_ids)[ok]
    used[rows, topk_ids.long()[ok]] = True
    counts = used.sum(dim=1).tolist()
    true = sum(c * per_rank * rk for c, rk, on in zip(counts, ranks, enabled) if on and rk)
    padded = sum(c * per_rank * r for c, rk, on in zip(counts, ranks, enabled) if on and rk)
    return true, padded


@dataclass
class LoRABatch:
    """One batch of a LoRA MoE benchmark: the problem (SGLang's configs for its size), its ``LoRAInfo``, and
    fixed buffers for the hooks alone (an activation, the gate-up and down outputs)."""

    problem: object
    info: object
    use_tma: bool
    act: torch.Tensor
    cache1: torch.Tensor
    cache3: torch.Tensor


def sglang_route_list(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """``sorted_token_ids, expert_ids, num_tokens_post_padded`` of SGLang's own ``moe_align_block_size`` (its GPU
    kernel, which places each route by an atomic add on its expert's count)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import moe_align_block_size

    return moe_align_block_size(topk_ids, block_m, num_experts)


def lora_batch(shape: dict, ranks_name: str, tokens: int, weights, route_list: str = "sglang") -> LoRABatch:
    """``route_list``: ``sglang``, the route list of SGLang's own ``moe_align_block_size`` (its GPU kernel, as a
    server has it: each expert's routes in the order its atomics took them), or ``stable`` (``tiny_moe``'s: each
    expert's routes in token order, so the batch's adapters, which own runs of tokens, lie in runs)."""
    from benchmarks._bench import lookup_configs
    from harness import tiny_moe

    config, down_config, use_tma = lookup_configs(shape, tokens, weight_base(weights))
    problem = tiny_moe.make_problem(num_tokens=tokens, topk=shape["topk"], seed=tokens, device="cuda",
                                    dtype=torch.bfloat16, weights=weights, config=config, down_config=down_config)
    if route_list == "sglang":
        problem.__dict__["alignment"] = sglang_route_list(problem.topk_ids, config["BLOCK_SIZE_M"], problem.num_experts)
    else:
        assert route_list == "stable", route_list
    info = lora_info(problem, ranks_name, seed=tokens)
    hidden, topk = problem.hidden_states, shape["topk"]
    gen = torch.Generator(device="cuda").manual_seed(7)
    act = (torch.randn(tokens * topk, info.down_lora_a_weights.shape[3], generator=gen, device="cuda") * 0.5)
    return LoRABatch(problem, info, use_tma, act.to(hidden.dtype),
                     torch.zeros(tokens, topk, info.gate_up_lora_b_weights.shape[2], dtype=hidden.dtype, device="cuda"),
                     torch.zeros(tokens, topk, hidden.shape[1], dtype=hidden.dtype, device="cuda"))


def add_rank_sets_option(parser, by_shape: bool = False) -> None:
    """``--rank-sets``: the adapters' ranks, ``mixed``, ``rN`` or ``rNinM`` (:func:`rank_set`); by default ``mixed``, or
    with ``by_shape`` each shape's own (:func:`shape_rank_sets`)."""
    parser.add_argument("--rank-sets", nargs="+", default=None if by_shape else ["mixed"],
                        help="mixed, rN (four adapters of rank N) or rNinM (the same in buffers padded to rank M: "
                             "an adapter of rank M loaded, not in the batch); default "
                             + ("mixed and r16 (GLM-5.1), mixed (others)" if by_shape else "mixed"))


def parts_table(rows, meta, what: str) -> list[str]:
    """The markdown lines of a table of parts (rows of ``ms PART``, one column a batch), headed by the run's
    versions and GPU and ``what`` was timed, then SGLang's tile of each batch (``tile``, ``use_tma``)."""
    from harness import tables

    parts = [k.removeprefix("ms ") for k in rows[0] if k.startswith("ms ")]
    return [
        f"SGLang {meta['sglang']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['gpu']}; {what}",
        "",
        tables.markdown(["part", *(f"{r['shape']} {r['ranks']} {r['tokens']}" for r in rows)],
                        ([p, *(f"{r[f'ms {p}']:.4f}" if f"ms {p}" in r else "–" for r in rows)] for p in parts)),
        "",
        "SGLang's tile: " + "; ".join(f"{r['tokens']} tokens {r['tile']}, TMA {r['use_tma']}" for r in rows),
    ]


def run_batches(args, stem: str, measure, markdown, **meta_extra) -> int:
    """Every batch of ``args`` through ``measure(capture_mode, name, shape, ranks, tokens, weights)``, the
    rows written to ``STEM.json`` and ``STEM.md`` under ``--out`` after each (a run cut short keeps them). A batch
    that raises (a kernel Triton refuses to launch: a tile over the GPU's shared memory) is said with its traceback,
    kept under ``failed`` in the json and named under the table, and the next batch runs; the exit status is then 1."""
    import traceback

    import sglang_lora_tma_guard as guard
    from benchmarks._bench import prepare_sglang, results_dir, run_meta

    base = getattr(args, "base", "fp8")
    check_base(args.shapes, base)
    out = results_dir(args)
    prepare_sglang()
    from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

    meta = run_meta(**meta_extra, base=base)
    rows, failed = [], []

    def table() -> str:
        lines = [markdown(rows, meta)] if rows else []
        lines += [f"Not measured: {f['shape']} {f['ranks']} {f['tokens']} tokens ({f['error']})" for f in failed]
        return "\n\n".join(lines)

    for name, shape, ranks_name, tokens, weights in batches(args.shapes, args.tokens, getattr(args, "rank_sets", None),
                                                            base):
        t0 = time.perf_counter()
        try:
            rows.append({**measure(model_capture_mode, name, shape, ranks_name, tokens, weights), "base": base})
        except Exception as error:
            traceback.print_exc()
            failed.append({"shape": name, "ranks": ranks_name, "tokens": tokens, "base": base,
                           "error": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"})
            print(f"# not measured: {json.dumps(failed[-1])}", flush=True)
        else:
            print(json.dumps(rows[-1]) + f"  # {time.perf_counter() - t0:.1f} s", flush=True)
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "failed": failed}, indent=1))
        (out / f"{stem}.md").write_text(table())
    guard.deactivate()
    print(table())
    return 1 if failed else 0


def fused_down_asked() -> str:
    """What ``FUSED_DOWN`` asks of :func:`fused_down` (its default: placed as ``=fast`` places it)."""
    import os

    return os.environ.get("FUSED_DOWN", "placed")


def wide_change_asked() -> dict:
    """``WIDE_CHANGE`` (JSON): kernel switches :func:`fused_down` adds to every wide tile ``fused_lora`` places, e.g.
    ``{"LORA_AHEAD": 1}``: the fused launch as it would run with them shipped ({} unless set)."""
    import json
    import os

    change = json.loads(os.environ.get("WIDE_CHANGE") or "{}")
    if not isinstance(change, dict):
        raise SystemExit(f"WIDE_CHANGE={change!r}: a JSON object of the wide kernel's switches")
    return change


@contextlib.contextmanager
def fused_down(on: bool, act: bool = True, how: str | None = None, split_rank: int | None = None):
    """The fast hooks built and run with (``on``) or without the fused down GEMM (``fused_lora``) and, with it unless
    ``act`` is False, the gate-up delta in the activation (``fused_act``, at every batch, whether or not
    ``fused_act.BY_FAST`` has ``=fast`` place it): the down GEMM placed where ``=fast`` places it, or with
    ``FUSED_DOWN=everywhere`` in the environment for every batch they cover (a tile ``=fast`` does not place, timed
    and scored against the float32 reference); ``FUSED_DOWN=everywhere-narrow``: every batch, each down GEMM one
    column tile a program (``moe_gemm``'s narrow kernel at SGLang's tile) whatever its K; ``FUSED_DOWN=split-R``:
    every batch, its epilogue taking the adapters up to rank R and the hook's expand the rest
    (``fused_lora.SPLIT_FROM_ROUTES``); ``FUSED_DOWN=nowhere``: no batch, the gate-up delta still in the activation
    (how ``=fast`` runs a batch it places no fused launch for). ``how``: one of these instead of the environment's;
    ``split_rank``: R (every batch, whatever ``how`` says). ``WIDE_CHANGE``: :func:`wide_change_asked`."""
    from sglang_lora_tma_guard import fused_act, fused_lora

    how = how or fused_down_asked()
    if how.startswith("split-") and how.removeprefix("split-").isdigit():
        how, split_rank = "everywhere", split_rank or int(how.removeprefix("split-"))
    if how not in ("placed", "everywhere", "everywhere-narrow", "nowhere"):
        raise SystemExit(f"FUSED_DOWN={how!r}: placed (the default), everywhere, everywhere-narrow, nowhere or split-R "
                         "(a rank)")
    tiles, placed = (fused_lora.WIDE_TILES, fused_lora.WIDE_TILES_BY_K_TILES), fused_lora._placed
    change = wide_change_asked()
    if on and change:  # the wide tiles only (n_tiles > 0): the narrow kernel takes no such switches
        def changed(rows):
            return tuple((rank, n, {**c, **change} if n else c) for rank, n, c in rows)

        fused_lora.WIDE_TILES = changed(fused_lora.WIDE_TILES)
        fused_lora.WIDE_TILES_BY_K_TILES = {k: changed(rows) for k, rows in fused_lora.WIDE_TILES_BY_K_TILES.items()}
    if on and how == "nowhere" and split_rank is None:
        fused_lora._placed = lambda routes, max_rank, k: None
    if on and how == "everywhere-narrow":
        narrow = ((fused_lora.MAX_RANK, 0, {}),)
        fused_lora.WIDE_TILES, fused_lora.WIDE_TILES_BY_K_TILES = narrow, {}
    if on:
        fused_lora.activate(everywhere=how not in ("placed", "nowhere") or split_rank is not None, split_rank=split_rank)
        if act:
            fused_act.activate()
    else:
        fused_lora.deactivate()
    try:
        yield
    finally:
        fused_lora.deactivate()
        fused_act.deactivate()
        (fused_lora.WIDE_TILES, fused_lora.WIDE_TILES_BY_K_TILES), fused_lora._placed = tiles, placed


def fast_call(batch: LoRABatch):
    """The batch's whole hooked call through SGLang's runner, the fast hooks built from the runner's own input
    (as SGLang's ``MoeRunner.run`` builds them): a function of no arguments that returns the call's output."""
    from sglang.srt.lora import lora_moe_runners as runners

    from sglang_lora_tma_guard import lora_path

    problem, info, original = batch.problem, batch.info, runners.build_lora_hooks
    return lambda: real_lora.run_runner(problem, None, use_tma=batch.use_tma,
                                        build=lambda h: lora_path.build_hooks(original, h, info, problem.topk_ids))


@contextlib.contextmanager
def direct_launches(on: bool):
    """The fast path's kernels launched directly (``on``) or every time through Triton's own path
    (``sglang_lora_tma_guard.launching.DIRECT``)."""
    from sglang_lora_tma_guard import launching

    saved, launching.DIRECT = launching.DIRECT, on
    try:
        yield
    finally:
        launching.DIRECT = saved


def one_stream(fn):
    """``fn()`` with the fast hooks built to leave their routing and gate-up shrink in the gate-up hook, on the
    call's own stream (``lora_path.OVERLAP`` off), as before they ran beside the gate-up GEMM."""
    from sglang_lora_tma_guard import lora_path

    was, lora_path.OVERLAP = lora_path.OVERLAP, False
    try:
        return fn()
    finally:
        lora_path.OVERLAP = was
