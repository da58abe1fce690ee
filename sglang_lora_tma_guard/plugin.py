"""Entry point of SGLang's general-plugin group ``sglang.srt.plugins`` (name ``lora_tma_guard``).

SGLang's ``load_plugins()`` calls :func:`register` once in every process it starts: the launcher,
each scheduler (one per GPU rank) and the offline ``Engine``. It reads the switch and arms the
guard; the patch itself happens when SGLang imports its fused-MoE module.
"""

from __future__ import annotations

import logging

from . import guard
from .settings import ENV_VAR, invalid_value_message, read_switch

logger = logging.getLogger("sglang_lora_tma_guard")


def register() -> None:
    """Turn the guard on when ``SGLANG_LORA_TMA_GUARD`` says so. Never raises."""
    try:
        switch = read_switch()
        if not switch.valid:
            logger.warning(invalid_value_message(switch))
            return
        if not switch.enabled:
            logger.debug("sglang-lora-tma-guard: %s is %s", ENV_VAR, switch.describe())
            return
        guard.activate(weight_tma=not switch.plain)
    except Exception:
        # SGLang logs and swallows plugin errors too, under its own name; say plainly whose it is.
        logger.exception(
            "sglang-lora-tma-guard: activation failed; SGLang runs unguarded. Please report this "
            "with the output of `python -m sglang_lora_tma_guard.check`."
        )
