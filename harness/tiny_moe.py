"""The tiny MoE layer of ``check --selftest`` (:mod:`sglang_lora_tma_guard.tiny_moe`, which ships), and
what only the tests and the benchmarks do with it: new routes for a problem, a route list shuffled as a GPU's
may be (and the check of one ordered by adapter), a hooked call's arguments bound by name (as the fallback
receives them), and the launch flags of the paths the guard avoids.
"""

from __future__ import annotations

import torch

from sglang_lora_tma_guard.tiny_moe import (  # noqa: F401  (re-exported: one module for the harness)
    FP8_BLOCK,
    ROW_TOLERANCE,
    WEIGHT_TMA_LAUNCH,
    Comparison,
    MoEProblem,
    align_block_size,
    compare,
    launch_recorder,
    lora_hooks,
    make_problem,
    make_weights,
    quantize_block_fp8,
    rel_err,
    run_sequence,
    sequence_kwargs,
    small_config,
)

NO_TMA_LAUNCH = {"a_use_tma": False, "b_use_tma": False, "c_sorted": False}
FULL_TMA_LAUNCHES = [{"a_use_tma": False, "b_use_tma": False, "c_sorted": True},   # gate-up
                     {"a_use_tma": True, "b_use_tma": True, "c_sorted": False}]   # down
"""SGLang's TMA down path of a hooked call (0.5.11-0.5.16): the gate-up output expert-sorted."""


def shuffle_runs(route_list, block_m: int, seed: int = 0):
    """A route list (``sorted_ids, expert_ids, num_post_padded``) with each expert's run of routes, its padding
    included, in random order: as SGLang's GPU ``moe_align_block_size``, whose atomics place the routes, may
    leave it (``align_block_size`` keeps each expert's routes in token order). Blocks and experts stay."""
    sorted_ids, expert_ids, post_padded = route_list
    used = int(post_padded)
    experts = expert_ids[:used // block_m].double().repeat_interleave(block_m)
    noise = torch.rand(used, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    shuffled = sorted_ids.clone()
    shuffled[:used] = sorted_ids[:used][torch.argsort(experts + noise.to(experts.device) / 2)]
    return shuffled, expert_ids, post_padded


def assert_ordered_by_adapter(given, ordered: torch.Tensor, token_lora: torch.Tensor, topk: int, block_m: int,
                              num_slots: int) -> int:
    """Assert that ``ordered`` (sorted ids) holds ``given``'s route list (``sorted_ids, expert_ids,
    num_post_padded``) with each expert's run of routes ordered by adapter slot (padding and tokens of no slot
    last) and no route moved out of its run; return how many places changed."""
    sorted_ids, expert_ids, post_padded = given
    used, routes = int(post_padded), token_lora.numel() * topk
    run_of = expert_ids[:used // block_m].long().repeat_interleave(block_m)
    for expert in run_of.unique().tolist():
        before, after = sorted_ids[:used][run_of == expert], ordered[:used][run_of == expert]
        assert sorted(before.tolist()) == sorted(after.tolist()), expert
        slot = torch.where(after < routes, token_lora.long()[after.clamp(max=routes - 1).long() // topk], -1)
        key = torch.where((slot >= 0) & (slot < num_slots), slot, num_slots)
        assert (key[1:] >= key[:-1]).all(), (expert, key)
    return int((sorted_ids[:used] != ordered[:used]).sum())


def reroute(problem: MoEProblem, topk_ids: torch.Tensor | None = None,
            topk_weights: torch.Tensor | None = None) -> None:
    """Give the problem new routes (in place); the alignment of the old ones is dropped."""
    if topk_ids is not None:
        problem.topk_ids = topk_ids
    if topk_weights is not None:
        problem.topk_weights = topk_weights
    problem.__dict__.pop("alignment", None)


def call_arguments(problem: MoEProblem, hooks, **overrides) -> dict:
    """A hooked call's arguments bound by name, as the fallback receives them (SGLang 0.5.16 names)."""
    sorted_ids, expert_ids, post_padded = problem.alignment
    args = dict(
        hidden_states=problem.hidden_states.clone(), w1=problem.w1, w2=problem.w2,
        topk_weights=problem.topk_weights, topk_ids=problem.topk_ids, sorted_token_ids=sorted_ids,
        expert_ids=expert_ids, num_tokens_post_padded=post_padded, config=dict(problem.config),
        down_config=dict(problem.down_config), down_moe_use_tma=True, swiglu_limit=None,
        gate_up_interleaved=True, **sequence_kwargs(problem, hooks),
    )
    args.update(overrides)
    return args


