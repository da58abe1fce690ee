"""The in-place MoE output races the shared expert on the other stream (SGLang 0.5.11-0.5.16).

Why: a LoRA-wrapped MoE layer runs with ``inplace=True``, so ``_fused_moe_kernel_sequence`` writes
the routed result into ``hidden_states``. When the shared expert is not fused (what the guard's
shared-expert fix makes of every LoRA server), DeepSeek-V2/V3, GLM-5 and GLM-4.x MoE blocks take
their dual-stream forward during CUDA-graph capture: the routed experts on one stream, the shared
expert reading ``hidden_states`` on the other, with no edge between that read and the in-place
write. Losing the race corrupts long generations. SGLang 0.5.17 sets
``moe_runner_config.inplace = False`` in ``FusedMoEWithLoRA.__init__`` (PR #31870).

What the guard does: the same, in each scheduler, for every MoE layer SGLang wrapped for LoRA,
before CUDA graphs are captured (the config object is the base layer's too, so base-only batches
of those layers run out of place as well, as upstream's). The package's own kernels honour
``inplace`` (the weight-TMA copy is SGLang's own code; the fallback allocates its output).
"""

from __future__ import annotations

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker, model_settings
from ..log import logger

LAYERS = "sglang.srt.lora.layers"
FIX = "moe_runner_config.inplace = False"
SHARED_EXPERT_KEYS = ("n_shared_experts", "shared_expert_intermediate_size", "num_shared_experts")


class InplaceRace(Defect):
    id = "inplace-race"
    title = "the in-place MoE output races the dual-stream shared expert"
    first, last = "0.5.11", "0.5.16"
    exposed = ("DeepSeek-V2/V3/R1, GLM-5/5.1, GLM-4.x MoE with the shared expert not fused (the guard's "
               "fusion fix) and CUDA graphs: long generations")
    remedy = Remedy.FIX
    does = "every LoRA-wrapped MoE layer runs out of place (as 0.5.17 does)"
    upstream = "https://github.com/sgl-project/sglang/pull/31870 (in 0.5.17)"

    def present(self) -> Presence:
        return by_marker(LAYERS, FIX, where="FusedMoEWithLoRA.__init__", fixed=f"FusedMoEWithLoRA.__init__ sets {FIX}",
                         present="the LoRA MoE runner writes its output into hidden_states")

    def affects(self, deployment: Deployment) -> bool | None:
        if deployment.lora is False or deployment.moe is False or deployment.arg("disable_cuda_graph"):
            return False
        if deployment.model is None:
            return None
        settings = model_settings(deployment.model)
        return any(settings.get(key) for key in SHARED_EXPERT_KEYS)

    def on_lora_modules(self, layers: list, deployment: Deployment) -> str | None:
        changed = 0
        for _, _, module in layers:
            # The base layer's config is the one its LoRA runner reads, in every release (0.5.11-0.5.12's
            # wrapper keeps no reference of its own; later ones share the same object).
            config = module.base_layer.moe_runner_config
            if config.inplace:
                config.inplace, changed = False, changed + 1
        if changed:
            logger.info("%d LoRA-wrapped MoE layer(s) run out of place (as SGLang 0.5.17 "
                        "does): their output no longer overwrites the hidden states the shared expert reads", changed)
        return None


DEFECT = InplaceRace()
