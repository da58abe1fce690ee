"""Keep SGLang's LoRA hooks off the TMA down path of its fused-MoE kernels.

Usage::

    pip install sglang-lora-tma-guard
    export SGLANG_LORA_TMA_GUARD=1
    python -m sglang.launch_server --model-path ... --enable-lora --lora-paths ...
    python -m sglang_lora_tma_guard.check

SGLang loads the guard itself, in every process, through its ``sglang.srt.plugins`` entry point.
On SGLang 0.5.11-0.5.16 it wraps ``_fused_moe_kernel_sequence`` so that a call carrying LoRA hooks
runs with ``down_moe_use_tma=False``, as SGLang 0.5.17 does on its own; calls without hooks and
every other SGLang version are left untouched.

From Python::

    import sglang_lora_tma_guard as guard
    guard.activate()     # now, or as soon as SGLang's fused-MoE module is imported
    guard.status()       # GuardStatus(active=True, installed=True, strategy='flag', ...)
    guard.deactivate()   # the original function object is back
"""

from .guard import GuardStatus, activate, deactivate, status
from .inspection import Inspection, Strategy, inspect_target

__version__ = "0.3.0"

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
