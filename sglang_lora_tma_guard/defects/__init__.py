"""The catalogue's entries, one module per defect, each with one ``DEFECT`` (a :class:`~sglang_lora_tma_guard.catalogue.Defect`).

    python -m sglang_lora_tma_guard.defects      (prints the README's defect table)

The order is the README's: the three defects 0.4.0 guarded, the rest of the serving path, then the
adapters SGLang's loader gets wrong.
"""

from __future__ import annotations

from ..catalogue import Assessment, Defect, Deployment
from . import (
    csgmv_segments,
    dp_attention,
    eplb_physical_experts,
    fused_shared_expert,
    fused_sum_all_reduce,
    gate_up_layout,
    inplace_race,
    lora_patterns,
    mixtral_target_names,
    ngram_cuda_graph,
    one_sided_expert_targets,
    peft_target_parameters,
    router_weight_on_input,
    rslora_scaling,
    shared_outer_runtime,
    stale_expert_slot,
    tma_down_path,
    up_proj_only_experts,
    virtual_experts,
)

SERVING = (tma_down_path, fused_shared_expert, virtual_experts, inplace_race, gate_up_layout, fused_sum_all_reduce,
           router_weight_on_input, csgmv_segments, dp_attention, eplb_physical_experts, ngram_cuda_graph)
"""Defects of the serving path: a server's configuration, its model's layers."""
ADAPTERS = (stale_expert_slot, rslora_scaling, lora_patterns, up_proj_only_experts, peft_target_parameters,
            one_sided_expert_targets, shared_outer_runtime, mixtral_target_names)
"""Defects of the adapters SGLang's loader and pool get wrong."""

DEFECTS: tuple[Defect, ...] = tuple(module.DEFECT for module in SERVING + ADAPTERS)
BY_ID = {defect.id: defect for defect in DEFECTS}


def assess(deployment: Deployment, guarded: bool = True) -> list[Assessment]:
    """Every defect judged for the installed SGLang and ``deployment`` (``guarded``: the guard is on)."""
    return [defect.assess(deployment, guarded) for defect in DEFECTS]


def markdown_table() -> str:
    """The README's defect table, one row per entry, from the entries themselves."""
    lines = ["| defect | releases | who is exposed | the guard | what it does |", "|---|---|---|---|---|"]
    for defect in DEFECTS:
        lines.append(f"| `{defect.id}`: {defect.title} | {defect.releases} | {defect.exposed} | {defect.remedy.value} | "
                     f"{defect.does} |")
    return "\n".join(lines)
