"""peft's per-module ``rank_pattern`` and ``alpha_pattern`` (every release).

Why: SGLang reads an adapter's ``r`` and ``lora_alpha`` and nothing per module. A module that
``alpha_pattern`` gives another alpha is served at the adapter's scale, silently; a module that
``rank_pattern`` gives another rank has tensors of that rank, which fail the pool's shape check when a
batch first uses the adapter: the scheduler dies, and the server with it.

What the guard does, on the adapter's raw weights before SGLang normalises them: each module's B is
multiplied by its own peft scaling over the one SGLang will apply (``alpha_m / r_m`` over the adapter's,
rsLoRA's square root included), and a module of a smaller rank is padded with zero rows of A and zero
columns of B up to ``r`` (they add nothing). A module whose rank exceeds ``r`` does not fit SGLang's
slots: that adapter is refused at load, with the module named.
"""

from __future__ import annotations

import math

from ..adapters import LORA, before_normalize, layer_weights, module_of, pattern_value, peft_config
from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker


def apply_patterns(adapter) -> int:
    """Fold each module's peft scaling into its B and pad smaller ranks to ``r``; the modules changed."""
    import torch

    config = peft_config(adapter)
    if not (config.get("rank_pattern") or config.get("alpha_pattern")):
        return 0
    r, changed = config["r"], 0
    for weights in layer_weights(adapter):
        for a_name in [name for name in weights if name.endswith("lora_A.weight")]:
            b_name = a_name.replace("lora_A", "lora_B")
            if b_name not in weights:
                continue
            module = module_of(a_name)
            a, b = weights[a_name], weights[b_name]
            rank = a.shape[-2]
            alpha = pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
            own = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
            if rank > r:
                continue  # refused by on_adapter: it does not fit SGLang's slots
            if own != adapter.scaling:
                b = b * (own / adapter.scaling)
            if rank < r:
                a = torch.cat([a, a.new_zeros(*a.shape[:-2], r - rank, a.shape[-1])], dim=-2)
                b = torch.cat([b, b.new_zeros(*b.shape[:-1], r - rank)], dim=-1)
            if a is not weights[a_name] or b is not weights[b_name]:
                weights[a_name], weights[b_name], changed = a, b, changed + 1
    return changed


PATCH = before_normalize("LoRA rank and alpha patterns", apply_patterns,
                         "LoRA adapter %s: rank_pattern / alpha_pattern applied to %d module(s) (each its own "
                         "scaling, smaller ranks padded to r)", lambda: DEFECT.present().present)


class LoraPatterns(Defect):
    id = "lora-patterns"
    title = "peft's rank_pattern / alpha_pattern: ignored (alpha) or a crash at the first batch (rank)"
    first, last = "0.5.11", "0.5.23"
    exposed = "adapters saved with rank_pattern or alpha_pattern (the server dies at their first batch)"
    remedy = Remedy.FIX
    does = ("each module gets its own scaling and its rank padded to r; a module above r is refused at "
            "load, named")

    def present(self) -> Presence:
        return by_marker(LORA, "rank_pattern", fixed="LoRAAdapter reads rank_pattern",
                         present="LoRAAdapter reads r and lora_alpha only")

    def on_adapter(self, manager, adapter, deployment: Deployment) -> str | None:
        config = peft_config(adapter)
        too_big = {key: rank for key, rank in (config.get("rank_pattern") or {}).items() if rank > config["r"]}
        if not too_big:
            return None
        key, rank = next(iter(too_big.items()))
        return (f"its rank_pattern gives {key!r} rank {rank}, above the adapter's r={config['r']}, which SGLang's pool "
                "slots cannot hold; save the adapter with r at least its largest rank")

    def diagnose(self, adapter) -> str | None:
        config = peft_config(adapter)
        said = [what for key, what in (("alpha_pattern", "its alpha_pattern ignored (those modules at the adapter's "
                                                         "scale)"),
                                       ("rank_pattern", "its rank_pattern ignored: the first batch that uses it fails "
                                                        "the pool's shape check (the scheduler dies)")) if config.get(key)]
        return "; ".join(said) or None

    def activate(self, switch) -> None:
        PATCH.activate()

    def deactivate(self) -> None:
        PATCH.deactivate()


DEFECT = LoraPatterns()
