"""The package's one logger: every line it logs starts with ``sglang-lora-tma-guard:``, said once, here."""

from __future__ import annotations

import logging

PREFIX = "sglang-lora-tma-guard: "


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return PREFIX + str(msg), kwargs


logger = _Prefixed(logging.getLogger("sglang_lora_tma_guard"), {})

said: set[str] = set()
"""What :func:`info_once` has said in this process."""


def info_once(message: str) -> None:
    """``message`` at INFO level, the first time only (a per-batch decision logged once a process)."""
    if message not in said:
        said.add(message)
        logger.info("%s (logged once)", message)
