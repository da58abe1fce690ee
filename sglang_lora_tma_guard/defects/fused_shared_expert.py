"""LoRA on a fused shared expert: SGLang's shared-experts fusion is turned off for LoRA servers.

Why: on DeepSeek-V3/R1, GLM-5/5.1, every GLM-4.5/4.6/4.7 and a few others, SGLang (0.5.11-0.5.23,
NVIDIA sm >= 80, no expert parallelism) folds the shared expert into the routed ones as expert
number ``routed`` and routes every token to it. Its LoRA MoE path does not know: the per-expert LoRA
buffers hold the routed experts only, and the ``fused_moe_lora`` kernel indexes them with the shared
expert's id, which lands on the *next* adapter slot's expert 0 (or past the buffer). The adapter's own
shared-expert LoRA is dropped by the loader without a word. Every adapter request is then wrong,
most from its first token; base-model requests are right. With ``--disable-shared-experts-fusion``
the shared expert is a plain MLP with its own LoRA wrappers, and every request is right.

What the guard does: the launcher sets ``disable_shared_experts_fusion`` on a LoRA server's arguments
before SGLang resolves them, so every scheduler receives it; each scheduler refuses to start if a
LoRA-wrapped MoE layer still has a fused shared expert (a launcher without the plugin). An explicit
``--enforce-shared-experts-fusion`` (or ``--enable-waterfill``, which forces it) is the user's word:
left as it is, with a loud warning in the launcher and in each scheduler.
"""

from __future__ import annotations

from ..catalogue import (
    Change,
    Defect,
    Deployment,
    Presence,
    Remedy,
    architecture,
    by_marker,
    model_settings,
    routed_experts,
)
from ..log import logger

FLAG = "disable_shared_experts_fusion"
LAYERS = "sglang.srt.lora.layers"

DISABLED_MESSAGE = (
    "LoRA is enabled, so shared-experts fusion is turned off "
    "(as --disable-shared-experts-fusion): SGLang's LoRA MoE kernels read another adapter's "
    "weights for a fused shared expert and drop the adapter's own shared-expert LoRA"
)
FORCED_MESSAGE = (
    "LoRA is enabled with shared-experts fusion forced by {why}: left as asked. "
    "LoRA ADAPTERS WILL BE WRONG on models whose shared expert SGLang fuses (DeepSeek-V3/R1, GLM-4.5+, "
    "GLM-5): their requests read another adapter's weights for the shared expert. Remove {why} "
    "to serve them correctly."
)


class FusedSharedExpertWithLoRA(RuntimeError):
    """Kept for callers of 0.4.0; the guard now raises :class:`~sglang_lora_tma_guard.catalogue.RefusedDeployment`."""


def fusion_forced_by(server_args) -> str | None:
    """The flag by which the user forces fusion, or None."""
    if getattr(server_args, "enforce_shared_experts_fusion", False):
        return "--enforce-shared-experts-fusion"
    if getattr(server_args, "enable_waterfill", False):
        return "--enable-waterfill"
    return None


class FusedSharedExpert(Defect):
    id = "fused-shared-expert"
    title = "LoRA on a fused shared expert reads another adapter's weights"
    first, last = "0.5.11", "0.5.23"
    exposed = ("DeepSeek-V3/R1, GLM-5/5.1, GLM-4.5/4.6/4.7, GLM-4.5V, MiniMax-M3, Qwen3-Next: shared expert "
               "fused by default (NVIDIA sm ≥ 80, no EP)")
    remedy = Remedy.FIX
    does = ("LoRA servers run with shared-experts fusion off (--disable-shared-experts-fusion); a scheduler "
            "that still has a fused LoRA layer refuses to start")
    upstream = "https://github.com/sgl-project/sglang/pull/40240 (open)"

    def present(self) -> Presence:
        return by_marker(LAYERS, "num_fused_shared_experts", where="FusedMoEWithLoRA",
                         fixed="FusedMoEWithLoRA handles num_fused_shared_experts",
                         present="FusedMoEWithLoRA ignores num_fused_shared_experts")

    def affects(self, deployment: Deployment) -> bool | None:
        from ..exposure import fused_shared_experts

        if deployment.model is None or not deployment.lora:
            return None if deployment.lora is not False else False
        if deployment.arg(FLAG, False) and not fusion_forced_by(deployment.args):
            return False
        if (deployment.arg("ep_size", 1) or 1) > 1:
            return False
        routed = routed_experts(deployment.model) or 0
        return fused_shared_experts(architecture(deployment.model), routed, model_settings(deployment.model)) > 0

    def server_args_changes(self, deployment: Deployment) -> list[Change]:
        forced = fusion_forced_by(deployment.args)
        if forced:
            logger.warning(FORCED_MESSAGE.format(why=forced))
            return []
        return [Change(FLAG, True, DISABLED_MESSAGE)]

    def on_lora_modules(self, layers: list, deployment: Deployment) -> str | None:
        fused = [(layer_id, name, module.base_layer) for layer_id, name, module in layers
                 if (getattr(module.base_layer, "num_fused_shared_experts", 0) or 0) > 0]
        if not fused:
            return None
        forced = fusion_forced_by(deployment.args)
        if forced:
            logger.warning(FORCED_MESSAGE.format(why=forced))
            return None
        layer_id, name, base = fused[0]
        return (f"{len(fused)} LoRA-wrapped MoE layer(s) have a fused shared expert (first: layer {layer_id} "
                f"{name}, {getattr(base, 'num_experts', '?')} experts of which {base.num_fused_shared_experts} "
                "fused shared); SGLang's LoRA MoE kernels would read another adapter's weights there and every "
                "adapter request would be wrong. Restart with --disable-shared-experts-fusion (the guard sets it "
                "by itself when it is loaded in the launcher before the server arguments are resolved)")


DEFECT = FusedSharedExpert()
