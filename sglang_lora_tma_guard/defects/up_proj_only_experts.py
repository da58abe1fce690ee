"""Expert LoRA on ``up_proj`` alone crashes the scheduler at its first batch (every release).

Why: SGLang stacks an expert's ``gate_proj`` and ``up_proj`` LoRA into ``gate_up_proj`` starting from the
gate (a gate-only adapter gets a zero up half), and keeps an ``up_proj`` without a gate as it is. That
name matches no buffer of a gated MoE: SGLang accepts the adapter, and the first batch that uses it
raises in the pool's loader.

What the guard does: gives such an expert a zero gate half before SGLang stacks it, as SGLang does for
the up half of a gate-only adapter: the up delta is served, the gate delta is zero, as trained.
"""

from __future__ import annotations

from ..adapters import EXPERT, LORA, before_normalize, layer_weights
from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker


def give_gates(adapter) -> int:
    """A zero ``gate_proj`` for every expert ``up_proj`` without one (gated MoE only); how many."""
    non_gated = getattr(adapter, "_is_non_gated_moe_weight", lambda name: False)
    added = 0
    for weights in layer_weights(adapter):
        for name in [n for n in weights if EXPERT.search(n) and ".up_proj." in n]:
            gate = name.replace(".up_proj.", ".gate_proj.")
            if gate not in weights and not non_gated(name):
                weights[gate] = weights[name].new_zeros(weights[name].shape)
                added += 1
    return added


PATCH = before_normalize("up_proj-only expert LoRA", give_gates,
                         "LoRA adapter %s has expert LoRA on up_proj alone: %d zero gate_proj tensor(s) (A and B) "
                         "added so that SGLang stacks it into gate_up_proj", lambda: DEFECT.present().present)


class UpProjOnlyExperts(Defect):
    id = "up-proj-only-experts"
    title = "expert LoRA on up_proj alone: accepted, then the scheduler dies at its first batch"
    first, last = "0.5.11", "0.5.23"
    exposed = "adapters whose expert targets are up_proj without gate_proj (the whole server goes down)"
    remedy = Remedy.FIX
    does = "a zero gate half is added before SGLang stacks gate and up, so the up delta is served"

    def present(self) -> Presence:
        return by_marker(LORA, 'elif "up_proj" in', where="LoRAAdapter.normalize_gate_up_proj",
                         fixed="SGLang stacks an up_proj without a gate_proj",
                         present="SGLang keeps an up_proj without a gate_proj as it is")

    def affects(self, deployment: Deployment) -> bool | None:
        return False if deployment.lora is False or deployment.moe is False else None

    def diagnose(self, adapter) -> str | None:
        from ..adapters import names

        orphans = [n for n in names(adapter) if EXPERT.search(n) and ".up_proj." in n and "lora_A" in n]
        if not orphans:
            return None
        return (f"{len(orphans)} expert up_proj LoRA without a gate_proj: the first batch that uses it fails in the "
                "pool's loader (the scheduler dies)")

    def activate(self, switch) -> None:
        PATCH.activate()

    def deactivate(self) -> None:
        PATCH.deactivate()


DEFECT = UpProjOnlyExperts()
