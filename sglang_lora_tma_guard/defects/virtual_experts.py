"""SGLang's ``--lora-use-virtual-experts`` path on gated MoE (0.5.11-0.5.22): the up half from the gate half's A.

The corrected hooks (and the fast path of ``=fast``) live in :mod:`sglang_lora_tma_guard.lora_path`;
this entry says where SGLang has the defect (no ``a_output_slices`` in its LoRA MoE runners, read
from their source) and arms that module in the switch's mode.
"""

from __future__ import annotations

from .. import lora_path
from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker


class VirtualExperts(Defect):
    id = "virtual-experts-up-half"
    title = "--lora-use-virtual-experts computes the up half of the gate-up delta from the gate half's A"
    first, last = "0.5.11", "0.5.22"
    exposed = "servers started with --lora-use-virtual-experts on a gated (SwiGLU) MoE"
    remedy = Remedy.FIX
    does = "such batches get this package's hooks (each half its own A); =fast: every covered batch"

    def present(self) -> Presence:
        return by_marker(lora_path.MODULE, "a_output_slices",
                         fixed="the runners give each half of a gated gate-up its own A (a_output_slices)",
                         present="one shrink over both halves' A, no a_output_slices")

    def affects(self, deployment: Deployment) -> bool | None:
        if deployment.lora is False or deployment.arg("lora_use_virtual_experts") is False:
            return False
        return True if deployment.arg("lora_use_virtual_experts") else None

    def activate(self, switch) -> None:
        lora_path.activate(lora_path.Mode.FAST if switch.fast else lora_path.Mode.CORRECT)

    def deactivate(self) -> None:
        lora_path.deactivate()


DEFECT = VirtualExperts()
