"""Entry point of SGLang's general-plugin group ``sglang.srt.plugins`` (name ``lora_tma_guard``).

SGLang's ``load_plugins()`` calls :func:`register` once in every process it starts: the launcher,
each scheduler (one per GPU rank) and the offline ``Engine``. It reads the switch and arms every
defect of the catalogue (:func:`~sglang_lora_tma_guard.serving.activate`): the launcher's step on
the server arguments and each scheduler's step after SGLang wraps its layers for LoRA
(:mod:`~sglang_lora_tma_guard.serving`), and each defect's own patches, among them the TMA guard
(:mod:`~sglang_lora_tma_guard.guard`, placed when SGLang imports its fused-MoE module) and the LoRA
MoE hook builder (:mod:`~sglang_lora_tma_guard.lora_path`: the fast path with ``=fast``, else
SGLang's own hooks with its virtual-experts path corrected).

A scheduler process runs ``load_plugins()`` before it configures logging (SGLang 0.5.16), so a line
logged while the guard installs there goes nowhere. Where that process's scheduler module is
already loaded, the plugin also asks SGLang's own hook registry to run :func:`announce` after
``configure_scheduler_process``: each rank then says, with its own log prefix (``TP0``, ``TP1``...),
what the guard does there.
"""

from __future__ import annotations

import sys

from . import guard, serving
from .log import logger
from .settings import ENV_VAR, invalid_value_message, read_switch

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
AFTER_LOGGING = f"{SCHEDULER_MODULE}.configure_scheduler_process"


def register() -> None:
    """Turn the guard on when ``SGLANG_LORA_TMA_GUARD`` says so. Never raises."""
    try:
        switch = read_switch()
        if not switch.valid:
            logger.warning(invalid_value_message(switch))
            return
        if not switch.enabled:
            logger.debug("%s is %s", ENV_VAR, switch.describe())
            return
        serving.activate(switch)
        _announce_after_scheduler_logging()
    except Exception:
        # SGLang logs and swallows plugin errors too, under its own name; say plainly whose it is.
        logger.exception(
            "activation failed; SGLang runs unguarded. Please report this "
            "with the output of `python -m sglang_lora_tma_guard.check`."
        )


def announce(result=None, *args, **kwargs):
    """One line saying what the guard does in this process (an AFTER hook: returns ``result``)."""
    state = guard.status()
    if state.installed or state.strategy is not None:
        logger.info("active in this process: SGLang %s, strategy %s: %s",
                    state.sglang_version, state.strategy.name if state.strategy else "", state.reason)
    else:
        logger.info("armed in this process (SGLang %s); it installs when SGLang "
                    "imports its fused-MoE module", state.sglang_version)
    return result


def _announce_after_scheduler_logging() -> None:
    scheduler = sys.modules.get(SCHEDULER_MODULE)
    if scheduler is None or not hasattr(scheduler, "configure_scheduler_process"):
        return  # not a scheduler process (or a release without that step): nothing is lost here
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return
    if any(hook is announce for _, hook, _ in HookRegistry._hooks.get(AFTER_LOGGING, ())):
        return
    HookRegistry.register(AFTER_LOGGING, announce, HookType.AFTER)
