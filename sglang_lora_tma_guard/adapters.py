"""A LoRA adapter as SGLang reads it: its weights by name, per decoder layer, and its peft config.

What the adapter entries of the catalogue (``defects/*``) read, at runtime from SGLang's own
``LoRAAdapter`` (``adapter.layers[i].weights``, ``adapter.config.hf_config``) and in ``check --adapter``
from the same object built on the CPU. Names are peft's: ``base_model.model.<module>.lora_A.weight``.
The entries that fix an adapter's weights do it in one seam, :func:`before_normalize`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from .log import logger
from .patching import Patch

LORA = "sglang.srt.lora.lora"

PEFT_PREFIX = "base_model.model."
EXPERT = re.compile(r"\.experts\.\d+\.")
FUSED_EXPERT_PARAMETER = re.compile(r"\.experts\.(base_layer\.)?lora_[AB]\b")
"""PEFT >= 0.18's ``target_parameters`` on fused 3-D expert tensors: no expert index in the name."""


def layer_weights(adapter):
    """Each decoder layer's ``{name: tensor}`` of an SGLang ``LoRAAdapter`` (empty where none)."""
    return [layer.weights for layer in getattr(adapter, "layers", None) or ()]


def names(adapter) -> list[str]:
    return [name for weights in layer_weights(adapter) for name in weights]


def module_of(name: str) -> str:
    """``base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight`` -> ``model.layers.0.mlp.experts.3.up_proj``."""
    module = name.removeprefix(PEFT_PREFIX)
    for suffix in (".lora_A.weight", ".lora_B.weight", ".lora_A", ".lora_B"):
        if module.endswith(suffix):
            return module[: -len(suffix)]
    return module


def peft_config(adapter) -> dict:
    return dict(getattr(getattr(adapter, "config", None), "hf_config", None) or {})


def pattern_value(patterns: dict | None, module: str, default):
    """peft's per-module value (``rank_pattern``, ``alpha_pattern``): the first key, in order, that matches
    the end of the module's name as a regular expression (peft's ``get_pattern_key``), else ``default``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def is_shared_outer(adapter) -> bool | None:
    """The adapter's expert layout as SGLang detects it (``_detect_shared_outer_loras``): True for one
    gate-up A shared by all experts (a 3-D A with expert dimension 1), False for per-expert weights, None
    without expert LoRA."""
    for weights in layer_weights(adapter):
        for name, weight in weights.items():
            if "gate_up_proj" not in name or "lora_A" not in name:
                continue
            if weight.dim() == 3:
                return weight.shape[0] == 1
            if EXPERT.search(name):
                return False
    return None


def before_normalize(name: str, step: Callable[[object], int], said: str, present: Callable[[], bool | None]) -> Patch:
    """A patch on SGLang's ``LoRAAdapter._normalize_weights`` that runs ``step(adapter)`` on the raw
    weights first, while the guard is engaged, and logs ``said % (adapter, count)`` when ``step`` changed
    ``count`` things. Not placed where ``present()`` says the release has no such defect."""

    def make(original, engaged):
        if original is None or present() is False:
            return None

        @functools.wraps(original)
        def _normalize_weights(self, *args, **kwargs):
            if engaged.on:
                changed = step(self)
                if changed:
                    logger.info(said, getattr(self, "uid", "?"), changed)
            return original(self, *args, **kwargs)

        return _normalize_weights

    return Patch(name, LORA, "LoRAAdapter._normalize_weights", make)
