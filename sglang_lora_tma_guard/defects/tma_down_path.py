"""The TMA down path (SGLang 0.5.11-0.5.16): LoRA hooks read expert-sorted buffers as route-major.

The fix and its strategies live in :mod:`sglang_lora_tma_guard.guard`; this entry says where SGLang
has the defect (its ``_fused_moe_kernel_sequence`` does not turn TMA off for hooked calls itself,
read from its source) and arms the guard with the switch's choice (weight TMA, or ``=plain``).
"""

from __future__ import annotations

from .. import guard
from ..catalogue import Defect, Deployment, Presence, Remedy, parameters, read, unreadable
from ..inspection import HOOKS_PARAM, TARGET_MODULE, TARGET_NAME, native_guard_in


class TmaDownPath(Defect):
    id = "tma-down-path"
    title = "LoRA hooks on the TMA down path touch the wrong rows"
    first, last = "0.5.11", "0.5.16"
    exposed = "block-fp8 MoE shapes whose tuned down config says USE_TMA (Hopper: GLM-5.1/DeepSeek-V3 at TP8…)"
    remedy = Remedy.FIX
    does = ("hooked calls keep route-major buffers with TMA for the weights (=plain: TMA off, as 0.5.17); "
            "hook-less calls untouched")
    upstream = "https://github.com/sgl-project/sglang/pull/31608 (in 0.5.17)"

    def present(self) -> Presence:
        text = read(TARGET_MODULE, TARGET_NAME)
        if text is None:
            if read(TARGET_MODULE) is not None:
                return Presence(False, f"no {TARGET_NAME} (SGLang before 0.5.11)")
            return unreadable(TARGET_MODULE, TARGET_NAME)
        if HOOKS_PARAM not in parameters(text):
            return Presence(False, f"{TARGET_NAME} takes no LoRA hooks")
        if native_guard_in(text):
            return Presence(False, f"{TARGET_NAME} turns TMA off for hooked calls itself")
        return Presence(True, f"{TARGET_NAME} can run hooked calls on the TMA down path")

    def affects(self, deployment: Deployment) -> bool | None:
        return False if deployment.lora is False else None  # the model's TMA buckets: check --model-path

    def activate(self, switch) -> None:
        guard.activate(weight_tma=not switch.plain)

    def deactivate(self) -> None:
        guard.deactivate()


DEFECT = TmaDownPath()
