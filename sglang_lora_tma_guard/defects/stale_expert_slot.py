"""A reused LoRA pool slot keeps the previous adapter's expert LoRA (SGLang 0.5.11-0.5.15).

Why: ``LoRAMemoryPool.load_lora_weight_to_buffer`` zeroes a slot's MoE buffers only for the modules the
new adapter has weights for. An adapter without expert LoRA (attention only), or without ``down_proj``,
put into a slot an expert adapter held before (LRU eviction, or unload and load) is served with the old
adapter's expert deltas: its slot still has rank > 0, so every MoE LoRA path reads them. 0.5.16 zeroes
the buffer where the new adapter has no weights (``elif weights is None``).

What the guard does: zeroes the slot's MoE buffers before SGLang fills it, every time.
"""

from __future__ import annotations

import functools

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker
from ..patching import Patch

MEM_POOL = "sglang.srt.lora.mem_pool"
FIX = "elif weights is None:"


def clear_expert_slot(pool, slot: int) -> None:
    """Zero every MoE LoRA buffer of one pool slot, every layer, A and B."""
    for buffers in (pool.A_buffer, pool.B_buffer):
        for name, per_layer in buffers.items():
            if name.endswith("_moe"):
                for tensor in per_layer:
                    if tensor is not None:
                        tensor[slot].zero_()


def _make(original, engaged):
    if original is None or DEFECT.present().present is False:
        return None

    @functools.wraps(original)
    def load_lora_weight_to_buffer(self, uid, buffer_id, *args, **kwargs):
        if engaged.on and uid is not None:
            clear_expert_slot(self, buffer_id)
        return original(self, uid, buffer_id, *args, **kwargs)

    return load_lora_weight_to_buffer


PATCH = Patch("stale expert slot", MEM_POOL, "LoRAMemoryPool.load_lora_weight_to_buffer", _make)


class StaleExpertSlot(Defect):
    id = "stale-expert-slot"
    title = "a reused pool slot keeps the previous adapter's expert LoRA"
    first, last = "0.5.11", "0.5.15"
    exposed = ("LoRA on MoE with more adapters than --max-loras-per-batch, or unload and load, when some "
               "adapters lack expert LoRA (attention-only) or its down_proj")
    remedy = Remedy.FIX
    does = "a slot's MoE buffers are zeroed before SGLang fills it"

    def present(self) -> Presence:
        return by_marker(MEM_POOL, FIX, where="LoRAMemoryPool.load_lora_weight_to_buffer",
                         fixed="the pool zeroes a module the new adapter lacks (elif weights is None)",
                         present="the pool zeroes only the modules the new adapter has")

    def affects(self, deployment: Deployment) -> bool | None:
        return False if deployment.lora is False or deployment.moe is False else None

    def diagnose(self, adapter) -> str | None:
        from ..adapters import EXPERT, names

        expert = [n for n in names(adapter) if EXPERT.search(n) or ".experts." in n]
        if expert and any("down_proj" in n for n in expert):
            return None
        lacks = "expert LoRA" if not expert else "an expert down_proj"
        return (f"it has no {lacks}: put in a pool slot an expert adapter held before, it is served with that "
                "adapter's expert LoRA")

    def activate(self, switch) -> None:
        PATCH.activate()

    def deactivate(self) -> None:
        PATCH.deactivate()


DEFECT = StaleExpertSlot()
