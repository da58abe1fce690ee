"""rsLoRA adapters served at the wrong scale (every release; upstream #40835, open).

Why: SGLang scales every adapter by ``lora_alpha / r``; peft scales an rsLoRA adapter
(``use_rslora: true``) by ``lora_alpha / sqrt(r)``. The same factor is folded into the expert B weights
when a pool slot is filled and applied to the dense layers in their kernels, so an rsLoRA adapter of
rank 16 is served 4x too weak, everywhere.

What the guard does: sets the adapter's scaling to ``lora_alpha / sqrt(r)`` when SGLang builds it,
before either use reads it (one line per adapter in the log).
"""

from __future__ import annotations

import functools
import math

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker
from ..log import logger
from ..patching import Patch

LORA = "sglang.srt.lora.lora"


def peft_scaling(config: dict) -> float:
    """peft's scaling of an adapter: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _make(original, engaged):
    if original is None or DEFECT.present().present is False:
        return None

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = getattr(self.config, "hf_config", None) or {}
        if engaged.on and config.get("use_rslora"):
            sglang, self.scaling = self.scaling, peft_scaling(config)
            logger.info("LoRA adapter %s uses rsLoRA: scaling %.4g (lora_alpha / sqrt(r)), "
                        "not SGLang's %.4g", getattr(self, "uid", "?"), self.scaling, sglang)

    return __init__


PATCH = Patch("rsLoRA scaling", LORA, "LoRAAdapter.__init__", _make)


class RsLoraScaling(Defect):
    id = "rslora-scaling"
    title = "rsLoRA adapters are scaled lora_alpha / r, not lora_alpha / sqrt(r)"
    first, last = "0.5.11", "0.5.23"
    exposed = "every adapter trained with use_rslora (rank 16: served 4x too weak), dense and expert layers"
    remedy = Remedy.FIX
    does = "such adapters get lora_alpha / sqrt(r), in the dense kernels and folded into the expert B alike"
    upstream = "https://github.com/sgl-project/sglang/issues/40835 (open)"

    def present(self) -> Presence:
        return by_marker(LORA, "use_rslora", fixed="LoRAAdapter reads use_rslora",
                         present="LoRAAdapter scales lora_alpha / r whatever use_rslora says")

    def affects(self, deployment: Deployment) -> bool | None:
        return False if deployment.lora is False else None  # an adapter's config says (check --adapter)

    def diagnose(self, adapter) -> str | None:
        from ..adapters import peft_config

        config = peft_config(adapter)
        if not config.get("use_rslora"):
            return None
        sglang, peft = config["lora_alpha"] / config["r"], peft_scaling(config)
        return f"scaled {sglang:.4g} (lora_alpha / r) instead of peft's {peft:.4g}: {peft / sglang:.2f}x too weak"

    def activate(self, switch) -> None:
        PATCH.activate()

    def deactivate(self) -> None:
        PATCH.deactivate()


DEFECT = RsLoraScaling()
