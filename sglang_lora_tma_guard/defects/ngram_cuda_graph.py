"""NGRAM speculative decoding with MoE LoRA and CUDA graphs (SGLang 0.5.11-0.5.18).

Why: the MoE LoRA CUDA-graph buffers are sized in requests, while the verify graphs of speculative
decoding carry ``requests x draft tokens``: 0.5.13-0.5.18 crash at capture, 0.5.11-0.5.12 write
past the buffers. NGRAM is the one speculative algorithm these releases allow with LoRA. 0.5.19
sizes the buffers by draft tokens.

What the guard does: refuses to start such a server, saying what to change.
"""

from __future__ import annotations

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker

LORA_MANAGER = "sglang.srt.lora.lora_manager"


class NgramCudaGraph(Defect):
    id = "ngram-cuda-graph"
    title = "NGRAM speculative decoding: MoE LoRA graph buffers sized in requests, verify runs draft tokens"
    first, last = "0.5.11", "0.5.18"
    exposed = "LoRA on MoE with --speculative-algorithm NGRAM and CUDA graphs on"
    remedy = Remedy.REFUSE
    does = "the server refuses to start; --disable-cuda-graph, no NGRAM, or SGLang 0.5.19+ serve it"

    def present(self) -> Presence:
        return by_marker(LORA_MANAGER, "speculative_num_draft_tokens",
                         fixed="the LoRA CUDA-graph buffers are sized by draft tokens",
                         present="the LoRA CUDA-graph buffers are sized in requests")

    def affects(self, deployment: Deployment) -> bool | None:
        if (deployment.lora is False or deployment.moe is False or deployment.arg("disable_cuda_graph")
                or str(deployment.arg("speculative_algorithm") or "").upper() != "NGRAM"):
            return False
        return deployment.moe

    def refusal(self, deployment: Deployment) -> str | None:
        return ("--speculative-algorithm NGRAM with LoRA on MoE and CUDA graphs: SGLang sizes the MoE LoRA graph "
                "buffers in requests while verify runs draft tokens (a crash at capture, or writes past them). Pass "
                "--disable-cuda-graph, drop NGRAM, or upgrade to SGLang 0.5.19 or later")


DEFECT = NgramCudaGraph()
