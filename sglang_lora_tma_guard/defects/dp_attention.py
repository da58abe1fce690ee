"""DP attention with LoRA on MoE: the LoRA mapping of one rank on every rank's tokens (SGLang 0.5.11-0.5.20).

Why: with ``--enable-dp-attention`` the MoE runs on the tokens of all DP ranks gathered into one
buffer, while the LoRA MoE path maps adapters to tokens from this rank's own batch: each rank's
adapters land on the first tokens of the gathered buffer (mostly rank 0's), base-model requests
included, and under CUDA graphs the alignment writes past its buffers. 0.5.21 gathers the LoRA
batch info across DP ranks (``LoRABatchLayout.TP_GLOBAL``) and refuses ``csgmv`` under DP attention.

What the guard does: refuses to start such a server, naming the flag and the release that fixes it.
"""

from __future__ import annotations

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker

LAYERS = "sglang.srt.lora.layers"


class DpAttention(Defect):
    id = "dp-attention"
    title = "--enable-dp-attention applies one rank's LoRA mapping to every rank's gathered tokens"
    first, last = "0.5.11", "0.5.20"
    exposed = "LoRA on MoE with --enable-dp-attention and --dp > 1 (DeepSeek-V3/R1, GLM-5 deployments)"
    remedy = Remedy.REFUSE
    does = "the server refuses to start; SGLang 0.5.21+ with --lora-backend triton serves it"

    def present(self) -> Presence:
        return by_marker(LAYERS, "TP_GLOBAL", fixed="the MoE LoRA path reads the DP-gathered batch info (TP_GLOBAL)",
                         present="the MoE LoRA path reads this rank's own batch info")

    def affects(self, deployment: Deployment) -> bool | None:
        if (deployment.lora is False or deployment.moe is False or not deployment.arg("enable_dp_attention")
                or (deployment.arg("dp_size", 1) or 1) <= 1):
            return False
        return deployment.moe

    def refusal(self, deployment: Deployment) -> str | None:
        return ("--enable-dp-attention with LoRA on MoE puts each DP rank's expert deltas on other ranks' tokens "
                "(base requests included) on this SGLang. Drop --enable-dp-attention, or upgrade to SGLang 0.5.21 "
                "or later and pass --lora-backend triton")


DEFECT = DpAttention()
