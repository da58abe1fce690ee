"""The ``csgmv`` LoRA backend gives the MoE path adapter-sorted segments (SGLang 0.5.11).

Why: 0.5.11's default LoRA backend, ``csgmv``, sorts a batch's tokens by adapter and describes it
in segments of that sorted order; ``FusedMoEWithLoRA`` hands those segments to the MoE LoRA path,
which reads them as positions in token order. In a mixed batch tokens get another adapter's expert
delta, base-model requests included. 0.5.12 passes per-request segments instead (PR #24007).

What the guard does: on a release whose MoE path reads the backend's segments (read from
``FusedMoEWithLoRA._get_lora_info``), a LoRA server gets ``--lora-backend triton`` in the launcher
(one warning), and a scheduler that still runs ``csgmv`` refuses to start.
"""

from __future__ import annotations

from ..catalogue import Change, Defect, Deployment, Presence, Remedy, by_marker

LAYERS = "sglang.srt.lora.layers"
WHERE = "FusedMoEWithLoRA._get_lora_info"
READS_BACKEND_SEGMENTS = "seg_indptr=batch_info.seg_indptr"

SWITCH_MESSAGE = (
    "LoRA is enabled on an SGLang whose csgmv LoRA backend gives the MoE path "
    "segments in adapter order (fixed in 0.5.12), so --lora-backend triton is used instead"
)


class CsgmvSegments(Defect):
    id = "csgmv-segments"
    title = "the csgmv backend's adapter-sorted segments put expert deltas on other requests' tokens"
    first, last = "0.5.11", "0.5.11"
    exposed = "LoRA on MoE with the default --lora-backend csgmv, mixed batches (base requests included)"
    remedy = Remedy.FIX
    does = "LoRA servers run --lora-backend triton; a scheduler on csgmv refuses to start"
    upstream = "https://github.com/sgl-project/sglang/pull/24007 (in 0.5.12)"

    def present(self) -> Presence:
        return by_marker(LAYERS, READS_BACKEND_SEGMENTS, where=WHERE, marker_is_the_fix=False,
                         present="the MoE path reads the LoRA backend's own segments (csgmv: adapter order)",
                         fixed="the MoE path gets per-request segments in token order")

    def affects(self, deployment: Deployment) -> bool | None:
        if deployment.lora is False or deployment.moe is False:
            return False
        return deployment.arg("lora_backend") == "csgmv" and (deployment.moe or None)

    def server_args_changes(self, deployment: Deployment) -> list[Change]:
        if deployment.arg("lora_backend") == "csgmv" and deployment.moe is not False:
            return [Change("lora_backend", "triton", SWITCH_MESSAGE)]
        return []

    def refusal(self, deployment: Deployment) -> str | None:
        if deployment.arg("lora_backend") != "csgmv":
            return None
        return ("--lora-backend csgmv gives the MoE path segments in adapter order on this SGLang (0.5.11): "
                "tokens get another request's expert delta. Restart with --lora-backend triton")


DEFECT = CsgmvSegments()
