"""The package's one logger: every line it logs starts with ``sglang-lora-tma-guard:``, said once, here."""

from __future__ import annotations

import logging

PREFIX = "sglang-lora-tma-guard: "


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return PREFIX + str(msg), kwargs


logger = _Prefixed(logging.getLogger("sglang_lora_tma_guard"), {})
