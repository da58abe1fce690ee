"""``--enable-fused-moe-sum-all-reduce`` drops every expert's down LoRA (SGLang 0.5.11-0.5.23).

Why: with the flag on and top-k > 2, the down GEMM of ``_fused_moe_kernel_sequence`` adds straight
into the layer's output, and ``hooks.after_down`` then adds the down delta into an intermediate
buffer that nothing reads: the gate-up LoRA is applied, the down LoRA of every expert is not.

What the guard does: a LoRA server's arguments get the flag off in the launcher (one warning); a
scheduler that still has it on (arguments resolved before the plugin loaded) refuses to start.
"""

from __future__ import annotations

from ..catalogue import Change, Defect, Deployment, Presence, Remedy, model_settings, read, unreadable

FUSED_MOE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
FLAG = "enable_fused_moe_sum_all_reduce"

OFF_MESSAGE = (
    "LoRA is enabled, so --enable-fused-moe-sum-all-reduce is turned off: with it "
    "SGLang's down GEMM writes straight into the output and the down LoRA delta of every expert is dropped"
)


def _condition(text: str) -> str | None:
    start = text.find("use_fused_moe_sum_all_reduce = (")
    return None if start < 0 else text[start:text.find(")\n", start) + 1]


class FusedSumAllReduce(Defect):
    id = "fused-sum-all-reduce"
    title = "--enable-fused-moe-sum-all-reduce drops the down LoRA of every expert"
    first, last = "0.5.11", "0.5.23"
    exposed = "LoRA servers started with --enable-fused-moe-sum-all-reduce on a top-k > 2 MoE"
    remedy = Remedy.FIX
    does = "LoRA servers run with it off; a scheduler that still has it refuses to start"

    def present(self) -> Presence:
        text = read(FUSED_MOE, "_fused_moe_kernel_sequence")
        condition = _condition(text) if text else None
        if condition is None:
            return unreadable(FUSED_MOE, "_fused_moe_kernel_sequence (use_fused_moe_sum_all_reduce)")
        if "hooks" in condition:
            return Presence(False, "the fused sum-all-reduce is skipped for hooked calls")
        return Presence(True, "the fused sum-all-reduce takes no account of LoRA hooks")

    def affects(self, deployment: Deployment) -> bool | None:
        if deployment.lora is False or deployment.moe is False or not deployment.arg(FLAG, False):
            return False
        topk = model_settings(deployment.model).get("num_experts_per_tok") if deployment.model else None
        return None if topk is None else topk > 2

    def server_args_changes(self, deployment: Deployment) -> list[Change]:
        return [Change(FLAG, False, OFF_MESSAGE)] if deployment.arg(FLAG, False) and deployment.moe is not False else []

    def on_lora_modules(self, layers: list, deployment: Deployment) -> str | None:
        if not deployment.arg(FLAG, False):
            return None
        if all((getattr(module.base_layer, "top_k", 3) or 3) <= 2 for _, _, module in layers):
            return None
        return ("--enable-fused-moe-sum-all-reduce is on: SGLang's down GEMM then writes straight into the output "
                "and drops the down LoRA of every expert. Restart without --enable-fused-moe-sum-all-reduce")


DEFECT = FusedSumAllReduce()
