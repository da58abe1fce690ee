"""PEFT >= 0.18 adapters on fused expert tensors (``target_parameters``): no loader in SGLang (every release).

Why: PEFT 0.18 writes LoRA for MoE models whose experts are one 3-D tensor (transformers 5 keeps
``mlp.experts.gate_up_proj`` and ``down_proj`` fused) as a LoRA on the parameter itself, keys
``...mlp.experts.base_layer.lora_A.weight`` / ``...mlp.experts.lora_A.weight``, without an expert index.
SGLang has no loader for that layout: the names match no target, it warns, and the first batch that
uses the adapter fails in the pool's loader (upstream #27381, closed unmerged).

What the guard does: refuses such an adapter at load, saying what to write instead.
"""

from __future__ import annotations

from ..adapters import FUSED_EXPERT_PARAMETER, module_of, names, peft_config
from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker

LORA_CONFIG = "sglang.srt.lora.lora_config"


class PeftTargetParameters(Defect):
    id = "peft-target-parameters"
    title = "PEFT >= 0.18 target_parameters expert adapters: accepted, then a crash at the first batch"
    first, last = "0.5.11", "0.5.23"
    exposed = "adapters peft wrote with target_parameters on fused expert tensors"
    remedy = Remedy.REFUSE
    refused_at = "load"
    does = "such an adapter is refused at load (the server keeps serving the others)"
    upstream = "https://github.com/sgl-project/sglang/pull/27381 (closed, not merged)"

    def present(self) -> Presence:
        return by_marker(LORA_CONFIG, "target_parameters", fixed="SGLang reads target_parameters",
                         present="SGLang has no loader for target_parameters")

    def on_adapter(self, manager, adapter, deployment: Deployment) -> str | None:
        fused = sorted({module_of(name) for name in names(adapter) if FUSED_EXPERT_PARAMETER.search(name)})
        if not fused and not peft_config(adapter).get("target_parameters"):
            return None
        where = f" (first: {fused[0]})" if fused else ""
        return (f"its expert LoRA is on fused expert tensors (peft target_parameters{where}), which SGLang cannot "
                "load and would crash on at the first batch; save it with target_modules gate_proj, up_proj and "
                "down_proj on each expert (peft < 0.18, or a per-expert conversion)")


    def diagnose(self, adapter) -> str | None:
        return self.on_adapter(None, adapter, Deployment())


DEFECT = PeftTargetParameters()
