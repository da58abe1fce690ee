"""Expert LoRA under EPLB or redundant experts: buffers by logical id, kernels by physical id (0.5.11-0.5.23).

Why: SGLang's LoRA memory pool sizes and keys its per-expert buffers by the config's *logical*
experts (``global id - ep_rank * local``), while with ``--enable-eplb``, an ``--init-expert-location``
other than ``trivial``, ``--ep-num-redundant-experts`` or a dispatch algorithm the MoE kernels see
*physical* expert ids: an expert's tokens get another expert's LoRA delta, or the next adapter
slot's weights, and EPLB's rebalancing moves base weights but never the LoRA buffers.

What the guard does: refuses to start such a server with expert parallelism > 1.
"""

from __future__ import annotations

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker

MEM_POOL = "sglang.srt.lora.mem_pool"


def physical_placement(deployment: Deployment) -> list[str]:
    """The flags that make the MoE kernels see physical expert ids."""
    flags = []
    if deployment.arg("enable_eplb"):
        flags.append("--enable-eplb")
    if deployment.arg("init_expert_location") not in (None, "trivial"):
        flags.append("--init-expert-location")
    if (deployment.arg("ep_num_redundant_experts", 0) or 0) > 0:
        flags.append("--ep-num-redundant-experts")
    if deployment.arg("ep_dispatch_algorithm"):
        flags.append("--ep-dispatch-algorithm")
    return flags


class EplbPhysicalExperts(Defect):
    id = "eplb-physical-experts"
    title = "EPLB / redundant experts: LoRA buffers keyed by logical expert, kernels see physical ids"
    first, last = "0.5.11", "0.5.23"
    exposed = "LoRA on MoE at --ep > 1 with --enable-eplb, --init-expert-location, --ep-num-redundant-experts"
    remedy = Remedy.REFUSE
    does = "the server refuses to start; expert parallelism without those flags is right"

    def present(self) -> Presence:
        return by_marker(MEM_POOL, "physical", fixed="the LoRA memory pool maps physical expert ids",
                         present="the LoRA memory pool keys expert buffers by logical id")

    def affects(self, deployment: Deployment) -> bool | None:
        if (deployment.lora is False or deployment.moe is False or (deployment.arg("ep_size", 1) or 1) <= 1
                or not physical_placement(deployment)):
            return False
        return deployment.moe

    def refusal(self, deployment: Deployment) -> str | None:
        flags = ", ".join(physical_placement(deployment))
        return (f"{flags} at --ep {deployment.arg('ep_size')} make the MoE kernels see physical expert ids while "
                "SGLang's LoRA buffers are keyed by logical expert: tokens get another expert's LoRA. Drop "
                f"{flags} (expert parallelism without them is right)")


DEFECT = EplbPhysicalExperts()
