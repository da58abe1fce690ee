"""Expert LoRA where the router weight scales the input (Llama-4; SGLang 0.5.11-0.5.23).

Why: with ``apply_router_weight_on_input`` the base gate-up GEMM multiplies its output by the
router weight and the down GEMM does not; SGLang's LoRA hooks ignore the flag: the gate-up delta
is added without the weight and the down delta with it. Right is ``W(wx) + BA(wx)``: every expert
LoRA delta of such a layer is off by the router weight, in both projections.

What the guard does: a scheduler whose LoRA-wrapped MoE layers route this way refuses to start,
and says to serve those adapters without expert targets.
"""

from __future__ import annotations

from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker

RUNNERS = "sglang.srt.lora.lora_moe_runners"
ARCHITECTURES = ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")


class RouterWeightOnInput(Defect):
    id = "router-weight-on-input"
    title = "expert LoRA on a router-weight-on-input MoE (Llama-4) is scaled in the wrong projection"
    first, last = "0.5.11", "0.5.23"
    exposed = "Llama-4 (Scout, Maverick) with adapters on the experts"
    remedy = Remedy.REFUSE
    does = "a scheduler with such a LoRA-wrapped MoE layer refuses to start (serve those adapters without expert targets)"

    def present(self) -> Presence:
        return by_marker(RUNNERS, "apply_router_weight_on_input",
                         fixed="the LoRA MoE hooks read apply_router_weight_on_input",
                         present="the LoRA MoE hooks ignore apply_router_weight_on_input")

    def affects(self, deployment: Deployment) -> bool | None:
        return deployment.lora_moe_of(ARCHITECTURES)

    def refusal(self, deployment: Deployment) -> str | None:
        return None  # whether adapters target the experts is known in the scheduler only

    def on_lora_modules(self, layers: list, deployment: Deployment) -> str | None:
        scaled = [layer_id for layer_id, _, module in layers
                  if getattr(module.base_layer.moe_runner_config, "apply_router_weight_on_input", False)]
        if not scaled:
            return None
        return (f"{len(scaled)} LoRA-wrapped MoE layer(s) apply the router weight to their input (Llama-4); "
                "SGLang's LoRA hooks then scale the gate-up delta too little and the down delta too much. Serve "
                "these adapters without expert targets (drop gate_up_proj/down_proj from the adapters and from "
                "--lora-target-modules)")


DEFECT = RouterWeightOnInput()
