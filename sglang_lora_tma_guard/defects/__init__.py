"""The catalogue's entries, one module per defect, each with one ``DEFECT`` (a :class:`~sglang_lora_tma_guard.catalogue.Defect`).

    python -m sglang_lora_tma_guard.defects      (prints the README's defect table)

The order is the README's: the three defects 0.4.0 guarded, then the rest of the bug table.
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
    ngram_cuda_graph,
    router_weight_on_input,
    tma_down_path,
    virtual_experts,
)

DEFECTS: tuple[Defect, ...] = tuple(module.DEFECT for module in (
    tma_down_path, fused_shared_expert, virtual_experts, inplace_race, gate_up_layout, fused_sum_all_reduce,
    router_weight_on_input, csgmv_segments, dp_attention, eplb_physical_experts, ngram_cuda_graph))
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
