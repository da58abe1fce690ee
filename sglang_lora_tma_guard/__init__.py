"""Stop LoRA adapters on SGLang's Mixture-of-Experts models from being served wrong, silently.

Usage::

    pip install sglang-lora-tma-guard
    export SGLANG_LORA_TMA_GUARD=1
    python -m sglang.launch_server --model-path ... --enable-lora --lora-paths ...
    python -m sglang_lora_tma_guard.check

SGLang loads the plugin itself, in every process, through its ``sglang.srt.plugins`` entry point.
It answers every defect of LoRA on MoE in SGLang 0.5.11-0.5.23 in the catalogue
(:mod:`~sglang_lora_tma_guard.defects`, switched on by :func:`~sglang_lora_tma_guard.serving.activate`),
fixing it or refusing the deployment before it serves. Among them, the TMA down path
(:mod:`~sglang_lora_tma_guard.guard`): a call of ``_fused_moe_kernel_sequence`` carrying LoRA hooks
runs with route-major buffers and TMA for the weights only (``=plain``: TMA off, SGLang 0.5.17's own
fix); calls without hooks are left untouched. A fused shared expert
(:mod:`~sglang_lora_tma_guard.fusion`): a server that serves LoRA runs with shared-experts fusion
off, or its schedulers refuse to start. SGLang's ``--lora-use-virtual-experts`` path on gated MoE
(0.5.11-0.5.22) is corrected; ``=fast`` builds every LoRA MoE batch's hooks on this package's own
virtual-experts kernels (:mod:`~sglang_lora_tma_guard.lora_path`).

From Python::

    import sglang_lora_tma_guard as guard
    guard.activate()     # now, or as soon as SGLang's fused-MoE module is imported
    guard.status()       # GuardStatus(active=True, installed=True, inert=False, strategy=<Strategy.WEIGHT_TMA...>, ...)
    guard.deactivate()   # the original function object is back (or, under another wrapper, the guard inert)
"""

from .guard import GuardStatus, activate, deactivate, status
from .inspection import Inspection, Strategy, inspect_target

__version__ = "0.5.0"

__all__ = [
    "GuardStatus",
    "Inspection",
    "Strategy",
    "activate",
    "deactivate",
    "inspect_target",
    "status",
    "__version__",
]
