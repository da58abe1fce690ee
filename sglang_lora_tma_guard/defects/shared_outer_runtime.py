"""A shared-outer adapter loaded at runtime into a per-expert pool lands on expert 0 (every release).

Why: the pool's expert layout (per expert, or ``--experts-shared-outer-loras``: one gate-up A and one
down B for all experts) is decided once, at start-up, from the first adapters. ``/load_lora_adapter``
does not check a later adapter against it: a shared-outer adapter in a per-expert pool is written to
expert 0 only, silently; the other way round, the first batch fails in the pool's loader.

What the guard does: refuses, at load, an adapter whose expert layout is not the pool's, saying which.
"""

from __future__ import annotations

from ..adapters import is_shared_outer
from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker

LORA_MANAGER = "sglang.srt.lora.lora_manager"
LAYOUT = {True: "shared-outer (one gate-up A and one down B for every expert)", False: "per-expert"}


class SharedOuterRuntime(Defect):
    id = "shared-outer-at-runtime"
    title = "an adapter of the other expert layout loaded at runtime: expert 0 only, or a crash"
    first, last = "0.5.11", "0.5.23"
    exposed = "/load_lora_adapter of a shared-outer adapter into a per-expert pool, or the other way"
    remedy = Remedy.REFUSE
    refused_at = "load"
    does = "such an adapter is refused at load, naming both layouts (the server keeps serving the others)"

    def present(self) -> Presence:
        return by_marker(LORA_MANAGER, "shared_outer", where="LoRAManager.validate_new_adapter",
                         fixed="validate_new_adapter checks the expert layout",
                         present="validate_new_adapter does not check the expert layout")

    def on_adapter(self, manager, adapter, deployment: Deployment) -> str | None:
        if getattr(manager, "memory_pool", None) is None:
            return None  # at start-up the pool's layout is decided from these adapters
        pool, own = bool(getattr(manager, "experts_shared_outer_loras", False)), is_shared_outer(adapter)
        if own is None or own == pool:
            return None
        return (f"its expert LoRA is {LAYOUT[own]} while this server's pool holds {LAYOUT[pool]} adapters (decided "
                "at start-up); SGLang would " + ("put it on expert 0 only" if own else "fail at its first batch")
                + ". Serve it from a server started with such adapters"
                + (" (--experts-shared-outer-loras)" if own else ""))


DEFECT = SharedOuterRuntime()
