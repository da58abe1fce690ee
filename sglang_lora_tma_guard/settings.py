"""The one environment switch, ``SGLANG_LORA_TMA_GUARD``, read in one place."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("sglang_lora_tma_guard")

ENV_VAR = "SGLANG_LORA_TMA_GUARD"
ON_VALUES = ("1", "true", "on")
PLAIN_VALUES = ("plain",)
"""On, with the plain fix only (``down_moe_use_tma=False``, as SGLang 0.5.17 does): no weight TMA."""
FAST_VALUES = ("fast",)
"""On, and LoRA MoE deltas on this package's virtual-experts path (:mod:`~sglang_lora_tma_guard.lora_path`)."""
OFF_VALUES = ("0", "false", "off")


@dataclass(frozen=True)
class Switch:
    """What the environment asks for: ``enabled``, ``plain``, ``fast``, and the raw ``value`` it was read from."""

    enabled: bool
    value: str | None
    valid: bool
    plain: bool = False
    fast: bool = False

    def describe(self) -> str:
        if self.value is None:
            return "unset (guard off)"
        if not self.valid:
            return f"{self.value!r} is not a recognised value (guard off)"
        state = ("on, plain fix" if self.plain else "on, fast LoRA MoE path" if self.fast else "on") if self.enabled else "off"
        return f"{self.value!r} (guard {state})"


def read_switch(environ=None) -> Switch:
    """Parse ``SGLANG_LORA_TMA_GUARD``; case and surrounding blanks do not matter."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR)
    if raw is None:
        return Switch(enabled=False, value=None, valid=True)
    value = raw.strip().lower()
    if value in ON_VALUES:
        return Switch(enabled=True, value=raw, valid=True)
    if value in PLAIN_VALUES:
        return Switch(enabled=True, value=raw, valid=True, plain=True)
    if value in FAST_VALUES:
        return Switch(enabled=True, value=raw, valid=True, fast=True)
    if value in OFF_VALUES or value == "":
        return Switch(enabled=False, value=raw, valid=True)
    return Switch(enabled=False, value=raw, valid=False)


def invalid_value_message(switch: Switch) -> str:
    return (
        f"sglang-lora-tma-guard: {ENV_VAR}={switch.value!r} is not understood; "
        f"use one of {', '.join(ON_VALUES)} to turn the guard on, {PLAIN_VALUES[0]} for the plain fix "
        f"without weight TMA, {FAST_VALUES[0]} for the guard with the fast LoRA MoE path, or "
        f"{', '.join(OFF_VALUES)} (or leave it unset) to keep it off. The guard stays off."
    )
