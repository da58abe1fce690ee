"""The one environment switch, ``SGLANG_LORA_TMA_GUARD``, read in one place, into two choices.

``1`` / ``true`` / ``on`` turn the guard on with its defaults; ``plain`` and ``fast`` each change one
choice: how hooked MoE calls are kept off SGLang's TMA down path (:class:`TmaFix`), and whose hooks
compute the LoRA deltas of a MoE batch (:class:`LoRAMoEPath`). Every other fix of the catalogue has no
choice to make: it is on whenever the guard is.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

ENV_VAR = "SGLANG_LORA_TMA_GUARD"


class TmaFix(str, enum.Enum):
    WEIGHT_TMA = "weight-tma"
    """Hooked calls keep route-major buffers and take the weights by TMA (the default)."""
    PLAIN = "plain"
    """Hooked calls run with ``down_moe_use_tma=False``, as SGLang 0.5.17 does (``=plain``)."""


class LoRAMoEPath(str, enum.Enum):
    SGLANG = "sglang"
    """SGLang's own LoRA MoE hooks (its virtual-experts path corrected where it is wrong)."""
    FAST = "fast"
    """This package's virtual-experts LoRA MoE kernels for every batch they cover (``=fast``)."""


ON = {"1": (TmaFix.WEIGHT_TMA, LoRAMoEPath.SGLANG), "true": (TmaFix.WEIGHT_TMA, LoRAMoEPath.SGLANG),
      "on": (TmaFix.WEIGHT_TMA, LoRAMoEPath.SGLANG), "plain": (TmaFix.PLAIN, LoRAMoEPath.SGLANG),
      "fast": (TmaFix.WEIGHT_TMA, LoRAMoEPath.FAST)}
OFF = ("0", "false", "off", "")


@dataclass(frozen=True)
class Switch:
    """What the environment asks for, and the raw ``value`` it was read from."""

    enabled: bool
    value: str | None
    valid: bool
    tma: TmaFix = TmaFix.WEIGHT_TMA
    lora_moe: LoRAMoEPath = LoRAMoEPath.SGLANG

    @property
    def plain(self) -> bool:
        return self.enabled and self.tma is TmaFix.PLAIN

    @property
    def fast(self) -> bool:
        return self.enabled and self.lora_moe is LoRAMoEPath.FAST

    def state(self) -> str:
        """``on``, ``on, plain fix``, ``on, fast LoRA MoE path``, ``off`` or ``off, not understood``."""
        if not self.valid:
            return "off, not understood"
        if not self.enabled:
            return "off"
        return "on" + (", plain fix" if self.plain else "") + (", fast LoRA MoE path" if self.fast else "")

    def describe(self) -> str:
        """The value and what it means, for the plugin's log line and ``check``."""
        return "unset (guard off)" if self.value is None else f"{self.value!r} (guard {self.state()})"


def read_switch(environ=None) -> Switch:
    """Parse ``SGLANG_LORA_TMA_GUARD``; case and surrounding blanks do not matter."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR)
    if raw is None:
        return Switch(enabled=False, value=None, valid=True)
    value = raw.strip().lower()
    if value in ON:
        tma, lora_moe = ON[value]
        return Switch(enabled=True, value=raw, valid=True, tma=tma, lora_moe=lora_moe)
    return Switch(enabled=False, value=raw, valid=value in OFF)


def invalid_value_message(switch: Switch) -> str:
    return (
        f"{ENV_VAR}={switch.value!r} is not understood; use one of 1, true, on to turn the guard on, plain for the "
        f"plain fix without weight TMA, fast for the guard with the fast LoRA MoE path, or {', '.join(OFF[:3])} "
        "(or leave it unset) to keep it off. The guard stays off."
    )
