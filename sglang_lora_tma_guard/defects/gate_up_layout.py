"""MiniMax-M3 / Kimi-K3 with LoRA: the gate and up halves read in the wrong layout (SGLang 0.5.16-0.5.23).

These models build ``FusedMoE(gemm1_alpha=..., gate_up_interleaved=False)``: gate-up rows ``[gate | up]``,
an alpha-SwiGLU between the GEMMs. Once SGLang wraps such a layer for LoRA, two things go wrong:

- the LoRA runner (``TritonRunnerCore.run``) calls ``_fused_moe_kernel_sequence`` without
  ``gate_up_interleaved``, whose default is True: the activation takes even columns as gate and odd
  ones as up (GPT-OSS's layout) on a ``[gate | up]`` buffer, for every request of the layer,
  base-model requests included;
- ``FusedMoEWithLoRA`` decides ``_uses_interleaved_gate_up`` from ``gemm1_alpha`` alone, so it
  interleaves the adapters' gate-up B rows for a base that is not interleaved, while the hook adds
  B's first half to the gate columns and its second half to the up columns.

What the guard does, in each scheduler whose LoRA-wrapped MoE layers are of this kind: sets
``_uses_interleaved_gate_up = False`` on them (B is sliced when a batch loads an adapter, later),
and places two patches: ``TritonRunnerCore.run`` says, for the length of the call, that its layer is
not interleaved, and ``_fused_moe_kernel_sequence`` passes ``gate_up_interleaved=False`` on for such
calls. Both patches exist only in schedulers that serve such a model.
"""

from __future__ import annotations

import contextvars
import functools

from ..catalogue import Defect, Deployment, Presence, Remedy, parameters, read, unreadable
from ..inspection import TARGET_MODULE, TARGET_NAME
from ..log import logger
from ..patching import Patch

LAYERS = "sglang.srt.lora.layers"
TRITON_RUNNER = "sglang.srt.layers.moe.moe_runner.triton"
MODELS = ("sglang.srt.models.minimax_m3", "sglang.srt.models.kimi_k3")
ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM")
PARAM = "gate_up_interleaved"

_not_interleaved: contextvars.ContextVar[bool] = contextvars.ContextVar("gate_up_not_interleaved", default=False)


def runner_drops_the_layout() -> bool | None:
    """Does ``TritonRunnerCore.run`` call the sequence without ``gate_up_interleaved``?"""
    text = read(TRITON_RUNNER, "TritonRunnerCore.run")
    if text is None:
        return None
    call = text.find("= _fused_moe_kernel_sequence(")
    if call < 0:
        return None
    return PARAM not in text[call:]


def lora_b_ignores_the_layout() -> bool | None:
    """Does ``FusedMoEWithLoRA`` interleave gate-up B whenever ``gemm1_alpha`` is set?"""
    text = read(LAYERS, "FusedMoEWithLoRA.__init__")
    if text is None:
        return None
    start = text.find("self._uses_interleaved_gate_up =")
    if start < 0:
        return False
    return PARAM not in text[start:text.find("\n\n", start)]


def _sequence_takes_the_layout() -> bool:
    text = read(TARGET_MODULE, TARGET_NAME)
    return text is not None and PARAM in parameters(text)


def not_interleaved_layers(layers: list) -> list:
    return [module for _, _, module in layers
            if getattr(module.base_layer.moe_runner_config, "gemm1_alpha", None) is not None
            and getattr(module.base_layer.moe_runner_config, PARAM, True) is False]


def _make_run(original, engaged):
    if original is None or not runner_drops_the_layout():
        return None

    @functools.wraps(original)
    def run(self, *args, **kwargs):
        if not engaged.on or getattr(self.config, PARAM, True) is not False:
            return original(self, *args, **kwargs)
        token = _not_interleaved.set(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _not_interleaved.reset(token)

    return run


def _make_sequence(original, engaged):
    if original is None or not _sequence_takes_the_layout():
        return None

    @functools.wraps(original)
    def _fused_moe_kernel_sequence(*args, **kwargs):
        if engaged.on and _not_interleaved.get() and PARAM not in kwargs:
            kwargs[PARAM] = False
        return original(*args, **kwargs)

    return _fused_moe_kernel_sequence


RUNNER_PATCH = Patch("gate-up layout (runner)", TRITON_RUNNER, "TritonRunnerCore.run", _make_run)
SEQUENCE_PATCH = Patch("gate-up layout (sequence)", TARGET_MODULE, TARGET_NAME, _make_sequence)


class GateUpLayout(Defect):
    id = "gate-up-layout"
    title = "MiniMax-M3 / Kimi-K3 with LoRA: the activation and the LoRA B read gate/up interleaved"
    first, last = "0.5.16", "0.5.23"
    exposed = "MiniMax-M3 (0.5.16+) and Kimi-K3 (0.5.17+) LoRA servers: every request, base included"
    remedy = Remedy.FIX
    does = ("their LoRA runner keeps gate_up_interleaved=False, and their adapters' gate-up B keeps the gate "
            "rows before the up rows")

    def present(self) -> Presence:
        models = [m.rsplit(".", 1)[1] for m in MODELS if "gate_up_interleaved=False" in (read(m) or "")]
        if not models:
            return Presence(False, "no model builds a non-interleaved gate-up with gemm1_alpha")
        runner, lora_b = runner_drops_the_layout(), lora_b_ignores_the_layout()
        if runner is None or lora_b is None:
            return unreadable(TRITON_RUNNER if runner is None else LAYERS)
        wrong = [what for what, bad in (("the LoRA runner drops gate_up_interleaved", runner),
                                        ("LoRA B interleaved whenever gemm1_alpha is set", lora_b)) if bad]
        if not wrong:
            return Presence(False, "the LoRA runner and LoRA B follow gate_up_interleaved")
        return Presence(True, f"{' and '.join(wrong)} ({', '.join(models)})")

    def affects(self, deployment: Deployment) -> bool | None:
        return deployment.lora_moe_of(ARCHITECTURES)

    def on_lora_modules(self, layers: list, deployment: Deployment) -> str | None:
        affected = not_interleaved_layers(layers)
        if not affected:
            return None
        if lora_b_ignores_the_layout():
            for module in affected:
                module._uses_interleaved_gate_up = False
        if runner_drops_the_layout():
            RUNNER_PATCH.activate()
            SEQUENCE_PATCH.activate()
            if not (RUNNER_PATCH.status().working and SEQUENCE_PATCH.status().working):
                return ("the gate-up layout of this model's LoRA MoE layers could not be corrected "
                        f"({RUNNER_PATCH.status().note or SEQUENCE_PATCH.status().note}); SGLang would serve "
                        "every request wrong")
        logger.info("%d LoRA-wrapped MoE layer(s) with a non-interleaved gate-up "
                    "(gemm1_alpha): the LoRA runner keeps gate_up_interleaved=False and the adapters' gate-up B "
                    "keeps [gate | up]", len(affected))
        return None

    def deactivate(self) -> None:
        SEQUENCE_PATCH.deactivate()
        RUNNER_PATCH.deactivate()


DEFECT = GateUpLayout()
