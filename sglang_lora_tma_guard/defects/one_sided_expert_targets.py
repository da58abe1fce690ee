"""Server targets with one of ``gate_up_proj`` / ``down_proj``: expert LoRA loaded and never applied (every release).

Why: SGLang wraps an MoE layer for LoRA only when both ``gate_up_proj`` and ``down_proj`` are targets.
Targets inferred from start-up adapters that trained one side of the experts (or a
``--lora-target-modules`` list with one of them) leave every MoE layer unwrapped: the expert weights of
every adapter load, with an info line, and are never applied (upstream #32406, open: a warning).

What the guard does: before SGLang wraps the layers of a model with MoE layers, it adds the missing side
to the targets, so the layers are wrapped and the missing side's LoRA buffers stay zero (one warning).
"""

from __future__ import annotations

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker
from ..log import logger

LORA_MANAGER = "sglang.srt.lora.lora_manager"
PAIR = ("gate_up_proj", "down_proj")


def has_moe_layer(model) -> bool:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return any(isinstance(module, FusedMoE) for module in model.modules())


class OneSidedExpertTargets(Defect):
    id = "one-sided-expert-targets"
    title = "targets with one of gate_up_proj / down_proj leave the MoE unwrapped: expert LoRA never applied"
    first, last = "0.5.11", "0.5.23"
    exposed = "servers whose (inferred or given) targets have one side of the experts"
    remedy = Remedy.FIX
    does = "the other side is added to the targets: the MoE layers are wrapped, the missing side zero"
    upstream = "https://github.com/sgl-project/sglang/pull/32406 (open: a warning)"

    def present(self) -> Presence:
        return by_marker(LORA_MANAGER, '["gate_up_proj", "down_proj"]', where="LoRAManager.init_lora_modules",
                         marker_is_the_fix=False, fixed="init_lora_modules wraps an MoE layer for either side",
                         present="init_lora_modules wraps an MoE layer only with both gate_up_proj and down_proj")

    def affects(self, deployment: Deployment) -> bool | None:
        targets = deployment.arg("lora_target_modules")
        if deployment.lora is False or deployment.moe is False:
            return False
        if not targets or "all" in targets:
            return None  # inferred from the start-up adapters
        return sum(side in targets for side in PAIR) == 1 or None

    def before_lora_modules(self, manager, deployment: Deployment) -> None:
        targets = getattr(manager, "target_modules", None)
        if targets is None or sum(side in targets for side in PAIR) != 1 or not has_moe_layer(manager.base_model):
            return
        missing = next(side for side in PAIR if side not in targets)
        targets.add(missing) if isinstance(targets, set) else setattr(manager, "target_modules", {*targets, missing})
        logger.warning("the LoRA targets have %s but not %s: SGLang would leave every MoE "
                       "layer unwrapped and apply no adapter's expert LoRA; %s is added (its LoRA buffers stay zero "
                       "where an adapter has none)", next(s for s in PAIR if s != missing), missing, missing)


    def diagnose(self, adapter) -> str | None:
        from ..adapters import EXPERT, names

        sides = {"gate_up_proj" if (".gate_proj." in n or ".up_proj." in n or ".gate_up_proj." in n) else "down_proj"
                 for n in names(adapter) if EXPERT.search(n)}
        if len(sides) != 1:
            return None
        return (f"its expert LoRA is on {sides.pop()} only: served with targets from it alone, SGLang leaves every MoE "
                "layer unwrapped and applies none of it")


DEFECT = OneSidedExpertTargets()
